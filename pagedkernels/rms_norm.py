"""RMSNorm and fused residual-add + RMSNorm."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _native
from ._backend import has_no_data, use_native, use_triton
from ._validate import FLOAT_DTYPES, check_same_dtype, check_tensor

# Largest row kept whole in registers (fp32): 8192 elements over 16 warps is 16 per thread. Longer
# rows are processed in chunks of _CHUNK over two passes (sum of squares, then scale and store).
_MAX_FUSED_SIZE = 8192
_CHUNK = 4096


@triton.jit
def _load_row_chunk(x_row, res_row, offs, mask, HAS_RESIDUAL: tl.constexpr):
    """x[offs] in fp32; with HAS_RESIDUAL, first residual[offs] = x + residual rounded to the
    residual's dtype (stored back), and that rounded sum is returned."""
    v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        summed = v + tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
        summed = summed.to(res_row.dtype.element_ty)
        tl.store(res_row + offs, summed, mask=mask)
        v = summed.to(tl.float32)
    return v


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_rows, hidden]  input; with HAS_RESIDUAL also the output (written in place)
    residual_ptr,  # [num_rows, hidden]  HAS_RESIDUAL only: becomes x + residual
    weight_ptr,  # [hidden]
    out_ptr,  # [num_rows, hidden]
    stride_x_row: tl.int64,
    stride_res_row: tl.int64,
    stride_out_row: tl.int64,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ONE_TILE: tl.constexpr,  # the whole row fits in one BLOCK (kept in registers)
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,  # cdiv(hidden, BLOCK); a constexpr so loop bounds are compile-time
):
    """One program per row, fp32 accumulation.

    rms_norm:            y = x / sqrt(mean(x^2) + eps) * w
    fused_add_rms_norm:  r' = round_to_dtype(r)(x + r)     (stored back into r)
                         y  = r' / sqrt(mean(r'^2) + eps) * w
    The sum is rounded to the residual's dtype before normalizing, so the result matches an unfused
    ``residual = x + residual; y = rms_norm(residual)`` in that dtype. Products with w are in fp32;
    y is rounded once, to the output dtype.
    """
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x_row
    res_row = residual_ptr + row * stride_res_row
    out_row = out_ptr + row * stride_out_row

    if ONE_TILE:
        offs = tl.arange(0, BLOCK)  # [BLOCK]
        mask = offs < hidden
        v = _load_row_chunk(x_row, res_row, offs, mask, HAS_RESIDUAL)
        rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / hidden + eps)
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + offs, (v * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Pass 1: sum of squares (and the residual add, stored rounded).
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for chunk in range(NUM_CHUNKS):
            offs = chunk * BLOCK + tl.arange(0, BLOCK)
            mask = offs < hidden
            v = _load_row_chunk(x_row, res_row, offs, mask, HAS_RESIDUAL)
            acc += v * v
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / hidden + eps)
        if HAS_RESIDUAL:
            tl.debug_barrier()  # make pass 1's residual stores visible to every thread of the program
        # Pass 2: normalize. The source is the rounded residual when there is one.
        src_row = res_row if HAS_RESIDUAL else x_row
        for chunk in range(NUM_CHUNKS):
            offs = chunk * BLOCK + tl.arange(0, BLOCK)
            mask = offs < hidden
            v = tl.load(src_row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + offs, (v * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x2d, residual2d, weight, out2d, eps: float) -> None:
    hidden = x2d.shape[1]
    one_tile = hidden <= _MAX_FUSED_SIZE
    block = triton.next_power_of_2(hidden) if one_tile else _CHUNK
    # About 16 fp32 values per thread: 4 warps up to 2048 elements, 8 up to 4096, 16 beyond.
    num_warps = 4 if block <= 2048 else 8 if block <= 4096 else 16
    res = residual2d if residual2d is not None else x2d
    _rms_norm_kernel[(x2d.shape[0],)](
        x2d, res, weight, out2d,
        x2d.stride(0), res.stride(0), out2d.stride(0),
        hidden, eps,
        HAS_RESIDUAL=residual2d is not None, ONE_TILE=one_tile, BLOCK=block,
        NUM_CHUNKS=triton.cdiv(hidden, block), num_warps=num_warps,
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., hidden]`` as ``[num_rows, hidden]`` without a copy when the strides allow it."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1])


def _check_common(x: object, weight: object, eps: float) -> int:
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have shape [..., hidden] with hidden > 0, got {list(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last (hidden) dimension")
    hidden = x.shape[-1]
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, like=("x", x), shape=(hidden,))
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    return hidden


def check_rms_norm_args(x, weight, eps, out=None) -> None:
    """Every check of :func:`rms_norm`'s arguments that reads no tensor value, shared with its fake
    implementation."""
    _check_common(x, weight, eps)
    if out is not None:
        check_tensor("out", out, like=("x", x), shape=tuple(x.shape))
        check_same_dtype("out", out, "x", x)
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last (hidden) dimension")


def check_fused_add_rms_norm_args(x, residual, weight, eps) -> None:
    """Every check of :func:`fused_add_rms_norm`'s arguments that reads no tensor value, shared with its
    fake implementation."""
    _check_common(x, weight, eps)
    check_tensor("residual", residual, dtypes=FLOAT_DTYPES, like=("x", x), shape=tuple(x.shape))
    if residual.stride(-1) != 1:
        raise ValueError("residual must be contiguous in its last (hidden) dimension")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x / sqrt(mean(x^2, -1) + eps) * weight`` with fp32 accumulation.

    x: ``[..., hidden]`` fp16/bf16/fp32, any leading dims, rows may be strided (last dim contiguous).
    weight: ``[hidden]``, any float dtype. out: optional tensor of x's shape and dtype.
    Returns y (``out`` when given), x's dtype.
    """
    check_rms_norm_args(x, weight, eps, out)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if has_no_data(x, weight, out) or x.numel() == 0:
        return out  # nothing to compute (meta or fake tensors: checked only, the fake implementation)

    on_triton = use_triton(x)
    if on_triton or use_native(x):
        out2d = _rows(out)
        if on_triton:
            _launch(_rows(x), None, weight, out2d, float(eps))
        else:
            _native.rms_norm(_rows(x), None, weight, out2d, float(eps))
        if not _same_storage(out2d, out):  # out's leading dims could not be flattened
            out.copy_(out2d.view(out.shape))
        return out

    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    out.copy_(y)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm, both in place, as in vLLM's ``fused_add_rms_norm``.

    ``residual <- x + residual`` (rounded to residual's dtype), then
    ``x <- rms_norm(residual)`` (rounded to x's dtype): the output overwrites x, so no tensor is
    allocated and the caller's hidden-state buffer is reused. Returns ``(x, residual)``.

    x, residual: ``[..., hidden]`` of the same shape (float dtypes, may differ, e.g. an fp32
    residual), rows may be strided (last dim contiguous). weight: ``[hidden]``.
    """
    check_fused_add_rms_norm_args(x, residual, weight, eps)
    if has_no_data(x, residual, weight) or x.numel() == 0:
        return x, residual  # nothing to compute (meta or fake tensors: checked only, the fake implementation)

    on_triton = use_triton(x)
    if on_triton or use_native(x):
        x2d, res2d = _rows(x), _rows(residual)
        if on_triton:
            _launch(x2d, res2d, weight, x2d, float(eps))
        else:
            _native.rms_norm(x2d, res2d, weight, x2d, float(eps))
        # _rows copies only when the leading dims cannot be flattened; write results back then.
        if not _same_storage(x2d, x):
            x.copy_(x2d.view(x.shape))
        if not _same_storage(res2d, residual):
            residual.copy_(res2d.view(residual.shape))
        return x, residual

    summed = (x.float() + residual.float()).to(residual.dtype)
    residual.copy_(summed)
    sf = summed.float()
    x.copy_(sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * weight.float())
    return x, residual


def _same_storage(view: torch.Tensor, t: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
