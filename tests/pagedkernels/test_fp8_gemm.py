"""pk.fp8_gemm against float64: weight-only (x unquantized) on the CPU backends and Triton's fp8 format
of the wq kernel, with per-tensor and per-channel weight scales; on CUDA GPUs with fp8 tensor cores
(torch._scaled_mm) with the activation quantized per token or by a static scale, the reference
quantizing it the same way. quantize_fp8_weight's round trip.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import pagedkernels as pk
from pagedkernels.fp8_gemm import fp8_tensor_cores, quantize_activation_fp8
from tests.pagedkernels.test_quant_gemm import SUM_RTOL, skip_unsupported

fp8_module = importlib.import_module("pagedkernels.fp8_gemm")
wq_module = importlib.import_module("pagedkernels.wq_gemm")
BACKENDS = ["triton", "torch", "native"]
FP8 = torch.float8_e4m3fn


def _weight(N, K, per_channel, generator):
    w = torch.randn(N, K, generator=generator) * 0.05
    q, scale = pk.quantize_fp8_weight(w, per_channel=per_channel)
    dequantized = q.double() * (scale.double()[:, None] if per_channel else scale.double())
    return q, scale, dequantized


def _assert_close(out, x, weight, *, msg=""):
    got, xd = out.double().cpu(), x.double().cpu()
    excess = ((got - xd @ weight.t()).abs() - SUM_RTOL[out.dtype] * (xd.abs() @ weight.abs().t())).max().item()
    assert excess <= 0, f"{msg}: off by {excess:.3g} past the tolerance"


def _fp8_gpu(device):
    return device == "cuda" and fp8_tensor_cores(torch.device("cuda"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
@pytest.mark.parametrize("M,N,K", [(1, 40, 96), (5, 33, 160), (70, 48, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_weight_only(backend, per_channel, M, N, K, dtype, device):
    skip_unsupported(backend, dtype, device)
    if _fp8_gpu(device) and backend == "triton" and N % 16 == 0 and K % 16 == 0:
        pytest.skip("the fp8 GPU path quantizes the activation: test_fp8_tensor_cores covers it")
    gen = torch.Generator().manual_seed(M + N + K)
    q, scale, weight = _weight(N, K, per_channel, gen)
    x = torch.randn(M, K, generator=gen).to(dtype)
    with pk.use_backend(backend):
        out = pk.fp8_gemm(x.to(device), q.to(device), scale.to(device))
    assert out.shape == (M, N) and out.dtype == dtype
    _assert_close(out, x, weight, msg=f"{backend} {dtype}")


@pytest.mark.parametrize("static", [False, True], ids=["per_token", "static"])
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_tensor_cores(static, per_channel, dtype, device):
    if not _fp8_gpu(device):
        pytest.skip("needs a CUDA GPU with fp8 tensor cores (compute capability 8.9+)")
    gen = torch.Generator().manual_seed(3)
    q, scale, weight = _weight(64, 128, per_channel, gen)
    x = (torch.randn(5, 128, generator=gen) * 3).to(dtype).to(device)
    act_scale = torch.tensor([0.02], device=device) if static else None
    out = pk.fp8_gemm(x, q.to(device), scale.to(device), act_scale=act_scale)
    x_q, scale_a = quantize_activation_fp8(x, act_scale)
    x_used = x_q.double().cpu() * scale_a.double().cpu()
    _assert_close(out, x_used, weight, msg="scaled_mm")
    # the activation really was quantized: the unquantized product differs by more than the rounding
    assert (out.double().cpu() - x.double().cpu() @ weight.t()).abs().max() > 1e-3


def test_triton_path_is_the_wq_kernel(monkeypatch, triton_device):
    """Without fp8 tensor cores, or (here, on any device) with N not a multiple of 16 that torch._scaled_mm
    needs, the Triton backend runs the weight-only kernel's fp8 format."""
    seen = []
    real = wq_module._wq_gemm_triton
    monkeypatch.setattr(wq_module, "_wq_gemm_triton", lambda *a: seen.append(a[4]) or real(*a))
    gen = torch.Generator().manual_seed(1)
    q, scale, weight = _weight(24, 64, True, gen)
    x = torch.randn(2, 64, generator=gen)
    with pk.use_backend("triton"):
        out = pk.fp8_gemm(x.to(triton_device), q.to(triton_device), scale.to(triton_device))
    assert seen == [wq_module.FORMAT_FP8]
    _assert_close(out, x, weight, msg="wq fp8")


@pytest.mark.parametrize("per_channel", [True, False])
def test_quantize_fp8_weight(per_channel):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(12, 80, generator=gen)
    q, scale = pk.quantize_fp8_weight(w, per_channel=per_channel)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == ((12,) if per_channel else (1,))
    back = q.float() * (scale[:, None] if per_channel else scale)
    # e4m3 keeps 3 mantissa bits: within 2**-4 relative, and the largest magnitude maps to 448
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + (scale[:, None] if per_channel else scale) * 2 ** -9).all()
    amax = q.float().abs().amax(dim=1) if per_channel else q.float().abs().amax()
    assert (amax == 448).all()


INVALID = [
    (dict(weight=torch.zeros(8, 64)), "weight"),
    (dict(weight=torch.zeros(8, 32, dtype=FP8)), "weight"),
    (dict(weight_scale=torch.ones(3)), "weight_scale"),
    (dict(weight_scale=torch.ones(8, 2)), "weight_scale"),
    (dict(weight_scale=torch.ones(1, dtype=torch.float16)), "weight_scale"),
    (dict(act_scale=torch.ones(2)), "act_scale"),
    (dict(act_scale=torch.ones(1, dtype=torch.float64)), "act_scale"),
    (dict(x=torch.randn(2, 64).to(torch.int32)), "x"),
    (dict(out=torch.empty(2, 7)), "out"),
]


@pytest.mark.parametrize("changes,name", INVALID, ids=[f"{n}-{i}" for i, (_, n) in enumerate(INVALID)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_arguments(changes, name, backend, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a kernel was reached with invalid arguments")

    monkeypatch.setattr(wq_module, "_wq_gemm_triton", fail)
    args = dict(x=torch.randn(2, 64), weight=torch.zeros(8, 64, dtype=FP8), weight_scale=torch.ones(8))
    args.update(changes)
    with pk.use_backend(backend), pytest.raises(ValueError, match=rf"\b{name}\b"):
        pk.fp8_gemm(args["x"], args["weight"], args["weight_scale"], act_scale=args.get("act_scale"),
                    out=args.get("out"))
