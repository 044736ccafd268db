"""The files a run leaves in its output dir, their names, one atomic writer and the readers.

=========================  =====================================================  ===========================
file                       written by                                              read by
=========================  =====================================================  ===========================
``run_summary.json``       the runner, when training ends                          resume, the pipeline report
``log_history.json``       the runner, when training ends (``checkpoint-N/``'s      the report, plot_run.py
                           ``trainer_state.json`` holds it while a run is going)
``eval_results.jsonl``     checkpoint evaluation, one row per evaluated step       the report, plot_run.py
``DONE.json``              the pipeline, when a stage finished (its outputs)       the pipeline, the report
=========================  =====================================================  ===========================

Example:
    >>> import tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> write_atomic(run / LOG_HISTORY, '[{"step": 1, "loss": 2.0}]')
    >>> train_history(run), eval_rows(run), read_json(run / RUN_SUMMARY)
    ([{'step': 1, 'loss': 2.0}], [], None)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

RUN_SUMMARY = "run_summary.json"
LOG_HISTORY = "log_history.json"
EVAL_RESULTS = "eval_results.jsonl"
DONE = "DONE.json"


def write_atomic(path: str | os.PathLike[str], text: str | Iterable[str]) -> None:
    """Write ``text`` (a string, or chunks of one) to ``path`` through a temporary file in the same folder and a
    rename: a reader sees the old file or the whole new one, never a half-written one. The temporary file is
    removed when writing fails; the new file's mode follows the umask, as a plain ``open()``'s would."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        with contextlib.suppress(OSError):  # mkstemp makes 0600; some network filesystems refuse chmod
            os.fchmod(handle, 0o666 & ~umask)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            for chunk in [text] if isinstance(text, str) else text:
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_json(path: Path) -> Any:
    """The file's JSON, or None when it is missing or unreadable (a run still going, a run killed mid-write)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def train_history(run: Path) -> list[dict]:
    """The trainer's logged rows: ``log_history.json``, else the newest ``checkpoint-N``'s; [] before any."""
    final = read_json(run / LOG_HISTORY)
    if isinstance(final, list):
        return final
    states = sorted(
        run.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(re.sub(r"\D", "", p.parent.name) or 0)
    )
    state = read_json(states[-1]) if states else None
    return list(state.get("log_history", [])) if isinstance(state, dict) else []


def eval_rows(run: Path) -> list[dict]:
    """The successful rows of ``eval_results.jsonl`` (a row with ``error`` failed), in step order."""
    path = run / EVAL_RESULTS
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if "error" not in r), key=lambda r: r.get("eval/step", 0))
