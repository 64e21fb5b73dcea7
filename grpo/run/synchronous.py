"""`Synchronous`: the batch of step s made when step s needs it, and the batch in training that every step of a
generation batch trains on (run/ahead.Ahead keeps its batch in training with one)."""
from __future__ import annotations

import contextlib

from ..rollout.batches import Generation


class Synchronous:
    """The batch of optimizer step s (run/supply's interface): a new one made by `make(step)` where `schedule`
    starts a generation batch (or none is in training), else the one in training; `device`: where a resumed one
    is loaded; `close`: what ends with the run (a server's adapters removed)."""

    def __init__(self, make, schedule, device, close=lambda: None):
        self.make, self.schedule, self.device, self.close = make, schedule, device, close
        self.current: Generation | None = None  # the batch in training (None: none yet, or resumed elastically)

    def take(self, step: int) -> Generation:
        if self.current is None or self.schedule.starts_generation(step):
            self.current = self.make(step)
        return self.current

    def state_dict(self, step: int) -> dict:
        """What a checkpoint after `step` optimizer steps keeps: the batch in training when step `step` still
        trains on it, else None (a resumed run makes the next one)."""
        kept = self.current is not None and not self.schedule.starts_generation(step)
        return {"generation": self.current.state_dict() if kept else None}

    def load_state_dict(self, saved: dict) -> None:
        """The inverse of `state_dict`. As the run's supply, it makes anew a batch that a run sampling ahead kept
        (`saved["ahead"]`), from the prompt position and RNG state the checkpoint restores."""
        kept = saved["generation"]
        self.current = Generation.from_state_dict(kept, self.device) if kept is not None else None

    @contextlib.contextmanager
    def undone_on_failure(self):
        """A step that fails or is stopped inside leaves the batch in training as it found it."""
        before = self.current
        try:
            yield
        except BaseException:  # a stop signal's KeyboardInterrupt too
            self.current = before
            raise

    def __enter__(self) -> Synchronous:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
