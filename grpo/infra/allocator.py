"""Giving freed memory back to the OS on a CPU run (glibc's malloc): a fixed mmap threshold (`MMAP_THRESHOLD`)
gives every larger block its own mapping, unmapped when torch frees it (why, and why 1 MB: docs/memory-planner.md,
"Memory on a CPU"). While decoding (`decoding_allocations`) the threshold is 32 MB: a decode frees and reallocates
the same few blocks each step, which at 1 MB are fresh mappings to fault in."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys

MMAP_THRESHOLD = 1024 * 1024
DECODING_MMAP_THRESHOLD = 32 * 1024 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 -- musl and other C libraries lack them
        return libc
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold for this process (Linux with glibc; elsewhere nothing happens). A threshold
    given in the environment (`MALLOC_MMAP_THRESHOLD_`) is the user's choice and wins. True when set here."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _libc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


@contextlib.contextmanager
def decoding_allocations(threshold_set: bool):
    """Within the context, DECODING_MMAP_THRESHOLD; after it, MMAP_THRESHOLD again and the heap's free memory
    given back (malloc_trim). Only where `return_freed_memory` set the threshold (`threshold_set`)."""
    libc = _libc() if threshold_set else None
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, DECODING_MMAP_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.malloc_trim(0)
