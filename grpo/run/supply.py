"""Where the batch of optimizer step s comes from, behind one interface: `take(step)`; `current`, the batch in
training; `state_dict(step)` and `load_state_dict`, what a checkpoint keeps of the supply (run/session saves it
as one entry); `undone_on_failure()`, a failed or stopped step undone; a context that ends what it started. The
generation pipeline (rollout/pipeline.Pipeline) run in this process when the step needs it
(run/synchronous.Synchronous), or by a sampler process ahead of the step (run/ahead.Ahead)."""
from __future__ import annotations

from .ahead import Ahead
from .synchronous import Synchronous


def supply(pipeline, state, schedule, total_steps: int, max_staleness: int | None, release=lambda: None):
    """The batches of a run's steps: made when the step needs it (`max_staleness` None) or ahead (run/ahead:
    `release` is what the trainer frees when the sampler process starts). `state`: the run's TrainerState;
    `schedule` (settings/schedule.Schedule) says where generation batches start."""
    if max_staleness is None:
        return Synchronous(lambda step: pipeline.make(step, state), schedule, pipeline.policy.device,
                           close=pipeline.close)
    return Ahead(pipeline, state, schedule, total_steps, max_staleness, release=release)
