"""CPU tensors backed by transparent huge pages, for weights that a decode step streams whole.

A decode step of a small batch reads every weight once, and how fast memory streams in is its speed. With 4 KB
pages the hardware prefetchers stop at every page boundary and each page costs a TLB entry; Linux backs a 2 MB
aligned range with one huge page where the range is marked ``MADV_HUGEPAGE`` (THP in ``madvise`` or ``always``
mode) when it is first touched. Measured on a 2-core AMD EPYC (THP ``madvise``): SmolLM2's 16-bit weights for
one row through ``w16_gemm`` 8.05 -> 7.0 ms (33 -> 38 GB/s).

:func:`empty` is ``torch.empty`` for CPU tensors of at least 2 MB on Linux, aligned to 2 MB and advised before
anything touches them; everywhere else (other systems, THP off, smaller tensors, an advice refused) it is plain
``torch.empty``. The memory is a mapping of its own (``mmap``), 2 MB larger than the tensor, whose slack is never
touched (address space, not memory): memory from malloc may have been written before (glibc reuses what it freed,
and does so up to 32 MB with the engine's settings, engine/worker/cpu_malloc.py), and pages already in place stay
4 KB ones whatever the advice (measured: SmolLM2's weights on 178 MB of huge pages through mmap, on 70 MB through
malloc with those settings, single-stream decode 115-122 -> 89-117 tok/s).
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys
import warnings

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14   # Linux


@functools.lru_cache(maxsize=None)
def _madvise():
    """libc's madvise, or None where huge pages cannot be asked for."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor of ``shape`` and ``dtype``, backed by huge pages where it can be
    (see the module docstring)."""
    shape = tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if madvise is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    try:
        # Private: a shared anonymous mapping is shmem, whose huge pages are off by default. Unmapped when the
        # tensor's storage dies (the storage holds the mapping).
        mapping = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():   # an mmap is writable: the "non-writable buffer" warning does not apply
        warnings.simplefilter("ignore", UserWarning)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -buffer.data_ptr() % HUGE_PAGE
    if madvise(buffer.data_ptr() + offset, length, _MADV_HUGEPAGE) != 0:
        return torch.empty(shape, dtype=dtype)
    return buffer[offset:offset + nbytes].view(dtype).view(shape)
