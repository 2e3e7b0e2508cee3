"""Keep the memory a CPU training step frees for the next step, instead of handing it back to the kernel (glibc).

A training step allocates and frees the same large tensors every step (the [rows, vocabulary] fp32 logits of a
DSpark step). glibc's malloc serves blocks above its mmap threshold (at most 32 MB when left to adapt) with a fresh
mapping and unmaps it on free, so every step faults in and zeroes those pages again, in the kernel's time.
`keep_freed_memory()` serves blocks up to 1 GiB from the heap and never trims it, so each step reuses the
previous step's pages; the price is a peak RSS that holds the heap's high-water mark (docs/results.md, "What the
implementation costs", has both). A no-op elsewhere than Linux with glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # blocks from 1 GiB up still get their own mapping
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: the largest, i.e. never trim in practice


def keep_freed_memory() -> bool:
    """Set glibc's malloc to reuse freed blocks (module docstring) for the rest of the process; True if it did."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
