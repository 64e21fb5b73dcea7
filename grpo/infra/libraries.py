"""Importing bitsandbytes (for its 8-bit AdamW and 4-bit layers, and inside peft) without a line it logs that
names nothing to fix."""
from __future__ import annotations

import logging

# bitsandbytes 0.50's CPU backend, at import on a CPU with AVX512-BF16, logs a warning when the optional
# `kernels` package cannot fetch its faster 4-bit inference kernel from the Hub (not installed, no network, or
# not trusted): it then uses its own CPU kernel, as it does everywhere else.
_KERNEL_NOTICE = ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community")


def import_bitsandbytes():
    """bitsandbytes, imported with that one line dropped (the first import logs it; peft's import of it is the
    same import, so import this first)."""
    logger = logging.getLogger(_KERNEL_NOTICE[0])

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_KERNEL_NOTICE[1])

    logger.addFilter(keep)
    try:
        import bitsandbytes
    finally:
        logger.removeFilter(keep)
    return bitsandbytes
