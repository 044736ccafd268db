"""TRL's AsyncGRPOTrainer with a portable attention path, file weight sync and exact resume.

Written against TRL 1.16.0; every touch of its private API lives in this module and is guarded
by ``tests/test_async_grpo.py::test_trl_async_canary``:
``AsyncGRPOTrainer._save_checkpoint`` / ``._inner_training_loop`` (overridden, calling super),
``get_train_dataloader`` (reads ``self.rollout_queue``), the attributes ``_trained_groups``,
``_groups_before_resume``, ``model_version``, ``rollout_worker._loop_kwargs`` and
``rollout_worker.start``, and the module-level ``get_peak_flops_per_device`` (made CUDA-optional).

Exact resume (S-ASYNC-6, fixed). TRL numbers prompt groups by their position in the rollout
worker's prompt stream and saves ``prompt_index`` = the smallest position not yet trained (a
low-water mark). A group whose samples were all dropped (stale, or longer than ``token_budget``)
never counts as trained, so it pins the mark, and on resume every group above it is generated
and trained again. Here a position is *done* when at least one of its samples reached the model,
or when all ``num_generations`` of its samples were dropped (the same treatment a dropped sample
gets during the run: it is skipped, not retried). ``rollout_state.json`` keeps TRL's
``prompt_index`` (the mark over done positions) plus ``done_above``, the done positions above
the mark. On resume the worker's prompt stream is rebuilt as every position from the mark on,
minus ``done_above``, so no group is trained twice and none is skipped. Groups that were
generated but still queued at the checkpoint are not done and are generated again.
``<output_dir>/trained_groups.jsonl`` records, per optimizer step, the positions trained.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo import async_grpo_trainer as _trl_async

import dna_factory.rollout_child  # noqa: F401  (TRL's rollout child, with its parse_response fallback)

logger = logging.getLogger(__name__)

_trl_peak_flops = _trl_async.get_peak_flops_per_device


def _peak_flops_per_device(accelerator, dtype):
    """TRL 1.16 asks torch.cuda for the device name unconditionally; off CUDA there is no MFU to report."""
    if accelerator.device.type != "cuda":
        return None
    return _trl_peak_flops(accelerator, dtype)


_trl_async.get_peak_flops_per_device = _peak_flops_per_device

TRL_VERSION = "1.16.0"
ROLLOUT_STATE = "rollout_state.json"
TRAINED_RECORD = "trained_groups.jsonl"
RESUME_HORIZON_EPOCHS = 4  # the rebuilt stream covers this many passes over the data after the resume point


def dropped_before_training(
    sample, *, model_version: int, max_staleness: int, token_budget: int | None
) -> bool:
    """Whether TRL 1.16 drops this rollout sample before it reaches the model.

    ``RolloutQueueDataset`` drops it as stale when ``model_version - sample.model_version > max_staleness``
    (computed right after ``get()``, on the same thread); then, with ``token_budget > 0``,
    ``TokenBudgetBatcher`` drops it when it has more than ``token_budget`` tokens.
    """
    if model_version - sample.model_version > max_staleness:
        return True
    return (token_budget or 0) > 0 and len(sample.input_ids) > token_budget


class _QueueWatcher:
    """Transparent proxy for the rollout queue: sees every sample the trainer takes and notes the dropped ones."""

    def __init__(self, queue, trainer: DnaAsyncGRPOTrainer):
        self._queue = queue
        self._trainer = trainer

    def get(self, *args, **kwargs):
        sample = self._queue.get(*args, **kwargs)
        trainer = self._trainer
        if dropped_before_training(
            sample,
            model_version=trainer.model_version,
            max_staleness=trainer.args.max_staleness,
            token_budget=trainer.args.token_budget,
        ):
            trainer._note_drop(sample.group_id)
        return sample

    def __getattr__(self, name):
        return getattr(self._queue, name)


class DnaAsyncGRPOTrainer(AsyncGRPOTrainer):
    """AsyncGRPOTrainer + ``tree_attention: sdpa`` + injected weight transfer + exact resume."""

    def __init__(self, *args, tree_attention: str = "fa3", **kwargs):
        super().__init__(*args, **kwargs)
        if tree_attention == "sdpa":
            from dna_factory.tree_attention import use_tree_sdpa

            use_tree_sdpa(self.model)
        self._positions: list[int] | None = None  # worker group id -> stream position (None: identity)
        self._drops: dict[int, int] = {}
        self._abandoned: set[int] = set()  # positions whose samples were all dropped
        self._recorded: set[int] = set()
        self._done_before: set[int] = set()  # done positions carried over from the checkpoint
        self._mark_before = 0
        if self.rollout_worker is not None and hasattr(self.rollout_worker, "_loop_kwargs"):
            original_start = self.rollout_worker.start

            def start_with_resume_plan():
                self._apply_resume_plan()
                original_start()

            self.rollout_worker.start = start_with_resume_plan

    # ------------------------------------------------------------------ bookkeeping

    def _position(self, group_id: int) -> int:
        return self._positions[group_id] if self._positions is not None else group_id

    def _note_drop(self, group_id: int) -> None:
        count = self._drops.get(group_id, 0) + 1
        self._drops[group_id] = count
        if count >= self.args.num_generations and group_id not in self._trained_groups:
            self._abandoned.add(self._position(group_id))

    def _done_positions(self) -> set[int]:
        trained = {self._position(g) for g in self._trained_groups}
        return trained | self._abandoned | self._done_before

    def get_train_dataloader(self):  # TRL 1.16.0: RolloutQueueDataset reads self.rollout_queue
        if self.rollout_queue is not None and not isinstance(self.rollout_queue, _QueueWatcher):
            self.rollout_queue = _QueueWatcher(self.rollout_queue, self)
        return super().get_train_dataloader()

    def _record_trained(self) -> None:
        if not self.accelerator.is_main_process:
            return
        new = sorted({self._position(g) for g in self._trained_groups} - self._recorded)
        self._recorded.update(new)
        if new:
            with open(Path(self.args.output_dir) / TRAINED_RECORD, "a") as fh:
                fh.write(json.dumps({"step": self.state.global_step, "positions": new}) + "\n")

    def _log_step_metrics(self) -> None:  # TRL 1.16.0 private, called once per optimizer step
        self._record_trained()
        super()._log_step_metrics()

    # ------------------------------------------------------------------ checkpoint / resume

    def _save_checkpoint(self, model, trial):  # TRL 1.16.0 private
        super()._save_checkpoint(model, trial)  # TRL writes its rollout_state.json first
        if not self.accelerator.is_main_process or self.rollout_worker is None:
            return
        done = self._done_positions()
        mark = next(p for p in range(len(done) + 1) if p not in done)
        state = {
            "prompt_index": mark,
            "done_above": sorted(p for p in done if p > mark),
            "model_version": self.model_version,
            "semantics": "dna-factory exact resume: positions < prompt_index and in done_above are done",
        }
        path = (
            Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}" / ROLLOUT_STATE
        )
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state) + "\n")
        os.replace(tmp, path)

    def _inner_training_loop(self, *args, **kwargs):  # TRL 1.16.0 private
        self._resume_from = kwargs.get("resume_from_checkpoint")
        return super()._inner_training_loop(*args, **kwargs)

    def _apply_resume_plan(self) -> None:
        """Before the worker starts: rebuild its prompt stream from the checkpoint's done set."""
        checkpoint = getattr(self, "_resume_from", None)
        state_file = Path(checkpoint) / ROLLOUT_STATE if checkpoint else None
        if state_file is None or not state_file.is_file() or not hasattr(self.train_dataset, "select"):
            return
        state = json.loads(state_file.read_text())
        mark, done_above = int(state["prompt_index"]), set(state.get("done_above", []))
        n = len(self.train_dataset)
        horizon = mark + n * RESUME_HORIZON_EPOCHS
        positions = [p for p in range(mark, horizon) if p not in done_above]
        self._positions = positions
        self._mark_before = mark
        self._done_before = set(range(mark)) | done_above
        self._recorded = set(self._done_before)
        worker_kwargs = self.rollout_worker._loop_kwargs
        worker_kwargs["dataset"] = self.train_dataset.select([p % n for p in positions])
        worker_kwargs["dataset_start_index"] = 0
        self._groups_before_resume = len(self._done_before)
        self._truncate_record(int(Path(checkpoint).name.rsplit("-", 1)[-1]))
        logger.info(
            "Exact resume from %s: %d prompt groups done (%d above the low-water mark %d) are not regenerated.",
            checkpoint,
            len(self._done_before),
            len(done_above),
            mark,
        )

    def _truncate_record(self, step: int) -> None:
        """Forget record lines written after the checkpoint: those groups are trained again after resume."""
        path = Path(self.args.output_dir) / TRAINED_RECORD
        if not path.is_file():
            return
        lines = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, path)
