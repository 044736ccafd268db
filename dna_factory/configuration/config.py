"""Layered, typed configuration: ``_defaults-<stage>.yaml`` < ``--config`` recipe < CLI flags.

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
import enum
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dna_factory.configuration.config_types import CLI, KeyTypes
from dna_factory.errors import DnaConfigError
from rewards.options import did_you_mean

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "configs"


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
    services: dict[str, Any] = field(
        default_factory=dict
    )  # what Stage.wait_for_services read from live servers

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


# --------------------------------------------------------------------------- layers


def shipped_config_hint(path: str | Path) -> str:
    """' Did you mean ...?' with the shipped config nearest to a path that does not exist, or ''.

    Case is ignored first: the recipe folders were renamed to the lower-case entry names
    (``configs/SFT/`` became ``configs/sft/``), and an old path must name its own new one.
    """
    shipped = sorted(p.relative_to(REPO_ROOT).as_posix() for p in CONFIGS_DIR.rglob("*.yaml"))
    wanted = Path(path).as_posix().removeprefix("./")
    by_case = {name.lower(): name for name in shipped}
    if wanted.lower() in by_case:
        return f" Did you mean {by_case[wanted.lower()]!r}?"
    return did_you_mean(wanted.lower(), shipped)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, first: int, second: int):
        super().__init__(f"key {key!r}")
        self.key, self.first, self.second = key, first, second


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (YAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str | int | float | bool) and key in seen:
                raise _DuplicateKey(key, seen[key], line)
            if isinstance(key, str | int | float | bool):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path, what: str) -> dict[str, Any]:
    """Read a YAML mapping; a missing file, a key given twice or a non-mapping is a DnaConfigError."""
    path = Path(path)
    if not path.is_file():
        raise DnaConfigError(
            f"{what} '{path}' does not exist.{shipped_config_hint(path)} Check the path (it is relative to "
            f"{Path.cwd()})."
        )
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 - a safe loader
    except _DuplicateKey as dup:
        raise DnaConfigError(
            f"{what} '{path}' has the key {dup.key!r} twice (line {dup.first} and line {dup.second}); YAML would "
            "keep the second silently. Keep one."
        ) from None
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


def parse_cli(argv: list[str], keys: KeyTypes) -> tuple[dict[str, Any], str | None]:
    """Parse ``--key value`` / ``--key=value`` / ``--flag`` tokens into a dict (values YAML-parsed; a key the stage
    does not have is left for :meth:`KeyTypes.typed_layer` to name, with its "did you mean").

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
                    "--config takes exactly one path. Use --config configs/<stage>/<recipe>.yaml."
                )
            recipe = values[0]
            continue
        tp = keys.get(key)
        if tp is None:  # a key the stage does not have: typed_layer names it (and what it may have meant)
            flags[key] = _parse_scalar(values[0]) if values else True
            continue
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
    keys = KeyTypes(dataclass_types, foreign_keys)
    cli, recipe_path = parse_cli(argv, keys)

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
        values.update(keys.typed_layer(layer, source))
        sources.update(dict.fromkeys(layer, source))
    if late_layer is not None:
        source, layer = late_layer(values, sources, recipe_path)
        values.update(keys.typed_layer(layer, source, keep_none=True))
        sources.update(dict.fromkeys(layer, source))
    resolved = ResolvedConfig(stage=stage, values=values, sources=sources, recipe_path=recipe_path)
    check_deepspeed_file(values.get("deepspeed"))
    resolved.args = build_dataclasses(resolved, dataclass_types)
    return resolved


def check_deepspeed_file(deepspeed: Any) -> None:
    """``deepspeed:`` names an existing DeepSpeed JSON file; checked before TRL's config refuses it less clearly."""
    if not isinstance(deepspeed, str) or not deepspeed:
        return
    if not deepspeed.endswith(".json"):
        raise DnaConfigError(
            f"deepspeed: {deepspeed} is not a DeepSpeed JSON config (see configs/deepspeed/). Accelerate YAML files "
            "such as configs/accelerate/zero3.yaml go to `accelerate launch --config_file`."
        )
    if not Path(deepspeed).is_file():
        shipped = sorted(
            f"configs/deepspeed/{path.name}" for path in (CONFIGS_DIR / "deepspeed").glob("*.json")
        )
        raise DnaConfigError(
            f"deepspeed config '{deepspeed}' does not exist.{did_you_mean(deepspeed, shipped)} Use a DeepSpeed JSON file, "
            f"e.g. one of configs/deepspeed/ ({', '.join(shipped)})."
        )


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
