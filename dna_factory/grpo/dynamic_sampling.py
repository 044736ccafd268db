"""DAPO-style dynamic sampling for sync GRPO (S-DYN-1..7), as a mixin over TRL's GRPOTrainer.

GRPO's advantage is a reward's deviation from its group mean, so a group whose
``num_generations`` rewards are all equal is *dead*: every token gets advantage 0 and the
group gives no policy gradient (``loss: 0 / grad_norm: 0``). Two remedies:

``mask``
    When every row of a TRL micro-batch is dead, the micro-batch is cut to a one-row stub
    before the forward pass (a rectangular tensor cannot be shortened for some rows only,
    so partially dead micro-batches are left alone). The stub still runs forward and
    backward so that DDP's gradient all-reduce happens on every rank; its loss is 0. The
    gradient is unchanged only when nothing but the advantage feeds the loss: ``beta: 0``
    (no KL to a reference), no entropy bonus, no router auxiliary loss — each is warned
    about at init and the run continues. The DAPO normaliser ``inputs["num_items_in_batch"]``
    was fixed when the batch was scored, so the survivors are not rescaled (S-DYN-5).

``resample``
    Informative groups are kept whole; a separate sampler (``repeat_count=1``, ``seed+1``)
    draws fresh prompts, which are generated and scored, and their informative groups are
    appended until the local batch is full or ``dynamic_sampling_max_rounds`` is reached
    (then dead rows pad the batch back: fallback). ``num_items_in_batch`` is recomputed
    for the refilled batch. This deliberately changes the gradient; a run with it is not
    reproducible against one without it.

Deadness is decided per group when the batch is scored — on the rewards gathered from
all processes, because TRL's groups may straddle ranks — and carried with the rows as a
boolean ``dyn_dead`` tensor through TRL's shuffle and split (S-DYN-2). A row exactly at its
group mean has advantage 0 but is *not* dead when its group is informative.

Metrics: ``dyn/dead_frac`` (share of local rows in a dead group after any refill, averaged
over processes), ``dyn/refilled`` (1 when the refill filled every rank's batch, 0 on
fallback), ``dyn/rounds`` (extra generation rounds), ``dyn/masked_frac`` (share of micro-batches cut to a stub).
TRL's ``frac_reward_zero_std`` is measured before filtering, per prompt, across ranks; with
``resample`` TRL's reward metrics average over every scored round.

TRL touch points — private API of TRL 1.16.0, all in this module, guarded by
``tests/test_dynamic_sampling.py::test_trl_canary``:
``GRPOTrainer._calculate_rewards``, ``._generate_and_score_completions``, ``._prepare_inputs``
(overridden; each calls ``super()``), ``_compute_loss`` reading ``inputs["num_items_in_batch"]``,
``trl.trainer.utils.RepeatSampler`` and ``nanstd``, and the attributes ``_metrics``,
``_tokenizer``, ``reward_weights``, ``num_generations``, ``beta``, ``_entropy_bonus_enabled``,
``aux_loss_enabled``, ``multi_objective_aggregation``, ``shuffle_dataset``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler, nanstd

from dna_factory.errors import DnaConfigError

logger = logging.getLogger(__name__)

MODES = ("off", "mask", "resample")
DEAD_KEY = "dyn_dead"
# Per-row (B, T) tensors of TRL's scored batch and how to pad them when batches are joined.
LEFT_PADDED = {"prompt_ids", "prompt_mask"}
RIGHT_PADDED = {
    "completion_ids",
    "completion_mask",
    "old_per_token_logps",
    "ref_per_token_logps",
    "sampling_per_token_logps",
    "tool_mask",
    "importance_sampling_ratio",
}
# Inputs that make rows non-rectangular or multimodal; neither mode can handle them (S-DYN-7).
MULTIMODAL_ROW_KEYS = ("image", "images")
MULTIMODAL_OUTPUT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
)


def _select_rows(batch: dict, index) -> dict:
    """The rows ``index`` (bool mask, index tensor or slice) of every per-row tensor; 0-d values kept."""
    return {k: (v[index] if torch.is_tensor(v) and v.ndim > 0 else v) for k, v in batch.items()}


def _concat_batches(parts: list[dict], pad_token_id: int) -> dict:
    """Join scored batches row-wise, re-padding prompts on the left and completions on the right."""
    joined = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        first = values[0]
        if not torch.is_tensor(first) or first.ndim == 0:
            joined[key] = first
            continue
        if first.ndim == 2 and key in LEFT_PADDED | RIGHT_PADDED and len({v.size(1) for v in values}) > 1:
            width = max(v.size(1) for v in values)
            fill = pad_token_id if key.endswith("_ids") else (1 if key == "tool_mask" else 0)
            values = [
                F.pad(v, (width - v.size(1), 0) if key in LEFT_PADDED else (0, width - v.size(1)), value=fill)
                for v in values
            ]
        joined[key] = torch.cat(values, dim=0)
    return joined


class DynamicSamplingMixin:
    """Adds ``dynamic_sampling`` (off | mask | resample) to a GRPOTrainer subclass. See the module docstring."""

    def __init__(self, *args, dynamic_sampling: str = "off", max_rounds: int = 4, **kwargs):
        if dynamic_sampling not in MODES:
            raise DnaConfigError(
                f"dynamic_sampling must be one of {', '.join(MODES)}, not {dynamic_sampling!r}."
            )
        if max_rounds < 0:
            raise DnaConfigError("dynamic_sampling_max_rounds must be >= 0.")
        super().__init__(*args, **kwargs)
        self.dynamic_sampling = dynamic_sampling
        self.dynamic_sampling_max_rounds = max_rounds
        self._dyn_gathered_rewards: torch.Tensor | None = None
        self._dyn_refill_iter = None
        self._dyn_checked_first_batch = False
        if dynamic_sampling == "mask":
            self._warn_if_mask_changes_gradient()
        if dynamic_sampling == "resample":
            self._check_resample_setup()

    # ------------------------------------------------------------------ init checks

    def _warn_if_mask_changes_gradient(self) -> None:
        reasons = []
        if self.beta != 0.0:
            reasons.append(f"beta={self.beta} adds a KL term that a dead row still contributes; set beta: 0")
        if getattr(self, "_entropy_bonus_enabled", False):
            reasons.append("the entropy bonus (entropy_coef / use_adaptive_entropy) still acts on dead rows")
        if getattr(self, "aux_loss_enabled", False):
            reasons.append("the router auxiliary loss (MoE, router_aux_loss_coef) still acts on dead rows")
        if getattr(self, "multi_objective_aggregation", "sum_then_normalize") == "normalize_then_sum":
            reasons.append(
                "multi_objective_aggregation=normalize_then_sum gives dead groups non-zero advantages"
            )
        for reason in reasons:
            logger.warning(
                "dynamic_sampling: mask changes the gradient here: %s. The run continues; masked micro-batches "
                "drop that contribution.",
                reason,
            )

    def _check_resample_setup(self) -> None:
        import datasets

        if isinstance(self.train_dataset, datasets.IterableDataset | torch.utils.data.IterableDataset):
            raise DnaConfigError(
                "dynamic_sampling: resample needs random access to draw fresh prompts, but the training dataset "
                "is streaming. Use a map-style dataset or dynamic_sampling: mask."
            )
        local = self.args.per_device_train_batch_size * self.args.steps_per_generation
        if local % self.num_generations:
            raise DnaConfigError(
                f"dynamic_sampling: resample keeps groups whole on each process, so per_device_train_batch_size "
                f"× steps_per_generation ({local}) must be a multiple of num_generations ({self.num_generations})."
            )
        prompts_per_batch = self.args.generation_batch_size // self.num_generations
        if len(self.train_dataset) < prompts_per_batch:
            raise DnaConfigError(
                f"dynamic_sampling: resample draws {prompts_per_batch} prompts per round but the dataset has "
                f"{len(self.train_dataset)}. Add data or lower the batch size."
            )

    def _check_first_batch(self, rows: list[dict], scored: dict | None = None) -> None:
        bad = [k for k in MULTIMODAL_ROW_KEYS if rows and k in rows[0] and rows[0][k] is not None]
        if scored is not None:
            bad += [k for k in MULTIMODAL_OUTPUT_KEYS if k in scored]
        if bad:
            raise DnaConfigError(
                f"dynamic_sampling: {self.dynamic_sampling} cannot handle multimodal or token-type inputs "
                f"({', '.join(bad)}). Set dynamic_sampling: off for this dataset."
            )

    # ------------------------------------------------------------------ deadness

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # TRL 1.16.0 private
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._dyn_gathered_rewards = rewards  # (num_processes * local rows, num_reward_funcs), gathered
        return rewards

    def _dead_rows(self, local_rows: int) -> torch.Tensor:
        """Bool (local_rows,): the row's group has zero reward spread (or fewer than 2 scorable rows).

        Decided on the rewards of all processes, exactly as TRL weights and groups them.
        """
        per_func = self._dyn_gathered_rewards
        weights = self.reward_weights.to(per_func.device).unsqueeze(0)
        rewards = (per_func * weights).nansum(dim=1)
        rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
        spread = nanstd(rewards.view(-1, self.num_generations), dim=1)
        dead_groups = torch.isclose(spread, torch.zeros_like(spread)) | torch.isnan(spread)
        dead = dead_groups.repeat_interleave(self.num_generations)
        start = self.accelerator.process_index * local_rows
        return dead[start : start + local_rows]

    def _score(self, rows: list[dict]) -> dict:
        scored = super()._generate_and_score_completions(rows)  # TRL 1.16.0 private
        if not self._dyn_checked_first_batch:
            self._check_first_batch(rows, scored)
            self._dyn_checked_first_batch = True
        dead = self._dead_rows(len(rows)).to(scored["advantages"].device)
        # A dead group's advantages are 0 up to float rounding; make them exactly 0.
        scored["advantages"] = scored["advantages"].masked_fill(dead, 0.0)
        scored[DEAD_KEY] = dead  # per-row, so TRL's shuffle/split carry it with the rows
        return scored

    # ------------------------------------------------------------------ resample

    def _refill_rows(self) -> list[dict]:
        """This process's share of a fresh generation batch from the separate (seed + 1) sampler."""
        if self._dyn_refill_iter is None:
            self._dyn_refill_sampler = RepeatSampler(
                data_source=self.train_dataset,
                mini_repeat_count=self.num_generations,
                batch_size=self.args.generation_batch_size // self.num_generations,
                repeat_count=1,
                shuffle=self.shuffle_dataset,
                seed=self.args.seed + 1,
            )
            self._dyn_refill_iter = iter(self._dyn_refill_sampler)
        indices: list[int] = []
        while len(indices) < self.args.generation_batch_size:
            try:
                indices.append(next(self._dyn_refill_iter))
            except StopIteration:  # next epoch of the refill sampler
                self._dyn_refill_iter = iter(self._dyn_refill_sampler)
        local = self.args.generation_batch_size // self.accelerator.num_processes
        start = self.accelerator.process_index * local
        return [self.train_dataset[i] for i in indices[start : start + local]]

    def _resample(self, scored: dict, local_rows: int) -> tuple[dict, float, int]:
        dead = scored[DEAD_KEY]
        parts = [_select_rows(scored, ~dead)]
        have = int((~dead).sum())
        rounds = 0
        device = self.accelerator.device
        while True:
            # Every process runs the same number of rounds: generation gathers across ranks.
            need = self.accelerator.gather(torch.tensor([local_rows - have], device=device)).max().item()
            if need == 0 or rounds >= self.dynamic_sampling_max_rounds:
                break
            rounds += 1
            fresh = self._score(self._refill_rows())
            alive = (~fresh[DEAD_KEY]).nonzero().squeeze(1)[: local_rows - have]
            parts.append(_select_rows(fresh, alive))
            have += len(alive)
        filled = (
            self.accelerator.gather(torch.tensor([float(have == local_rows)], device=device)).min().item()
        )
        if have < local_rows:  # fallback: pad with this batch's dead rows
            parts.append(_select_rows(_select_rows(scored, dead), slice(0, local_rows - have)))
        batch = _concat_batches(parts, self._tokenizer.pad_token_id)
        loss_mask = (
            batch["completion_mask"] * batch["tool_mask"]
            if "tool_mask" in batch
            else batch["completion_mask"]
        )
        batch["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        return batch, filled, rounds

    # ------------------------------------------------------------------ TRL hooks

    def _generate_and_score_completions(self, inputs):  # TRL 1.16.0 private
        if self.dynamic_sampling == "off" or not self.model.training:
            return super()._generate_and_score_completions(inputs)
        if not self._dyn_checked_first_batch:
            self._check_first_batch(inputs)
        batch = self._score(inputs)
        metrics = self._metrics["train"]
        if self.dynamic_sampling == "resample":
            batch, filled, rounds = self._resample(batch, len(inputs))
            metrics["dyn/refilled"].append(filled)
            metrics["dyn/rounds"].append(float(rounds))
        dead_frac = self.accelerator.gather(batch[DEAD_KEY].float().mean().reshape(1)).mean().item()
        metrics["dyn/dead_frac"].append(dead_frac)
        return batch

    def _prepare_inputs(self, generation_batch):  # TRL 1.16.0 private
        inputs = super()._prepare_inputs(generation_batch)
        if self.dynamic_sampling != "mask" or not self.model.training or DEAD_KEY not in inputs:
            return inputs
        all_dead = torch.tensor([int(bool(inputs[DEAD_KEY].all()))], device=self.accelerator.device)
        # Truncate only when every rank's micro-batch is dead: TRL gathers per-row tensors in the loss.
        if self.accelerator.gather(all_dead).min().item() == 1:
            self._metrics["train"]["dyn/masked_frac"].append(1.0)
            return _select_rows(inputs, slice(0, 1))  # a new dict: the buffer is reused across iterations
        self._metrics["train"]["dyn/masked_frac"].append(0.0)
        return inputs


class DynamicSamplingGRPOTrainer(DynamicSamplingMixin, GRPOTrainer):
    """TRL's GRPOTrainer with ``dynamic_sampling``; ``off`` behaves exactly like GRPOTrainer."""
