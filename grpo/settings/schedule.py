"""The batch schedule, resolved once from a Config and the number of ranks as TRL 1.16's GRPOConfig resolves it
(docs/recipes-and-settings.md, "The batch schedule"): a *micro-batch* is `per_device_train_batch_size` completions
on one rank, one forward and backward; an *optimizer step* accumulates `gradient_accumulation_steps` of them; a
*generation batch* is what one round of sampling draws, scored (advantages) as a whole."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class Schedule:
    world_size: int  # ranks
    num_generations: int  # G: completions per prompt
    micro_batch: int  # completions per micro-batch on each rank (per_device_train_batch_size)
    accumulation: int  # micro-batches per optimizer step (gradient_accumulation_steps)
    micro_batches_per_generation: int  # per rank; TRL's steps_per_generation
    num_iterations: int  # optimizer passes over each generation batch (TRL's num_iterations)

    @classmethod
    def resolve(cls, config, world_size: int = 1) -> Schedule:
        """The schedule of `config` (a Config, or anything with its batch fields) on `world_size` ranks: the
        micro-batches per generation batch from `steps_per_generation`, else from `generation_batch_size`
        (completions over all ranks), else `gradient_accumulation_steps`; stricter than TRL where the errors say."""
        per_device, accumulation = config.per_device_train_batch_size, config.gradient_accumulation_steps
        steps, generation_batch_size = config.steps_per_generation, config.generation_batch_size
        G = config.num_generations
        if steps is not None and generation_batch_size is not None:
            raise ConfigError("set steps_per_generation or generation_batch_size, not both (as in TRL)")
        if generation_batch_size is not None:
            if generation_batch_size % (per_device * world_size):
                raise ConfigError(f"generation_batch_size={generation_batch_size} must be a multiple of "
                                  f"per_device_train_batch_size x ranks = {per_device * world_size}")
            steps = generation_batch_size // (per_device * world_size)
        steps = accumulation if steps is None else steps
        if steps % accumulation:
            raise ConfigError(f"steps_per_generation={steps} must be a multiple of gradient_accumulation_steps="
                              f"{accumulation} here: a generation batch feeds whole optimizer steps")
        if (per_device * steps) % G:
            raise ConfigError(f"a generation batch of {per_device * steps} completions per rank (per_device_train_"
                              f"batch_size x steps_per_generation) must hold whole groups of num_generations={G}")
        return cls(world_size, G, per_device, accumulation, steps, config.num_iterations)

    @property
    def optimizer_steps_per_generation(self) -> int:
        """Optimizer steps one generation batch feeds: its micro-batches in steps, `num_iterations` times over."""
        return self.micro_batches_per_generation // self.accumulation * self.num_iterations

    @property
    def completions_per_generation(self) -> int:
        """Completions one rank samples per generation batch."""
        return self.micro_batches_per_generation * self.micro_batch

    @property
    def prompts_per_generation(self) -> int:
        """Prompts a generation batch draws over all ranks (each rank samples its share of whole prompts)."""
        return self.completions_per_generation * self.world_size // self.num_generations

    @property
    def prompts_per_micro_batch(self) -> int:
        """Whole prompts in a micro-batch's worth of completions, at least one (a group may span micro-batches)."""
        return max(1, self.micro_batch // self.num_generations)

    @property
    def global_batch(self) -> int:
        """Completions one optimizer step takes over all ranks."""
        return self.micro_batch * self.accumulation * self.world_size

    def starts_generation(self, step: int) -> bool:
        """Whether optimizer step `step` (0-based: the steps done before it) samples a new generation batch."""
        return step % self.optimizer_steps_per_generation == 0

    def micro_batches_of(self, step: int) -> slice:
        """The micro-batches of its generation batch that optimizer step `step` (0-based) trains on."""
        first = step % (self.micro_batches_per_generation // self.accumulation) * self.accumulation
        return slice(first, first + self.accumulation)

    def epochs_done(self, step: int, num_prompts: int) -> int:
        """Whole passes over `num_prompts` prompts drawn by the generation batches that the first `step` optimizer
        steps finished (an epoch ends with the generation batch that completes it)."""
        return step // self.optimizer_steps_per_generation * self.prompts_per_generation // num_prompts

    def ends_epoch(self, step: int, num_prompts: int) -> bool:
        """Whether optimizer step `step` (1-based) finished a pass over `num_prompts` prompts."""
        return self.epochs_done(step, num_prompts) > self.epochs_done(step - 1, num_prompts)

    def epoch(self, step: int, num_prompts: float) -> float:
        """transformers' `state.epoch` after the first `step` optimizer steps: passes over `num_prompts` prompts,
        each step counting for its share of its generation batch's prompts (`prompts_of`)."""
        return step * self.prompts_per_generation / (self.optimizer_steps_per_generation * num_prompts)

    def prompts_of(self, steps: int) -> float:
        """The prompts `steps` optimizer steps train on, each counting for its share of its generation batch's:
        with `epoch`, `steps` make one epoch of this many prompts."""
        return steps * self.prompts_per_generation / self.optimizer_steps_per_generation

    def total_steps(self, num_prompts: int, num_train_epochs: float, max_steps: int) -> int:
        """Optimizer steps of a run: `max_steps` when set, else enough generation batches for the epochs over
        `num_prompts` prompts, each feeding `optimizer_steps_per_generation` steps."""
        if max_steps > 0:
            return max_steps
        batches = max(1, math.ceil(num_train_epochs * num_prompts / self.prompts_per_generation))
        return batches * self.optimizer_steps_per_generation
