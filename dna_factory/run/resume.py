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
* a fingerprint that differs (another stage, changed keys, an edited dataset file, another world size) is refused with the keys that differ, unless
  the user resumes explicitly with ``--allow_config_change``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dna_factory.errors import DnaConfigError
from dna_factory.inputs.input_fingerprint import input_differences, inputs
from dna_factory.run.run_files import LOG_HISTORY, RUN_SUMMARY, read_json, write_atomic
from rewards.options import shorten

logger = logging.getLogger(__name__)

FINGERPRINT_NAME = "run_fingerprint.json"
TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer_callback.TRAINER_STATE_NAME, written last
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")

# Keys that do not change what is optimised: where output goes, how often to log, save and evaluate,
# how long to train (raising max_steps continues a run), how to reach services, how to report.
_OPERATIONAL_PREFIXES = (
    "logging_", "save_", "eval_", "per_device_eval_", "hub_", "push_to_hub", "report_to", "run_name", "project",
    "trackio_", "output_dir", "overwrite_output_dir", "resume_from_checkpoint", "auto_resume",
    "allow_config_change", "dry_run", "wandb_", "log_", "dataloader_", "dataset_num_proc", "ddp_", "use_cpu",
    "torch_compile", "vllm_server_", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "server_wait_s",
    "checkpoint_eval", "max_steps", "num_train_epochs", "disable_tqdm", "num_completions_to_print",
    "gradient_checkpointing", "torch_empty_cache_steps", "include_", "skip_memory_metrics", "teacher_server_",
    "teacher_request_timeout", "teacher_retries", "teacher_max_concurrent_requests", "judge_", "request_timeout",
    "heartbeat_stale_after_s", "server_down_after_s", "server_probe_interval_s", "rollout_stop_timeout_s",
    "weight_sync_timeout", "max_inflight_tasks", "alarm_after_steps",
)  # fmt: skip
PATH_KEYS = ("model_name_or_path", "teacher_model_name_or_path")


def _operational(key: str) -> bool:
    return key.startswith(_OPERATIONAL_PREFIXES)


def _same_path(value: Any) -> Any:
    """A local path as its real absolute path (``./m``, ``m`` and ``/abs/m`` are one model); anything else as is."""
    if isinstance(value, str) and value and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    return value


def _plain(key: str, value: Any) -> Any:
    if key in PATH_KEYS:
        return _same_path(value)
    if key in ("datasets", "eval_datasets") and isinstance(value, list):
        return [
            {**d, "path": _same_path(d.get("path"))} if isinstance(d, dict) else _same_path(d) for d in value
        ]
    return value


def fingerprint(stage: str, values: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The stage and the effective value of every key that changes the optimisation, as plain JSON values,
    with the run's inputs (its dataset files' contents and the world size: :mod:`dna_factory.inputs.input_fingerprint`).

    ``values`` are the keys a layer set; ``defaults`` the dataclass defaults of the others, used where the two
    runs' layers set different keys (a key set to its default is no change).
    """
    keys = {k: _plain(k, values[k]) for k in sorted(values) if not _operational(k)}
    plain_defaults = {k: v for k, v in (defaults or {}).items() if not _operational(k)}
    return {
        "stage": stage,
        "keys": json.loads(json.dumps(keys, default=str)),
        "defaults": json.loads(json.dumps(plain_defaults, default=str)),
        "inputs": inputs(values),
    }


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: was -> now`` for each key whose effective value differs (``unset``: neither run knows a value), then
    each input that differs (a dataset file's contents, the world size)."""
    before, after = old.get("keys", {}), new.get("keys", {})
    fallback = {**old.get("defaults", {}), **new.get("defaults", {})}
    lines = []
    for key in sorted(set(before) | set(after)):
        was, now = before.get(key, fallback.get(key, "unset")), after.get(key, fallback.get(key, "unset"))
        if was != now:
            lines.append(f"{key}: {_short(was)} -> {_short(now)}")
    return lines + input_differences(old.get("inputs"), new.get("inputs"))


def _short(value: Any) -> str:
    return shorten(json.dumps(value) if not isinstance(value, str) else value, 60)


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


class AlreadyFinished(Exception):
    """The output dir holds this run, finished: nothing to train."""


@dataclass
class ResumePlan:
    """Where training starts: ``checkpoint`` (None: from scratch) and the wall time already spent.

    ``move_aside``: the output dir holds another run that this one starts over from (its files move to
    ``previous-<time>/`` once this run's checks passed).
    """

    checkpoint: str | None
    wall_seconds_before: float = 0.0
    config_changed: bool = False
    move_aside: bool = False


def holds_a_run(output_dir: str | Path) -> bool:
    """A complete checkpoint or a finished run's summary: something a new run must not mix with."""
    out = Path(output_dir)
    return (out / RUN_SUMMARY).is_file() or any(is_complete(c) for c in checkpoints(out))


def plan_resume(
    stage: str,
    values: dict[str, Any],
    output_dir: str,
    requested: Any,
    auto_resume: bool,
    allow_config_change: bool,
    defaults: dict[str, Any] | None = None,
) -> ResumePlan:
    """Decide where training starts (see the module docstring). Reads files only; raises DnaConfigError.

    Args:
        stage: This run's stage name.
        values: The resolved config's layered keys.
        output_dir: This run's output dir.
        requested: ``resume_from_checkpoint``: None, ``true``/``last``/``false``/``none`` or a path.
        auto_resume: Resume from the newest checkpoint when none is requested.
        allow_config_change: Resume although the fingerprint differs (an explicit resume only).
        defaults: The dataclass default of every key (see :func:`fingerprint`).
    """
    mine = fingerprint(stage, values, defaults)
    text = str(requested).lower() if requested is not None else None
    want_last = text in ("true", "last")
    fresh = text in ("false", "none") or (requested is None and not auto_resume)
    explicit_path = Path(requested) if text is not None and not (want_last or fresh) else None
    out = Path(output_dir)
    if fresh:
        return ResumePlan(None, move_aside=holds_a_run(out))

    if explicit_path is not None:
        if not is_complete(explicit_path):
            raise DnaConfigError(
                f"Checkpoint {explicit_path} has no readable {TRAINER_STATE_NAME}: its save was interrupted. "
                "Resume from an earlier checkpoint-N, or use `last` for the newest complete one."
            )
        checkpoint = explicit_path
    else:
        checkpoint = newest_complete_checkpoint(out)
        if checkpoint is None and want_last:
            raise DnaConfigError(
                f"resume_from_checkpoint={requested} but {output_dir} has no complete checkpoint-N. "
                "Drop the flag to start fresh."
            )
    finished = (out / RUN_SUMMARY).is_file() and explicit_path is None
    if checkpoint is None and not finished:
        return ResumePlan(
            None
        )  # nothing to resume or protect (at most a run that died before its first save)

    theirs = read_json(checkpoint / FINGERPRINT_NAME) if checkpoint is not None else None
    if theirs is None and explicit_path is None:
        theirs = read_json(out / FINGERPRINT_NAME)
    changed = theirs is not None and (theirs.get("stage") != stage or bool(differences(theirs, mine)))
    if changed:
        where = checkpoint.name if checkpoint is not None else RUN_SUMMARY
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
        other_stage = theirs.get("stage") != stage  # never continued: --allow_config_change is for keys
        if other_stage or not (
            (explicit_path is not None or want_last) and allow_config_change and checkpoint is not None
        ):
            ways = "Use a new output_dir for this run"
            if checkpoint is not None and not other_stage:
                ways += (
                    f", continue that one on purpose with --resume_from_checkpoint {checkpoint} "
                    "--allow_config_change"
                )
            raise DnaConfigError(
                f"{problem} {ways}, or start over in it with --resume_from_checkpoint false (its files move to "
                "previous-<time>/)."
            )
        logger.warning("%s Resuming anyway (--allow_config_change).", problem)

    if finished and not changed:
        _refuse_rerun_of_finished(out, values, checkpoint)
    if checkpoint is None:
        return ResumePlan(
            None, move_aside=True
        )  # a finished run without checkpoints, asked for more: start over
    record = read_json(checkpoint / FINGERPRINT_NAME) or {}
    if not want_last and explicit_path is None:
        logger.info("Found %s: resuming from it (set auto_resume: false to start over).", checkpoint)
    return ResumePlan(str(checkpoint), float(record.get("wall_seconds", 0.0)), changed)


def _refuse_rerun_of_finished(out: Path, values: dict[str, Any], checkpoint: Path | None) -> None:
    """Raise AlreadyFinished when ``run_summary.json`` says the run ended and this run asks for no more steps.

    Asked for: ``max_steps`` when set (> 0), else ``num_train_epochs``. A finished run that was cut short by
    its own ``max_steps`` is not finished for an epoch-based request.
    """
    summary = read_json(out / RUN_SUMMARY)
    if not summary or "global_step" not in summary:
        return
    done = int(summary["global_step"])
    if checkpoint is not None and int(_CHECKPOINT.match(checkpoint.name).group(1)) > done:
        return  # trained further after that summary was written
    before = summary.get("requested", {})
    max_steps = values.get("max_steps")
    if isinstance(max_steps, int) and max_steps > 0:
        if max_steps > done:
            return
    else:
        epochs_before = before.get("num_train_epochs")
        cut_short = isinstance(before.get("max_steps"), int) and before["max_steps"] > 0
        if (
            cut_short
            or epochs_before is None
            or float(values.get("num_train_epochs", epochs_before)) > float(epochs_before)
        ):
            return
    raise AlreadyFinished(
        f"{out} holds this run, already finished at step {done} ({RUN_SUMMARY}): nothing to train. Raise "
        "max_steps (or num_train_epochs) to train further, or use a new output_dir to start over."
    )


def move_aside(output_dir: str | Path) -> Path:
    """Move an earlier run's checkpoints and records into ``previous-<time>/`` (nothing is deleted)."""
    out = Path(output_dir)
    target = out / time.strftime("previous-%Y%m%d-%H%M%S")
    target.mkdir()
    names = {RUN_SUMMARY, FINGERPRINT_NAME, "resolved_config.yaml", LOG_HISTORY, "completions.jsonl"}
    for path in out.iterdir():
        if path.name in names or _CHECKPOINT.match(path.name) or path.name == "completions":
            path.replace(target / path.name)
    logger.warning("Starting over in %s: the earlier run's checkpoints and records moved to %s.", out, target)
    return target


def follow_umask(folder: Path) -> None:
    """Give the files of ``folder`` (not below) the mode a plain ``open()`` would: safetensors writes 0600."""

    umask = os.umask(0)
    os.umask(umask)
    mode = 0o666 & ~umask
    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 != mode:
            path.chmod(mode)


def write_fingerprint(path: Path, record: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(record, indent=2) + "\n")


# --------------------------------------------------------------------------- a full disk (#35 item 6)

_NO_SPACE = ("No space left on device", "StorageFull", "Disk quota exceeded")
_SHORT_WRITE = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")


def _mib(size: float) -> str:
    return f"{size / 2**20:.1f}"


def _tree_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _chain(exc: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    while exc is not None and exc not in found:
        found.append(exc)
        exc = exc.__cause__ or exc.__context__
    return found


def disk_full_message(exc: BaseException, output_dir: str | Path | None) -> str | None:
    """One line for a write into ``output_dir`` that failed on a full disk; None when ``exc`` is something else.

    A full disk reaches us as ``OSError(ENOSPC)`` (counted only when the failing file, if named, is in
    ``output_dir``: a full ``/dev/shm`` is another story), as safetensors' ``StorageFull``, or as torch's zip
    writer's short write ("unexpected pos", "PytorchStreamWriter failed"), which says nothing of the cause: that
    one counts only while a checkpoint newer than the last complete one is half-written and less room is left than
    the last checkpoint took. The line names the free space, the checkpoint being written (incomplete, skipped on
    resume), the size of a checkpoint, and the last complete one, which a rerun resumes from.
    """
    if output_dir is None:
        return None
    try:
        return _disk_full_message(exc, Path(output_dir))
    except OSError:  # a checkpoint rotated away while we looked: no diagnosis, the original error stands
        return None


def _disk_full_message(exc: BaseException, out: Path) -> str | None:
    usage = shutil.disk_usage(out if out.exists() else out.parent)
    chain = _chain(exc)
    no_space = False
    for e in chain:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            filename = getattr(e, "filename", None)
            no_space = no_space or filename is None or out.resolve() in Path(filename).resolve().parents
        elif not isinstance(e, OSError) and any(text in str(e) for text in _NO_SPACE):
            no_space = True
    complete = next((c for c in checkpoints(out) if is_complete(c)), None)
    done = int(complete.name.split("-")[1]) if complete is not None else -1
    newer = [c for c in checkpoints(out) if int(c.name.split("-")[1]) > done]
    size = _tree_size(complete) if complete is not None else None
    short_write = any(
        isinstance(e, RuntimeError) and any(text in str(e) for text in _SHORT_WRITE) for e in chain
    )
    if not no_space and not (short_write and newer and size is not None and usage.free < size):
        return None
    writing = (
        f" while writing {newer[0]}, which is incomplete and skipped on resume (delete it)" if newer else ""
    )
    if size is not None:
        need = f"a checkpoint takes about {_mib(size)} MiB"
    elif newer:
        need = f"a checkpoint takes more than {_mib(_tree_size(newer[0]))} MiB"
    else:
        need = "a checkpoint needs more"
    kept = (
        f"{complete} is the last complete checkpoint, and a rerun resumes from it"
        if complete is not None
        else "no checkpoint is complete yet, so a rerun starts over"
    )
    return (
        f"the disk holding {out} is full ({_mib(usage.free)} MiB free of {_mib(usage.total)} MiB){writing}; "
        f"{need}. {kept}: free space there (or set save_total_limit, or another output_dir) and rerun."
    )
