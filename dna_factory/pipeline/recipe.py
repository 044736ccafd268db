"""A pipeline recipe: its stages, their overrides and ``${stage}`` references, read and checked.

``configs/recipes/*.yaml`` (docs/pipeline.md): ``load_pipeline`` checks every key and reference;
``apply_cli_overrides`` adds ``--set KEY=VALUE`` and ``--output_dir``; ``stage_argv`` is the command
line a stage runs with.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dna_factory.configuration.config import load_yaml, shipped_config_hint
from dna_factory.errors import DnaConfigError
from dna_factory.run import run_files
from dna_factory.stages import STAGE_MODULES
from rewards.options import did_you_mean

ENTRIES = tuple(STAGE_MODULES)
RECIPE_KEYS = {
    "name",
    "description",
    "output_dir",
    "model_name_or_path",
    "overrides",
    "launcher",
    "stages",
    "eval_server",
}
EVAL_SERVER_KEYS = {"model", "args", "devices"}
STAGE_KEYS = {
    "name",
    "entry",
    "config",
    "overrides",
    "merge_adapter",
    "launcher",
    "gpus",
    "env",
    "description",
    "model",
}
REFERENCE = re.compile(r"\$\{([A-Za-z0-9_.-]+)\}")  # "${stage}" in overrides: that stage's final model
DONE = run_files.DONE


@dataclass
class PipelineStage:
    index: int
    name: str
    entry: str
    config: str
    overrides: dict[str, Any] = field(default_factory=dict)
    merge_adapter: bool = True
    launcher: list[str] = field(default_factory=list)
    gpus: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    description: str = ""
    model: str | None = None
    flags: list[str] = field(default_factory=list)  # bare flags for the entry script (``--rehearse``)

    def output_dir(self, root: Path) -> Path:
        return root / f"{self.index}-{self.name}"


@dataclass
class Pipeline:
    name: str
    output_dir: Path
    model_name_or_path: str
    stages: list[PipelineStage]
    description: str = ""
    eval_server: dict[str, str] | None = None  # one vLLM server for every stage's checkpoint evals


def _check_keys(mapping: dict, valid: set[str], where: str) -> None:
    for key in mapping:
        if key not in valid:
            raise DnaConfigError(
                f"Unknown key '{key}' in {where}.{did_you_mean(key, valid)} Valid: {', '.join(sorted(valid))}."
            )


def _launcher(value, where: str) -> list[str]:
    """A ``launcher:`` as argv words: a list, or one string split on spaces; none is ``[]``."""
    if value is None:
        return []
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list) and all(isinstance(word, (str, int, float)) for word in value):
        return [str(word) for word in value]
    raise DnaConfigError(
        f"{where}: `launcher:` must be a list of words (e.g. [accelerate, launch, --config_file, F]) or one "
        f"string, not {value!r}."
    )


def load_pipeline(path: str | Path) -> Pipeline:
    """Parse and check a pipeline recipe (not the stages' own configs: see :func:`validate`)."""
    raw = load_yaml(path, "Pipeline recipe")
    _check_keys(raw, RECIPE_KEYS, str(path))
    stages_raw = raw.get("stages")
    if not isinstance(stages_raw, list) or not stages_raw:
        raise DnaConfigError(f"{path} needs `stages:`, a list of {{name, entry, config}} mappings.")
    if not raw.get("model_name_or_path"):
        raise DnaConfigError(f"{path} needs `model_name_or_path:`, the model the first stage starts from.")
    common = raw.get("overrides") or {}
    if not isinstance(common, dict):
        raise DnaConfigError(f"{path}: `overrides:` must be a mapping of config keys to values.")
    shared_launcher = _launcher(raw.get("launcher"), str(path))
    stages, names = [], set()
    for i, entry in enumerate(stages_raw, start=1):
        where = f"{path} stage {i}"
        if not isinstance(entry, dict):
            raise DnaConfigError(f"{where} must be a mapping with name, entry and config.")
        _check_keys(entry, STAGE_KEYS, where)
        for required in ("name", "entry", "config"):
            if not entry.get(required):
                raise DnaConfigError(f"{where} needs `{required}:`.")
        if entry["entry"] not in ENTRIES:
            raise DnaConfigError(
                f"{where} has entry '{entry['entry']}'.{did_you_mean(entry['entry'], ENTRIES)} Use one of: {', '.join(ENTRIES)}."
            )
        if entry["name"] in names:
            raise DnaConfigError(
                f"{where}: stage name '{entry['name']}' is used twice. Stage names must be unique."
            )
        names.add(entry["name"])
        if not Path(entry["config"]).is_file():
            raise DnaConfigError(
                f"{where}: config '{entry['config']}' does not exist.{shipped_config_hint(entry['config'])}"
            )
        launcher = _launcher(entry["launcher"], where) if "launcher" in entry else list(shared_launcher)
        stages.append(
            PipelineStage(
                index=i,
                name=str(entry["name"]),
                entry=entry["entry"],
                config=str(entry["config"]),
                overrides={**common, **(entry.get("overrides") or {})},
                merge_adapter=bool(entry.get("merge_adapter", True)),
                launcher=launcher,
                gpus={k: str(v) for k, v in (entry.get("gpus") or {}).items()},
                env={k: str(v) for k, v in (entry.get("env") or {}).items()},
                description=str(entry.get("description", "")),
                model=str(entry["model"]) if entry.get("model") else None,
            )
        )
    check_references(stages, str(path))
    return Pipeline(
        name=str(raw.get("name") or Path(path).stem),
        output_dir=Path(raw.get("output_dir") or f"outputs/pipeline-{Path(path).stem}"),
        model_name_or_path=str(raw["model_name_or_path"]),
        stages=stages,
        description=str(raw.get("description", "")),
        eval_server=_eval_server(raw.get("eval_server"), raw["model_name_or_path"], str(path)),
    )


def _eval_server(value: Any, model: str, where: str) -> dict[str, str] | None:
    """``eval_server: {model, args, devices}``: every key optional; ``model`` defaults to the recipe's model."""
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise DnaConfigError(
            f'{where}: `eval_server:` must be a mapping such as {{model: M, args: "--max-model-len 4096"}}, '
            f"not {value!r}."
        )
    _check_keys(value, EVAL_SERVER_KEYS, f"{where} eval_server")
    spec = {"model": str(value.get("model") or model), "args": str(value.get("args") or "")}
    if value.get("devices") is not None:
        spec["devices"] = str(value["devices"])
    return spec


def model_reference(stage: PipelineStage) -> str | None:
    """The earlier stage a ``model: ${name}`` names (the stage starts from that stage's final model), else None."""
    match = REFERENCE.fullmatch(stage.model or "")
    return match.group(1) if match else None


def check_references(stages: list[PipelineStage], where: str) -> None:
    """Every ``${name}`` in a stage's ``model:`` and overrides names an earlier stage."""
    for stage in stages:
        if stage.model and REFERENCE.search(stage.model) and not model_reference(stage):
            raise DnaConfigError(
                f"{where} stage {stage.index} ({stage.name}) has model: {stage.model}; write a path, or one "
                "reference to an earlier stage, e.g. model: ${sft}."
            )
        for value in [stage.model or "", *stage.overrides.values()]:
            for ref in REFERENCE.findall(str(value)):
                earlier = [s.name for s in stages if s.index < stage.index]
                if ref not in earlier:
                    raise DnaConfigError(
                        f"{where} stage {stage.index} ({stage.name}) refers to ${{{ref}}}, which is not an earlier "
                        f"stage.{did_you_mean(ref, earlier)} Earlier stages: {', '.join(earlier) or '(none)'}."
                    )


def set_keys(assignments: list[str]) -> set[str]:
    """The keys that ``--set KEY=VALUE`` assignments name."""
    return {a.partition("=")[0].strip().removeprefix("--") for a in assignments}


def apply_cli_overrides(pipeline: Pipeline, assignments: list[str], output_dir: str | None) -> None:
    """``--set KEY=VALUE`` (YAML value) into every stage's overrides, and ``--output_dir``."""
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or not key:
            raise DnaConfigError(f"--set {assignment!r}: write it as KEY=VALUE, e.g. --set max_steps=2.")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            raise DnaConfigError(f"--set {assignment!r}: the value is not valid YAML ({exc}).") from None
        for stage in pipeline.stages:
            stage.overrides[key] = value
    if assignments:
        check_references(pipeline.stages, "--set: in")
    if output_dir:
        pipeline.output_dir = Path(output_dir)


def _flag_value(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def stage_argv(
    stage: PipelineStage, model: str, root: Path, models: dict[str, str] | None = None
) -> list[str]:
    """The stage's command-line arguments (after ``<entry>.py``); ``${name}`` becomes that stage's model."""
    argv = [
        "--config",
        stage.config,
        "--model_name_or_path",
        model,
        "--output_dir",
        str(stage.output_dir(root)),
    ]
    for key, value in stage.overrides.items():
        if isinstance(value, str) and models:
            value = REFERENCE.sub(lambda m: models[m.group(1)], value)
        argv.append(f"--{key}={_flag_value(value)}")  # "=": a value may itself start with "--"
    return argv + stage.flags


def input_model(pipeline: Pipeline, stage: PipelineStage) -> str:
    """The model a stage starts from: its own ``model:`` (a path, or ``${name}``: that stage's final model), else
    the previous stage's final model."""
    reference = model_reference(stage)
    if reference:
        return final_model(next(s for s in pipeline.stages if s.name == reference), pipeline.output_dir)
    if stage.model:
        return stage.model
    previous = [s for s in pipeline.stages if s.index == stage.index - 1]
    return final_model(previous[0], pipeline.output_dir) if previous else pipeline.model_name_or_path


def final_model(stage: PipelineStage, root: Path) -> str:
    """Where the next stage finds this stage's model (recorded in DONE.json)."""
    done = stage.output_dir(root) / DONE
    if done.is_file():
        return json.loads(done.read_text())["model"]
    return str(stage.output_dir(root))
