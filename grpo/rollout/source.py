"""Where a step's rollouts come from (`RolloutSource.draw`): the next prompts, this rank's share sampled by the
engine and scored."""
from __future__ import annotations

import dataclasses
import time

from ..errors import ConfigError
from ..infra.allocator import decoding_allocations
from ..infra.progress import TokenProgress
from .batches import Rollout
from .environments import make_envs
from .prompts import PromptStream, PromptTooLong, per_completion
from .rewards import RewardContext, compute_rewards, warn_unscored
from .streams import PromptStreams


class RolloutSource:
    """`engine` (engines/engine.Engine) over the prompts of `prompts`, rewarded by `reward_funcs`; `settings`:
    settings/components.GenerationSettings; `dist` (infra/distributed) shards the prompts over the ranks;
    `release_memory`: infra/allocator's, which decodes suspend; `tools`: the run's, whose environments make the
    prompts."""

    def __init__(self, engine, prompts: PromptStream, reward_funcs: list, settings, *, dist, release_memory: bool,
                 tools=None):
        self.engine, self.prompts, self.reward_funcs, self.settings = engine, prompts, reward_funcs, settings
        self.tools = tools if tools is not None and tools.environments else None  # None: no environments
        self.dist, self.release_memory = dist, release_memory
        self.show_progress = dist.is_main  # off in a sampler process (run/ahead.py): the trainer's bar is shown

    def draw(self, num_prompts: int, step: int, context: RewardContext) -> tuple[Rollout, float]:
        """`num_prompts` new prompts over all ranks, this rank's share sampled and scored at optimizer step `step`:
        its rollout (with prompts, rewards, per_func and extras) and the seconds sampling took."""
        t0 = time.perf_counter()
        # Every rank draws the same global prompts and keeps its own share of whole prompts; each prompt's
        # random numbers come from its place in the generation batch, whichever rank samples it.
        streams = PromptStreams(self.settings.seed, step, self.prompts.drawn).after(
            self.dist.rank * (num_prompts // self.dist.world_size))
        rows = self.dist.shard(self.prompts.next(num_prompts))
        columns = per_completion(rows, self.settings.num_generations)
        prompts, envs = rows.get("prompt"), {}
        if self.tools is not None:  # one environment per completion; its tools are its methods
            prompts, envs = self.environments(columns)
            # The rewards get the prompts the model saw, what reset() added included, as in TRL.
            columns["prompt"] = [p for p in prompts for _ in range(self.settings.num_generations)]
        with TokenProgress(f"sampling step {step + 1}", enabled=self.show_progress) as on_token:
            with decoding_allocations(self.release_memory):
                try:
                    rollout, fields = self.engine(prompts, on_token, streams, **envs)
                except PromptTooLong as error:  # said by its row: the encoder sees prompts alone
                    raise error.in_dataset(self.prompts.dataset, "train_dataset") from None
        seconds = time.perf_counter() - t0
        columns = {**columns, **fields, **({"environments": envs["envs"]} if envs else {})}  # a rollout_func's win
        prompts = columns.pop("prompt")
        rewards, per_func = compute_rewards(self.reward_funcs, prompts, rollout.completions, columns,
                                            self.settings.reward_weights, context=context,
                                            completion_ids=rollout.completion_id_lists)
        warn_unscored(per_func, prompts, rollout.completions, columns)
        if rollout.tool_notes is not None:  # each completion's failed tool calls, a completions.jsonl column
            context.log_extra("tool_failures", rollout.tool_notes)
        return dataclasses.replace(rollout, prompts=prompts, rewards=rewards, per_func=per_func,
                                   extras=context.take_extras(len(rollout.completions))), seconds

    def environments(self, columns: dict[str, list]) -> tuple[list, dict]:
        """The prompts (one per group) and `{"envs": [one environment per completion]}` of a generation batch's rows
        (`columns`, one entry per completion); a reset that words a group's prompt differently is an error."""
        rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
        envs, prompts = make_envs(self.tools, rows)
        G = self.settings.num_generations
        differs = [i for i in range(len(prompts)) if prompts[i] != prompts[i - i % G]]
        if differs:
            raise ConfigError(f"{type(envs[differs[0]]).__name__}.reset returned different prompts for the "
                              f"completions of one dataset row: a group's {G} completions are sampled from one prompt")
        return prompts[::G], {"envs": envs}
