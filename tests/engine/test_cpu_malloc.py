"""engine/worker/cpu_malloc.py: on CPU, memory a step frees is reused by the next one, not faulted in again.

Each case runs in a subprocess: the setting is process-wide and lasts for the process."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
