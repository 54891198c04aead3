"""Gated activation for SwiGLU MLPs: ``silu(gate) * up`` on a fused gate_up projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _native
from ._backend import has_no_data, use_native, use_triton
from ._validate import FLOAT_DTYPES, check_same_dtype, check_tensor

_BLOCK = 1024  # elements per program: 4 warps x 8 contiguous elements per thread (16-byte fp16 accesses)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_rows, 2 * d]: gate in [:d], up in [d:]
    out_ptr,  # [num_rows, d]
    stride_x_row: tl.int64,
    stride_out_row: tl.int64,
    d,
    BLOCK: tl.constexpr,
):
    """out = silu(g) * u = g / (1 + exp(-g)) * u, computed in fp32, rounded once."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < d
    x_row = x_ptr + row * stride_x_row
    gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + d + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def check_silu_and_mul_args(x, out=None) -> tuple[int, ...]:
    """Every check of :func:`silu_and_mul`'s arguments that reads no tensor value, shared with its fake
    implementation. Returns the output's shape."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must have shape [..., 2 * d], got {list(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last dimension")
    out_shape = (*x.shape[:-1], x.shape[-1] // 2)
    if out is not None:
        check_tensor("out", out, like=("x", x), shape=out_shape)
        check_same_dtype("out", out, "x", x)
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last dimension")
    return out_shape


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]``.

    x: ``[..., 2 * d]`` fp16/bf16/fp32 (last dim contiguous). out: optional ``[..., d]`` of x's
    dtype. Returns ``[..., d]`` in x's dtype; computed in fp32.
    """
    out_shape = check_silu_and_mul_args(x, out)
    d = out_shape[-1]
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    if has_no_data(x, out) or out.numel() == 0:
        return out  # nothing to compute (meta or fake tensors: checked only, the fake implementation)

    on_triton = use_triton(x)
    if on_triton or use_native(x):
        x2d = x.reshape(-1, 2 * d)  # a view unless x's leading dims cannot be flattened
        try:
            out2d = out.view(-1, d)
        except RuntimeError:
            out2d = torch.empty(x2d.shape[0], d, dtype=x.dtype, device=x.device)
        if on_triton:
            grid = (x2d.shape[0], triton.cdiv(d, _BLOCK))
            _silu_and_mul_kernel[grid](x2d, out2d, x2d.stride(0), out2d.stride(0), d, BLOCK=_BLOCK)
        else:
            _native.silu_and_mul(x2d, out2d)
        if out2d.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
            out.copy_(out2d.view(out_shape))
        return out

    gate, up = x[..., :d], x[..., d:]
    if x.dtype == torch.float32:  # one temporary, product written straight into out
        return torch.mul(torch.nn.functional.silu(gate), up, out=out)
    out.copy_(torch.nn.functional.silu(gate.float()) * up.float())
    return out
