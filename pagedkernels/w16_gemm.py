"""GEMM with a 16-bit float weight and float32 arithmetic: ``out = x @ W^T`` for W bfloat16 or float16.

Every bf16 or fp16 value is exactly a float32, so this is the float32 product of the same weight, reading half
its bytes. That is what a decode step of a float32 model on a CPU is bound by (a single row reads every
weight once and does two FLOPs per value), and the checkpoints of most models are bf16: their float32
weights are bf16 values widened. The engine keeps such weights in 16 bits next to oneDNN's float32 copy and
multiplies the few-row products with this op (``engine/layers/quantization/unquantized.py``).

The weight is packed once (:func:`pack_w16`) in panels of :data:`PANEL` output columns, each panel's K rows
of 32 values back to back::

    packed[p, k, c] = W[PANEL * p + c, k]        (columns past N are zero)

The native kernel vectorizes over a panel's outputs (per k: widen its 32 weights once, then one broadcast and
FMA per activation row and vector; no horizontal sums), and each thread reads its panels as one sequential
stream. On a 2-core AMD EPYC (AVX-512), with the weights cold as in a decode step, it ran 2.5-4x faster than
oneDNN's prepacked float32 product at one row and kept level or ahead up to 48 rows at the shapes of SmolLM2's
layers.

A bf16 model on the CPU multiplies its decode rows the same way: bf16 activations times the packed bf16 weight,
the float32 product of the values rounded once to bf16. With AVX512-BF16 (Cooper Lake, Xeons since Sapphire
Rapids, AMD Zen 4/5) the kernel takes two k at a time in ``vdpbf16ps`` pair dot products, x never widened;
elsewhere x's rows are widened to float32 once per call and go through the float32 kernel.

Backends:

- Native (CPU): ``csrc/w16_gemm_cpu.c``, AVX-512 / AVX2 / NEON through vector extensions, float32
  accumulation, parallel over panels; x and out float32, bfloat16 or float16.
- PyTorch twin (CUDA, the ``torch`` backend): the weight unpacked and widened to float32, ``x.float() @ W^T``.
  There is no Triton kernel: on a GPU a 16-bit model runs 16-bit GEMMs.
"""

from __future__ import annotations

import torch

from . import _huge_pages, _native
from ._backend import has_no_data, use_native
from ._validate import FLOAT_DTYPES, check_tensor

__all__ = ["w16_gemm", "pack_w16", "unpack_w16", "check_w16_gemm_args", "W16_DTYPES", "PANEL"]

W16_DTYPES = (torch.bfloat16, torch.float16)
PANEL = 32


def _packed_shape(n: int, k: int) -> tuple[int, int, int]:
    return (-(-n // PANEL), k, PANEL)


def pack_w16(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (bf16/fp16) in the packed layout of the module docstring: ``[ceil(N / 32), K, 32]``,
    same dtype and device, contiguous."""
    check_tensor("weight", weight, ndim=2, dtypes=W16_DTYPES)
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    panelled = padded.view(panels, PANEL, k).transpose(1, 2)
    if weight.device.type != "cpu":
        return panelled.contiguous()
    # On the CPU a decode step streams the whole weight: huge pages where the system gives them (_huge_pages).
    return _huge_pages.empty(panelled.shape, weight.dtype).copy_(panelled)


def unpack_w16(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The ``[n, K]`` weight a :func:`pack_w16` result holds."""
    panels, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * PANEL, k)[:n]


def check_w16_gemm_args(x, packed, n, out=None) -> tuple[int, int, int]:
    """Every check of :func:`w16_gemm`'s arguments (none reads a tensor value). Returns (M, N, K)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last (K) dimension")
    on_x = ("x", x)
    M, K = x.shape
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int (the weight's rows), got {n!r}")
    check_tensor("packed", packed, ndim=3, dtypes=W16_DTYPES, like=on_x)
    if tuple(packed.shape) != _packed_shape(n, K):
        raise ValueError(f"packed must be pack_w16 of an [n={n}, K={K}] weight: shape {list(_packed_shape(n, K))}, "
                         f"got {list(packed.shape)}")
    if not packed.is_contiguous():
        raise ValueError("packed must be contiguous")
    if out is not None:
        check_tensor("out", out, dtypes=(x.dtype,), like=on_x, shape=(M, n))
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last (N) dimension")
    return M, n, K


def w16_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T`` for the weight ``W [n, K]`` that ``packed`` (:func:`pack_w16`) holds.

    Args:
        x: ``[M, K]`` fp32/fp16/bf16, last dimension contiguous.
        packed: ``pack_w16(W)`` for a bf16/fp16 ``W [n, K]``.
        n: W's rows (the panels round them up to a multiple of 32).
        out: optional ``[M, n]`` in x's dtype, last dimension contiguous.

    Returns ``[M, n]`` in x's dtype (``out`` when given): the float32 product of x and W's values (exact
    widening, float32 accumulation), rounded to x's dtype.
    """
    M, N, K = check_w16_gemm_args(x, packed, n, out)
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if has_no_data(x, packed, out) or M == 0 or N == 0:
        return out
    if use_native(x):
        _native.w16_gemm(x, packed, N, out)
    else:
        out.copy_(x.float() @ unpack_w16(packed, N).float().t())
    return out
