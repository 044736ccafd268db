"""Ctrl-C and SIGTERM (SLURM preemption) during training: finish the step, save a checkpoint, stop.

The first SIGINT or SIGTERM sets a flag; at the end of the current optimiser step
:class:`GracefulStop` asks the Trainer to save ``checkpoint-N`` and stop, and the runner exits with
one line saying how to resume (status 128 + the signal). A second signal stops at once
(:class:`Interrupted` without a step): the newest checkpoint already on disk is the resume point.
:func:`stop_requested` lets checkpoint eval skip the checkpoint saved on the signal (an eval would
outlast SLURM's grace period). With several
processes the flag is agreed on by all of them at every step (one all-reduce of one number), so all
ranks save the same step.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _report_interval() -> float:
    try:
        value = float(os.environ.get("DNA_STOP_REPORT_S", "30"))
    except ValueError:
        return 30.0
    return value if value > 0 else 0.0


STOP_REPORT_S = _report_interval()
"""While a stop takes longer than this, the log says every this many seconds what the process is doing
(``DNA_STOP_REPORT_S``; 0 turns the report off)."""
_PACKAGES = ("dna_factory", "rewards", "trl", "transformers", "accelerate", "torch", "vllm")


_requested: list[tuple[int, float]] = []  # (signal, monotonic time) of each stop request this process got


def stop_requested() -> bool:
    """True once SIGINT or SIGTERM asked this training process to stop (checkpoint eval skips its work then)."""
    return bool(_requested)


def note_stop_request(signum: int) -> None:
    """Record that this process was asked to stop on ``signum`` (:class:`~dna_factory.run.run_callbacks.GracefulStop`);
    the reporter thread (:func:`start_stop_reporter`) says what a stop that takes long waits for."""
    _requested.append((signum, time.monotonic()))


def start_stop_reporter() -> None:
    """Start (once, outside any signal handler) the thread that reports a stop taking longer than STOP_REPORT_S."""
    global _reporter
    if _reporter is None and STOP_REPORT_S > 0:
        _reporter = threading.Thread(
            target=_report_slow_stop, args=(threading.main_thread().ident,), name="stop-report", daemon=True
        )
        _reporter.start()


_reporter: threading.Thread | None = None


def where(thread_id: int | None) -> str:
    """Where a thread is: its innermost frame, and the innermost one in code of ours or our libraries, if other."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return "unknown"
    inner = frame
    known = None
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if known is None and any(part in _PACKAGES or part == "tests" for part in path.parts):
            known = frame
        frame = frame.f_back
    text = f"{inner.f_code.co_name} ({Path(inner.f_code.co_filename).name}:{inner.f_lineno})"
    if known is not None and known is not inner:
        text += f", called from {known.f_code.co_name} ({known.f_code.co_filename}:{known.f_lineno})"
    return text


def _report_slow_stop(thread_id: int | None) -> None:
    reported = 0.0
    while True:
        time.sleep(min(1.0, STOP_REPORT_S))
        if not _requested:
            continue
        signum, started = _requested[0]
        waited = time.monotonic() - started
        if waited - reported < STOP_REPORT_S:
            continue
        reported = waited
        logger.warning(
            "%s: still stopping after %.0f s (the step in progress finishes first, then a checkpoint is saved); the "
            "main thread is in %s.",
            signal.Signals(signum).name,
            waited,
            where(thread_id),
        )
