"""Paged prefill attention: causal attention of packed new query tokens over a paged KV cache.

One kernel serves first prefill (q_len == seq_len), chunked prefill and prefix-cache hits
(0 < q_len < seq_len) and mixed batches with 1-token (decode) rows. Query ``i`` of sequence ``s``
(``q_len = cu_seqlens_q[s+1] - cu_seqlens_q[s]``) sits at position ``p = seq_len - q_len + i``
(bottom-right alignment) and attends to cache positions ``k`` with ``k <= p`` and, with a sliding
window ``W``, ``k > p - W``:

    S = scale * q @ k^T                      (softcap: S = softcap * tanh(S / softcap))
    out = softmax(S masked to visible keys) @ v

Kernel layout (after vLLM's triton_unified_attention): a 2D grid of (query tiles, KV heads). A
program takes BLOCK_Q consecutive query tokens of one sequence and *all* query heads of one KV
head, folded into BLOCK_M = BLOCK_Q * GROUP_PAD rows (row m = token m // GROUP_PAD, head
m % GROUP_PAD of the group), so each K/V tile is loaded once per KV head and feeds one tl.dot. It
walks the sequence's keys in tiles of TILE_N tokens (independent of the page size: every token's
physical block comes from the block table) with an online softmax in fp32. A float8 e4m3 cache
(``torch.float8_e4m3fn``) holds K / k_scale and V / v_scale: its codes are converted to q's dtype after
loading (exact) and the scales fold into the score scale and the output's normalization.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _native
from ._backend import has_no_data, launch_device_kind, use_native, use_triton, value_checks_enabled
from ._fp8 import _e4m3_to_float, is_fp8
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

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq_idx(
    cu_seqlens_q_ptr,  # [num_seqs + 1]
    q_tile_idx,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    """Sequence owning global query tile ``q_tile_idx``. Sequence s owns the tiles numbered from
    ``cu_seqlens_q[s] // BLOCK_Q + s`` on: its ceil(q_len / BLOCK_Q) tiles always fit before the
    next sequence's first number, so the owner is the last s whose first number <= q_tile_idx."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_kv_tile(
    Q,  # (BLOCK_M, HEAD_DIM_PAD), input dtype
    m_i,  # (BLOCK_M,) fp32 running max of the log2-scaled scores
    l_i,  # (BLOCK_M,) fp32 running sum of exp2(S - m_i)
    acc,  # (BLOCK_M, HEAD_DIM_PAD) fp32 running sum of P @ V
    tile_idx,
    q_pos,  # (BLOCK_M,) absolute position of each row's query
    kv_end,  # keys at positions >= kv_end are never read
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_row_ptr,  # [max_blocks_per_seq] of this sequence
    kv_head_offset_k,  # int64: kv_head * stride_k_head
    kv_head_offset_v,
    stride_k_block,
    stride_k_slot,
    stride_v_block,
    stride_v_slot,
    qk_scale,  # scale * log2(e), or scale when USE_SOFTCAP
    softcap,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0 = off
    USE_SOFTCAP: tl.constexpr,
    MASKED: tl.constexpr,  # False: every row sees every key of this tile (no mask needed)
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # uint8 e4m3 codes in the caches
):
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = offs_d < HEAD_DIM
    k_pos = tile_idx * TILE_N + tl.arange(0, TILE_N)  # (TILE_N,)
    key_valid = k_pos < kv_end
    # Physical block of every key. Positions >= kv_end are never looked up, so table entries past
    # a sequence's end are never dereferenced; unmasked tiles lie wholly below kv_end.
    table_ptrs = block_table_row_ptr + k_pos // BLOCK_SIZE
    if MASKED:
        block_ids = tl.load(table_ptrs, mask=key_valid, other=0).to(tl.int64)
    else:
        block_ids = tl.load(table_ptrs).to(tl.int64)
    slots = (k_pos % BLOCK_SIZE).to(tl.int64)

    # K : (HEAD_DIM_PAD, TILE_N), V : (TILE_N, HEAD_DIM_PAD). The steady-state (unmasked) tiles of
    # a power-of-two head load without predicates.
    k_ptrs = key_cache_ptr + (block_ids[None, :] * stride_k_block + slots[None, :] * stride_k_slot
                              + kv_head_offset_k + offs_d[:, None])
    v_ptrs = value_cache_ptr + (block_ids[:, None] * stride_v_block + slots[:, None] * stride_v_slot
                                + kv_head_offset_v + offs_d[None, :])
    if MASKED:
        K = tl.load(k_ptrs, mask=dim_valid[:, None] & key_valid[None, :], other=0.0)
        V = tl.load(v_ptrs, mask=key_valid[:, None] & dim_valid[None, :], other=0.0)
    elif HEAD_DIM == HEAD_DIM_PAD:
        K = tl.load(k_ptrs)
        V = tl.load(v_ptrs)
    else:
        K = tl.load(k_ptrs, mask=dim_valid[:, None], other=0.0)
        V = tl.load(v_ptrs, mask=dim_valid[None, :], other=0.0)
    if KV_FP8:
        K = _e4m3_to_float(K).to(Q.dtype)
        V = _e4m3_to_float(V).to(Q.dtype)

    # S : (BLOCK_M, TILE_N), in log2 units so the softmax can use exp2
    S = tl.dot(Q, K, input_precision=DOT_PRECISION)
    if USE_SOFTCAP:
        x = S * (qk_scale / softcap)
        # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits +-1 when exp over/underflows
        S = (softcap * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
    else:
        S = S * qk_scale
    if MASKED:
        visible = key_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        S = tl.where(visible, S, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(S, 1))
    if MASKED:
        # A row may have seen no key yet (window start inside the tile): keep exp2 finite.
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    P = tl.exp2(S - m_new[:, None])  # (BLOCK_M, TILE_N)
    l_i = l_i * alpha + tl.sum(P, 1)
    acc = acc * alpha[:, None] + tl.dot(P.to(V.dtype), V, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Not specialized on the step's sequences or its block table's width (the columns the batch touches): a step of a
# new shape compiles no variant of its own (tests/engine/test_kernel_variants.py).
@triton.jit(do_not_specialize=["num_seqs", "stride_table_seq"])
def _prefill_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    qk_scale,  # float32 (times k_scale when KV_FP8)
    softcap,  # float32
    v_scale,  # float32, used when KV_FP8
    num_seqs,
    stride_q_token: tl.int64,
    stride_q_head: tl.int64,
    stride_out_token: tl.int64,
    stride_out_head: tl.int64,
    stride_table_seq: tl.int64,
    stride_k_block: tl.int64,
    stride_k_slot: tl.int64,
    stride_k_head: tl.int64,
    stride_v_block: tl.int64,
    stride_v_slot: tl.int64,
    stride_v_head: tl.int64,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (page)
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_PAD rows
    TILE_N: tl.constexpr,  # keys per inner iteration
    SLIDING_WINDOW: tl.constexpr,  # 0 = off
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # the caches hold float8 e4m3 codes (uint8 views)
):
    q_tile_global = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq_idx = _find_seq_idx(cu_seqlens_q_ptr, q_tile_global, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
    q_len = tl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_start
    q_tile = q_tile_global - (q_start // BLOCK_Q + seq_idx)
    if q_tile * BLOCK_Q >= q_len:
        return  # spare tile of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - q_len  # cached tokens before the first new query

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP_PAD  # (BLOCK_M,) query index within the sequence
    head_in_group = offs_m % GROUP_PAD
    row_valid = (q_idx < q_len) & (head_in_group < GROUP)
    dim_valid = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q_head = (kv_head * GROUP + head_in_group).to(tl.int64)
    q_pos = context_len + q_idx  # (BLOCK_M,)

    # Q : (BLOCK_M, HEAD_DIM_PAD)
    io_mask = row_valid[:, None] & dim_valid[None, :]
    Q = tl.load(q_ptr + token[:, None] * stride_q_token + q_head[:, None] * stride_q_head + offs_d[None, :],
                mask=io_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # Key tiles: [first_tile, full_lo) and [full_hi, num_tiles) need masks; in [full_lo, full_hi)
    # every row of the tile sees every key (causally before the tile's first query and inside the
    # window of its last one), so they run unmasked.
    first_q_pos = context_len + q_tile * BLOCK_Q
    last_q_pos = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1
    kv_end = last_q_pos + 1
    num_tiles = tl.cdiv(kv_end, TILE_N)
    first_tile = 0
    full_lo = 0
    if SLIDING_WINDOW > 0:
        first_tile = tl.maximum(first_q_pos - SLIDING_WINDOW + 1, 0) // TILE_N
        full_lo = tl.cdiv(tl.maximum(last_q_pos - SLIDING_WINDOW + 1, 0), TILE_N)
    full_lo = tl.minimum(full_lo, num_tiles)
    full_hi = tl.maximum(tl.minimum((first_q_pos + 1) // TILE_N, num_tiles), full_lo)

    block_table_row_ptr = block_tables_ptr + seq_idx.to(tl.int64) * stride_table_seq
    kv_head_offset_k = kv_head.to(tl.int64) * stride_k_head
    kv_head_offset_v = kv_head.to(tl.int64) * stride_v_head
    for tile_idx in range(first_tile, full_lo):
        m_i, l_i, acc = _attend_kv_tile(
            Q, m_i, l_i, acc, tile_idx, q_pos, kv_end, key_cache_ptr, value_cache_ptr,
            block_table_row_ptr, kv_head_offset_k, kv_head_offset_v,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, qk_scale, softcap,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, SLIDING_WINDOW, USE_SOFTCAP, True, DOT_PRECISION, KV_FP8)
    for tile_idx in range(full_lo, full_hi):
        m_i, l_i, acc = _attend_kv_tile(
            Q, m_i, l_i, acc, tile_idx, q_pos, kv_end, key_cache_ptr, value_cache_ptr,
            block_table_row_ptr, kv_head_offset_k, kv_head_offset_v,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, qk_scale, softcap,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, SLIDING_WINDOW, USE_SOFTCAP, False, DOT_PRECISION, KV_FP8)
    for tile_idx in range(full_hi, num_tiles):
        m_i, l_i, acc = _attend_kv_tile(
            Q, m_i, l_i, acc, tile_idx, q_pos, kv_end, key_cache_ptr, value_cache_ptr,
            block_table_row_ptr, kv_head_offset_k, kv_head_offset_v,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, qk_scale, softcap,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, SLIDING_WINDOW, USE_SOFTCAP, True, DOT_PRECISION, KV_FP8)

    # Every valid row saw at least its own key, so l_i > 0 there; padding rows (l_i may be 0) are
    # not stored.
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_FP8:
        acc = acc * v_scale
    tl.store(out_ptr + token[:, None] * stride_out_token + q_head[:, None] * stride_out_head + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=io_mask)


def launch_config(head_dim_pad: int, group_pad: int, dtype: torch.dtype,
                  device_kind: str, kv_fp8: bool = False, head_dim: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages), chosen without autotuning, from shapes, dtype and
    the device kind (``"cuda"`` or ``"cpu"``, see ``_backend.launch_device_kind``) only, so the
    CUDA choice can be asked for (and compiled ahead of time) on any machine.

    GPU, fp16/bf16: a program keeps acc (BLOCK_M x HEAD_DIM_PAD fp32), Q, S/P (BLOCK_M x TILE_N
    fp32) and, because K/V are gathered token by token through the block table, two
    TILE_N x HEAD_DIM_PAD tensors of 64-bit addresses in registers. With 8 warps (256 threads) and
    head 128: acc 64 + Q 32 + S 16 + addresses 2 x 16 = ~150 registers at BLOCK_M=128,
    TILE_N=32; TILE_N=64 doubles the address part and spills (ptxas, sm_90: 255 regs + stack).
    Head <= 64 halves acc, Q and addresses, so TILE_N=64 fits. Head 256 doubles everything:
    BLOCK_M=64, TILE_N=16. Group size 1 (no row sharing of K/V) compiled to spills at the larger
    BLOCK_M at head 128, hence half of it there (at head 256, 32 x 16 tiles at 4 warps spilled 12 to
    36 B under Triton 3.6 on sm_90 or sm_80 depending on the stage count; 64 x 16 at 8 warps does
    not). fp32 runs ieee FMA dots (no tensor cores; a correctness dtype, not a serving one) whose
    operand layouts are register-hungry: 32 x 32 tiles at head <= 64, 16 x 16 above (32-wide key
    tiles spilled hundreds of bytes at any warp count), 4 warps up to head 128 and 8 beyond, all
    with ``max_registers`` (see there).
    Each choice compiles without register spills for sm_90 and sm_80 with Triton 3.6 and 3.9
    (``python -m pagedkernels._aot``; the test tests/pagedkernels/test_aot_compile.py keeps it
    so). BLOCK_M >= 16 always (tl.dot needs >= 16 on every dimension on a GPU), and BLOCK_M >=
    group_pad so a program holds at least one token with all heads of its group.

    A float8 cache (``kv_fp8``) under fp32 queries takes one stage: pipelining kept the loaded codes and
    their conversions live beside the fp32 operands (head 128 with window + softcap: 255 registers +
    600 B of spills at 2 stages; 80-96 registers, none, at 1).

    Interpreter (CPU): no registers, cost is per program and per op and tests run tiny shapes; 32 x 32
    tiles keep the masked waste low and make modest test lengths cross query- and key-tile
    boundaries.
    """
    if device_kind != "cuda":
        config = (32, 32, 4, 1)
    elif dtype == torch.float32:
        if head_dim_pad <= 64:
            config = (32, 32, 8, 2)
        elif head_dim_pad <= 128:
            config = (16, 16, 4, 2)
        else:
            config = (16, 16, 8, 1)
    elif head_dim_pad <= 64:
        config = (128, 64, 8, 3)
    elif head_dim_pad <= 128:
        # An unpadded head 128 with GQA takes 2 stages, not 3: on an H100 (bench/results/
        # 2026-11-26-nvidia-h100-80gb-hbm3-phase9-tune.md), 8 x 2048 tokens, 32q/8kv heads, 0.924 ms at 2 stages
        # against 1.325 ms at 3 (SDPA-flash 0.888 ms). Padded heads (96, 112) keep 3: head 112 with a window and
        # softcap spilled 24 B at 2 stages on sm_80 under Triton 3.9.
        if group_pad == 1:
            config = (64, 32, 8, 3)
        else:
            config = (128, 32, 8, 2 if head_dim in (None, head_dim_pad) else 3)
    else:
        config = (64, 16, 8, 2)
    block_m, tile_n, num_warps, num_stages = config
    if kv_fp8 and dtype == torch.float32 and device_kind == "cuda":
        num_stages = 1
    return max(block_m, group_pad), tile_n, num_warps, num_stages


def max_registers(dtype: torch.dtype, device_kind: str) -> int | None:
    """The ``maxnreg`` the prefill kernel is compiled with, or None for ptxas' own choice.

    fp32 on CUDA: 255, the most a thread may have. Left to itself, ptxas gives the fp32 variants
    (masked heads 80/96/112/160 and head 256 without GQA in particular) allocations of 64 to 168
    registers that buy occupancy with 4 to 40 B of spills, differently for sm_80 and sm_90 and for
    Triton 3.6 and 3.9; with the limit stated, every fp32 variant of the launch matrix compiles without
    spills on both targets with both Tritons (``python -m pagedkernels._aot``). 16-bit dtypes compile
    spill-free without it."""
    return 255 if device_kind == "cuda" and dtype == torch.float32 else None


def _prefill_attention_triton(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                              scale, sliding_window, softcap, out, k_scale=1.0, v_scale=1.0) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = triton.next_power_of_2(head_dim)
    block_m, tile_n, num_warps, num_stages = launch_config(head_dim_pad, group_pad, q.dtype,
                                                           launch_device_kind(q.device), is_fp8(key_cache),
                                                           head_dim=head_dim)
    block_q = block_m // group_pad
    maxnreg = max_registers(q.dtype, launch_device_kind(q.device))
    register_limit = {} if maxnreg is None else {"maxnreg": maxnreg}
    # Sequence s owns tiles cu[s] // BLOCK_Q + s ... so this bound covers every tile without
    # reading cu_seqlens_q on the host; spare programs return at once.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    use_softcap = softcap is not None
    kv_fp8 = is_fp8(key_cache)
    if kv_fp8:
        scale = scale * k_scale
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    _prefill_attention_kernel[grid](
        out, q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
        scale if use_softcap else scale * _LOG2E,
        softcap if use_softcap else 1.0,
        float(v_scale),
        num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n,
        SLIDING_WINDOW=sliding_window or 0, USE_SOFTCAP=use_softcap,
        # fp32 inputs: exact fp32 products (tl.dot would default to tf32 on a GPU)
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8,
        num_warps=num_warps, num_stages=num_stages, **register_limit,
    )


# Bound on the fp32 score matrix the torch path materializes per chunk of queries (elements).
_TORCH_SCORE_BUDGET = 1 << 26


def _prefill_attention_torch(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                             scale, sliding_window, softcap, out, k_scale=1.0, v_scale=1.0) -> None:
    """Per sequence: gather exactly its seq_len cached K/V through the block table (never an unused
    slot, so NaN there cannot leak in through a zero weight), then masked attention in fp32 with the
    GQA group handled by SDPA's enable_gqa or by broadcasting."""
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    # Gather whole blocks as rows of a 2-D view: index_select on it is a plain row copy, orders of
    # magnitude faster than on the 4-D tensor (or advanced indexing).
    key_rows = key_cache.flatten(1) if key_cache.is_contiguous() else key_cache
    value_rows = value_cache.flatten(1) if value_cache.is_contiguous() else value_cache
    cache_token_shape = (-1, num_kv_heads, head_dim)
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        blocks = block_tables[s, : -(-seq_len // block_size)]
        # k, v : [num_kv_heads, seq_len, head_dim]
        k = key_rows.index_select(0, blocks).view(cache_token_shape)[:seq_len].transpose(0, 1).float()
        v = value_rows.index_select(0, blocks).view(cache_token_shape)[:seq_len].transpose(0, 1).float()
        if is_fp8(key_cache):
            k, v = k * k_scale, v * v_scale
        k_pos = torch.arange(seq_len, device=q.device)
        chunk = max(1, _TORCH_SCORE_BUDGET // (num_q_heads * max(seq_len, 1)))
        for c_start in range(0, q_len, chunk):
            c_end = min(c_start + chunk, q_len)
            # qs : [num_q_heads, chunk, head_dim]
            qs = q[q_start + c_start: q_start + c_end].transpose(0, 1).float()
            q_pos = torch.arange(seq_len - q_len + c_start, seq_len - q_len + c_end, device=q.device)
            visible = k_pos[None, :] <= q_pos[:, None]  # [chunk, seq_len]
            if sliding_window is not None:
                visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
            if softcap is None:
                # Fast paths: a square first prefill is SDPA's (top-left) causal case; a row that sees
                # every key needs no mask. 4-D inputs select SDPA's fused CPU kernel (3-D ones take a
                # much slower path).
                is_causal = sliding_window is None and c_end - c_start == seq_len
                sees_all = c_end - c_start == 1 and (sliding_window is None or sliding_window >= seq_len)
                mask = None if is_causal or sees_all else visible
                o = F.scaled_dot_product_attention(qs[None], k[None], v[None], attn_mask=mask, is_causal=is_causal,
                                                   scale=scale, enable_gqa=group > 1)[0]
            else:
                # scores : [num_kv_heads, group, chunk, seq_len]
                scores = qs.reshape(num_kv_heads, group, c_end - c_start, head_dim) @ k[:, None].transpose(-1, -2)
                scores = softcap * torch.tanh(scores * (scale / softcap))
                scores = scores.masked_fill(~visible, float("-inf"))
                o = (torch.softmax(scores, dim=-1) @ v[:, None]).flatten(0, 1)
            out[q_start + c_start: q_start + c_end] = o.transpose(0, 1).to(out.dtype)


def _check_values(q, key_cache, block_tables, cu_seqlens_q, seq_lens) -> None:
    """Value checks: one vectorized pass that costs a few microseconds on CPU; only when it finds
    something wrong does :func:`_explain_bad_values` look for the first offence to name."""
    num_blocks, block_size = key_cache.shape[:2]
    cu, lens, table = cu_seqlens_q.long(), seq_lens.long(), block_tables
    q_lens = cu[1:] - cu[:-1]
    blocks_needed = (lens + block_size - 1) // block_size
    used = torch.arange(table.shape[1], device=table.device) < blocks_needed[:, None]
    bad = ((cu[0] != 0) | (cu[-1] != q.shape[0]) | (q_lens < 0).any() | (lens < 0).any() | (q_lens > lens).any()
           | (blocks_needed > table.shape[1]).any() | (used & ((table < 0) | (table >= num_blocks))).any())
    if bool(bad):
        _explain_bad_values(q, key_cache, block_tables, cu_seqlens_q, seq_lens)


def _explain_bad_values(q, key_cache, block_tables, cu_seqlens_q, seq_lens) -> None:
    num_blocks, block_size = key_cache.shape[:2]
    cu = cu_seqlens_q.cpu().long()
    lens = seq_lens.cpu().long()
    if cu[0].item() != 0:
        raise ValueError(f"cu_seqlens_q must start at 0, got {cu[0].item()}")
    q_lens = cu[1:] - cu[:-1]
    if (q_lens < 0).any():
        raise ValueError(f"cu_seqlens_q must be non-decreasing, got {cu.tolist()}")
    if cu[-1].item() != q.shape[0]:
        raise ValueError(f"cu_seqlens_q[-1] ({cu[-1].item()}) must equal q.shape[0] ({q.shape[0]})")
    if (lens < 0).any():
        raise ValueError(f"seq_lens must be non-negative, got {lens.tolist()}")
    if (q_lens > lens).any():
        s = int(torch.nonzero(q_lens > lens)[0])
        raise ValueError(
            f"seq_lens[{s}] ({lens[s].item()}) must be >= the sequence's query length ({q_lens[s].item()}): "
            "the new tokens must already be in the cache")
    blocks_needed = (lens + block_size - 1) // block_size
    if (blocks_needed > block_tables.shape[1]).any():
        s = int(torch.nonzero(blocks_needed > block_tables.shape[1])[0])
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns but seq_lens[{s}] = {lens[s].item()} "
            f"needs {blocks_needed[s].item()} blocks of {block_size}")
    table = block_tables.cpu().long()
    used = torch.arange(table.shape[1])[None, :] < blocks_needed[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        s, j = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(f"block_tables[{s}, {j}] = {table[s, j].item()} is out of range [0, {num_blocks})")


def check_prefill_args(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale=None,
                       sliding_window=None, softcap=None, out=None, k_scale=1.0, v_scale=1.0) -> int:
    """Every check of :func:`paged_prefill_attention`'s arguments that reads no tensor value (types,
    ranks, dtypes, one device, shapes, strides, the options), shared with its fake implementation.
    Returns the GQA group size."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    on_q = ("q", q)
    check_kv_caches(key_cache, value_cache, like=on_q)
    check_cache_dtype("key_cache", key_cache, "q", q)
    check_kv_scales(k_scale, v_scale, key_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"key_cache: head_dim ({cache_head_dim}) must equal q's head_dim ({head_dim})")
    check_head_size("q", head_dim)
    group = check_gqa(num_q_heads, num_kv_heads)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), like=on_q)
    num_seqs = seq_lens.shape[0]
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), like=on_q, shape=(num_seqs, None))
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), like=on_q, shape=(num_seqs + 1,))
    check_attention_options(scale, sliding_window, softcap)
    if out is not None:
        check_tensor("out", out, dtypes=(q.dtype,), like=on_q, shape=tuple(q.shape))
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last (head_dim) dimension")
    return group


def paged_prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal (bottom-right aligned) attention of packed new tokens over a paged KV cache.

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]`` fp16/bf16/fp32, the new tokens of all sequences
            packed back to back; head_dim a multiple of 16 in [32, 256].
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype or
            ``torch.float8_e4m3fn``; the new tokens are already written (``reshape_and_cache``).
            num_q_heads must be a multiple of num_kv_heads (GQA).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``; entries past a sequence's end are
            never read.
        cu_seqlens_q: int32 ``[num_seqs + 1]``, starts 0, non-decreasing; sequence s owns tokens
            ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of q.
        seq_lens: int32 ``[num_seqs]``, tokens in the cache per sequence, new ones included
            (``seq_lens[s] >= q_len[s]``; equal for a first prefill, 1-token rows are decodes).
        scale: defaults to ``head_dim ** -0.5``.
        sliding_window: W: a query at position p sees keys k with ``p - W < k <= p``.
        softcap: scores become ``softcap * tanh(score / softcap)`` after scaling.
        out: optional ``[num_tokens, num_q_heads, head_dim]`` output in q's dtype.
        k_scale, v_scale: a float8 cache's per-layer scales; 1.0 for other caches.

    Returns ``out`` (new tensor if not given). ``cu_seqlens_q[-1] == num_tokens`` is checked only
    where value checks run (CPU tensors, ``PAGEDKERNELS_DEBUG=1``); otherwise rows of ``out`` past
    ``cu_seqlens_q[-1]`` are left untouched.
    """
    group = check_prefill_args(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                               sliding_window, softcap, out, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if has_no_data(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, out):
        return out  # meta or fake tensors: checked, nothing to compute (the fake implementation)
    head_dim = q.shape[-1]
    # The native kernel checks the metadata values itself, before it writes anything.
    native = not use_triton(q) and use_native(q) and _native.supports(q, head_dim, group)
    if value_checks_enabled(q) and not native:
        _check_values(q, key_cache, block_tables, cu_seqlens_q, seq_lens)

    scale = head_dim ** -0.5 if scale is None else float(scale)
    softcap = None if softcap is None else float(softcap)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if native:
        if not _native.paged_attention(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                       sliding_window, softcap, out, k_scale, v_scale):
            _check_values(q, key_cache, block_tables, cu_seqlens_q, seq_lens)
            raise RuntimeError("pagedkernels native prefill attention rejected metadata the checks accept")
        return out
    impl = _prefill_attention_triton if use_triton(q) else _prefill_attention_torch
    impl(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window, softcap, out,
         k_scale, v_scale)
    return out
