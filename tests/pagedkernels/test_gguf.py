"""GGUF block types (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K): pk.gguf_dequantize against the gguf package's own
de-quantization (exact), pk.gguf_gemm against the float64 product with that weight, every backend, and
the conversion of Q4_0/Q4_1/Q8_0/Q4_K into the canonical int4/int8 layout.

Blocks are random bytes (every bit pattern of the packed values, 6-bit scales and mins occurs) with
finite float16 scale fields; quant_oracle.random_gguf.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pagedkernels as pk
from pagedkernels import _native, quant_formats
from tests.extras import MAIN_INSTALL, require
from tests.pagedkernels.quant_oracle import gguf_reference, random_gguf
from tests.pagedkernels.test_quant_gemm import BACKENDS, assert_gemm_close, skip_unsupported

gguf_module = importlib.import_module("pagedkernels.gguf_quant")
require("gguf", "the reference for the block formats; a main dependency", MAIN_INSTALL)

TYPES = list(pk.GGUF_BLOCKS)


def _k(quant_type: str, blocks: int) -> int:
    return pk.GGUF_BLOCKS[quant_type][0] * blocks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quant_type", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_matches_gguf(backend, quant_type, dtype, device):
    skip_unsupported(backend, dtype, device)
    gen = torch.Generator().manual_seed(len(quant_type) + int(dtype.itemsize))
    qweight = random_gguf(quant_type, 5, _k(quant_type, 3), gen)
    expected = gguf_reference(qweight, quant_type)
    with pk.use_backend(backend):
        got = pk.gguf_dequantize(qweight.to(device), quant_type, dtype=dtype)
    assert got.shape == expected.shape and got.dtype == dtype
    # computed in float32 (where gguf computes), rounded once to dtype
    torch.testing.assert_close(got.cpu(), expected.to(dtype), atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quant_type", TYPES)
@pytest.mark.parametrize("M", [1, 4, 70])
def test_gemm(backend, quant_type, M, device):
    """M=1 (decode), a few rows (one pass of the native kernel's row tile of 4 and a remainder), and
    more rows than the native int8 path takes (de-quantize + GEMM)."""
    gen = torch.Generator().manual_seed(M + len(quant_type))
    N, K = 37, _k(quant_type, 3 if quant_type.endswith("_K") else 7)
    qweight = random_gguf(quant_type, N, K, gen)
    weight = gguf_reference(qweight, quant_type)
    x = torch.randn(M, K, generator=gen)
    with pk.use_backend(backend):
        out = pk.gguf_gemm(x.to(device), qweight.to(device), quant_type)
    assert out.shape == (M, N) and out.dtype == x.dtype
    assert_gemm_close(out, x, weight, backend, msg=f"{backend} {quant_type} M={M}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemm_half_precision(backend, dtype, device):
    skip_unsupported(backend, dtype, device)
    gen = torch.Generator().manual_seed(21)
    for quant_type in ("Q4_K", "Q8_0"):
        qweight = random_gguf(quant_type, 24, 512, gen)
        x = torch.randn(3, 512, generator=gen).to(dtype)
        with pk.use_backend(backend):
            out = pk.gguf_gemm(x.to(device), qweight.to(device), quant_type)
        assert out.dtype == dtype
        assert_gemm_close(out, x, gguf_reference(qweight, quant_type), backend, msg=f"{quant_type} {dtype}")


def test_type_ids_and_names_agree_with_gguf():
    import gguf

    for name, (values, nbytes) in pk.GGUF_BLOCKS.items():
        qtype = getattr(gguf.GGMLQuantizationType, name)
        assert gguf_module.GGUF_TYPE_IDS[name] == int(qtype)
        assert gguf.GGML_QUANT_SIZES[qtype] == (values, nbytes)
    # a ggml id works wherever a name does
    gen = torch.Generator().manual_seed(1)
    qweight = random_gguf("Q4_1", 2, 64, gen)
    torch.testing.assert_close(pk.gguf_dequantize(qweight, int(gguf.GGMLQuantizationType.Q4_1)),
                               pk.gguf_dequantize(qweight, "Q4_1"), atol=0, rtol=0)


def test_quantized_by_gguf_round_trips():
    """Weights quantized by the gguf package (Q8_0, Q4_0, Q4_1) de-quantize to within a step."""
    import gguf
    from gguf import quants

    gen = torch.Generator().manual_seed(2)
    w = torch.randn(8, 256, generator=gen)
    for name, steps in (("Q8_0", 127), ("Q4_0", 8), ("Q4_1", 15)):
        raw = torch.from_numpy(quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, name)))
        back = pk.gguf_dequantize(raw, name)
        block_range = w.view(8, 8, 32).abs().amax(-1, keepdim=True) * 2
        assert ((back - w).view(8, 8, 32).abs() <= block_range / steps).all(), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_gguf_to_wq_through_wq_gemm(backend, quant_type, device):
    """The canonical form of a GGUF weight (float32 scales and zero points) is the same weight."""
    gen = torch.Generator().manual_seed(len(quant_type) * 3)
    K = _k(quant_type, 2 if quant_type == "Q4_K" else 6)
    qweight = random_gguf(quant_type, 20, K, gen)
    weight = gguf_reference(qweight, quant_type)
    converted = quant_formats.gguf_to_wq(qweight, quant_type)
    torch.testing.assert_close(converted.dequantize(torch.float64), weight, atol=1e-6, rtol=1e-6)
    x = torch.randn(2, K, generator=gen)
    with pk.use_backend(backend):
        out = pk.wq_gemm(x.to(device), converted.qweight.to(device), converted.scales.to(device),
                         None if converted.zeros is None else converted.zeros.to(device), bits=converted.bits,
                         group_size=converted.group_size)
    assert_gemm_close(out, x, weight, backend, msg=f"{quant_type} as wq")


INTERLEAVED = list(pk.GGUF_INTERLEAVED)


@pytest.mark.parametrize("quant_type", INTERLEAVED)
def test_interleave_layout_and_round_trip(quant_type):
    """The byte layout csrc/quant_cpu.c reads: per group of 8 rows and block, the 8 rows' f16 fields, then chunk j
    holding row r's nibble bytes 4j..4j+3 at 4r; and de-interleaving gives the file's bytes back."""
    base = pk.GGUF_INTERLEAVED[quant_type]
    gen = torch.Generator().manual_seed(5)
    N, K = 16, 96
    qweight = random_gguf(base, N, K, gen)
    packed = pk.gguf_interleave(qweight, base)
    assert packed.shape == qweight.shape and packed.dtype == torch.uint8
    values = 32 if base == "Q8_0" else 16   # bytes of values in a row's block (int8, or nibbles)
    nbytes = pk.GGUF_BLOCKS[base][1]
    head = nbytes - values
    blocks = qweight.view(N, K // 32, nbytes)
    group = packed.view(N // 8, K // 32, 8 * nbytes)
    for g, b, r in [(0, 0, 0), (1, 2, 7), (0, 1, 3)]:
        row = blocks[8 * g + r, b]
        for field in range(head // 2):   # d, then m (Q4_1)
            assert torch.equal(group[g, b, 16 * field + 2 * r:16 * field + 2 * r + 2], row[2 * field:2 * field + 2])
        for j in range(values // 4):
            start = 8 * head + 32 * j + 4 * r
            assert torch.equal(group[g, b, start:start + 4], row[head + 4 * j:head + 4 * j + 4])
    assert torch.equal(pk.gguf_deinterleave(packed, quant_type), qweight)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quant_type", INTERLEAVED)
@pytest.mark.parametrize("M", [1, 4, 6, 70])
def test_interleaved_gemm_and_dequantize(backend, quant_type, M, device):
    """Every path takes the interleaved layouts: the native kernels directly (one row, a full row tile of 4, a
    remainder, and the de-quantize + GEMM path above NATIVE_MAX_ROWS), Triton and torch through
    gguf_deinterleave; the values are the row layout's."""
    base = pk.GGUF_INTERLEAVED[quant_type]
    gen = torch.Generator().manual_seed(M + 40)
    N, K = 24, _k(base, 5)
    qweight = random_gguf(base, N, K, gen)
    weight = gguf_reference(qweight, base)
    packed = pk.gguf_interleave(qweight, base)
    x = torch.randn(M, K, generator=gen)
    with pk.use_backend(backend):
        out = pk.gguf_gemm(x.to(device), packed.to(device), quant_type)
        dequantized = pk.gguf_dequantize(packed.to(device), quant_type)
    assert_gemm_close(out, x, weight, backend, msg=f"{backend} {quant_type} M={M}")
    torch.testing.assert_close(dequantized.cpu(), weight.float(), atol=0, rtol=0)


@pytest.mark.parametrize("quant_type", ["Q8_0", *INTERLEAVED])
def test_take_rows_gives_row_layout_blocks(quant_type):
    """gguf_take_rows: the ids' rows in GGUF's row layout (an embedding's lookup in blocks an interleaved LM head
    shares), repeated and out-of-order ids included."""
    base = pk.GGUF_INTERLEAVED.get(quant_type, quant_type)
    gen = torch.Generator().manual_seed(9)
    qweight = random_gguf(base, 24, 64, gen)
    stored = pk.gguf_interleave(qweight, base) if quant_type != base else qweight
    ids = torch.tensor([5, 0, 23, 5, 8, 15, 16])
    rows, row_type = pk.gguf_take_rows(stored, quant_type, ids)
    assert row_type == base and torch.equal(rows, qweight[ids])


def test_interleave_refuses_what_it_cannot_hold():
    gen = torch.Generator().manual_seed(2)
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        pk.gguf_interleave(random_gguf("Q4_0", 12, 64, gen), "Q4_0")
    with pytest.raises(ValueError, match="takes Q4_0, Q4_1, Q8_0 weights"):
        pk.gguf_interleave(random_gguf("Q4_K", 8, 256, gen), "Q4_K")
    with pytest.raises(ValueError, match="groups of 8 rows"):
        pk.gguf_gemm(torch.randn(1, 64), torch.zeros(12, 36, dtype=torch.uint8), "Q4_0x8")


@pytest.mark.skipif(_native.library() is None, reason="native CPU kernels unavailable (no C compiler)")
def test_auto_backend_on_cpu_runs_native(monkeypatch):
    calls = []
    real = _native.quant_gemm
    monkeypatch.setattr(_native, "quant_gemm", lambda *a: calls.append(a[2]) or real(*a))
    gen = torch.Generator().manual_seed(3)
    with pk.use_backend("auto"):
        pk.gguf_gemm(torch.randn(1, 256), random_gguf("Q6_K", 4, 256, gen), "Q6_K")
    assert calls == ["Q6_K"]


INVALID = [
    (dict(quant_type="Q5_0"), "quant_type"),
    (dict(quant_type=99), "quant_type"),
    (dict(qweight=torch.zeros(4, 35, dtype=torch.uint8)), "qweight"),  # not whole Q8_0 blocks
    (dict(qweight=torch.zeros(4, 68, dtype=torch.int8)), "qweight"),
    (dict(x=torch.randn(2, 32)), "x"),  # K = 32, the weight holds 64
    (dict(x=torch.randn(2, 64).double()), "x"),
    (dict(out=torch.empty(2, 5)), "out"),
]


@pytest.mark.parametrize("changes,name", INVALID, ids=[f"{n}-{i}" for i, (_, n) in enumerate(INVALID)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_arguments(changes, name, backend, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a kernel was reached with invalid arguments")

    for module, attr in ((gguf_module, "_dequantize_triton"), (_native, "quant_gemm"), (_native, "quant_dequantize"),
                         (gguf_module, "_dequantize_torch")):
        monkeypatch.setattr(module, attr, fail)
    args = dict(x=torch.randn(2, 64), qweight=torch.zeros(4, 68, dtype=torch.uint8), quant_type="Q8_0", **{})
    args.update(changes)
    with pk.use_backend(backend), pytest.raises(ValueError, match=rf"\b{name}\b"):
        pk.gguf_gemm(args["x"], args["qweight"], args["quant_type"], out=args.get("out"))
    if name in ("quant_type", "qweight"):
        with pk.use_backend(backend), pytest.raises(ValueError, match=rf"\b{name}\b"):
            pk.gguf_dequantize(args["qweight"], args["quant_type"])


@pytest.mark.skipif(_native.library() is None or os.uname().machine != "x86_64", reason="needs a C compiler on x86-64")
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"])
def test_native_gemm_portable_builds(march, portable_cache_dir):
    """The native block GEMM's other paths (this machine's build takes the widest): scalar C (x86-64) and AVX2
    without VNNI (x86-64-v3: maddubs), each built afresh (once a session) and run in a process of its own, every
    block type and format at one row (each format's single-row copy of the loop) and a few, against the float64
    product."""
    script = textwrap.dedent("""
        import torch, pagedkernels as pk
        from pagedkernels import _native
        from tests.pagedkernels.quant_oracle import gguf_reference, random_gguf
        from tests.pagedkernels.test_quant_gemm import assert_gemm_close
        assert _native.library() is not None, _native.build_error()
        gen = torch.Generator().manual_seed(11)
        for quant_type in [*pk.GGUF_BLOCKS, *pk.GGUF_INTERLEAVED]:
            base = pk.GGUF_INTERLEAVED.get(quant_type, quant_type)
            for M in (1, 3, 6):
                K = pk.GGUF_BLOCKS[base][0] * (3 if base.endswith("_K") else 7)
                qweight = random_gguf(base, 24 if base != quant_type else 19, K, gen)
                x = torch.randn(M, K, generator=gen)
                weight = qweight if base == quant_type else pk.gguf_interleave(qweight, base)
                with pk.use_backend("native"):
                    out = pk.gguf_gemm(x, weight, quant_type)
                assert_gemm_close(out, x, gguf_reference(qweight, base), "native", msg=f"{quant_type} M={M}")
        print("ok", _native.library().pk_quant_simd_level())
    """)
    env = {**os.environ, "PAGEDKERNELS_NATIVE_MARCH": march, "PAGEDKERNELS_CACHE_DIR": str(portable_cache_dir)}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == ("0" if march == "x86-64" else "1"), proc.stdout   # portable C, AVX2
