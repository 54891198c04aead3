"""pagedkernels._huge_pages: weights a decode step streams whole sit in memory advised for transparent huge pages
(2 MB aligned, MADV_HUGEPAGE) where the system offers them, and in plain memory elsewhere."""

from __future__ import annotations

import pytest
import torch

import pagedkernels as pk
from pagedkernels import _huge_pages
from pagedkernels.gguf_quant import gguf_interleave
from pagedkernels.w16_gemm import unpack_w16

ADVISES = _huge_pages._madvise() is not None


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not ADVISES, reason="no transparent huge pages to ask for here (not Linux, or THP never)")
def test_large_tensors_are_aligned_and_advised():
    t = _huge_pages.empty((3, 1 << 20), torch.float16)   # 6 MB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float16 and t.is_contiguous()
    assert t.data_ptr() % _huge_pages.HUGE_PAGE == 0
    assert "hg" in _vm_flags(t.data_ptr()), "the range is not marked MADV_HUGEPAGE"
    t.fill_(1.5)
    assert bool((t == 1.5).all())


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
