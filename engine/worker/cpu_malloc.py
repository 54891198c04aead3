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
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc's malloc.h
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
