"""pk.wq_gemm (weight-only int4/int8 GEMM in the canonical layout) and the GPTQ/AWQ conversions into it,
against float64 references (tests/pagedkernels/quant_oracle.py): every backend, decode (M=1) and
prefill-sized M, group sizes 32/64/128/-1, K not a multiple of the Triton tile, zero points and the
symmetric default, act-order permutations.

Tolerances are relative to sum_k |x[m,k]| |w[n,k]| (the size of the terms a product sums), so a kernel
that drops, repeats or misplaces one column's contribution fails. The native CPU kernels quantize x to
int8 per 32 values (llama.cpp's scheme); they are held to the product with that quantization emulated
exactly (quant_oracle.int8_activation), float32 rounding only, and to the exact product within the
quantization's worst-case bound; above NATIVE_MAX_ROWS rows they de-quantize and are held to the exact
product like the others.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

import pagedkernels as pk
from pagedkernels import _native, quant_formats
from tests.pagedkernels.quant_oracle import (
    int8_activation,
    int8_activation_bound,
    make_awq,
    make_gptq,
    gptq_dequantize,
    pack_canonical_int4,
)

# The module, not the function of the same name that pagedkernels re-exports.
wq_module = importlib.import_module("pagedkernels.wq_gemm")

BACKENDS = ["triton", "torch", "native"]
# Relative to sum_k |x||w|: fp32 accumulates exactly-rounded products; 16-bit kernels round the
# de-quantized weight (and the output) to the dtype.
SUM_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
NATIVE_EMULATED_RTOL = 1e-5  # the native result against the emulated int8 activation (fp32 sums)


def skip_unsupported(backend, dtype, device):
    if backend == "triton" and dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 arithmetic is wrong in the Triton interpreter; tested on CUDA")


def assert_gemm_close(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, backend: str, *, msg: str = ""):
    """out [M, N] (the kernel's dtype) against x [M, K] @ weight [N, K]^T (weight float64, exact)."""
    got = out.double().cpu()
    xd = x.double().cpu()
    exact = xd @ weight.t()
    scale = xd.abs() @ weight.abs().t()
    rtol = SUM_RTOL[out.dtype]
    if backend == "native" and x.device.type == "cpu" and x.shape[0] <= wq_module.NATIVE_MAX_ROWS:
        x_q = int8_activation(x)
        emulated = x_q @ weight.t()
        limit = (NATIVE_EMULATED_RTOL + (rtol if out.dtype != torch.float32 else 0)) * (x_q.abs() @ weight.abs().t())
        worst = ((got - emulated).abs() - limit).max().item()
        assert worst <= 0, f"{msg}: native result off the emulated int8 product by {worst:.3g} past the bound"
        bound = int8_activation_bound(x, weight) + rtol * scale
        assert ((got - exact).abs() <= bound).all(), f"{msg}: native result outside the int8 activation bound"
        return
    excess = ((got - exact).abs() - rtol * scale).max().item()
    assert excess <= 0, f"{msg}: off by {excess:.3g} past rtol {rtol} of sum |x||w|"


def _weight(N, K, bits, group_size, symmetric, generator, scale_dtype=torch.float16):
    """A random canonical weight built independently of pagedkernels: q, scales, zeros, the packed
    qweight (the oracle's packer) and the float64 weight they mean."""
    g = K if group_size == -1 else group_size
    qmax = 2 ** bits - 1
    q = torch.randint(0, qmax + 1, (N, K), generator=generator)
    scales = (torch.rand(N, K // g, generator=generator) * 0.02 + 0.002).to(scale_dtype)
    zeros = None if symmetric else torch.randint(0, qmax + 1, (N, K // g), generator=generator).to(scale_dtype)
    z = torch.full((N, K // g), 2.0 ** (bits - 1), dtype=torch.float64) if zeros is None else zeros.double()
    weight = (q.double() - z.repeat_interleave(g, 1)) * scales.double().repeat_interleave(g, 1)
    qweight = pack_canonical_int4(q.numpy().astype(np.uint8)) if bits == 4 else q.to(torch.uint8)
    return qweight, scales, zeros, weight


# (M, N, K, bits, group_size): M=1 (decode, split-K in Triton), small M, M past the native int8 path's
# limit (de-quantize + GEMM) and past one Triton tile; K a multiple of 32 but not of the 64-column tile;
# N odd; every group size.
CASES = [
    (1, 40, 96, 4, 32),
    (1, 40, 96, 8, -1),
    (1, 64, 512, 4, 128),
    (5, 72, 192, 4, 64),
    (5, 72, 192, 8, 64),
    (3, 48, 256, 8, 128),
    (70, 33, 128, 4, -1),
    (70, 33, 128, 8, 32),
    (17, 24, 320, 4, 32),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("symmetric", [False, True], ids=["zeros", "symmetric"])
@pytest.mark.parametrize("M,N,K,bits,group_size", CASES)
def test_wq_gemm_fp32(backend, symmetric, M, N, K, bits, group_size, device):
    gen = torch.Generator().manual_seed(M * 1000 + K + bits)
    qweight, scales, zeros, weight = _weight(N, K, bits, group_size, symmetric, gen)
    x = torch.randn(M, K, generator=gen)
    with pk.use_backend(backend):
        out = pk.wq_gemm(x.to(device), qweight.to(device), scales.to(device),
                         None if zeros is None else zeros.to(device), bits=bits, group_size=group_size)
    assert out.shape == (M, N) and out.dtype == torch.float32 and out.device.type == device
    assert_gemm_close(out, x, weight, backend, msg=f"{backend} {M}x{N}x{K} int{bits} g{group_size}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,N,K,bits,group_size", [CASES[0], CASES[4], CASES[6], CASES[7]])
def test_wq_gemm_half_precision(backend, dtype, M, N, K, bits, group_size, device):
    skip_unsupported(backend, dtype, device)
    gen = torch.Generator().manual_seed(K + bits)
    # scales in the activation dtype, as GPTQ checkpoints store fp16 ones
    qweight, scales, zeros, weight = _weight(N, K, bits, group_size, False, gen, scale_dtype=dtype)
    x = torch.randn(M, K, generator=gen).to(dtype)
    with pk.use_backend(backend):
        out = pk.wq_gemm(x.to(device), qweight.to(device), scales.to(device), zeros.to(device), bits=bits,
                         group_size=group_size)
    assert out.dtype == dtype
    assert_gemm_close(out, x, weight, backend, msg=f"{backend} {dtype}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("M,N,K,bits,group_size", [CASES[0], CASES[3], CASES[8]])
def test_reads_nothing_past_scales_and_zeros(backend, M, N, K, bits, group_size, device):
    """Scales and zeros end where NaNs begin: a kernel that reads one group past a row's last (the K
    tail of the last tile, the last row) turns a masked-out product into NaN. (It did, in the Triton
    path, whenever the allocator left a NaN there: about one run in fifty.)"""
    gen = torch.Generator().manual_seed(N + K)
    qweight, scales, zeros, weight = _weight(N, K, bits, group_size, False, gen)

    def followed_by_nans(t):
        buffer = torch.full((t.numel() + 256,), float("nan"), dtype=t.dtype, device=device)
        buffer[:t.numel()] = t.reshape(-1).to(device)
        return buffer[:t.numel()].view(t.shape)

    x = torch.randn(M, K, generator=gen)
    with pk.use_backend(backend):
        out = pk.wq_gemm(x.to(device), qweight.to(device), followed_by_nans(scales), followed_by_nans(zeros),
                         bits=bits, group_size=group_size)
    assert torch.isfinite(out).all()
    assert_gemm_close(out, x, weight, backend, msg=f"{backend} {M}x{N}x{K} g{group_size}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_argument_and_strided_rows(backend, device):
    """x and out as row-strided views (a slice of wider buffers); only out's columns are written."""
    gen = torch.Generator().manual_seed(3)
    qweight, scales, zeros, weight = _weight(40, 96, 4, 32, False, gen)
    wide = torch.randn(3, 160, generator=gen)
    x = wide[:, 32:128]
    buffer = torch.full((3, 50), float("nan"))
    out = buffer[:, 5:45]
    with pk.use_backend(backend):
        result = pk.wq_gemm(x.to(device) if device == "cpu" else x.to(device), qweight.to(device),
                            scales.to(device), zeros.to(device), bits=4, group_size=32,
                            out=out if device == "cpu" else out.to(device))
    if device == "cpu":
        assert result.data_ptr() == out.data_ptr()
        assert buffer[:, :5].isnan().all() and buffer[:, 45:].isnan().all()
    assert_gemm_close(result, x.contiguous(), weight, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_perm_gathers_columns(backend, device):
    """perm: weight column k multiplies x[:, perm[k]] (act-order)."""
    gen = torch.Generator().manual_seed(4)
    qweight, scales, zeros, weight = _weight(24, 128, 4, 32, False, gen)
    perm = torch.randperm(128, generator=gen)
    x = torch.randn(3, 128, generator=gen)
    with pk.use_backend(backend):
        out = pk.wq_gemm(x.to(device), qweight.to(device), scales.to(device), zeros.to(device), bits=4,
                         group_size=32, perm=perm.to(device))
    assert_gemm_close(out, x[:, perm], weight, backend)
    # the same as the original-order weight times x as it is (the native kernels quantize the gathered
    # x, so their rounding is checked in gathered order above)
    original = torch.empty_like(weight)
    original[:, perm] = weight
    if backend != "native":
        assert_gemm_close(out, x, original, backend)


# ---------------------------------------------------------------------------------------------
# the canonical layout and the checkpoint conversions
# ---------------------------------------------------------------------------------------------

def test_pack_unpack_match_the_documented_order():
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (6, 96), generator=gen, dtype=torch.uint8)
    packed = quant_formats.pack_int4(q)
    assert torch.equal(packed, pack_canonical_int4(q.numpy()))
    assert torch.equal(quant_formats.unpack_int4(packed), q)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, -1])
@pytest.mark.parametrize("symmetric", [False, True])
def test_quantize_wq_round_trip(bits, group_size, symmetric):
    """The reference quantizer: every weight within half a step of its group's scale."""
    gen = torch.Generator().manual_seed(bits + group_size)
    w = torch.randn(10, 192, generator=gen)
    q = quant_formats.quantize_wq(w, bits=bits, group_size=group_size, symmetric=symmetric,
                                  scale_dtype=torch.float32)
    assert (q.zeros is None) == symmetric
    g = 192 if group_size == -1 else group_size
    step = q.scales.repeat_interleave(g, 1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size,act_order", [(32, False), (128, False), (-1, False), (32, True), (128, True)])
@pytest.mark.parametrize("checkpoint_format,symmetric", [("gptq", False), ("gptq", True), ("gptq_v2", False)])
def test_gptq_conversion(bits, group_size, act_order, checkpoint_format, symmetric):
    gen = torch.Generator().manual_seed(bits * 7 + group_size + act_order)
    K, N = 256, 48
    tensors, weight = make_gptq(K, N, bits=bits, group_size=group_size, act_order=act_order, symmetric=symmetric,
                                checkpoint_format=checkpoint_format, generator=gen)
    # the oracle's own packing and de-quantization agree
    torch.testing.assert_close(gptq_dequantize(**tensors, bits=bits, checkpoint_format=checkpoint_format), weight,
                               atol=0, rtol=0)
    converted = quant_formats.gptq_to_wq(**tensors, bits=bits, group_size=group_size,
                                         checkpoint_format=checkpoint_format, scale_dtype=torch.float32)
    assert (converted.perm is not None) == act_order
    assert (converted.zeros is None) == symmetric
    torch.testing.assert_close(converted.dequantize(torch.float64), weight, atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits,group_size,act_order", [(4, 128, True), (8, 32, True), (4, -1, False)])
def test_gptq_checkpoint_through_wq_gemm(backend, bits, group_size, act_order, device):
    """A GPTQ linear (fp16 scales, v1 zeros) converted once, then multiplied: the checkpoint's own
    weight times x."""
    gen = torch.Generator().manual_seed(bits + group_size)
    tensors, weight = make_gptq(256, 40, bits=bits, group_size=group_size, act_order=act_order, symmetric=False,
                                checkpoint_format="gptq", generator=gen)
    w = quant_formats.gptq_to_wq(**tensors, bits=bits, group_size=group_size)
    assert w.scales.dtype == torch.float16
    x = torch.randn(2, 256, generator=gen)
    with pk.use_backend(backend):
        out = pk.wq_gemm(x.to(device), w.qweight.to(device), w.scales.to(device), w.zeros.to(device),
                         bits=bits, group_size=group_size, perm=None if w.perm is None else w.perm.to(device))
    if w.perm is not None:  # the kernel's view: x's columns gathered, the weight's in canonical order
        x, weight = x[:, w.perm], weight[:, w.perm]
    assert_gemm_close(out, x, weight, backend, msg=f"gptq {backend}")


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_awq_conversion(group_size):
    gen = torch.Generator().manual_seed(group_size + 1)
    tensors, weight = make_awq(256, 64, group_size=group_size, generator=gen)
    converted = quant_formats.awq_to_wq(**tensors, group_size=group_size, scale_dtype=torch.float32)
    assert converted.bits == 4 and converted.perm is None
    torch.testing.assert_close(converted.dequantize(torch.float64), weight, atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_awq_checkpoint_through_wq_gemm(backend, device):
    gen = torch.Generator().manual_seed(11)
    tensors, weight = make_awq(128, 48, group_size=64, generator=gen)
    w = quant_formats.awq_to_wq(**tensors, group_size=64)
    x = torch.randn(4, 128, generator=gen)
    with pk.use_backend(backend):
        out = pk.wq_gemm(x.to(device), w.qweight.to(device), w.scales.to(device), w.zeros.to(device), bits=4,
                         group_size=64)
    assert_gemm_close(out, x, weight, backend, msg=f"awq {backend}")


def test_awq_order_matters():
    """Guards the AWQ test: reading the nibbles in plain order gives another weight."""
    gen = torch.Generator().manual_seed(12)
    tensors, weight = make_awq(64, 16, group_size=32, generator=gen)
    original = quant_formats.AWQ_ORDER
    try:
        quant_formats.AWQ_ORDER = tuple(range(8))
        wrong = quant_formats.awq_to_wq(**tensors, group_size=32, scale_dtype=torch.float32)
    finally:
        quant_formats.AWQ_ORDER = original
    assert (wrong.dequantize(torch.float64) - weight).abs().max() > 1e-3


def test_conversion_errors():
    gen = torch.Generator().manual_seed(13)
    tensors, _ = make_gptq(128, 16, bits=4, group_size=32, act_order=False, symmetric=False,
                           checkpoint_format="gptq", generator=gen)
    with pytest.raises(ValueError, match="bits"):
        quant_formats.gptq_to_wq(**tensors, bits=3, group_size=32)
    with pytest.raises(ValueError, match="qzeros"):
        quant_formats.gptq_to_wq(**{**tensors, "qzeros": tensors["qzeros"][:2]}, bits=4, group_size=32)
    with pytest.raises(ValueError, match="checkpoint_format"):
        quant_formats.gptq_to_wq(**tensors, bits=4, group_size=32, checkpoint_format="exl2")
    uneven = torch.zeros(128, dtype=torch.int32)  # every column in group 0: groups of unequal size
    with pytest.raises(ValueError, match="g_idx"):
        quant_formats.gptq_to_wq(**{**tensors, "g_idx": uneven}, bits=4, group_size=32)


# ---------------------------------------------------------------------------------------------
# dispatch and validation
# ---------------------------------------------------------------------------------------------

class _LaunchRecorder:
    def __init__(self, kernel, fail=False):
        self.kernel, self.fail, self.grids = kernel, fail, []

    def __getitem__(self, grid):
        if self.fail:
            raise AssertionError("kernel launched although the call was invalid")
        self.grids.append(grid)
        return self.kernel[grid]


def test_decode_shape_splits_k_in_triton(monkeypatch, triton_device):
    recorder = _LaunchRecorder(wq_module._wq_gemm_kernel)
    monkeypatch.setattr(wq_module, "_wq_gemm_kernel", recorder)
    gen = torch.Generator().manual_seed(6)
    qweight, scales, zeros, weight = _weight(40, 192, 4, 64, False, gen)
    qweight, scales, zeros = (t.to(triton_device) for t in (qweight, scales, zeros))
    x = torch.randn(1, 192, generator=gen)
    with pk.use_backend("triton"):
        out = pk.wq_gemm(x.to(triton_device), qweight, scales, zeros, bits=4, group_size=64)
    assert recorder.grids[0][2] > 1  # split-K for one row
    assert_gemm_close(out, x, weight, "triton")
    with pk.use_backend("triton"):
        pk.wq_gemm(torch.randn(40, 192, generator=gen).to(triton_device), qweight, scales, zeros, bits=4,
                   group_size=64)
    assert recorder.grids[1][2] == 1  # prefill-shaped: no split


@pytest.mark.skipif(_native.library() is None, reason="native CPU kernels unavailable (no C compiler)")
def test_auto_backend_on_cpu_takes_the_native_paths(monkeypatch):
    calls = []
    for name in ("quant_gemm", "quant_dequantize"):
        real = getattr(_native, name)
        monkeypatch.setattr(_native, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    gen = torch.Generator().manual_seed(7)
    qweight, scales, zeros, _ = _weight(16, 64, 8, 32, False, gen)
    with pk.use_backend("auto"):
        pk.wq_gemm(torch.randn(2, 64), qweight, scales, zeros, bits=8, group_size=32)
        pk.wq_gemm(torch.randn(wq_module.NATIVE_MAX_ROWS + 1, 64), qweight, scales, zeros, bits=8, group_size=32)
    assert calls == ["quant_gemm", "quant_dequantize"]


def _valid(dtype=torch.float32):
    gen = torch.Generator().manual_seed(8)
    qweight, scales, zeros, _ = _weight(16, 64, 4, 32, False, gen)
    return dict(x=torch.randn(3, 64, generator=gen).to(dtype), qweight=qweight, scales=scales, zeros=zeros,
                bits=4, group_size=32)


INVALID = [
    (dict(x=torch.randn(3, 64).double()), "x"),
    (dict(x=torch.randn(3, 64, 2)[..., 0]), "x"),  # K not contiguous
    (dict(x=torch.randn(3, 48)), "qweight"),  # K mismatch
    (dict(qweight=torch.zeros(16, 32, dtype=torch.int8)), "qweight"),
    (dict(qweight=torch.zeros(16, 64, dtype=torch.uint8)), "qweight"),  # 8-bit rows for bits=4
    (dict(bits=3), "bits"),
    (dict(bits=True), "bits"),
    (dict(group_size=48), "group_size"),
    (dict(group_size=128), "group_size"),  # does not divide K
    (dict(scales=torch.ones(16, 3)), "scales"),
    (dict(scales=torch.ones(16, 2, dtype=torch.int32)), "scales"),
    (dict(zeros=torch.ones(16, 2)), "zeros"),  # dtype differs from scales (fp16)
    (dict(perm=torch.arange(32)), "perm"),
    (dict(perm=torch.arange(64).float()), "perm"),
    (dict(out=torch.empty(3, 15)), "out"),
    (dict(out=torch.empty(3, 16, dtype=torch.float16)), "out"),
]


@pytest.mark.parametrize("changes,name", INVALID, ids=[f"{n}-{i}" for i, (_, n) in enumerate(INVALID)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_arguments_raise_before_any_launch(changes, name, backend, monkeypatch):
    monkeypatch.setattr(wq_module, "_wq_gemm_kernel", _LaunchRecorder(None, fail=True))

    def no_native(*args):
        raise AssertionError("native kernel reached with invalid arguments")

    monkeypatch.setattr(_native, "quant_gemm", no_native)
    args = {**_valid(), **changes}
    x, qweight, scales, zeros = args.pop("x"), args.pop("qweight"), args.pop("scales"), args.pop("zeros")
    with pk.use_backend(backend), pytest.raises(ValueError, match=rf"\b{name}\b"):
        pk.wq_gemm(x, qweight, scales, zeros, **args)


def test_perm_values_are_checked_once_not_per_call():
    """An act-order perm's values are checked by check_wq_perm (at load), never read on the host by wq_gemm itself,
    so a CPU graph can record the call; one out of range that reaches wq_gemm still reads nothing outside x."""
    from pagedkernels.cpu_graph import CPUGraph
    from pagedkernels.wq_gemm import check_wq_perm

    args = _valid()
    x, qweight, scales, zeros = args.pop("x"), args.pop("qweight"), args.pop("scales"), args.pop("zeros")
    with pytest.raises(ValueError, match=r"perm: column indices must lie in \[0, 64\), got values in \[1, 64\]"):
        check_wq_perm(torch.arange(64) + 1, 64)
    with pytest.raises(ValueError, match="perm"):
        check_wq_perm(torch.arange(32), 64)
    with pytest.raises((IndexError, RuntimeError), match="out of (range|DATA bounds)"):
        pk.wq_gemm(x, qweight, scales, zeros, perm=torch.arange(64) + 1, **args)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    check_wq_perm(perm, 64)
    if _native.library() is None:
        return
    graph = CPUGraph()
    graph.capture(lambda: pk.wq_gemm(x, qweight, scales, zeros, perm=perm, **args))
    x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(x.dtype))
    torch.testing.assert_close(graph.replay(), pk.wq_gemm(x, qweight, scales, zeros, perm=perm, **args), rtol=0,
                               atol=0)
