"""engine/worker/cpu_malloc.py: on CPU, memory a step frees is reused by the next one, not faulted in again.

Each case runs in a subprocess: the setting is process-wide and lasts for the process."""

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# Five rounds of a forward's worth of activations (megabytes each, written, then freed), after one round to warm
# up: the page faults of those five rounds, and the pages they write.
CHURN = textwrap.dedent("""
    import resource, sys, torch
    from engine.worker import cpu_malloc
    from engine.platform import DevicePolicy

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def churn(sizes_mb):
        before = faults()
        for _ in range(5):
            live = [torch.ones(n << 18) for n in sizes_mb]
            del live
        return faults() - before

    if sys.argv[1] == "runner":   # what a CPU model runner does at start
        if DevicePolicy.for_device("cpu").keep_freed_host_memory:
            print("set", cpu_malloc.keep_freed_memory())
    sizes = [12, 3, 6, 1, 12, 8]
    churn(sizes)
    print(churn(sizes), 5 * sum(sizes) * 256)
""")

glibc_only = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"),
                                reason="the setting is glibc's malloc's")


def _churn(mode: str, **env) -> tuple[list[str], int, int]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    environ.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    out = subprocess.run([sys.executable, "-c", CHURN, mode], env=environ, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split("\n")
    faults, pages = map(int, out[-2].split())
    return out[:-2], faults, pages


@glibc_only
def test_freed_activations_are_reused_without_page_faults():
    """With the CPU policy's setting the rounds reuse the first round's memory. The same rounds in a process whose
    malloc gives freed blocks back at once (its own mapping for each, the heap trimmed on every free) fault every
    page in again: the count sees it. (glibc's defaults sit in between, by history: the mmap threshold rises to
    the largest mapped block freed so far, and a heap whose top is pinned by a small block is not trimmed.)"""
    _, faults, pages = _churn("default", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=131072:"
                                                        "glibc.malloc.trim_threshold=0")
    assert faults > pages / 2
    lines, faults, pages = _churn("runner")
    assert lines == ["set True"]
    assert faults < pages / 50


@glibc_only
def test_malloc_settings_of_the_environment_are_left_alone():
    """A user who set when glibc's malloc gives memory back (MALLOC_*_ or GLIBC_TUNABLES) keeps it; other settings
    of malloc do not stop the engine's."""
    for env in ({"MALLOC_TRIM_THRESHOLD_": "0"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}):
        lines, faults, pages = _churn("runner", **env)
        assert lines == ["set False"] and faults > pages / 2, env
    lines, _, _ = _churn("runner", MALLOC_ARENA_MAX="2")
    assert lines == ["set True"]


# --- prefault: the KV cache committed at start-up --------------------------------------------------------------

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="residency is read with Linux's mincore")


def _resident_fraction(tensor) -> float:
    """Share of the whole pages inside ``tensor``'s bytes that are in memory (mincore)."""
    import ctypes

    page = 4096
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
    pages = (end - start) // page
    vec = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


def _fresh_tensor(nbytes: int):
    """A float32 tensor on a fresh anonymous mapping, none of whose pages has been touched. (torch.empty cannot
    promise that: glibc's malloc may carve even a large block out of the free top of its heap, which the engine's
    setting keeps, written before, up to 1 GB.)"""
    import mmap
    import warnings

    import torch

    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.float32)


@linux_only
@pytest.mark.parametrize("path", ["madvise", "zeroed"])
def test_prefault_makes_a_fresh_tensor_resident(monkeypatch, path):
    """A tensor on a fresh mapping has no page in memory until written; prefault brings them all in, by
    MADV_POPULATE_WRITE or, where that is missing, by zeroing."""
    from engine.worker import cpu_malloc

    if path == "zeroed":
        monkeypatch.setattr(cpu_malloc, "_madvise", lambda: None)
    tensor = _fresh_tensor(64 << 20)
    assert _resident_fraction(tensor) < 0.1
    assert cpu_malloc.prefault(tensor, threads=2) == path
    assert _resident_fraction(tensor) == 1.0


@linux_only
@pytest.mark.parametrize("prefault", ["1", "0"])
def test_cpu_engine_commits_its_kv_cache_at_start_up(monkeypatch, llama_dir, prefault):
    """On CPU the runner's KV cache is committed (prefault) and in memory once the runner is built (the policy's
    default; the suite's conftest sets ENGINE_CPU_KV_PREFAULT=0 for its many engines), and left to its first writes
    with the variable at 0. (Whether memory is resident before then depends on where malloc took it from.)"""
    from engine.platform import DevicePolicy
    from engine.worker import cpu_malloc
    from engine.worker.model_runner import ModelRunner
    from tests.engine.models_util import engine_config

    assert DevicePolicy.for_device("cpu").prefault_kv_cache and not DevicePolicy.for_device("cuda").prefault_kv_cache
    committed = []
    real_prefault = cpu_malloc.prefault
    monkeypatch.setattr(cpu_malloc, "prefault", lambda t, *a, **k: committed.append(t.data_ptr()) or real_prefault(t))
    monkeypatch.setenv("ENGINE_CPU_KV_PREFAULT", prefault)
    config = engine_config(llama_dir, device="cpu", max_model_len=256, block_size=16,
                           num_kv_blocks=16384, max_num_seqs=8, max_num_batched_tokens=512)
    runner = ModelRunner(config)
    if prefault == "1":
        assert committed == [runner.kv_cache.data_ptr()] and _resident_fraction(runner.kv_cache) == 1.0
    else:
        assert committed == []


def _refusing_madvise(code: int):
    """A stand-in for libc's madvise that fails with errno ``code``."""
    import ctypes

    def madvise(addr, length, advice):
        ctypes.set_errno(code)
        return -1

    return lambda: madvise


@linux_only
def test_prefault_zeroes_where_the_kernel_lacks_populate_and_reports_missing_memory(monkeypatch):
    """A kernel before 5.14 answers EINVAL: the tensor is zeroed instead. ENOMEM is the system out of memory: a
    MemoryError, which the runner words with what to do about it."""
    import errno

    import torch

    from engine.worker import cpu_malloc

    tensor = torch.empty(1 << 20, dtype=torch.float32)
    monkeypatch.setattr(cpu_malloc, "_madvise", _refusing_madvise(errno.EINVAL))
    assert cpu_malloc.prefault(tensor) == "zeroed" and _resident_fraction(tensor) == 1.0
    monkeypatch.setattr(cpu_malloc, "_madvise", _refusing_madvise(errno.ENOMEM))
    with pytest.raises(MemoryError, match="not enough memory to commit 4.0 MiB"):
        cpu_malloc.prefault(tensor)


@linux_only
def test_a_kv_cache_the_system_cannot_commit_fails_the_start_with_what_to_do(monkeypatch, llama_dir):
    import errno

    from engine.worker import cpu_malloc
    from engine.worker.model_runner import ModelRunner
    from tests.engine.models_util import engine_config

    monkeypatch.setenv("ENGINE_CPU_KV_PREFAULT", "1")
    monkeypatch.setattr(cpu_malloc, "_madvise", _refusing_madvise(errno.ENOMEM))
    config = engine_config(llama_dir, device="cpu", max_model_len=256, num_kv_blocks=64, max_num_seqs=8,
                           max_num_batched_tokens=512)
    with pytest.raises(MemoryError, match="KV cache: not enough memory .*num_kv_blocks=.*ENGINE_CPU_KV_PREFAULT=0"):
        ModelRunner(config)


# oneDNN's and ideep's primitive caches: a float32 product on oneDNN for each of 120 row counts not seen before,
# memory in use (glibc's mallinfo2) before and after. The caches' settings are read when the first primitive is
# made: cpu_malloc.bound_onednn_caches runs before that, after torch is imported, as the model runner calls it.
NEW_SHAPES = textwrap.dedent("""
    import ctypes, json, os, sys, torch
    from engine.worker import cpu_malloc
    settings = cpu_malloc.bound_onednn_caches()
    libc = ctypes.CDLL("libc.so.6")
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    libc.mallinfo2.restype = Info
    w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(1536, 576), batch_size=64)
    linear = lambda x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    linear(torch.randn(3, 576))
    before = libc.mallinfo2().uordblks
    for rows in range(200, 320):
        linear(torch.randn(rows, 576))
    print(json.dumps({"settings": settings, "grew_mb": (libc.mallinfo2().uordblks - before) / 2**20}))
""")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or not torch.backends.mkldnn.is_available()
                    or not hasattr(torch.ops.mkldnn, "_linear_pointwise"),
                    reason="glibc's mallinfo2 and torch's oneDNN linear are needed")
def test_onednn_primitive_caches_are_bounded_unless_the_environment_says_otherwise():
    def run(**env):
        base = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
        out = subprocess.run([sys.executable, "-c", NEW_SHAPES], env={**base, "PYTHONPATH": str(ROOT), **env},
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    from engine.worker import cpu_malloc
    default = run()
    assert default["settings"] == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(cpu_malloc.ONEDNN_CACHE_CAPACITY),
                                   "LRU_CACHE_CAPACITY": str(cpu_malloc.ONEDNN_CACHE_CAPACITY)}
    tiny = run(ONEDNN_PRIMITIVE_CACHE_CAPACITY="4", LRU_CACHE_CAPACITY="4")
    assert tiny["settings"] == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "4", "LRU_CACHE_CAPACITY": "4"}   # left alone
    torch_default = run(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024")
    # The caches are what grows (120 new shapes: 4, 64 and all of them kept), and their setting holds. What a
    # primitive costs depends on the torch build (torch 2.13's CPU wheel: 1.2 / 27.8 / 72.0 MB; the GPU image's torch
    # 2.11: 0.12 / 2.4 / 4.5 MB), so the check is the shares: ~4/120 and ~64/120 of keeping them all.
    everything = torch_default["grew_mb"]
    assert everything > 1, torch_default
    assert tiny["grew_mb"] < min(8, 0.15 * everything), (tiny, torch_default)
    assert 0.2 * everything < default["grew_mb"] < 0.8 * everything, (tiny, default, torch_default)
