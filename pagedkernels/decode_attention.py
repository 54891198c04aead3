"""Paged decode attention: one new query token per sequence against its paged KV cache.

For sequence s and query head h (KV head g = h // group), with the query at position
p = seq_lens[s] - 1 and the visible key positions V = {k : max(0, p - W + 1) <= k <= p}
(W = sliding_window, or unbounded):

    score_k = scale * <q[s, h], K[s, k, g]>,   then softcap * tanh(score_k / softcap) if softcap
    out[s, h] = sum_{k in V} softmax(score)_k * V[s, k, g]

where K[s, k] lives at key_cache[block_tables[s, k // block_size], k % block_size] (times k_scale for a
float8 e4m3 cache, whose V is times v_scale: the kernels fold the scales into the score scale and the
output's normalization and feed the e4m3 values to the products as they are, pagedkernels/_fp8.py).
A sequence with seq_len == 0 sees no keys: its output is all zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _native
from ._backend import (
    has_no_data,
    launch_device_kind,
    num_multiprocessors,
    pdl_launch,
    use_native,
    use_triton,
    value_checks_enabled,
)
from ._pdl import pdl_wait
from ._fp8 import _e4m3_to_float, _float_to_e4m3, is_fp8
from .cache_ops import _check_slots
from .rotary import _check_positions, check_rotary_and_cache_args, rotary_embedding_and_cache
from ._validate import (
    FLOAT_DTYPES,
    check_attention_options,
    check_cache_dtype,
    check_gqa,
    check_head_size,
    check_kv_caches,
    check_kv_scales,
    check_tensor,
)

__all__ = ["paged_decode_attention", "rotary_cache_decode_attention", "check_decode_args", "decode_num_splits",
           "decode_split_counters", "decode_workspace", "decode_workspace_numel"]


def check_decode_args(q, key_cache, value_cache, block_tables, seq_lens, scale=None, sliding_window=None,
                      softcap=None, num_splits=None, out=None, workspace=None, k_scale=1.0, v_scale=1.0,
                      split_counters=None) -> int:
    """Every check of :func:`paged_decode_attention`'s arguments that reads no tensor value (types,
    ranks, dtypes, one device, shapes, strides, the options), shared with its fake implementation.
    Returns the GQA group size."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_seqs, num_q_heads, head_dim = q.shape
    on_q = ("q", q)
    check_kv_caches(key_cache, value_cache, like=on_q)
    check_cache_dtype("key_cache", key_cache, "q", q)
    check_kv_scales(k_scale, v_scale, key_cache)
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"key_cache: head_dim {cache_head_dim} differs from q's head_dim {head_dim}")
    check_head_size("q", head_dim)
    group = check_gqa(num_q_heads, num_kv_heads)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), like=on_q, shape=(num_seqs, None))
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), like=on_q, shape=(num_seqs,))
    check_attention_options(scale, sliding_window, softcap)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be an int >= 1 or None, got {num_splits!r}")
    if out is not None:
        check_tensor("out", out, dtypes=(q.dtype,), like=on_q, shape=tuple(q.shape))
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last (head_dim) dimension")
    if workspace is not None:
        check_tensor("workspace", workspace, ndim=1, dtypes=(torch.float32,), like=on_q)
        if not workspace.is_contiguous():
            raise ValueError("workspace must be contiguous")
        if num_splits is not None and num_splits > 1:
            needed = decode_workspace_numel(num_seqs, num_q_heads, head_dim, num_splits)
            if workspace.numel() < needed:
                raise ValueError(f"workspace holds {workspace.numel()} floats; num_splits={num_splits} needs "
                                 f"{needed} (decode_workspace_numel)")
    if split_counters is not None:
        check_tensor("split_counters", split_counters, ndim=1, dtypes=(torch.int32,), like=on_q)
        if not split_counters.is_contiguous():
            raise ValueError("split_counters must be contiguous")
        if split_counters.numel() < num_seqs * num_kv_heads:
            raise ValueError(f"split_counters holds {split_counters.numel()} counters; {num_seqs} sequences x "
                             f"{num_kv_heads} KV heads need {num_seqs * num_kv_heads} (decode_split_counters)")
    return group


def _check_values(key_cache, block_tables, seq_lens) -> None:
    """Checks that read seq_lens / block_tables (a host sync on CUDA)."""
    num_blocks, block_size = key_cache.shape[:2]
    max_blocks_per_seq = block_tables.shape[1]
    lens = seq_lens.long()
    # One vectorized pass (microseconds on CPU); the messages below are built only on failure.
    used = torch.arange(max_blocks_per_seq, device=lens.device) * block_size < lens[:, None]
    bad = ((lens < 0) | (lens > min(num_blocks, max_blocks_per_seq) * block_size)).any() | (
        used & ((block_tables < 0) | (block_tables >= num_blocks))).any()
    if not bool(bad):
        return
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
    workspace: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    split_counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged KV cache (flash-decoding split-K).

    Args:
        q: ``[num_seqs, num_q_heads, head_dim]`` fp16/bf16/fp32; head_dim a multiple of 16 in [32, 256].
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype or
            ``torch.float8_e4m3fn``; num_q_heads must be a multiple of num_kv_heads (GQA).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``; entries past a sequence's last block
            are never read.
        seq_lens: int32 ``[num_seqs]``, tokens in the cache including the current one (the query
            sits at position ``seq_len - 1``). ``seq_len == 0`` gives an all-zero output row.
        scale: score scale, default ``head_dim ** -0.5``.
        sliding_window: W; the query at p sees keys k with ``p - W < k <= p``.
        softcap: scores become ``softcap * tanh(score / softcap)`` after scaling.
        num_splits: force the number of context partitions (>= 1); default from
            :func:`decode_num_splits` (shape-only, no host sync, CUDA-graph capturable), capped
            to what ``workspace`` holds when one is given.
        out: optional ``[num_seqs, num_q_heads, head_dim]`` output in q's dtype.
        workspace: optional float32 1-D contiguous buffer on q's device for the split-K partial
            results (see :func:`decode_workspace`), so that a launch allocates nothing (CUDA-graph
            capture). ``num_splits`` partitions of ``num_seqs`` sequences use its first
            :func:`decode_workspace_numel` floats; a forced ``num_splits`` that does not fit is a
            ValueError. Without it the op allocates that scratch per call. Unused by the PyTorch and
            native backends (validated all the same). Calls that run one after another on a stream
            (the layers of a model) may share one workspace.
        k_scale, v_scale: a float8 cache's per-layer scales (its values times these are K and V);
            1.0 for other caches.
        split_counters: optional int32 1-D contiguous buffer of at least ``num_seqs * num_kv_heads``
            zeros on q's device (see :func:`decode_split_counters`). With it, a launch that splits
            the context merges the splits in its one kernel: the last program of each (sequence, KV
            head) to finish counts in, reads the others' partial results and writes the output, so
            the reduce kernel is not launched; it leaves the counters at zero again. Launches that
            may run at the same time (other streams) must not share one; calls one after another on
            a stream may. Unused by the PyTorch and native backends and by unsplit launches.

    Returns:
        ``[num_seqs, num_q_heads, head_dim]`` in q's dtype (``out`` when given).
    """
    group = check_decode_args(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap,
                              num_splits, out, workspace, k_scale, v_scale, split_counters)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if has_no_data(q, key_cache, value_cache, block_tables, seq_lens, out, workspace, split_counters):
        return out  # meta or fake tensors: checked, nothing to compute (the fake implementation)
    head_dim = q.shape[-1]
    # The native kernel checks the metadata values itself, before it writes anything.
    native = not use_triton(q) and use_native(q) and _native.supports(q, head_dim, group)
    if value_checks_enabled(q) and not native:
        _check_values(key_cache, block_tables, seq_lens)
    scale = float(head_dim ** -0.5 if scale is None else scale)
    if q.shape[0] == 0:
        return out
    if native:
        if not _native.paged_attention(q, key_cache, value_cache, block_tables, None, seq_lens, scale,
                                       sliding_window, softcap, out, k_scale, v_scale):
            _check_values(key_cache, block_tables, seq_lens)
            raise RuntimeError("pagedkernels native decode attention rejected metadata the checks accept")
    elif use_triton(q):
        if value_checks_enabled(q):
            _check_counters_zero(split_counters, q.shape[0] * key_cache.shape[2])
        _decode_triton(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap,
                       num_splits, out, group, workspace, k_scale, v_scale, split_counters)
    else:
        out.copy_(_decode_torch(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
                                softcap, k_scale, v_scale))
    return out


def rotary_cache_decode_attention(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    is_neox: bool = True,
    head_size: int | None = None,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float | None = None,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    split_counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """A decode step's attention layer from its un-rotated q, k and v: what
    :func:`~pagedkernels.rotary_embedding_and_cache` then :func:`paged_decode_attention` compute, in one Triton
    kernel on CUDA (a small model's batch-1 step is bound by its launches). Each sequence's new token sits at
    position ``seq_len - 1``; its key is rotated (after Qwen3's per-head norms with ``q_weight`` / ``k_weight`` /
    ``eps``) and written with its value into its ``slot_mapping`` slot, and every query head is rotated, inside the
    split kernel: the program holding the last tile of a (sequence, KV head) writes the slot before its loop reads
    its tiles back (no other program reads that position).

    Unlike the two ops, **q and k are not modified** (the programs of a KV head all read the group's queries). The
    other backends (PyTorch, native CPU) run the two ops on copies of q and k.

    positions, q, k, v, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox, head_size, q_weight, k_weight,
    eps, k_scale, v_scale: as :func:`~pagedkernels.rotary_embedding_and_cache`, with one token per sequence (q
    ``[num_seqs, num_q_heads, head_dim]`` or its 2-D view, whose head size defaults to the cache's; strided views of
    a fused qkv are fine). block_tables, seq_lens, scale, sliding_window, softcap, num_splits, out, workspace,
    split_counters: as
    :func:`paged_decode_attention`. ``slot_mapping[s]`` must be the cache slot of sequence s's position
    ``seq_len - 1`` under its block table (checked when value checks are on), or negative: nothing cached, and the
    attention reads that position from the cache as it is, as the two ops would. A sequence with ``seq_len == 0``
    (padding) writes nothing and gets zeros.

    Returns:
        ``[num_seqs, num_q_heads, head_dim]`` in q's dtype (``out`` when given).
    """
    if head_size is None and isinstance(q, torch.Tensor) and q.dim() == 2 and isinstance(key_cache, torch.Tensor):
        head_size = key_cache.shape[-1]   # a 2-D q: heads of the cache's width
    q3, k3, v3 = check_rotary_and_cache_args(positions, q, k, v, key_cache, value_cache, slot_mapping,
                                             cos_sin_cache, head_size, q_weight, k_weight, eps, k_scale, v_scale)
    group = check_decode_args(q3, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap,
                              num_splits, out, workspace, k_scale, v_scale, split_counters)
    if out is None:
        out = torch.empty(q3.shape, dtype=q3.dtype, device=q3.device)
    if has_no_data(positions, q3, k3, v3, key_cache, value_cache, slot_mapping, cos_sin_cache, block_tables, seq_lens,
                   q_weight, k_weight, out, workspace, split_counters) or q3.shape[0] == 0:
        return out
    if value_checks_enabled(q3):   # the one check the two ops do not make
        _check_new_token_slots(slot_mapping, block_tables, seq_lens, key_cache.shape[1])
    if not use_triton(q3):
        q3, k3 = q3.clone(), k3.clone()
        rotary_embedding_and_cache(positions, q3, k3, v3, key_cache, value_cache, slot_mapping, cos_sin_cache,
                                   is_neox=is_neox, head_size=q3.shape[-1], q_weight=q_weight, k_weight=k_weight,
                                   eps=eps, k_scale=k_scale, v_scale=v_scale)
        return paged_decode_attention(q3, key_cache, value_cache, block_tables, seq_lens, scale=scale,
                                      sliding_window=sliding_window, softcap=softcap, num_splits=num_splits, out=out,
                                      workspace=workspace, k_scale=k_scale, v_scale=v_scale,
                                      split_counters=split_counters)
    if value_checks_enabled(q3):
        _check_values(key_cache, block_tables, seq_lens)
        _check_positions(positions, cos_sin_cache.shape[0])
        _check_slots(slot_mapping, key_cache.shape[0], key_cache.shape[1])
        _check_counters_zero(split_counters, q3.shape[0] * key_cache.shape[2])
    head_dim = q3.shape[-1]
    scale = float(head_dim ** -0.5 if scale is None else scale)
    _decode_triton(q3, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap, num_splits,
                   out, group, workspace, k_scale, v_scale, split_counters,
                   _NewTokens(positions.contiguous(), k3, v3, slot_mapping.contiguous(), cos_sin_cache, q_weight,
                              k_weight, eps, is_neox))
    return out


def _check_counters_zero(split_counters, used: int) -> None:
    """The split counters a launch uses are zero (a host sync)."""
    if split_counters is not None and bool(split_counters[:used].any()):
        raise ValueError("split_counters must be all zeros before a launch (a launch leaves them so; another "
                         "launch using them may be running on another stream)")


def _check_new_token_slots(slot_mapping, block_tables, seq_lens, block_size) -> None:
    """Each cached new token's slot is its sequence's position seq_len - 1 under its block table (a host sync)."""
    lens = seq_lens.long()
    rows = ((lens > 0) & (slot_mapping >= 0)).nonzero().flatten()
    if rows.numel() == 0:
        return
    last = lens[rows] - 1
    expected = block_tables[rows, last // block_size].long() * block_size + last % block_size
    bad = expected != slot_mapping[rows]
    if bool(bad.any()):
        seq = int(rows[bad.nonzero()[0, 0]])
        raise ValueError(f"slot_mapping[{seq}] = {int(slot_mapping[seq])} is not the slot of the sequence's position "
                         f"seq_len - 1 = {int(lens[seq]) - 1} under its block table "
                         f"({int(expected[bad.nonzero()[0, 0]])})")


def _decode_torch(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap, k_scale=1.0,
                  v_scale=1.0):
    """Vectorized PyTorch twin: gather the used blocks of every sequence as rows of a 2-D cache view,
    then two batched matmuls over (sequence, KV head) with the GQA group as the query rows.
    (The engine uses the prefill op for decode batches on CPU: its per-sequence SDPA over exactly
    the cached tokens measured faster there than this padded gather.)

    On CPU the table is cut to the longest sequence's blocks (reading seq_lens is free there); on
    CUDA the whole table width is gathered, keeping the path free of host syncs."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    lens = seq_lens.long()
    width = block_tables.shape[1]
    if not q.is_cuda:
        width = min(width, max(1, -(-int(lens.max()) // block_size)))
    context = width * block_size
    # Table entries past a sequence's end may be garbage: point them at block 0 (in range), mask below.
    block_used = torch.arange(width, device=q.device) * block_size < lens[:, None]
    block_ids = torch.where(block_used, block_tables[:, :width], 0).flatten()
    # keys, values : [num_seqs, context, num_kv_heads, head_dim]; index_select on a 2-D view copies
    # whole rows (blocks), far faster than advanced indexing of the 4-D tensor.
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        keys = key_cache.view(num_blocks, -1).index_select(0, block_ids)
        values = value_cache.view(num_blocks, -1).index_select(0, block_ids)
    else:
        keys, values = key_cache[block_ids], value_cache[block_ids]
    keys = keys.view(num_seqs, context, num_kv_heads, head_dim).float()
    values = values.view(num_seqs, context, num_kv_heads, head_dim).float()
    if is_fp8(key_cache):
        keys, values = keys * k_scale, values * v_scale
    pos = torch.arange(context, device=q.device)
    visible = pos[None, :] < lens[:, None]  # [num_seqs, context]
    if sliding_window is not None:
        visible &= pos[None, :] > lens[:, None] - 1 - sliding_window
    # Unused slots may hold NaN/inf: a zero weight would still give 0 * NaN = NaN, so clear the values
    # (the gathered copy is ours); masked scores become -inf whatever the keys held.
    values.masked_fill_(~visible[:, :, None, None], 0.0)
    # One batched matmul over (sequence, KV head) pairs, the GQA group as the query rows: K/V made
    # contiguous per pair first (a strided 4-D matmul takes a far slower path on CPU).
    group = num_q_heads // num_kv_heads
    keys = keys.permute(0, 2, 1, 3).reshape(num_seqs * num_kv_heads, context, head_dim)
    values = values.permute(0, 2, 1, 3).reshape(num_seqs * num_kv_heads, context, head_dim)
    qg = q.float().reshape(num_seqs * num_kv_heads, group, head_dim)
    scores = torch.bmm(qg, keys.transpose(1, 2)).view(num_seqs, num_kv_heads, group, context)
    scores.mul_(scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # A sequence with no visible key has an all-NaN softmax row: zero it (its output is zeros).
    probs.masked_fill_(~visible[:, None, None, :], 0.0)
    outg = torch.bmm(probs.view(num_seqs * num_kv_heads, group, context), values)
    return outg.view(num_seqs, num_q_heads, head_dim)


# ----------------------------------------------------------------------------------------------
# Triton: flash-decoding split-K
# ----------------------------------------------------------------------------------------------

# Tokens per K/V tile, independent of the page size: each token finds its own physical block.
TILE_N = 32
# A split streams at least this many tiles (128 tokens), so its fixed costs (loading Q, writing a
# partial row + lse, its share of the reduce) stay small next to its K/V traffic.
MIN_TILES_PER_SPLIT = 4
# More splits than this only grow the scratch and the reduce; 32 already fills an H100 with one
# sequence x 8 KV heads.
MAX_SPLITS = 32
# Software-pipelining stages of the split kernel's tile loop; None: Triton's default (3). A knob for
# bench.kernels' tune phase (DECODE_LAUNCH_SWEEP), which tries others on the GPU at hand.
SPLIT_NUM_STAGES: int | None = None


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_multiprocessors: int, *,
                      tile_n: int = TILE_N, max_splits: int = MAX_SPLITS) -> int:
    """Number of context partitions for a decode launch, from shapes only (no host sync).

    Without splitting the grid has ``num_seqs * num_kv_heads`` programs, each streaming a whole
    context: a small batch leaves most SMs idle. We aim for about two waves of programs
    (``2 * num_multiprocessors``; the second wave evens out the tail left by uneven lengths),
    but no split shorter than ``MIN_TILES_PER_SPLIT`` tiles of ``max_context`` (the upper bound
    ``max_blocks_per_seq * block_size``, since reading seq_lens would sync the host), and at most
    ``max_splits``. Examples on an H100 (132 SMs): 1 seq x 8 KV heads x 4096 tokens -> 32;
    8 x 8 x 4096 -> 5; 64 x 8 x 4096 -> 1 (512 programs are already ~2 waves).
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = -(-2 * num_multiprocessors // programs)
    by_length = max_context // (MIN_TILES_PER_SPLIT * tile_n)
    return max(1, min(wanted, by_length, max_splits))


def decode_workspace_numel(num_seqs: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """Floats of workspace a decode launch with ``num_splits`` partitions uses: the partial outputs
    ``[num_seqs, num_q_heads, num_splits, next_power_of_2(head_dim)]`` then the partial
    log-sum-exps ``[num_seqs, num_q_heads, num_splits]``, both float32, back to back. One split
    writes the output directly and uses none."""
    if num_splits <= 1:
        return 0
    return num_seqs * num_q_heads * num_splits * (triton.next_power_of_2(head_dim) + 1)


def decode_workspace(max_num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
                     device: torch.device | str, max_context: int | None = None) -> torch.Tensor:
    """A workspace for :func:`paged_decode_attention` that never caps the default split count of
    any batch of up to ``max_num_seqs`` sequences on ``device``: the largest
    :func:`decode_workspace_numel` over batch sizes 1..max_num_seqs at the splits
    :func:`decode_num_splits` picks for them (with ``max_context`` tokens per sequence, default
    unbounded). Splits shrink as batches grow, so this stays small: about 1 MB for 32 query heads
    of 128 over 8 KV heads on an H100, whatever ``max_num_seqs``. Allocate it once (e.g. before
    capturing CUDA graphs) and pass it to every decode call.

    Returns a float32 ``[numel]`` tensor (uninitialized; every launch writes before it reads).
    """
    for name, value in (("max_num_seqs", max_num_seqs), ("num_q_heads", num_q_heads),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    check_head_size("head_dim", head_dim)
    check_gqa(num_q_heads, num_kv_heads)
    device = torch.device(device)
    sms = num_multiprocessors(device)
    # Unbounded length: any context this long already allows MAX_SPLITS splits.
    context = MAX_SPLITS * MIN_TILES_PER_SPLIT * TILE_N if max_context is None else max_context
    numel = max(decode_workspace_numel(n, num_q_heads, head_dim, decode_num_splits(n, num_kv_heads, context, sms))
                for n in range(1, max_num_seqs + 1))
    return torch.empty(numel, dtype=torch.float32, device=device)


def decode_split_counters(max_num_seqs: int, num_kv_heads: int, *, device: torch.device | str) -> torch.Tensor:
    """The ``split_counters`` of :func:`paged_decode_attention` for batches of up to ``max_num_seqs``
    sequences: int32 zeros, one per (sequence, KV head). With them a decode that splits its context
    runs one kernel instead of two (its last split merges the others). Allocate once (e.g. before
    capturing CUDA graphs) and pass to every decode call of one stream: each launch leaves them zero."""
    for name, value in (("max_num_seqs", max_num_seqs), ("num_kv_heads", num_kv_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return torch.zeros(max_num_seqs * num_kv_heads, dtype=torch.int32, device=device)


def launch_config(dtype: torch.dtype, device_kind: str) -> int:
    """num_warps of the split kernel, from the dtype and the device kind (``"cuda"`` or ``"cpu"``,
    see ``_backend.launch_device_kind``) only, so the CUDA choice can be compiled ahead of time on
    any machine (``pagedkernels._aot``).

    A program holds Q (BLOCK_H x HEAD_PAD), a K and a V tile (TILE_N x HEAD_PAD), S/P
    (BLOCK_H x TILE_N) and acc (BLOCK_H x HEAD_PAD, fp32). 16-bit inputs feed tensor-core dots:
    4 warps keep it at <= 170 registers up to head 256 without spills (sm_90 and sm_80, Triton 3.6
    and 3.9). fp32 inputs run ieee FMA dots (exact; a correctness dtype, not a serving one) whose
    operand layouts keep long K rows per thread: at 4 warps Triton 3.6's sm_90 build of heads 80 to
    256 spilled (255 registers + 0.5 KB, or a 32-register allocation with 10 KB of spills); 8 warps
    halve each thread's share: ~60 registers at head 128, ~110 at 256, no spills. The interpreter
    ignores warps."""
    if device_kind == "cuda" and dtype == torch.float32:
        return 8
    return 4


@triton.jit
def _softcap(S, softcap):
    # softcap * tanh(S / softcap), written with exp(-2|y|) so it cannot overflow.
    y = S / softcap
    t = tl.exp(-2.0 * tl.abs(y))
    th = (1.0 - t) / (1.0 + t)
    return softcap * tl.where(y < 0, -th, th)


@triton.jit
def _decode_split_kernel(
    out_ptr,  # [num_seqs, num_q_heads, head_dim]; written here only when NUM_SPLITS == 1
    partial_out_ptr,  # fp32 [num_seqs, num_q_heads, NUM_SPLITS, HEAD_PAD]
    partial_lse_ptr,  # fp32 [num_seqs, num_q_heads, NUM_SPLITS]
    split_counters_ptr,  # int32 [num_seqs, num_kv_heads], zeros; used when FUSED_REDUCE
    q_ptr,  # [num_seqs, num_q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; uint8 e4m3 codes when KV_FP8
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; uint8 e4m3 codes when KV_FP8
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [num_seqs]
    scale,  # float (times k_scale when KV_FP8)
    softcap,  # float, used when USE_SOFTCAP
    v_scale,  # float, used when KV_FP8
    stride_q_seq: tl.int64,
    stride_q_head: tl.int64,
    stride_k_blk: tl.int64,
    stride_k_slot: tl.int64,
    stride_k_head: tl.int64,
    stride_v_blk: tl.int64,
    stride_v_slot: tl.int64,
    stride_v_head: tl.int64,
    stride_bt_seq: tl.int64,
    stride_o_seq: tl.int64,
    stride_o_head: tl.int64,
    # ROPE only (else placeholders never read): the step's new token of each sequence, un-rotated
    positions_ptr,  # int64 [num_seqs]: its position (the cos/sin row)
    k_ptr,  # [num_seqs, num_kv_heads, head_dim]: its key before the rotation (and the norm)
    v_ptr,  # [num_seqs, num_kv_heads, head_dim]: its value
    q_norm_ptr,  # [head_dim]: Qwen3's per-head q norm weight (ROPE_NORM)
    k_norm_ptr,  # [head_dim]: its k norm weight (ROPE_NORM)
    cos_sin_ptr,  # [max_position, rot_dim]: cos then sin
    slot_mapping_ptr,  # int64 [num_seqs]: its cache slot (negative: not cached)
    stride_k_seq: tl.int64,
    stride_k_nhead: tl.int64,
    stride_v_seq: tl.int64,
    stride_v_nhead: tl.int64,
    stride_cs_pos: tl.int64,
    rot_half,  # rot_dim // 2
    norm_eps,
    k_store_scale,  # a float8 cache's k_scale (the code is e4m3(k / k_scale); v's is v_scale)
    NUM_QUERIES_PER_KV: tl.constexpr,  # GQA group size
    BLOCK_H: tl.constexpr,  # group padded to a power of two >= 16 (tl.dot needs >= 16 rows)
    GROUP_PAD: tl.constexpr,  # group padded to a power of two (the fused reduce's rows)
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # page size (tokens per cache block)
    TILE_N: tl.constexpr,  # tokens per K/V tile
    NUM_SPLITS: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0 = off
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (exact, not tf32); None (default) for 16-bit
    KV_FP8: tl.constexpr,  # the caches hold float8 e4m3 codes: converted to q's dtype after loading (exact)
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (_backend.programmatic_dependent_launch)
    FUSED_REDUCE: tl.constexpr,  # NUM_SPLITS > 1: the last split of each (sequence, KV head) merges them all
    ROPE: tl.constexpr = False,  # q and the new token's k un-rotated: rotated here, the new k/v cached here
    ROPE_NORM: tl.constexpr = False,  # Qwen3's per-head q/k RMSNorms before the rotation
    IS_NEOX: tl.constexpr = True,  # rotated pairs (d, d + rot_dim/2); else GPT-J's (2d, 2d + 1)
):
    # grid: (num_seqs, num_kv_heads, NUM_SPLITS); one program = all query heads of one KV head over
    # one contiguous range of tiles, so each K/V tile is loaded once per group.
    if USE_PDL:   # q and the step's K/V are the kernel ahead's outputs
        pdl_wait()
    seq_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq_idx)
    # The query sits at seq_len - 1 and sees keys [first_key, seq_len).
    if SLIDING_WINDOW > 0:
        first_key = tl.maximum(seq_len - SLIDING_WINDOW, 0)
    else:
        first_key = seq_len * 0
    # Only tiles touching [first_key, seq_len) are visited; each split takes an equal share of
    # them, so splits balance per sequence and every visited tile holds >= 1 visible key.
    first_tile = first_key // TILE_N
    end_tile = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(end_tile - first_tile, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, end_tile)

    head_offs = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    head_mask = head_offs < NUM_QUERIES_PER_KV
    q_heads = (kv_head * NUM_QUERIES_PER_KV + head_offs).to(tl.int64)
    dim_offs = tl.arange(0, HEAD_PAD)  # [HEAD_PAD]
    dim_mask = dim_offs < HEAD_DIM
    qh_mask = head_mask[:, None] & dim_mask[None, :]  # [BLOCK_H, HEAD_PAD]

    # Q : (BLOCK_H, HEAD_PAD)
    q_rows = q_ptr + seq_idx.to(tl.int64) * stride_q_seq + q_heads[:, None] * stride_q_head
    if ROPE:   # q normed and rotated in registers by every program (as rotary_embedding_and_cache does it): q and k
        # are only read (the programs of a KV head all read its group's queries)
        cs_row = cos_sin_ptr + tl.load(positions_ptr + seq_idx, mask=seq_len > 0, other=0) * stride_cs_pos
        Q = _norm_rope_rows(q_rows, head_mask, q_norm_ptr, norm_eps, cs_row, rot_half, HEAD_DIM, HEAD_PAD, IS_NEOX,
                            ROPE_NORM).to(q_ptr.dtype.element_ty)
    else:
        Q = tl.load(q_rows + dim_offs[None, :], mask=qh_mask, other=0.0)

    M = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max
    L = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of exp
    acc = tl.zeros([BLOCK_H, HEAD_PAD], dtype=tl.float32)

    block_table_row = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt_seq
    k_head_ptr = key_cache_ptr + kv_head.to(tl.int64) * stride_k_head
    v_head_ptr = value_cache_ptr + kv_head.to(tl.int64) * stride_v_head
    if ROPE:
        last_tile = end_tile - 1   # the new token's (position seq_len - 1), in one program's range
        new_slot = tl.load(slot_mapping_ptr + seq_idx)
        if (seq_len > 0) & (new_slot >= 0) & (tile_lo <= last_tile) & (last_tile < tile_hi):
            # The new key and value of this KV head, normed, rotated and rounded as rotary_embedding_and_cache writes
            # them (a float8 cache: their codes), written to their slot by the program whose tiles hold it (no other
            # program reads that position), before its loop reads them back with the rest of the tile: nothing of
            # them stays live through the loop.
            one_row = tl.arange(0, 1)
            k_row = (k_ptr + seq_idx.to(tl.int64) * stride_k_seq + kv_head.to(tl.int64) * stride_k_nhead
                     + one_row[:, None] * 0)
            k_new = _norm_rope_rows(k_row, one_row == 0, k_norm_ptr, norm_eps, cs_row, rot_half, HEAD_DIM, HEAD_PAD,
                                    IS_NEOX, ROPE_NORM).to(k_ptr.dtype.element_ty)  # (1, HEAD_PAD)
            v_new = tl.load(v_ptr + seq_idx.to(tl.int64) * stride_v_seq + kv_head.to(tl.int64) * stride_v_nhead
                            + one_row[:, None] * 0 + dim_offs[None, :], mask=dim_mask[None, :], other=0.0)
            if KV_FP8:
                k_new = _float_to_e4m3(k_new.to(tl.float32) / k_store_scale)
                v_new = _float_to_e4m3(v_new.to(tl.float32) / v_scale)
            slot_block = new_slot // BLOCK_SIZE
            slot_offset = new_slot % BLOCK_SIZE
            tl.store(k_head_ptr + slot_block * stride_k_blk + slot_offset * stride_k_slot + dim_offs[None, :], k_new,
                     mask=dim_mask[None, :])
            tl.store(v_head_ptr + slot_block * stride_v_blk + slot_offset * stride_v_slot + dim_offs[None, :], v_new,
                     mask=dim_mask[None, :])
        tl.debug_barrier()   # every thread's stores visible to the program's loads below (as _rotary_cache_kernel)
    tile_offs = tl.arange(0, TILE_N)  # [TILE_N]
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + tile_offs  # [TILE_N] key positions
        visible = (pos >= first_key) & (pos < seq_len)
        # Masked lanes never touch the table or the cache: unused slots may hold NaN.
        physical_block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=visible, other=0).to(tl.int64)
        slot = (pos % BLOCK_SIZE).to(tl.int64)
        kv_mask = visible[:, None] & dim_mask[None, :]  # [TILE_N, HEAD_PAD]

        # K : (TILE_N, HEAD_PAD)
        K = tl.load(k_head_ptr + physical_block[:, None] * stride_k_blk + slot[:, None] * stride_k_slot
                    + dim_offs[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            K = _e4m3_to_float(K).to(Q.dtype)
        # S : (BLOCK_H, TILE_N)
        S = tl.dot(Q, tl.trans(K), input_precision=DOT_PRECISION) * scale
        if USE_SOFTCAP:
            S = _softcap(S, softcap)
        S = tl.where(visible[None, :], S, float("-inf"))

        # Online softmax; M stays finite after the first tile (it has a visible key).
        m_new = tl.maximum(M, tl.max(S, axis=1))  # [BLOCK_H]
        P = tl.exp(S - m_new[:, None])  # (BLOCK_H, TILE_N)
        alpha = tl.exp(M - m_new)  # [BLOCK_H]; exp(-inf) = 0 on the first tile
        L = L * alpha + tl.sum(P, axis=1)
        M = m_new

        # V : (TILE_N, HEAD_PAD)
        V = tl.load(v_head_ptr + physical_block[:, None] * stride_v_blk + slot[:, None] * stride_v_slot
                    + dim_offs[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            V = _e4m3_to_float(V).to(Q.dtype)
        acc = acc * alpha[:, None] + tl.dot(P.to(V.dtype), V, input_precision=DOT_PRECISION)

    # An empty split (past the end, before the window, or seq_len == 0) has L == 0: output 0, lse -inf.
    has_keys = L > 0
    L_safe = tl.where(has_keys, L, 1.0)
    O = acc / L_safe[:, None]  # (BLOCK_H, HEAD_PAD)
    if KV_FP8:
        O = O * v_scale
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq_idx.to(tl.int64) * stride_o_seq + q_heads[:, None] * stride_o_head + dim_offs[None, :],
                 O.to(out_ptr.dtype.element_ty), mask=qh_mask)
    else:
        row = (seq_idx.to(tl.int64) * tl.num_programs(1) * NUM_QUERIES_PER_KV + q_heads) * NUM_SPLITS + split
        tl.store(partial_out_ptr + row[:, None] * HEAD_PAD + dim_offs[None, :], O, mask=head_mask[:, None])
        lse = tl.where(has_keys, M + tl.log(L_safe), float("-inf"))
        tl.store(partial_lse_ptr + row, lse, mask=head_mask)
        if FUSED_REDUCE:
            # Every thread's stores issued, then one acq_rel count: the release publishes this program's
            # partials; the program that counts last acquires everyone's, merges them (what the reduce kernel
            # does, for this KV head's query heads) and sets the count back to zero for the next launch.
            tl.debug_barrier()
            counter = split_counters_ptr + seq_idx.to(tl.int64) * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == NUM_SPLITS - 1:
                _merge_splits(out_ptr, partial_out_ptr, partial_lse_ptr, seq_idx, kv_head, tl.num_programs(1),
                              stride_o_seq, stride_o_head, NUM_QUERIES_PER_KV, GROUP_PAD, HEAD_DIM, HEAD_PAD,
                              NUM_SPLITS)
                tl.atomic_xchg(counter, 0)


@triton.jit
def _norm_rope_rows(rows_ptr, row_mask, w_ptr, eps, cs_row_ptr, half, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                    IS_NEOX: tl.constexpr, NORM: tl.constexpr):
    """Rows of heads (``rows_ptr``: [R, 1] pointers to each head's first value) normed (NORM: RMSNorm over the
    head, the product with ``w`` rounded to the rows' dtype) and rotated by the cos/sin row at ``cs_row_ptr``:
    rotary.py's _norm_rotate_heads / _rotate_heads arithmetic, each value beside its pair's (loaded a second time)
    instead of the two halves apart. fp32 [R, HEAD_PAD], zero past HEAD_DIM and in masked rows; dimensions past
    2 * half pass through (normed)."""
    d = tl.arange(0, HEAD_PAD)
    dim_mask = d < HEAD_DIM
    rotated = d < 2 * half
    if IS_NEOX:
        first = d < half
        freq = tl.where(first, d, d - half)
        partner = tl.where(first, d + half, d - half)
    else:
        first = (d % 2) == 0
        freq = d // 2
        partner = d ^ 1
    partner = tl.where(rotated, partner, d)
    mask = row_mask[:, None] & dim_mask[None, :]
    x = tl.load(rows_ptr + d[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    xp = tl.load(rows_ptr + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)
        w = tl.load(w_ptr + d, mask=dim_mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=dim_mask, other=0.0).to(tl.float32)
        xf = (xf * rstd[:, None] * w[None, :]).to(x.dtype).to(tl.float32)
        xp = (xp * rstd[:, None] * wp[None, :]).to(x.dtype).to(tl.float32)
    cos = tl.load(cs_row_ptr + freq, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(cs_row_ptr + half + freq, mask=rotated, other=0.0).to(tl.float32)
    out = tl.where(first, xf * cos[None, :] - xp * sin[None, :], xf * cos[None, :] + xp * sin[None, :])
    return tl.where(rotated[None, :], out, xf)


@triton.jit
def _merge_splits(out_ptr, partial_out_ptr, partial_lse_ptr, seq_idx, kv_head, num_kv_heads, stride_o_seq,
                  stride_o_head, NUM_QUERIES_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """The fused reduce of the split kernel's last program for one KV head's query heads: out = sum_s exp(lse_s -
    lse) * O_s, as the reduce kernel computes it. Its rows are the group padded to a power of two, not to the 16 of
    the split loop's dots (no dot here). Loads bypass L1 (.cg): the other programs' partials are read from L2, where
    their release put them."""
    head_offs = tl.arange(0, GROUP_PAD)
    head_mask = head_offs < NUM_QUERIES_PER_KV
    q_heads = (kv_head * NUM_QUERIES_PER_KV + head_offs).to(tl.int64)
    first_row = (seq_idx.to(tl.int64) * num_kv_heads * NUM_QUERIES_PER_KV + q_heads) * NUM_SPLITS  # [GROUP_PAD]
    dim_offs = tl.arange(0, HEAD_PAD)
    lse_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    for s in range(NUM_SPLITS):
        lse_max = tl.maximum(lse_max, tl.load(partial_lse_ptr + first_row + s, mask=head_mask, other=float("-inf"),
                                              cache_modifier=".cg"))
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty: seq_len == 0
    total = tl.zeros([GROUP_PAD], dtype=tl.float32)
    merged = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        weight = tl.exp(tl.load(partial_lse_ptr + first_row + s, mask=head_mask, other=float("-inf"),
                                cache_modifier=".cg") - lse_max)  # 0 for an empty split
        total += weight
        partial = tl.load(partial_out_ptr + (first_row + s)[:, None] * HEAD_PAD + dim_offs[None, :],
                          mask=head_mask[:, None], other=0.0, cache_modifier=".cg")
        merged += weight[:, None] * partial
    merged = merged / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + seq_idx.to(tl.int64) * stride_o_seq + q_heads[:, None] * stride_o_head + dim_offs[None, :],
             merged.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & (dim_offs < HEAD_DIM)[None, :])


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [num_seqs, num_q_heads, head_dim]
    partial_out_ptr,  # fp32 [num_seqs, num_q_heads, NUM_SPLITS, HEAD_PAD]
    partial_lse_ptr,  # fp32 [num_seqs, num_q_heads, NUM_SPLITS]
    stride_o_seq: tl.int64,
    stride_o_head: tl.int64,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next power of two >= NUM_SPLITS
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (_backend.programmatic_dependent_launch)
):
    # grid: (num_seqs, num_q_heads). out = sum_s exp(lse_s - lse) * O_s with lse = logsumexp_s lse_s.
    if USE_PDL:   # the partial results are the split kernel's
        pdl_wait()
    seq_idx = tl.program_id(0)
    head = tl.program_id(1)
    row = seq_idx.to(tl.int64) * tl.num_programs(1) + head
    split_offs = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    split_mask = split_offs < NUM_SPLITS
    dim_offs = tl.arange(0, HEAD_PAD)  # [HEAD_PAD]
    dim_mask = dim_offs < HEAD_DIM

    lse = tl.load(partial_lse_ptr + row * NUM_SPLITS + split_offs, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty: seq_len == 0
    weight = tl.exp(lse - lse_max)  # [SPLITS_PAD]; 0 for empty splits
    total = tl.sum(weight, axis=0)
    # O_s : (SPLITS_PAD, HEAD_PAD); every split row was written (zeros when empty), so no NaN.
    partial = tl.load(partial_out_ptr + (row * NUM_SPLITS + split_offs[:, None]) * HEAD_PAD + dim_offs[None, :],
                      mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    O = tl.sum(weight[:, None] * partial, axis=0) / tl.where(total > 0, total, 1.0)  # [HEAD_PAD]
    tl.store(out_ptr + seq_idx.to(tl.int64) * stride_o_seq + head.to(tl.int64) * stride_o_head + dim_offs,
             O.to(out_ptr.dtype.element_ty), mask=dim_mask)


class _NewTokens(NamedTuple):
    """What the split kernel's ROPE variant takes besides the decode's arguments (rotary_cache_decode_attention)."""
    positions: torch.Tensor
    k: torch.Tensor   # [num_seqs, num_kv_heads, head_dim], un-rotated
    v: torch.Tensor
    slot_mapping: torch.Tensor
    cos_sin_cache: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float | None
    is_neox: bool


def _decode_triton(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap,
                   num_splits, out, group, workspace, k_scale=1.0, v_scale=1.0, split_counters=None,
                   new_tokens: _NewTokens | None = None):
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.shape[1] > 0 and block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        if sliding_window is not None:  # a window spans at most W + TILE_N - 1 tokens of tiles
            max_context = min(max_context, sliding_window + TILE_N)
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_context, num_multiprocessors(q.device))
        if workspace is not None:  # as many splits as the caller's workspace holds (shapes only)
            per_split = decode_workspace_numel(num_seqs, num_q_heads, head_dim, 2) // 2
            num_splits = max(1, min(num_splits, workspace.numel() // per_split))
    head_pad = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        rows = num_seqs * num_q_heads * num_splits
        if workspace is None:
            workspace = torch.empty(rows * (head_pad + 1), dtype=torch.float32, device=q.device)
        partial_out = workspace[: rows * head_pad].view(num_seqs, num_q_heads, num_splits, head_pad)
        partial_lse = workspace[rows * head_pad: rows * (head_pad + 1)].view(num_seqs, num_q_heads, num_splits)
    else:  # the split kernel writes `out` directly; the scratch arguments are unused
        partial_out = partial_lse = out
    kv_fp8 = is_fp8(key_cache)
    if kv_fp8:
        scale = scale * k_scale
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    pdl = pdl_launch(q.device)
    fused = split_counters is not None and num_splits > 1
    nt = new_tokens
    if nt is None:   # placeholders of the ROPE arguments (never read): one signature either way
        rope_args = (seq_lens, q, q, q, q, q, seq_lens, 0, 0, 0, 0, 0, 0, 0.0, 1.0)
    else:
        norm = nt.q_weight is not None
        rope_args = (nt.positions, nt.k, nt.v, nt.q_weight if norm else q, nt.k_weight if norm else q,
                     nt.cos_sin_cache, nt.slot_mapping, nt.k.stride(0), nt.k.stride(1), nt.v.stride(0),
                     nt.v.stride(1), nt.cos_sin_cache.stride(0), nt.cos_sin_cache.shape[1] // 2,
                     float(nt.eps) if norm else 0.0, float(k_scale))
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        # Unfused, seq_lens stands in for the counters (an int32 pointer never read): one signature either way.
        out, partial_out, partial_lse, split_counters if fused else seq_lens, q, key_cache, value_cache,
        block_tables, seq_lens,
        scale, float(softcap or 0.0), float(v_scale),
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        *rope_args,
        NUM_QUERIES_PER_KV=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        # fp32 queries over a float8 cache with the new token's rotation: Triton 3.6's sm_90/sm_80 builds of the
        # 32-token tile spilled 200-230 B at 255 registers (head 128, q/k norms, fused merge); 16-token tiles keep the
        # K/V codes and scores of a tile in half the registers. (The split count's sizing keeps TILE_N.)
        TILE_N=16 if nt is not None and kv_fp8 and q.dtype == torch.float32 else TILE_N,
        NUM_SPLITS=num_splits,
        SLIDING_WINDOW=sliding_window or 0,
        USE_SOFTCAP=softcap is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # None: the default for 16-bit
        KV_FP8=kv_fp8,
        FUSED_REDUCE=fused,
        ROPE=nt is not None,
        ROPE_NORM=nt is not None and nt.q_weight is not None,
        IS_NEOX=True if nt is None else bool(nt.is_neox),
        num_warps=launch_config(q.dtype, launch_device_kind(q.device)),
        # fp32 queries over a float8 cache: software-pipelining the tile loop (Triton's default 3
        # stages) kept the loaded codes and their conversions live next to fp32's ieee dot operands and
        # spilled (255 registers + 250 B at head 128 with window + softcap, ~2 KB at head 256, sm_90 and
        # sm_80); unpipelined, 48-64 registers and no spills.
        **({"num_stages": 1} if kv_fp8 and q.dtype == torch.float32
           else {"num_stages": SPLIT_NUM_STAGES} if SPLIT_NUM_STAGES is not None else {}),
        **pdl,
    )
    if num_splits > 1 and not fused:
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            out, partial_out, partial_lse, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4, **pdl,
        )
    return out
