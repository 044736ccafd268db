"""Which pipeline stages are done, by what they were trained from (#35 item 3).

A stage is done only while what it was trained from is still what is upstream. Before a stage trains, the
pipeline writes ``pipeline_inputs.json`` into its folder, and its ``DONE.json`` repeats it with a ``run_id``
of its own:

* ``fingerprint``: its resolved config as the run fingerprint sees it (:func:`dna_factory.run.resume.fingerprint`:
  every key that changes the optimisation, less the model paths, which the next two cover) with its dataset
  files' contents (:mod:`dna_factory.inputs.input_fingerprint`);
* ``upstream``: the ``run_id`` of each stage it builds on (the previous stage, and any ``${stage}`` its
  overrides name);
* ``model``: for a stage that starts from a model of its own (``model:``, or the recipe's first model), that
  folder's files (weights by size and mtime, small files by content), or the hub id.

A stage whose record differs from what is upstream now, or one after a stage that trains again, reruns from
scratch (its earlier run moves to ``previous-<time>/``, the runner's start-over), and every stage after it
follows; the log and ``--dry_run`` say why. A record written before this existed (no inputs) is trusted.
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dna_factory.configuration.config_types import dataclass_defaults
from dna_factory.inputs.input_fingerprint import file_differences, model_records
from dna_factory.pipeline.recipe import DONE, REFERENCE, Pipeline, PipelineStage, model_reference
from dna_factory.run.resume import PATH_KEYS, differences, fingerprint
from dna_factory.run.run_files import read_json, write_atomic

INPUTS = "pipeline_inputs.json"


@dataclass
class StageState:
    """``done`` (skipped), ``rerun`` (trained again from scratch, ``why``), ``resume`` (an interrupted run of
    the same inputs) or ``run`` (nothing there yet)."""

    state: str
    why: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.state == "rerun":
            return "reruns from scratch: " + "; ".join(self.why)
        return {"done": "done: skipped", "resume": "resumes its last checkpoint", "run": "runs"}[self.state]


def dependencies(pipeline: Pipeline, stage: PipelineStage) -> list[PipelineStage]:
    """The earlier stages ``stage`` builds on: the previous one (unless it has a ``model:`` of its own) and each
    ``${name}`` its ``model:`` and overrides name."""
    earlier = [s for s in pipeline.stages if s.index < stage.index]
    named = json.dumps([stage.model, stage.overrides])
    referenced = [s for s in earlier if f"${{{s.name}}}" in named]
    previous = [] if stage.model or not earlier else [earlier[-1]]
    return referenced + [s for s in previous if s not in referenced]


def _config_fingerprint(stage: PipelineStage, cfg: Any) -> dict[str, Any]:

    chained = {
        key for key, value in stage.overrides.items() if isinstance(value, str) and REFERENCE.search(value)
    }
    values = {k: v for k, v in cfg.values.items() if k not in PATH_KEYS and k not in chained}
    record = fingerprint(stage.entry, values, dataclass_defaults(cfg.args))
    record["inputs"].pop("world_size", None)  # the pipeline's own process; the stage's runner checks its own
    return record


def stage_inputs(pipeline: Pipeline, stage: PipelineStage, cfg: Any) -> dict[str, Any]:
    """What ``stage`` trains from now (see the module docstring)."""
    root = pipeline.output_dir
    upstream = {}
    for dependency in dependencies(pipeline, stage):
        done = read_json(dependency.output_dir(root) / DONE) or {}
        upstream[dependency.name] = done.get("run_id")
    own = (
        None
        if model_reference(stage)
        else stage.model or (pipeline.model_name_or_path if stage.index == 1 else None)
    )
    return {
        "fingerprint": _config_fingerprint(stage, cfg),
        "upstream": upstream,
        "model": model_records(own) if own else None,
    }


def _why(recorded: dict[str, Any], now: dict[str, Any], pipeline: Pipeline, retrained: set[str]) -> list[str]:
    why = []
    by_name = {s.name: s for s in pipeline.stages}
    for name, run_id in now["upstream"].items():
        where = f"stage {by_name[name].index} ({name})"
        if name in retrained:
            why.append(f"{where} trains again first")
        elif name in recorded.get("upstream", {}) and recorded["upstream"][name] != run_id:
            why.append(f"{where} was trained again since")
    old_fp, new_fp = recorded.get("fingerprint"), now["fingerprint"]
    if old_fp is not None:
        if old_fp.get("stage") != new_fp.get("stage"):
            why.append(f"its entry changed: {old_fp.get('stage')} -> {new_fp.get('stage')}")
        changed = differences(old_fp, new_fp)
        if changed:
            why.append("its settings changed: " + ", ".join(changed))
    was, model = recorded.get("model"), now["model"]
    if was is not None and model is not None:
        if isinstance(was, str) or isinstance(model, str):
            if was != model:
                why.append(f"its model changed: {was} -> {model}")
        else:
            why += file_differences(was, model, "its model's file")
    return why


def state_of(pipeline: Pipeline, stage: PipelineStage, cfg: Any, retrained: set[str]) -> StageState:
    """Where ``stage`` stands, given the stages that train (again) before it in this run (``retrained``)."""
    out = stage.output_dir(pipeline.output_dir)
    done = read_json(out / DONE)
    recorded = (done or {}).get("inputs") or read_json(out / INPUTS)
    if recorded:
        why = _why(recorded, stage_inputs(pipeline, stage, cfg), pipeline, retrained)
    else:  # a stage recorded before inputs were: only a stage before it that trains again makes it stale
        why = [f"stage {d.index} ({d.name}) trains again first" for d in dependencies(pipeline, stage)
               if d.name in retrained]  # fmt: skip
    if why and (done is not None or _holds_a_run(out)):
        return StageState("rerun", why)
    if done is not None:
        return StageState("done")
    return StageState("resume" if _holds_a_run(out) else "run")


def _holds_a_run(out: Path) -> bool:
    return any(out.glob("checkpoint-*")) or (out / "run_summary.json").is_file()


def plan(pipeline: Pipeline, selected: list[PipelineStage], cfgs: dict[str, Any]) -> dict[str, StageState]:
    """Every selected stage's state before anything runs (what ``--dry_run`` prints)."""
    states: dict[str, StageState] = {}
    retrained: set[str] = set()
    for stage in selected:
        states[stage.name] = state_of(pipeline, stage, cfgs[stage.name], retrained)
        if states[stage.name].state != "done":
            retrained.add(stage.name)
    return states


def start_over(stage: PipelineStage, root: Path) -> None:
    """Before a stale stage trains again: drop its done marker and merged model (what its last run made) and
    ask the runner to start over (it moves the earlier checkpoints and records to ``previous-<time>/``)."""
    out = stage.output_dir(root)
    (out / DONE).unlink(missing_ok=True)
    shutil.rmtree(out / "merged", ignore_errors=True)
    stage.overrides["resume_from_checkpoint"] = False


def record_inputs(stage: PipelineStage, root: Path, inputs: dict[str, Any]) -> None:
    """Write what the stage trains from into its folder, before it trains."""
    out = stage.output_dir(root)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / INPUTS, json.dumps(inputs, indent=2) + "\n")


def done_record(inputs: dict[str, Any]) -> dict[str, Any]:
    """The part of ``DONE.json`` that says what the stage was trained from, with a new ``run_id``."""
    return {"run_id": uuid.uuid4().hex, "inputs": inputs}
