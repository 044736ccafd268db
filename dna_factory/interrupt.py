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
import signal

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


_requested: list[int] = []  # the signal this process was asked to stop on, once one arrived


def stop_requested() -> bool:
    """True once SIGINT or SIGTERM asked this training process to stop (checkpoint eval skips its work then)."""
    return bool(_requested)


def note_stop_request(signum: int) -> None:
    """Record that this process was asked to stop on ``signum`` (:class:`~dna_factory.run_callbacks.GracefulStop`)."""
    _requested.append(signum)
