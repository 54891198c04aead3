"""GEMM of a few rows, for decode at small batch: ``x @ W^T`` with an RMSNorm or SiLU-and-mul prologue and a
residual-add epilogue.

At batch 1 a decode step's linears are matrix-vector products, bound by reading the weight once. cuBLAS serves them
with tiles made for large M: on the H200 (2026-11-28, Qwen3-0.6B shape, bf16) the step's GEMMs read 1.1 TB/s, a
quarter of the copy bandwidth, and the down projection splits K with a reduction kernel of its own. Here one
program owns ``BLOCK_N`` output columns and runs all of K for every row: each weight row is read once, whole and in
order, many programs per SM keep loads in flight, and no output is split (no reduction kernel, no atomics).

Owning whole outputs lets a program also do what the kernels around a decode linear did, saving two launches a
linear pair (vLLM's fused norm-quant and allreduce-add ideas, here for the plain product):

- ``norm_weight`` (prologue, RMSNorm): ``y = rms_norm(x) * norm_weight`` then ``y @ W^T``. Every program computes
  the rows' mean squares itself (x is a few KiB, read from L2); y is rounded to x's dtype before the product, as the
  unfused ``rms_norm`` -> linear pair rounds it, so only the GEMM's own summation order differs from that pair.
- ``gated="silu"`` (prologue, SwiGLU): x is the gate_up projection ``[M, 2K]`` and the product's input is
  ``silu(gate) * up``, computed and rounded as ``silu_and_mul`` does, never stored.
- ``residual`` (epilogue): ``residual <- residual + (x @ W^T + bias)``, the product rounded to x's dtype first and
  the sum to the residual's, as an unfused linear followed by ``fused_add_rms_norm``'s add. Returns the residual.

A decoder layer on this path (engine/models/llama.py) is 7 launches: norm+qkv, q/k norm+rotary+cache write
(``rotary_embedding_and_cache``), attention (split and reduce), o+residual, norm+gate_up, SiLU-and-mul+down+residual;
around cuBLAS it is 11, and 12 where cuBLAS splits K with a reduction kernel. One row sums its products elementwise
over a program's ``[BLOCK_N, BLOCK_K]`` tile and reduces across K once at the end; several rows reduce per K block.

Launched with programmatic dependent launch (``pagedkernels.set_programmatic_dependent_launch``, Hopper and later), a
program loads its first weight tile before it waits for the kernel ahead, whose outputs (x, the residual) it reads.
With :func:`set_skinny_gemm_deep` (off by default until a GPU has measured it) a program reaches deeper into K: tiles
widened along K, and two in flight where K takes several (the first loaded before the prologue, then each K block's
loads issued before the block ahead is multiplied: the products and their order unchanged, so are the bits).

Backends: Triton (CUDA; fp32 accumulation; M up to :data:`MAX_ROWS`, the rows unrolled), and a PyTorch twin (CPU and
the ``torch`` backend) with the same rounding points. There is no native CPU kernel: the CPU's few-row products go
through ``w16_gemm`` and oneDNN (engine/layers/quantization/unquantized.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._backend import has_no_data, num_multiprocessors, pdl_launch, use_triton
from ._pdl import pdl_wait
from ._validate import FLOAT_DTYPES, check_tensor

__all__ = ["skinny_gemm", "check_skinny_gemm_args", "skinny_gemm_config", "set_skinny_gemm_deep",
           "skinny_gemm_deep", "MAX_ROWS"]

# Rows the kernel unrolls: beyond a few, the weight tile is reused enough that a tiled GEMM (cuBLAS) wins.
MAX_ROWS = 8


@triton.jit
def _skinny_tile(acc, wide, w, x_ptr, stride_xm, norm_ptr, rstd, offs_m, offs_k, M, K,
                 HAS_NORM: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr):
    """One ``[BLOCK_N, BLOCK_K]`` weight tile ``w`` (fp32) times the rows' K block ``offs_k``: ``wide`` gains the
    elementwise products (one row), or ``acc`` each row's sums (several). Returns (acc, wide)."""
    k_mask = offs_k < K
    if HAS_NORM:
        g = tl.load(norm_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    for m in tl.static_range(BLOCK_M):
        row_mask = k_mask & (offs_k * 0 + m < M)
        xm = tl.load(x_ptr + m * stride_xm + offs_k, mask=row_mask, other=0.0).to(tl.float32)
        if GATED:   # as silu_and_mul: in fp32, rounded once to x's dtype
            up = tl.load(x_ptr + m * stride_xm + K + offs_k, mask=row_mask, other=0.0).to(tl.float32)
            xm = (xm / (1.0 + tl.exp(-xm)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        if HAS_NORM:
            rstd_m = tl.sum(tl.where(offs_m == m, rstd, 0.0), axis=0)
            xm = (xm * rstd_m * g).to(x_ptr.dtype.element_ty).to(tl.float32)
        if BLOCK_M == 1:
            wide += w * xm[None, :]
        else:
            part = tl.sum(w * xm[None, :], axis=1)   # [BLOCK_N]
            acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    return acc, wide


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K] ([M, 2K] with GATED)
    w_ptr,  # [N, K], rows contiguous
    bias_ptr,  # [N] (HAS_BIAS)
    norm_ptr,  # [K] (HAS_NORM)
    res_ptr,  # [M, N] (HAS_RESIDUAL): residual += product, in place
    out_ptr,  # [M, N] (not HAS_RESIDUAL)
    M, N, K,
    stride_xm: tl.int64,
    stride_wn: tl.int64,
    stride_rm: tl.int64,
    stride_om: tl.int64,
    eps,
    HAS_BIAS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    GATED: tl.constexpr,  # x is [M, 2K]: gate | up, and the product's input silu(gate) * up
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,  # M rounded up to a power of two (<= MAX_ROWS), the rows unrolled
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (_backend.programmatic_dependent_launch)
    PREFETCH: tl.constexpr,  # the first weight tile loaded before the prologue, then each tile one K block ahead
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn

    if USE_PDL or PREFETCH:   # the first weight tile in flight while the kernel ahead (or the prologue) runs
        first_k = tl.arange(0, BLOCK_K)
        w_first = tl.load(w_rows + first_k[None, :], mask=n_mask[:, None] & (first_k < K)[None, :], other=0.0)
    if USE_PDL:
        pdl_wait()   # x, the norm's input and the residual are the kernel ahead's outputs (no kernel writes weights)

    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM:   # the rows' reciprocal RMS, every program its own (x is small and in L2)
        sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                         mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
            sumsq += tl.sum(xs * xs, axis=1)
        rstd = 1.0 / tl.sqrt(sumsq / K + eps)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # one row: the products summed elementwise, across K once at the end (no reduction per block); several: unused
    wide = tl.zeros([BLOCK_N if BLOCK_M == 1 else 1, BLOCK_K if BLOCK_M == 1 else 1], dtype=tl.float32)
    if PREFETCH:   # two tiles in flight a program: the next K block's loads issued before this one's products
        w_next = w_first
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = w_next
            ahead = offs_k + BLOCK_K   # past K on the last block: masked, nothing read
            w_next = tl.load(w_rows + ahead[None, :], mask=n_mask[:, None] & (ahead < K)[None, :], other=0.0)
            acc, wide = _skinny_tile(acc, wide, w.to(tl.float32), x_ptr, stride_xm, norm_ptr, rstd, offs_m, offs_k,
                                     M, K, HAS_NORM, GATED, BLOCK_M)
    else:
        first = 0
        if USE_PDL:   # the prefetched tile, then the loop from the second
            acc, wide = _skinny_tile(acc, wide, w_first.to(tl.float32), x_ptr, stride_xm, norm_ptr, rstd, offs_m,
                                     first_k, M, K, HAS_NORM, GATED, BLOCK_M)
            first = BLOCK_K
        for k0 in range(first, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :],
                        other=0.0).to(tl.float32)
            acc, wide = _skinny_tile(acc, wide, w, x_ptr, stride_xm, norm_ptr, rstd, offs_m, offs_k, M, K, HAS_NORM,
                                     GATED, BLOCK_M)
    if BLOCK_M == 1:
        acc = tl.sum(wide, axis=1)[None, :]

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & n_mask[None, :]
    product = acc.to(x_ptr.dtype.element_ty)   # the linear's output as an unfused one returns it
    if HAS_RESIDUAL:
        res = res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :]
        summed = product.to(tl.float32) + tl.load(res, mask=mask, other=0.0).to(tl.float32)
        tl.store(res, summed.to(res_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], product.to(out_ptr.dtype.element_ty),
                 mask=mask)


def _env_deep() -> bool:
    value = os.environ.get("PAGEDKERNELS_SKINNY_DEEP", "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"PAGEDKERNELS_SKINNY_DEEP must be 0 or 1, got {value!r}")
    return value == "1"


# Whether skinny_gemm_config takes the deep launches (set_skinny_gemm_deep).
_deep = _env_deep()


def set_skinny_gemm_deep(on: bool) -> bool:
    """Whether skinny_gemm's Triton launches reach deeper into K a program (:func:`skinny_gemm_config`): tiles
    widened along K to up to 4096 values (a program of one or two rows reads its rows whole, in one or two memory
    round trips), the first loaded before the prologue (the RMSNorm's sums of squares, the SiLU-and-mul's loads), and
    where K still takes several tiles, two in flight (the kernel's PREFETCH: each K block's loads issued before the
    block ahead is multiplied). The grid of a small projection then asks for its whole weight at once: with the
    default tiles the 0.6B down projection's one row of 3072 a program runs as six 1 KiB round trips in a row, about
    1 MiB in flight over the device, a fraction of what an H200 needs in flight to stream at its bandwidth.
    Off by default (or ``PAGEDKERNELS_SKINNY_DEEP=1``) until a GPU has measured it. The same bits either way where
    the tiles are unchanged (prefetch alone); a wider tile sums in another order. Returns the previous setting. A
    CUDA graph keeps the launches it captured: capture again after changing it."""
    global _deep
    if not isinstance(on, bool):
        raise ValueError(f"on must be a bool, got {on!r}")
    previous, _deep = _deep, on
    return previous


def skinny_gemm_deep() -> bool:
    """The setting of :func:`set_skinny_gemm_deep`."""
    return _deep


# Values of a program's tile the deep launches widen BLOCK_K up to (4 warps: 32 a thread).
DEEP_TILE = 4096


def skinny_gemm_config(M: int, N: int, K: int, num_multiprocessors: int) -> tuple[int, int, int, bool]:
    """(BLOCK_N, BLOCK_K, num_warps, prefetch) for an ``[M, K] x [N, K]^T`` launch: enough programs for about four
    per SM (a program streams BLOCK_N weight rows; more of them in flight hide the memory latency), BLOCK_N between
    1 and 16 so a program's tile stays ~2-8K values, BLOCK_K up to 512 (a 16-bit row read in 1 KiB pieces). With
    :func:`set_skinny_gemm_deep`: BLOCK_K doubled while the tile stays within DEEP_TILE values and K's power of two,
    and prefetch (the kernel's PREFETCH: the first tile loaded before the prologue, the next one ahead where K takes
    more than one), with 8 warps from 4096 values."""
    block_n = 16
    while block_n > 1 and triton.cdiv(N, block_n) < 4 * num_multiprocessors:
        block_n //= 2
    block_k = min(512, max(64, triton.next_power_of_2(K)))
    if _deep:
        while block_k < triton.next_power_of_2(K) and 2 * block_n * block_k <= DEEP_TILE:
            block_k *= 2
    prefetch = _deep   # one tile too: loaded before the prologue's reads of x (the load ahead then reads nothing)
    # two tiles a program in registers: 8 warps from 4096 values (4 spilled on sm_80, the gated 4 x 1024)
    num_warps = 4 if block_n * block_k <= (2048 if prefetch else 4096) else 8
    return block_n, block_k, num_warps, prefetch


GATED = ("silu",)


def check_skinny_gemm_args(x, weight, bias=None, norm_weight=None, eps=None, residual=None, out=None, gated=None
                           ) -> tuple[int, int, int]:
    """Every check of :func:`skinny_gemm`'s arguments (none reads a tensor value). Returns (M, N, K)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last (K) dimension")
    M, K = x.shape
    if gated is not None:
        if gated not in GATED:
            raise ValueError(f"gated must be None or one of {GATED}, got {gated!r}")
        if norm_weight is not None:
            raise ValueError("gated and norm_weight exclude each other (one prologue)")
        if K % 2:
            raise ValueError(f"x must have shape [M, 2 * K] (gate | up) with gated, got {list(x.shape)}")
        K //= 2
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"x must have 1 to {MAX_ROWS} rows (skinny_gemm is for decode at small batch; a tiled GEMM "
                         f"serves more), got {M}")
    on_x = ("x", x)
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), like=on_x, shape=(None, K))
    if weight.stride(-1) != 1:
        raise ValueError("weight must be contiguous in its last (K) dimension")
    N = weight.shape[0]
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, like=on_x, shape=(N,))
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, ndim=1, dtypes=FLOAT_DTYPES, like=on_x, shape=(K,))
        if not norm_weight.is_contiguous():
            raise ValueError("norm_weight must be contiguous")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"eps must be a positive number with norm_weight, got {eps!r}")
    elif eps is not None:
        raise ValueError("eps is the RMSNorm prologue's: give it with norm_weight")
    if residual is not None:
        if out is not None:
            raise ValueError("out and residual exclude each other: with residual the product is added into it")
        check_tensor("residual", residual, ndim=2, dtypes=FLOAT_DTYPES, like=on_x, shape=(M, N))
        if residual.stride(-1) != 1:
            raise ValueError("residual must be contiguous in its last (N) dimension")
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=(x.dtype,), like=on_x, shape=(M, N))
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last (N) dimension")
    return M, N, K


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                norm_weight: torch.Tensor | None = None, eps: float | None = None, gated: str | None = None,
                residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` for 1 to :data:`MAX_ROWS` rows, optionally with an RMSNorm before it or a residual
    add after it (module docstring).

    Args:
        x: ``[M, K]`` fp32/fp16/bf16, last dimension contiguous, 1 <= M <= MAX_ROWS.
        weight: ``[N, K]`` in x's dtype, last dimension contiguous.
        bias: optional ``[N]``, added in fp32 before the product is rounded.
        norm_weight, eps: the RMSNorm applied to x's rows first (``x / sqrt(mean(x^2) + eps) * norm_weight``,
            rounded to x's dtype).
        gated: ``"silu"``: x is ``[M, 2K]`` (gate | up) and the product's input ``silu(gate) * up`` (rounded to
            x's dtype); not with ``norm_weight``.
        residual: optional ``[M, N]``: the product is added into it (in place) instead of returned.
        out: optional ``[M, N]`` in x's dtype (not with ``residual``).

    Returns ``residual`` when given, else the ``[M, N]`` product in x's dtype (``out`` when given).
    """
    M, N, K = check_skinny_gemm_args(x, weight, bias, norm_weight, eps, residual, out, gated)
    if residual is None and out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    result = residual if residual is not None else out
    if has_no_data(x, weight, bias, norm_weight, result) or N == 0:
        return result
    if use_triton(x):
        _skinny_triton(x, weight, bias, norm_weight, eps, residual, out, gated)
    else:
        _skinny_torch(x, weight, bias, norm_weight, eps, residual, out, gated)
    return result


def _skinny_triton(x, weight, bias, norm_weight, eps, residual, out, gated=None) -> None:
    M = x.shape[0]
    N, K = weight.shape
    block_n, block_k, num_warps, prefetch = skinny_gemm_config(M, N, K, num_multiprocessors(x.device))
    dummy = residual if residual is not None else out
    _skinny_gemm_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else dummy, norm_weight if norm_weight is not None else dummy,
        residual if residual is not None else dummy, out if out is not None else dummy,
        M, N, K, x.stride(0), weight.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0) if out is not None else 0,
        float(eps) if eps is not None else 0.0,
        HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None, GATED=gated is not None,
        HAS_RESIDUAL=residual is not None,
        BLOCK_M=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k, PREFETCH=prefetch, num_warps=num_warps,
        **pdl_launch(x.device))


def _skinny_torch(x, weight, bias, norm_weight, eps, residual, out, gated=None) -> None:
    """The PyTorch twin: float32 arithmetic, the kernel's rounding points."""
    xf = x.float()
    if gated is not None:
        gate, up = xf.chunk(2, dim=-1)
        xf = (gate / (1.0 + torch.exp(-gate)) * up).to(x.dtype).float()
    if norm_weight is not None:
        xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()).to(x.dtype).float()
    product = xf @ weight.float().t()
    if bias is not None:
        product += bias.float()
    product = product.to(x.dtype)
    if residual is not None:
        residual.copy_(product.float() + residual.float())
    else:
        out.copy_(product)
