"""DAPO's dynamic sampling (`dynamic_sampling`): a generation batch keeps only groups whose rewards differ (the
others have every advantage 0), sampling more prompts while it lacks some and rounds are left."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..algo.advantages import has_signal
from .batches import Rollout


def kept_groups(signal: torch.Tensor, need: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `need` groups a batch keeps of those sampled (`signal` [n]: a group's rewards differ), those with signal
    first, then filler: their indices [need], ascending, and rows [need * group_size] (group g: rows g*G..g*G+G-1)."""
    keep = torch.cat([signal.nonzero(), (~signal).nonzero()]).flatten()[:need].sort().values  # [need]
    return keep, (keep[:, None] * group_size + torch.arange(group_size)).flatten()  # [need], [need * G]


class DynamicSampling:
    """Refills this rank's share of a generation batch with groups with signal, the ranks in step (`dist`)."""

    def __init__(self, num_generations: int, max_rounds: int, dist, pad_id: int):
        self.G, self.max_rounds, self.dist, self.pad_id = num_generations, max_rounds, dist, pad_id

    def __call__(self, rollout: Rollout, seconds: float,
                 sample: Callable[[int], tuple[Rollout, float]]) -> tuple[Rollout, dict, float]:
        """Keep the groups with signal of `rollout` (this rank's, scored), calling `sample(prompts over all ranks)`
        while a rank lacks some and rounds are left; a rank still short tops up with groups it dropped. Returns the
        kept rows, the `dynamic_sampling/*` metrics and `seconds` plus those the rounds took."""
        G = self.G
        need = len(rollout.completions) // G  # this rank's groups in a generation batch
        parts, rounds = [rollout], 0
        signal = has_signal(rollout.rewards, G, rollout.applied)  # [n] per group sampled so far
        while rounds < self.max_rounds:
            missing = int(self.dist.reduce({"value": float(max(0, need - int(signal.sum())))}, "max")["value"])
            if missing == 0:
                break
            more, more_seconds = sample(missing * self.dist.world_size)
            parts.append(more)
            signal = torch.cat([signal, has_signal(more.rewards, G, more.applied)])  # [n]
            seconds, rounds = seconds + more_seconds, rounds + 1
        keep, rows = kept_groups(signal, need, G)  # [need], [need * G]
        whole = Rollout.cat(parts, self.pad_id)
        counts = self.dist.reduce({"dropped": float(len(signal) - need), "filler": float(need - signal[keep].sum())})
        metrics = {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/dropped_groups": counts["dropped"],
                   "dynamic_sampling/filler_groups": counts["filler"]}
        return whole.select(rows), metrics, seconds
