"""Giving freed memory back to the OS on a CPU run (glibc's malloc).

glibc serves blocks under its mmap threshold from heaps it keeps, and raises that threshold up to 32 MB each time
a bigger block is freed. A training step allocates and frees hundreds of such blocks (a layer's activations and
their gradients, a decoding step's logits): the heaps grow to the largest set ever live at once, plus their
fragmentation, and stay that size. On the benchmark model (benchmarks/profile_step.py) 0.7-0.9 GB of the
process's resident memory was memory freed but kept, more than the LoRA run's weights. A fixed threshold puts
every block of `MMAP_THRESHOLD` bytes or more in its own mapping, unmapped when torch frees it.

16 MB, not glibc's starting 128 KB: smaller blocks (a decoding step's logits, at 5-10 MB, hundreds per step) then
stay in the heap, where reusing them costs no page faults. Measured on that model, one thread, LoRA: peak
2.25 GB and 84 CPU s per step by default, 1.77 GB and 87 s at 16 MB, 1.44 GB and 101 s at 128 KB
(`MALLOC_MMAP_THRESHOLD_=131072` in the environment chooses that).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

MMAP_THRESHOLD = 16 * 1024 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold for this process (Linux with glibc; elsewhere nothing happens). A threshold
    given in the environment (`MALLOC_MMAP_THRESHOLD_`) is the user's choice and wins. True when set here."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
