"""The process's heap: memory a step frees is kept for the next step instead of returned to the kernel.

glibc hands every allocation of 32 MB or more (a layer's activations at a few hundred tokens) to the kernel by its
own `mmap`, and gives it back when freed, so the next micro-batch takes the same memory again page by page: one
BFCL update micro-batch of SmolLM2 (12 rollouts) faulted 400,000 to 1,000,000 pages, 1-3 s of its 12-15 s on this
machine's cores.  With the thresholds at their maximum the freed blocks stay in the heap and are reused: 0 faults
after the first micro-batch (docs/measured.md).  The price: the process keeps its peak memory until it exits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
LARGEST = 2**31 - 1  # mallopt takes an int
# A user's own settings of the same thresholds win.
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory() -> bool:
    """Keep freed memory in the heap (glibc's mmap and trim thresholds at their largest), once per process, before
    a run's first step.  False where the C library is not glibc or the environment sets the thresholds itself."""
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator is left as it is
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, LARGEST)) and bool(mallopt(M_TRIM_THRESHOLD, LARGEST))
