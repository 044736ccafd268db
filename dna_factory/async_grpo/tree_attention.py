"""A portable (SDPA) implementation of TRL's tree attention for async GRPO's packed rows.

TRL 1.16's AsyncGRPOTrainer packs a rank's samples into a prefix trie (``TreeRow``): a token
shared by several samples is forwarded once, and each trie segment attends to the keys and
values of its root-to-segment path. TRL computes that with FlashAttention-3 varlen kernels
(``tree_fa3``), which exist only on recent NVIDIA GPUs with an FA3 build — not on CPU, not on
older GPUs.

``tree_sdpa`` computes the same attention with ``torch.nn.functional.scaled_dot_product_attention``
and an explicit boolean mask over the packed row: packed position ``q`` of segment ``s`` may see
key position ``k`` iff ``k`` lies on ``s``'s root-to-segment path at a depth no greater than
``q``'s (causal, aligned bottom-right exactly like flash-attn's ``causal=True`` with
``seqlen_q <= seqlen_k``), within the sliding window if the layer has one. The mask costs
``N²`` booleans for ``N`` packed tokens, so this path is for CPUs, tests and GPUs without FA3,
not for 16k-token rows on a production GPU. Selected with ``tree_attention: sdpa``;
``tests/test_async_grpo.py`` checks it against an unpacked dense forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TREE_SDPA = "tree_sdpa"

_mask_cache: dict[str, object] = {}


def tree_mask(
    kv_index: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, n: int, window: int | None
) -> torch.Tensor:
    """Boolean (n, n) mask: row = packed query position, column = packed key position it may attend to."""
    allowed = torch.zeros(n, n, dtype=torch.bool, device=kv_index.device)
    q_bounds = cu_seqlens_q.tolist()
    k_bounds = cu_seqlens_k.tolist()
    for s in range(len(q_bounds) - 1):
        q0, q1 = q_bounds[s], q_bounds[s + 1]
        path = kv_index[k_bounds[s] : k_bounds[s + 1]]
        len_q, len_k = q1 - q0, len(path)
        depth = torch.arange(len_k, device=kv_index.device)
        for j in range(len_q):
            last = len_k - len_q + j  # bottom-right causal alignment
            visible = depth <= last
            if window:
                visible &= depth > last - window
            allowed[q0 + j, path[visible]] = True
    return allowed


def _cached_mask(kv_index, cu_q, cu_k, n, window) -> torch.Tensor:
    # Every layer of one forward sees the same tree tensors: build the mask once per forward. The cache
    # holds the tensor object itself, so an identity match cannot be a recycled id.
    entry = _mask_cache.get("last")
    if entry is not None and entry[0] is kv_index and entry[1] == (n, window):
        return entry[2]
    mask = tree_mask(kv_index, cu_q, cu_k, n, window)
    _mask_cache["last"] = (kv_index, (n, window), mask)
    return mask


def tree_attention_sdpa(
    module,
    query,
    key,
    value,
    attention_mask,
    *,
    tree_kv_index,
    tree_cu_seqlens_q,
    tree_cu_seqlens_k,
    tree_max_seqlen_q=None,
    tree_max_seqlen_k=None,
    scaling=None,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """Same contract as ``trl.experimental.async_grpo.packing.tree_attention``: (1, H, N, D) in, (1, N, H, D) out."""
    if softcap:
        raise ValueError(
            "tree_attention: sdpa does not implement attention logit soft-capping; use tree_attention: fa3."
        )
    n = query.shape[2]
    mask = _cached_mask(tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, n, sliding_window)
    out = F.scaled_dot_product_attention(
        query,
        key.to(query.dtype),
        value.to(query.dtype),
        attn_mask=mask[None, None],
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def register_tree_sdpa() -> None:
    """Make ``tree_sdpa`` a transformers attention implementation (no separate mask: the kernel builds it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TREE_SDPA, tree_attention_sdpa)
    AttentionMaskInterface.register(TREE_SDPA, lambda **kwargs: None)


def use_tree_sdpa(model: torch.nn.Module) -> None:
    """Switch a model built with TRL's ``tree_fa3`` to ``tree_sdpa`` (same inputs, portable kernel)."""
    register_tree_sdpa()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = TREE_SDPA
