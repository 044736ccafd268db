"""Config value types: each key's type from the dataclasses, lenient YAML-aware coercion, unknown-key errors.

Used by :mod:`dna_factory.configuration.config` for every layer. The one "did you mean" helper is
:func:`rewards.options.did_you_mean` (in ``rewards/``, the ground floor both packages build on).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from typing import Any

from dna_factory.errors import DnaConfigError
from rewards.options import did_you_mean

CLI = "the command line"
"""The source name of the command-line layer, as messages say it."""


def field_types(dataclass_types: typing.Iterable[type]) -> dict[str, Any]:
    """Map every field name of the given dataclasses to its resolved type."""
    result: dict[str, Any] = {}
    for cls in dataclass_types:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.init:
                result.setdefault(f.name, hints.get(f.name, Any))
    return result


def type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]" if args else origin.__name__
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    return getattr(tp, "__name__", str(tp))


class _Mismatch(Exception):
    pass


def _yaml_bool_as_choice(value: bool, choices: typing.Iterable[Any]) -> Any:
    """YAML 1.1 reads a bare off/on/no/yes as a boolean: `save_strategy: no` means the choice "no"."""
    spellings = ("no", "off", "false") if not value else ("yes", "on", "true")
    return next((s for s in spellings if s in set(choices)), value)


def _coerce(value: Any, tp: Any, strict: bool) -> Any:
    """Return ``value`` converted to ``tp`` or raise _Mismatch. ``strict`` disables lenient casts."""
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise _Mismatch
        members = [a for a in args if a is not type(None)]
        for pass_strict in (True, False):
            for member in members:
                try:
                    return _coerce(value, member, pass_strict)
                except _Mismatch:
                    continue
        raise _Mismatch
    if value is None:
        raise _Mismatch
    if origin is typing.Literal:
        if isinstance(value, bool) and not strict:
            value = _yaml_bool_as_choice(value, args)
        if value in args and not isinstance(value, bool):
            return value
        raise _Mismatch
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, bool) and not strict:
            value = _yaml_bool_as_choice(value, [m.value for m in tp])
        try:
            return tp(value).value
        except ValueError:
            raise _Mismatch from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        if (
            not strict
            and isinstance(value, str)
            and value.lower() in ("true", "false", "yes", "no", "1", "0")
        ):
            return value.lower() in ("true", "yes", "1")
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if not strict and isinstance(value, float) and value.is_integer():
            return int(value)
        if not strict and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise _Mismatch from None
        raise _Mismatch
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return value  # an int is a valid float; keeping it prints `save_steps: 20`, not 20.0
        if not strict and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise _Mismatch from None
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        if not strict and isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise _Mismatch
    if origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, str) and not strict:
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list | tuple):
            raise _Mismatch
        inner = args[0] if args else Any
        return [_coerce(v, inner, strict) for v in value]
    if origin is dict or tp is dict:
        if not strict and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise _Mismatch from None
        if not isinstance(value, dict):
            raise _Mismatch
        return value
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _Mismatch
    return value


PEFT_PATTERN_KEYS = ("lora_target_modules",)
"""TRL types it ``list[str]`` but PEFT also takes one string: ``all-linear`` or a regex over full module names.
(``lora_target_parameters`` must stay a list: PEFT refuses a string there.)"""
_REGEX_CHARACTERS = frozenset("*+?()[]{}|^$\\")


def _peft_pattern(value: Any) -> str | None:
    """``value`` as PEFT's single-string form when it is ``all-linear`` or a regex (one string, or a one-item list)."""
    if isinstance(value, list | tuple) and len(value) == 1:
        value = value[0]
    if isinstance(value, str) and (value.lower() == "all-linear" or _REGEX_CHARACTERS & set(value)):
        return value
    return None


def coerce_value(key: str, value: Any, tp: Any, source: str) -> Any:
    """Check ``value`` against the field type; raise DnaConfigError naming key, value and type.

    ``lora_target_modules: all-linear`` and regex targets (``".*_proj"``) stay one string, as PEFT
    needs them (a list item is matched as a module-name suffix, so ``[all-linear]`` matches nothing).
    """
    if key in PEFT_PATTERN_KEYS and (pattern := _peft_pattern(value)) is not None:
        return pattern
    if key == "resume_from_checkpoint" and isinstance(value, bool):
        return str(value).lower()  # YAML reads `resume_from_checkpoint: true` as a bool; the key is a string
    try:
        return _coerce(value, tp, strict=False)
    except _Mismatch:
        raise DnaConfigError(
            f"Config key '{key}' has value {value!r} ({type(value).__name__}) in {source}, but it must be "
            f"{type_name(tp)}. Change the value in {source}."
        ) from None


def check_known_keys(layer: dict[str, Any], valid: typing.Iterable[str], source: str) -> None:
    valid = set(valid)
    for key in layer:
        if key not in valid:
            raise DnaConfigError(
                f"Unknown config key '{key}' in {source}.{did_you_mean(key, valid)} "
                f"Fix or remove it (python <stage>.py --help lists every key)."
            )


def describe_keys(
    dataclass_types: typing.Iterable[type], layer: tuple[str, dict[str, Any]] | None = None
) -> str:
    """``--help``'s key list: per dataclass, each key with its type, the default a run gets and its help.

    Args:
        dataclass_types: The classes whose fields are the keys (a key of two classes is listed under the first).
        layer: ``(name, keys)`` of the defaults file under the recipe: a key it sets shows that value,
            ``from <name>``; every other key its field's default (``default_factory`` called).
    """
    layered = layer[1] if layer else {}
    classes = list(dataclass_types)
    defaults = dataclass_defaults(classes)
    types_by_key = field_types(classes)
    lines: list[str] = []
    seen: set[str] = set()
    for cls in classes:
        lines.append(f"{cls.__name__}:")
        for f in dataclasses.fields(cls):
            if not f.init or f.name in seen:
                continue
            seen.add(f.name)
            if f.name in layered:
                default = f"{layered[f.name]!r} from {layer[0]}"
            elif f.name in defaults:
                default = repr(defaults[f.name])
            else:
                default = "none: required"
            lines.append(f"  --{f.name} ({type_name(types_by_key[f.name])}, default {default})")
            help_text = " ".join(str(f.metadata.get("help", "")).split())
            if help_text:
                lines.append(f"      {help_text[:300]}")
        lines.append("")
    return "\n".join(lines)


def dataclass_defaults(classes: typing.Iterable[type]) -> dict[str, Any]:
    """The default of every field of ``classes`` (``default_factory`` called; the first class to define a key wins),
    for ``--help`` and the run fingerprint (:func:`dna_factory.run.resume.fingerprint`)."""
    found: dict[str, Any] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                found.setdefault(f.name, f.default)
            elif f.default_factory is not dataclasses.MISSING:
                found.setdefault(f.name, f.default_factory())
    return found


class KeyTypes:
    """Every key a stage accepts and its type (from the stage's dataclasses), and the one pass a layer of keys goes
    through: a sibling variant's key and an unknown key are one error line each, and every value is coerced to its
    key's type. The layering (:func:`dna_factory.configuration.config.resolve`) hands each layer here once.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Args:
        ...     max_steps: int = 10
        >>> KeyTypes([Args]).typed_layer({"max_steps": "20"}, "the command line")
        {'max_steps': 20}
    """

    def __init__(self, dataclass_types: typing.Iterable[type], foreign_keys: dict[str, str] | None = None):
        self.types = field_types(dataclass_types)
        self.foreign = dict(foreign_keys or {})
        """Keys only a sibling variant accepts, each with the reason the user reads."""

    def get(self, key: str) -> Any:
        """The type of ``key``, or None for a key the stage does not have."""
        return self.types.get(key)

    def typed_layer(self, layer: dict[str, Any], source: str, *, keep_none: bool = False) -> dict[str, Any]:
        """``layer`` checked and coerced, from ``source`` (a file, or "the command line"); ``keep_none`` leaves a
        None as None (a late layer that unsets a key)."""
        where = "on" if source == CLI else "in"
        for key in layer:
            if key in self.foreign and key not in self.types:
                raise DnaConfigError(f"Key '{key}' {where} {source} {self.foreign[key]}")
        check_known_keys(layer, self.types, source)
        return {
            key: None if keep_none and value is None else coerce_value(key, value, self.types[key], source)
            for key, value in layer.items()
        }
