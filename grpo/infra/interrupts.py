"""Stopping cleanly on SIGINT (Ctrl-C) and SIGTERM (preemption). While a step is still generating or
back-propagating, nothing has touched the weights, so the step is abandoned (the trainer rolls it back);
once the optimizer runs, the step is finished. Either way the trainer then saves and raises
TrainingInterrupted (a KeyboardInterrupt). A second signal stops at once, without saving."""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from pathlib import Path

from ..errors import resume_hint


class StepAbandoned(Exception):
    """Raised inside the abandonable part of a step when a stop signal arrives."""


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on signal `signum` after `step` steps; `checkpoint` holds them (None before step 1, or
    when nothing is saved: `unsaved` says why). A KeyboardInterrupt, as Ctrl-C's own would be, so code that
    stops on one stops on this; its message says how to resume, in the caller's language."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, unsaved: str = "nothing to save yet"):
        self.signum, self.step, self.checkpoint, self.unsaved = signum, step, checkpoint, unsaved
        self.summary = f"interrupted by {signal.Signals(signum).name} after step {step}"
        saved = f"saved {checkpoint}; to resume, set {resume_hint()}" if checkpoint is not None else unsaved
        super().__init__(f"{self.summary}: {saved}")


class StopSignals:
    """While entered (in the main thread), SIGINT and SIGTERM set `received` instead of killing the process."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: int | None = None
        self._abandonable = False
        self._previous = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python only lets it set handlers
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    @contextlib.contextmanager
    def abandonable(self):
        """The part of a step a signal may cut short: generation and backward, before any update."""
        if self.received is not None:
            raise StepAbandoned
        self._abandonable = True
        try:
            yield
        finally:
            self._abandonable = False

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            print(f"\n{name} again: stopping now, without saving", file=sys.stderr, flush=True)
            raise SystemExit(128 + signum)
        self.received = signum
        print(f"\n{name}: saving a checkpoint, then stopping ({name} again stops now, without saving)",
              file=sys.stderr, flush=True)
        if self._abandonable:
            self._abandonable = False
            raise StepAbandoned
