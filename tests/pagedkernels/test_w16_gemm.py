"""pk.w16_gemm: float32 activations times a packed bf16/fp16 weight, against the float64 product of the same
values; the packed layout; argument checks; the native kernel's portable builds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pagedkernels as pk
from pagedkernels import _native
from pagedkernels.w16_gemm import PANEL, unpack_w16

NATIVE = _native.library() is not None
BACKENDS = ["torch", pytest.param("native", marks=pytest.mark.skipif(not NATIVE, reason="no C compiler here"))]


def _weight(n, k, dtype, gen):
    return (torch.randn(n, k, generator=gen) / 8).to(dtype)


def assert_product(out, x, weight):
    """out against x @ weight^T in float64 (weight's values exactly), within float32 accumulation error: 2^-21
    per term of |x| @ |w|^T (K terms, each rounded once, and the sum's own rounding), plus out's own rounding."""
    exact = x.double() @ weight.double().t()
    bound = (x.double().abs() @ weight.double().abs().t()) * 2.0 ** -21 * 4
    if out.dtype != torch.float32:
        bound = bound + exact.abs() * torch.finfo(out.dtype).eps
    excess = ((out.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"off the float64 product by {excess:.3g} past the bound"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 4, 16), (1, 37, 48), (2, 64, 576), (3, 130, 96), (4, 8, 1536), (5, 41, 64),
                                   (7, 19, 33), (8, 32, 7), (9, 70, 100), (17, 96, 128), (40, 33, 1)])
def test_matches_the_float64_product(backend, wdtype, M, N, K):
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    weight, x = _weight(N, K, wdtype, gen), torch.randn(M, K, generator=gen)
    with pk.use_backend(backend):
        out = pk.w16_gemm(x, pk.pack_w16(weight), N)
    assert out.shape == (M, N) and out.dtype == torch.float32
    assert_product(out, x, weight)


@pytest.mark.skipif(not NATIVE, reason="native CPU kernels unavailable (no C compiler)")
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", [(9, 70, 100), (48, 96, 576), (10, 40, 4100)])
def test_a_row_gets_the_same_bits_in_any_batch(wdtype, M, N, K):
    """A row's products are the same additions in the same order whatever the rows beside it (blocks of MB rows,
    the last rows' own copies, a row alone): a decode step's tokens do not depend on the batch they run in."""
    gen = torch.Generator().manual_seed(M + N + K)
    weight, x = _weight(N, K, wdtype, gen), torch.randn(M, K, generator=gen)
    packed = pk.pack_w16(weight)
    with pk.use_backend("native"):
        together = pk.w16_gemm(x, packed, N)
        alone = torch.cat([pk.w16_gemm(x[i:i + 1], packed, N) for i in range(M)])
    assert torch.equal(together, alone)
    assert_product(together, x, weight)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_argument_and_strided_rows(backend):
    """x rows with a stride (a view of a wider tensor) and an ``out`` view of a wider buffer: only its
    columns are written."""
    gen = torch.Generator().manual_seed(3)
    weight = _weight(21, 64, torch.bfloat16, gen)
    x = torch.randn(3, 100, generator=gen)[:, 10:74]
    buffer = torch.full((3, 30), float("nan"))
    with pk.use_backend(backend):
        result = pk.w16_gemm(x, pk.pack_w16(weight), 21, out=buffer[:, 4:25])
    assert result.data_ptr() == buffer[:, 4:25].data_ptr()
    assert_product(buffer[:, 4:25], x, weight)
    assert buffer[:, :4].isnan().all() and buffer[:, 25:].isnan().all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("xdtype", [torch.float16, torch.bfloat16])
def test_16bit_activations_take_the_float32_product_rounded(backend, xdtype):
    gen = torch.Generator().manual_seed(4)
    weight, x = _weight(40, 32, torch.bfloat16, gen), torch.randn(3, 32, generator=gen).to(xdtype)
    with pk.use_backend(backend):
        out = pk.w16_gemm(x, pk.pack_w16(weight), 40)
    assert out.dtype == xdtype
    assert_product(out, x, weight)


def test_native_and_torch_agree_to_float32_rounding():
    if not NATIVE:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(5)
    weight, x = _weight(300, 576, torch.bfloat16, gen), torch.randn(2, 576, generator=gen)
    packed = pk.pack_w16(weight)
    with pk.use_backend("native"):
        native = pk.w16_gemm(x, packed, 300)
    with pk.use_backend("torch"):
        twin = pk.w16_gemm(x, packed, 300)
    torch.testing.assert_close(native, twin, rtol=1e-5, atol=1e-5)


def test_pack_layout_is_the_documented_one():
    weight = torch.arange(40 * 5, dtype=torch.float32).view(40, 5).to(torch.bfloat16)
    packed = pk.pack_w16(weight)
    assert packed.shape == (2, 5, PANEL) and packed.is_contiguous() and packed.dtype == torch.bfloat16
    for p, k, c in [(0, 0, 0), (0, 4, 31), (1, 2, 7), (1, 0, 3)]:
        assert packed[p, k, c] == weight[PANEL * p + c, k]
    assert (packed[1, :, 8:] == 0).all()  # columns 40..63 pad the last panel
    assert torch.equal(unpack_w16(packed, 40), weight)


@pytest.mark.parametrize("call,match", [
    (lambda w, x: pk.pack_w16(torch.zeros(4, 32)), r"weight must have dtype in \(bfloat16, float16\)"),
    (lambda w, x: pk.w16_gemm(x, w, 40), r"packed must be pack_w16 of an \[n=40, K=32\] weight"),
    (lambda w, x: pk.w16_gemm(x[:, :16], w, 8), r"packed must be pack_w16 of an \[n=8, K=16\]"),
    (lambda w, x: pk.w16_gemm(x, w[0], 8), "packed must have 3 dimensions"),
    (lambda w, x: pk.w16_gemm(x, w, -1), "n must be a non-negative int"),
    (lambda w, x: pk.w16_gemm(x, w, True), "n must be a non-negative int"),
    (lambda w, x: pk.w16_gemm(x.double(), w, 8), r"x must have dtype"),
    (lambda w, x: pk.w16_gemm(x.t().contiguous().t(), w, 8), "x must be contiguous in its last"),
    (lambda w, x: pk.w16_gemm(x, torch.zeros(1, 32, 32, dtype=torch.bfloat16)[:, :, ::1].transpose(1, 2), 8),
     "packed must be contiguous"),
    (lambda w, x: pk.w16_gemm(x, w, 8, out=torch.empty(3, 8, dtype=torch.float16)), "out must have dtype"),
    (lambda w, x: pk.w16_gemm(x, w, 8, out=torch.empty(3, 9)), "out must have shape"),
])
def test_bad_arguments_raise(call, match):
    w = pk.pack_w16(torch.zeros(8, 32, dtype=torch.bfloat16))
    x = torch.zeros(3, 32)
    with pytest.raises(ValueError, match=match):
        call(w, x)


def test_empty_products():
    packed = pk.pack_w16(torch.zeros(0, 32, dtype=torch.bfloat16))
    assert pk.w16_gemm(torch.zeros(3, 32), packed, 0).shape == (3, 0)
    assert pk.w16_gemm(torch.zeros(0, 32), pk.pack_w16(torch.ones(5, 32, dtype=torch.float16)), 5).shape == (0, 5)


@pytest.mark.skipif(not NATIVE or os.uname().machine != "x86_64", reason="needs a C compiler on x86-64")
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"])
def test_portable_builds(march, portable_cache_dir):
    """The kernel's other SIMD paths (this machine's build takes the widest): generic vectors (x86-64: SSE2,
    fp16 converted element by element) and AVX2/F16C (x86-64-v3: bf16 widened in even/odd pairs), each built
    afresh (once a session) and run in a process of its own, at row counts that take every block size and
    remainder, with float32 and 16-bit activations."""
    script = textwrap.dedent("""
        import torch, pagedkernels as pk
        from pagedkernels import _native
        from tests.pagedkernels.test_w16_gemm import assert_product
        assert _native.library() is not None, _native.build_error()
        gen = torch.Generator().manual_seed(7)
        for wdtype in (torch.bfloat16, torch.float16):
            # rows: AVX2 runs blocks of 6 (7 and 8 as 4 + 3 and 4 + 4, 13 and 14 as 6 + 4 + 3 / 4), AVX-512 blocks
            # of 8, the generic vectors blocks of 4, each with its last rows' own copy
            for M, N, K in [(1, 37, 48), (3, 130, 96), (5, 9, 576), (9, 33, 7), (6, 64, 64), (7, 40, 96),
                            (8, 33, 130), (13, 70, 50), (14, 32, 64), (18, 100, 33)]:
                w = (torch.randn(N, K, generator=gen) / 8).to(wdtype)
                # float32 activations, and 16-bit ones (widened once, the output rounded once)
                for x in (torch.randn(M, K, generator=gen), torch.randn(M, K, generator=gen).to(wdtype)):
                    with pk.use_backend("native"):
                        assert_product(pk.w16_gemm(x, pk.pack_w16(w), N), x, w)
        print("ok")
    """)
    env = {**os.environ, "PAGEDKERNELS_NATIVE_MARCH": march, "PAGEDKERNELS_CACHE_DIR": str(portable_cache_dir)}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]
