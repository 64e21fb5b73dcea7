"""Serves TRL's `zen` data sets offline (a patched `datasets.load_dataset`, set before the test module imports
it) from the parquet files the harness wrote, and stops any one test after TRL_TESTS_TIMEOUT seconds.

Without a GPU, transformers' TrainingArguments refuse bf16 ("doesn't support bf16/gpu") unless use_cpu is set,
and TRL's GRPOConfig turns bf16 on by default, so on a CPU-only machine every TRL test would stop there. bf16
autocast runs on CPUs, so that check is told the truth for this setting (the test file was written for
machines with accelerators). It changes nothing for a trainer that does not use that check."""
import os
import signal
from pathlib import Path

import datasets
import pytest
import torch
import transformers.training_args

if not torch.cuda.is_available():
    transformers.training_args.is_torch_bf16_gpu_available = lambda *args, **kwargs: True

_REAL_LOAD = datasets.load_dataset
_DATA = Path(os.environ["TRL_TESTS_DATA"])


def _load(path, name=None, split=None, streaming=False, **kwargs):
    folder = _DATA / str(path).replace("/", "--") / str(name)
    if not folder.is_dir():
        return _REAL_LOAD(path, name, split=split, streaming=streaming, **kwargs)
    files = {p.stem: str(p) for p in sorted(folder.glob("*.parquet"))}
    return _REAL_LOAD("parquet", data_files=files, split=split, streaming=streaming)


datasets.load_dataset = _load


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    def stop(signum, frame):
        raise TimeoutError(f"test ran past {limit}s (TRL_TESTS_TIMEOUT)")

    limit = int(os.environ.get("TRL_TESTS_TIMEOUT", "300"))
    signal.signal(signal.SIGALRM, stop)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
