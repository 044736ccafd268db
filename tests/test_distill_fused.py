"""The fused distillation losses (dna_factory/distill/fused_loss.py) equal TRL's and the float64 definitions.

Values and gradients (hidden states, a trained head's weight and bias) are compared with TRL's
own kernels (``_chunked_divergence_loss``, ``ChunkedLogProbFunction``) and with naive float64
full-logits losses, to 1e-5 in fp32, over every divergence (beta 0, 0.5, 1), the sampled-token
loss, TRL's logit conventions (scale, soft-cap, temperature), masking and many chunks. The bf16
path is compared with the fp32 loss at bf16 precision. Then the stage's trainers: the fused loss
is what they train by default, and ``fused_loss: false`` (TRL's kernels) gives the same loss and
LoRA gradients.
"""

from __future__ import annotations

import itertools

import pytest

from tests.lazy import lazy

torch = lazy("torch")
fused_loss = lazy("dna_factory.distill.fused_loss")
trainers = lazy("dna_factory.distill.trainers")

B, K, H, V = 3, 7, 16, 53


@pytest.fixture(autouse=True)
def many_chunks(monkeypatch):
    """Three tokens per chunk: the chunk loop, its last partial chunk and the gradient rows are all exercised."""
    monkeypatch.setattr("dna_factory.distill.fused_loss.TILE_BYTES", 4 * V * 3)


def _transform(logits, scale, softcap, temperature=1.0):
    y = logits * scale
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    return y / temperature


def _divergence_f64(zs, zt, beta):
    log_s, log_t = torch.log_softmax(zs.double(), -1), torch.log_softmax(zt.double(), -1)
    if beta == 0.0:
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if beta == 1.0:
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    log_m = torch.logaddexp(log_s + torch.log(torch.tensor(1 - beta)), log_t + torch.log(torch.tensor(beta)))
    return beta * (log_t.exp() * (log_t - log_m)).sum(-1) + (1 - beta) * (log_s.exp() * (log_s - log_m)).sum(
        -1
    )


def _mask():
    mask = torch.ones(B, K)
    mask[0, 4:] = 0  # right padding
    mask[2, :2] = 0  # masked positions inside a row (tool outputs)
    return mask


CASES = list(itertools.product([0.0, 0.5, 1.0], [(1.0, None), (0.7, 5.0)], [1.0, 2.0], [False, True]))


@pytest.mark.parametrize(("beta", "transform", "temperature", "bias"), CASES)
def test_divergence_equals_trl_and_float64_with_gradients(beta, transform, temperature, bias):
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    torch.manual_seed(0)
    h_s, h_t = torch.randn(B, K, H, requires_grad=True), torch.randn(B, K, H)
    student, teacher = torch.nn.Linear(H, V, bias=bias), torch.nn.Linear(H, V, bias=bias)
    mask, n = _mask(), torch.tensor(17.0)
    params = [h_s, student.weight] + ([student.bias] if bias else [])
    scale, softcap = transform

    loss, entropy, n_valid = fused_loss.fused_divergence_loss(
        h_s, h_t, student, teacher, mask, beta, n, student_transform=transform, temperature=temperature
    )
    grads = torch.autograd.grad(loss, params)
    trl = _chunked_divergence_loss(
        h_s, h_t, student.weight, teacher.weight, mask, beta, n, student.bias, teacher.bias,
        scale, 1.0, softcap, None, temperature,
    )  # fmt: skip
    trl_grads = torch.autograd.grad(trl[0], params)
    zs = _transform(student(h_s), scale, softcap, temperature)
    zt = _transform(teacher(h_t), 1.0, None, temperature)
    f64 = (_divergence_f64(zs, zt, beta) * mask).sum() / n
    f64_grads = torch.autograd.grad(f64, params)

    assert loss.item() == pytest.approx(f64.item(), abs=1e-6)
    assert loss.item() == pytest.approx(trl[0].item(), abs=1e-6)
    assert entropy.item() == pytest.approx(trl[1].item(), abs=1e-4) and int(n_valid) == int(mask.sum())
    for mine, theirs, exact in zip(grads, trl_grads, f64_grads, strict=True):
        assert torch.allclose(mine, theirs, atol=1e-5, rtol=1e-5)
        assert torch.allclose(mine, exact, atol=1e-5, rtol=1e-5)
    assert grads[0][0, 4:].abs().max() == 0 and grads[0][2, :2].abs().max() == 0  # masked rows get nothing


def test_divergence_without_num_items_is_the_mean_over_the_mask():
    torch.manual_seed(1)
    h_s, h_t = torch.randn(B, K, H), torch.randn(B, K, H)
    student, teacher = torch.nn.Linear(H, V, bias=False), torch.nn.Linear(H, V, bias=False)
    mask = _mask()
    loss, _, _ = fused_loss.fused_divergence_loss(h_s, h_t, student, teacher, mask, 1.0)
    with torch.no_grad():
        expected = (_divergence_f64(student(h_s), teacher(h_t), 1.0) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)


@pytest.mark.parametrize(
    ("transform", "bias"), list(itertools.product([(1.0, None), (0.7, 5.0)], [False, True]))
)
def test_sampled_token_equals_the_unfused_loss_and_trl_logprobs(transform, bias):
    from trl.kernels import ChunkedLogProbFunction

    torch.manual_seed(2)
    hidden = torch.randn(B, K, H, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=bias)
    ids = torch.randint(0, V, (B, K))
    teacher_logps, mask, n = -8 * torch.rand(B, K), _mask(), 11.0
    params = [hidden, head.weight] + ([head.bias] if bias else [])

    loss, logps = fused_loss.fused_sampled_token_loss(
        hidden, head, ids, teacher_logps, mask, n, 0.5, transform
    )
    grads = torch.autograd.grad(loss, params)
    full = torch.log_softmax(_transform(head(hidden), *transform), -1).gather(-1, ids[..., None])[..., 0]
    _, advantages = trainers.sampled_token_advantages(full.detach(), teacher_logps, 0.5)
    reference = trainers.importance_sampling_loss(full, full.detach(), advantages, mask, n)
    reference_grads = torch.autograd.grad(reference, params)
    trl = ChunkedLogProbFunction.apply(
        hidden.reshape(-1, H), head.weight, head.bias, ids.reshape(-1), 1.0, 4, transform[1], transform[0],
        ("log_probs",),
    )[0].view(B, K)  # fmt: skip

    assert loss.item() == pytest.approx(reference.item(), abs=1e-6)
    assert torch.allclose(logps, (full * mask).detach(), atol=1e-5)
    assert torch.allclose(logps, (trl * mask).detach(), atol=1e-5)
    assert not logps.requires_grad
    for mine, theirs in zip(grads, reference_grads, strict=True):
        assert torch.allclose(mine, theirs, atol=1e-6, rtol=1e-5)


def test_no_gradient_is_formed_under_no_grad():
    h_s = torch.randn(B, K, H, requires_grad=True)
    student, teacher = torch.nn.Linear(H, V), torch.nn.Linear(H, V)
    with torch.no_grad():
        loss, _, _ = fused_loss.fused_divergence_loss(
            h_s, torch.randn(B, K, H), student, teacher, _mask(), 0.5
        )
        sampled, _ = fused_loss.fused_sampled_token_loss(h_s, student, torch.zeros(B, K, dtype=torch.long), -torch.ones(B, K),
                                              _mask(), 5.0, 1.0)  # fmt: skip
    assert not loss.requires_grad and not sampled.requires_grad


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_bf16_inputs_train_in_float32_and_give_bf16_gradients(beta):
    """A bf16 student: its logits are not rounded to bf16, the gradients come back in bf16 at bf16 precision."""
    torch.manual_seed(3)
    h32, t32 = torch.randn(B, K, H), torch.randn(B, K, H)
    s32, te32 = torch.nn.Linear(H, V, bias=False), torch.nn.Linear(H, V, bias=False)
    s16, te16 = torch.nn.Linear(H, V, bias=False).bfloat16(), torch.nn.Linear(H, V, bias=False).bfloat16()
    with torch.no_grad():
        s16.weight.copy_(s32.weight)
        te16.weight.copy_(te32.weight)
        s32.weight.copy_(s16.weight.float())  # the same (bf16-representable) numbers in both
        te32.weight.copy_(te16.weight.float())
    h16 = h32.bfloat16().requires_grad_()
    h32 = h16.detach().float().requires_grad_()
    mask = _mask()
    loss16, _, _ = fused_loss.fused_divergence_loss(h16, t32.bfloat16(), s16, te16, mask, beta)
    loss32, _, _ = fused_loss.fused_divergence_loss(h32, t32.bfloat16().float(), s32, te32, mask, beta)
    g16, w16 = torch.autograd.grad(loss16, [h16, s16.weight])
    g32, w32 = torch.autograd.grad(loss32, [h32, s32.weight])
    assert loss16.dtype == torch.float32 and loss16.item() == pytest.approx(loss32.item(), abs=1e-6)
    assert g16.dtype == torch.bfloat16 and w16.dtype == torch.bfloat16
    assert torch.allclose(g16.float(), g32, atol=1e-3, rtol=1e-2)
    assert torch.allclose(w16.float(), w32, atol=1e-3, rtol=1e-2)

    ids = torch.randint(0, V, (B, K))
    sampled16, _ = fused_loss.fused_sampled_token_loss(h16, s16, ids, -torch.ones(B, K), mask, 9.0, 1.0)
    sampled32, _ = fused_loss.fused_sampled_token_loss(h32, s32, ids, -torch.ones(B, K), mask, 9.0, 1.0)
    assert sampled16.item() == pytest.approx(sampled32.item(), abs=1e-5)
    assert torch.allclose(torch.autograd.grad(sampled16, h16)[0].float(), torch.autograd.grad(sampled32, h32)[0],
                          atol=1e-3, rtol=1e-2)  # fmt: skip


def test_chunk_rows_fit_the_tile_budget(monkeypatch):
    monkeypatch.setattr("dna_factory.distill.fused_loss.TILE_BYTES", 1 << 28)
    assert fused_loss.rows_per_chunk(4096, 151936) == 441
    assert fused_loss.rows_per_chunk(4096, 151936) * 151936 * 4 <= 1 << 28
    assert fused_loss.rows_per_chunk(5, 10**9) == 1  # a huge vocabulary still makes progress


def test_a_trained_sharded_head_is_left_to_trl():
    weight = torch.nn.Parameter(torch.zeros(4, 2))
    weight.ds_id = 7  # how DeepSpeed ZeRO-3 marks a partitioned parameter
    assert not fused_loss.fused_loss_applies(weight)
    weight.requires_grad_(False)  # frozen (LoRA): gathered for the forward, nothing to hand back
    assert fused_loss.fused_loss_applies(weight)
    assert fused_loss.fused_loss_applies(torch.nn.Parameter(torch.zeros(4, 2)))
