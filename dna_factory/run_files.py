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

import json
import re
from pathlib import Path
from typing import Any

RUN_SUMMARY = "run_summary.json"
LOG_HISTORY = "log_history.json"
EVAL_RESULTS = "eval_results.jsonl"
DONE = "DONE.json"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through ``<path>.tmp`` and a rename: a reader sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


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
