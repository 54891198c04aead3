"""pagedkernels._huge_pages: weights a decode step streams whole sit in memory advised for transparent huge pages
(2 MB aligned, MADV_HUGEPAGE) where the system offers them, and in plain memory elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pagedkernels as pk
from pagedkernels import _huge_pages
from pagedkernels.gguf_quant import gguf_interleave
from pagedkernels.w16_gemm import unpack_w16

ADVISES = _huge_pages._madvise() is not None


def mapping_field(address: int, field: str) -> list[str] | None:
    """The values of ``field`` (``VmFlags``, ``Rss``, ...) of the mapping of this process that holds ``address``
    (/proc/self/smaps), or None if no mapping holds it."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == f"{field}:":
                return line.split()[1:]
    return None


@pytest.mark.skipif(not ADVISES, reason="no transparent huge pages to ask for here (not Linux, or THP never)")
def test_large_tensors_are_aligned_and_advised():
    t = _huge_pages.empty((3, 1 << 20), torch.float16)   # 6 MB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float16 and t.is_contiguous()
    assert t.data_ptr() % _huge_pages.HUGE_PAGE == 0
    assert "hg" in mapping_field(t.data_ptr(), "VmFlags"), "the range is not marked MADV_HUGEPAGE"
    t.fill_(1.5)
    assert bool((t == 1.5).all())


# In a process of its own, whose malloc keeps freed memory up to 32 MB (as the engine sets it on CPU): megabytes
# allocated, written and freed, then a 20 MB tensor. Prints its range's resident kB before and after it is written,
# and after it is dropped (-1: no mapping holds it any more).
FRESH = textwrap.dedent("""
    import ctypes, gc, torch
    from pagedkernels import _huge_pages
    from tests.pagedkernels.test_huge_pages import mapping_field

    def rss(address):
        kb = mapping_field(address, "Rss")
        return -1 if kb is None else int(kb[0])

    libc = ctypes.CDLL(None)
    assert libc.mallopt(-3, 32 << 20) == 1 and libc.mallopt(-1, 1 << 30) == 1   # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    for _ in range(3):
        churn = [torch.ones(3 << 20) for _ in range(8)]   # 12 MB each, written
        del churn
    t = _huge_pages.empty((5, 1 << 20), torch.float32)
    address = t.data_ptr()
    before = rss(address)
    t.fill_(2.0)
    written = rss(address)
    del t
    gc.collect()
    print(before, written, rss(address))
""")


@pytest.mark.skipif(not ADVISES or not os.confstr("CS_GNU_LIBC_VERSION"),
                    reason="no transparent huge pages to ask for here (not Linux, or THP never), or not glibc")
def test_large_tensors_are_fresh_memory_of_their_own():
    """Pages already written stay 4 KB ones whatever the advice, and malloc hands out memory it freed before: the
    tensor's range is a mapping of its own, nothing of it resident before it is written, and it goes back to the
    system with the tensor."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", FRESH], env={**os.environ, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, check=True, timeout=120).stdout
    before, written, dropped = map(int, out.split())
    assert before == 0, f"{before} kB of the range were resident before it was written"
    assert written >= 20 << 10
    assert dropped == -1, "the mapping outlived its tensor"


def test_small_tensors_are_plain():
    t = _huge_pages.empty((4, 100), torch.float32)
    assert t.shape == (4, 100) and t.untyped_storage().nbytes() == 1600


@pytest.mark.parametrize("n,k", [(49152 // 8, 576), (70, 96)])
def test_packed_weights_hold_the_weight(n, k):
    """pack_w16 and gguf_interleave write their CPU results into such memory: the same values either way."""
    w = (torch.randn(n, k) / 8).to(torch.bfloat16)
    packed = pk.pack_w16(w)
    assert packed.is_contiguous() and torch.equal(unpack_w16(packed, n), w)
    if ADVISES and packed.numel() * 2 >= _huge_pages.HUGE_PAGE:
        assert packed.data_ptr() % _huge_pages.HUGE_PAGE == 0
    q = torch.randint(0, 256, (64, 18 * 8), dtype=torch.uint8)   # Q4_0: 8 blocks of 18 bytes a row
    inter = gguf_interleave(q, "Q4_0")
    assert inter.is_contiguous() and torch.equal(pk.gguf_deinterleave(inter, "Q4_0x8"), q)
