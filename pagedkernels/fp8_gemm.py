"""FP8 (e4m3) weight GEMM: ``out = x @ (weight * weight_scale)^T``.

Checkpoints in vLLM's / llm-compressor's fp8 format store ``weight`` as ``torch.float8_e4m3fn``
[N, K] with a float32 ``weight_scale`` per tensor or per output channel, and for static activation
schemes an ``input_scale`` (per tensor); ``quantization="fp8"`` on load makes the same from a float
weight (``quantize_fp8_weight``).

Where it runs:

- CUDA (the ``auto`` / ``triton`` backends) with fp8 tensor cores (compute capability 8.9+: Ada,
  Hopper) and K, N multiples of 16: ``torch._scaled_mm``. The activation is quantized to e4m3 too:
  with ``act_scale`` (the checkpoint's static input scale) per tensor, else dynamically per token
  (scale = max|x[m]| / 448, computed on the device, no host sync). Per-tensor weight and activation scales use _scaled_mm's tensor-wise scaling
  (out in x's dtype); any per-channel or per-token scale its row-wise scaling, whose output is bf16
  (copied into x's dtype).
- Elsewhere on CUDA (Ampere) and for the ``triton`` backend: weight-only, x unquantized: the int4/int8
  kernel of ``wq_gemm`` with its fp8 format, which converts e4m3 codes in registers (Ampere has no fp8
  conversions in Triton).
- CPU and the ``torch`` backend: weight-only too, ``x @ (weight.float() * scale)^T`` (the PyTorch
  twin); bench/quant_cpu.py measures it against torch._scaled_mm on the CPU.

So the activation is quantized exactly where the hardware multiplies fp8; ``act_scale`` is accepted
(and checked) everywhere and used there.
"""

from __future__ import annotations


import torch

from ._backend import device_capability, has_no_data, use_triton
from ._fp8 import FP8_DTYPE, FP8_MAX
from ._validate import FLOAT_DTYPES, check_tensor

__all__ = ["fp8_gemm", "check_fp8_gemm_args", "quantize_fp8_weight", "quantize_activation_fp8", "fp8_tensor_cores"]


def check_fp8_gemm_args(x, weight, weight_scale, act_scale=None, out=None) -> tuple[int, int, int, bool]:
    """Every check of :func:`fp8_gemm`'s arguments that reads no tensor value. Returns (M, N, K, whether
    the weight scale is per channel)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last (K) dimension")
    on_x = ("x", x)
    M, K = x.shape
    check_tensor("weight", weight, ndim=2, dtypes=(FP8_DTYPE,), like=on_x, shape=(None, K))
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    N = weight.shape[0]
    check_tensor("weight_scale", weight_scale, dtypes=(torch.float32,), like=on_x)
    if weight_scale.numel() not in (1, N) or weight_scale.dim() > 2 or \
            (weight_scale.dim() == 2 and weight_scale.shape[1] != 1):
        raise ValueError(f"weight_scale must hold 1 (per tensor) or N = {N} (per channel: [N] or [N, 1]) "
                         f"values, got shape {list(weight_scale.shape)}")
    if act_scale is not None:
        check_tensor("act_scale", act_scale, dtypes=(torch.float32,), like=on_x)
        if act_scale.numel() != 1:
            raise ValueError(f"act_scale must be one value (a static per-tensor scale), got shape "
                             f"{list(act_scale.shape)}")
    if out is not None:
        check_tensor("out", out, dtypes=(x.dtype,), like=on_x, shape=(M, N))
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last (N) dimension")
    return M, N, K, weight_scale.numel() == N and N > 1


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` multiplies fp8 in hardware (CUDA compute capability 8.9+)."""
    return device.type == "cuda" and device_capability(device) >= (8, 9)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
             act_scale: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale)^T`` for an e4m3 weight (see the module docstring for where the
    activation is quantized too).

    Args:
        x: ``[M, K]`` fp16/bf16/fp32, last dimension contiguous.
        weight: ``torch.float8_e4m3fn`` ``[N, K]``, contiguous.
        weight_scale: float32, one value (per tensor: ``[]``, ``[1]``) or N (per channel: ``[N]``, ``[N, 1]``).
        act_scale: None (dynamic per-token activation scales on fp8 GPUs) or a float32 one-value tensor
            (the checkpoint's static input scale).
        out: optional ``[M, N]`` in x's dtype, last dimension contiguous.

    Returns ``[M, N]`` in x's dtype (``out`` when given).
    """
    M, N, K, per_channel = check_fp8_gemm_args(x, weight, weight_scale, act_scale, out)
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if has_no_data(x, weight, weight_scale, act_scale, out) or M == 0 or N == 0:
        return out
    if use_triton(x):
        if x.is_cuda and fp8_tensor_cores(x.device) and K % 16 == 0 and N % 16 == 0:
            _scaled_mm(x, weight, weight_scale, act_scale, per_channel, out)
        else:
            from .wq_gemm import FORMAT_FP8, _wq_gemm_triton

            scales = weight_scale.reshape(-1, 1) if per_channel else weight_scale.reshape(1, 1)
            _wq_gemm_triton(x, weight.view(torch.uint8), scales.contiguous(), None, FORMAT_FP8, K, out)
    else:
        scale = weight_scale.reshape(-1, 1) if per_channel else weight_scale.reshape(())
        out.copy_(x.float() @ (weight.float() * scale).t())
    return out


def quantize_activation_fp8(x: torch.Tensor, act_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x, float32 scale): per tensor with ``act_scale``, else per token ([M, 1], max|x[m]| / 448,
    floored so an all-zero row keeps a finite scale). The tests reproduce this to build the reference."""
    if act_scale is not None:
        scale = act_scale.reshape(()).float()
    else:
        scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _scaled_mm(x, weight, weight_scale, act_scale, per_channel, out) -> None:
    x_q, scale_a = quantize_activation_fp8(x, act_scale)
    if scale_a.dim() == 0 and not per_channel:
        result = torch._scaled_mm(x_q, weight.t(), scale_a=scale_a, scale_b=weight_scale.reshape(()).float(),
                                  out_dtype=x.dtype)
    else:  # row-wise scaling: [M, 1] and [1, N]
        M, N = out.shape
        scale_a = scale_a.reshape(-1, 1).expand(M, 1).contiguous()
        scale_b = weight_scale.reshape(1, -1).expand(1, N).contiguous()
        result = torch._scaled_mm(x_q, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    out.copy_(result)


def quantize_fp8_weight(weight: torch.Tensor, *, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A float ``[N, K]`` weight as (``float8_e4m3fn`` [N, K], float32 scale [N] or [1]): scale = max|w| /
    448 per output channel (or for the whole tensor), the weight divided by it and rounded to nearest
    even. For ``quantization="fp8"`` on load."""
    w = weight.float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    scale = (amax / FP8_MAX).clamp_min(1e-12)
    q = (w / (scale[:, None] if per_channel else scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale
