r"""Verifiable rewards: string-match against a gold answer, and the narrow playground reward.

String-match (S-RW-3..8) extracts the final answer from a completion with an *extractor*,
extracts the gold answer from ``kwargs[answer_column]`` the same way, or with ``gold_extractor``
when the dataset writes its gold in another form (GSM8K's ``#### 72`` while the prompt asks for
``\boxed{}``), falling back to the raw gold string when extraction finds nothing; normalises both with :func:`normalize_answer` and
returns 1.0 when they are equal, else 0.0. It is chosen for speed (a few microseconds per
sample), determinism and no dependencies when gold answers are already canonical. By default, unlike
TRL's ``accuracy_reward`` (math_verify), it treats ``0.5`` and ``1/2`` as different answers; with
``equivalence: math`` it credits the same number or object in any form (:mod:`rewards.math_equivalence`).

A sample gets ``None`` ("does not apply", never counted as 0.0) when its gold value is missing
or empty, when ``only_label`` is set and the row's ``label`` differs, and when ``only_label`` is
set but the batch has no ``label`` column (logged once).

Extractors (:data:`EXTRACTORS`), each ``str -> str | None`` (None: no answer found):

=============== ===============================================================================
``boxed``       content of the last complete ``\boxed{...}``, braces scanned with a depth count so
                nested braces work (``\boxed{\frac{1}{2}}`` gives ``\frac{1}{2}``); escaped
                braces ``\{``/``\}`` do not count
``gsm8k``       the text after the last ``####``
``last_number`` the last numeric token: optional sign, digits with optional thousands commas,
                optional decimal part (``-1,234.50``)
``full``        the whole completion unchanged
=============== ===============================================================================

Example:
    >>> reward = make_string_match_reward("boxed", answer_column="solution")
    >>> reward(prompts=["q", "q"], completions=[r"so \boxed{\frac{1}{2}}.", r"\boxed{0.5}"],
    ...        solution=[r"\frac{1}{2}", r"\frac{1}{2}"])
    [1.0, 0.0]
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import partial
from typing import Any

from rewards.interface import Reward, completion_text
from rewards.math_equivalence import math_equal_plain, plain_number
from rewards.memo import Memo

EQUIVALENCES = ("exact", "math")
"""String-match ``equivalence`` choices."""

logger = logging.getLogger(__name__)

_BOXED = "\\boxed{"
_BOXED_LEN = len(_BOXED)
_GROUPING_MARK = re.compile(r"\\.|[{}]", re.DOTALL)  # an escape (two characters) or a brace
_PLAIN = r"[^{}\\]*+"  # characters that are no brace and no backslash (possessive: no backtracking)


def _body(depth: int) -> str:
    """A group's body with groups nested up to ``depth`` deep inside, unrolled (plain characters, then escapes or
    groups each followed by plain characters): a body without a group or an escape takes one step."""
    if depth == 0:
        return rf"{_PLAIN}(?:\\.{_PLAIN})*+"
    return rf"{_PLAIN}(?:(?:\\.|\{{{_body(depth - 1)}\}}){_PLAIN})*+"


_GROUP_BODY = re.compile(rf"({_body(3)})\}}", re.DOTALL)
"""A group's body and its closing brace, with groups nested up to three deep inside (deeper: the loop below)."""


def extract_boxed(text: str) -> str | None:
    r"""Content of the last complete ``\boxed{...}`` in ``text``, or None.

    Braces are matched with a depth count, so ``\boxed{\frac{1}{2}}`` gives ``\frac{1}{2}``.
    A ``\boxed{`` that never closes (a truncated completion) is skipped in favour of the
    previous complete one.

    Example:
        >>> extract_boxed(r"first \boxed{1}, then \boxed{\frac{a}{b}}")
        '\\frac{a}{b}'
    """
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    group = _GROUP_BODY.match(text, start + _BOXED_LEN)
    if group:  # groups nested up to three deep (nearly every answer): one match
        return group.group(1).strip() or None
    while True:  # deeper nesting, or unclosed (a truncated completion): scan the braces
        body = start + _BOXED_LEN
        depth = 1
        for mark in _GROUPING_MARK.finditer(text, body):
            char = mark.group()
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    return text[body : mark.start()].strip() or None
            # else an escaped character, e.g. \{ or \}: content, not grouping (the pattern takes both)
        start = text.rfind(_BOXED, 0, start)  # unclosed: try the previous \boxed{
        if start < 0:
            return None
        group = _GROUP_BODY.match(text, start + _BOXED_LEN)
        if group:
            return group.group(1).strip() or None


def extract_gsm8k(text: str) -> str | None:
    """The text after the last ``####`` (GSM8K's answer marker), stripped, or None.

    Example:
        >>> extract_gsm8k("#### 3 is a guess\\n#### 1,000")
        '1,000'
    """
    head, sep, tail = text.rpartition("####")
    if not sep:
        return None
    return tail.strip() or None


# Sign only when it does not follow a word character or ")" (so "3-5" gives "5", "x=-5" gives
# "-5"); integer part either strictly grouped by thousands or plain digits; optional decimals.
_NUMBER_FIND = re.compile(r"(?:(?<![\w)])[-+])?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)")


def extract_last_number(text: str) -> str | None:
    """The last numeric token in ``text`` (optional sign, thousands commas, decimals), or None.

    Example:
        >>> extract_last_number("we get 12 apples, then -1,234.50 dollars.")
        '-1,234.50'
    """
    last = None
    for last in _NUMBER_FIND.finditer(text):  # noqa: B007 - only the last match is wanted
        pass
    return last.group(0) if last is not None else None


def extract_full(text: str) -> str | None:
    """The whole text unchanged (None when empty after stripping).

    Example:
        >>> extract_full(" Paris ")
        ' Paris '
    """
    return text if text.strip() else None


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "boxed": extract_boxed,
    "gsm8k": extract_gsm8k,
    "last_number": extract_last_number,
    "full": extract_full,
}
"""Extractor name -> function returning the answer found in a text, or None when there is none."""

ANSWER_MARKERS: dict[str, str] = {"boxed": "\\boxed", "gsm8k": "####"}
"""Extractor name -> the marker a completion must write, so the prompt must ask for it (``--dry_run`` warns
when neither the system prompt nor the prompts mention it). ``last_number`` and ``full`` need none."""

# A number grouped by thousands ("1,000", "12,345,678.5"), not part of a longer digit/comma run.
_THOUSANDS = re.compile(r"(?<![\d,.])\d{1,3}(?:,\d{3})+(?![\d]|,\d)")


def _drop_thousands_commas(match: re.Match[str]) -> str:
    return match.group(0).replace(",", "")


def _strip_outer_braces(text: str) -> str:
    """Remove one pair of braces enclosing the whole text, only if they match each other."""
    if len(text) < 2 or text[0] != "{" or text[-1] != "}":
        return text
    depth = 0
    for i, char in enumerate(text):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0 and i != len(text) - 1:
                return text  # "{a}{b}": the first brace closes early
    return text[1:-1].strip()


def normalize_answer(text: str) -> str:
    r"""Canonical form of an answer for string comparison (S-RW-5).

    In order: strip; collapse inner whitespace to one space; lowercase; remove one trailing
    ``.``; remove thousands-separator commas inside numbers (``1,000`` -> ``1000``, but the
    tuple ``(1,2)`` keeps its comma); remove a surrounding ``$`` or ``\$`` (leading and trailing
    independently, so ``\$18`` -> ``18``) and a pair of braces enclosing the whole text, repeating
    these two until nothing changes (``$\$4$`` -> ``4``, ``{$5$}`` -> ``5``).

    Args:
        text: The extracted answer.

    Returns:
        The normalised answer.

    Example:
        >>> normalize_answer("  $1,000$. ")
        '1000'
        >>> normalize_answer(r"{\frac{1}{2}}")
        '\\frac{1}{2}'
    """
    text = " ".join(text.split()).lower()
    if text.endswith("."):
        text = text[:-1].rstrip()
    if "," in text:
        text = _THOUSANDS.sub(_drop_thousands_commas, text)
    # Repeated so nested wrappers such as "$\\$4$" or "{$5$}" come off completely.
    # A leading backslash starts a wrapper only as "\\$" (else the loop below changes nothing: it would break).
    while text and (text[0] in "${" or text[-1] == "$" or text.startswith("\\$")):
        before = text
        if text.startswith("\\$"):
            text = text[2:].lstrip()
        elif text.startswith("$"):
            text = text[1:].lstrip()
        if text.endswith("\\$"):
            text = text[:-2].rstrip()
        elif text.endswith("$"):
            text = text[:-1].rstrip()
        if text.startswith("{"):
            text = _strip_outer_braces(text)
        if text == before:
            break
    return text


def _gold_record(extractor: str, math: bool, gold: str) -> tuple[str | None, str, bool, str | None]:
    """``(normalised gold or None, gold as extracted, whether normalising the normalised gold leaves it
    unchanged, the exact digits of the extracted gold when it is a plain number and ``math``, else None)``. The
    extracted gold is the raw cell when the extractor finds nothing."""
    extracted = EXTRACTORS[extractor](gold)
    answer = extracted if extracted is not None else gold
    normalized = normalize_answer(answer) or None
    fixed = normalized is not None and (
        (normalized.isdigit() and normalized.isascii()) or normalize_answer(normalized) == normalized
    )  # ASCII digits are a fixed point
    plain = plain_number(answer) if math and "\\" not in answer else None  # a plain number has no backslash
    return normalized, answer, fixed, plain


_GOLD_MEMOS: dict[tuple[str, bool], Memo] = {}
"""(Extractor name, math equivalence) -> gold cell -> :func:`_gold_record`: cached because GRPO repeats each
gold num_generations times (a :class:`~rewards.memo.Memo`: the reward reads it with one subscription)."""


def _gold_memo(extractor: str, math: bool = False) -> Memo:
    if (memo := _GOLD_MEMOS.get((extractor, math))) is None:
        memo = _GOLD_MEMOS[extractor, math] = Memo(partial(_gold_record, extractor, math), maxsize=4096)
    return memo


def clear_gold_caches() -> None:
    """Forget every gold :class:`StringMatchReward` has read (benchmarks time gold normalisation too)."""
    for memo in _GOLD_MEMOS.values():
        memo.clear()


def _gold_string(value: Any) -> str | None:
    """A gold cell as a non-empty string, or None when it is missing or empty."""
    if type(value) is str:
        return value if value.strip() else None
    if value is None:
        return None
    if isinstance(value, float) and value != value:  # NaN from a pandas-backed column
        return None
    text = value if isinstance(value, str) else str(value)
    return text if text.strip() else None


@dataclass(eq=False, kw_only=True)
class StringMatchReward(Reward):
    r"""A picklable string-match reward; build it with :func:`make_string_match_reward`.

    Calling it follows TRL's reward signature and returns one of 1.0, 0.0 or None per
    completion. See the module docstring for the rules.
    """

    extractor: str
    answer_column: str
    gold_extractor: str | None = None
    equivalence: str = "exact"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.gold_extractor = self.gold_extractor or self.extractor

    def required_columns(self) -> set[str]:
        """Dataset columns this reward reads (for the recipe dry-run)."""
        return {self.answer_column}

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float | None]:
        n = len(completions)
        applies = self.applies(kwargs, n)
        golds = self.column_or_abstain(
            kwargs, self.answer_column, n, holds="gold answers", option="answer_column"
        )
        if golds is None:
            return [None] * n
        extract, gold_extractor, math = (
            EXTRACTORS[self.extractor],
            self.gold_extractor,
            self.equivalence == "math",
        )
        scores: list[float | None] = [None] * n
        gold_parts = _gold_memo(gold_extractor, math)
        for i, (completion, gold, applies_here) in enumerate(zip(completions, golds, applies, strict=True)):
            if not applies_here:
                continue
            # A str gold needs no _gold_string: one that is blank normalises to "" (None below) all the same.
            gold_text = gold if type(gold) is str else _gold_string(gold)
            if gold_text is None:
                continue
            gold_norm, gold_answer, fixed, gold_plain = gold_parts[gold_text]
            if gold_norm is None:
                continue
            if (  # completion_text's common case inline: one assistant message with str content
                type(completion) is list
                and len(completion) == 1
                and type(message := completion[0]) is dict
                and type(text := message.get("content")) is str
                and message.get("role", "assistant") == "assistant"
            ):
                answer = extract(text)
            else:
                answer = extract(completion_text(completion))
            if answer is None:
                scores[i] = 0.0
                continue
            # An answer written exactly as the normalised gold normalises to it when that is a fixed point; an
            # ASCII answer shorter than it never does (normalize_answer only removes characters from ASCII text).
            if fixed and answer == gold_norm:
                scores[i] = 1.0
            elif answer.isdigit() and answer.isascii():
                # ASCII digits: normalize_answer leaves them as they are, and math_equal reads them as a plain number
                if answer == gold_norm:
                    scores[i] = 1.0
                elif gold_plain is not None and answer[0] != "0":  # what math_equal says of two plain numbers
                    scores[i] = 1.0 if answer == gold_plain else 0.0
                elif math:
                    verdict = math_equal_plain(answer, gold_answer, gold_plain)
                    scores[i] = None if verdict is None else 1.0 if verdict else 0.0
                else:
                    scores[i] = 0.0
            elif (
                (len(answer) >= len(gold_norm) or not answer.isascii())
                and (
                    # normalize_answer keeps the first character of an ASCII answer (lower case) unless it is part of a
                    # wrapper or whitespace: when that differs from the gold's, so do they (most wrong answers)
                    (first := answer[0]).lower() == gold_norm[0]
                    or first in "${"
                    or first.isspace()
                    or answer[:2] == "\\$"
                    or not answer.isascii()
                )
                and normalize_answer(answer) == gold_norm
            ):
                scores[i] = 1.0
            elif math:  # equal in another form? None when undecidable in time
                verdict = math_equal_plain(answer, gold_answer, gold_plain)
                scores[i] = None if verdict is None else 1.0 if verdict else 0.0
            else:
                scores[i] = 0.0
        return scores


def make_string_match_reward(
    extractor: str = "boxed",
    answer_column: str = "solution",
    only_label: str | None = None,
    name: str | None = None,
    gold_extractor: str | None = None,
    equivalence: str = "exact",
) -> StringMatchReward:
    r"""Build a string-match reward (S-RW-3).

    Args:
        extractor: One of :data:`EXTRACTORS` (``boxed``, ``gsm8k``, ``last_number``, ``full``): how
            the answer is found in a completion; the prompt must ask for that form.
        answer_column: The dataset column holding the gold answer.
        gold_extractor: How the answer is found in the gold cell (default: ``extractor``), e.g.
            ``gsm8k`` for GSM8K's ``answer`` column while completions answer in ``\boxed{}``.
        equivalence: ``exact`` (default: equal after :func:`normalize_answer`) or ``math``: also
            1.0 for the same number or object written another way (``\dfrac12`` for ``\frac{1}{2}``,
            ``0.5``, ``50\%``, ``x = 3\text{ cm}`` for ``3``, tuples, intervals, sets;
            :mod:`rewards.math_equivalence`), None when its symbolic fallback runs out of time.
        only_label: Score only rows whose ``label`` column equals this; others get None.
        name: The reward's ``__name__``, which TRL uses for its metric names
            (``rewards/<name>/mean``); defaults to ``string_match_<extractor>``.

    Returns:
        A picklable callable ``f(prompts, completions, completion_ids=None, **kwargs)``
        returning ``list[float | None]``.

    Raises:
        ValueError: When ``extractor`` is not a known extractor.

    Example:
        >>> reward = make_string_match_reward("gsm8k", answer_column="answer", only_label="gsm8k")
        >>> reward(prompts=["q"] * 3, completions=["#### 1,000", "#### 7", "#### 7"],
        ...        answer=["#### 1000", "#### 8", "#### 7"], label=["gsm8k", "gsm8k", "math"])
        [1.0, 0.0, None]
        >>> boxed = make_string_match_reward("boxed", answer_column="answer", gold_extractor="gsm8k")
        >>> boxed(prompts=["q"] * 2, completions=[r"so \boxed{1,000}.", "#### 1000"], answer=["... #### 1000"] * 2)
        [1.0, 0.0]
    """
    if equivalence not in EQUIVALENCES:
        raise ValueError(
            f"Unknown string-match equivalence {equivalence!r}. Use one of: {', '.join(EQUIVALENCES)}."
        )
    for key, value in (("extractor", extractor), ("gold_extractor", gold_extractor)):
        if value is not None and value not in EXTRACTORS:
            raise ValueError(
                f"Unknown string-match {key} {value!r}. Use one of: {', '.join(sorted(EXTRACTORS))}."
            )
    return StringMatchReward(
        extractor=extractor,
        answer_column=answer_column,
        only_label=only_label,
        name=name or f"string_match_{extractor}",
        gold_extractor=gold_extractor,
        equivalence=equivalence,
    )


def _as_number(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


@dataclass(eq=False, kw_only=True)
class LastNumberReward(Reward):
    """A picklable playground reward; build it with :func:`make_playground_reward`.

    Deliberately narrow (S-RW-7): 1.0 when the last number in the completion equals the expected
    number (the last number in the gold cell, compared as decimals, so ``5.0`` equals ``5`` and
    ``1,000`` equals ``1000``), else 0.0. None when the gold cell is missing, empty or has no
    number.
    """

    answer_column: str

    def required_columns(self) -> set[str]:
        """Dataset columns this reward reads (for the recipe dry-run)."""
        return {self.answer_column}

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float | None]:
        n = len(completions)
        applies = self.applies(kwargs, n)
        golds = self.column_or_abstain(
            kwargs, self.answer_column, n, holds="expected numbers", option="answer_column"
        )
        if golds is None:
            return [None] * n
        scores: list[float | None] = []
        for completion, gold, applies_here in zip(completions, golds, applies, strict=True):
            gold_text = _gold_string(gold) if applies_here else None
            gold_token = extract_last_number(gold_text) if gold_text is not None else None
            expected = _as_number(gold_token) if gold_token is not None else None
            if expected is None:
                scores.append(None)
                continue
            token = extract_last_number(completion_text(completion))
            got = _as_number(token) if token is not None else None
            scores.append(1.0 if got is not None and got == expected else 0.0)
        return scores


def make_playground_reward(answer_column: str = "solution", name: str | None = None) -> LastNumberReward:
    """Build the playground reward: the last number in the answer equals the expected one.

    Args:
        answer_column: The dataset column holding the expected answer (its last number counts).
        name: The reward's ``__name__``; defaults to ``last_number_reward``.

    Returns:
        A picklable callable with TRL's reward signature returning 1.0, 0.0 or None per sample.

    Example:
        >>> reward = make_playground_reward(answer_column="answer")
        >>> reward(prompts=["q", "q"], completions=["so 12.0", "maybe 13"], answer=["12", "12"])
        [1.0, 0.0]
    """
    return LastNumberReward(answer_column=answer_column, name=name or "last_number_reward")


last_number_reward = make_playground_reward()
"""The playground reward reading the expected answer from the ``solution`` column."""
