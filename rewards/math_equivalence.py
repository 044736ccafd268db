r"""Math answer equivalence for string-match (``equivalence: math``): fast canonical forms, exact numbers,
and a bounded symbolic fallback.

:func:`math_equal` decides whether an extracted answer and a gold answer are the same mathematical
object. Three steps, the first that decides wins:

1. **Canonical strings** (:func:`canonical`): ``\dfrac``/``\tfrac`` -> ``\frac``, ``\frac12`` ->
   ``\frac{1}{2}``, ``\sqrt2`` -> ``\sqrt{2}``, no ``\left``/``\right``/spacing commands, no
   ``\text{...}`` units or degree signs, no ``x =`` prefix, no thousands separators, lower case.
2. **Values**: tuples, intervals, sets and lists of solutions are split at their top-level commas
   (tuples and intervals in order with the same brackets, sets and bare lists in any order) and
   compared item by item; an item is evaluated by a small LaTeX expression evaluator
   (:func:`evaluate`): exact rational arithmetic for numbers, fractions, decimals, percentages and
   scientific notation (so two different numbers are never equal), floating point only where
   ``\sqrt``, ``\pi`` or a non-integer power appear; expressions with variables are compared at
   three fixed points.
3. **Symbolic fallback** for what the evaluator cannot read (``\sin``, matrices, ...):
   ``math_verify.verify`` (:mod:`rewards.math_fallback`) with a per-pair time limit; a timeout or a crash
   gives None (the reward abstains), never a silent 0.0 or 1.0. Results are cached.

Example:
    >>> math_equal(r"\dfrac12", r"\frac{1}{2}"), math_equal("0.5", r"\frac{1}{2}"), math_equal("50\\%", "0.5")
    (True, True, True)
    >>> math_equal(r"x = 3\text{ cm}", "3"), math_equal("(1,2]", "(1, 2]"), math_equal("(1,2)", "[1,2]")
    (True, True, False)
    >>> math_equal(r"2\sqrt2", r"\sqrt{8}"), math_equal("1200", r"1.2\times10^{3}"), math_equal("0.3333", r"\frac13")
    (True, True, False)
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache
from typing import NamedTuple

from rewards.latex_eval import (
    POINTS,
    _names,
    _simple_value,
    evaluate,
    own_names,
    same_everywhere,
    same_value,
    tokenize,
    value_at,
)
from rewards.math_fallback import symbolic_equal

# --------------------------------------------------------------------------- 1. canonical strings

_SPACING = re.compile(r"(?<!\\)\\(?:left|right|displaystyle|textstyle|!|,|;|:|\s)|~")
_SPACING_MARK = re.compile(r"\\[lrdt!,;:\s]|~")  # what every match of _SPACING starts with
_VALUE_END = re.compile(r"(?:[\d}]|\\pi)\s*$")
_FRAC_SHORT = re.compile(r"\\[dtc]?frac\s*(\d|\{[^{}]*\}|\\[a-z]+)\s*(\d|\{[^{}]*\}|\\[a-z]+)")
_SQRT_SHORT = re.compile(r"\\sqrt\s*(\d|[a-z])")  # LaTeX: \sqrt23 is \sqrt{2}3
_MIXED = re.compile(r"(?<![\d.}a-z\\^_])(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}")  # 2\frac{1}{2}: two and a half
_TEXT = re.compile(r"\\(?:text|textbf|textit|mbox|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
_TEXT_UNIT = re.compile(r"^(.*\S)\s*\\(?:text|mbox|mathrm)\s*\{\s*([a-zA-Z][a-zA-Z .]+?)\s*\}\s*$")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")
_PREFIX = re.compile(r"^\s*((?:[a-z]|\\[a-z]+)(?:_\{?\w+\}?)?)\s*=\s*(?=[^=]+$)")
_UNITS = (
    r"units?|cm|mm|km|meters?|inches|inch|feet|foot|ft|miles?|mph|hours?|hrs?|minutes?|mins?|seconds?|sec|days?|"
    r"weeks?|years?|dollars?|cents?|degrees?|pounds?|lbs?|kg|grams?|liters?|ml|gallons?|ounces?|oz|people|"
    r"students|cookies|apples|points|percent"
)
_UNIT_TAIL = re.compile(rf"^(.*?\d)\s*((?:sq\.?\s*|square\s*|cubic\s*)?(?:{_UNITS})(?:\^?\{{?[23]\}}?)?)\.?$")
_UNIT_WORDS = tuple(w for u in _UNITS.split("|") for w in ((u[:-2], u[:-1]) if u.endswith("s?") else (u,)))
"""Every word :data:`_UNIT_TAIL` reads as a unit: an answer ending in none of them (after the power) has no unit."""
_THOUSANDS = re.compile(r"-?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?")
_GROUPING = re.compile(r"(?<=\d)(?:\{,\}|,\\!)(?=\d{3})")  # 3{,}000 and 3,\!000: thousands, in LaTeX
_SUBSCRIPT = re.compile(r"_\{(\w+)\}")
_AND_OR = re.compile(r"\s+(?:and|or)\s+")
_SPACES = re.compile(r"\s+")
_WORD = re.compile(r"[a-z]{2,}")
_AS_WRITTEN = re.compile(r"\\(?:overline|angle|triangle|mathbb|underline|vec|hat|bar|circ)(?![a-z])")
_WORDS = re.compile(r"(?<![\\a-z])[a-z]{3,}")
_RELATION = re.compile(r"[=<>]|\\(?:in|le|ge|leq|geq|neq|ne|lt|gt|pm|mp|subset|subseteq|cup|cap)(?![a-z])")


_ARITHMETIC = re.compile(r"[\d.,+\-*/()\[\]{}^ ]*")  # what _parts needs no LaTeX step for
_SHAPE = re.compile(
    r"(?:([a-zA-Z])\s*=\s*)?(-?(?:\d+(?:\.\d+)?|\\[dt]?frac\{\d+\}\{\d+\}))\s*"
    r"(?:\\(?:text|mbox|mathrm)\s*\{\s*([a-zA-Z]{2,}(?: [a-zA-Z]+)*)\s*\}|\^\s*\{?\s*\\circ\s*\}?)?"
)
"""The answers models write most (a number or a fraction, maybe named, with a unit or a degree sign): one match
gives their parts (tests/rewards/test_math_equivalence.py checks them against :func:`_latex_parts`)."""
_DECIMAL = re.compile(r"-?\d+(?:\.\d+)?")
_BASE = re.compile(r"\d+_\d+")  # canonical 506_{7}: 506 in base 7
_PLAIN = re.compile(r"-?(?:[1-9]\d{0,2}(?:,\d{3})+|\d+)(?:\.\d+)?")
"""A plain decimal number (thousands commas allowed): compared exactly, before any canonical form."""


@lru_cache(maxsize=65536)
def plain_number(text: str) -> str | None:
    """A plain number's exact canonical digits (``-1,000.50`` -> ``-1000.5``), or None for anything else."""
    if text.isdigit() and text.isascii() and text[0] != "0":
        return text  # digits without a leading zero (most numbers): already canonical
    text = text.strip().strip("$").strip()
    if not _PLAIN.fullmatch(text):
        return None
    sign, digits = ("-", text[1:]) if text[0] == "-" else ("", text)
    whole, _, part = digits.replace(",", "").partition(".")
    whole, part = whole.lstrip("0") or "0", part.rstrip("0")
    number = whole + "." + part if part else whole
    return "0" if number == "0" else sign + number


@lru_cache(maxsize=65536)
def _parts(text: str) -> tuple[str, str, str]:
    r"""``(canonical value, its unit, its variable prefix)``: ``x = 10\text{ cm}`` -> ``("10", "cm", "x")``."""
    s = text.strip().strip("$").strip()
    if "\\" not in s:  # neither pattern below takes a backslash: LaTeX (most answers here) skips both
        if _DECIMAL.fullmatch(s):  # 12, -3.50: its own canonical form
            return s, "", ""
        if _ARITHMETIC.fullmatch(s):  # digits and operators only: no LaTeX, unit or name to remove
            s = _grouped(" ".join(_GROUPING.sub("", s).split()).rstrip(".").strip())
            return _strip_braces(_SPACES.sub("", s)), "", ""
    shape = _SHAPE.fullmatch(s)
    if shape:  # x = 5, 5\text{ cm}, 30^\circ, \dfrac{1}{2}: what every step of _latex_parts makes of them
        name, value, unit = shape.groups()
        unit = unit.lower().replace(" ", "") if unit else ""
        value = value.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
        return value, (unit.rstrip("s") if len(unit) > 2 else unit), name.lower() if name else ""
    return _latex_parts(s)


def _latex_parts(s: str) -> tuple[str, str, str]:
    """:func:`_parts` of an answer with LaTeX, words or units in it (every step; a step whose pattern needs a
    character the answer lacks is skipped: no step writes a backslash into an answer that had none)."""
    if "," in s:
        s = _GROUPING.sub("", s)
    latex = "\\" in s
    unit = ""
    if latex:
        s = s.replace("\\$", "").replace("\\%", "%")
        if _SPACING_MARK.search(s):  # a spacing command is rare: no substitution to run without one
            s = _SPACING.sub(" ", s)
    elif "~" in s:
        s = s.replace("~", " ")
    if "circ" in s or "degree" in s or "°" in s:
        s = _DEGREES.sub("", s)
    if latex:
        if "\\text" in s or "\\m" in s or "\\operatorname" in s:  # what _TEXT_UNIT and _TEXT need
            tail = _TEXT_UNIT.match(s)
            if tail and _VALUE_END.search(tail.group(1)) and len(tail.group(2).strip()) > 1:
                s, unit = tail.group(1), tail.group(2)  # a unit after a value: "10\text{ cm}"
            s = _TEXT.sub(r"\1", s)
        if "frac" in s:
            s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\cfrac", "\\frac")
            s = _FRAC_SHORT.sub(
                lambda m: f"\\frac{{{m.group(1).strip('{}')}}}{{{m.group(2).strip('{}')}}}", s
            )
        if "binom" in s:
            s = s.replace("\\dbinom", "\\binom").replace("\\tbinom", "\\binom")
        if "sqrt" in s:
            s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = " ".join(s.split()).lower().rstrip(".").strip()
    prefix = _PREFIX.match(s) if "=" in s else None
    if prefix:
        s = s[prefix.end() :]
    tail_unit = _UNIT_TAIL.match(s) if _unit_last(s) else None
    if tail_unit:
        s, unit = tail_unit.group(1), tail_unit.group(2)
    s = _grouped(s)
    if " and " in s or " or " in s:
        s = _AND_OR.sub(",", s)
    if latex and "frac" in s:
        s = _MIXED.sub(lambda m: f"({m.group(1)}+\\frac{{{m.group(2)}}}{{{m.group(3)}}})", s)
    s = s.replace(" ", "")  # the only whitespace left after the join above
    if "_{" in s:
        s = _SUBSCRIPT.sub(r"_\1", s)
    s = _strip_braces(s)
    unit = re.sub(r"[\s.]+", "", unit.lower()) if unit else ""
    prefix_name = prefix.group(1).replace(" ", "") if prefix else ""
    return s, (unit.rstrip("s") if len(unit) > 2 else unit), prefix_name


def _unit_last(s: str) -> bool:
    """Whether ``s`` ends in a unit word, maybe with a power (``cm^{2}``) and a full stop: :data:`_UNIT_TAIL`
    can match only then."""
    if s.endswith("."):
        s = s[:-1]
    if s.endswith("}"):
        s = s[:-1]
    if s.endswith(("2", "3")):
        s = s[:-1]
    if s.endswith("{"):
        s = s[:-1]
    if s.endswith("^"):
        s = s[:-1]
    return s.endswith(_UNIT_WORDS)


def _grouped(s: str) -> str:
    """One number written with thousands separators loses them: never inside a tuple, an interval or a set."""
    return s.replace(",", "") if _THOUSANDS.fullmatch(s) else s


def _strip_braces(s: str) -> str:
    while len(s) > 1 and s[0] == "{" and s[-1] == "}" and _balanced(s[1:-1]):
        s = s[1:-1]
    return s


def canonical(text: str) -> str:
    r"""The canonical string of an answer (step 1 of the module docstring).

    Example:
        >>> canonical(r"$x = \left( \dfrac12, 3 \right)$"), canonical("3{,}000"), canonical(r"2\frac{1}{2}")
        ('(\\frac{1}{2},3)', '3000', '(2+\\frac{1}{2})')
    """
    return _parts(text)[0]


def _balanced(s: str) -> bool:
    depth = 0
    for char in s:
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0


# --------------------------------------------------------------------------- 2. values


def _split_top(s: str) -> list[str]:
    """``s`` split at commas outside any bracket or brace."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(s):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _sequence(s: str) -> tuple[str, list[str]] | None:
    """``(kind, items)`` for a tuple/interval (kind: its two brackets), a set (``set``) or a bare list of
    solutions (``set``); None for a single value."""
    if s.startswith("\\{") and s.endswith("\\}"):
        return "set", _split_top(s[2:-2])
    if "," not in s:
        return None  # one item, in brackets or not
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        inner = s[1:-1]
        items = _split_top(inner)
        if len(items) > 1 and _balanced_all(inner):
            return s[0] + s[-1], items
        return None
    items = _split_top(s)
    return ("set", items) if len(items) > 1 else None


def _balanced_all(s: str) -> bool:
    depth = 0
    for char in s:
        depth += 1 if char in "([{" else -1 if char in ")]}" else 0
        if depth < 0:
            return False
    return depth == 0


def _percent_forms(s: str, other: str) -> list[str]:
    """``50%`` is 1/2, and also reads as ``50`` against a gold without ``%`` (GSM8K writes ``50``); a percentage
    below 1 never drops its sign (``0.5%`` is not ``0.5``)."""
    if s.endswith("%") and len(s) > 1 and not other.endswith("%"):
        value = evaluate(s[:-1])
        if value is not None and len(value) == 1 and isinstance(value[0], Fraction) and abs(value[0]) >= 1:
            return [s, s[:-1]]
    return [s]


class _Traits(NamedTuple):
    """What :func:`_decide` asks of one canonical answer, worked out once per answer."""

    matrix: list[list[str]] | None
    begin: bool  # \begin{...} that is not one matrix
    as_written: bool  # a ratio, a time or words: compared as written
    base: bool  # 506_7
    union: bool
    relation: bool  # =, <, \in, \pm, ... (\cup is no relation here)
    equation: bool
    index: bool  # an index or \overline, \angle, ...
    sequence: tuple[str, list[str]] | None
    word: bool


@lru_cache(maxsize=65536)
def _traits(s: str) -> _Traits:
    begin, union = "\\begin" in s, "\\cup" in s
    return _Traits(  # in field order (positional: faster than keywords)
        _matrix(s) if begin else None,
        begin,
        ":" in s or _WORDS.search(s) is not None,
        "_" in s and _BASE.fullmatch(s) is not None,
        union,
        _RELATION.search(s.replace("\\cup", "") if union else s) is not None,
        "=" in s and _equation(s),
        "_" in s or _AS_WRITTEN.search(s) is not None,
        _sequence(s),
        _WORD.fullmatch(s) is not None,
    )


_TRAIT_MARKS = re.compile(r"[,:_=<>]|\\(?:begin|cup|\{)")
"""What most answers with a trait of :class:`_Traits` have (a tuple, an interval, a set, a matrix, an index, a
relation), and few without."""


def _has_trait(t: _Traits) -> bool:
    """Any trait that makes :func:`_decide` say False against a plain number or fraction."""
    return (
        t.matrix is not None
        or t.as_written
        or t.base
        or t.union
        or t.relation
        or t.equation
        or t.index
        or t.sequence is not None
        or t.word
    )


def _decide(a: str, g: str) -> bool | None:
    """Steps 1-2 for canonical strings; None: the evaluator cannot decide (the fallback does)."""
    if a == g:
        return True
    value_a, value_g = _simple_value(a), _simple_value(g)
    if value_a is not None or value_g is not None:
        if value_a is not None and value_g is not None:
            return value_a == value_g  # two numbers or fractions: what the steps below conclude, exactly
        # One number or fraction, which has none of the traits below: when the other side has one, they all say
        # False (whatever the values), so neither side need be evaluated. Looked for only where one is likely.
        other = g if value_a is not None else a
        if _TRAIT_MARKS.search(other) and _has_trait(_traits(other)):
            return False
    if not (a.endswith("%") or g.endswith("%")):
        # Two values the evaluator reads that differ where it first looks: every step below says False too (the
        # steps that could say True or None need an answer it cannot read), so none of them runs.
        own_a = () if value_a is not None else own_names(a)  # what own_names says of a number
        own_g = () if value_g is not None else own_names(g)
        if own_a is not None and own_g is not None:  # else one cannot be read: no value to tell them apart
            names = own_a if own_a == own_g or not own_g else own_g if not own_a else _union(own_a, own_g)
            # value_at gives a number its value (None past six names, as it gives the other side: no decision)
            past = len(names) > len(POINTS[0])  # more names than a point has values: value_at gives None
            x = value_at(a, names) if value_a is None or past else value_a
            y = value_at(g, names) if value_g is None or past else value_g
            if x is not None and y is not None and not same_value(x, y):
                return False
    ta, tg = _traits(a), _traits(g)
    matrix_a, matrix_g = ta.matrix, tg.matrix
    if matrix_a is not None or matrix_g is not None:
        if matrix_a is None or matrix_g is None or [len(r) for r in matrix_a] != [len(r) for r in matrix_g]:
            return (
                False
                if (matrix_a is not None or not ta.begin) and (matrix_g is not None or not tg.begin)
                else None
            )
        return _all_items([x for r in matrix_a for x in r], [y for r in matrix_g for y in r])
    if ta.as_written or tg.as_written:
        return False  # ratios, times and words are compared as written
    if ta.base or tg.base:
        return False  # a number in another base (506_7) is its own canonical form: the question asked for it
    if ta.union != tg.union and not (ta.relation or tg.relation):
        return (
            False  # a union of intervals is never one interval or an expression (x < 2 or x > 3 may be one)
        )
    if (ta.equation and not tg.relation) or (tg.equation and not ta.relation):
        return False  # an equation (a plane, a line) is never a bare expression
    if ta.union != tg.union:
        return False if _is_number(a) or _is_number(g) else None
    if ta.index or tg.index or ta.relation or tg.relation or ta.union or tg.union:
        # an index, \overline, x \in S, a \pm b: never one plain number; against anything else the symbolic
        # fallback decides
        return False if _is_number(a) or _is_number(g) else None
    seq_a, seq_g = ta.sequence, tg.sequence
    if seq_a or seq_g:
        if not (seq_a and seq_g):
            return False  # a tuple, an interval or a list of solutions is never one value
        if seq_a[0] != seq_g[0] or (seq_a[0] != "set" and len(seq_a[1]) != len(seq_g[1])):
            return False
        if seq_a[0] != "set":
            return _all_items(seq_a[1], seq_g[1])
        return _same_set(seq_a[1], seq_g[1])
    if ta.word or tg.word:
        return False  # a word ("east", "odd") is its own canonical form
    undecided = False
    for form_a in _percent_forms(a, g):
        for form_g in _percent_forms(g, a):
            names = _union(own_names(form_a) or (), own_names(form_g) or ())
            same = same_everywhere(form_a, form_g, names)
            if same:
                return True
            undecided = undecided or same is None
    return None if undecided else False


def _equation(s: str) -> bool:
    """``5x-7y+11z+4=0``, ``x+y=3``: one equation of a curve or a plane, not a name given a value (``f(x)=x^2``,
    ``x=1,y=2``: those the fallback compares)."""
    if s.count("=") != 1 or "," in s:
        return False
    left, right = s.split("=")
    top = re.sub(r"\{[^{}]*\}|\([^()]*\)", "", left)  # f^{-1}(x), a_{n+1}, f(x-1): names, not sums
    return right == "0" or any(op in top[1:] for op in "+-")


@lru_cache(maxsize=65536)
def _is_number(s: str) -> bool:
    """``s`` evaluates to one value without variables."""
    value = evaluate(s)
    return value is not None and len(value) == 1


def _all_items(xs: list[str], ys: list[str]) -> bool | None:
    verdicts = [_decide(x, y) for x, y in zip(xs, ys, strict=True)]
    return False if False in verdicts else (None if None in verdicts else True)


_MATRIX = re.compile(r"^\\begin\{([pbv]?matrix)\}(.*)\\end\{\1\}$")


def _matrix(s: str) -> list[list[str]] | None:
    """A matrix's entries by row, or None when ``s`` is not one matrix."""
    m = _MATRIX.match(s)
    if not m:
        return None
    rows = m.group(2).split("\\\\")
    if rows and not rows[-1].strip():
        rows.pop()  # a row separator right before the end
    return [row.split("&") for row in rows]


def _union(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    """Two sorted tuples of variable names as one."""
    return a if a == b or not b else b if not a else tuple(sorted({*a, *b}))


def _same_set(xs: list[str], ys: list[str]) -> bool | None:
    """Every item of each side is an item of the other (a set: order and repeats do not count)."""
    undecided = False
    for items, others in ((xs, ys), (ys, xs)):
        for x in items:
            verdicts = [_decide(x, y) for y in others]
            if True in verdicts:
                continue
            if None in verdicts:
                undecided = True
                continue
            return False
    return None if undecided else True


def math_equal(answer: str, gold: str) -> bool | None:
    r"""Whether ``answer`` and ``gold`` are the same mathematical object; None when undecidable in time.

    Example:
        >>> math_equal(r"\{2, -1\}", "-1, 2"), math_equal("3.10", "3.1"), math_equal("1,000", "1000")
        (True, True, True)
    """
    return math_equal_plain(answer, gold, plain_number(gold))


def math_equal_plain(answer: str, gold: str, plain_gold: str | None) -> bool | None:
    """:func:`math_equal`, given ``plain_number(gold)`` (a reward works it out once per gold)."""
    # When the gold is a plain number, so may the answer be (never one with a backslash: _PLAIN takes none)
    if plain_gold is not None and "\\" not in answer:
        a = plain_number(answer)
        if a is not None:
            return a == plain_gold  # two plain numbers (most GSM8K pairs): exact, without the canonical forms
    (a, unit_a, prefix_a), (g, unit_g, prefix_g) = _parts(answer), _parts(gold)
    if (unit_a and unit_g and unit_a != unit_g) or (prefix_a and prefix_g and prefix_a != prefix_g):
        return False  # 12 hours is not 12 minutes; y = 2 is not x = 2
    if a == g:
        return True  # the same canonical string (what _math_equal says first), without its cache
    return _math_equal(a, g)


@lru_cache(maxsize=65536)
def _math_equal(a: str, g: str) -> bool | None:
    if not a or not g:
        return a == g
    verdict = _decide(a, g)
    if verdict is not None:
        return verdict
    return symbolic_equal(a, g)


def clear_caches() -> None:
    """Empty every cache of this module and of :mod:`rewards.latex_eval` (benchmarks time a cold start)."""
    caches = (plain_number, _parts, _traits, _is_number, _math_equal, symbolic_equal)
    for cached in (*caches, value_at, _names, own_names, tokenize, _simple_value):
        cached.cache_clear()
