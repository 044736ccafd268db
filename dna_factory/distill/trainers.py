"""On-policy distillation (S-OPD): the student samples, the teacher scores, the student moves toward the teacher.

Both modes run TRL's :class:`~trl.DistillationTrainer` loop — the student generates
completions for prompt-only rows with its own sampling parameters (``temperature``,
``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``), completions are generated once per
optimizer step and split across the accumulation window — and differ in what the teacher
gives back and which loss is trained (all quantities in nats, per completion token).

``local_teacher`` — :class:`LocalTeacherDistillationTrainer` (TRL's loss, unchanged)
    The teacher is loaded next to the student and both full next-token distributions are
    compared at every completion position with TRL's generalized Jensen–Shannon divergence
    (chunked over the vocabulary; the ``(tokens, vocab)`` logits are never materialised)::

        beta = 1:  KL(S ‖ T) = Σ_v S_v (log S_v − log T_v)        reverse KL, mode-seeking (default)
        beta = 0:  KL(T ‖ S) = Σ_v T_v (log T_v − log S_v)        forward KL, mass-covering
        else:      beta·KL(T ‖ M) + (1 − beta)·KL(S ‖ M),  M = (1 − beta)·S + beta·T   (0.5: JSD)

    The logged ``loss`` is the mean of that divergence over completion tokens.

``server_teacher`` — :class:`SampledTokenOPDTrainer` (S-OPD-3, seed 001)
    The teacher sits behind a vLLM server (:mod:`dna_factory.distill.teacher_server`) and returns
    only ``log π_T(y_t | x, y_<t)`` of the token the student sampled. Per token::

        d_t = log π_old(y_t | x, y_<t) − log π_T(y_t | x, y_<t)     one-sample estimate of KL(π_θ ‖ π_T)
        A_t = −β · d_t                                             β = ``opd_kl_coef``
        L   = −Σ_t r_t · A_t / N,   r_t = π_θ(y_t) / π_old(y_t)      importance-sampling policy gradient

    summed over the completion tokens of the batch, ``N`` of them. Each rollout gets its own
    signal (no group centring). ``π_old`` is the student that sampled: the weights do not
    change between sampling and the last micro-batch of the step, so ``log π_old`` is the
    detached ``log π_θ`` of the same forward (as TRL's GRPO does for ``num_iterations=1``)
    and ``r_t = 1`` in value, while ``∇L = −Σ_t A_t ∇ log π_θ(y_t) / N = β·Σ_t d_t ∇ log π_θ(y_t) / N``,
    the policy gradient of ``β·KL(π_θ ‖ π_T)`` with per-token credit. The logged ``loss``
    therefore equals ``β · opd/reverse_kl_mean``. Both log-probabilities are untempered
    (temperature 1); the sampling temperature only decides which states are visited.

Metrics (both modes, per optimizer step): ``data/completion_tokens_total`` (completion
tokens the teacher scored, all processes) and ``data/completion_tokens_per_second`` (that
count over the whole step: sampling, teacher, forward/backward, optimizer). Server mode
adds ``opd/reverse_kl_mean`` and ``opd/reverse_kl_std`` (mean and standard deviation of
``d_t`` over the step's tokens) and ``time/teacher_s`` (wall time of teacher scoring).

Both losses are trained fused by default (:mod:`dna_factory.distill.fused_loss`: the gradient is
formed in the forward, one vocabulary projection per model; ``fused_loss: false`` trains TRL's
kernels, as do vision-language inputs and a sharded head that trains).

TRL touch points — private API of TRL 1.16.0, all in this module and
:mod:`dna_factory.distill.teacher_server`, guarded by ``tests/test_distill.py::test_trl_canary``:
``DistillationTrainer._generate_and_score_completions`` (overridden, calls ``super()``; its
output keys ``prompt_ids``, ``prompt_mask``, ``completion_ids``, ``completion_mask``,
``num_items_in_batch``), ``._compute_loss`` (overridden, falls back to ``super()``),
``._get_last_hidden_state``, ``._forward_redirection``, ``._metrics``,
``trl.trainer.utils.add_fused_lm_head`` (its ``fused_lm_head=True`` forward returning
``log_probs`` shifted by one) and ``maybe_gather_lm_head_ctx``, and
``VLLMClient.get_sequence_logprobs``'s ``actual_logprobs``.
"""

from __future__ import annotations

import logging
import time

import torch
from accelerate.utils import extract_model_from_parallel, is_peft_model
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback
from trl import DistillationTrainer
from trl.trainer.utils import add_fused_lm_head, maybe_gather_lm_head_ctx

from dna_factory.distill.fused_loss import (
    fused_divergence_loss,
    fused_loss_applies,
    fused_sampled_token_loss,
    logit_transform,
)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the maths


def sampled_token_advantages(
    student_logps: torch.Tensor, teacher_logps: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token reverse-KL signal of S-OPD-3: ``d_t = log π_old(y_t) − log π_T(y_t)``, ``A_t = −kl_coef · d_t``.

    Args:
        student_logps: ``log π_old(y_t | x, y_<t)`` of the sampled tokens, nats, any shape.
        teacher_logps: ``log π_T(y_t | x, y_<t)`` of the same tokens, same shape.
        kl_coef: β, the distillation strength.

    Returns:
        ``(d, A)``: ``d_t > 0`` where the student likes ``y_t`` more than the teacher does (it is pushed
        down), ``d_t < 0`` where the teacher gives ``y_t`` more probability (it is pulled up).

    Example:
        >>> d, a = sampled_token_advantages(torch.tensor([-0.5, -2.0, -0.1]), torch.tensor([-0.7, -0.9, -0.1]), 0.5)
        >>> [round(x, 6) for x in a.tolist()]
        [-0.1, 0.55, -0.0]
    """
    d = student_logps - teacher_logps
    return d, -kl_coef * d


def importance_sampling_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_items: torch.Tensor | float,
) -> torch.Tensor:
    """``−Σ_t exp(log π_θ − log π_old) · A_t / N`` over the masked tokens (the importance-sampling loss).

    Args:
        logps: ``log π_θ(y_t)`` with gradient, shape ``(B, T)``.
        old_logps: ``log π_old(y_t)`` of the sampler, no gradient, same shape.
        advantages: ``A_t``, no gradient, same shape.
        mask: 1 on completion tokens, 0 on padding.
        num_items: ``N``, the tokens the loss is averaged over (the batch's, for gradient accumulation).
    """
    ratio = torch.exp(logps - old_logps)
    return -(ratio * advantages * mask).sum() / num_items


def use_fused_lm_head(model) -> None:
    """Give the student TRL's fused LM head once (``add_fused_lm_head``, temperature 1: untempered log-probs).

    TRL's head reads every logit convention a config can carry (``logit_scale``, ``output_multiplier``,
    ``lm_head_multiplier``, ``logits_scaling`` as a divisor or, for HyperCLOVA X, a multiplier, and
    ``final_logit_softcapping``), gathers FSDP2-sharded heads, and projects the vocabulary in
    chunks, so ``(tokens, vocab)`` logits are never materialised. Generation is unaffected: the
    patched forward is the original one unless called with ``fused_lm_head=True``.

    Args:
        model: the student, bare, PEFT-wrapped or wrapped by accelerate (DDP, FSDP, ``torch.compile``).
    """
    base = extract_model_from_parallel(model)
    base = base.get_base_model() if is_peft_model(base) else base
    if not getattr(base, "_dna_fused_lm_head", False):
        add_fused_lm_head(base, temperature=1.0, outputs=("log_probs",))
        base._dna_fused_lm_head = True


def completion_logprobs(model, inputs: dict) -> torch.Tensor:
    """``log π(y_t | x, y_<t)`` of every completion token of ``inputs`` (0 on padding), with gradient.

    One forward through ``model`` itself (so DDP/FSDP hooks and LoRA layers act) with TRL's fused
    LM head; prompt and padding positions are labelled ``-100`` and never projected on GPUs.

    Args:
        model: the student, as for :func:`use_fused_lm_head`.
        inputs: ``prompt_ids``, ``prompt_mask`` (left-padded), ``completion_ids``, ``completion_mask`` (right-padded).
    """
    use_fused_lm_head(model)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    scored = torch.cat([torch.zeros_like(inputs["prompt_mask"]), inputs["completion_mask"]], dim=1).bool()
    labels = input_ids.masked_fill(~scored, -100)
    output = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    # log_probs[:, i] scores input_ids[:, i + 1]: the completion is the last completion-width columns.
    log_probs = output.log_probs
    return log_probs[:, log_probs.size(1) - inputs["completion_ids"].size(1) :]


# --------------------------------------------------------------------------- per-step metrics


class _StepMetrics(TrainerCallback):
    """Times each optimizer step (sampling through optimizer) and flushes the step's counters into TRL's metrics."""

    def __init__(self, trainer: _CompletionThroughputMixin) -> None:
        self.trainer = trainer
        self.started: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.started is not None:
            self.trainer._flush_step_metrics(time.perf_counter() - self.started)
        self.started = None


class _CompletionThroughputMixin:
    """``data/completion_tokens_total`` and ``data/completion_tokens_per_second`` for a DistillationTrainer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._step_completion_tokens = 0
        self.add_callback(_StepMetrics(self))

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            # num_items_in_batch is the completion-token count gathered over every process.
            self._step_completion_tokens += int(output["num_items_in_batch"].item())
        return output

    def _flush_step_metrics(self, seconds: float) -> None:
        metrics = self._metrics["train"]
        metrics["data/completion_tokens_total"].append(float(self._step_completion_tokens))
        metrics["data/completion_tokens_per_second"].append(self._step_completion_tokens / max(seconds, 1e-9))
        self._step_completion_tokens = 0


MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                   "token_type_ids", "mm_token_type_ids", "image_position_ids")  # fmt: skip
"""Inputs TRL's ``_compute_loss`` forwards to a vision-language backbone; with any of them, TRL's own loss runs."""


def _full(tensor):
    """A frozen FSDP2-sharded head gathered once (as TRL does), else the tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class _HeadView:
    """``weight`` and ``bias`` of an ``lm_head`` as the fused losses take them (FSDP2 shards gathered)."""

    def __init__(self, head):
        self.weight, self.bias = _full(head.weight), None if head.bias is None else _full(head.bias)


class LocalTeacherDistillationTrainer(_CompletionThroughputMixin, DistillationTrainer):
    """TRL's DistillationTrainer (local teacher, generalized JSD selected by ``beta``) plus throughput metrics.

    With ``fused_loss`` (the default) the divergence is :func:`~dna_factory.distill.fused_loss.fused_divergence_loss`:
    TRL's loss, its scaling and masking, with the gradient formed in the forward. TRL's own chunked kernel runs
    for vision-language inputs, for a sharded head that trains (FSDP2, ZeRO-3), or with ``fused_loss: false``.
    """

    def __init__(self, *args, fused_loss: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused_loss = fused_loss

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        student_head = unwrapped_student.get_output_embeddings()
        if (
            not self.fused_loss
            or any(key in inputs for key in MULTIMODAL_KEYS)
            or not fused_loss_applies(student_head.weight, student_head.bias)
        ):
            return super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)
        # As TRL's _compute_loss: both backbones on the completion positions (the teacher's through its own
        # wrapper, so FSDP/DeepSpeed materialise it), tool outputs masked out of the loss.
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        loss_mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            loss_mask = loss_mask * inputs["tool_mask"]
        keep = inputs["completion_ids"].size(1)
        student_hidden = self._get_last_hidden_state(unwrapped_student, input_ids, attention_mask, keep)
        self.teacher_model.eval()
        unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
        with torch.no_grad():
            teacher_hidden = self._forward_redirection(
                self.teacher_model, unwrapped_teacher, self._get_last_hidden_state, unwrapped_teacher,
                input_ids, attention_mask, keep,
            )  # fmt: skip
        teacher_head = unwrapped_teacher.get_output_embeddings()
        device = student_head.weight.device
        if teacher_head.weight.device != device:
            raise ValueError(
                f"The student lm_head is on {device} but the teacher lm_head is on {teacher_head.weight.device}. "
                "Place both on the same device in their device_map."
            )
        with maybe_gather_lm_head_ctx(
            student_head.weight, student_head.bias, teacher_head.weight, teacher_head.bias
        ):
            loss, entropy_sum, n_valid = fused_divergence_loss(
                student_hidden.to(device), teacher_hidden.to(device), _HeadView(student_head),
                _HeadView(teacher_head), loss_mask.to(device), self.beta, num_items_in_batch,
                student_transform=logit_transform(unwrapped_student.config),
                teacher_transform=logit_transform(unwrapped_teacher.config),
                temperature=self.temperature,
            )  # fmt: skip
        return loss, entropy_sum.detach(), n_valid


class SampledTokenOPDTrainer(_CompletionThroughputMixin, DistillationTrainer):
    """Sampled-token on-policy distillation against a teacher server (S-OPD-3); see the module docstring.

    Args:
        teacher: a :class:`~dna_factory.distill.teacher_server.TeacherServer`, already checked for alignment.
        kl_coef: β of ``A_t = −β·d_t``.
        *args, **kwargs: as for :class:`~trl.DistillationTrainer`, without ``teacher_model``.
    """

    _tag_names = ["trl", "distillation", "dna-factory-opd"]

    def __init__(self, *args, teacher, kl_coef: float = 1.0, fused_loss: bool = True, **kwargs):
        super().__init__(*args, teacher_model=None, **kwargs)
        self.teacher = teacher
        self.kl_coef = kl_coef
        self.fused_loss = fused_loss
        self._kl_moments = torch.zeros(3, dtype=torch.float64)  # Σ d_t, Σ d_t², token count of the step
        use_fused_lm_head(self.model)

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        prompt_mask = output["prompt_mask"].bool()
        completion_mask = output["completion_mask"].bool()
        # The teacher scores exactly the student's ids: the prompt rendered once by the student's tokenizer
        # (left padding removed) followed by the sampled completion (right padding removed).
        prompts = [row[keep].tolist() for row, keep in zip(output["prompt_ids"], prompt_mask, strict=True)]
        completions = [
            row[keep].tolist() for row, keep in zip(output["completion_ids"], completion_mask, strict=True)
        ]
        started = time.perf_counter()
        scores = self.teacher.score(prompts, completions)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["time/teacher_s"].append(time.perf_counter() - started)
        teacher_logps = torch.zeros(completion_mask.shape, dtype=torch.float32)
        for row, values in enumerate(scores):
            teacher_logps[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        output["teacher_logps"] = teacher_logps.to(output["completion_ids"].device)
        return output

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mask = inputs["completion_mask"].float()
        if self.model.training and inputs.get("num_items_in_batch") is not None:
            # As TRL's DistillationTrainer: the completion-token count of the whole generation batch (all
            # processes), divided by the process count to undo DDP's gradient averaging.
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        else:
            num_items = mask.sum().clamp(min=1.0)
        unwrapped = self.accelerator.unwrap_model(model)
        head = unwrapped.get_output_embeddings()
        if self.fused_loss and fused_loss_applies(head.weight, head.bias):
            # Through the wrapper's forward, so DDP/FSDP/DeepSpeed hooks act as for any model call.
            loss, old_logps = self._forward_redirection(
                model, unwrapped, self._fused_sampled_token_loss, unwrapped, inputs, mask, num_items
            )
            d = old_logps - inputs["teacher_logps"].to(old_logps.device)
        else:
            logps = completion_logprobs(model, inputs)
            old_logps = logps.detach()
            teacher_logps = inputs["teacher_logps"].to(logps.device)
            d, advantages = sampled_token_advantages(old_logps, teacher_logps, self.kl_coef)
            loss = importance_sampling_loss(logps, old_logps, advantages, mask.to(logps.device), num_items)
        if self.model.training:
            masked = (d * mask.to(d.device)).double().cpu()
            self._kl_moments += torch.stack([masked.sum(), (masked**2).sum(), mask.double().sum().cpu()])
        return (loss, None) if return_outputs else loss

    def _fused_sampled_token_loss(self, unwrapped, inputs, mask, num_items):
        """``(loss, log π_old)`` of S-OPD-3 by :func:`~dna_factory.distill.fused_loss.fused_sampled_token_loss`."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        keep = inputs["completion_ids"].size(1)
        hidden = self._get_last_hidden_state(unwrapped, input_ids, attention_mask, keep)
        head = unwrapped.get_output_embeddings()
        device = head.weight.device
        with maybe_gather_lm_head_ctx(head.weight, head.bias):
            return fused_sampled_token_loss(
                hidden.to(device), _HeadView(head), inputs["completion_ids"].to(device),
                inputs["teacher_logps"], mask.to(device), num_items, self.kl_coef, logit_transform(unwrapped.config),
            )  # fmt: skip

    def _flush_step_metrics(self, seconds: float) -> None:
        super()._flush_step_metrics(seconds)
        total, total_sq, count = self.accelerator.reduce(
            self._kl_moments.to(self.accelerator.device), reduction="sum"
        ).tolist()
        self._kl_moments.zero_()
        if count > 0:
            mean = total / count
            variance = max(total_sq / count - mean * mean, 0.0)
            self._metrics["train"]["opd/reverse_kl_mean"].append(mean)
            self._metrics["train"]["opd/reverse_kl_std"].append(variance**0.5)
