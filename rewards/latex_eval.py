r"""A small evaluator of LaTeX answers for :mod:`rewards.math_equivalence`: exact where it can be.

:func:`evaluate` reads one canonical answer (``\\frac{3}{4}``, ``2\\sqrt{2}``, ``1.2\\times10^{3}``, ``x^2+1``,
``\\binom{5}{2}``, ``12.5%``, ``\\cos x``) and returns its value — a ``Fraction`` for rational
arithmetic (so two different numbers never compare equal), a complex number where ``\\sqrt``, ``\\pi``,
a function or a non-integer power appears — at :data:`POINTS` when it has variables. What it cannot read
raises :class:`Unreadable` inside and gives None outside.
"""

from __future__ import annotations

import cmath
import math
import re
from fractions import Fraction
from functools import lru_cache

REL_TOL = 1e-13
"""Tolerance (relative, and absolute near 0) for values that are not exact (``\\sqrt``, ``\\pi``, variables):
rounding of a few floating-point operations, far below any decimal a model writes."""
POINTS = (
    (0.7311, 1.3179, 0.5123, 1.9021, -0.3827, 2.4495),
    (1.6180, 0.4142, 2.2361, -1.2247, 0.9239, 3.1623),
    (-0.8660, 2.7183, 1.1412, 0.6931, 1.7321, -2.0801),
)
"""Where expressions with variables are compared: up to six variables, in alphabetical order, take these values."""

_TOKEN = re.compile(
    r"\d+\.?\d*|\.\d+"  # a number
    r"|\\(?:arcsin|arccos|arctan|sin|cos|tan|cot|sec|csc|ln|log|exp)(?![a-z]*\{)|\\[a-z]+"  # a command
    r"|[a-z]"  # a variable
    r"|[-+*/^(){}\[\]%!]"  # an operator or a bracket
)
_MUL = {"\\cdot", "\\times", "\\ast"}
_DIV = {"\\div"}
_GREEK = {
    "\\alpha", "\\beta", "\\gamma", "\\delta", "\\theta", "\\lambda", "\\mu", "\\phi", "\\omega", "\\sigma", "\\tau",
}  # fmt: skip


_FUNCTIONS = {
    "\\sin": cmath.sin, "\\cos": cmath.cos, "\\tan": cmath.tan, "\\cot": lambda x: 1 / cmath.tan(x),
    "\\sec": lambda x: 1 / cmath.cos(x), "\\csc": lambda x: 1 / cmath.sin(x), "\\ln": cmath.log,
    "\\log": cmath.log, "\\exp": cmath.exp, "\\arcsin": cmath.asin, "\\arccos": cmath.acos,
    "\\arctan": cmath.atan,
}  # fmt: skip
"""Functions the evaluator reads (radians, natural log), as sympy and math_verify read them."""


_TIMES = frozenset({"*", *_MUL})
_OVER = frozenset({"/", *_DIV})
_NO_POSTFIX = frozenset({"+", "-", "*", "/", ")", "}", "]", "(", "{", *_MUL, *_DIV})
"""Tokens after an atom that are none of ``!``, ``%``, ``^``: :meth:`_Parser.power` has nothing more to read."""
_ATOM_STARTS = frozenset({"(", "{", "\\frac", "\\binom", "\\sqrt", "\\pi", *_GREEK, *_FUNCTIONS})


class Unreadable(Exception):
    """The evaluator cannot read this expression: the symbolic fallback decides."""


@lru_cache(maxsize=65536)
def tokenize(s: str) -> tuple[str, ...]:
    tokens = _TOKEN.findall(s)
    if sum(map(len, tokens)) != len(s):  # findall skipped what no token matches: find where
        i = 0
        while (m := _TOKEN.match(s, i)) is not None:
            i = m.end()
        raise Unreadable(s[i:])
    return tuple(tokens)


class _Parser:
    """A recursive-descent evaluator of one LaTeX expression at one point (variables -> values)."""

    def __init__(self, tokens: tuple[str, ...], point: dict[str, complex]):
        self.t, self.i, self.point = (
            (*tokens, None),
            0,
            point,
        )  # None ends the tokens: self.t[self.i] is the next

    def take(self, expected: str | None = None) -> str:
        token = self.t[self.i]
        if token is None or (expected is not None and token != expected):
            raise Unreadable(f"expected {expected!r}")
        self.i += 1
        return token

    def parse(self):
        value = self.sum()
        if self.t[self.i] is not None:
            raise Unreadable(f"left over {self.t[self.i]!r}")
        return value

    def sum(self):
        value = self.product()
        t = self.t
        while (op := t[self.i]) == "+" or op == "-":
            self.i += 1
            right = self.product()
            value = value + right if op == "+" else value - right
        return value

    def product(self):
        value = self.unary()
        t = self.t
        while True:
            token = t[self.i]
            if token is None:
                return value
            if token in _TIMES:
                self.i += 1
                value = value * self.unary()
            elif token in _OVER:
                self.i += 1
                right = self.unary()
                if right == 0:
                    raise Unreadable("division by zero")
                value = value / right
            elif (  # _starts_atom, inline: implicit multiplication (2x, 2\pi, (1)(2))
                token in _ATOM_STARTS
                or (first := token[0]).isdigit()
                or first == "."
                or (len(token) == 1 and token.isalpha())
            ):
                value = value * self.power()
            else:
                return value

    @staticmethod
    def _starts_atom(token: str) -> bool:
        return (
            token in _ATOM_STARTS
            or token[0].isdigit()
            or token[0] == "."
            or (len(token) == 1 and token.isalpha())
        )

    def unary(self):
        token = self.t[self.i]
        if token == "-":
            self.i += 1
            return -self.unary()
        if token == "+":
            self.i += 1
            return self.unary()
        return self.power()

    def power(self):
        base = self.atom()
        if (token := self.t[self.i]) is None or token in _NO_POSTFIX:
            return base  # no factorial, percent or power follows (nearly always)
        if self.t[self.i] == "!":
            self.take()
            if not (isinstance(base, Fraction) and base.denominator == 1 and 0 <= base <= 5000):
                raise Unreadable("factorial")
            base = Fraction(math.factorial(int(base)))
        if self.t[self.i] == "%":
            self.take()
            base = base / 100 if isinstance(base, Fraction) else base / 100.0
        if self.t[self.i] == "^":
            self.take()
            exponent = self.group() if self.t[self.i] == "{" else self.unary_atom()
            return _pow(base, exponent)
        return base

    def unary_atom(self):
        if self.t[self.i] == "-":
            self.take()
            return -self.atom()
        return self.atom()

    def argument(self):
        """A function's argument: the atoms that follow it without an operator (``\\sin 2x`` is sin(2x))."""
        value = self.power()
        while (token := self.t[self.i]) is not None and self._starts_atom(token) and token not in _FUNCTIONS:
            value = value * self.power()
        return value

    def group(self):
        self.take("{")
        value = self.sum()
        self.take("}")
        return value

    def atom(self):
        token = self.t[self.i]
        if token is None:
            raise Unreadable("expected None")
        self.i += 1
        if (first := token[0]).isdigit() or first == ".":
            return _decimal(token)
        if token in ("(", "["):
            value = self.sum()
            self.take(")" if token == "(" else "]")
            return value
        if token == "{":
            value = self.sum()
            self.take("}")
            return value
        if token == "\\frac":
            numerator = self.group()
            denominator = self.group()
            if denominator == 0:
                raise Unreadable("division by zero")
            return numerator / denominator
        if token == "\\binom":
            n, k = self.group(), self.group()
            if not (
                isinstance(n, Fraction) and isinstance(k, Fraction) and n.denominator == k.denominator == 1
            ):
                raise Unreadable("binom")
            if not 0 <= k <= n <= 10000:
                raise Unreadable("binom")
            return Fraction(math.comb(int(n), int(k)))
        if token == "\\sqrt":
            if self.t[self.i] == "[":
                self.take("[")
                degree = self.sum()
                self.take("]")
                return _pow(self.group(), 1 / degree if not isinstance(degree, Fraction) else 1 / degree)
            return _pow(self.group(), Fraction(1, 2))
        if token == "\\pi":
            return cmath.pi
        if token in _FUNCTIONS:
            exponent = None
            if self.t[self.i] == "^":  # \sin^2 x
                self.take()
                exponent = self.group() if self.t[self.i] == "{" else self.atom()
            value = complex(_FUNCTIONS[token](complex(self.argument())))
            return value if exponent is None else _pow(value, exponent)
        if token == "e":
            return cmath.e  # Euler's number, as sympy and math_verify read it
        if token == "\\infty":
            raise Unreadable("infinity")
        if token in _GREEK or (len(token) == 1 and token.isalpha()):
            if token not in self.point:
                raise Unreadable(f"no value for {token}")
            return self.point[token]
        raise Unreadable(token)


MAX_EXACT_POWER = 64
"""The largest root exponent (``8^{2/3}``) tried exactly."""
MAX_EXACT_BITS = 1 << 13
"""An integer power whose result has at most about this many bits is computed exactly (``3^{2007}``: 3,200
bits; more, summed over many terms, costs seconds); a larger one in floating point, where it overflows (unreadable). Floating point would call
``2^{100}+1`` and ``2^{100}`` the same number."""


def _pow(base, exponent):
    if isinstance(base, Fraction) and isinstance(exponent, Fraction):
        bits = max(base.numerator.bit_length(), base.denominator.bit_length())
        if (
            exponent.denominator == 1
            and abs(exponent.numerator) * bits <= MAX_EXACT_BITS
            and not (base == 0 and exponent < 0)
        ):
            return base**exponent.numerator
        if exponent.denominator > 1 and abs(exponent.numerator) <= MAX_EXACT_POWER:
            root = _exact_root(base, exponent)
            if root is not None:
                return root
        if abs(exponent) > 4096 or abs(base) > 10**300:
            raise Unreadable("too large")
    try:
        return complex(base) ** complex(exponent)
    except (OverflowError, ZeroDivisionError) as exc:
        raise Unreadable(str(exc)) from None


def _exact_root(base: Fraction, exponent: Fraction) -> Fraction | None:
    """``base ** exponent`` when it is rational (``\\sqrt{4}``, ``8^{2/3}``), else None."""
    if base < 0 or exponent.denominator > 8:
        return None
    n = exponent.denominator
    num, den = round(base.numerator ** (1 / n)), round(base.denominator ** (1 / n))
    if num**n == base.numerator and den**n == base.denominator:
        return Fraction(num, den) ** exponent.numerator
    return None


def variable_names(tokens: list[str]) -> list[str]:
    return sorted({t for t in tokens if t in _GREEK or (len(t) == 1 and t.isalpha() and t != "e")})


_FAILURES = (Unreadable, ValueError, ZeroDivisionError, OverflowError, RecursionError, MemoryError, TypeError)


@lru_cache(maxsize=65536)
def own_names(s: str) -> tuple[str, ...] | None:
    """The variables of ``s`` (sorted), or None when the tokenizer cannot read it."""
    if _simple_value(s) is not None:
        return ()
    try:
        return tuple(variable_names(tokenize(s)))
    except Unreadable:
        return None


@lru_cache(maxsize=65536)
def _names(s: str, variables: tuple[str, ...]) -> tuple[str, ...] | None:
    """The variables ``s`` is evaluated over (its own and ``variables``), or None when it cannot be read."""
    own = own_names(s)
    if own is None:
        return None
    names = tuple(sorted({*own, *variables})) if variables else own
    return None if len(names) > len(POINTS[0]) else names


@lru_cache(maxsize=65536)
def value_at(s: str, variables: tuple[str, ...] = (), point: int = 0):
    """The value of ``s`` at ``POINTS[point]`` (its only value when it has no variable), or None when the
    evaluator cannot read it there."""
    names = _names(s, variables)
    if names is None:
        return None
    simple = _simple_value(s)
    if simple is not None:  # a number or a fraction of two (most answers): the parser's value, without it
        return simple
    try:
        return _Parser(tokenize(s), dict(zip(names, POINTS[point], strict=False))).parse()
    except _FAILURES:
        return None


def evaluate(s: str, variables: tuple[str, ...] = ()) -> tuple | None:
    r"""The values of canonical expression ``s`` at :data:`POINTS` (one value when it has no variable), or
    None when the evaluator cannot read it. Exact (a ``Fraction``) for rational arithmetic.

    Example:
        >>> evaluate(r"\frac{3}{4}")
        (Fraction(3, 4),)
        >>> evaluate("-1.5\\times10^{2}")
        (Fraction(-150, 1),)
    """
    names = _names(s, variables)
    if names is None:
        return None
    values = tuple(value_at(s, variables, k) for k in range(len(POINTS) if names else 1))
    return None if None in values else values


def same_everywhere(a: str, b: str, variables: tuple[str, ...] = ()) -> bool | None:
    """Whether ``a`` and ``b`` take the same value at every point (False at the first point where they differ,
    without evaluating the rest); None when either cannot be read."""
    names_a, names_b = _names(a, variables), _names(b, variables)
    if names_a is None or names_b is None:
        return None
    for k in range(len(POINTS) if names_a or names_b else 1):
        x, y = value_at(a, variables, k), value_at(b, variables, k)
        if x is None or y is None:
            return None
        if not same_value(x, y):
            return False
    return True


_NUMBER = r"(?:\d+\.?\d*|\.\d+)"  # the tokenizer's number
_SIMPLE = re.compile(rf"(-?)(?:({_NUMBER})|\\frac\{{({_NUMBER})\}}\{{({_NUMBER})\}}|({_NUMBER})/({_NUMBER}))")


@lru_cache(maxsize=65536)
def _simple_value(s: str) -> Fraction | None:
    r"""The exact value of ``s`` when it is a signed number, a ``\frac`` of two numbers or two numbers with a
    slash (``3/4``), as the parser reads it; None for anything else (a zero denominator included: the parser
    decides)."""
    m = _SIMPLE.fullmatch(s)
    if m is None:
        return None
    sign, number, top, bottom, over, under = m.groups()
    try:
        if number is not None:
            value = _decimal(number)
        else:
            if top is None:
                top, bottom = over, under
            if "." in top or "." in bottom:
                denominator = _decimal(bottom)
                if not denominator:
                    return None
                value = _decimal(top) / denominator
            else:  # two integers (nearly every fraction): one Fraction, the same value
                denominator = int(bottom)
                if not denominator:
                    return None
                value = Fraction(int(top), denominator)
    except ValueError:  # past Python's 4,300-digit limit on int(): the parser's answer too (unreadable)
        return None
    return -value if sign else value


def _decimal(number: str) -> Fraction:
    """``Fraction(number)`` for the tokenizer's numbers (``12``, ``1.50``, ``.5``, ``3.``), without its regex."""
    if "." not in number:
        return Fraction(int(number))  # the same value, without the two-argument constructor
    whole, _, part = number.partition(".")
    return Fraction(int(whole + part) if whole or part else 0, 10 ** len(part))


def same_value(a, b) -> bool:
    """Exact for two rationals; else within :data:`REL_TOL` (a value too large for a float is not the same)."""
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    try:  # complex(numerator / denominator) is what complex(x) does for a Fraction, without numbers.Real's detour
        a = complex(a.numerator / a.denominator) if isinstance(a, Fraction) else complex(a)
        b = complex(b.numerator / b.denominator) if isinstance(b, Fraction) else complex(b)
    except OverflowError:
        return False
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b), 1.0)
