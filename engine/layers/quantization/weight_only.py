"""What GPTQ and AWQ share once loaded: the weight in pagedkernels' canonical int4/int8 layout
(``pagedkernels.quant_formats``) multiplied by ``pagedkernels.wq_gemm`` (its custom op under torch.compile)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.quantization.base import replace_param
from pagedkernels.quant_formats import WQWeight
from pagedkernels.wq_gemm import check_wq_perm


def install_wq(layer: nn.Module, wq: WQWeight, *, drop: tuple[str, ...], pad_perm: torch.Tensor | None = None) -> None:
    """Replace the checkpoint's parameters (``drop``) with the canonical ones: ``qweight`` (uint8), ``scales``,
    ``zeros`` (float zero points, or None: symmetric), ``perm`` (act-order column order, or None), and
    ``pad_perm`` (see :func:`wq_apply`; built by gptq.py's regrouping, in range by construction). ``perm``'s column
    indices are checked here, once: wq_gemm reads no tensor value on the host, so that a quantized model's decode
    step can be a CPU graph (act-order GPTQ decoded eagerly while wq_gemm checked them on every call)."""
    if wq.perm is not None:
        check_wq_perm(wq.perm, wq.qweight.shape[1] * (8 // wq.bits))
    for name in drop:
        replace_param(layer, name, None)
        delattr(layer, name)
    replace_param(layer, "qweight", wq.qweight.contiguous())
    replace_param(layer, "scales", wq.scales.contiguous())
    replace_param(layer, "zeros", None if wq.zeros is None else wq.zeros.contiguous())
    replace_param(layer, "perm", wq.perm)
    replace_param(layer, "pad_perm", pad_perm)
    layer.wq_bits, layer.wq_group_size = wq.bits, wq.group_size


def wq_apply(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for a layer :func:`install_wq` set up. ``pad_perm`` (act-order GPTQ in a
    row-parallel layer, see gptq.py) gathers x's columns with a zero column appended at index K."""
    from engine.layers import pk_ops

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if layer.pad_perm is not None:
        x2 = F.pad(x2, (0, 1)).index_select(1, layer.pad_perm)
    out = pk_ops().wq_gemm(x2, layer.qweight, layer.scales, layer.zeros, bits=layer.wq_bits,
                           group_size=layer.wq_group_size, perm=layer.perm)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], out.shape[-1])


def scale_dtype_for(params_dtype: torch.dtype, checkpoint_dtype: torch.dtype) -> torch.dtype:
    """Scales and zero points in float32 when the model runs in float32 (exact from fp16/bf16), else in
    the model dtype."""
    return torch.float32 if params_dtype == torch.float32 else checkpoint_dtype


def check_kernel_shape(prefix: str, fmt: str, input_size_per_partition: int, group_size: int) -> None:
    """wq_gemm's shape rules, as a load-time error naming the layer: K a multiple of 32, groups of a
    multiple of 32 that divide K."""
    K = input_size_per_partition
    if K % 32:
        raise ValueError(f"{fmt} layer {prefix or '(unnamed)'}: {K} input features per rank are not a multiple of "
                         f"32, which the quantized GEMM needs")
    if group_size != -1 and K % group_size:
        raise ValueError(f"{fmt} layer {prefix or '(unnamed)'}: group_size {group_size} does not divide its {K} "
                         f"input features per rank (tensor parallelism splits groups whole)")
