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

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


_requested: list[int] = []  # the signal this process was asked to stop on, once one arrived


def stop_requested() -> bool:
    """True once SIGINT or SIGTERM asked this training process to stop (checkpoint eval skips its work then)."""
    return bool(_requested)


class Interrupted(KeyboardInterrupt):  # a KeyboardInterrupt: no `except Exception` on the way swallows it
    """Training stopped on a signal: after saving ``checkpoint`` (at ``step``), or at once on a second signal
    (``step`` None). ``status`` is the process exit status, 128 + the signal."""

    def __init__(self, signum: int, step: int | None, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.status = 128 + signum
        name = signal.Signals(signum).name
        super().__init__(f"{name} at step {step}" if step is not None else f"{name} again: stopped at once")


class GracefulStop(TrainerCallback):
    """Install with :meth:`install` around ``trainer.train()``; :meth:`restore` puts the old handlers back."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        self._pid = os.getpid()  # dataloader workers fork with this handler; only this process acts on it
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            return
        if self.signum is not None:
            self.restore()
            raise Interrupted(signum, None, None)
        self.signum = signum
        _requested.append(signum)
        logger.warning(
            "%s: finishing this step and saving a checkpoint, then stopping (send it again to stop at once).",
            signal.Signals(signum).name,
        )

    def _agreed(self) -> int | None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.signum
        import torch

        flag = torch.tensor([self.signum or 0], device="cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None

    def on_step_end(self, args, state, control, **kwargs):
        signum = self._agreed()
        if signum is not None:
            self.signum = signum
            control.should_save = True
            control.should_training_stop = True
        return control
