"""Giving freed memory back to the OS on a CPU run (glibc's malloc).

glibc serves blocks under its mmap threshold from heaps it keeps, and raises that threshold up to 32 MB each time
a bigger block is freed. A training step allocates and frees hundreds of such blocks (a layer's activations and
their gradients, a decoding step's logits): the heaps grow to the largest set ever live at once, plus their
fragmentation, and stay that size. A fixed threshold puts every block of `MMAP_THRESHOLD` bytes or more in its own
mapping, unmapped when torch frees it.

1 MB. Measured, one thread, LoRA with gradient checkpointing:
- SmolLM2-135M (30 layers, activations of 5-13 MB), forward + backward of 8 x 255 tokens: peak 4.15 GB and 69 CPU s
  at a 16 MB threshold (2.6 GB of it freed blocks the heap kept: malloc_trim gave them back), 1.59 GB / 77 s at
  4 MB, 1.35 GB / 78 s at 1 MB, 1.35 GB / 79 s at 128 KB.
- The benchmark model of benchmarks/vs_trl.py (4 layers, 151,936-token vocabulary), one step: peak 2.25 GB and
  84 CPU s by default, 1.77 GB / 87 s at 16 MB, 1.44 GB / 101 s at 128 KB: a decoding step's logits (5-10 MB,
  hundreds per step) become fresh mappings, whose page faults cost CPU time.
Memory first: a deep model's peak was 3x its live memory at 16 MB. `MALLOC_MMAP_THRESHOLD_` in the environment
chooses another threshold (16777216: faster decoding at a large vocabulary, more memory).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

MMAP_THRESHOLD = 1024 * 1024
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
