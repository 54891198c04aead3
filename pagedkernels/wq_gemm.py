"""Weight-only quantized GEMM: ``out = x @ W^T`` with W stored as int4/int8 in pagedkernels' canonical
layout (``pagedkernels/quant_formats.py``: GPTQ, AWQ and GGUF weights convert to it at load time), or
as float8 e4m3 with per-channel / per-tensor scales (``pagedkernels.fp8_gemm`` uses the same kernel
where no fp8 tensor-core GEMM exists).

    w[n, k] = (q[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]
    out[m, n] = sum_k x[m, perm[k]] * w[n, k]          (perm = identity unless act-order)

Backends:

- Triton (CUDA): one kernel, ``_wq_gemm_kernel``, de-quantizes each weight tile in registers and feeds
  ``tl.dot`` in x's dtype (fp32 accumulation). Decode-shaped calls (M <= 16) take 16-row tiles with
  long K tiles split over programs (split-K, float32 partial sums reduced after), so a single token
  spreads over the GPU; prefill-shaped calls take large M/N tiles and no split.
- Native (CPU): ``csrc/quant_cpu.c``: the activation quantized to int8 per block of 32, integer dot
  products on the packed blocks (llama.cpp's scheme), parallel over output features; for M above
  :data:`NATIVE_MAX_ROWS` the weight is de-quantized (native) and multiplied by torch. The int8
  activation makes the result differ from x @ W^T by at most sum_k |w[n,k]| * max|x block| / 254.
- PyTorch twin: de-quantize in float32 and multiply (the reference the others are tested against).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _native
from ._backend import has_no_data, launch_device_kind, num_multiprocessors, use_native, use_triton
from ._fp8 import _e4m3_to_float
from ._validate import FLOAT_DTYPES, check_tensor
from .quant_formats import dequantize_wq

__all__ = ["wq_gemm", "check_wq_gemm_args", "check_wq_perm", "wq_launch_config", "NATIVE_MAX_ROWS"]

# Rows up to which the native CPU path runs its int8 GEMM; above, de-quantize + torch's GEMM is faster
# (bench/quant_cpu.py measures both; see its results).
NATIVE_MAX_ROWS = 64
QUANT_BLOCK = 32
# Weight formats of the Triton kernel.
FORMAT_INT4, FORMAT_INT8, FORMAT_FP8 = 0, 1, 2


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


def check_wq_gemm_args(x, qweight, scales, zeros, bits, group_size, perm=None, out=None) -> tuple[int, int, int, int]:
    """Every check of :func:`wq_gemm`'s arguments that reads no tensor value, shared with its fake
    implementation. Returns (M, N, K, group size as a number of columns)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    on_x = ("x", x)
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last (K) dimension")
    M, K = x.shape
    if _check_int("bits", bits) not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.uint8,), like=on_x)
    N = qweight.shape[0]
    per_byte = 8 // bits
    check_tensor("qweight", qweight, shape=(N, K // per_byte))
    if qweight.shape[1] * per_byte != K:
        raise ValueError(f"qweight: {bits}-bit rows of {qweight.shape[1]} bytes hold {qweight.shape[1] * per_byte} "
                         f"values but x has K = {K}")
    if not qweight.is_contiguous():
        raise ValueError("qweight must be contiguous")
    if K % QUANT_BLOCK:
        raise ValueError(f"x: K ({K}) must be a multiple of {QUANT_BLOCK}")
    group_size = _check_int("group_size", group_size)
    group = K if group_size == -1 else group_size
    if group <= 0 or group % QUANT_BLOCK or K % group:
        raise ValueError(f"group_size must be -1 or a multiple of {QUANT_BLOCK} dividing K ({K}), got {group_size}")
    check_tensor("scales", scales, dtypes=FLOAT_DTYPES, like=on_x, shape=(N, K // group))
    if not scales.is_contiguous():
        raise ValueError("scales must be contiguous")
    if zeros is not None:
        check_tensor("zeros", zeros, dtypes=(scales.dtype,), like=on_x, shape=(N, K // group))
        if not zeros.is_contiguous():
            raise ValueError("zeros must be contiguous")
    if perm is not None:
        check_tensor("perm", perm, dtypes=(torch.int32, torch.int64), like=on_x, shape=(K,))
    if out is not None:
        check_tensor("out", out, dtypes=(x.dtype,), like=on_x, shape=(M, N))
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last (N) dimension")
    return M, N, K, group


def check_wq_perm(perm: torch.Tensor, K: int) -> None:
    """ValueError unless every value of an act-order ``perm`` ([K] int32/int64) is a column index in [0, K).

    This reads the values on the host, so :func:`wq_gemm` does not (a CPU or CUDA graph could not replay such a
    read, and a decode step would pay it per layer): a weight's ``perm`` is checked once, when it is loaded
    (the engine's ``install_wq``). A bad one that reaches ``wq_gemm`` still reads nothing outside x: its
    ``index_select`` raises on the CPU and asserts on a GPU."""
    check_tensor("perm", perm, ndim=1, dtypes=(torch.int32, torch.int64), shape=(K,))
    if perm.numel() and (int(perm.min()) < 0 or int(perm.max()) >= K):
        raise ValueError(f"perm: column indices must lie in [0, {K}), got values in "
                         f"[{int(perm.min())}, {int(perm.max())}]")


def wq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    *,
    bits: int,
    group_size: int,
    perm: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T`` for a weight W in the canonical int4/int8 layout (``pagedkernels.quant_formats``).

    Args:
        x: ``[M, K]`` fp16/bf16/fp32, last dimension contiguous; K a multiple of 32.
        qweight: uint8 ``[N, K // 2]`` (bits=4, blocks of 32 values: byte j of a block holds values j and
            16 + j in its low and high nibble) or ``[N, K]`` (bits=8), contiguous.
        scales: ``[N, K // group_size]`` fp16/bf16/fp32, contiguous.
        zeros: float zero points like ``scales``, or None for 2 ** (bits - 1) (symmetric).
        bits: 4 or 8.
        group_size: a multiple of 32 dividing K, or -1 for one group per row.
        perm: int32/int64 ``[K]`` (act-order): weight column k multiplies ``x[:, perm[k]]``; its values are
            checked once by :func:`check_wq_perm`, not here (no host read: the call can be graphed).
        out: optional ``[M, N]`` in x's dtype, last dimension contiguous.

    Returns ``[M, N]`` in x's dtype (``out`` when given). Accumulation is float32 on every backend; the
    native CPU backend quantizes x to int8 per block of 32 (see the module docstring).
    """
    M, N, K, group = check_wq_gemm_args(x, qweight, scales, zeros, bits, group_size, perm, out)
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if has_no_data(x, qweight, scales, zeros, perm, out):
        return out  # meta or fake tensors: checked, nothing to compute (the fake implementation)
    if M == 0 or N == 0:
        return out
    if perm is not None:
        x = x.index_select(1, perm)
    if use_triton(x):
        _wq_gemm_triton(x, qweight, scales, zeros, FORMAT_INT4 if bits == 4 else FORMAT_INT8, group, out)
    elif use_native(x):
        fmt = "wq4" if bits == 4 else "wq8"
        if M <= NATIVE_MAX_ROWS:
            _native.quant_gemm(x, qweight, fmt, group, scales, zeros, out)
        else:
            weight = torch.empty(N, K, dtype=torch.float32)
            _native.quant_dequantize(qweight, N, K, fmt, group, scales, zeros, weight)
            _matmul_into(x, weight, out)
    else:
        weight = dequantize_wq(qweight, scales, zeros, bits=bits, group_size=group_size)
        out.copy_(x.float() @ weight.t())
    return out


def _matmul_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out = x @ weight^T with a float32 weight (CPU), in float32."""
    if x.dtype == torch.float32:
        torch.matmul(x, weight.t(), out=out)
    else:
        out.copy_(torch.matmul(x.float(), weight.t()))


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dequantize_tile(
    q,  # (TILE_K, BLOCK_N) uint8 / float8 weight values
    k_offs,  # (TILE_K,) the tile's weight columns
    k_mask,  # (TILE_K,) k_offs < K
    k0,  # first column of the whole K tile
    offs_n,  # (BLOCK_N,)
    n_mask,
    scales_ptr,  # [N, num_groups]
    zeros_ptr,  # [N, num_groups]
    stride_s_n,
    group_size,
    default_zero,
    HAS_ZEROS: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr,  # group_size % BLOCK_K == 0: one group per row and K tile
):
    """(q - zero) * scale in float32, (TILE_K, BLOCK_N)."""
    qf = q.to(tl.float32)
    if SCALE_PER_TILE:
        ptrs = offs_n * stride_s_n + k0 // group_size  # (BLOCK_N,)
        s = tl.load(scales_ptr + ptrs, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + ptrs, mask=n_mask, other=0.0).to(tl.float32)
            w = (qf - z[None, :]) * s[None, :]
        else:
            w = (qf - default_zero) * s[None, :]
    else:
        # Columns past K (the last tile's tail) would name a group past the row's last one, past the
        # tensor's end for the last row: garbage there (NaN, inf) times the masked-out zero activation
        # is NaN, so they are masked too.
        ptrs = offs_n[None, :] * stride_s_n + (k_offs // group_size)[:, None]  # (TILE_K, BLOCK_N)
        sz_mask = k_mask[:, None] & n_mask[None, :]
        s = tl.load(scales_ptr + ptrs, mask=sz_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + ptrs, mask=sz_mask, other=0.0).to(tl.float32)
            w = (qf - z) * s
        else:
            w = (qf - default_zero) * s
    return w


# Not specialized on the step's rows: a step of a new shape compiles no variant of its own
# (tests/engine/test_kernel_variants.py).
@triton.jit(do_not_specialize=["M"])
def _wq_gemm_kernel(
    x_ptr,  # [M, K], fp16/bf16/fp32
    w_ptr,  # WEIGHT_FORMAT 0: uint8 [N, K // 2]; 1: uint8 [N, K]; 2: uint8 e4m3 codes [N, K]
    scales_ptr,  # [N, num_groups]; stride_s_n == 0 with one group: a per-tensor scale
    zeros_ptr,  # [N, num_groups], read when HAS_ZEROS
    out_ptr,  # SPLIT_K == 1: [M, N] in x's dtype; else float32 partial sums [SPLIT_K, M, N]
    M,
    N,
    K,
    group_size,
    default_zero,  # float: the zero point when not HAS_ZEROS (8, 128, or 0 for fp8)
    stride_x_m: tl.int64,
    stride_w_n: tl.int64,
    stride_s_n: tl.int64,
    stride_out_m: tl.int64,
    stride_out_split: tl.int64,
    WEIGHT_FORMAT: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 32
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 x (exact products), None for 16-bit
):
    # grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K); program (i, j, s) sums its share of the K
    # tiles for output tile (i, j).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x_m  # (BLOCK_M, 1)
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_w_n  # (1, BLOCK_N)

    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    tile_lo = pid_k * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, k_tiles)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        k0 = tile * BLOCK_K
        if WEIGHT_FORMAT == 0:
            # Byte c of the tile holds columns k_lo[c] (low nibble) and k_lo[c] + 16 (high nibble).
            c = tl.arange(0, BLOCK_K // 2)  # (BLOCK_K / 2,)
            k_lo = k0 + (c // 16) * 32 + c % 16
            k_mask = k_lo < K  # K is a multiple of 32: the high column is in range iff the low one is
            # B : (BLOCK_K / 2, BLOCK_N) uint8
            B = tl.load(w_rows + (k0 // 2 + c)[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
            W_lo = _dequantize_tile(B & 0xF, k_lo, k_mask, k0, offs_n, n_mask, scales_ptr, zeros_ptr, stride_s_n,
                                    group_size, default_zero, HAS_ZEROS, SCALE_PER_TILE)
            W_hi = _dequantize_tile(B >> 4, k_lo + 16, k_mask, k0, offs_n, n_mask, scales_ptr, zeros_ptr, stride_s_n,
                                    group_size, default_zero, HAS_ZEROS, SCALE_PER_TILE)
            x_mask = m_mask[:, None] & k_mask[None, :]
            # X_lo, X_hi : (BLOCK_M, BLOCK_K / 2), the activation columns matching the nibbles
            X_lo = tl.load(x_rows + k_lo[None, :], mask=x_mask, other=0.0)
            X_hi = tl.load(x_rows + (k_lo + 16)[None, :], mask=x_mask, other=0.0)
            acc = tl.dot(X_lo, W_lo.to(X_lo.dtype), acc, input_precision=DOT_PRECISION)
            acc = tl.dot(X_hi, W_hi.to(X_hi.dtype), acc, input_precision=DOT_PRECISION)
        else:
            k = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
            k_mask = k < K
            # Q : (BLOCK_K, BLOCK_N) uint8: the values, or (WEIGHT_FORMAT 2) e4m3 codes
            Q = tl.load(w_rows + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
            if WEIGHT_FORMAT == 2:
                Q = _e4m3_to_float(Q)
            W = _dequantize_tile(Q, k, k_mask, k0, offs_n, n_mask, scales_ptr, zeros_ptr, stride_s_n, group_size,
                                 default_zero, HAS_ZEROS, SCALE_PER_TILE)
            X = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            acc = tl.dot(X, W.to(X.dtype), acc, input_precision=DOT_PRECISION)

    out_mask = m_mask[:, None] & n_mask[None, :]
    out_ptrs = out_ptr + pid_k.to(tl.int64) * stride_out_split + offs_m.to(tl.int64)[:, None] * stride_out_m \
        + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptrs, acc, mask=out_mask)


# Most K splits of a decode-shaped launch: beyond it the partial sums cost more than the idle SMs.
MAX_SPLIT_K = 16


def wq_launch_config(M: int, N: int, K: int, dtype: torch.dtype, device_kind: str,
                     num_multiprocessors: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) from shapes, dtype and the device kind
    only (no autotuning, no host sync), so the CUDA choice can be compiled ahead of time anywhere.

    Decode-shaped (M <= 16): the weight is read once, so the launch is about spreading it: 16-row tiles
    (tl.dot's minimum), 64 features x 128 columns per program, split-K up to about two programs per SM
    (a [1, 4096] x [4096, 4096] call has 64 N tiles; 132 SMs -> 5 splits), 2 stages (at 3, Triton 3.6
    gave the fp8 variant 128 registers and 8 B of spills on sm_90). Larger M, no split: 64 x 64 x 64
    tiles (64 x 128 spilled 76 B on sm_80 under Triton 3.6 where group-32 scales are gathered per
    column), 128 x 64 over 8 warps from 128 rows. fp32 activations take ieee FMA dots (a correctness
    dtype) with 32 x 32 x 64 tiles over 8 warps: at 4 warps they spilled 120 to 230 B (255 registers,
    sm_90 and sm_80, Triton 3.9), 32-column K tiles still 8 B. Every choice compiles without spills for
    sm_90 and sm_80 with Triton 3.6 and 3.9 (``python -m pagedkernels._aot``).
    Interpreter (CPU): small tiles, so tests cross tile edges at small shapes; 8 SMs for the split."""
    if device_kind != "cuda":
        block_m, block_n, block_k, warps, stages = 16, 32, 64, 4, 1
    elif dtype == torch.float32:
        block_m, block_n, block_k, warps, stages = (16 if M <= 16 else 32), 32, 64, 8, 2
    elif M <= 16:
        block_m, block_n, block_k, warps, stages = 16, 64, 128, 4, 2
    elif M < 128:
        block_m, block_n, block_k, warps, stages = 64, 64, 64, 4, 3
    else:
        block_m, block_n, block_k, warps, stages = 128, 64, 64, 8, 3
    split = 1
    if M <= 16:
        programs = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
        split = max(1, min(triton.cdiv(2 * num_multiprocessors, programs), triton.cdiv(K, block_k), MAX_SPLIT_K))
    return block_m, block_n, block_k, split, warps, stages


def _wq_gemm_triton(x, weight, scales, zeros, weight_format: int, group: int, out: torch.Tensor) -> None:
    """Launch for the canonical formats (zeros or the midpoint) and fp8 (a uint8 view of the e4m3 weight,
    zeros None, zero point 0; ``scales`` [N, 1] per channel or [1, 1] per tensor, broadcast with a zero
    row stride)."""
    M, K = x.shape
    N = weight.shape[0]
    block_m, block_n, block_k, split, warps, stages = wq_launch_config(
        M, N, K, x.dtype, launch_device_kind(x.device), num_multiprocessors(x.device))
    if split > 1:
        partial = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        target, stride_split, stride_out_m = partial, partial.stride(0), partial.stride(1)
    else:
        target, stride_split, stride_out_m = out, 0, out.stride(0)
    default_zero = {FORMAT_INT4: 8.0, FORMAT_INT8: 128.0, FORMAT_FP8: 0.0}[weight_format]
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), split)
    _wq_gemm_kernel[grid](
        x, weight, scales, scales if zeros is None else zeros, target,
        M, N, K, group, default_zero,
        x.stride(0), weight.stride(0), scales.stride(0) if scales.shape[0] == N and N > 1 else 0,
        stride_out_m, stride_split,
        WEIGHT_FORMAT=weight_format, HAS_ZEROS=zeros is not None, SCALE_PER_TILE=group % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=warps, num_stages=stages,
    )
    if split > 1:
        torch.sum(partial, dim=0, out=out) if out.dtype == torch.float32 else out.copy_(partial.sum(0))
