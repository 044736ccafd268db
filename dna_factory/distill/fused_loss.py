"""Fused distillation losses: each chunk's gradient is computed in the forward pass, no logits kept for the backward.

TRL's kernels (:class:`trl.kernels.ChunkedDivergenceFunction`, ``ChunkedLogProbFunction``) never
materialise the ``(tokens, vocab)`` logits either, but they project the vocabulary again in the
backward: the divergence costs two forward projections per model (three for the JSD) plus two in
the backward, against three for the naive ``log_softmax`` of full logits. The functions here
project each token chunk once per model, form the loss and its gradient with respect to the
chunk's logits while the chunk is in memory, and turn that into the gradient of the student's
hidden states (and, when they train, of its ``lm_head`` weight and bias) right away, as Liger's
fused linear losses do. The backward then only scales what the forward stored by the incoming
gradient: the same three projections as the naive loss, at the memory of one chunk.

This is exact because the loss is a fixed weighted sum of per-token terms: the weights
(``completion_mask / num_items``, TRL's scaling) are known when the forward runs, so the
per-token gradient rows are final. Both functions return the scalar loss, not per-token values.

``fused_divergence_loss``
    TRL's generalized JSD (``beta`` 0 forward KL, 1 reverse KL, else JSD with mixture
    ``(1 − beta)·S + beta·T``) between student and local teacher, with TRL's logit conventions
    (``logit_scale`` multiplier, ``final_logit_softcapping``, temperature) and the student's
    entropy; same values and gradients as ``trl.trainer.distillation_trainer._chunked_divergence_loss``.
``fused_sampled_token_loss``
    The sampled-token OPD loss of :mod:`dna_factory.distill.trainers` (S-OPD-3):
    ``−Σ_t r_t·A_t·w_t`` with ``A_t = −β·(log π_θ(y_t) − log π_T(y_t))``, ``r_t = 1`` in value.

Precision: projections and every per-chunk quantity are float32 whatever the inputs' dtype (a
bf16 student's logits are not rounded to bf16); gradients are cast back to each input's dtype.
Sharded heads (FSDP2 ``DTensor``, DeepSpeed ZeRO-3) that train are not handled here: the
trainers fall back to TRL's kernels for them (:func:`fused_loss_applies`).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

TILE_BYTES = 1 << 28
"""Bytes of one float32 ``(tokens, vocab)`` tile: 441 tokens at Qwen3's vocabulary of 151,936."""


def rows_per_chunk(tokens: int, vocab: int) -> int:
    """Tokens projected at once: a ``(rows, vocab)`` float32 tile fits :data:`TILE_BYTES`.

    Example:
        >>> rows_per_chunk(4096, 151936), rows_per_chunk(10, 1000)
        (441, 10)
    """
    return max(1, min(tokens, TILE_BYTES // (4 * vocab)))


def logit_transform(config) -> tuple[float, float | None]:
    """``(logit_scale, final_logit_softcapping)`` of a model config, read the way TRL 1.16 reads them.

    ``logit_scale`` (Cohere), ``output_multiplier`` (Muse Glimmer), ``lm_head_multiplier``
    (Falcon-H1) multiply the logits; ``logits_scaling`` divides them (Granite, MiniCPM3) except for
    HyperCLOVA X, which multiplies; ``final_logit_softcapping`` (Gemma) caps them after the scale.
    """
    text = config.get_text_config()
    scale = getattr(text, "logit_scale", None)
    if scale is None:
        scale = getattr(text, "output_multiplier", None)
    if scale is None:
        scale = getattr(text, "lm_head_multiplier", None)
    if scale is None and getattr(text, "logits_scaling", None) is not None:
        scale = text.logits_scaling if text.model_type == "hyperclovax" else 1 / text.logits_scaling
    return (1.0 if scale is None else float(scale)), getattr(text, "final_logit_softcapping", None)


def _sharded(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and (isinstance(tensor, DTensor) or hasattr(tensor, "ds_id"))


def fused_loss_applies(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """False for a sharded ``lm_head`` (FSDP2, ZeRO-3) that trains: its gradient belongs to the shard's backward."""
    trains = weight.requires_grad or (bias is not None and bias.requires_grad)
    return not (trains and (_sharded(weight) or _sharded(bias)))


class _Head:
    """One model's ``lm_head`` with its logit conventions: float32 logits of a chunk, and the chain rule back."""

    def __init__(self, weight, bias, scale: float, softcap: float | None, temperature: float):
        # A bf16/fp16 head is upcast once per call, not once per chunk (CPU matmuls have no fp32 output option).
        self.weight = weight if weight.dtype == torch.float32 else weight.float()
        self.bias = None if bias is None else bias.float()
        self.scale, self.softcap, self.inv_t = scale, softcap, 1.0 / temperature

    def logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(z, tanh)``: transformed float32 logits of ``hidden`` and, with soft-capping, the tanh for the backward."""
        y = hidden.float() @ self.weight.t()
        if self.bias is not None:
            y += self.bias
        if self.scale != 1.0:
            y *= self.scale
        th = None
        if self.softcap is not None:
            th = torch.tanh(y.div_(self.softcap))
            y = th * self.softcap
        if self.inv_t != 1.0:
            y *= self.inv_t
        return y, th

    def chain(self, grad_z: torch.Tensor, th: torch.Tensor | None) -> torch.Tensor:
        """``∂/∂(h·Wᵀ + b)`` from ``∂/∂z``, in place."""
        if th is not None:
            grad_z *= 1 - th * th
        factor = self.scale * self.inv_t
        return grad_z.mul_(factor) if factor != 1.0 else grad_z


class _Grads:
    """Float32 accumulators of the gradients of the student's hidden states, head weight and bias."""

    def __init__(self, hidden, weight, bias, needs: tuple[bool, bool, bool]):
        f32 = torch.float32
        self.hidden = torch.zeros(hidden.shape, dtype=f32, device=hidden.device) if needs[0] else None
        self.weight = torch.zeros(weight.shape, dtype=f32, device=weight.device) if needs[1] else None
        self.bias = (
            torch.zeros(bias.shape, dtype=f32, device=bias.device) if needs[2] and bias is not None else None
        )
        self.any = any(g is not None for g in (self.hidden, self.weight, self.bias))

    def add(self, rows: slice, grad_logits: torch.Tensor, hidden_chunk: torch.Tensor, head: _Head) -> None:
        if self.hidden is not None:
            self.hidden[rows] = grad_logits @ head.weight
        if self.weight is not None:
            self.weight.addmm_(grad_logits.t(), hidden_chunk.float())
        if self.bias is not None:
            self.bias += grad_logits.sum(0)

    def scaled(self, grad_loss: torch.Tensor, like: tuple) -> tuple:
        return tuple(
            None if g is None else (g * grad_loss.float()).to(x.dtype)
            for g, x in zip((self.hidden, self.weight, self.bias), like, strict=True)
        )


def _needs(hidden, weight, bias) -> tuple[bool, bool, bool]:
    """Which gradients to form; called before ``apply`` (inside ``forward`` grad mode is always off, and
    ``ctx.needs_input_grad`` says True under ``torch.no_grad`` too)."""
    if not torch.is_grad_enabled():
        return False, False, False
    return hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad


def _divergence_chunk(log_ps: torch.Tensor, log_pt: torch.Tensor, beta: float):
    """Per-token divergence, student entropy and ``∂ divergence / ∂ z_student`` of one chunk of log-probabilities."""
    ps = log_ps.exp()
    entropy = -(ps * log_ps).sum(-1)
    if beta == 0.0:  # KL(T ‖ S)
        pt = log_pt.exp()
        divergence = (pt * (log_pt - log_ps)).sum(-1)
        return divergence, entropy, ps.sub_(pt)
    if beta == 1.0:  # KL(S ‖ T)
        gap = log_ps - log_pt
        divergence = (ps * gap).sum(-1)
        return divergence, entropy, ps.mul_(gap.sub_(divergence[:, None]))
    log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))
    kl_t = (log_pt.exp() * (log_pt - log_m)).sum(-1)
    gap = log_ps - log_m
    kl_s = (ps * gap).sum(-1)
    grad = ps.mul_(gap.sub_(kl_s[:, None])).mul_(1 - beta)
    return beta * kl_t + (1 - beta) * kl_s, entropy, grad


class FusedDivergenceFunction(torch.autograd.Function):
    """``Σ_t w_t · D_beta(S_t ‖ T_t)`` with its gradient formed in the forward; see the module docstring."""

    @staticmethod
    def forward(ctx, h_s, w_s, b_s, h_t, w_t, b_t, weights, beta, temperature, student, teacher, needs):
        grads = _Grads(h_s, w_s, b_s, needs)
        s_head = _Head(w_s, b_s, *student, temperature)
        t_head = _Head(w_t, b_t, *teacher, temperature)
        n = h_s.shape[0]
        divergence = torch.zeros(n, dtype=torch.float32, device=h_s.device)
        entropy = torch.zeros_like(divergence)
        weights = weights.float()
        step = rows_per_chunk(n, w_s.shape[0])
        for start in range(0, n, step):
            rows = slice(start, min(start + step, n))
            zs, th = s_head.logits(h_s[rows])
            zt, _ = t_head.logits(h_t[rows])
            log_ps = zs.sub_(torch.logsumexp(zs, -1, keepdim=True))
            log_pt = zt.sub_(torch.logsumexp(zt, -1, keepdim=True))
            divergence[rows], entropy[rows], grad_z = _divergence_chunk(log_ps, log_pt, beta)
            del log_ps, log_pt, zs, zt
            if grads.any:
                grad_z *= weights[rows, None]
                grads.add(rows, s_head.chain(grad_z, th), h_s[rows], s_head)
        ctx.grads, ctx.like = grads, (h_s, w_s, b_s)
        ctx.mark_non_differentiable(divergence, entropy)
        return (weights * divergence).sum(), divergence, entropy

    @staticmethod
    def backward(ctx, grad_loss, _divergence, _entropy):
        return *ctx.grads.scaled(grad_loss, ctx.like), *(None,) * 9


class FusedSampledTokenFunction(torch.autograd.Function):
    """``−Σ_t r_t·A_t·w_t`` (S-OPD-3, ``r_t = 1`` in value) with its gradient formed in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, teacher_logps, weights, kl_coef, student, needs):
        grads = _Grads(hidden, weight, bias, needs)
        head = _Head(weight, bias, *student, 1.0)
        n = hidden.shape[0]
        logps = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        weights = weights.float()
        step = rows_per_chunk(n, weight.shape[0])
        for start in range(0, n, step):
            rows = slice(start, min(start + step, n))
            z, th = head.logits(hidden[rows])
            # One exp pass serves both the log-normaliser and the softmax of the gradient.
            top = z.amax(-1, keepdim=True)
            picked = z.gather(-1, targets[rows, None]) - top
            e = z.sub_(top).exp_()
            total = e.sum(-1, keepdim=True)
            logps[rows] = (picked - total.log())[:, 0]
            if grads.any:
                # ∂L/∂log π(y_t) = −A_t·w_t = β·d_t·w_t, and ∂log π(y_t)/∂z = onehot(y_t) − softmax(z).
                coef = (kl_coef * (logps[rows] - teacher_logps[rows].float()) * weights[rows])[:, None]
                grad_z = e.mul_(-coef / total)
                grad_z.scatter_add_(-1, targets[rows, None], coef)
                grads.add(rows, head.chain(grad_z, th), hidden[rows], head)
            del z, e
        advantages = -kl_coef * (logps - teacher_logps.float())
        ctx.grads, ctx.like = grads, (hidden, weight, bias)
        ctx.mark_non_differentiable(logps)
        return -(advantages * weights).sum(), logps

    @staticmethod
    def backward(ctx, grad_loss, _logps):
        return *ctx.grads.scaled(grad_loss, ctx.like), *(None,) * 6


def fused_divergence_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    student_head: torch.nn.Module,
    teacher_head: torch.nn.Module,
    completion_mask: torch.Tensor,
    beta: float,
    num_items_in_batch: torch.Tensor | float | None = None,
    *,
    student_transform: tuple[float, float | None] = (1.0, None),
    teacher_transform: tuple[float, float | None] = (1.0, None),
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop-in for TRL's ``_chunked_divergence_loss``: ``(loss, entropy_sum, n_valid)`` over the masked positions.

    Args:
        student_hidden, teacher_hidden: backbone outputs ``(B, K, H)`` aligned to the completion tokens.
        student_head, teacher_head: the two ``lm_head`` modules (``weight`` ``(V, H)``, optional ``bias``).
        completion_mask: ``(B, K)``, 1 where the token is in the loss.
        beta: 0 forward KL, 1 reverse KL, else generalized JSD.
        num_items_in_batch: divide the sum by this (TRL's gradient-accumulation scaling); None: mean over the mask.
        student_transform, teacher_transform: ``(logit_scale, final_logit_softcapping)``, see :func:`logit_transform`.
        temperature: divides both models' logits.
    """
    valid = completion_mask.reshape(-1) != 0
    n_valid = valid.sum()
    h_s = student_hidden.reshape(-1, student_hidden.size(-1))[valid]
    h_t = teacher_hidden.reshape(-1, teacher_hidden.size(-1))[valid]
    denominator = n_valid.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    if isinstance(denominator, torch.Tensor):
        denominator = denominator.to(h_s.device)
    weights = torch.ones(h_s.shape[0], device=h_s.device) / denominator
    loss, _, entropy = FusedDivergenceFunction.apply(
        h_s, student_head.weight, student_head.bias, h_t.detach(), teacher_head.weight.detach(),
        None if teacher_head.bias is None else teacher_head.bias.detach(), weights, beta, temperature,
        student_transform, teacher_transform, _needs(h_s, student_head.weight, student_head.bias),
    )  # fmt: skip
    return loss, entropy.sum(), n_valid


def fused_sampled_token_loss(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    completion_ids: torch.Tensor,
    teacher_logps: torch.Tensor,
    mask: torch.Tensor,
    num_items: torch.Tensor | float,
    kl_coef: float,
    transform: tuple[float, float | None] = (1.0, None),
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, log π_θ(y_t))`` of S-OPD-3 from the student's hidden states; same values as the unfused loss.

    Args:
        hidden: backbone outputs ``(B, K, H)``, position ``t`` predicting ``completion_ids[:, t]``.
        head: the student's ``lm_head``.
        completion_ids: ``(B, K)`` sampled tokens ``y_t``.
        teacher_logps: ``(B, K)`` ``log π_T(y_t)``.
        mask: ``(B, K)`` 1 on completion tokens.
        num_items: ``N`` of ``−Σ_t r_t·A_t / N``.
        kl_coef: β of ``A_t = −β·d_t``.
        transform: ``(logit_scale, final_logit_softcapping)`` of the student.

    Returns:
        The loss and the detached ``(B, K)`` log-probabilities (0 off the mask).
    """
    valid = mask.reshape(-1) != 0
    flat = hidden.reshape(-1, hidden.size(-1))[valid]
    weights = mask.reshape(-1)[valid].float() / num_items
    loss, logps = FusedSampledTokenFunction.apply(
        flat, head.weight, head.bias, completion_ids.reshape(-1)[valid],
        teacher_logps.reshape(-1)[valid].to(flat.device), weights.to(flat.device), kl_coef, transform,
        _needs(flat, head.weight, head.bias),
    )  # fmt: skip
    full = torch.zeros(valid.shape, dtype=logps.dtype, device=logps.device)
    full[valid] = logps
    return loss, full.view(mask.shape)
