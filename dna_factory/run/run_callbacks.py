"""The Trainer callbacks the runner gives every stage: :class:`GracefulStop` (signals, see
:mod:`dna_factory.run.interrupt`) and :class:`FingerprintCallback` (resume records, see :mod:`dna_factory.run.resume`).

They live apart from those two modules because they import transformers: the runner imports this
module when it builds the trainer, so ``--help`` and config errors answer without loading it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from dna_factory.errors import Interrupted
from dna_factory.run.interrupt import SIGNALS, note_stop_request, start_stop_reporter
from dna_factory.run.resume import FINGERPRINT_NAME, follow_umask, write_fingerprint

logger = logging.getLogger("dna_factory.run.interrupt")


class GracefulStop(TrainerCallback):
    """Install with :meth:`install` around ``trainer.train()``; :meth:`restore` puts the old handlers back."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        self._pid = os.getpid()  # dataloader workers fork with this handler; only this process acts on it
        start_stop_reporter()
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
        note_stop_request(signum)
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
            follow_umask(checkpoint)
