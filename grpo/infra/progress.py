"""Progress a person can see during long sampling and evaluation: a counter of generated tokens (with
tokens/s), advanced after every new token. On a terminal (or in a notebook) the bars are tqdm's; written to a
file or a pipe, a bar's carriage-return redraws would fill it, so each is a plain line every few seconds."""
from __future__ import annotations

import contextlib
import sys
import time

from tqdm.auto import tqdm

LINE_EVERY_S = 10.0  # seconds between two lines of a bar written to a file


def interactive() -> bool:
    """Whether stderr is read by a person as it is drawn: a terminal, or a notebook (tqdm.auto's widget)."""
    return sys.stderr.isatty() or "ipykernel" in sys.modules


def progress_bar(desc: str, total: int | None = None, initial: int = 0, unit: str = "it",
                 enabled: bool = True, leave: bool = True, smoothing: float = 0.3):
    """A tqdm bar on a terminal, else a `LineProgress`; either takes `update`, `set_postfix(_str)`,
    `close`. `smoothing` 0: the rate is the average since the start (LineProgress's always is)."""
    if interactive() or not enabled:
        return tqdm(desc=desc, total=total, initial=initial, unit=unit, leave=leave, dynamic_ncols=True,
                    mininterval=1.0, disable=not enabled, smoothing=smoothing)
    return LineProgress(desc, total, initial, unit)


def exclude_time(bar, seconds: float) -> None:
    """Leave `seconds` out of `bar`'s elapsed time and average rate (work timed apart, inside its run)."""
    if isinstance(bar, LineProgress):
        bar.start += seconds
    elif getattr(bar, "start_t", None) is not None:
        bar.start_t += seconds


class LineProgress:
    """A bar for a log file: `desc: n/total unit, rate, postfix` at most every `every` seconds, and once at
    the end, each a line of its own."""

    def __init__(self, desc: str, total: int | None = None, initial: int = 0, unit: str = "it"):
        self.desc, self.total, self.unit, self.every = desc, total, unit, LINE_EVERY_S
        self.n = self.start_n = initial
        self.start = self.last = time.monotonic()
        self.postfix, self.written = "", initial

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.every:
            self._write()

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:  # noqa: ARG002 -- tqdm's signature
        self.postfix = text

    def close(self) -> None:
        if self.n != self.written:
            self._write()

    def _write(self) -> None:
        now = time.monotonic()
        done = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        rate = (self.n - self.start_n) / max(now - self.start, 1e-9)
        parts = [f"{done} {self.unit}", f"{now - self.start:.0f}s", f"{rate:.3g} {self.unit}/s", self.postfix]
        print(f"{self.desc}: {', '.join(p for p in parts if p)}", file=sys.stderr, flush=True)
        self.last, self.written = now, self.n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def quiet_library_bars():
    """transformers' and datasets' own bars ("Writing model shards" while saving, "Generating train split"
    while reading a data file) off where they would fill a log file."""
    from datasets.utils import logging as datasets_logging
    from transformers.utils import logging as transformers_logging

    on = [] if interactive() else [library for library in (transformers_logging, datasets_logging)
                                   if library.is_progress_bar_enabled()]
    for library in on:
        library.disable_progress_bar()
    try:
        yield
    finally:
        for library in on:
            library.enable_progress_bar()


class TokenProgress:
    """`progress(n)` adds n generated tokens (the bar shows them and tokens/s); `progress.prompts_done(k, total)`
    shows k/total prompts in the postfix. After `progress.batch(start, size, total)` (a decode of prompts
    start..start+size, one row each: evaluation) the prompts done advance as rows finish. Use as a context
    manager; disabled, it does nothing."""

    def __init__(self, desc: str, enabled: bool = True):
        self.bar = progress_bar(desc, unit="tok", enabled=enabled, leave=False)
        self.rows = None  # (start, size, total) of the batch being decoded, one row per prompt

    def __call__(self, new_tokens: int) -> None:
        if self.rows is not None:  # rows that generated no token this step have finished
            start, size, total = self.rows
            self.prompts_done(start + size - int(new_tokens), total)
        self.bar.update(int(new_tokens))

    def prompts_done(self, done: int, total: int) -> None:
        self.bar.set_postfix_str(f"prompts {done}/{total}", refresh=False)

    def batch(self, start: int, size: int, total: int) -> None:
        self.rows = (start, size, total)
        self.prompts_done(start, total)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.rows is not None:
            start, size, total = self.rows
            self.prompts_done(start + size, total)
        self.bar.close()
