"""bf16 on the CPU, on the paths the native build can take: the 16-bit-weight GEMM with bf16 activations, the
paged attention of bf16 queries on a bf16 cache and the MoE layer of a bf16 model, against float64 oracles with bf16
tolerances.

The paths (``_native.bf16_dot_path()``, ``PK_BF16_DOT`` in csrc/cpu_common.h):

- this machine's build: AVX512-BF16 pair dot products where the CPU has them (Cooper Lake, Xeons since Sapphire
  Rapids, AMD Zen 4/5), else bf16 widened to float32 by shifts and multiplied in float32 (AVX2, AVX-512 without
  BF16, SSE, NEON; the portable and AVX2 builds of the float32 kernels these go through are test_w16_gemm's and
  test_native's ``portable_builds``);
- a build with the pair dot emulated (``-DPK_EMULATE_AVX512BF16``): the AVX512-BF16 kernels, every line of them but
  the instruction, on any machine;
- AMX tiles (``_native.w16_amx()``, csrc/w16_gemm_cpu.c) for the 16-bit-weight GEMM's bf16 products of 5 rows or
  more where the CPU and the build have them (Xeons since Sapphire Rapids): tested with every row count forced onto
  them, skipped on other CPUs;
- builds for Sapphire Rapids (AMX-BF16, AVX512-BF16) and for Zen 4's ISA: compiled here and checked for the
  instructions; they run (the first group above) where the CPU has them, and their runtime check skips elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

import pagedkernels as pk
from pagedkernels import _native
from tests.pagedkernels.moe_oracle import assert_moe_close, moe_reference, random_moe
from tests.pagedkernels.oracle import assert_attention_close, attention_oracle, make_paged_kv
from tests.pagedkernels.test_w16_gemm import assert_product

NATIVE = _native.library() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="native CPU kernels unavailable (no C compiler)")
ROOT = Path(__file__).resolve().parents[2]


@needs_native
@pytest.mark.parametrize("M,N,K", [(1, 37, 48), (3, 130, 96), (5, 9, 577), (8, 64, 64), (9, 33, 7), (13, 70, 51),
                                   (17, 32, 130), (1, 40, 1)])
def test_w16_gemm_bf16_activations_match_float64(M, N, K):
    """bf16 x times a packed bf16 weight, bf16 out: the float64 product within float32 accumulation and one bf16
    rounding. Rows of every block size and remainder (8 for the pair-dot path, 6/8/4 for the widened one), odd K
    (the last k without a partner), column counts past a panel's 32."""
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    weight = (torch.randn(N, K, generator=gen) / 8).to(torch.bfloat16)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    with pk.use_backend("native"):
        out = pk.w16_gemm(x, pk.pack_w16(weight), N)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    assert_product(out, x, weight)


AMX = NATIVE and _native.w16_amx()[0]
needs_amx = pytest.mark.skipif(not AMX, reason="needs AMX-BF16 tiles (Intel Xeons since Sapphire Rapids) and a build "
                                               "with them; test_avx512_bf16_builds compiles the tile kernel here")


@pytest.fixture
def amx_rows():
    """Sets the rows from which bf16 products take the AMX tiles (w16_amx), restoring the default after the test."""
    default = _native.w16_amx()[1] if NATIVE else None
    yield lambda rows: _native.w16_amx(rows)
    if NATIVE:
        _native.w16_amx(default)


@needs_native
@pytest.mark.parametrize("path", ["pair dots", "AMX tiles"])
def test_w16_gemm_bf16_row_gets_the_same_bits_in_any_batch(path, amx_rows):
    """A decode step's token does not depend on the rows beside it on either path: each row's sums run in the same
    order in a block of rows, in the last rows' copy, and alone (pair dots: blocks of 8; tiles: blocks of 16 rows, a
    partial block of k from a padded copy). The two paths round differently, so the rows from which the tiles take
    over (5 by default) are a switch of bits, as the engine's switch to oneDNN at its row limit is."""
    if path == "AMX tiles" and not AMX:
        pytest.skip("needs AMX-BF16 tiles (Intel Xeons since Sapphire Rapids) and a build with them")
    amx_rows(1 if path == "AMX tiles" else sys.maxsize)
    gen = torch.Generator().manual_seed(11)
    weight = (torch.randn(70, 200, generator=gen) / 8).to(torch.bfloat16)
    x = torch.randn(19, 200, generator=gen).to(torch.bfloat16)
    packed = pk.pack_w16(weight)
    with pk.use_backend("native"):
        together = pk.w16_gemm(x, packed, 70)
        alone = torch.cat([pk.w16_gemm(x[i:i + 1], packed, 70) for i in range(19)])
    assert torch.equal(together, alone)


@needs_amx
@pytest.mark.parametrize("M,N,K", [(1, 37, 48), (3, 130, 96), (5, 9, 577), (16, 64, 64), (17, 33, 7), (13, 70, 51),
                                   (40, 32, 130), (33, 96, 1536), (2, 40, 1), (48, 200, 32)])
def test_w16_gemm_bf16_amx_tiles_match_float64(M, N, K, amx_rows):
    """The AMX tile kernel (every row count forced onto it): blocks of 16 rows and a partial last one, K in whole
    blocks of 32 and a partial block (odd K included: the last k without a partner), columns past a panel's 32; bf16
    out, and float32 out through the op's out=."""
    amx_rows(1)
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    weight = (torch.randn(N, K, generator=gen) / 8).to(torch.bfloat16)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    packed = pk.pack_w16(weight)
    with pk.use_backend("native"):
        out = pk.w16_gemm(x, packed, N)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    assert_product(out, x, weight)


@needs_native
def test_amx_rows_switch(amx_rows):
    """w16_amx reports whether the tiles can be used and sets the rows from which they are; PAGEDKERNELS_CPU_AMX=0
    turns them off for the process. On a CPU with AMX-BF16 and AMX-TILE, a native build has them."""
    usable, default = _native.w16_amx()
    assert default == 5
    assert amx_rows(12) == (usable, 12) and _native.w16_amx() == (usable, 12)
    assert amx_rows(0) == (usable, 1)   # at least one row
    flags = _native.cpu_flags()
    if {"amx_bf16", "amx_tile"} <= flags and _native.native_march() == "native" and not _native.native_extra_flags():
        assert usable, "this CPU has AMX-BF16 but the native build cannot use the tiles"
    proc = _run(["-c", "from pagedkernels import _native; print(_native.w16_amx())"],
                {**os.environ, "PAGEDKERNELS_CPU_AMX": "0"})
    assert proc.returncode == 0 and proc.stdout.strip() == "(False, 5)", proc.stdout + proc.stderr


@needs_native
@pytest.mark.parametrize("lens,num_kv_heads,group,head_dim,window,softcap", [
    ([37, 90, 1, 64, 130], 3, 3, 64, None, None),   # SmolLM2's heads; one pass over all heads of a sequence
    ([300], 2, 4, 128, None, None),                 # one long sequence: its keys split across threads
    ([257, 5], 1, 7, 64, 100, 30.0),                # a window and softcap; 7 heads: 4 + 3 in registers
    ([33, 70, 18], 2, 5, 96, None, None),           # head_dim of three 32-value pair vectors
    ([40] * 12, 4, 2, 32, None, None),
])
def test_attention_bf16_matches_float64(lens, num_kv_heads, group, head_dim, window, softcap):
    """Decode and prefill of bf16 queries over a bf16 cache (blocks scattered, unused slots NaN) against the float64
    oracle with bf16 tolerances (element-wise and per output vector)."""
    gen = torch.Generator().manual_seed(sum(lens) + head_dim)
    kv = make_paged_kv(lens, 16, num_kv_heads, head_dim, torch.bfloat16, "cpu", generator=gen)
    options = dict(sliding_window=window, softcap=softcap)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen).to(torch.bfloat16)
    with pk.use_backend("native"):
        out = pk.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, **options)
    expected = torch.cat([attention_oracle(q[s:s + 1], kv.keys[s], kv.values[s], **options)
                          for s in range(len(lens))])
    assert_attention_close(out, expected, msg="decode")
    q_lens = [min(n, 20) for n in lens]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qp = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim, generator=gen).to(torch.bfloat16)
    with pk.use_backend("native"):
        out = pk.paged_prefill_attention(qp, kv.key_cache, kv.value_cache, kv.block_tables, cu, kv.seq_lens, **options)
    expected = torch.cat([attention_oracle(qp[cu[s]:cu[s + 1]], kv.keys[s], kv.values[s], **options)
                          for s in range(len(lens))])
    assert_attention_close(out, expected, msg="prefill")


@needs_native
@pytest.mark.parametrize("dtype,tokens,hidden,intermediate,experts,top_k,expert_parallel", [
    (torch.bfloat16, 1, 64, 48, 16, 4, False),     # a decode token
    (torch.bfloat16, 37, 72, 40, 8, 2, True),      # sizes across panel edges; 3 of 8 global experts elsewhere
    (torch.bfloat16, 130, 96, 80, 6, 3, False),    # row blocks of every size per expert
    (torch.float16, 21, 40, 24, 4, 2, False),
])
def test_fused_moe_16bit_hidden_matches_float64(dtype, tokens, hidden, intermediate, experts, top_k,
                                                expert_parallel):
    """A bf16 (or fp16) model's MoE layer on the native kernel: hidden states, panels and output in the model's dtype,
    routing weights in it too. Against the float64 reference of the same values: float32 accumulation and one rounding
    to the dtype (unrouted experts' weights NaN, out starting NaN). Where the kernel widens the rows and runs the
    float32 path (fp16; bf16 without AVX512-BF16): the same bits as the float32 kernel's result on the widened rows,
    rounded once. On the pair-dot path (bf16 with AVX512-BF16, real or emulated) the activated rows are rounded to bf16
    before the down projection: the reference rounds them too, and each token's row has the same bits alone as in the
    batch."""
    gen = torch.Generator().manual_seed(tokens * 17 + hidden)
    x, w13, w2, weights, ids = random_moe(tokens, hidden, intermediate, experts, top_k, dtype, gen)
    weights = weights.to(dtype)
    expert_map = None
    if expert_parallel:  # global experts 0..7, this rank's: 5 of them (local 0..4), the rest elsewhere
        expert_map = torch.tensor([3, -1, 0, 4, -1, 1, -1, 2], dtype=torch.int32)
        local = torch.tensor([2, 5, 7, 0, 3])
        w13, w2 = w13[local].contiguous(), w2[local].contiguous()
        ids[0] = torch.tensor([1, 4], dtype=torch.int32)  # a token with no expert here: zero
    mapped = ids.long() if expert_map is None else expert_map.long()[ids.long()]
    unrouted = torch.ones(w13.shape[0], dtype=torch.bool)
    unrouted[mapped[mapped >= 0]] = False
    w13[unrouted], w2[unrouted] = float("nan"), float("nan")
    packed = (pk.pack_moe_weight(w13), pk.pack_moe_weight(w2))
    assert packed[0].dtype == dtype
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype)
    with pk.use_backend("native"):
        result = pk.fused_moe(x, *packed, weights, ids, expert_map=expert_map, out=out)
        widened = pk.fused_moe(x.float(), *packed, weights, ids, expert_map=expert_map)
    assert result.data_ptr() == out.data_ptr() and out.dtype == dtype
    pair_dots = dtype == torch.bfloat16 and _native.bf16_dot_path() != "bf16 widened to float32"
    if pair_dots:
        for t in (0, tokens // 2, tokens - 1):
            with pk.use_backend("native"):
                alone = pk.fused_moe(x[t:t + 1], *packed, weights[t:t + 1], ids[t:t + 1], expert_map=expert_map)
            assert torch.equal(alone[0], out[t]), t
    else:
        assert torch.equal(out, widened.to(dtype))
    reference = moe_reference(x, w13, w2, weights, ids, expert_map=expert_map,
                              activation_dtype=torch.bfloat16 if pair_dots else None)
    assert_moe_close(out, reference, torch.finfo(dtype).eps / 2 + 2e-5)
    if expert_parallel:
        assert torch.equal(out[0], torch.zeros(hidden, dtype=dtype))


@needs_native
def test_this_build_uses_avx512_bf16_where_the_cpu_has_it():
    """On a CPU with AVX512-BF16 the default build (-march=native) multiplies bf16 in pair dot products, so the tests
    above ran the instruction itself."""
    if "avx512_bf16" not in _native.cpu_flags():
        pytest.skip("this CPU lacks AVX512-BF16: the pair-dot kernels are compiled (test_avx512_bf16_builds) and run "
                    "emulated (test_avx512_bf16_kernels_emulated) here")
    if _native.native_march() != "native" or _native.native_extra_flags():
        pytest.skip(f"this run builds for -march={_native.native_march()} {' '.join(_native.native_extra_flags())}")
    assert _native.bf16_dot_path() == "AVX512-BF16"


def _run(script_or_args: list[str], env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *script_or_args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(not NATIVE or os.uname().machine != "x86_64", reason="needs a C compiler on x86-64")
def test_avx512_bf16_kernels_emulated(tmp_path):
    """The AVX512-BF16 kernels (pair dot products, weight pairs unpacked within 128-bit lanes and the sums put back
    in column order, odd K, the query-key tiles of 4 and 1 keys, the LoRA shrink's and expand's pairs and odd ranks)
    built for AVX2 with the one instruction emulated, in a process of their own: the numerics tests of this file and
    test_lora.py's bf16 native ones pass on them. Built at -O1 (half the compile time of -O3): this build checks what
    the kernels compute, not how fast."""
    env = {**os.environ, "PAGEDKERNELS_NATIVE_MARCH": "x86-64-v3", "PAGEDKERNELS_CACHE_DIR": str(tmp_path),
           "PAGEDKERNELS_NATIVE_CFLAGS": "-DPK_EMULATE_AVX512BF16 -O1"}
    lora = os.path.join(os.path.dirname(__file__), "test_lora.py")
    # not the AMX tile kernel's tests: a build for AVX2 has no tiles (they run natively where a Xeon has them)
    select = ("test_bf16_cpu and (float64 or same_bits) and not amx or test_lora and bfloat16 and "
              "(native or same_bits)")
    script = ("import sys, pytest\nfrom pagedkernels import _native\n"
              "assert _native.bf16_dot_path() == 'AVX512-BF16 (emulated)', _native.bf16_dot_path()\n"
              f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {__file__!r}, {lora!r}, '-k', {select!r}]))")
    proc = _run(["-c", script], env)
    assert proc.returncode == 0 and " passed" in proc.stdout and "skipped" not in proc.stdout \
        and "deselected" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


# Zen 4's ISA for a GCC without -march=znver4 (GCC 12.2 and older): Zen 3's plus the AVX-512 subsets Zen 4 has.
_ZEN4_FLAGS = ("-mavx512f", "-mavx512cd", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512ifma", "-mavx512vbmi",
               "-mavx512vbmi2", "-mavx512vnni", "-mavx512bitalg", "-mavx512vpopcntdq", "-mavx512bf16", "-mgfni",
               "-mvaes", "-mvpclmulqdq")


def _accepts_march(march: str) -> bool:
    proc = subprocess.run([_native.c_compiler(), f"-march={march}", "-x", "c", "-E", "-"], input="",
                          capture_output=True, text=True)
    return proc.returncode == 0


@pytest.mark.skipif(not NATIVE or os.uname().machine != "x86_64", reason="needs a C compiler on x86-64")
@pytest.mark.parametrize("target", ["sapphirerapids", "znver4"])
def test_avx512_bf16_builds(target, tmp_path):
    """The library builds for an AMX Xeon (Sapphire Rapids) and for Zen 4 (AVX512-BF16, no AMX) with this compiler,
    and its bf16 kernels take the pair-dot path there: the built library holds vdpbf16ps (none otherwise: the
    kernels' other paths never emit it)."""
    march, extra = target, ()
    if target == "znver4" and not _accepts_march("znver4"):
        march, extra = "znver3", _ZEN4_FLAGS
    if not _accepts_march(march):
        pytest.skip(f"{_native.c_compiler()} does not know -march={march}")
    flags = {"PAGEDKERNELS_NATIVE_MARCH": march, "PAGEDKERNELS_NATIVE_CFLAGS": " ".join(extra)}
    with mock.patch.dict(os.environ, flags):
        graph_c = tmp_path / "graph_cpu.c"
        graph_c.write_text(_native.graph_source())
        built = tmp_path / "lib.so"
        proc = _native.build(_native.c_compiler(), _native.SOURCES + (graph_c,), built)
    assert proc.returncode == 0, proc.stderr[-3000:]
    disassembly = subprocess.run(["objdump", "-d", str(built)], capture_output=True, text=True).stdout
    assert "vdpbf16ps" in disassembly
    assert ("tdpbf16ps" in disassembly) == (target == "sapphirerapids")   # the AMX tile kernel: Xeons only
