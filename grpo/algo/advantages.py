"""Group-relative advantages (GRPO, DeepSeekMath; Dr. GRPO variant without scaling).

Each prompt is sampled ``group_size`` times; a completion's advantage is its reward relative to its siblings, so
no learned value function is needed. A completion that no reward function scored (all returned None) is left
out of its group's mean and std and gets advantage 0, as in TRL."""

from __future__ import annotations

import torch
from torch import Tensor

from . import SCALES


def _check_rewards(rewards: Tensor, group_size: int, scale: str, scored: Tensor | None = None) -> None:
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; valid: {', '.join(SCALES)}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int, got {group_size!r}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (the std of a group of {group_size} is undefined)")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"number of rewards {rewards.numel()} is not a multiple of group_size {group_size}")
    bad = ~torch.isfinite(rewards)
    if bad.any():
        positions = bad.nonzero().flatten().tolist()
        raise ValueError(f"non-finite rewards (NaN or inf) at positions {positions}")
    if scored is not None and scored.shape != rewards.shape:
        raise ValueError(f"scored must be [N] = {tuple(rewards.shape)}, got {tuple(scored.shape)}")


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4,
                     scored: Tensor | None = None) -> Tensor:
    """``[N]`` group-normalized advantages ``A = (r - mean_group(r)) / (std + eps)`` of the rewards ``[N]``,
    ``N / group_size`` consecutive groups of one prompt's completions. ``scale``, what the centered reward is
    divided by: ``"group"`` the std within each group (GRPO), ``"batch"`` the std over all N rewards (the mean
    is still per group), ``"none"`` nothing (Dr. GRPO). ``scored`` ``[N]``: False where no reward function
    scored the completion (default: all True), a row that takes no part in any mean or std.

    The std is the unbiased sample std. A group whose scored rewards are all equal, or that has fewer than two
    scored completions (TRL: a NaN std, then 0), gets an advantage of exactly 0 under every scale. The dtype is
    that of ``rewards`` (float32 if it was an integer type)."""
    _check_rewards(rewards, group_size, scale, scored)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if scored is None:
        scored = torch.ones_like(rewards, dtype=torch.bool)  # [N]
    grouped = rewards.view(-1, group_size)  # [N/G, G]
    valid = scored.view(-1, group_size)  # [N/G, G]
    weight = valid.to(rewards.dtype)  # [N/G, G]
    count = weight.sum(dim=1, keepdim=True)  # [N/G, 1]
    mean = (grouped * weight).sum(dim=1, keepdim=True) / count.clamp(min=1)  # [N/G, 1]
    centered = (grouped - mean) * weight  # [N/G, G]: unscored rows 0
    # Equal rewards can leave a rounding residue after subtracting the mean; the spec
    # promises an exact zero, so no signal leaks from a group that carries none.
    centered = centered.masked_fill(_no_signal(grouped, valid), 0.0)  # [N/G, G]
    if scale == "group":
        var = (centered**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)  # [N/G, 1]
        std = var.sqrt()  # [N/G, 1]
    elif scale == "batch":
        flat = rewards[scored]  # [n_scored]
        std = flat.std(correction=1) if flat.numel() > 1 else rewards.new_zeros(())  # []
    else:
        return centered.reshape(-1)  # [N]
    return (centered / (std + eps)).reshape(-1)  # [N]


def normalized_sum_advantages(per_func: Tensor, weights: Tensor, group_size: int, eps: float = 1e-4) -> Tensor:
    """``[N]`` advantages of TRL's ``multi_objective_aggregation="normalize_then_sum"`` (GDPO): each reward
    function's rewards normalized within each group, ``(r_k - mean_group(r_k)) / (std_group(r_k) + eps)``,
    summed with ``weights`` ``[F]`` into one reward per completion, then normalized over the whole batch,
    ``(s - mean(s)) / (std(s) + eps)``. ``per_func`` ``[N, F]``: NaN where a function returned None (left out of
    its means and stds, and of the sum).

    The stds are unbiased. A completion no function scored stays out of the batch's mean and std and gets
    advantage 0; a function's group with fewer than two scored rewards has no std and adds nothing (TRL: NaN,
    which nansum drops). scale_rewards does not apply, as in TRL."""
    if per_func.dim() != 2 or weights.shape != per_func.shape[1:]:
        raise ValueError(f"per_func must be [N, F] and weights [F], got {tuple(per_func.shape)} and "
                         f"{tuple(weights.shape)}")
    _check_rewards(per_func.nan_to_num().sum(dim=1), group_size, "group")
    grouped = per_func.float().view(-1, group_size, per_func.shape[1])  # [N/G, G, F]
    normalized = (grouped - grouped.nanmean(dim=1, keepdim=True)) / (_nanstd(grouped, dim=1) + eps)  # [N/G, G, F]
    sums = (normalized.reshape(per_func.shape) * weights.to(normalized.dtype)).nansum(dim=1)  # [N]
    scored = ~per_func.isnan().all(dim=1)  # [N]
    batch = sums[scored]  # [n_scored]
    if batch.numel() < 2:
        return torch.zeros_like(sums)
    return torch.where(scored, (sums - batch.mean()) / (batch.std(correction=1) + eps), 0.0)  # [N]


def _nanstd(values: Tensor, dim: int) -> Tensor:
    """The unbiased std along `dim` (kept) of the values that are not NaN; NaN where fewer than two are."""
    count = (~values.isnan()).sum(dim=dim, keepdim=True)  # [..., 1, ...]
    squares = ((values - values.nanmean(dim=dim, keepdim=True)) ** 2).nansum(dim=dim, keepdim=True)
    return torch.where(count > 1, squares / (count - 1).clamp(min=1), torch.nan).sqrt()


def _no_signal(grouped: Tensor, valid: Tensor) -> Tensor:
    """``[N/G, 1]`` True for groups whose scored rewards are all equal (or fewer than two)."""
    high = grouped.masked_fill(~valid, -torch.inf).amax(dim=1, keepdim=True)  # [N/G, 1]
    low = grouped.masked_fill(~valid, torch.inf).amin(dim=1, keepdim=True)  # [N/G, 1]
    return (high <= low) | (valid.sum(dim=1, keepdim=True) < 2)  # [N/G, 1]


def has_signal(rewards: Tensor, group_size: int, scored: Tensor | None = None) -> Tensor:
    """``[N/G]`` bool: True for groups whose scored rewards differ (at least two scored, not all equal), the
    groups whose advantages are not all exactly 0. DAPO's dynamic sampling keeps only these."""
    _check_rewards(rewards, group_size, "group", scored)
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    if scored is None:
        scored = torch.ones_like(rewards, dtype=torch.bool)  # [N]
    return ~_no_signal(rewards.view(-1, group_size), scored.view(-1, group_size)).squeeze(1)  # [N/G]


def zero_std_fraction(rewards: Tensor, group_size: int, scored: Tensor | None = None) -> float:
    """Fraction of groups whose scored rewards all agree (TRL's ``frac_reward_zero_std``): groups
    that carry no learning signal. A group with fewer than two scored completions counts too."""
    return (~has_signal(rewards, group_size, scored)).float().mean().item()
