"""Where the batch of optimizer step s comes from (docs/architecture.md names the interface): made in this process
when the step needs it (run/synchronous.Synchronous), or in a sampler process ahead of it (run/ahead.Ahead)."""
from __future__ import annotations

from .ahead import Ahead
from .synchronous import Synchronous


def supply(pipeline, state, schedule, total_steps: int, max_staleness: int | None, release=lambda: None):
    """The batches of a run's steps: made when the step needs it (`max_staleness` None) or ahead (run/ahead:
    `release` is what the trainer frees when the sampler process starts)."""
    if max_staleness is None:
        return Synchronous(lambda step: pipeline.make(step, state), schedule, pipeline.policy.device,
                           close=pipeline.close)
    return Ahead(pipeline, state, schedule, total_steps, max_staleness, release=release)
