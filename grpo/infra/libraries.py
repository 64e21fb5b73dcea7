"""Lines that libraries log and that name nothing to fix, dropped where they are logged: a filter on the library's
own logger. It is installed when grpo is imported, before any library is, because these lines come at import,
and that import can be anyone's: transformers imports peft, which imports bitsandbytes, from several places."""
from __future__ import annotations

import logging

# (logger, start of the message). Each is a notice after which the library goes on as it would anyway.
NOTICES = (
    # bitsandbytes 0.50's CPU backend, imported on a CPU with AVX512-BF16, tries to fetch a faster 4-bit inference
    # kernel from the Hub through the optional `kernels` package. When it cannot (not installed, no network, the
    # publisher not trusted, offline and not cached) it says so and uses its own CPU kernel, as on other CPUs.
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community"),
    # `kernels` (0.19) during that same fetch with HF_HUB_OFFLINE=1: it cannot ask the Hub who published it.
    ("kernels._internals.hf_hub", "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'"),
)


def _keep(record: logging.LogRecord) -> bool:
    return not any(record.name == name and str(record.msg).startswith(start) for name, start in NOTICES)


def quiet_library_notices() -> None:
    """The NOTICES dropped for the rest of the process (a second call adds nothing: `addFilter` keeps one)."""
    for name, _ in NOTICES:
        logging.getLogger(name).addFilter(_keep)
