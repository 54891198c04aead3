"""The native CPU kernels' build and backend selection (their numerics are checked by the attention
and cache-op suites under backend "native")."""

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

import pagedkernels as pk
from pagedkernels import _native


@pytest.mark.skipif(_native.c_compiler() is None, reason="no C compiler on this machine")
def test_library_builds_where_a_compiler_exists():
    assert _native.library() is not None, _native.build_error()


def test_auto_backend_uses_native_on_cpu(monkeypatch):
    if _native.library() is None:
        pytest.skip(f"native kernels unavailable here: {_native.build_error()}")
    calls = []
    real = _native.paged_attention
    monkeypatch.setattr(_native, "paged_attention", lambda *a: calls.append(a) or real(*a))
    q = torch.randn(2, 4, 64)
    cache = torch.randn(4, 16, 2, 64)
    with pk.use_backend("auto"):
        pk.paged_decode_attention(q, cache, cache, torch.tensor([[0], [1]], dtype=torch.int32),
                                  torch.tensor([3, 16], dtype=torch.int32))
    assert len(calls) == 1


def test_disabled_native_falls_back_under_auto_and_explains_under_native(tmp_path):
    script = (
        "import torch, pagedkernels as pk\n"
        "q = torch.randn(1, 2, 64); c = torch.randn(2, 16, 1, 64)\n"
        "t = torch.zeros(1, 1, dtype=torch.int32); n = torch.tensor([5], dtype=torch.int32)\n"
        "pk.paged_decode_attention(q, c, c, t, n)\n"
        "pk.set_backend('native')\n"
        "try:\n"
        "    pk.paged_decode_attention(q, c, c, t, n)\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**__import__("os").environ, "PAGEDKERNELS_NATIVE": "0",
                               "PAGEDKERNELS_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "ERR pagedkernels native CPU kernels are unavailable: disabled by PAGEDKERNELS_NATIVE=0" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # nothing was built


def test_broken_compiler_reports_its_output(tmp_path):
    script = (
        "from pagedkernels import _native\n"
        "assert _native.library() is None\n"
        "print(_native.build_error())\n"
    )
    fake_cc = tmp_path / "cc"
    fake_cc.write_text("#!/bin/sh\necho 'fatal: no compiler today' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**__import__("os").environ, "CC": str(fake_cc),
                               "PAGEDKERNELS_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    assert "fatal: no compiler today" in proc.stdout


def _native_or_skip():
    if _native.library() is None:
        pytest.skip(f"native kernels unavailable here: {_native.build_error()}")


def test_native_rejections_name_the_value_and_write_nothing():
    """The native kernels check the values that index memory themselves (no separate pass in Python);
    on a bad one they write nothing and the op raises the same ValueError as the other backends."""
    _native_or_skip()
    g = torch.Generator().manual_seed(0)
    with pk.use_backend("native"):
        # rotary: a position past the cos/sin cache
        q = torch.randn(3, 2, 64, generator=g)
        k = torch.randn(3, 1, 64, generator=g)
        q0, k0 = q.clone(), k.clone()
        cache = pk.compute_cos_sin_cache(8, 64, 10000.0)
        with pytest.raises(ValueError, match="positions must lie in"):
            pk.rotary_embedding(torch.tensor([0, 8, 1]), q, k, cache)
        assert torch.equal(q, q0) and torch.equal(k, k0)
        # reshape_and_cache: a slot past the cache
        kc, vc = torch.zeros(2, 4, 1, 64), torch.zeros(2, 4, 1, 64)
        with pytest.raises(ValueError, match="slot_mapping: slot 8 is out of range"):
            pk.reshape_and_cache(k, k, kc, vc, torch.tensor([0, 8, 1]))
        assert not kc.any() and not vc.any()
        # prefill attention: a block id past the cache
        kc, vc = torch.randn(2, 4, 1, 64, generator=g), torch.randn(2, 4, 1, 64, generator=g)
        out = torch.full((3, 2, 64), 7.0)
        with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = 2 is out of range"):
            pk.paged_prefill_attention(q, kc, vc, torch.tensor([[0], [2]], dtype=torch.int32),
                                       torch.tensor([0, 2, 3], dtype=torch.int32),
                                       torch.tensor([2, 1], dtype=torch.int32), out=out)
        assert (out == 7.0).all()


def test_native_elementwise_ops_run_under_auto(monkeypatch):
    _native_or_skip()
    calls = []
    for name in ("rms_norm", "rotary_embedding", "silu_and_mul"):
        real = getattr(_native, name)
        monkeypatch.setattr(_native, name, lambda *a, _real=real, _n=name: calls.append(_n) or _real(*a))
    x, w = torch.randn(4, 32), torch.ones(32)
    with pk.use_backend("auto"):
        pk.rms_norm(x, w, 1e-6)
        pk.fused_add_rms_norm(x, torch.randn(4, 32), w, 1e-6)
        pk.rotary_embedding(torch.arange(4), torch.randn(4, 2, 64), None, pk.compute_cos_sin_cache(4, 64, 1e4))
        pk.silu_and_mul(torch.randn(4, 64))
    assert calls == ["rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"]


# What runs each op (decode, prefill, rms_norm, rotary, silu_and_mul, reshape_and_cache, in that
# order) on CPU tensors, per backend: (module, attribute) of the implementation.
_CPU_IMPLEMENTATIONS = {
    "native": [("_native", "paged_attention"), ("_native", "paged_attention"), ("_native", "rms_norm"),
               ("_native", "rotary_embedding"), ("_native", "silu_and_mul"), ("_native", "reshape_and_cache")],
    # the norms, rotary, the activation and the cache write are inline PyTorch in their ops
    "torch": [("decode_attention", "_decode_torch"), ("prefill_attention", "_prefill_attention_torch")],
}


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_cpu_backends_run_bf16_themselves(backend, monkeypatch):
    """bf16 on the CPU is computed by the selected backend's own code (only the Triton interpreter is
    wrong on bf16, so only its cases skip), not handed to another path; the numerics are the suites'
    bf16 cases."""
    import importlib

    if backend == "native" and _native.library() is None:
        pytest.skip(f"native kernels unavailable here: {_native.build_error()}")
    calls = []
    for module_name, attr in set(_CPU_IMPLEMENTATIONS[backend]):
        module = importlib.import_module(f"pagedkernels.{module_name}")
        real = getattr(module, attr)
        monkeypatch.setattr(module, attr, lambda *a, _real=real, _key=(module_name, attr): calls.append(_key)
                            or _real(*a))
    bf16 = torch.bfloat16
    q = torch.randn(2, 4, 64).to(bf16)
    cache = torch.randn(4, 16, 2, 64).to(bf16)
    tables, lens = torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([3, 16], dtype=torch.int32)
    x = torch.randn(3, 128).to(bf16)
    with pk.use_backend(backend):
        pk.paged_decode_attention(q, cache, cache, tables, lens)
        pk.paged_prefill_attention(q, cache, cache, tables, torch.tensor([0, 1, 2], dtype=torch.int32), lens)
        pk.rms_norm(x, torch.ones(128, dtype=bf16), 1e-6)
        pk.rotary_embedding(torch.tensor([0, 5]), q, q[:, :2].clone(), pk.compute_cos_sin_cache(8, 64, 1e4))
        pk.silu_and_mul(x)
        pk.reshape_and_cache(q[:, :2], q[:, 2:], cache, cache.clone(), torch.tensor([1, 17]))
    assert calls == _CPU_IMPLEMENTATIONS[backend]


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _scattered_cache(lens, block_size, num_kv_heads, head_dim, spare_blocks, g):
    """float32 key and value caches with ``spare_blocks`` unused blocks, and block tables giving each sequence of
    ``lens`` its blocks in a random order of the cache."""
    num_blocks = sum(-(-n // block_size) for n in lens) + spare_blocks
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    order = torch.randperm(num_blocks, generator=g)
    tables, used = torch.zeros(len(lens), max(-(-n // block_size) for n in lens), dtype=torch.int32), 0
    for s, n in enumerate(lens):
        blocks = -(-n // block_size)
        tables[s, :blocks] = order[used:used + blocks].to(torch.int32)
        used += blocks
    return key_cache, value_cache, tables


@pytest.mark.parametrize("lens,window,softcap,fp8", [([300], None, None, False), ([300, 70], None, None, False),
                                                     ([257], 100, None, False), ([190, 0], None, 30.0, False),
                                                     ([300], None, None, True)])
def test_native_decode_splits_the_keys_of_few_sequences(lens, window, softcap, fp8):
    """One or two decoding sequences give fewer (sequence, KV head) items than the threads want: the native
    decode splits their keys in ranges and merges the partial softmaxes. Against the PyTorch twin: a sliding
    window (early ranges see no key), softcap, an empty sequence (zeros), an fp8 cache with its scales."""
    _native_or_skip()
    g = torch.Generator().manual_seed(sum(lens))
    block_size, num_kv_heads, group, head_dim = 16, 3, 3, 64
    key_cache, value_cache, tables = _scattered_cache(lens, block_size, num_kv_heads, head_dim, 2, g)
    if fp8:
        key_cache, value_cache = key_cache.to(torch.float8_e4m3fn), value_cache.to(torch.float8_e4m3fn)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kwargs = dict(sliding_window=window, softcap=softcap, k_scale=0.5 if fp8 else 1.0, v_scale=2.0 if fp8 else 1.0)
    with pk.use_backend("native"), torch_threads(2):
        got = pk.paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, **kwargs)
    with pk.use_backend("torch"):
        expected = pk.paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, **kwargs)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    assert not got[seq_lens == 0].any()


@pytest.mark.parametrize("num_kv_heads,group,head_dim,cache,window,softcap", [
    (3, 3, 64, torch.float32, None, None), (4, 2, 32, torch.float16, 50, 20.0),
    (2, 4, 64, torch.float8_e4m3fn, None, None),
    (2, 40, 32, torch.float32, None, None),   # 80 query heads: more than one pass holds (MAX_GROUP 64)
    # groups past 4 heads of registers, with 3, 1 and 2 left over; head sizes of two value slices, none, and 16s
    (1, 7, 128, torch.float32, None, None), (2, 5, 80, torch.float16, None, None),
    (1, 6, 48, torch.float32, 40, None), (8, 1, 64, torch.bfloat16, None, None)])
def test_native_attention_takes_all_heads_of_a_sequence_in_one_pass(num_kv_heads, group, head_dim, cache, window,
                                                                     softcap):
    """Enough sequences for every thread: an item is a sequence (decode) or a chunk of its queries (prefill) with all
    its KV heads, which go through each tile of keys together (one pass over the blocks), or one head per pass where
    their query heads exceed the per-pass buffers. Against the PyTorch twin, decode and prefill, 16-bit and fp8
    caches, a sliding window and softcap, blocks in random order."""
    _native_or_skip()
    g = torch.Generator().manual_seed(num_kv_heads * group + head_dim)
    block_size, lens = 16, [37, 90, 1, 64, 130, 17, 48, 75, 5, 110]
    key_cache, value_cache, tables = _scattered_cache(lens, block_size, num_kv_heads, head_dim, 3, g)
    key_cache, value_cache = key_cache.to(cache), value_cache.to(cache)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scales = dict(k_scale=0.5, v_scale=2.0) if cache == torch.float8_e4m3fn else {}
    dtype = cache if cache in (torch.float16, torch.bfloat16) else torch.float32
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=g).to(dtype)
    kwargs = dict(sliding_window=window, softcap=softcap, **scales)
    with pk.use_backend("native"), torch_threads(2):
        got = pk.paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, **kwargs)
    with pk.use_backend("torch"):
        expected = pk.paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, **kwargs)
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype, 2e-5)
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    # prefill: each sequence's last q_len positions
    q_lens = [min(n, 20) for n in lens]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qp = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim, generator=g).to(dtype)
    with pk.use_backend("native"), torch_threads(2):
        got = pk.paged_prefill_attention(qp, key_cache, value_cache, tables, cu, seq_lens, **kwargs)
    with pk.use_backend("torch"):
        expected = pk.paged_prefill_attention(qp, key_cache, value_cache, tables, cu, seq_lens, **kwargs)
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.skipif(_native.library() is None, reason="native CPU kernels unavailable (no C compiler)")
def test_attention_prefetches_survive_the_compiler(tmp_path):
    """The decode/prefill kernel's prefetches are its only access to the next tiles' rows before it reads them, and a
    helper whose only effects are prefetches is a const function to GCC (its calls were deleted at -O1 and up):
    the kernel's source, built as the library is, still has prefetch instructions."""
    _compile_alone(Path(_native.__file__).parent / "csrc" / "paged_attention_cpu.c", tmp_path / "out.s", "-S")
    assert "prefetch" in (tmp_path / "out.s").read_text()


def _compile_alone(source: Path, dst: Path, *extra: str, march: str | None = None) -> str:
    """Compile ``source`` by itself with the library's own flags (for ``march`` if given) plus ``extra``, into
    ``dst``; returns the compiler's stderr."""
    with mock.patch.dict(os.environ, {"PAGEDKERNELS_NATIVE_MARCH": march} if march else {}):
        command = _native._compile_command(_native.c_compiler(), (source,), dst)
    command = [a for a in command if a not in ("-shared", "-fPIC", "-lm")] + list(extra)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def _gcc_vectorized_lines(source: Path, march: str, tmp_path: Path) -> set[int] | None:
    """Lines of ``source`` holding a loop that GCC vectorized, built with the library's own flags for ``march``
    (None when the compiler is not GCC: the report is GCC's -fopt-info)."""
    version = subprocess.run([_native.c_compiler(), "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" not in version:   # GCC's banner; clang's has none
        return None
    report = _compile_alone(source, tmp_path / "out.o", "-c", "-fopt-info-vec-optimized", march=march)
    return {int(m.group(1)) for m in re.finditer(re.escape(source.name) + r":(\d+):\d+: optimized: loop vectorized",
                                                  report)}


@pytest.mark.skipif(_native.library() is None or os.uname().machine != "x86_64", reason="needs a C compiler on x86-64")
@pytest.mark.parametrize("source_name, marker", [
    ("elementwise_cpu.c", "const float silu = "),                        # SiLU-and-mul: a select on the sign
    ("paged_attention_cpu.c", "const float w = j < n ? exp_nonpositive"),  # the softmax's tile mask
])
def test_loops_with_selects_vectorize_without_avx512(source_name, marker, tmp_path):
    """Built for AVX2 (x86-64-v3: no mask registers), a loop whose body has a float select is vectorized only if
    the compiler may if-convert a comparison, which GCC's default -ftrapping-math forbids (it might raise
    "invalid"): GCC 12 left SiLU-and-mul element by element there, 12x slower than vectorized. The library's
    flags let it."""
    source = Path(_native.__file__).parent / "csrc" / source_name
    lines = source.read_text().splitlines()
    marked = [i + 1 for i, line in enumerate(lines) if marker in line]
    assert len(marked) == 1, marked
    # the loop's `for` is the nearest one above the marked line
    loop_line = next(i for i in range(marked[0], 0, -1) if lines[i - 1].lstrip().startswith("for ("))
    vectorized = _gcc_vectorized_lines(source, "x86-64-v3", tmp_path)
    if vectorized is None:
        pytest.skip("the check reads GCC's vectorization report (-fopt-info); this compiler is not GCC")
    # GCC names a loop by a line between its `for` and its body's first statements
    assert any(loop_line <= line <= marked[0] for line in vectorized), \
        f"{source_name}: the loop at {loop_line} is not vectorized; vectorized: {sorted(vectorized)}"


@pytest.mark.skipif(_native.library() is None or os.uname().machine != "x86_64", reason="needs a C compiler on x86-64")
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"])
def test_attention_portable_builds(march, portable_cache_dir):
    """The attention's vectors are the machine's width (16 floats with AVX-512, 8 with AVX2, 4 with SSE), and so are
    the heads a pass keeps in registers: the tests of the one-pass and split decode paths, again on builds for SSE2
    (x86-64) and AVX2 (x86-64-v3), each built afresh (once a session, shared
    with the other portable-build tests) and run in a process of its own."""
    env = {**os.environ, "PAGEDKERNELS_NATIVE_MARCH": march, "PAGEDKERNELS_CACHE_DIR": str(portable_cache_dir)}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "one_pass or splits_the_keys"], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and " passed" in proc.stdout and "skipped" not in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-2000:]
