"""The one "did you mean" helper, the one options checker and the one shortener of values shown in messages,
shared by rewards/ and dna_factory/.

Here, in ``rewards/`` (the ground floor, which imports nothing from ``dna_factory/``), so that both
packages use the same code: every error that names an unknown key, name or option suggests the
nearest one with :func:`did_you_mean`; a reward factory's options (``reward_funcs``) and an agent
environment's options (``environment_options``) are checked against the function or class they are
passed to by :func:`check_options`, before anything is built.

Example:
    >>> did_you_mean("extractr", ["extractor", "answer_column"])
    " Did you mean 'extractor'?"
    >>> def make(limit: int, name: str = "x"): ...
    >>> check_options(make, {"limt": 3}, "reward factory 'make'")
    Traceback (most recent call last):
    ...
    ValueError: Unknown option 'limt' for reward factory 'make'. Did you mean 'limit'? Its options are: limit, name.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

CUTOFF = 0.6
"""difflib's similarity ratio a name must reach to be suggested (``learning_rat`` -> ``learning_rate``)."""

SIMPLE_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
}
"""Annotations whose YAML values are type-checked: an int is a float, a bool is never an int."""


def shorten(text: str, limit: int = 120) -> str:
    """``text`` cut to ``limit`` characters, ending in ``...`` when cut: how a message shows a long value.

    Example:
        >>> shorten("abcdefgh", 6), shorten("abc", 6)
        ('abc...', 'abc')
    """
    return text if len(text) <= limit else text[: limit - 3] + "..."


def nearest(word: str, choices: Iterable[str]) -> str | None:
    """The choice closest to ``word``, or None when none is close enough."""
    match = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=CUTOFF)
    return match[0] if match else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" Did you mean 'X'?"`` for the nearest choice, or ``""``: appended to a sentence of an error."""
    match = nearest(word, choices)
    return f" Did you mean {match!r}?" if match else ""


def keyword_parameters(target: Callable) -> dict[str, inspect.Parameter]:
    """The parameters of ``target`` (a function, or a class's ``__init__``) a mapping of options can set."""
    return {
        name: p
        for name, p in inspect.signature(target).parameters.items()  # a class: its __init__ less self
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def type_mismatch(value: Any, annotation: Any) -> str | None:
    """The annotation's text when ``value`` clearly is not of that str/int/float/bool type, else None.

    Other annotations (lists, unions of several types, classes) are left to the target itself.
    """
    if annotation is inspect.Parameter.empty:
        return None
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    parts = [part.strip() for part in text.split("|")]
    kinds = [part for part in parts if part != "None"]
    if len(kinds) != 1 or kinds[0] not in SIMPLE_TYPES or (value is None and "None" in parts):
        return None
    allowed = SIMPLE_TYPES[kinds[0]]
    if isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed):
        return None
    return text


def check_options(
    target: Callable,
    options: Mapping[str, Any],
    owner: str,
    *,
    extra: Iterable[str] = (),
    where: str = "the recipe",
    error: type[Exception] = ValueError,
) -> None:
    """Raise ``error`` for an unknown option, a value of the wrong simple type or a missing required one.

    Args:
        target: The function or class the options will be passed to as keyword arguments.
        options: The recipe's options.
        owner: How messages name the target, e.g. ``"reward factory 'string_match'"``.
        extra: Options the caller consumes itself (a reward's ``weight``): accepted, not checked.
        where: Where the user fixes it, for the messages (``"the recipe"``).
        error: The exception type to raise (each package raises its own config error).
    """
    parameters = keyword_parameters(target)
    extra = list(extra)
    valid = [*parameters, *extra]
    for option, value in options.items():
        if option in extra:
            continue
        if option not in parameters:
            raise error(
                f"Unknown option {option!r} for {owner}.{did_you_mean(option, valid)} "
                f"Its options are: {', '.join(valid) or '(none)'}."
            )
        expected = type_mismatch(value, parameters[option].annotation)
        if expected is not None:
            raise error(
                f"Option {option!r} of {owner} is {value!r} ({type(value).__name__}), but it must be a "
                f"{expected}. Fix the value in {where}."
            )
    missing = [name for name, p in parameters.items() if p.default is p.empty and name not in options]
    if missing:
        raise error(
            f"{owner[:1].upper()}{owner[1:]} needs the option(s) {', '.join(missing)}. Add them to {where}."
        )
