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
   ``math_verify.verify`` in a separate process with a per-pair time limit; a timeout or a crash
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

import logging
import math
import multiprocessing
import re
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from fractions import Fraction
from functools import lru_cache

from rewards.latex_eval import Unreadable, evaluate, same_value, tokenize, variable_names

logger = logging.getLogger(__name__)

FALLBACK_TIMEOUT_S = 5.0
"""Seconds one symbolic comparison may take before the pair gets None."""
# --------------------------------------------------------------------------- 1. canonical strings

_SPACING = re.compile(r"(?<!\\)\\(?:left|right|displaystyle|textstyle|!|,|;|:|\s)|~")
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
_BASE = re.compile(r"\d+_\d+")  # canonical 506_{7}: 506 in base 7
_PLAIN = re.compile(r"-?(?:[1-9]\d{0,2}(?:,\d{3})+|\d+)(?:\.\d+)?")
"""A plain decimal number (thousands commas allowed): compared exactly, before any canonical form."""


def _plain_number(text: str) -> str | None:
    """A plain number's exact canonical digits (``-1,000.50`` -> ``-1000.5``), or None for anything else."""
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
    if _ARITHMETIC.fullmatch(s):  # digits and operators only (most answers): no LaTeX, unit or name to remove
        s = _grouped(" ".join(_GROUPING.sub("", s).split()).rstrip(".").strip())
        return _strip_braces(_SPACES.sub("", s)), "", ""
    return _latex_parts(s)


def _latex_parts(s: str) -> tuple[str, str, str]:
    """:func:`_parts` of an answer with LaTeX, words or units in it (every step)."""
    s = _GROUPING.sub("", s).replace("\\$", "").replace("\\%", "%")
    s = _SPACING.sub(" ", s)
    s = _DEGREES.sub("", s)
    unit = ""
    tail = _TEXT_UNIT.match(s)
    if tail and re.search(r"(?:[\d}]|\\pi)\s*$", tail.group(1)) and len(tail.group(2).strip()) > 1:
        s, unit = tail.group(1), tail.group(2)  # a unit after a value: "10\text{ cm}"
    s = _TEXT.sub(r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\cfrac", "\\frac")
    s = s.replace("\\dbinom", "\\binom").replace("\\tbinom", "\\binom")
    s = _FRAC_SHORT.sub(lambda m: f"\\frac{{{m.group(1).strip('{}')}}}{{{m.group(2).strip('{}')}}}", s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = " ".join(s.split()).lower().rstrip(".").strip()
    prefix = _PREFIX.match(s)
    if prefix:
        s = s[prefix.end() :]
    tail_unit = _UNIT_TAIL.match(s)
    if tail_unit:
        s, unit = tail_unit.group(1), tail_unit.group(2)
    s = _grouped(s)
    s = _AND_OR.sub(",", s)
    s = _MIXED.sub(lambda m: f"({m.group(1)}+\\frac{{{m.group(2)}}}{{{m.group(3)}}})", s)
    s = _strip_braces(_SUBSCRIPT.sub(r"_\1", _SPACES.sub("", s)))
    unit = re.sub(r"[\s.]+", "", unit.lower())
    prefix_name = prefix.group(1).replace(" ", "") if prefix else ""
    return s, (unit.rstrip("s") if len(unit) > 2 else unit), prefix_name


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


def _decide(a: str, g: str) -> bool | None:
    """Steps 1-2 for canonical strings; None: the evaluator cannot decide (the fallback does)."""
    if a == g:
        return True
    matrix_a, matrix_g = _matrix(a), _matrix(g)
    if matrix_a is not None or matrix_g is not None:
        if matrix_a is None or matrix_g is None or [len(r) for r in matrix_a] != [len(r) for r in matrix_g]:
            return (
                False
                if (matrix_a is not None or "\\begin" not in a)
                and (matrix_g is not None or "\\begin" not in g)
                else None
            )
        return _all_items([x for r in matrix_a for x in r], [y for r in matrix_g for y in r])
    if ":" in a or ":" in g or _WORDS.search(a) or _WORDS.search(g):
        return False  # ratios, times and words are compared as written
    if _BASE.fullmatch(a) or _BASE.fullmatch(g):
        return False  # a number in another base (506_7) is its own canonical form: the question asked for it
    union_a, union_g = "\\cup" in a, "\\cup" in g
    relation_a = _RELATION.search(a.replace("\\cup", ""))  # \cup itself is no relation here
    relation_g = _RELATION.search(g.replace("\\cup", ""))
    if union_a != union_g and not (relation_a or relation_g):
        return (
            False  # a union of intervals is never one interval or an expression (x < 2 or x > 3 may be one)
        )
    if (_equation(a) and not relation_g) or (_equation(g) and not relation_a):
        return False  # an equation (a plane, a line) is never a bare expression
    if union_a != union_g:
        return False if _is_number(a) or _is_number(g) else None
    relation_a, relation_g = relation_a or union_a, relation_g or union_g
    if "_" in a or "_" in g or _AS_WRITTEN.search(a + g) or relation_a or relation_g:
        # an index, \overline, x \in S, a \pm b: never one plain number; against anything else the symbolic
        # fallback decides
        return False if _is_number(a) or _is_number(g) else None
    seq_a, seq_g = _sequence(a), _sequence(g)
    if seq_a or seq_g:
        if not (seq_a and seq_g):
            return False  # a tuple, an interval or a list of solutions is never one value
        if seq_a[0] != seq_g[0] or (seq_a[0] != "set" and len(seq_a[1]) != len(seq_g[1])):
            return False
        if seq_a[0] != "set":
            return _all_items(seq_a[1], seq_g[1])
        return _same_set(seq_a[1], seq_g[1])
    if _WORD.fullmatch(a) or _WORD.fullmatch(g):
        return False  # a word ("east", "odd") is its own canonical form
    undecided = False
    for form_a in _percent_forms(a, g):
        for form_g in _percent_forms(g, a):
            names = tuple(sorted(set(_var_names(form_a) or ()) | set(_var_names(form_g) or ())))
            va, vg = evaluate(form_a, names), evaluate(form_g, names)
            if va is None or vg is None:
                undecided = True
                continue
            if all(same_value(x, y) for x, y in zip(va, vg, strict=True)):
                return True
    return None if undecided else False


def _equation(s: str) -> bool:
    """``5x-7y+11z+4=0``, ``x+y=3``: one equation of a curve or a plane, not a name given a value (``f(x)=x^2``,
    ``x=1,y=2``: those the fallback compares)."""
    if s.count("=") != 1 or "," in s:
        return False
    left, right = s.split("=")
    top = re.sub(r"\{[^{}]*\}|\([^()]*\)", "", left)  # f^{-1}(x), a_{n+1}, f(x-1): names, not sums
    return right == "0" or any(op in top[1:] for op in "+-")


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


def _var_names(s: str) -> list[str] | None:
    """The variables of ``s`` (sorted), or None when it cannot be read."""
    try:
        return variable_names(tokenize(s))
    except Unreadable:
        return None


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


# --------------------------------------------------------------------------- 3. the symbolic fallback

_POOL: ProcessPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _verify(answer: str, gold: str) -> bool:
    """math_verify's parse and verify, bounded from outside (signal timeouts work on a main thread only)."""
    from math_verify import parse, verify

    parsed_gold = parse(f"${gold}$", parsing_timeout=None, raise_on_error=True)
    parsed = parse(f"${answer}$", parsing_timeout=None, raise_on_error=True)
    return bool(verify(parsed_gold, parsed, timeout_seconds=None, raise_on_error=True))


def _pool() -> ProcessPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return _POOL


def _reset_pool() -> None:
    """A worker stuck past its limit is killed; the next fallback starts a new one."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None:
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)


def _verify_here(answer: str, gold: str, timeout_s: float) -> bool:
    """math_verify in this process, bounded by its own SIGALRM timeouts (main thread only)."""
    from math_verify import parse, verify

    seconds = max(1, math.ceil(timeout_s))
    parsed_gold = parse(f"${gold}$", parsing_timeout=seconds, raise_on_error=True)
    parsed = parse(f"${answer}$", parsing_timeout=seconds, raise_on_error=True)
    return bool(verify(parsed_gold, parsed, timeout_seconds=seconds, raise_on_error=True))


def _verify_in_thread(answer: str, gold: str, timeout_s: float) -> bool | None:
    """math_verify in a daemon thread, waited for ``timeout_s`` seconds (a daemonic process, such as async GRPO's
    rollout child, cannot start the pool's process). A thread past its limit is left to finish; the pair gets
    None."""
    box: dict = {}

    def work() -> None:
        try:
            box["verdict"] = _verify(answer, gold)
        except Exception as exc:  # noqa: BLE001 - reported below as None
            box["error"] = exc

    thread = threading.Thread(target=work, daemon=True, name="math-equivalence-fallback")
    thread.start()
    thread.join(timeout_s)
    if "verdict" in box:
        return box["verdict"]
    why = box.get("error") or f"no verdict within {timeout_s:g} s"
    logger.warning("Math equivalence: %r vs %r: %s; the sample gets None.", answer, gold, why)
    return None


@lru_cache(maxsize=16384)
def symbolic_equal(answer: str, gold: str, timeout_s: float = FALLBACK_TIMEOUT_S) -> bool | None:
    """math_verify's verdict on a pair, within ``timeout_s`` seconds; None on a timeout or a failure.

    On the main thread it runs here, bounded by math_verify's SIGALRM timeouts; elsewhere (an event
    loop's thread, where signals cannot be set) in a one-process pool, bounded by the wait for its result
    (a stuck worker is killed); in a daemonic process, which cannot start one, in a thread waited for.
    """
    if threading.current_thread() is threading.main_thread():
        from math_verify.errors import TimeoutException  # a BaseException: `except Exception` lets it through

        try:
            return _verify_here(answer, gold, timeout_s)
        except (Exception, TimeoutException) as exc:  # a timeout or a parse error: never a silent verdict
            logger.warning(
                "Math equivalence: %r vs %r: %s; the sample gets None.", answer, gold, exc or type(exc)
            )
            return None

    if multiprocessing.current_process().daemon:  # async GRPO's rollout child: no child processes allowed
        return _verify_in_thread(answer, gold, timeout_s)
    try:
        future = _pool().submit(_verify, answer, gold)
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        logger.warning(
            "Math equivalence: %r vs %r took over %g s; the sample gets None.", answer, gold, timeout_s
        )
        _reset_pool()
        return None
    except Exception as exc:  # a crashed worker or a math_verify error: never a silent verdict
        logger.warning("Math equivalence: %r vs %r failed (%s); the sample gets None.", answer, gold, exc)
        _reset_pool()
        return None


def math_equal(answer: str, gold: str) -> bool | None:
    r"""Whether ``answer`` and ``gold`` are the same mathematical object; None when undecidable in time.

    Example:
        >>> math_equal(r"\{2, -1\}", "-1, 2"), math_equal("3.10", "3.1"), math_equal("1,000", "1000")
        (True, True, True)
    """
    a, g = _plain_number(answer), _plain_number(gold)
    if a is not None and g is not None:
        return a == g  # two plain numbers (most GSM8K pairs): exact, without the canonical forms
    (a, unit_a, prefix_a), (g, unit_g, prefix_g) = _parts(answer), _parts(gold)
    if (unit_a and unit_g and unit_a != unit_g) or (prefix_a and prefix_g and prefix_a != prefix_g):
        return False  # 12 hours is not 12 minutes; y = 2 is not x = 2
    return _math_equal(a, g)


@lru_cache(maxsize=65536)
def _math_equal(a: str, g: str) -> bool | None:
    if not a or not g:
        return a == g
    verdict = _decide(a, g)
    if verdict is not None:
        return verdict
    return symbolic_equal(a, g)
