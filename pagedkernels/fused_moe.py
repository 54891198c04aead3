"""A mixture-of-experts MLP: two grouped GEMMs with the gated activation between them, weighted and summed
over each token's experts (vLLM's ``fused_experts``).

For token t routed to experts ``topk_ids[t, j]`` with weights ``topk_weights[t, j]`` (j < top_k), expert e
holding ``w13[e] = [W_gate; W_up]`` (``[2I, H]``) and ``w2[e]`` (``[H, I]``):

    y_j = act(W_gate x_t) * (W_up x_t)           [I]   act = silu (or gelu_tanh)
    out[t] = sum_j topk_weights[t, j] * (w2[e_j] y_j)     [H]

Under expert parallelism ``expert_map`` (``[num_global_experts]``) maps a global expert id to this rank's
expert, or -1: slots of experts held elsewhere add nothing here (the ranks' outputs are then summed).

Backends:

- Triton (CUDA): :func:`pagedkernels.moe_align_block_size` sorts the slots by expert and pads each expert's
  run to the GEMM's row block; ``_fused_moe_kernel`` runs GEMM 1 with one program per (block of slots,
  block of I columns): it reads its expert's gate and up rows for the same columns, and writes
  ``act(gate) * up`` (the activation fused, so the ``[slots, 2I]`` product is never stored); the same kernel
  runs GEMM 2 over the activated rows; ``_moe_sum_kernel`` weights and sums each token's top_k rows. Four
  launches, no Python loop over experts, no host sync: every buffer is sized from shapes. Where the slots are
  few against the experts (decode of a fine-grained MoE, :func:`direct_layout`) each slot is a block of its own
  and the alignment is skipped: three launches. Up to :func:`moe_gemv_max_tokens` tokens (off unless set, see
  :func:`gemv_layout`) two matrix-vector launches instead, with no tile of padding rows and no top-k sum of its own:
  ``_moe_gemv_up_kernel`` (a program: one slot's block of I columns, gate and up, activated) and
  ``_moe_gemv_down_kernel`` (a program: one token's block of H columns, summed over its top_k experts with their
  weights), both launched with programmatic dependent launch where it is on (the down projection's first weight
  tile then streams in while the up projection finishes).
- Native (CPU, weights packed by :func:`pack_moe_weight`): ``csrc/moe_cpu.c`` sorts the slots by
  expert (a counting sort), then each expert's slots are one GEMM through the 16-bit-weight GEMM's panel
  kernel (``csrc/w16_panel.h``, shared with :func:`pagedkernels.w16_gemm`; float32, fp16 or bf16 panels), the
  activation, the second GEMM, and the weighted sum: one call, parallel over (expert, panel) pairs, so a CPU
  graph records it like any native kernel (its row count is the token count). Hidden states in bf16 or fp16 (a
  16-bit model on the CPU) come in and go out in their dtype, each token's float32 sum rounded once. bf16 hidden
  states on bf16 panels, in a build with AVX512-BF16 (``_native.bf16_dot_path()``), take its pair dot products
  for both GEMMs, the activated rows rounded to bf16 between them as a dense bf16 MLP rounds them (a 256-token
  layer of 8 experts, hidden 1024, intermediate 1024, top-2: 7.2 -> 4.3 ms on a 2-core Zen 5); otherwise they are
  widened to float32 once per call: the float32 kernel's result on the same values, rounded.
- PyTorch twin (the reference): a loop over experts, each a float32 GEMM of its tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import _huge_pages, _native
from ._backend import (has_no_data, launch_capability, launch_device_kind, num_multiprocessors, pdl_launch,
                       use_native, use_triton, value_checks_enabled)
from ._pdl import pdl_wait
from ._validate import FLOAT_DTYPES, check_tensor
from .moe_align import moe_align_block_size

__all__ = ["fused_moe", "check_fused_moe_args", "pack_moe_weight", "unpack_moe_weight", "MoELaunchConfig",
           "fused_moe_launch_config", "direct_layout", "ACTIVATIONS", "PANEL", "native_scratch_bytes",
           "set_moe_gemv_max_tokens", "moe_gemv_max_tokens", "gemv_layout", "moe_gemv_config"]

ACTIVATIONS = ("silu", "gelu_tanh")
# Output columns per panel of a packed weight (the native kernel's layout, pagedkernels.w16_gemm's PANEL).
PANEL = 32


# ----------------------------------------------------------------------------------------------
# packed weights (native CPU backend)
# ----------------------------------------------------------------------------------------------


def pack_moe_weight(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``weight [E, N, K]`` (w13 or w2) in the native kernel's panels: ``[E, ceil(N / 32), K, 32]``,
    ``packed[e, p, k, c] = weight[e, 32 p + c, k]`` (columns past N zero), in ``dtype`` (default the
    weight's; bf16 or fp16 halve the bytes of a weight whose values are all such numbers, as a 16-bit
    checkpoint's are), contiguous, on the weight's device (huge pages on the CPU where the system gives them).
    Packed one expert at a time: no temporary of the whole weight."""
    check_tensor("weight", weight, ndim=3, dtypes=FLOAT_DTYPES)
    dtype = weight.dtype if dtype is None else dtype
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
    experts, n, k = weight.shape
    panels = -(-n // PANEL)
    shape = (experts, panels, k, PANEL)
    packed = (_huge_pages.empty(shape, dtype) if weight.device.type == "cpu"
              else torch.empty(shape, dtype=dtype, device=weight.device))
    padded = torch.zeros(panels * PANEL, k, dtype=dtype, device=weight.device)
    for e in range(experts):
        padded[:n] = weight[e]
        packed[e] = padded.view(panels, PANEL, k).transpose(1, 2)
    return packed


def unpack_moe_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The ``[E, n, K]`` weight a :func:`pack_moe_weight` result holds (a copy)."""
    experts, panels, k, _ = packed.shape
    return packed.transpose(2, 3).reshape(experts, panels * PANEL, k)[:, :n]


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------


def check_fused_moe_args(hidden, w13, w2, topk_weights, topk_ids, activation="silu", expert_map=None,
                         out=None) -> tuple[int, int, int, int, bool]:
    """Every check of :func:`fused_moe`'s arguments that reads no tensor value, shared with its fake
    implementation. Returns (num_tokens, hidden_size, intermediate_size, num_experts, packed)."""
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    if hidden.stride(-1) != 1:
        raise ValueError("hidden must be contiguous in its last (hidden_size) dimension")
    on_hidden = ("hidden", hidden)
    num_tokens, hidden_size = hidden.shape
    check_tensor("w13", w13, dtypes=FLOAT_DTYPES, like=on_hidden)
    check_tensor("w2", w2, dtypes=FLOAT_DTYPES, like=on_hidden)
    packed = w13.dim() == 4
    if packed:
        # pack_moe_weight's panels: w13 [E, ceil(2I / 32), H, 32], w2 [E, ceil(H / 32), I, 32]
        check_tensor("w2", w2, ndim=4)
        num_experts, intermediate = w13.shape[0], w2.shape[2]
        check_tensor("w13", w13, shape=(num_experts, -(-2 * intermediate // PANEL), hidden_size, PANEL))
        check_tensor("w2", w2, shape=(num_experts, -(-hidden_size // PANEL), intermediate, PANEL))
        if w2.dtype != w13.dtype:
            raise ValueError(f"w2 must have w13's dtype ({w13.dtype}), got {w2.dtype}")
        if hidden.device.type != "cpu":
            raise ValueError(f"packed (pack_moe_weight) weights are for the native CPU backend; hidden is on "
                             f"{hidden.device}")
    else:
        check_tensor("w13", w13, ndim=3)
        num_experts, two_i, _ = w13.shape
        if two_i % 2:
            raise ValueError(f"w13 must be [num_experts, 2 * intermediate_size, hidden_size] (gate rows, then up "
                             f"rows), got {list(w13.shape)}")
        intermediate = two_i // 2
        check_tensor("w13", w13, shape=(num_experts, 2 * intermediate, hidden_size))
        check_tensor("w2", w2, ndim=3, shape=(num_experts, hidden_size, intermediate))
        for name, w in (("w13", w13), ("w2", w2)):
            if w.dtype != hidden.dtype:
                raise ValueError(f"{name} must have hidden's dtype ({hidden.dtype}), got {w.dtype}")
            if w.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dimension")
    for name, w in (("w13", w13), ("w2", w2)):
        if packed and not w.is_contiguous():
            raise ValueError(f"{name} must be contiguous (as pack_moe_weight makes it)")
    if num_experts < 1 or intermediate < 1 or hidden_size < 1:
        raise ValueError(f"w13, w2: need at least one expert of non-empty sizes, got w13 {list(w13.shape)} and "
                         f"w2 {list(w2.shape)}")
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64), like=on_hidden)
    top_k = topk_ids.shape[1]
    check_tensor("topk_ids", topk_ids, shape=(num_tokens, top_k))
    if top_k < 1:
        raise ValueError(f"topk_ids: top_k must be >= 1, got shape {list(topk_ids.shape)}")
    check_tensor("topk_weights", topk_weights, dtypes=FLOAT_DTYPES, like=on_hidden, shape=(num_tokens, top_k))
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if expert_map is not None:
        check_tensor("expert_map", expert_map, ndim=1, dtypes=(torch.int32,), like=on_hidden)
        if expert_map.numel() < num_experts:
            raise ValueError(f"expert_map maps {expert_map.numel()} global experts, fewer than the weights' "
                             f"{num_experts} local ones")
    if out is not None:
        check_tensor("out", out, dtypes=(hidden.dtype,), like=on_hidden, shape=(num_tokens, hidden_size))
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last (hidden_size) dimension")
    return num_tokens, hidden_size, intermediate, num_experts, packed


def _check_routing_values(topk_ids, expert_map, num_experts) -> None:
    """Expert ids inside the table they index: the weights' experts, or expert_map's global ones, which map to
    local experts or -1. Reads values: on a GPU only with PAGEDKERNELS_DEBUG=1."""
    if not value_checks_enabled(topk_ids) or topk_ids.numel() == 0:
        return
    table = num_experts if expert_map is None else expert_map.numel()
    low, high = int(topk_ids.min()), int(topk_ids.max())
    if low < 0 or high >= table:
        what = "expert ids" if expert_map is None else "global expert ids (expert_map's length)"
        raise ValueError(f"topk_ids must be {what} in [0, {table}), got range [{low}, {high}]")
    if expert_map is not None and expert_map.numel():
        low, high = int(expert_map.min()), int(expert_map.max())
        if low < -1 or high >= num_experts:
            raise ValueError(f"expert_map must hold local expert ids in [0, {num_experts}) or -1, got range "
                             f"[{low}, {high}]")


# ----------------------------------------------------------------------------------------------
# the op
# ----------------------------------------------------------------------------------------------


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    expert_map: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE MLP of each token over its routed experts (see the module docstring for the math).

    Args:
        hidden: ``[num_tokens, H]`` fp16/bf16/fp32, last dimension contiguous.
        w13: ``[E, 2I, H]`` in hidden's dtype, each expert's gate rows then its up rows; or, for hidden on the
            CPU, ``pack_moe_weight(w13)`` (any float dtype, whatever hidden's: the native kernel's panels).
        w2: ``[E, H, I]`` in hidden's dtype; or ``pack_moe_weight(w2)`` in w13's packed dtype.
        topk_weights: ``[num_tokens, top_k]`` fp32/fp16/bf16 (:func:`pagedkernels.moe_topk`'s weights).
        topk_ids: int32/int64 ``[num_tokens, top_k]``: expert ids in ``[0, E)``, or global ids when
            ``expert_map`` is given.
        activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, tanh approximation).
        expert_map: int32 ``[num_global_experts]``: global expert id -> this rank's expert in ``[0, E)``, or -1
            for an expert held elsewhere (its slots add nothing).
        out: optional ``[num_tokens, H]`` in hidden's dtype.

    Returns ``[num_tokens, H]`` in hidden's dtype (``out`` when given). Every backend accumulates in float32;
    the Triton kernel keeps the activated intermediate and the per-expert outputs in hidden's dtype.
    """
    num_tokens, hidden_size, intermediate, num_experts, packed = check_fused_moe_args(
        hidden, w13, w2, topk_weights, topk_ids, activation, expert_map, out)
    if out is None:
        out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if has_no_data(hidden, w13, w2, topk_weights, topk_ids, expert_map, out):
        return out  # meta or fake tensors: checked, nothing to compute (the fake implementation)
    if num_tokens == 0:
        return out
    native = packed and use_native(hidden)
    if not native:  # the native kernel checks the ids itself, in the pass that sorts them
        _check_routing_values(topk_ids, expert_map, num_experts)
    if native:
        if not _native.fused_moe(hidden, w13, w2, topk_weights, topk_ids, ACTIVATIONS.index(activation),
                                 expert_map, intermediate, out, native_scratch_bytes):
            _check_routing_values(topk_ids, expert_map, num_experts)
            raise RuntimeError("pagedkernels native fused_moe rejected expert ids the checks accept")
    elif not packed and use_triton(hidden):
        _fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, activation, expert_map, out)
    else:
        if packed:
            w13, w2 = unpack_moe_weight(w13, 2 * intermediate), unpack_moe_weight(w2, hidden_size)
        out.copy_(_fused_moe_torch(hidden, w13, w2, topk_weights, topk_ids, activation, expert_map))
    return out


def _activate(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def _fused_moe_torch(hidden, w13, w2, topk_weights, topk_ids, activation, expert_map) -> torch.Tensor:
    """The PyTorch twin: per expert, its tokens' rows through two float32 GEMMs, added into the output with
    their routing weights (transformers' loop over experts)."""
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts).tolist()
    start = int((flat < 0).sum())  # slots of experts held elsewhere sort first
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    weights = topk_weights.float().flatten()
    top_k = ids.shape[1]
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start:start + count]
        start += count
        tokens = slots // top_k
        gate_up = hidden[tokens].float() @ w13[expert].float().t()
        y = _activate(gate_up[:, :intermediate], gate_up[:, intermediate:], activation)
        out.index_add_(0, tokens, (y @ w2[expert].float().t()) * weights[slots, None])
    return out.to(hidden.dtype)


def native_scratch_bytes(num_tokens: int, top_k: int, hidden_size: int, intermediate: int, num_experts: int, *,
                         widened_rows: bool = False) -> int:
    """Bytes of scratch the native kernel takes (``csrc/moe_cpu.c``, its layout): the sort's int32 tables
    (expert offsets, cursors and the active experts; each slot's row and each row's token), then, 64-byte
    aligned, float32 rows of the slots: the first GEMM's ``[slots, 2I]`` (whose buffer the second GEMM's
    ``[slots, H]`` reuses) and the activated ``[slots, I]``; with ``widened_rows`` (16-bit hidden states) then
    the tokens' float32 rows ``[num_tokens, H]`` (the widened input, then each token's sum before its rounding)."""
    slots = num_tokens * top_k
    ints = -(-(3 * num_experts + 1 + 2 * slots) // 16) * 16
    widened = num_tokens * hidden_size if widened_rows else 0
    return 4 * (ints + slots * max(2 * intermediate, hidden_size) + slots * intermediate + widened)


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


@triton.jit
def _gelu_tanh(x):
    # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(u) = 1 - 2 / (exp(2u) + 1) (no overflow to NaN)
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))


# Not specialized on the step's routed slots and their padded count: a step of a new shape compiles no variant of
# its own (tests/engine/test_kernel_variants.py).
@triton.jit(do_not_specialize=["EM", "num_slots"])
def _fused_moe_kernel(
    a_ptr,  # GEMM 1: hidden [num_tokens, K]; GEMM 2: the activated rows [num_slots, K]
    b_ptr,  # [E, N_B, K]: w13 (N_B = 2N: gate rows [0, N), up rows [N, 2N)) or w2 (N_B = N)
    c_ptr,  # [num_slots, N], rows written for the slots of local experts only
    sorted_token_ids_ptr,  # int32 [EM]: slots sorted by expert, padding rows = num_slots (unread when DIRECT)
    expert_ids_ptr,  # int32 [EM // BLOCK_M]; DIRECT: the slots' local expert ids [num_slots], -1 for none here
    num_tokens_post_padded_ptr,  # int32 [1] (unread when DIRECT)
    N,
    K,
    EM,
    num_slots,
    num_experts,
    stride_am: tl.int64,
    stride_be: tl.int64,
    stride_bn: tl.int64,
    stride_cm: tl.int64,
    A_ROW_DIV: tl.constexpr,  # slot s reads row s // A_ROW_DIV of A: top_k for GEMM 1, 1 for GEMM 2
    GATED: tl.constexpr,  # 0: C = A B^T; 1: silu(gate) * up; 2: gelu_tanh(gate) * up
    DIRECT: tl.constexpr,  # each slot a block of its own, in slot order (EM = num_slots * BLOCK_M): no alignment
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (exact products), None for 16-bit
):
    # grid: (cdiv(EM, BLOCK_M) * cdiv(N, BLOCK_N),). Program -> (block of sorted slots, block of columns),
    # GROUP_M row blocks per column block in a row, so consecutive programs share B's columns in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = pid // per_group * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    if DIRECT:
        # Block pid_m is slot pid_m alone (its other rows padding); a slot of no local expert has nothing to do.
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        if (expert < 0) | (expert >= num_experts):  # as the alignment drops them (ids unchecked on a GPU)
            return
        slots = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_slots)  # (BLOCK_M,)
    else:
        # Blocks past the padded length (the buffers are sized for the worst case) have nothing to do.
        if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
            return
        offs_sorted = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        slots = tl.load(sorted_token_ids_ptr + offs_sorted)  # padding rows hold num_slots
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    slot_mask = slots < num_slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    a_rows = a_ptr + (slots // A_ROW_DIV).to(tl.int64)[:, None] * stride_am  # (BLOCK_M, 1)
    b_cols = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn  # (1, BLOCK_N)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        b_up = b_cols + N * stride_bn
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        A = tl.load(a_rows + k[None, :], mask=slot_mask[:, None] & k_mask[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        b_mask = k_mask[:, None] & n_mask[None, :]
        B = tl.load(b_cols + k[:, None], mask=b_mask, other=0.0)  # (BLOCK_K, BLOCK_N)
        acc = tl.dot(A, B, acc, input_precision=DOT_PRECISION)
        if GATED:
            B_up = tl.load(b_up + k[:, None], mask=b_mask, other=0.0)  # (BLOCK_K, BLOCK_N)
            acc_up = tl.dot(A, B_up, acc_up, input_precision=DOT_PRECISION)
    if GATED == 1:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    elif GATED == 2:
        acc = _gelu_tanh(acc) * acc_up
    c_ptrs = c_ptr + slots.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=slot_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_tokens"])   # the step's tokens: no variant per count
def _moe_sum_kernel(
    c_ptr,  # [num_tokens * TOP_K, N]: expert outputs per slot (rows of non-local slots unwritten, unread)
    weights_ptr,  # [num_tokens, TOP_K]
    ids_ptr,  # [num_tokens, TOP_K] local expert ids, -1 for a slot no local expert takes
    out_ptr,  # [num_tokens, N]
    num_tokens,
    N,
    num_experts,
    stride_cm: tl.int64,
    stride_om: tl.int64,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # grid: (cdiv(num_tokens, BLOCK_T), cdiv(N, BLOCK_N)). out[t] = sum_j w[t, j] c[t * TOP_K + j], in float32,
    # in slot order.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    t_mask = tokens < num_tokens
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    n_mask = offs < N
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slots = tokens.to(tl.int64) * TOP_K + j
        expert = tl.load(ids_ptr + slots, mask=t_mask, other=-1)
        local = t_mask & (expert >= 0) & (expert < num_experts)  # as the alignment placed them
        w = tl.load(weights_ptr + slots, mask=local, other=0.0).to(tl.float32)  # (BLOCK_T,)
        # R : (BLOCK_T, BLOCK_N); the row of a slot no local expert took is never read
        R = tl.load(c_ptr + slots[:, None] * stride_cm + offs[None, :], mask=local[:, None] & n_mask[None, :],
                    other=0.0)
        acc += w[:, None] * R.to(tl.float32)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * stride_om + offs[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_slots"])   # the step's slots: no variant per count
def _moe_gemv_up_kernel(
    x_ptr,  # [num_tokens, K]: the hidden states
    w_ptr,  # [E, 2N, K]: w13, each expert's gate rows [0, N) then its up rows [N, 2N)
    ids_ptr,  # [num_slots] local expert ids, -1 (or out of range) for a slot no local expert takes
    act_ptr,  # [num_slots, N]: act(gate) * up, rows written for the slots of local experts only
    num_slots,
    N,
    K,
    num_experts,
    stride_xm: tl.int64,
    stride_we: tl.int64,
    stride_wn: tl.int64,
    stride_am: tl.int64,
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 1: silu(gate) * up; 2: gelu_tanh(gate) * up
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (_backend.programmatic_dependent_launch)
):
    # grid: (num_slots, cdiv(N, BLOCK_N)). A program reads BLOCK_N gate rows and the same up rows of its slot's
    # expert once, whole and in order, against the slot's token: the products summed elementwise over a
    # [BLOCK_N, BLOCK_K] tile and across K once at the end (as skinny_gemm's one row), in float32.
    slot = tl.program_id(0)
    if USE_PDL:
        pdl_wait()   # the ids and the hidden states are the kernels ahead's outputs
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):   # as the other layouts drop them (ids unchecked on a GPU)
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    x_row = x_ptr + (slot // TOP_K).to(tl.int64) * stride_xm
    gate_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    up_rows = gate_rows + N * stride_wn
    wide_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    wide_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xk = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        mask = n_mask[:, None] & k_mask[None, :]
        wide_gate += tl.load(gate_rows + k[None, :], mask=mask, other=0.0).to(tl.float32) * xk
        wide_up += tl.load(up_rows + k[None, :], mask=mask, other=0.0).to(tl.float32) * xk
    gate = tl.sum(wide_gate, axis=1)
    up = tl.sum(wide_up, axis=1)
    if ACTIVATION == 1:
        y = gate / (1.0 + tl.exp(-gate)) * up
    else:
        y = _gelu_tanh(gate) * up
    tl.store(act_ptr + slot.to(tl.int64) * stride_am + offs_n, y.to(act_ptr.dtype.element_ty), mask=n_mask)


@triton.jit(do_not_specialize=["num_tokens"])   # the step's tokens: no variant per count
def _moe_gemv_down_kernel(
    act_ptr,  # [num_tokens * TOP_K, K]: the activated rows (those of non-local slots unwritten, unread)
    w_ptr,  # [E, N, K]: w2
    ids_ptr,  # [num_tokens * TOP_K] local expert ids, -1 (or out of range) for a slot no local expert takes
    weights_ptr,  # [num_tokens * TOP_K]: the routing weights
    out_ptr,  # [num_tokens, N]
    num_tokens,
    N,
    K,
    num_experts,
    stride_am: tl.int64,
    stride_we: tl.int64,
    stride_wn: tl.int64,
    stride_om: tl.int64,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,  # TOP_K rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # grid: (num_tokens, cdiv(N, BLOCK_N)). A program owns BLOCK_N output columns of one token and reads them from
    # all its top_k experts at once: a [TOP_K_PAD, BLOCK_N, BLOCK_K] tile a K step, every expert's rows in flight
    # together (a loop over the experts would keep one row block in flight and leave the memory idle between).
    # Each expert's products are summed in float32 and rounded to the output's dtype (as the other layouts store
    # each expert's output), then weighted and added in float32 in slot order (as their top-k sum adds them): no
    # [slots, H] buffer, no launch of its own for the sum.
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    j = tl.arange(0, TOP_K_PAD)
    slots = token.to(tl.int64) * TOP_K + j  # [TOP_K_PAD]
    j_mask = j < TOP_K
    # The ids and the routing weights are read before the wait under programmatic dependent launch: they come from
    # before the up projection, which waited for them to be written before it let this kernel launch.
    experts = tl.load(ids_ptr + slots, mask=j_mask, other=-1).to(tl.int64)
    local = j_mask & (experts >= 0) & (experts < num_experts)   # as the other layouts drop them
    experts = tl.where(local, experts, 0)
    rows = (w_ptr + experts[:, None, None] * stride_we
            + offs_n.to(tl.int64)[None, :, None] * stride_wn)  # [TOP_K_PAD, BLOCK_N, 1]
    row_mask = local[:, None, None] & n_mask[None, :, None]
    a_rows = act_ptr + slots[:, None] * stride_am  # [TOP_K_PAD, 1]
    wide = tl.zeros([TOP_K_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    first = 0
    if USE_PDL:   # the first weight tile streams in while the up projection finishes (no kernel writes weights)
        k_first = tl.arange(0, BLOCK_K)
        b_first = tl.load(rows + k_first[None, None, :], mask=row_mask & (k_first < K)[None, None, :], other=0.0)
        pdl_wait()   # the activated rows are the kernel ahead's output
        a_first = tl.load(a_rows + k_first[None, :], mask=local[:, None] & (k_first < K)[None, :], other=0.0)
        wide += b_first.to(tl.float32) * a_first.to(tl.float32)[:, None, :]
        first = BLOCK_K
    for k0 in range(first, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        a = tl.load(a_rows + k[None, :], mask=local[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        b = tl.load(rows + k[None, None, :], mask=row_mask & k_mask[None, None, :], other=0.0).to(tl.float32)
        wide += b * a[:, None, :]
    expert_out = tl.sum(wide, axis=2).to(out_ptr.dtype.element_ty).to(tl.float32)  # [TOP_K_PAD, BLOCK_N]
    weighted = tl.load(weights_ptr + slots, mask=local, other=0.0).to(tl.float32)[:, None] * expert_out
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in tl.static_range(TOP_K):   # in slot order, one term at a time (a tree sum would round otherwise)
        acc += tl.sum(tl.where(j[:, None] == i, weighted, 0.0), axis=0)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@dataclass(frozen=True)
class MoELaunchConfig:
    """The tiles of one grouped GEMM launch (BLOCK_M is the alignment's block, shared by both GEMMs)."""
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def fused_moe_launch_config(num_tokens: int, num_experts: int, top_k: int, n: int, k: int, gated: bool,
                            dtype: torch.dtype, device_kind: str, *,
                            capability: tuple[int, int] | None = None) -> MoELaunchConfig:
    """Tiles of a grouped GEMM with ``n`` output columns (GEMM 1: I, gated over 2I weight rows; GEMM 2: H) and
    ``k`` reduction columns, from shapes, dtype, the device kind and its compute capability only (no autotuning, no
    host sync; the CUDA choice can be compiled ahead of time anywhere, for each architecture).

    BLOCK_M follows the mean slots per expert, ``r = num_tokens * top_k / num_experts``: a block of an expert's
    slots reads its weight tile once, so a block should be about as tall as an expert's run but no taller
    (padding rows cost a full tile's products): 16 rows (tl.dot's least) up to r = 16, 32 up to 64, then 128 (64
    where I or H is no multiple of 16, below). Measured on the H200
    (bench/results/2026-11-30-nvidia-h200-phase9-tune; decode timed in CUDA graphs), against the earlier rule:
    - Decode (BLOCK_M 16) is bound by the weights' bytes: 32 gated columns (64 weight rows: gate and up) and 64
      plain ones, 128-deep K tiles, 3 stages, 4 warps: the best or within 1% of it among nine launches at
      Qwen3-30B-A3B's layer at 1 and 16 tokens and Mixtral's at 1 (0.0392 / 0.203 / 0.195 ms); the earlier rule
      (the widest column block giving 4 programs a multiprocessor, else 16) was 0-6% slower.
    - From r = 64 (BLOCK_M 128) the matmul rate bounds it: on Hopper (sm_90) 128 x 128 gated tiles (two accumulators,
      256 weight rows) and 128 x 256 plain ones, 64-deep K, 4 stages, 8 warps, GROUP_M 8 so that neighbouring
      programs share a column block: 0.901 ms at Qwen3-30B-A3B's 4096 tokens and 5.50 ms at Mixtral's (0.50 and
      0.76 of the bf16 matmul rate), the best of eight launches at both, as vLLM's tuned H200 table picks (128 x 256
      over gate and up together); the earlier 64 x 32 / 64 x 64 tiles took 1.38 and 10.15 ms. Those tiles spill on
      sm_80 (7 KB gated: the gathered rows' pointers beside two 128 x 128 float32 accumulators; 20 B plain under
      Triton 3.6), so Ampere and the rest take 128 x 64 gated and 128 x 128 plain tiles, otherwise the same: on the
      H200 1.033 and 6.43 ms (0.43 and 0.65).
    - 32-row blocks: 32 x 32 gated, 32 x 64 plain, 64-deep K, 4 warps, 3 stages (not yet swept).
    The gathered A rows make each program hold its (BLOCK_M, BLOCK_K) pointers, and where strides are no multiple
    of 16 (hidden 1000) loads are not vectorized and take more registers: those shapes keep 16-column decode tiles
    and 64-row prefill tiles of 32 / 64 columns over 8 warps, which compile without spills (the wider ones spilled
    16-8200 B). fp32 (ieee FMA dots, a correctness dtype): 32-column tiles over 8 warps and 2 stages, as the
    quantized GEMM's fp32 launches.
    Interpreter (CPU): BLOCK_M and GROUP_M as on CUDA, 16/32-column and 32-deep tiles, so tests cross every tile
    edge (and the last, partial group of row blocks) at small sizes.
    Every CUDA choice compiles for sm_90 and sm_80 without spills and within their shared memory
    (``python -m pagedkernels._aot``)."""
    slots = num_tokens * top_k
    rows_per_expert = slots / num_experts
    # {n, k} is {I, H} for both GEMMs, so both (and their shared BLOCK_M) see the same answer.
    aligned = n % 16 == 0 and k % 16 == 0
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 128
    if block_m == 128 and device_kind == "cuda" and dtype != torch.float32 and not aligned:
        block_m = 64
    if device_kind != "cuda":
        return MoELaunchConfig(block_m, 16 if gated else 32, 32, 1 if block_m == 16 else 8, 4, 1)
    if dtype == torch.float32:
        return MoELaunchConfig(min(block_m, 32), 32, 32, 8, 8, 2)
    if block_m == 16:
        return MoELaunchConfig(16, (32 if gated else 64) if aligned else 16, 128, 1, 4, 3)
    if block_m == 32:
        return MoELaunchConfig(32, 32 if gated else 64, 64, 8, 4, 3)
    if not aligned:
        return MoELaunchConfig(64, 32 if gated else 64, 64, 8, 8, 3)
    if capability is not None and capability >= (9, 0):
        return MoELaunchConfig(128, 128 if gated else 256, 64, 8, 8, 4)
    return MoELaunchConfig(128, 64 if gated else 128, 64, 8, 8, 4)


def direct_layout(num_slots: int, num_experts: int, block_m: int) -> bool:
    """Whether the grouped GEMMs take each slot as a block of its own, in slot order, with no alignment (no sort,
    one launch fewer): where the slots are few against the experts (``4 * num_slots <= num_experts``, 16-row
    blocks), as at decode of a fine-grained MoE (one token of Qwen3-30B-A3B: 8 slots over 128 experts), most
    slots have an expert of their own, so a block of one slot reads the weights the aligned layout would (two
    slots on one expert read its weights twice instead of once), and the alignment, a single program that scans
    the ids and writes the padded layout ahead of the first GEMM, is not launched: three launches, not four."""
    return block_m == 16 and 4 * num_slots <= num_experts


def _env_gemv_max_tokens() -> int:
    value = os.environ.get("PAGEDKERNELS_MOE_GEMV_MAX_TOKENS", "").strip()
    if not value:
        return 0
    if not value.isdigit():
        raise ValueError(f"PAGEDKERNELS_MOE_GEMV_MAX_TOKENS must be a non-negative int, got {value!r}")
    return int(value)


# Tokens up to which the Triton backend takes the matrix-vector launches (gemv_layout); 0: never.
_gemv_max_tokens = _env_gemv_max_tokens()


def set_moe_gemv_max_tokens(max_tokens: int) -> int:
    """Up to how many tokens fused_moe's Triton backend takes the matrix-vector launches (:func:`gemv_layout`);
    0 (the default, or ``PAGEDKERNELS_MOE_GEMV_MAX_TOKENS``): never. Returns the previous setting. A CUDA graph
    keeps the launches it captured: capture again after changing it."""
    global _gemv_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"max_tokens must be a non-negative int, got {max_tokens!r}")
    previous, _gemv_max_tokens = _gemv_max_tokens, max_tokens
    return previous


def moe_gemv_max_tokens() -> int:
    """The setting of :func:`set_moe_gemv_max_tokens`."""
    return _gemv_max_tokens


def gemv_layout(num_tokens: int) -> bool:
    """Whether fused_moe's Triton backend runs ``num_tokens`` tokens as two matrix-vector launches: GEMM 1 with a
    program per (slot, block of I columns), GEMM 2 and the top-k sum with one per (token, block of H columns).
    Each slot reads its expert's weights itself (two slots of one expert read them twice, as in the direct
    layout), with no 16-row tile of which one row is real and no launch for the sum: two launches where the
    direct layout has three, chained by programmatic dependent launch where it is on. Up to
    :func:`moe_gemv_max_tokens` tokens; off by default until a GPU has measured it against the direct layout
    (bench.kernels' tune phase: "fused_moe configs", the "matrix-vector launches" rows; a decode of Qwen3-30B-A3B's
    layer is the case: 0.52 of the copy bandwidth at one token on the H200 of 2026-11-30, whatever the tiles)."""
    return 0 < num_tokens <= _gemv_max_tokens


def moe_gemv_config(rows: int, n: int, k: int, depth: int, device_kind: str, num_sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of a matrix-vector launch with ``rows`` program rows (GEMM 1: the slots;
    GEMM 2: the tokens), ``n`` output columns, ``k`` reduction columns and ``depth`` weight rows a column (GEMM 1:
    2, gate and up; GEMM 2: top_k rounded up to a power of two, every expert's rows read together), much as
    skinny_gemm_config chooses for one row: BLOCK_N halved from 16 until the grid has about four programs a
    multiprocessor (more loads in flight) and the tile holds at most 4096 values with BLOCK_K >= 128; BLOCK_K up
    to 256 (a 16-bit row read in 512 B pieces), the widest power of two from 64 that divides K (768 -> 256: no
    half-masked last tile) and fits those 4096; 4 warps up to 1024 values a tile, else 8. The grid then keeps
    ``n * depth * BLOCK_K`` weights in flight. Every choice compiles for sm_90 and sm_80 without spills (``python -m
    pagedkernels._aot``; under Triton 3.6, sm_80 spilled a few bytes with 2048 values over 4 warps, and with 512-deep
    tiles). Interpreter (CPU): 4 x 32 tiles, so the tests cross every tile edge at small sizes."""
    if device_kind != "cuda":
        return 4, 32, 4
    block_n = 16
    while block_n > 1 and (rows * triton.cdiv(n, block_n) < 4 * num_sms or block_n * depth * 128 > 4096):
        block_n //= 2
    cap = max(64, min(256, 4096 // (block_n * depth)))
    block_k = cap
    while block_k > 64 and k % block_k:
        block_k //= 2
    if k % block_k:
        block_k = min(cap, max(64, triton.next_power_of_2(k)))
    values = block_n * block_k * depth
    return block_n, block_k, 4 if values <= 1024 else 8


# Values per program of the top-k sum: 32 float32 accumulators per thread of 4 warps.
SUM_TILE = 4096


def _fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, activation, expert_map, out) -> None:
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    intermediate = two_i // 2
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    device_kind, capability = launch_device_kind(hidden.device), launch_capability(hidden.device)
    ids = topk_ids if expert_map is None else expert_map[topk_ids.long()]  # local ids, -1: elsewhere
    ids = ids if ids.is_contiguous() else ids.contiguous()
    weights = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    if gemv_layout(num_tokens):
        _fused_moe_gemv(hidden, w13, w2, weights, ids, activation, out, device_kind)
        return
    config1 = fused_moe_launch_config(num_tokens, num_experts, top_k, intermediate, hidden_size, True,
                                      hidden.dtype, device_kind, capability=capability)
    config2 = fused_moe_launch_config(num_tokens, num_experts, top_k, hidden_size, intermediate, False,
                                      hidden.dtype, device_kind, capability=capability)
    block_m = config1.block_m
    direct = direct_layout(num_slots, num_experts, block_m)
    if direct:  # each slot its own block: the ids are the blocks' experts, nothing to sort
        sorted_ids, expert_ids, num_post_padded, em = ids, ids, ids, num_slots * block_m
    else:
        sorted_ids, expert_ids, num_post_padded = moe_align_block_size(ids, block_m, num_experts)
        em = sorted_ids.numel()
    activated = torch.empty(num_slots, intermediate, dtype=hidden.dtype, device=hidden.device)
    expert_out = torch.empty(num_slots, hidden_size, dtype=hidden.dtype, device=hidden.device)
    precision = "ieee" if hidden.dtype == torch.float32 else None
    for a, b, c, n, k, a_row_div, gated, config in (
            (hidden, w13, activated, intermediate, hidden_size, top_k, ACTIVATIONS.index(activation) + 1, config1),
            (activated, w2, expert_out, hidden_size, intermediate, 1, 0, config2)):
        grid = (triton.cdiv(em, block_m) * triton.cdiv(n, config.block_n),)
        _fused_moe_kernel[grid](
            a, b, c, sorted_ids, expert_ids, num_post_padded, n, k, em, num_slots, num_experts,
            a.stride(0), b.stride(0), b.stride(1), c.stride(0),
            A_ROW_DIV=a_row_div, GATED=gated, DIRECT=direct, BLOCK_M=block_m, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, GROUP_M=config.group_m, DOT_PRECISION=precision, num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    # Tiles of SUM_TILE values: a row of up to 1024 columns, as many tokens as fill the rest.
    block_n = min(1024, triton.next_power_of_2(hidden_size))
    block_t = SUM_TILE // block_n
    _moe_sum_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(hidden_size, block_n))](
        expert_out, weights, ids, out, num_tokens, hidden_size, num_experts, expert_out.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_T=block_t, BLOCK_N=block_n, num_warps=4,
    )


def _fused_moe_gemv(hidden, w13, w2, weights, ids, activation, out, device_kind) -> None:
    """The two matrix-vector launches of :func:`gemv_layout` (ids: local expert ids, contiguous)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    top_k = ids.shape[1]
    num_slots = num_tokens * top_k
    sms = num_multiprocessors(hidden.device)
    pdl = pdl_launch(hidden.device)
    activated = torch.empty(num_slots, intermediate, dtype=hidden.dtype, device=hidden.device)
    block_n, block_k, warps = moe_gemv_config(num_slots, intermediate, hidden_size, 2, device_kind, sms)
    _moe_gemv_up_kernel[(num_slots, triton.cdiv(intermediate, block_n))](
        hidden, w13, ids, activated, num_slots, intermediate, hidden_size, num_experts,
        hidden.stride(0), w13.stride(0), w13.stride(1), activated.stride(0),
        TOP_K=top_k, ACTIVATION=ACTIVATIONS.index(activation) + 1, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, **pdl,
    )
    top_k_pad = triton.next_power_of_2(top_k)
    block_n, block_k, warps = moe_gemv_config(num_tokens, hidden_size, intermediate, top_k_pad, device_kind, sms)
    _moe_gemv_down_kernel[(num_tokens, triton.cdiv(hidden_size, block_n))](
        activated, w2, ids, weights, out, num_tokens, hidden_size, intermediate, num_experts,
        activated.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, TOP_K_PAD=top_k_pad, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl,
    )
