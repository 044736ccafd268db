"""IFEval-style verifiable instructions: which of a row's instructions a response follows.

A row names its instructions the way IFEval does: ``instruction_id_list`` (e.g.
``["punctuation:no_comma", "length_constraints:number_words"]``) and ``kwargs``, one dict per
instruction (``[{}, {"num_words": 300, "relation": "at least"}]``). Keys whose value is None are
dropped first, so rows of the Hugging Face ``google/IFEval`` dataset (every key present, most
None) work as they are. :data:`CHECKERS` lists the 25 supported ids.

Strict evaluation checks the response as it is; *loose* evaluation (IFEval's upper bound) also
accepts an instruction when it holds for the response without its first line, without its last
line, without both, or with every ``*`` removed. An empty response follows no instruction.

Example:
    >>> follows("Hello there", ["punctuation:no_comma", "length_constraints:number_words"],
    ...         [{}, {"num_words": 3, "relation": "at least"}])
    [True, False]
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from rewards.ifeval.checkers import CHECKERS

__all__ = ["CHECKERS", "follows", "response_variants", "validate_instruction"]


def _integral(value: Any) -> Any:
    """``300.0`` -> ``300``: counts arrive as floats from pandas-backed columns."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def validate_instruction(instruction_id: str, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The kwargs an instruction's checker gets: None values dropped, names and presence checked.

    Raises:
        ValueError: For an unknown instruction id, an unknown kwarg, or a missing one.

    Example:
        >>> validate_instruction("punctuation:no_comma", {"num_words": None})
        {}
    """
    if instruction_id not in CHECKERS:
        raise ValueError(
            f"Unknown IFEval instruction {instruction_id!r}. Use one of the {len(CHECKERS)} ids in "
            "rewards/ifeval/checkers.py (e.g. punctuation:no_comma)."
        )
    given = {key: _integral(value) for key, value in (kwargs or {}).items() if value is not None}
    parameters = dict(inspect.signature(CHECKERS[instruction_id]).parameters)
    parameters.pop("response")
    unknown = sorted(set(given) - set(parameters))
    missing = sorted(name for name in parameters if name not in given)
    if unknown or missing:
        raise ValueError(
            f"IFEval instruction {instruction_id!r} takes the kwargs {sorted(parameters) or 'none'}, but the row "
            f"gives {sorted(given) or 'none'} (unknown: {unknown or 'none'}, missing: {missing or 'none'}). "
            "Fix the row's kwargs."
        )
    return given


def response_variants(response: str) -> list[str]:
    """IFEval's loose variants: the response without its first/last line or both, each also
    with every ``*`` removed.

    Example:
        >>> response_variants("Sure:\\n*yes*\\nBye")[:3]
        ['Sure:\\n*yes*\\nBye', 'Sure:\\nyes\\nBye', '*yes*\\nBye']
    """
    lines = response.split("\n")
    without_first = "\n".join(lines[1:]).strip()
    without_last = "\n".join(lines[:-1]).strip()
    without_both = "\n".join(lines[1:-1]).strip()
    return [
        response,
        response.replace("*", ""),
        without_first,
        without_last,
        without_both,
        without_first.replace("*", ""),
        without_last.replace("*", ""),
        without_both.replace("*", ""),
    ]


def follows(
    response: str,
    instruction_ids: Sequence[str],
    kwargs_list: Sequence[Mapping[str, Any] | None] | None = None,
    loose: bool = False,
) -> list[bool]:
    """Whether ``response`` follows each instruction, in order.

    Args:
        response: The model's answer.
        instruction_ids: IFEval instruction ids.
        kwargs_list: One kwargs dict per instruction (None or a shorter list: no kwargs).
        loose: Use IFEval's loose evaluation (see the module docstring).

    Raises:
        ValueError: For an unknown id, bad kwargs, or more kwargs dicts than instructions.

    Example:
        >>> follows('"quoted"', ["startend:quotation"]), follows("Sure:\\n\\"quoted\\"", ["startend:quotation"],
        ...                                                       loose=True)
        ([True], [True])
    """
    kwargs_list = list(kwargs_list or [])
    if len(kwargs_list) > len(instruction_ids):
        raise ValueError(
            f"The row has {len(kwargs_list)} kwargs dicts for {len(instruction_ids)} instructions. "
            "Give one kwargs dict per instruction."
        )
    kwargs_list += [None] * (len(instruction_ids) - len(kwargs_list))
    candidates = [r for r in (response_variants(response) if loose else [response]) if r.strip()]
    results = []
    for instruction_id, kwargs in zip(instruction_ids, kwargs_list, strict=True):
        arguments = validate_instruction(instruction_id, kwargs)
        checker = CHECKERS[instruction_id]
        results.append(any(checker(candidate, **arguments) for candidate in candidates))
    return results
