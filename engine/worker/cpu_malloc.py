"""glibc's malloc set to keep the memory a CPU forward frees, for the next step to reuse.

By default glibc gives every allocation above ``M_MMAP_THRESHOLD`` its own mapping, unmapped again when freed
(the threshold starts at 128 KB and rises, up to 32 MB, to the largest such block freed so far), and hands the
free top of its heap back to the system past ``M_TRIM_THRESHOLD`` (twice that threshold). A forward's activations
are freed and allocated again, at every layer and every step (a 1024-token prefill chunk's are megabytes each);
memory given back comes back as fresh pages, each zeroed in a page fault when first written. Measured on a 2-core
AMD EPYC, SmolLM2-135M float32, the 48 prompts of ``bench.engine_cpu`` (3324 tokens): 205,000 page faults in
their prefill, 38,000 with the settings below (the rest are the KV cache's blocks, first written then).

vLLM's CPU backend gets the same from tcmalloc, preloaded by its launcher; a library loaded into a running
process cannot swap its allocator, but it can set glibc's (``mallopt``), as this module does once per process:
no mapping of its own below 32 MB (glibc's limit for the setting), and the heap's free top kept up to 1 GB. The
memory a process keeps so is at most what its steps had in use at once. Other C libraries, and a process whose
environment sets those settings of glibc's malloc itself (``MALLOC_TRIM_THRESHOLD_`` and the like, or in
``GLIBC_TUNABLES``), are left as they are.

:func:`prefault` commits a fresh tensor's pages at once (the KV cache, at start-up: see ``DevicePolicy``): Linux
gives anonymous memory a page at a time, each zeroed in a fault when first written, and a virtual machine whose
host backs guest memory lazily (and takes back what the guest frees) faults twice: measured on a 2-core AMD EPYC
Firecracker VM, 6.4 us a 4 KB page the first time, 1.1 us a page recycled within the guest.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import sys
import threading

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc's malloc.h
_MADV_POPULATE_WRITE = 23   # Linux 5.14+
_PAGE = 4096
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


# The settings of glibc's malloc that decide when freed memory goes back to the system.
_SETTINGS = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")


def _user_set_malloc() -> bool:
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(f"MALLOC_{name.upper()}_" in os.environ or f"glibc.malloc.{name}=" in tunables for name in _SETTINGS)


@functools.lru_cache(maxsize=None)
def keep_freed_memory() -> bool:
    """Set glibc's malloc as the module docstring says, once. Returns whether it is so set (False: not glibc,
    or the environment sets malloc itself)."""
    if not sys.platform.startswith("linux") or _user_set_malloc():
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version   # glibc only (musl has mallopt without these settings)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        logger.debug("glibc's mallopt refused the thresholds; malloc left as it is")
    return done


# oneDNN keeps every primitive it creates in a cache of its own (ONEDNN_PRIMITIVE_CACHE_CAPACITY), and ideep, torch's
# layer over it, the same in another (LRU_CACHE_CAPACITY): 1024 entries each by default. A primitive is made for
# each shape of product, and a step's row count is its shape: every prefill or mixed step of a row count not seen
# before adds one a distinct linear shape, ~0.55 MB with both caches (JIT-compiled code included). Measured on a
# 2-core AMD EPYC, SmolLM2-135M float32, prompts of 8-600 tokens one at a time, 100 a round: at the defaults the
# process grew 190-200 MB a round and kept growing (a server's RSS rose ~84 MB every thousand requests of a soak);
# with 256 or 512 entries each the memory in use stopped, but the heap's free holes between the cached primitives
# grew ~60 MB a round, unreturned; with 64 each the process stayed within 3 MB from the second round on. A decode
# step's row count (its batch size) comes back step after step and stays among the most recent; a primitive made
# again costs 0.7-3 ms (the same machine, [n, 576] x [576, 1536]).
ONEDNN_CACHE_CAPACITY = 64
_ONEDNN_CACHE_SETTINGS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches() -> dict[str, str]:
    """Set oneDNN's and ideep's primitive caches to :data:`ONEDNN_CACHE_CAPACITY` entries where the environment does
    not set them. Both read their setting when they first make a primitive, so this must run before any float32
    product on oneDNN in the process (the model runner calls it before it loads the model). Returns the settings."""
    for name in _ONEDNN_CACHE_SETTINGS:
        os.environ.setdefault(name, str(ONEDNN_CACHE_CAPACITY))
    return {name: os.environ[name] for name in _ONEDNN_CACHE_SETTINGS}


@functools.lru_cache(maxsize=None)
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def prefault(tensor, threads: int | None = None) -> str:
    """Make every page of a freshly allocated CPU tensor resident and writable now, instead of at its first write.
    Its values are unspecified afterwards (it must not hold data yet). Linux: ``MADV_POPULATE_WRITE`` over its
    pages (the kernel zeroes them; nothing is written from here), in ``threads`` slices at once (default: torch's
    threads; ctypes lets go of the GIL, and the faults of two vCPUs went twice as fast as one's); elsewhere, or
    where the kernel refuses it (before 5.14), the tensor is zeroed, which faults each page in the same way.
    Returns which of the two it did; raises MemoryError where the kernel answers that it has not the memory
    (ENOMEM)."""
    nbytes = tensor.numel() * tensor.element_size()
    madvise = _madvise()
    if madvise is not None and nbytes:
        # The whole pages the storage touches: populating changes no page's contents, so a page the tensor shares
        # with a neighbour at either end is populated as it is.
        start = tensor.data_ptr() // _PAGE * _PAGE
        pages = (-(-(tensor.data_ptr() + nbytes) // _PAGE) * _PAGE - start) // _PAGE
        threads = max(1, min(threads or torch.get_num_threads(), pages))
        bounds = [start + pages * i // threads * _PAGE for i in range(threads + 1)]
        errors = [0] * threads   # errno of each slice's call, 0 when it succeeded

        def populate(i: int) -> None:
            if madvise(bounds[i], bounds[i + 1] - bounds[i], _MADV_POPULATE_WRITE) != 0:
                errors[i] = ctypes.get_errno() or -1

        workers = [threading.Thread(target=populate, args=(i,)) for i in range(1, threads)]
        for worker in workers:
            worker.start()
        populate(0)
        for worker in workers:
            worker.join()
        if not any(errors):
            return "madvise"
        if errno.ENOMEM in errors:
            size = f"{nbytes / 2**30:.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / 2**20:.1f} MiB"
            raise MemoryError(f"not enough memory to commit {size} (MADV_POPULATE_WRITE: ENOMEM)")
        logger.debug("MADV_POPULATE_WRITE refused (errno %s); zeroing the tensor instead", errors)
    tensor.zero_()
    return "zeroed"
