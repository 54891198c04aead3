"""Paged decode attention: one new query token per sequence against its paged KV cache.

For sequence s and query head h (KV head g = h // group), with the query at position
p = seq_lens[s] - 1 and the visible key positions V = {k : max(0, p - W + 1) <= k <= p}
(W = sliding_window, or unbounded):

    score_k = scale * <q[s, h], K[s, k, g]>,   then softcap * tanh(score_k / softcap) if softcap
    out[s, h] = sum_{k in V} softmax(score)_k * V[s, k, g]

where K[s, k] lives at key_cache[block_tables[s, k // block_size], k % block_size].
A sequence with seq_len == 0 sees no keys: its output is all zeros.
"""

from __future__ import annotations

import torch

from ._backend import num_multiprocessors, use_triton, value_checks_enabled
from ._validate import (
    FLOAT_DTYPES,
    check_gqa,
    check_head_size,
    check_kv_caches,
    check_optional_positive,
    check_same_dtype,
    check_tensor,
)

__all__ = ["paged_decode_attention"]


def _validate(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap,
              num_splits, out) -> int:
    """All shape/dtype/device checks (no tensor values read). Returns the GQA group size."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_seqs, num_q_heads, head_dim = q.shape
    check_kv_caches(key_cache, value_cache, device=q.device)
    check_same_dtype("key_cache", key_cache, "q", q)
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"key_cache: head_dim {cache_head_dim} differs from q's head_dim {head_dim}")
    check_head_size("q", head_dim)
    group = check_gqa(num_q_heads, num_kv_heads)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=q.device,
                 shape=(num_seqs, None))
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=q.device, shape=(num_seqs,))
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if softcap is not None and not isinstance(softcap, (int, float)):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    check_optional_positive("softcap", softcap)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be an int >= 1 or None, got {num_splits!r}")
    if out is not None:
        check_tensor("out", out, dtypes=(q.dtype,), device=q.device, shape=tuple(q.shape))
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last (head_dim) dimension")
    return group


def _check_values(key_cache, block_tables, seq_lens) -> None:
    """Checks that read seq_lens / block_tables (a host sync on CUDA)."""
    num_blocks, block_size = key_cache.shape[:2]
    max_blocks_per_seq = block_tables.shape[1]
    lens = seq_lens.long()
    if bool((lens < 0).any()):
        raise ValueError(f"seq_lens must be >= 0, got {seq_lens.tolist()}")
    if bool((lens > num_blocks * block_size).any()):
        raise ValueError(
            f"seq_lens {seq_lens.tolist()} exceed the cache capacity of {num_blocks} blocks x {block_size} slots")
    if bool((lens > max_blocks_per_seq * block_size).any()):
        raise ValueError(
            f"block_tables too short: {max_blocks_per_seq} blocks per sequence x block size {block_size} "
            f"cannot hold seq_lens {seq_lens.tolist()}")
    # Only the entries a sequence actually uses must be valid block ids; the rest may be padding.
    used = torch.arange(max_blocks_per_seq, device=lens.device) * block_size < lens[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        seq = int(bad.nonzero()[0, 0])
        raise ValueError(f"block_tables[{seq}] holds block ids out of range [0, {num_blocks}): "
                         f"{block_tables[seq][used[seq]].tolist()}")


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged KV cache (flash-decoding split-K).

    Args:
        q: ``[num_seqs, num_q_heads, head_dim]`` fp16/bf16/fp32; head_dim in (64, 80, 96, 128, 256).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype;
            num_q_heads must be a multiple of num_kv_heads (GQA).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``; entries past a sequence's last block
            are never read.
        seq_lens: int32 ``[num_seqs]``, tokens in the cache including the current one (the query
            sits at position ``seq_len - 1``). ``seq_len == 0`` gives an all-zero output row.
        scale: score scale, default ``head_dim ** -0.5``.
        sliding_window: W; the query at p sees keys k with ``p - W < k <= p``.
        softcap: scores become ``softcap * tanh(score / softcap)`` after scaling.
        num_splits: force the number of context partitions (>= 1); default from
            :func:`decode_num_splits` (shape-only, no host sync, CUDA-graph capturable).
        out: optional ``[num_seqs, num_q_heads, head_dim]`` output in q's dtype.

    Returns:
        ``[num_seqs, num_q_heads, head_dim]`` in q's dtype (``out`` when given).
    """
    group = _validate(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap,
                      num_splits, out)
    if value_checks_enabled(q):
        _check_values(key_cache, block_tables, seq_lens)
    head_dim = q.shape[-1]
    scale = float(head_dim ** -0.5 if scale is None else scale)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.shape[0] == 0:
        return out
    if use_triton(q):
        _decode_triton(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap,
                       num_splits, out, group)
    else:
        out.copy_(_decode_torch(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
                                softcap))
    return out


def _decode_torch(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap):
    """Vectorized PyTorch twin: gather each sequence's whole table width, mask, softmax in fp32."""
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    max_blocks_per_seq = block_tables.shape[1]
    lens = seq_lens.long()
    # Table entries past a sequence's end may be garbage: point them at block 0 (in range) and mask.
    block_used = torch.arange(max_blocks_per_seq, device=q.device) * block_size < lens[:, None]
    block_ids = torch.where(block_used, block_tables.long(), 0)  # [num_seqs, max_blocks_per_seq]
    context = max_blocks_per_seq * block_size
    keys = key_cache[block_ids].reshape(num_seqs, context, num_kv_heads, head_dim)
    values = value_cache[block_ids].reshape(num_seqs, context, num_kv_heads, head_dim)
    pos = torch.arange(context, device=q.device)
    visible = pos[None, :] < lens[:, None]  # [num_seqs, context]
    if sliding_window is not None:
        visible &= pos[None, :] > lens[:, None] - 1 - sliding_window
    # Unused slots may hold NaN/inf: zero them, since 0 * NaN would still be NaN.
    keys = torch.where(visible[:, :, None, None], keys.float(), 0.0)
    values = torch.where(visible[:, :, None, None], values.float(), 0.0)
    qg = q.float().view(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = torch.einsum("skgd,slkd->skgl", qg, keys) * scale  # [num_seqs, kv, group, context]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = torch.where(visible[:, None, None, :], scores, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # empty rows (seq_len 0)
    probs = torch.exp(scores - row_max)  # exp(-inf) = 0 on masked keys
    denom = probs.sum(dim=-1, keepdim=True)
    outg = torch.einsum("skgl,slkd->skgd", probs, values) / torch.where(denom > 0, denom, 1.0)
    return outg.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)


def _decode_triton(*args, **kwargs):
    raise NotImplementedError("the Triton decode kernel is not written yet; use backend 'torch'")
