"""General Agent environment: a calculator, unit conversion and a key-value fact table.

Pair it with a string-match reward on the final answer (``{factory: string_match, extractor:
boxed, answer_column: answer}``); the tools only help the model get there.

* ``calculator(expression)`` evaluates arithmetic safely: the expression is parsed with
  :mod:`ast` and only numbers, ``+ - * / // % **``, parentheses and a few functions
  (:data:`FUNCTIONS`) and constants (``pi``, ``e``) are evaluated; no names, attributes or calls
  of anything else. Results are kept small (at most :data:`MAX_DIGITS` digits) so an expression
  like ``9**9**9`` is refused instead of hanging the trainer.
* ``convert_units(value, from_unit, to_unit)`` converts within one dimension (:data:`UNITS`:
  length, mass, time, volume, speed, data, temperature).
* ``lookup_fact(key)`` reads a JSON object of facts (``{"capital of Veloria": "Marrowgate"}``);
  keys match case- and whitespace-insensitively; a miss lists the closest keys.

Example:
    >>> env = GeneralEnvironment()
    >>> env.calculator("(3 + 4) * 2.5"), env.convert_units(1.5, "km", "m"), env.convert_units(100, "C", "F")
    ('17.5', '1500 m', '212 F')
"""

from __future__ import annotations

import ast
import difflib
import json
import math
import operator
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dna_factory.agents.environment import Environment, tool
from dna_factory.errors import DnaConfigError
from rewards.options import nearest

DEFAULT_FACTS = "data/agents/facts.json"
MAX_EXPRESSION_CHARS = 500
MAX_DIGITS = 10_000
"""Largest magnitude of any intermediate result, in decimal digits."""

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
FUNCTIONS = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "log10": math.log10,
    "exp": math.exp,
    "min": min,
    "max": max,
}
CONSTANTS = {"pi": math.pi, "e": math.e}


def _digits(value: float | int) -> float:
    """log10 of |value| (0 for 0), without converting huge integers to float."""
    if not value:
        return 0.0
    if isinstance(value, int) and value.bit_length() > 1000:  # too big for float
        return value.bit_length() * math.log10(2)
    return math.log10(abs(value))


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.Name) and node.id in CONSTANTS:
        return CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if (
            isinstance(node.op, ast.Pow)
            and left not in (0, 1, -1)
            and abs(right) * _digits(left) > MAX_DIGITS
        ):
            raise ValueError(f"the result of {left} ** {right} is too large (over {MAX_DIGITS} digits)")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex):
            raise ValueError("the result is a complex number")
        if _digits(result) > MAX_DIGITS:
            raise ValueError(f"the result is too large (over {MAX_DIGITS} digits)")
        return result
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS:
        if node.keywords:
            raise ValueError(f"{node.func.id}() takes positional arguments only")
        return FUNCTIONS[node.func.id](*(_evaluate(arg) for arg in node.args))
    raise ValueError(
        f"{ast.unparse(node)!r} is not allowed; use numbers, + - * / // % **, parentheses, "
        f"{', '.join(FUNCTIONS)} and {', '.join(CONSTANTS)}"
    )


def format_number(value: float | int) -> str:
    """A result as the model should read it: integers exactly, floats to 12 significant digits.

    Example:
        >>> format_number(0.1 + 0.2), format_number(2.0), format_number(10**20)
        ('0.3', '2', '100000000000000000000')
    """
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise ValueError("the result is not a finite number")
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def evaluate(expression: str) -> str:
    """Evaluate an arithmetic expression safely (see the module docstring).

    Raises:
        ValueError: For anything but allowed arithmetic, a syntax error, division by zero or an
            over-large result.

    Example:
        >>> evaluate("2 ** 10 - sqrt(16)"), evaluate("7 // 2"), evaluate("7 / 2")
        ('1020', '3', '3.5')
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"invalid expression: {exc.msg}") from None
    try:
        return format_number(_evaluate(tree))
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large") from None


# unit -> (dimension, factor to the dimension's base unit); temperature is affine and handled apart
UNITS: dict[str, tuple[str, float]] = {
    "m": ("length", 1.0),
    "km": ("length", 1000.0),
    "cm": ("length", 0.01),
    "mm": ("length", 0.001),
    "mi": ("length", 1609.344),
    "yd": ("length", 0.9144),
    "ft": ("length", 0.3048),
    "in": ("length", 0.0254),
    "kg": ("mass", 1.0),
    "g": ("mass", 0.001),
    "mg": ("mass", 1e-6),
    "t": ("mass", 1000.0),
    "lb": ("mass", 0.45359237),
    "oz": ("mass", 0.028349523125),
    "s": ("time", 1.0),
    "min": ("time", 60.0),
    "h": ("time", 3600.0),
    "day": ("time", 86400.0),
    "week": ("time", 604800.0),
    "l": ("volume", 1.0),
    "ml": ("volume", 0.001),
    "m3": ("volume", 1000.0),
    "gal": ("volume", 3.785411784),
    "m/s": ("speed", 1.0),
    "km/h": ("speed", 1000.0 / 3600.0),
    "mph": ("speed", 1609.344 / 3600.0),
    "b": ("data", 1.0),
    "kb": ("data", 1e3),
    "mb": ("data", 1e6),
    "gb": ("data", 1e9),
    "kib": ("data", 1024.0),
    "mib": ("data", 1024.0**2),
    "gib": ("data", 1024.0**3),
}
TEMPERATURES = ("C", "F", "K")
ALIASES = {
    "meter": "m", "meters": "m", "metre": "m", "metres": "m", "kilometer": "km", "kilometers": "km",
    "kilometre": "km", "kilometres": "km", "centimeter": "cm", "centimeters": "cm", "millimeter": "mm",
    "millimeters": "mm", "mile": "mi", "miles": "mi", "yard": "yd", "yards": "yd", "foot": "ft", "feet": "ft",
    "inch": "in", "inches": "in", "kilogram": "kg", "kilograms": "kg", "gram": "g", "grams": "g",
    "milligram": "mg", "milligrams": "mg", "tonne": "t", "tonnes": "t", "pound": "lb", "pounds": "lb",
    "lbs": "lb", "ounce": "oz", "ounces": "oz", "second": "s", "seconds": "s", "sec": "s", "minute": "min",
    "minutes": "min", "hour": "h", "hours": "h", "hr": "h", "days": "day", "d": "day", "weeks": "week",
    "liter": "l", "liters": "l", "litre": "l", "litres": "l", "milliliter": "ml", "milliliters": "ml",
    "gallon": "gal", "gallons": "gal", "kph": "km/h", "kmh": "km/h", "mps": "m/s", "byte": "b", "bytes": "b",
    "celsius": "C", "c": "C", "fahrenheit": "F", "f": "F", "kelvin": "K", "k": "K",
}  # fmt: skip


def _unit(name: str) -> str:
    key = name.strip()
    if key in UNITS or key in TEMPERATURES:
        return key
    lowered = key.lower().replace("°", "").strip()
    if lowered in UNITS:
        return lowered
    if lowered in ALIASES:
        return ALIASES[lowered]
    known = sorted(UNITS) + list(TEMPERATURES)
    raise ValueError(
        f"unknown unit {name!r}{_unit_hint(lowered, known + list(ALIASES))}; known units: {', '.join(known)}"
    )


def _unit_hint(word: str, choices: list[str]) -> str:
    """The tool's own wording (it answers the model, not the user): `` (did you mean 'km'?)``."""
    match = nearest(word, choices)
    return f" (did you mean {match!r}?)" if match else ""


def _to_kelvin(value: float, unit: str) -> float:
    return {"C": value + 273.15, "F": (value - 32.0) * 5.0 / 9.0 + 273.15, "K": value}[unit]


def _from_kelvin(value: float, unit: str) -> float:
    return {"C": value - 273.15, "F": (value - 273.15) * 9.0 / 5.0 + 32.0, "K": value}[unit]


def convert(value: float, from_unit: str, to_unit: str) -> float:
    """``value`` in ``from_unit`` expressed in ``to_unit`` (same dimension).

    Example:
        >>> convert(1, "mi", "km"), convert(-40, "C", "F")
        (1.609344, -40.0)
    """
    source, target = _unit(from_unit), _unit(to_unit)
    if source in TEMPERATURES or target in TEMPERATURES:
        if not (source in TEMPERATURES and target in TEMPERATURES):
            raise ValueError(
                f"cannot convert {from_unit!r} to {to_unit!r}: only temperatures convert to temperatures"
            )
        return _from_kelvin(_to_kelvin(float(value), source), target)
    (dim_from, factor_from), (dim_to, factor_to) = UNITS[source], UNITS[target]
    if dim_from != dim_to:
        raise ValueError(f"cannot convert {from_unit!r} ({dim_from}) to {to_unit!r} ({dim_to})")
    return float(value) * factor_from / factor_to


def _normalise_key(key: str) -> str:
    return " ".join(str(key).lower().split())


class GeneralEnvironment(Environment):
    """Calculator, unit conversion and fact lookup.

    Args:
        facts: A JSON file holding one object of fact name -> value (values become strings).
        max_suggestions: How many close keys a failed lookup lists.
    """

    def __init__(self, facts: str = DEFAULT_FACTS, max_suggestions: int = 3) -> None:
        self.facts = {_normalise_key(k): str(v) for k, v in _read_facts(facts).items()}
        self.max_suggestions = max_suggestions

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        _read_facts(options.get("facts", DEFAULT_FACTS))
        if options.get("max_suggestions", 3) < 0:
            raise DnaConfigError("environment_options.max_suggestions must be 0 or more. Fix the value.")

    @tool
    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return the result.

        Args:
            expression: Numbers with + - * / // % ** and parentheses, e.g. "(12.5 + 7) * 3 / 2";
                sqrt, abs, round, floor, ceil, log, log10, exp, min, max, pi and e are available.
        """
        return evaluate(expression)

    @tool
    def convert_units(self, value: float, from_unit: str, to_unit: str) -> str:
        """Convert a quantity from one unit to another of the same kind.

        Args:
            value: The amount to convert, e.g. 3.5.
            from_unit: Its unit, e.g. "mi", "kg", "h", "l", "km/h", "GB" or "C".
            to_unit: The unit wanted, of the same kind, e.g. "km", "lb", "min", "gal", "mph", "MiB" or "F".
        """
        if isinstance(value, str):
            value = float(evaluate(value))
        return f"{format_number(round(convert(value, from_unit, to_unit), 9))} {to_unit}"

    @tool
    def lookup_fact(self, key: str) -> str:
        """Look up a fact by its name in the fact table.

        Args:
            key: The fact's name, e.g. "capital of Veloria" or "population of Marrowgate".
        """
        wanted = _normalise_key(key)
        if wanted in self.facts:
            return self.facts[wanted]
        close = difflib.get_close_matches(wanted, list(self.facts), n=self.max_suggestions, cutoff=0.5)
        hint = f" Close keys: {'; '.join(close)}." if close else ""
        return f"No fact named {key!r}.{hint}"


def _read_facts(path: str) -> dict[str, Any]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise DnaConfigError(
            f"Fact file {path!r} (environment_options.facts) does not exist. Point it at a JSON object of "
            "fact name -> value, e.g. data/agents/facts.json (python scripts/make_agent_data.py writes it)."
        )
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DnaConfigError(f"Fact file {path!r} is not valid JSON ({exc}). Fix the file.") from None
    if not isinstance(data, dict) or not data:
        raise DnaConfigError(f"Fact file {path!r} must hold one non-empty JSON object of name -> value.")
    return data
