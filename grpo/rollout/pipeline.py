"""The generation pipeline: what makes the batch of optimizer step s (`Pipeline.make`: draw, score, refill,
advantages, cut, fixed log-probs; docs/architecture.md), whichever engine samples."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..algo.advantages import group_advantages, normalized_sum_advantages
from ..algo.loss import zero_advantage_has_no_gradient
from .batches import Cut, Generation, Rollout, generation_metrics, with_advantages
from .dynamic import DynamicSampling
from .engines.engine import Engine, close, corrected
from .prompts import PromptStream
from .rewards import RewardContext, reward_func_names
from .source import RolloutSource


class Pipeline:
    """Makes generation batches: `source` draws and scores this rank's share of the prompts, `refill` (or None)
    replaces groups without signal, `policy` (policy/forwards) takes the log-probs fixed for the batch, `dist`
    spans the ranks; `settings`: settings/components.GenerationSettings."""

    def __init__(self, source: RolloutSource, policy, dist, settings, cut: Cut, reward_names: list[str],
                 refill: DynamicSampling | None = None):
        self.source, self.policy, self.dist, self.settings = source, policy, dist, settings
        self.cut, self.reward_names, self.refill = cut, reward_names, refill

    @classmethod
    def build(cls, engine: Engine, prompts: PromptStream, reward_funcs: list, policy, dist, settings, loss: Mapping,
              pad_id: int, release_memory: bool, tools=None) -> Pipeline:
        """The pipeline of `engine` over `prompts`, rewarded by `reward_funcs`; `loss`: policy_loss's settings, which
        say whether rows of advantage 0 can be cut out; `pad_id` pads the refilled rows."""
        s = settings
        source = RolloutSource(engine, prompts, reward_funcs, s, dist=dist, release_memory=release_memory, tools=tools)
        refill = None if s.refill_rounds is None else DynamicSampling(s.num_generations, s.refill_rounds, dist,
                                                                      pad_id)
        every_row = policy.router_aux_coef != 0  # the router's loss has a gradient through every row's tokens
        skip = zero_advantage_has_no_gradient(loss["beta"], loss["top_entropy_quantile"],
                                              loss["entropy_coef"] or loss["use_adaptive_entropy"])
        cut = Cut(s.micro_batch, skip_zero_advantage=skip and not every_row, keep_one=dist.world_size > 1,
                  every_row=every_row, pad_to_multiple_of=s.pad_to_multiple_of)
        return cls(source, policy, dist, s, cut, reward_func_names(reward_funcs), refill)

    @torch.no_grad()
    def make(self, step: int, trainer_state) -> Generation:
        """The generation batch training starts on at optimizer step `step` (`trainer_state`: run/state's, for the
        reward functions): sampled, scored, refilled, given advantages, cut, with its fixed log-probs."""
        s, context = self.settings, RewardContext(trainer_state)  # TRL's trainer_state, log_metric, log_extra
        rollout, seconds = self.source.draw(s.prompts_per_generation, step, context)
        self.check_head(rollout)
        refilled = {}
        if self.refill is not None:  # DAPO: only groups with signal, while rounds are left  rollout/dynamic
            rollout, refilled, seconds = self.refill(rollout, seconds,
                                                     lambda n: self.source.draw(n, step, context))
        generate_s = self.dist.reduce({"s": seconds}, "max")["s"]  # the slowest rank's
        # Every rank's rewards [W*N], [W*N, F]: a group's advantages may span ranks.
        rewards, per_func = self.dist.gather(rollout.rewards), self.dist.gather(rollout.per_func)
        advantages = _advantages(rewards, per_func, s)  # [W*N]
        batch = with_advantages(rollout, self.dist.local(advantages), s.mask_truncated_completions)
        metrics = {**generation_metrics(batch, rewards, per_func, context, generate_s, self.reward_names,
                                        s.num_generations, self.dist), **refilled}
        generation = Generation(batch, self.cut, metrics)  # cut into micro-batches
        generation.fix_logprobs(lambda micro: self.policy.fixed_logprobs(
            micro, old=s.old_logprobs, reference=s.ref_logprobs))
        if s.sampling_correction is not None:  # a server's, int8 or bf16 samples reweighted
            generation.metrics.update(corrected(self.source.engine, generation, s.sampling_correction))
        return generation

    def check_head(self, rollout: Rollout) -> None:
        """On the first batch, the policy's log-probs against the model's own forward (Policy.check_head_once)."""
        first = torch.arange(min(self.cut.size, len(rollout.completions)))  # a micro-batch's rows
        self.policy.check_head_once(rollout.select(first),
                                    agree=lambda value: self.dist.reduce({"value": value}, "max")["value"])

    def close(self) -> None:
        """The run has ended, however: what the engine keeps for it let go (a server's adapters)."""
        close(self.source.engine)

    def quiet(self) -> None:
        """No sampling bar (a sampler process: the trainer's bar is shown)."""
        self.source.show_progress = False


def _advantages(rewards: torch.Tensor, per_func: torch.Tensor, s) -> torch.Tensor:
    """[N] advantages of rewards [N] and per_func [N, F] as `s.multi_objective_aggregation` says (algo/advantages)."""
    if s.multi_objective_aggregation == "normalize_then_sum":
        weights = torch.tensor(s.reward_weights) if s.reward_weights is not None else torch.ones(per_func.shape[1])
        return normalized_sum_advantages(per_func, weights, s.num_generations)
    return group_advantages(rewards, s.num_generations, scale=s.scale_rewards, scored=~per_func.isnan().all(dim=1))
