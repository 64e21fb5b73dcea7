"""Stopping cleanly on SIGINT (Ctrl-C) and SIGTERM (preemption). While a step is still generating or
back-propagating, nothing has touched the weights, so the step is abandoned (the trainer rolls it back); once
the optimizer runs, the step is finished. Either way the trainer then saves and raises TrainingInterrupted. A
second signal stops at once, without saving."""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from pathlib import Path

from ..errors import resume_hint

_installed: StopSignals | None = None  # whose handlers are in force: a process has one handler per signal


class StepAbandoned(Exception):
    """Raised inside the abandonable part of a step when a stop signal arrives."""


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on signal `signum` after `step` steps; `checkpoint` holds them (None when nothing is
    saved: `unsaved` says why). A KeyboardInterrupt, as Ctrl-C's own would be; its message says how to resume."""

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
        self._previous, self._outer = {}, None

    def __enter__(self) -> StopSignals:
        global _installed
        if threading.current_thread() is threading.main_thread():  # Python only lets it set handlers
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
            self._outer, _installed = _installed, self
        return self

    def __exit__(self, *exc) -> None:
        global _installed
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._previous:
            _installed = self._outer

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

    @contextlib.contextmanager
    def atomic(self):
        """A part of the abandonable step that a signal must not cut in two: one arriving inside abandons the
        step (StepAbandoned) when it has run to its end."""
        if not self._abandonable:
            yield
            return
        self._abandonable = False
        try:
            yield
        finally:
            self._abandonable = self.received is None
        if self.received is not None:
            raise StepAbandoned

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


def atomic():
    """`StopSignals.atomic` of the handlers in force, for code that is not handed them (run/ahead.py)."""
    return _installed.atomic() if _installed is not None else contextlib.nullcontext()
