"""The data GRPO's optimizer steps consume: micro-batches of scored rollouts, grouped into the generation
batch that `num_iterations` steps reuse, and how one is rebuilt from its checkpoint form (`asdict`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .custom import CustomRollouts
from .sampling import Rollout


@dataclass
class Batch:
    """One micro-batch ready for the loss: a rollout plus what GRPO attaches to it."""

    rollout: Rollout
    advantages: torch.Tensor  # [N]
    old_logprobs: torch.Tensor | None = None  # [N, C], only when num_iterations > 1
    ref_logprobs: torch.Tensor | None = None  # [N, C], only when beta > 0

    @property
    def tokens(self) -> int:
        """Completion tokens the loss counts."""
        return int(self.rollout.completion_mask.sum().item())


@dataclass
class Scored:
    """A generation batch's completions and their scores, as completions.jsonl records them. Row i belongs to
    prompt i // num_generations; under torchrun the tensors hold every rank's rows (rank-major)."""

    prompts: list  # this rank's, one per completion
    completions: list  # this rank's
    rewards: torch.Tensor  # [W*N] weighted sum over the reward functions
    per_func: torch.Tensor  # [W*N, F] each function's reward, NaN where it returned None
    advantages: torch.Tensor  # [W*N]
    extras: dict = dataclasses.field(default_factory=dict)  # this rank's reward functions' log_extra columns


@dataclass
class Generation:
    """One generation batch, used by `num_iterations` optimizer steps."""

    batches: list[Batch]  # this rank's micro-batches
    metrics: dict
    scored: Scored


def generation_from_dict(saved: dict, device: torch.device) -> Generation:
    """The inverse of `dataclasses.asdict(generation)`, with its tensors moved (back) to `device`."""
    batches = [Batch(Rollout(**{k: to_device(v, device) for k, v in b["rollout"].items()}),
                     *(to_device(b[k], device) for k in ("advantages", "old_logprobs", "ref_logprobs")))
               for b in saved["batches"]]
    return Generation(batches, saved["metrics"], Scored(**saved["scored"]))


def to_device(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def loss_batches(rollouts: list[Rollout], advantages: torch.Tensor, mask_truncated: bool,
                 device: torch.device) -> list[Batch]:
    """The micro-batches as the loss takes them, each with its rows of `advantages` [N] (this rank's)."""
    sizes = [len(r.completions) for r in rollouts]
    return [Batch(loss_rollout(r, mask_truncated), a.to(device)) for r, a in zip(rollouts, advantages.split(sizes))]


def sample_batch(sample, prompts: list, per_device: int, num_generations: int,
                 pad_id: int) -> tuple[list[Rollout], dict[str, list]]:
    """A generation batch's micro-batches of `per_device` rows, and the reward columns a rollout_func returned
    besides its tokens (none for our decoder). Our decoder (`sample(prompts) -> Rollout`) is called on a
    micro-batch's worth of whole prompts at a time (at least one), so its KV cache is a micro-batch's; a
    rollout_func (`CustomRollouts`) once for the whole generation batch, as TRL calls it. Either way the rows
    are then cut into micro-batches."""
    if isinstance(sample, CustomRollouts):
        rollout, fields = sample(prompts)
        return regroup([rollout], per_device, pad_id), fields
    k = max(1, per_device // num_generations)
    return regroup([sample(prompts[i:i + k]) for i in range(0, len(prompts), k)], per_device, pad_id), {}


def regroup(rollouts: list[Rollout], size: int, pad_id: int) -> list[Rollout]:
    """The rows of `rollouts` (sampled in chunks of whole prompts) in order, cut into micro-batches of `size`
    rows: a prompt's group may span two micro-batches. Each micro-batch keeps only the padding its own rows
    need (prompts stay left-padded, completions right-padded), so its compute does not depend on the chunks."""
    if all(len(r.completions) == size for r in rollouts):
        return rollouts  # sampled as they are trained: nothing to move
    P = max(r.prompt_ids.shape[1] for r in rollouts)
    C = max(r.completion_ids.shape[1] for r in rollouts)

    def cat(name: str, width: int, left: bool, value: int) -> torch.Tensor:
        parts = [getattr(r, name) for r in rollouts]
        return torch.cat([torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]),
                                                  value=value) for t in parts])  # [sum N, width]
    prompt_ids, prompt_mask = cat("prompt_ids", P, True, pad_id), cat("prompt_mask", P, True, 0)  # [M, P]
    completion_ids = cat("completion_ids", C, False, pad_id)  # [M, C]
    completion_mask = cat("completion_mask", C, False, 0)  # [M, C]
    completions = [c for r in rollouts for c in r.completions]
    truncated = torch.cat([r.truncated for r in rollouts])  # [M]
    out = []
    for start in range(0, len(completions), size):
        rows = slice(start, start + size)
        p = int(prompt_mask[rows].sum(0).nonzero().min()) if prompt_mask[rows].any() else P  # first used column
        c = int(completion_mask[rows].sum(0).nonzero().max()) + 1 if completion_mask[rows].any() else 1
        out.append(Rollout(prompt_ids[rows, p:], prompt_mask[rows, p:], completion_ids[rows, :c],
                           completion_mask[rows, :c], completions[rows], truncated[rows]))
    return out


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
