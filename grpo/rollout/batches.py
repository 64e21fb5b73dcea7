"""The data GRPO's optimizer steps consume: micro-batches of scored rollouts, grouped into the generation
batch that `num_iterations` steps reuse, and how one is rebuilt from its checkpoint form (`asdict`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..algo.advantages import zero_std_fraction
from .rewards import RewardContext, reward_metrics
from .sampling import Rollout, rollout_rows, row_chunks


@dataclass
class Batch:
    """One micro-batch ready for the loss: a rollout plus what GRPO attaches to it. The rollout may hold only the
    rows whose gradient is not exactly 0 (`trained_rows`); `rows` and `tokens` count the whole micro-batch, the
    loss's divisors."""

    rollout: Rollout  # n of the micro-batch's rows
    advantages: torch.Tensor  # [n]
    old_logprobs: torch.Tensor | None = None  # [n, C], only when num_iterations > 1
    ref_logprobs: torch.Tensor | None = None  # [n, C], only when beta > 0
    rows: int | None = None  # the micro-batch's completions (None: the rollout's)
    tokens: int | None = None  # their completion tokens the loss counts (None: the rollout's)

    def __post_init__(self):
        if self.rows is None:
            self.rows = len(self.rollout.completions)
        if self.tokens is None:
            self.tokens = self.trained_tokens

    @property
    def trained_tokens(self) -> int:
        """Completion tokens of the rows the forward sees: what per-token metrics average over."""
        return int(self.rollout.completion_mask.sum().item())

    @property
    def empty(self) -> bool:
        """No row left to forward (one process only: `trained_rows` keeps one where there are several ranks)."""
        return len(self.rollout.completions) == 0

    @property
    def skipped(self) -> int:
        """Rows left out of the forward and backward (a row kept only to run the forward counts too)."""
        return self.rows - int(self.rollout.completion_mask.any(dim=1).sum().item())


@dataclass
class Scored:
    """A generation batch's completions and their scores, as completions.jsonl records them. Row i belongs to
    prompt i // num_generations; under torchrun the tensors hold every rank's rows (rank-major)."""

    prompts: list  # this rank's, one per completion
    completions: list  # this rank's
    rewards: torch.Tensor  # [W*N] weighted sum over the reward functions
    per_func: torch.Tensor  # [W*N, F] each function's reward, NaN where it returned None
    advantages: torch.Tensor | None = None  # [W*N], once computed from the rewards
    extras: dict = dataclasses.field(default_factory=dict)  # this rank's reward functions' log_extra columns

    @property
    def applied(self) -> torch.Tensor:
        """[W*N] False where every reward function returned None: such a completion has no score."""
        return ~self.per_func.isnan().all(dim=1)


@dataclass
class Generation:
    """One generation batch, used by `num_iterations` optimizer steps."""

    batches: list[Batch]  # this rank's micro-batches
    metrics: dict
    scored: Scored

    def step_counts(self, step: list[Batch], reduce) -> dict[str, float]:
        """What the loss and metrics of an optimizer step on micro-batches `step` count, summed over ranks by
        `reduce`: the generation batch's completion tokens per step it feeds (`divisor`, TRL's dapo/cispo
        divisor), counted before rows were skipped; the step's tokens trained on (`trained`: per-token metrics
        average over them); its micro-batches, rows, and rows skipped."""
        counts = reduce({"all": sum(b.tokens for b in self.batches), "trained": sum(b.trained_tokens for b in step),
                         "micro_batches": len(step), "rows": sum(b.rows for b in step),
                         "skipped": sum(b.skipped for b in step)})
        return {**counts, "divisor": counts["all"] * len(step) / len(self.batches)}


def generation_from_dict(saved: dict, device: torch.device) -> Generation:
    """The inverse of `dataclasses.asdict(generation)`, with its tensors moved (back) to `device`."""
    batches = [Batch(Rollout(**{k: to_device(v, device) for k, v in b["rollout"].items()}),
                     *(to_device(b[k], device) for k in ("advantages", "old_logprobs", "ref_logprobs")),
                     b["rows"], b["tokens"])
               for b in saved["batches"]]
    return Generation(batches, saved["metrics"], Scored(**saved["scored"]))


def to_device(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def loss_batches(rollouts: list[Rollout], advantages: torch.Tensor, mask_truncated: bool, device: torch.device,
                 skip_zero_advantage: bool = False, keep_one: bool = False) -> list[Batch]:
    """The micro-batches as the loss takes them, each with its rows of `advantages` [N] (this rank's), cut to
    the rows whose gradient is not exactly 0 (`trained_rows`)."""
    sizes = [len(r.completions) for r in rollouts]
    return [trained_rows(Batch(loss_rollout(r, mask_truncated), a.to(device)), skip_zero_advantage, keep_one)
            for r, a in zip(rollouts, advantages.split(sizes))]


def trained_rows(batch: Batch, skip_zero_advantage: bool, keep_one: bool) -> Batch:
    """`batch` (before any log-probs are attached) cut to the rows whose gradient is not exactly 0, its counts
    before the cut kept for the loss's divisors: gone are rows with no completion token in the loss
    (mask_truncated_completions) and, with `skip_zero_advantage` (algo/loss.zero_advantage_has_no_gradient),
    rows whose advantage is exactly 0. With `keep_one` (several ranks) a micro-batch left with no row keeps its
    first, its completion mask zeroed so that it adds nothing to the loss or the metrics: every rank must run
    every micro-batch's forward and backward, or DDP's and FSDP's collectives wait for it forever."""
    needed = batch.rollout.completion_mask.bool().any(dim=1).cpu()  # [N]
    if skip_zero_advantage:
        needed &= batch.advantages.cpu() != 0
    if needed.all():
        return batch
    keep = needed.nonzero().squeeze(1)  # [n], on the CPU: it indexes tensors on either device
    rollout = batch.rollout
    if keep.numel() == 0 and keep_one:
        keep = keep.new_zeros(1)  # [1]
        rollout = dataclasses.replace(rollout, completion_mask=torch.zeros_like(rollout.completion_mask))  # [N, C]
    return Batch(rollout_rows(rollout, keep), batch.advantages[keep], rows=batch.rows, tokens=batch.tokens)


def regroup(rollouts: list[Rollout], size: int, pad_id: int) -> list[Rollout]:
    """The rows of `rollouts` (a sampler's, in chunks of whole prompts) in order, cut into micro-batches of
    `size` rows: a prompt's group may span two micro-batches. Each micro-batch keeps only the padding its own rows
    need (prompts stay left-padded, completions right-padded), so its compute does not depend on the chunks."""
    if all(len(r.completions) == size for r in rollouts):
        return rollouts  # sampled as they are trained: nothing to move
    return row_chunks(concat(rollouts, pad_id), size)


def concat(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """The rows of `rollouts` in order as one rollout, prompts left-padded and completions right-padded to the
    widest."""
    P = max(r.prompt_ids.shape[1] for r in rollouts)
    C = max(r.completion_ids.shape[1] for r in rollouts)

    def cat(name: str, width: int, left: bool, value: int) -> torch.Tensor:
        parts = [getattr(r, name) for r in rollouts]
        return torch.cat([torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]),
                                                  value=value) for t in parts])  # [sum N, width]
    return Rollout(cat("prompt_ids", P, True, pad_id), cat("prompt_mask", P, True, 0),  # [M, P] each
                   cat("completion_ids", C, False, pad_id), cat("completion_mask", C, False, 0),  # [M, C] each
                   [c for r in rollouts for c in r.completions], torch.cat([r.truncated for r in rollouts]))


def loss_rollout(rollout: Rollout, mask_truncated: bool) -> Rollout:
    """The rollout as the loss sees it. With `mask_truncated` (TRL's mask_truncated_completions) a completion
    that hit max_completion_length without EOS gets an all-zero completion mask: it counts in no loss term,
    token count or loss metric (and, as in TRL, its tokens are masked from attention)."""
    if not mask_truncated:
        return rollout
    keep = (~rollout.truncated).to(rollout.completion_mask.dtype)[:, None]  # [N, 1]
    return dataclasses.replace(rollout, completion_mask=rollout.completion_mask * keep)  # [N, C]


def length_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's `completions/*` metrics from a generation batch's completion lengths [N] (before any masking)
    and truncation flags [N] (`clipped_ratio`: the share that hit max_completion_length without EOS)."""
    return {"completions/mean_length": lengths.float().mean().item(),
            "completions/min_length": lengths.float().min().item(),
            "completions/max_length": lengths.float().max().item(),
            "completions/clipped_ratio": truncated.float().mean().item()}


def generation_metrics(rollouts: list[Rollout], scored: Scored, context: RewardContext, generate_s: float,
                       reward_names: list[str], num_generations: int, dist) -> dict[str, float]:
    """A generation batch's metrics over all ranks (`dist`: infra/distributed's): rewards, lengths, groups
    without signal, what the reward functions logged, timing."""
    lengths = dist.gather(torch.cat([ro.completion_mask.sum(1) for ro in rollouts]).float())  # [W*N]
    truncated = dist.gather(torch.cat([ro.truncated for ro in rollouts]).float())  # [W*N]
    return {**reward_metrics(scored.rewards, scored.per_func, reward_names), **length_metrics(lengths, truncated),
            "frac_reward_zero_std": zero_std_fraction(scored.rewards, num_generations, scored.applied),
            **context.metrics_over(dist), "perf/generate_s": generate_s,
            "perf/tokens_per_s": lengths.sum().item() / generate_s}
