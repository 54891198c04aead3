"""The grouped GEMMs' layout of a mixture-of-experts batch: routed slots sorted by expert, each expert's run
padded to a whole number of GEMM blocks (vLLM's ``moe_align_block_size``).

A batch of num_tokens tokens routed to top_k experts each has ``num_slots = num_tokens * top_k`` slots; slot
``s = t * top_k + j`` is token t's j-th choice, ``topk_ids[t, j]``. With B the GEMM's row block:

    sorted_token_ids:  the slots of expert 0, padded with num_slots to a multiple of B, then expert 1's, ...
                       (slots of one expert in increasing order; an expert with no slot takes no room)
    expert_ids[b]:     the expert of block b (rows [b B, (b + 1) B) of sorted_token_ids); -1 past the end
    num_tokens_post_padded[0]: the padded length, sum over experts of ceil(count / B) * B

so a program of the grouped GEMM takes one block, reads its expert's weights once for up to B slots, and a
padding row (num_slots) is masked. Slots whose expert id is negative (an expert on another rank under expert
parallelism) take no row at all.

The outputs are sized from shapes only, never from the ids (no host sync; CUDA-graph capturable): at most
``min(num_slots, num_experts)`` experts have slots, each adds at most B - 1 padding rows, so
``max_num_tokens_padded = num_slots + min(num_slots, num_experts) * (B - 1)``.

Backends: a Triton kernel (one program: a histogram of the ids, a cumulative sum over experts, then each slot
placed by an atomic increment of its expert's cursor; within an expert the order of slots is then the order
the increments land in, which the GEMMs do not depend on: each row is computed alone), and the PyTorch twin
(a stable sort: slots in increasing order within an expert). The native CPU MoE kernel sorts by itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import has_no_data, use_triton, value_checks_enabled
from ._validate import check_tensor

__all__ = ["moe_align_block_size", "check_moe_align_args", "max_num_tokens_padded"]


def max_num_tokens_padded(num_slots: int, num_experts: int, block_size: int) -> int:
    """Rows of ``sorted_token_ids``: the most the padded layout can take (see the module docstring). A symbolic
    num_slots (torch.compile with dynamic shapes) stays symbolic."""
    return num_slots + torch.sym_min(num_slots, num_experts) * (block_size - 1)


def check_moe_align_args(topk_ids, block_size, num_experts) -> int:
    """Every check of :func:`moe_align_block_size`'s arguments that reads no value. Returns num_slots."""
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64))
    for name, value in (("block_size", block_size), ("num_experts", num_experts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return topk_ids.numel()


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int, name: str = "topk_ids") -> None:
    """Expert ids below ``num_experts`` (negative ones mean "not here" and are allowed). Reads the values: on a
    GPU only with PAGEDKERNELS_DEBUG=1."""
    if value_checks_enabled(topk_ids) and topk_ids.numel() and int(topk_ids.max()) >= num_experts:
        raise ValueError(f"{name} holds expert ids >= num_experts ({num_experts}): max {int(topk_ids.max())}")


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sorted, padded layout of a routed batch (see the module docstring).

    Args:
        topk_ids: int32/int64 ``[num_tokens, top_k]``, expert ids in ``[0, num_experts)``, or negative for a
            slot no local expert takes.
        block_size: B, the grouped GEMM's row block.
        num_experts: experts the ids index (this rank's, under expert parallelism).

    Returns:
        ``(sorted_token_ids int32 [max_num_tokens_padded], expert_ids int32 [cdiv(max_num_tokens_padded, B)],
        num_tokens_post_padded int32 [1])``.
    """
    num_slots = check_moe_align_args(topk_ids, block_size, num_experts)
    device = topk_ids.device
    max_padded = max_num_tokens_padded(num_slots, num_experts, block_size)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(triton.cdiv(max_padded, block_size), dtype=torch.int32, device=device)
    num_post_padded = torch.empty(1, dtype=torch.int32, device=device)
    if has_no_data(topk_ids):
        return sorted_ids, expert_ids, num_post_padded
    check_expert_ids(topk_ids, num_experts)
    if use_triton(topk_ids):
        _moe_align_triton(topk_ids, block_size, num_experts, sorted_ids, expert_ids, num_post_padded)
    else:
        _moe_align_torch(topk_ids, block_size, num_experts, sorted_ids, expert_ids, num_post_padded)
    return sorted_ids, expert_ids, num_post_padded


def _moe_align_torch(topk_ids, block_size, num_experts, sorted_ids, expert_ids, num_post_padded) -> None:
    """The PyTorch twin: a stable sort of the slots by expert (no host sync)."""
    flat = topk_ids.flatten().long()
    num_slots = flat.numel()
    valid = flat >= 0
    key = torch.where(valid, flat, num_experts)  # slots of no local expert sort last, then are dropped
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    first_slot = torch.cumsum(counts, 0) - counts  # the expert's first position in `order`
    sorted_key = key[order]
    local = sorted_key < num_experts
    expert = sorted_key.clamp(max=num_experts - 1)
    rank = torch.arange(num_slots, device=flat.device) - first_slot[expert]
    # Slots of no local expert go to one spare row past the end, cut off below.
    dest = torch.where(local, starts[expert] + rank, sorted_ids.numel())
    staging = torch.full((sorted_ids.numel() + 1,), num_slots, dtype=torch.int32, device=flat.device)
    staging[dest] = order.to(torch.int32)
    sorted_ids.copy_(staging[:-1])
    total = ends[-1:] if num_experts else torch.zeros(1, dtype=torch.long, device=flat.device)
    block_starts = torch.arange(expert_ids.numel(), device=flat.device) * block_size
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    expert_ids.copy_(torch.where(block_starts < total, block_expert, -1))
    num_post_padded.copy_(total)


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------

# Slots one pass of the kernel's loops takes.
ALIGN_CHUNK = 1024


# Not specialized on the step's routed slots and the padded layout's sizes: a step of a new shape compiles no
# variant of its own (tests/engine/test_kernel_variants.py).
@triton.jit(do_not_specialize=["num_slots", "max_padded", "num_blocks"])
def _moe_align_kernel(
    topk_ids_ptr,  # [num_slots] (the [num_tokens, top_k] ids, contiguous), int32 or int64
    sorted_ids_ptr,  # int32 [max_padded]
    expert_ids_ptr,  # int32 [num_blocks]
    num_post_padded_ptr,  # int32 [1]
    cursor_ptr,  # int32 [num_experts]: scratch, each expert's next free row
    num_slots,
    num_experts,
    max_padded,
    num_blocks,
    BLOCK_SIZE: tl.constexpr,
    E_PAD: tl.constexpr,  # next power of two > num_experts: bin E_PAD - 1 holds the ids of no local expert
    CHUNK: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,  # blocks per pass of the expert-id loop ((BLOCK_CHUNK, E_PAD) compares)
):
    # grid: (1,). Histogram -> padded cumulative sum -> sentinel fill and block experts -> scatter.
    offs = tl.arange(0, CHUNK)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    for start in range(0, num_slots, CHUNK):
        idx = start + offs
        ids = tl.load(topk_ids_ptr + idx, mask=idx < num_slots, other=-1).to(tl.int32)
        ids = tl.where((ids >= 0) & (ids < num_experts), ids, E_PAD - 1)
        counts += tl.histogram(ids, E_PAD)
    counts = tl.where(experts < num_experts, counts, 0)
    padded = (counts + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    ends = tl.cumsum(padded, 0)  # (E_PAD,)
    total = tl.sum(padded, axis=0)
    tl.store(num_post_padded_ptr, total)
    tl.store(cursor_ptr + experts, ends - padded, mask=experts < num_experts)
    for start in range(0, max_padded, CHUNK):
        idx = start + offs
        tl.store(sorted_ids_ptr + idx, tl.zeros([CHUNK], tl.int32) + num_slots, mask=idx < max_padded)
    block_offs = tl.arange(0, BLOCK_CHUNK)
    for start in range(0, num_blocks, BLOCK_CHUNK):
        blocks = start + block_offs
        first_row = blocks * BLOCK_SIZE  # (BLOCK_CHUNK,)
        # The block's expert: how many experts end at or before its first row (empty experts included).
        below = (ends[None, :] <= first_row[:, None]) & (experts < num_experts)[None, :]
        expert = tl.sum(below.to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blocks, tl.where(first_row < total, expert, -1), mask=blocks < num_blocks)
    # The cursors and the sentinel rows are in memory for every thread before the scatter reads them.
    tl.debug_barrier()
    for start in range(0, num_slots, CHUNK):
        idx = start + offs
        ids = tl.load(topk_ids_ptr + idx, mask=idx < num_slots, other=-1).to(tl.int32)
        local = (ids >= 0) & (ids < num_experts)  # ids past the table (unchecked on a GPU) are dropped
        row = tl.atomic_add(cursor_ptr + ids, 1, mask=local)
        tl.store(sorted_ids_ptr + row, idx, mask=local)


def _moe_align_triton(topk_ids, block_size, num_experts, sorted_ids, expert_ids, num_post_padded) -> None:
    topk_ids = topk_ids.contiguous()
    e_pad = triton.next_power_of_2(num_experts + 1)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=topk_ids.device)
    _moe_align_kernel[(1,)](
        topk_ids, sorted_ids, expert_ids, num_post_padded, cursor, topk_ids.numel(), num_experts, sorted_ids.numel(),
        expert_ids.numel(), BLOCK_SIZE=block_size, E_PAD=e_pad, CHUNK=ALIGN_CHUNK,
        BLOCK_CHUNK=max(16, ALIGN_CHUNK * 16 // e_pad), num_warps=8,
    )
