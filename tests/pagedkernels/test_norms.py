"""rms_norm and fused_add_rms_norm against a float64 reference, every backend."""

import importlib

import pytest
import torch

import pagedkernels as pk

# The module, not the function of the same name that pagedkernels re-exports.
rms_norm_module = importlib.import_module("pagedkernels.rms_norm")

BACKENDS = ["triton", "torch", "native"]
# (dtype, atol, rtol) for the normalized output vs float64: a few ulps of the output dtype.
TOLERANCES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 1e-3, 2e-3),
    (torch.bfloat16, 1e-2, 1.6e-2),
]
# 123 and 769: odd, not powers of two; 9000 > the kernel's single-tile limit (two-pass chunk loop).
HIDDEN_SIZES = [123, 769, 9000]
EPS = 1e-6


def skip_bf16_interpreter(backend: str, dtype: torch.dtype, device: str) -> None:
    if backend == "triton" and dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 arithmetic is wrong in the Triton interpreter; tested on CUDA")


def rms_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    x, weight = x.double().cpu(), weight.double().cpu()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def randn(*shape, generator, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=generator) * scale).to(dtype=dtype, device=device)


def test_chunked_path_is_exercised():
    assert max(HIDDEN_SIZES) > rms_norm_module._MAX_FUSED_SIZE


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_rms_norm(backend, device, dtype, atol, rtol, hidden):
    skip_bf16_interpreter(backend, dtype, device)
    g = torch.Generator().manual_seed(hidden)
    # Rows with a stride wider than hidden (a slice of a bigger buffer) whose padding is NaN.
    buffer = torch.full((2, 3, hidden + 5), float("nan"), dtype=dtype, device=device)
    buffer[..., :hidden] = randn(2, 3, hidden, generator=g, dtype=dtype, device=device, scale=3.0)
    x = buffer[..., :hidden]
    weight = randn(hidden, generator=g, dtype=dtype, device=device)
    x_before = x.clone()
    with pk.use_backend(backend):
        y = pk.rms_norm(x, weight, EPS)
    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y.cpu().double(), rms_ref(x, weight), atol=atol, rtol=rtol)
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm_out_and_fp32_weight(backend, device):
    g = torch.Generator().manual_seed(1)
    x = randn(5, 200, generator=g, dtype=torch.float16, device=device)
    weight = randn(200, generator=g, dtype=torch.float32, device=device)
    out = torch.full_like(x, float("nan"))
    with pk.use_backend(backend):
        y = pk.rms_norm(x, weight, EPS, out=out)
    assert y is out
    torch.testing.assert_close(out.cpu().double(), rms_ref(x, weight), atol=1e-3, rtol=2e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_fused_add_rms_norm(backend, device, dtype, atol, rtol, hidden):
    skip_bf16_interpreter(backend, dtype, device)
    g = torch.Generator().manual_seed(100 + hidden)
    x = randn(4, hidden, generator=g, dtype=dtype, device=device, scale=2.0)
    residual = randn(4, hidden, generator=g, dtype=dtype, device=device)
    weight = randn(hidden, generator=g, dtype=dtype, device=device)
    # The unfused computation in the storage dtype: residual rounded, then normalized.
    residual_ref = (x.double() + residual.double()).to(dtype)
    out_ref = rms_ref(residual_ref, weight)
    x_ptr, residual_ptr = x.data_ptr(), residual.data_ptr()
    with pk.use_backend(backend):
        out, new_residual = pk.fused_add_rms_norm(x, residual, weight, EPS)
    assert out.data_ptr() == x_ptr and new_residual.data_ptr() == residual_ptr  # both in place
    if dtype == torch.bfloat16:
        torch.testing.assert_close(new_residual, residual_ref, atol=0, rtol=1e-2)
    else:  # the sum of two fp16/fp32 values rounds identically via fp32 and via float64
        assert torch.equal(new_residual, residual_ref)
    torch.testing.assert_close(out.cpu().double(), out_ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_add_rms_norm_fp32_residual_and_strided_rows(backend, device):
    """fp16 hidden states with an fp32 residual; x's rows are strided, and 3-D views whose leading
    dims cannot be flattened are still updated in place."""
    g = torch.Generator().manual_seed(7)
    hidden = 96
    buffer = randn(3, 2, hidden + 16, generator=g, dtype=torch.float16, device=device)
    x = buffer.transpose(0, 1)[..., :hidden]  # [2, 3, hidden], leading dims not flattenable
    residual = randn(2, 3, hidden, generator=g, dtype=torch.float32, device=device)
    weight = randn(hidden, generator=g, dtype=torch.float16, device=device)
    residual_ref = (x.double() + residual.double()).float()
    tail_before = buffer[..., hidden:].clone()
    with pk.use_backend(backend):
        out, new_residual = pk.fused_add_rms_norm(x, residual, weight, EPS)
    assert out is x and new_residual is residual
    assert torch.equal(residual, residual_ref)
    torch.testing.assert_close(x.cpu().double(), rms_ref(residual_ref, weight), atol=1e-3, rtol=2e-3)
    assert torch.equal(buffer[..., hidden:], tail_before)


def test_validation_errors():
    x = torch.randn(4, 64)
    w = torch.randn(64)
    cases = [
        (lambda: pk.rms_norm(x.long(), w, EPS), "x"),
        (lambda: pk.rms_norm(x.t().contiguous().t(), w, EPS), "x"),
        (lambda: pk.rms_norm(x, torch.randn(63), EPS), "weight"),
        (lambda: pk.rms_norm(x, w.long(), EPS), "weight"),
        (lambda: pk.rms_norm(x, w, 0.0), "eps"),
        (lambda: pk.rms_norm(x, w, EPS, out=torch.empty(4, 64, dtype=torch.float16)), "out"),
        (lambda: pk.rms_norm(x, w, EPS, out=torch.empty(4, 63)), "out"),
        (lambda: pk.fused_add_rms_norm(x, torch.randn(4, 63), w, EPS), "residual"),
        (lambda: pk.fused_add_rms_norm(x, torch.randn(4, 64).long(), w, EPS), "residual"),
        (lambda: pk.fused_add_rms_norm(x, "residual", w, EPS), "residual"),
    ]
    for call, name in cases:
        with pytest.raises(ValueError, match=name):
            call()
