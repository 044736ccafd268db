"""Ctrl-C and SIGTERM (SLURM preemption) during training: finish the step, save a checkpoint, stop.

The first SIGINT or SIGTERM sets a flag; at the end of the current optimiser step
:class:`GracefulStop` asks the Trainer to save ``checkpoint-N`` and stop, and the runner exits with
one line saying how to resume (status 128 + the signal). A second signal stops at once
(``KeyboardInterrupt``): the newest checkpoint already on disk is the resume point. With several
processes the flag is agreed on by all of them at every step (one all-reduce of one number), so all
ranks save the same step.
"""

from __future__ import annotations

import logging
import signal

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """Training stopped on a signal after saving ``checkpoint``; ``status`` is the process exit status."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.status = 128 + signum
        super().__init__(f"{signal.Signals(signum).name} at step {step}")


class GracefulStop(TrainerCallback):
    """Install with :meth:`install` around ``trainer.train()``; :meth:`restore` puts the old handlers back."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            self.restore()
            raise KeyboardInterrupt
        self.signum = signum
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
