"""Where the batch of optimizer step s comes from, behind one interface (`take(step)`, `for_checkpoint`,
`restore`, a context that ends what it started): the generation pipeline (rollout/pipeline.Pipeline) run in this
process when the step needs it (`Synchronous`), or by a sampler process ahead of the step (run/ahead.Ahead)."""
from __future__ import annotations

from ..rollout.batches import Generation
from .ahead import Ahead


def supply(pipeline, state, schedule, total_steps: int, max_staleness: int | None, release=lambda: None):
    """The batches of a run's steps: made when the step needs it (`max_staleness` None) or ahead (run/ahead:
    `release` is what the trainer frees when the sampler process starts). `state`: the run's TrainerState;
    `schedule` (settings/schedule.Schedule) says where generation batches start."""
    if max_staleness is None:
        return Synchronous(pipeline, schedule, state)
    return Ahead(pipeline, state, schedule, total_steps, max_staleness, release=release)


class Synchronous:
    """The batch of step s made by `pipeline` in this process when step s needs it: a new one where `schedule`
    starts a generation batch, else the one in training. `state`: the run's TrainerState."""

    def __init__(self, pipeline, schedule, state):
        self.pipeline, self.schedule, self.state = pipeline, schedule, state
        self.current: Generation | None = None  # the batch in training (None: none yet, or resumed elastically)

    def take(self, step: int) -> Generation:
        if self.current is None or self.schedule.starts_generation(step):
            self.current = self.pipeline.make(step, self.state)
        return self.current

    def for_checkpoint(self, step: int) -> None:
        """Nothing made ahead for a checkpoint to keep."""
        return None

    def restore(self, current: Generation | None, ahead=None) -> None:
        """A resumed run's batch in training (Session.resume)."""
        self.current = current

    def __enter__(self) -> Synchronous:
        return self

    def __exit__(self, *exc) -> None:
        self.pipeline.close()  # a server's adapters removed
