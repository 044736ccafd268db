"""TRL's AsyncGRPOTrainer with a portable attention path, file weight sync and exact resume.

Written against TRL 1.16.0; every touch of its private API lives in this module and is guarded
by the canary tests in ``tests/test_async_grpo.py``:
``AsyncGRPOTrainer._save_checkpoint`` / ``._inner_training_loop`` / ``training_step`` / ``_sync_weight``
(overridden, calling super), ``get_train_dataloader`` (reads ``self.rollout_queue`` only through ``get``; its
collator's ``groups_trained.update`` per micro-batch), the attributes ``_trained_groups``,
``model_version``, ``rollout_worker._loop_kwargs`` and ``rollout_worker.start``, the worker's group
numbering (0, 1, 2, ... from ``dataset_start_index``, wrapping round the dataset), accelerate's
one-micro-batch look-ahead, and the module-level ``get_peak_flops_per_device`` (made CUDA-optional).
The worker's ``check_health``/``stop`` are wrapped by ``dna_factory.async_grpo.rollout_watchdog`` (its own canary).

Exact resume (S-ASYNC-6, fixed). TRL numbers prompt groups 0, 1, 2, ... from where its rollout
worker starts; a worker started at ``dataset_start_index = m`` gives group ``g`` the row
``(m + g) % len(dataset)``, wrapping round the dataset for ever, so group ``g`` is stream position
``m + g``. TRL saves ``prompt_index`` = the smallest position not yet trained (a low-water mark) and
counts a group as trained when its micro-batch is *collated*; accelerate's ``DataLoaderDispatcher``
(``dispatch_batches=True``) collates one micro-batch ahead, so at a checkpoint TRL counts a micro-batch
that never reached the model. Here a position is *done* when at least one of its samples reached
``training_step`` (the collator's group ids are queued per micro-batch and taken off when that
micro-batch is consumed), or when all ``num_generations`` of its samples were dropped (stale, or
longer than ``token_budget``: skipped, not retried, as a dropped sample is during the run).
``rollout_state.json`` keeps ``prompt_index`` (the mark over done positions) plus ``done_above``, the
done positions above the mark. On resume TRL starts its worker at the mark, and the samples of
positions in ``done_above`` are regenerated but dropped at the queue, before any batching (counted,
logged once): no group is trained twice, none is skipped, and the stream keeps TRL's own numbering
past any number of epochs. Groups generated but not trained at the checkpoint are generated again.
``<output_dir>/trained_groups.jsonl`` records, per optimizer step, the positions trained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
from collections import deque
from pathlib import Path

from transformers import TrainerCallback
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo import async_grpo_trainer as _trl_async

import dna_factory.async_grpo.rollout_child  # noqa: F401  (TRL's rollout child, with its two guards)
from dna_factory.async_grpo.rollout_watchdog import RolloutWatchdog, WatchdogTimeouts
from dna_factory.async_grpo.tree_attention import use_tree_sdpa
from dna_factory.errors import DnaConfigError
from dna_factory.run.run_files import read_jsonl, write_atomic
from dna_factory.trl_pin import TRL_VERSION

logger = logging.getLogger(__name__)

_trl_peak_flops = _trl_async.get_peak_flops_per_device


def _peak_flops_per_device(accelerator, dtype):
    """TRL 1.16 asks torch.cuda for the device name unconditionally; off CUDA there is no MFU to report."""
    if accelerator.device.type != "cuda":
        return None
    return _trl_peak_flops(accelerator, dtype)


_trl_async.get_peak_flops_per_device = _peak_flops_per_device

ROLLOUT_STATE = "rollout_state.json"
TRAINED_RECORD = "trained_groups.jsonl"


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


def prompt_stream(dataset, *, max_model_len: int | None, max_completion_length: int) -> dict:
    """What makes positions in ``rollout_state.json`` mean the same prompts: the filtered rows and their settings."""
    digest = hashlib.sha256()
    for prompt in dataset["prompt"]:
        digest.update(json.dumps(prompt, sort_keys=True, ensure_ascii=False).encode())
        digest.update(b"\n")
    return {
        "rows": len(dataset),
        "sha256": digest.hexdigest(),
        "max_model_len": max_model_len,
        "max_completion_length": max_completion_length,
    }


def stream_change(saved: dict, now: dict) -> str | None:
    """How the prompt stream of a checkpoint differs from this run's, in words; None when it is the same.

    Only the prompts themselves decide (row count and SHA-256): a changed length setting that keeps the
    same rows is no change. When they differ, a changed length setting is named as the cause.
    """
    if saved.get("rows") == now.get("rows") and saved.get("sha256") == now.get("sha256"):
        return None
    rows = f"{saved.get('rows')} prompts then, {now.get('rows')} now"
    settings = [
        f"{key} was {saved.get(key)}, now {now.get(key)}"
        for key in ("max_completion_length", "max_model_len")
        if saved.get(key) != now.get(key)
    ]
    if settings:
        return f"{'; '.join(settings)}, so the over-long-prompt filter keeps other rows ({rows})"
    return f"the training prompts differ ({rows}: datasets, mixture, seed or prompt settings changed)"


class _QueueWatcher:
    """Transparent proxy for the rollout queue: sees every sample the trainer takes.

    Samples of positions trained before the resume are dropped here (taken, never returned); the
    other dropped ones are noted. TRL 1.16's ``RolloutQueueDataset`` reads the queue only through
    ``get(timeout=...)`` (pinned by a canary test).
    """

    def __init__(self, queue, trainer: DnaAsyncGRPOTrainer):
        self._queue = queue
        self._trainer = trainer

    def get(self, *args, **kwargs):
        trainer = self._trainer
        if trainer.watchdog is not None:  # the training loop is taking samples: it is not blocked
            trainer.watchdog.progress.mark()
        while True:
            sample = self._queue.get(*args, **kwargs)
            if sample is None or not trainer._done_before_resume(sample.group_id):
                break
            trainer._note_already_trained(sample.group_id)
        if sample is not None and dropped_before_training(
            sample,
            model_version=trainer.model_version,
            max_staleness=trainer.args.max_staleness,
            token_budget=trainer.args.token_budget,
        ):
            trainer._note_drop(sample.group_id)
        return sample

    def __getattr__(self, name):
        return getattr(self._queue, name)


class _CollatedGroups:
    """Stands in for the collator's ``groups_trained`` set: one entry per collated micro-batch, in order.

    TRL 1.16's ``DataCollatorForRollout.torch_call`` calls ``groups_trained.update(...)`` once per
    micro-batch; the trainer takes the entries off in ``training_step``, when the micro-batch is used.
    """

    def __init__(self):
        self.pending: deque[set[int]] = deque()

    def update(self, group_ids) -> None:
        self.pending.append(set(group_ids))


def _optimizer_steps(optimizer) -> float | None:
    """The most steps the optimizer has applied to any parameter (Adam's ``state["step"]``: 0 before the first), or
    None where it keeps no count (SGD, a DeepSpeed optimizer). The most, not the first parameter's: a parameter
    that gets no gradient (a VLM's vision tower on text prompts) never gets a state."""
    try:
        states = list(optimizer.state.values())
    except (AttributeError, TypeError):
        return None
    steps = [
        float(state["step"]) for state in states if isinstance(state, dict) and state.get("step") is not None
    ]
    if steps:
        return max(steps)
    return 0.0 if not any(states) else None


class _CountAtOptimizerStep(TrainerCallback):
    """After each optimizer step: its micro-batches' groups count as trained, unless the step was skipped (fp16 loss
    scaling after an overflow, a DeepSpeed skip), when the model never learned from them.

    A skip is accelerate's ``optimizer_step_was_skipped``, or an optimizer step count that did not advance: with a
    fused optimizer (transformers' default ``adamw_torch_fused``) the scaler hands the overflow to the optimizer,
    which skips inside its own step, and accelerate's flag stays false."""

    def __init__(self, trainer: DnaAsyncGRPOTrainer):
        self._trainer = trainer
        self._before: float | None = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._before = _optimizer_steps(self._trainer.optimizer)

    def on_optimizer_step(self, args, state, control, **kwargs):
        after = _optimizer_steps(self._trainer.optimizer)
        stalled = self._before is not None and after is not None and after <= self._before
        self._trainer._close_step(bool(self._trainer.accelerator.optimizer_step_was_skipped) or stalled)


class DnaAsyncGRPOTrainer(AsyncGRPOTrainer):
    """AsyncGRPOTrainer + ``tree_attention: sdpa`` + injected weight transfer + exact resume."""

    def __init__(
        self,
        *args,
        tree_attention: str = "fa3",
        prompt_stream: dict | None = None,
        watchdog_timeouts: WatchdogTimeouts | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.watchdog = None
        if tree_attention == "sdpa":
            use_tree_sdpa(self.model)
        self._start = 0  # stream position of worker group 0 (TRL's dataset_start_index)
        self._collated = _CollatedGroups()
        self._step_groups: set[int] = set()  # used by this optimizer step's micro-batches so far
        self._skipped_steps = 0
        self.add_callback(_CountAtOptimizerStep(self))
        self._drops: dict[int, int] = {}
        self._abandoned: set[int] = set()  # positions whose samples were all dropped
        self._recorded: set[int] = set()
        self._done_above_before: set[int] = set()  # done positions above the resume mark
        self._skipped: set[int] = set()  # positions regenerated after the resume and dropped as done
        self.prompt_stream = prompt_stream  # see prompt_stream(): a resume must find the same stream
        if self.rollout_worker is not None and hasattr(self.rollout_worker, "_loop_kwargs"):
            original_start = self.rollout_worker.start

            def start_with_resume_plan():
                self._apply_resume_plan()
                original_start()

            self.rollout_worker.start = start_with_resume_plan
        if self.rollout_worker is not None and hasattr(self.rollout_worker, "_process"):
            # a dead child, a dead server or a stuck stop() becomes one error line (docs/async-grpo.md)
            timeouts = watchdog_timeouts or WatchdogTimeouts()
            timeouts = dataclasses.replace(timeouts, grace_s=self.args.heartbeat_stale_after_s)
            self.watchdog = RolloutWatchdog(self.rollout_worker, timeouts)

    def _busy(self, what: str):
        """The watchdog's busy mark (never cut by it), or nothing where this process has no rollout worker."""
        return self.watchdog.progress.busy(what) if self.watchdog is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ bookkeeping

    def _position(self, group_id: int) -> int:
        return self._start + group_id

    def _done_before_resume(self, group_id: int) -> bool:
        return self._position(group_id) in self._done_above_before

    def _note_already_trained(self, group_id: int) -> None:
        position = self._position(group_id)
        if position not in self._skipped:
            self._skipped.add(position)
            logger.info(
                "Resume: prompt group at stream position %d was trained before the checkpoint; its regenerated "
                "samples are dropped (%d of %d such groups so far).",
                position,
                len(self._skipped),
                len(self._done_above_before),
            )

    def _note_drop(self, group_id: int) -> None:
        count = self._drops.get(group_id, 0) + 1
        self._drops[group_id] = count
        if count >= self.args.num_generations and group_id not in self._trained_groups:
            self._abandoned.add(self._position(group_id))

    def _done_positions(self) -> set[int]:
        """Done positions from the resume mark ``self._start`` on (every position below it is done)."""
        trained = {self._position(g) for g in self._trained_groups}
        return trained | self._abandoned | self._done_above_before

    def get_train_dataloader(self):  # TRL 1.16.0: RolloutQueueDataset reads self.rollout_queue
        if self.rollout_queue is not None and not isinstance(self.rollout_queue, _QueueWatcher):
            self.rollout_queue = _QueueWatcher(self.rollout_queue, self)
        dataloader = super().get_train_dataloader()
        if self.accelerator.is_main_process and self.rollout_worker is not None:
            collator = getattr(dataloader, "collate_fn", None)  # accelerate's dispatcher keeps TRL's collator
            if getattr(collator, "groups_trained", None) is not self._trained_groups:
                raise RuntimeError(
                    "TRL's rollout collator no longer exposes groups_trained as the trainer's _trained_groups: "
                    f"exact resume cannot count consumed groups (TRL {TRL_VERSION} expected)."
                )
            self._collated.pending.clear()
            collator.groups_trained = self._collated
        return dataloader

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The micro-batch is used here (not when collated); its groups count as trained once the optimizer step
        they went into is taken (:meth:`_close_step`)."""
        groups = self._collated.pending.popleft() if self._collated.pending else set()
        with self._busy("a training step"):
            loss = super().training_step(model, inputs, num_items_in_batch)
        self._step_groups.update(groups)
        return loss

    def _close_step(self, skipped: bool) -> None:
        groups, self._step_groups = self._step_groups, set()
        if not skipped:
            self._trained_groups.update(groups)
            return
        self._skipped_steps += 1
        # done untrained, like a group whose samples were all dropped: the resume mark moves past them
        self._abandoned.update(self._position(g) for g in groups if g not in self._trained_groups)
        logger.warning(
            "Optimizer step %d was skipped (gradient overflow: fp16 loss scaling lowers its scale); its %d groups "
            "are not trained and, like dropped samples, not generated again (%d skipped steps so far).",
            self.state.global_step + 1,
            len(groups),
            self._skipped_steps,
        )

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

    def _sync_weight(self):  # TRL 1.16.0 private: the weight sync after an optimizer step
        with self._busy("a weight sync"):
            return super()._sync_weight()

    def _save_checkpoint(self, model, trial):  # TRL 1.16.0 private
        with self._busy("a checkpoint save"):
            self._save_checkpoint_with_record(model, trial)

    def _save_checkpoint_with_record(self, model, trial):
        super()._save_checkpoint(model, trial)  # TRL writes its rollout_state.json first
        if not self.accelerator.is_main_process or self.rollout_worker is None:
            return
        done = self._done_positions()
        mark = self._start
        while mark in done:
            mark += 1
        state = {
            "prompt_index": mark,
            "done_above": sorted(p for p in done if p > mark),
            "model_version": self.model_version,
            "stream": self.prompt_stream,
            "semantics": "dna-factory exact resume: positions < prompt_index and in done_above are done",
        }
        path = (
            Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}" / ROLLOUT_STATE
        )
        write_atomic(path, json.dumps(state) + "\n")

    def _inner_training_loop(self, *args, **kwargs):  # TRL 1.16.0 private
        self._resume_from = kwargs.get("resume_from_checkpoint")
        self._refuse_changed_stream()
        return super()._inner_training_loop(*args, **kwargs)

    def _refuse_changed_stream(self) -> None:
        state_file = Path(self._resume_from) / ROLLOUT_STATE if self._resume_from else None
        if state_file is None or not state_file.is_file() or self.prompt_stream is None:
            return
        saved = json.loads(state_file.read_text()).get("stream")
        change = stream_change(saved, self.prompt_stream) if saved else None
        if change:
            raise DnaConfigError(
                f"Cannot resume from {self._resume_from}: its prompt stream differs from this run's: {change}. "
                "Async GRPO's rollout_state.json numbers prompts by their position in that stream, so the resume "
                "would skip or repeat prompts. Restore the setting, or start over in a new output_dir."
            )

    def _apply_resume_plan(self) -> None:
        """Before the worker starts: TRL has set its start to the checkpoint's mark; note what is done above it."""
        self._start = int(self.rollout_worker._loop_kwargs.get("dataset_start_index", 0))
        checkpoint = getattr(self, "_resume_from", None)
        state_file = Path(checkpoint) / ROLLOUT_STATE if checkpoint else None
        if state_file is None or not state_file.is_file():
            return
        state = json.loads(state_file.read_text())
        if "done_above" not in state:
            logger.warning(
                "%s has TRL's low-water mark only (the save was cut before dna-factory's record was written): "
                "prompt groups above position %d that were already trained may be trained again.",
                state_file,
                self._start,
            )
        self._done_above_before = {int(p) for p in state.get("done_above", []) if int(p) >= self._start}
        # TRL stops an epoch-bounded run at _groups_before_resume + len(_trained_groups) groups; the done
        # groups above the mark are dropped, never counted in _trained_groups, so they count here.
        self._groups_before_resume = self._start + len(self._done_above_before)
        self._recorded = set()  # the record shows every position trained after the resume, repeats included
        self._truncate_record(int(Path(checkpoint).name.rsplit("-", 1)[-1]))
        logger.info(
            "Exact resume from %s: %d prompt groups done (%d above the low-water mark %d) are not trained again.",
            checkpoint,
            self._start + len(self._done_above_before),
            len(self._done_above_before),
            self._start,
        )

    def _truncate_record(self, step: int) -> None:
        """Forget record lines written after the checkpoint: those groups are trained again after resume."""
        path = Path(self.args.output_dir) / TRAINED_RECORD
        if not path.is_file():
            return
        rows = [row for row in read_jsonl(path) if row["step"] <= step]
        write_atomic(path, (json.dumps(row) + "\n" for row in rows))
