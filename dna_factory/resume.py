"""Resume that never does the wrong thing (docs/configuration.md, "Output dir, resume").

Every checkpoint carries ``run_fingerprint.json``: what makes a run the same run (the stage and
every key a layer set, less the ones that only say where output goes, how often to log, save or
evaluate, how long to train and where services are) and the wall time spent up to that step. The
output dir holds the same fingerprint from the moment a run's checks passed. Before anything loads,
:func:`plan_resume` reads an existing output dir and decides:

* a finished run (``run_summary.json`` is written only when training ends) that is asked for no more
  steps is not trained again: :class:`AlreadyFinished`;
* the newest checkpoint without ``trainer_state.json`` (what a kill during a save leaves; Transformers
  writes that file last) is skipped, with a warning, for the newest complete one;
* a fingerprint that differs (another stage, changed keys) is refused with the keys that differ, unless
  the user resumes explicitly with ``--allow_config_change``.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from dna_factory.errors import DnaConfigError

logger = logging.getLogger(__name__)

FINGERPRINT_NAME = "run_fingerprint.json"
SUMMARY_NAME = "run_summary.json"
TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer_callback.TRAINER_STATE_NAME, written last
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")

# Keys that do not change what is optimised: where output goes, how often to log, save and evaluate,
# how long to train (raising max_steps continues a run), how to reach services, how to report.
_OPERATIONAL_PREFIXES = (
    "logging_", "save_", "eval_", "per_device_eval_", "hub_", "push_to_hub", "report_to", "run_name",
    "output_dir", "overwrite_output_dir", "resume_from_checkpoint", "auto_resume", "allow_config_change",
    "dry_run", "wandb_", "log_", "dataloader_", "vllm_server_", "server_wait_s", "checkpoint_eval",
    "max_steps", "num_train_epochs", "disable_tqdm", "num_completions_to_print", "gradient_checkpointing",
    "torch_empty_cache_steps", "include_", "skip_memory_metrics", "teacher_server_", "judge_",
)  # fmt: skip


def _operational(key: str) -> bool:
    return key.startswith(_OPERATIONAL_PREFIXES)


def fingerprint(stage: str, values: dict[str, Any]) -> dict[str, Any]:
    """The stage and every key a layer set that changes the optimisation, as plain JSON values."""
    keys = {k: values[k] for k in sorted(values) if not _operational(k)}
    return {"stage": stage, "keys": json.loads(json.dumps(keys, default=str))}


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: was -> now`` for each differing key (``unset`` where a side has no value)."""
    before, after = old.get("keys", {}), new.get("keys", {})
    lines = []
    for key in sorted(set(before) | set(after)):
        if before.get(key, "unset") != after.get(key, "unset"):
            lines.append(f"{key}: {_short(before.get(key, 'unset'))} -> {_short(after.get(key, 'unset'))}")
    return lines


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def checkpoints(output_dir: str | Path) -> list[Path]:
    """``checkpoint-N`` folders of ``output_dir``, newest (highest N) first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [p for p in out.iterdir() if p.is_dir() and _CHECKPOINT.match(p.name)]
    return sorted(found, key=lambda p: int(_CHECKPOINT.match(p.name).group(1)), reverse=True)


def is_complete(checkpoint: Path) -> bool:
    try:
        json.loads((checkpoint / TRAINER_STATE_NAME).read_text())
    except (OSError, ValueError):
        return False
    return True


def newest_complete_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest checkpoint with a readable ``trainer_state.json``; incomplete newer ones are logged and skipped."""
    for checkpoint in checkpoints(output_dir):
        if is_complete(checkpoint):
            return checkpoint
        logger.warning(
            "%s is incomplete (no readable %s: a save was interrupted); skipping it.",
            checkpoint,
            TRAINER_STATE_NAME,
        )
    return None


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class AlreadyFinished(Exception):
    """The output dir holds this run, finished: nothing to train."""


@dataclass
class ResumePlan:
    """Where training starts: ``checkpoint`` (None: from scratch) and the wall time already spent."""

    checkpoint: str | None
    wall_seconds_before: float = 0.0
    config_changed: bool = False


def plan_resume(
    stage: str,
    values: dict[str, Any],
    output_dir: str,
    requested: Any,
    auto_resume: bool,
    allow_config_change: bool,
) -> ResumePlan:
    """Decide where training starts (see the module docstring). Reads files only; raises DnaConfigError.

    Args:
        stage: This run's stage name.
        values: The resolved config's layered keys.
        output_dir: This run's output dir.
        requested: ``resume_from_checkpoint``: None, a bool, ``true``/``last``/``false``/``none`` or a path.
        auto_resume: Resume from the newest checkpoint when none is requested.
        allow_config_change: Resume although the fingerprint differs (an explicit resume only).
    """
    mine = fingerprint(stage, values)
    explicit_path = None
    want_last = requested is True or (isinstance(requested, str) and requested.lower() in ("true", "last"))
    if isinstance(requested, str) and requested.lower() not in ("true", "last", "false", "none"):
        explicit_path = Path(requested)
    fresh = requested is False or (isinstance(requested, str) and requested.lower() in ("false", "none"))
    if fresh or (requested is None and not auto_resume):
        return ResumePlan(None)

    if explicit_path is not None:
        if not is_complete(explicit_path):
            raise DnaConfigError(
                f"Checkpoint {explicit_path} has no readable {TRAINER_STATE_NAME}: its save was interrupted. "
                "Resume from an earlier checkpoint-N, or use `last` for the newest complete one."
            )
        checkpoint = explicit_path
    else:
        checkpoint = newest_complete_checkpoint(output_dir)
        if checkpoint is None and want_last:
            raise DnaConfigError(
                f"resume_from_checkpoint={requested} but {output_dir} has no complete checkpoint-N. "
                "Drop the flag to start fresh."
            )

    out = Path(output_dir)
    theirs = None
    if checkpoint is not None:
        theirs = read_json(checkpoint / FINGERPRINT_NAME)
    if theirs is None and explicit_path is None:
        theirs = read_json(out / FINGERPRINT_NAME)
    changed = False
    if theirs is not None and {k: theirs.get(k) for k in mine} != mine:
        changed = True
        where = checkpoint.name if checkpoint is not None else "its files"
        if theirs.get("stage") != stage:
            problem = (
                f"output_dir {output_dir} holds a {theirs.get('stage')} run ({where}) and this is {stage}: "
                "resuming would continue another stage's training."
            )
        else:
            problem = (
                f"output_dir {output_dir} holds a run ({where}) whose settings differ from this one's: "
                f"{'; '.join(differences(theirs, mine))}."
            )
        explicit = explicit_path is not None or want_last
        if not (explicit and allow_config_change):
            target = checkpoint if checkpoint is not None else "last"
            raise DnaConfigError(
                f"{problem} Use a new output_dir for this run, or continue that one on purpose with "
                f"--resume_from_checkpoint {target} --allow_config_change."
            )
        logger.warning("%s Resuming anyway (--allow_config_change).", problem)

    if explicit_path is None and not changed:
        _refuse_rerun_of_finished(out, values, checkpoint)
    if checkpoint is None:
        return ResumePlan(None)
    record = read_json(checkpoint / FINGERPRINT_NAME) or {}
    if not want_last and explicit_path is None:
        logger.info("Found %s: resuming from it (set auto_resume: false to start over).", checkpoint)
    return ResumePlan(str(checkpoint), float(record.get("wall_seconds", 0.0)), changed)


def _refuse_rerun_of_finished(out: Path, values: dict[str, Any], checkpoint: Path | None) -> None:
    """Raise AlreadyFinished when ``run_summary.json`` says the run ended and no more steps are asked for."""
    summary = read_json(out / SUMMARY_NAME)
    if not summary or "global_step" not in summary:
        return
    done = int(summary["global_step"])
    if checkpoint is not None and int(_CHECKPOINT.match(checkpoint.name).group(1)) > done:
        return  # trained further after that summary was written
    max_steps = values.get("max_steps")
    if isinstance(max_steps, int) and max_steps > 0:
        if max_steps > done:
            return
    else:
        asked = summary.get("requested", {}).get("num_train_epochs")
        if asked is None or float(values.get("num_train_epochs", asked)) > float(asked):
            return
    raise AlreadyFinished(
        f"{out} holds this run, already finished at step {done} ({SUMMARY_NAME}): nothing to train. Raise "
        "max_steps (or num_train_epochs) to train further, or use a new output_dir to start over."
    )


def write_fingerprint(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)


class FingerprintCallback(TrainerCallback):
    """Writes the run's fingerprint and the wall time so far into every checkpoint it saves."""

    def __init__(self, record: dict[str, Any], wall_seconds_before: float, started: float | None = None):
        self.record = record
        self.wall_seconds_before = wall_seconds_before
        self.started = time.time() if started is None else started

    def wall_seconds(self) -> float:
        return round(self.wall_seconds_before + time.time() - self.started, 2)

    def on_save(self, args, state, control, **kwargs):
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and checkpoint.is_dir():
            write_fingerprint(
                checkpoint / FINGERPRINT_NAME, {**self.record, "wall_seconds": self.wall_seconds()}
            )
