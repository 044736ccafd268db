"""Layered, typed configuration: ``_defaults-<Stage>.yaml`` < ``--config`` recipe < CLI flags.

A stage's configuration is the union of the fields of a few dataclasses: the TRL config
of the stage (``SFTConfig``, ``DPOConfig``, ...), TRL's ``ModelConfig`` (model path,
dtype, LoRA) and our :class:`RunArguments` (datasets, dry run, resume). The keys live
in one flat namespace, exactly like TRL's own ``TrlParser``; what we add is:

* every layer is checked: an unknown key names itself, where it came from and the
  nearest valid key; a wrong type names the key, the value and the expected type;
* YAML quirks are forgiven where they are unambiguous (``1e-5`` is a string to YAML
  1.1 but a float to us);
* the sources are remembered, so ``--dry_run`` shows which layer set each key and the
  resolved config written to the output dir can be passed back as ``--config``.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dna_factory.errors import DnaConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS_DIR = REPO_ROOT / "configs"

CLI = "the command line"


@dataclass
class RunArguments:
    """Project-level keys shared by every stage (the rest come from TRL's dataclasses)."""

    datasets: list[dict | str] | None = field(
        default=None,
        metadata={
            "help": "Training dataset mixture: a list of {path, label, split, weight, columns, max_samples, "
            "name, data_files}. See docs/datasets.md."
        },
    )
    eval_datasets: list[dict | str] | None = field(
        default=None, metadata={"help": "Optional evaluation mixture, same format as `datasets`."}
    )
    dry_run: bool = field(
        default=False,
        metadata={
            "help": "Print the resolved config, run every validator and exit, without loading anything."
        },
    )
    auto_resume: bool = field(
        default=True,
        metadata={"help": "Resume from the last checkpoint-N in output_dir when one exists."},
    )
    allow_config_change: bool = field(
        default=False,
        metadata={
            "help": "Resume although the checkpoint was trained with other settings (another stage or changed "
            "keys); only with an explicit --resume_from_checkpoint (last or a path)."
        },
    )
    wandb_project: str | None = field(
        default=None, metadata={"help": "W&B project name (sets WANDB_PROJECT when report_to has wandb)."}
    )
    log_level_console: str = field(
        default="info", metadata={"help": "Level of the project's console logging: debug, info, warning."}
    )
    server_wait_s: float = field(
        default=900.0,
        metadata={
            "help": "How long a run waits for each external server it talks to (a vLLM server, the judge, the "
            "teacher) to answer /health before it stops with an error (logged every 10 s); the data, tokenizer "
            "and model load only after they answered. --dry_run probes them once and skips those that are down."
        },
    )


@dataclass
class ResolvedConfig:
    """The result of layering and type-checking, before any dataclass is built."""

    stage: str
    values: dict[str, Any]
    sources: dict[str, str]
    recipe_path: str | None
    args: dict[type, Any] = field(default_factory=dict)
    rehearsal: Any = None  # a dna_factory.rehearsal.Rehearsal under --rehearse

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def of(self, cls: type):
        """The built dataclass instance of ``cls`` (or of its subclass)."""
        for built_cls, instance in self.args.items():
            if issubclass(built_cls, cls):
                return instance
        raise KeyError(cls)

    def render(self) -> str:
        """YAML of the layered keys, each commented with the layer that set it."""
        lines = [f"# dna-factory resolved config for stage {self.stage}"]
        for key in sorted(self.values):
            dumped = yaml.safe_dump({key: _plain(self.values[key])}, sort_keys=False, width=1000).rstrip()
            if "\n" in dumped:
                lines.append(f"# {key}: from {self.sources[key]}")
                lines.append(dumped)
            else:
                lines.append(f"{dumped}  # {self.sources[key]}")
        return "\n".join(lines) + "\n"


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# --------------------------------------------------------------------------- types


def field_types(dataclass_types: typing.Iterable[type]) -> dict[str, Any]:
    """Map every field name of the given dataclasses to its resolved type."""
    result: dict[str, Any] = {}
    for cls in dataclass_types:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.init:
                result.setdefault(f.name, hints.get(f.name, Any))
    return result


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
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
            f"{_type_name(tp)}. Change the value in {source}."
        ) from None


def suggest(key: str, valid: typing.Iterable[str]) -> str:
    """A ' Did you mean ...?' hint with the nearest valid key, or an empty string."""
    matches = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f" Did you mean '{matches[0]}'?" if matches else ""


def check_known_keys(layer: dict[str, Any], valid: typing.Iterable[str], source: str) -> None:
    valid = set(valid)
    for key in layer:
        if key not in valid:
            raise DnaConfigError(
                f"Unknown config key '{key}' in {source}.{suggest(key, valid)} "
                f"Fix or remove it (python <stage>.py --help lists every key)."
            )


# --------------------------------------------------------------------------- layers


def load_yaml(path: str | Path, what: str) -> dict[str, Any]:
    """Read a YAML mapping; a missing file or a non-mapping is a DnaConfigError."""
    path = Path(path)
    if not path.is_file():
        raise DnaConfigError(
            f"{what} '{path}' does not exist. Check the path (it is relative to {Path.cwd()})."
        )
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise DnaConfigError(f"{what} '{path}' is not valid YAML: {exc}. Fix the syntax.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DnaConfigError(f"{what} '{path}' must be a mapping of key: value, not {type(data).__name__}.")
    return data


def _wants_list(tp: Any) -> bool:
    members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return any(typing.get_origin(m) in (list, tuple) or m in (list, tuple) for m in members)


def _is_bool(tp: Any) -> bool:
    members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return bool in members


def parse_cli(argv: list[str], types_by_key: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Parse ``--key value`` / ``--key=value`` / ``--flag`` tokens into a dict (values YAML-parsed).

    Returns the flags and the value of ``--config`` (the recipe path), if any.
    """
    flags: dict[str, Any] = {}
    recipe: str | None = None
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or token == "--":
            raise DnaConfigError(
                f"Unexpected argument '{token}' on the command line. Flags look like --key value or --key=value."
            )
        key, eq, inline = token[2:].partition("=")
        key = key.replace("-", "_")
        values: list[str] = [inline] if eq else []
        i += 1
        if not eq:
            while i < len(argv) and not (
                argv[i].startswith("--") and len(argv[i]) > 2 and not _is_number(argv[i])
            ):
                values.append(argv[i])
                i += 1
        if key == "config":
            if len(values) != 1:
                raise DnaConfigError(
                    "--config takes exactly one path. Use --config configs/<Stage>/<recipe>.yaml."
                )
            recipe = values[0]
            continue
        tp = types_by_key.get(key)
        if tp is None:
            check_known_keys({key: None}, types_by_key, CLI)
        if not values:
            if _is_bool(tp):
                flags[key] = True
                continue
            raise DnaConfigError(f"Flag --{key} needs a value. Use --{key} VALUE.")
        if len(values) > 1 and not _wants_list(tp):
            raise DnaConfigError(
                f"Flag --{key} got {len(values)} values ({' '.join(values)}) but takes one. Quote the value."
            )
        if (
            _wants_list(tp)
            and len(values) == 1
            and "," in values[0]
            and values[0].lstrip()[:1] not in ("[", "{")  # a YAML flow list or mapping is parsed whole
        ):
            values = [v.strip() for v in values[0].split(",") if v.strip()]  # --key a,b means [a, b]
        parsed = [_parse_scalar(v) for v in values]
        flags[key] = (
            parsed if _wants_list(tp) and (len(values) > 1 or not isinstance(parsed[0], list)) else parsed[0]
        )
    return flags, recipe


def _is_number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        return text


def peek_value(argv: list[str], key: str) -> Any:
    """The value of ``key`` from the CLI, else from the ``--config`` recipe, else None — before full parsing.

    Used to pick a stage variant (``grpo_execution: async``) whose key set differs; the CLI wins.
    """
    for i, token in enumerate(argv):
        if token == f"--{key}" and i + 1 < len(argv):
            return _parse_scalar(argv[i + 1])
        if token.startswith(f"--{key}="):
            return _parse_scalar(token.split("=", 1)[1])
    for i, token in enumerate(argv):
        recipe = argv[i + 1] if token == "--config" and i + 1 < len(argv) else None
        if token.startswith("--config="):
            recipe = token.split("=", 1)[1]
        if recipe is not None and Path(recipe).is_file():
            return load_yaml(recipe, "Config file").get(key)
    return None


def resolve(
    stage: str,
    defaults_name: str,
    dataclass_types: typing.Sequence[type],
    argv: list[str],
    defaults_dir: Path = CONFIGS_DIR,
    foreign_keys: dict[str, str] | None = None,
    late_layer: typing.Callable[[dict[str, Any], dict[str, str], str | None], tuple[str, dict[str, Any]]]
    | None = None,
) -> ResolvedConfig:
    """Layer defaults < recipe < CLI (< ``late_layer``), check keys and types, build the dataclasses.

    ``late_layer(values, sources, recipe_path)`` sees the layered keys and returns ``(source name, keys)`` to set
    over them (``--rehearse`` uses it); it may only set keys of ``dataclass_types``.

    Raises:
        DnaConfigError: for an unknown key, a wrong type, a missing or malformed file.
    """
    types_by_key = field_types(dataclass_types)
    if foreign_keys:
        for token in argv:
            key = token[2:].split("=", 1)[0].replace("-", "_") if token.startswith("--") else None
            if key in foreign_keys and key not in types_by_key:
                raise DnaConfigError(f"Key '{key}' on {CLI} {foreign_keys[key]}")
    cli, recipe_path = parse_cli(argv, types_by_key)

    layers: list[tuple[str, dict[str, Any]]] = []
    defaults_path = defaults_dir / f"_defaults-{defaults_name}.yaml"
    if defaults_path.is_file():
        layers.append(
            (str(defaults_path.relative_to(defaults_dir.parent)), load_yaml(defaults_path, "Defaults file"))
        )
    if recipe_path is not None:
        layers.append((recipe_path, load_yaml(recipe_path, "Config file")))
    layers.append((CLI, cli))

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, layer in layers:
        if "config" in layer and source != CLI:
            raise DnaConfigError(
                f"'config' is not a key inside {source}. Pass the recipe with --config PATH."
            )
        for key in layer:
            if foreign_keys and key in foreign_keys and key not in types_by_key:
                raise DnaConfigError(f"Key '{key}' in {source} {foreign_keys[key]}")
        check_known_keys(layer, types_by_key, source)
        for key, value in layer.items():
            values[key] = coerce_value(key, value, types_by_key[key], source)
            sources[key] = source
    if late_layer is not None:
        source, layer = late_layer(values, sources, recipe_path)
        for key, value in layer.items():
            values[key] = None if value is None else coerce_value(key, value, types_by_key[key], source)
            sources[key] = source
    resolved = ResolvedConfig(stage=stage, values=values, sources=sources, recipe_path=recipe_path)
    deepspeed = values.get("deepspeed")
    if isinstance(deepspeed, str) and not deepspeed.endswith(".json"):
        raise DnaConfigError(
            f"deepspeed: {deepspeed} is not a DeepSpeed JSON config (see configs/deepspeed/). Accelerate YAML files "
            "such as configs/accelerate/zero3.yaml go to `accelerate launch --config_file`."
        )
    resolved.args = build_dataclasses(resolved, dataclass_types)
    return resolved


def build_dataclasses(resolved: ResolvedConfig, dataclass_types: typing.Sequence[type]) -> dict[type, Any]:
    """Instantiate each dataclass from its share of the flat key space."""
    built = {}
    for cls in dataclass_types:
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        kwargs = {k: v for k, v in resolved.values.items() if k in names}
        kwargs.update(_dry_run_hardware_overrides(resolved, names))
        try:
            built[cls] = cls(**kwargs)
        except (ValueError, TypeError) as exc:
            raise DnaConfigError(
                f"{cls.__name__} rejected the configuration: {str(exc).rstrip('.')}. Fix the keys it names."
            ) from None
    return built


HARDWARE_KEYS = ("bf16", "fp16", "tf32")


def _dry_run_hardware_overrides(resolved: ResolvedConfig, names: set[str]) -> dict[str, Any]:
    """A dry run checks the config, not this machine: a GPU recipe must validate on a laptop.

    transformers refuses ``bf16: true`` without a GPU at construction time, so for a dry run on a
    machine without CUDA those switches are turned off in the built object only; the printed
    config keeps the recipe's values.
    """
    if not resolved.values.get("dry_run") or not any(resolved.values.get(k) for k in HARDWARE_KEYS):
        return {}
    import torch

    if torch.cuda.is_available():
        return {}
    return {k: False for k in HARDWARE_KEYS if k in names and resolved.values.get(k)}
