"""Group-relative advantages (GRPO, DeepSeekMath; Dr. GRPO variant without scaling).

Each prompt is sampled ``group_size`` times; a completion's advantage is its reward
relative to its siblings, so no learned value function is needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import SCALES


def _check_rewards(rewards: Tensor, group_size: int, scale: str) -> None:
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; valid: {', '.join(SCALES)}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int, got {group_size!r}")
    if group_size < 2:
        # The unbiased std of a single sample divides by zero.
        raise ValueError(
            f"group_size must be >= 2 (the std of a group of {group_size} is undefined)"
        )
    n = rewards.numel()
    if n % group_size != 0:
        raise ValueError(
            f"number of rewards {n} is not a multiple of group_size {group_size}"
        )
    bad = ~torch.isfinite(rewards)
    if bad.any():
        positions = bad.nonzero().flatten().tolist()
        raise ValueError(f"non-finite rewards (NaN or inf) at positions {positions}")


def group_advantages(
    rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4
) -> Tensor:
    """Return group-normalized advantages ``A = (r - mean_group(r)) / (std + eps)``.

    Args:
        rewards: ``[N]`` rewards laid out as ``N / group_size`` consecutive groups, each
            holding the ``group_size`` completions of one prompt.
        group_size: completions per prompt (G); must be >= 2 and divide N.
        scale: what the centered reward is divided by:
            ``"group"``: the std within each group (GRPO);
            ``"batch"``: the std over all N rewards (the mean is still per group);
            ``"none"``: nothing, only centering (Dr. GRPO).
        eps: added to the std before dividing.

    The std is the unbiased (Bessel-corrected, divide by ``n - 1``) sample std, as
    ``torch.std`` computes it by default. A group whose rewards are all equal gets an
    advantage of exactly 0 under every scale.

    Returns:
        ``[N]`` advantages in the dtype of ``rewards`` (float32 if it was an integer type).

    Raises:
        ValueError: on NaN/inf rewards (naming the positions), a bad ``group_size``,
            N not a multiple of ``group_size``, or an unknown ``scale``.
    """
    _check_rewards(rewards, group_size, scale)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    grouped = rewards.view(-1, group_size)  # [N/G, G]
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # [N/G, G]
    # Equal rewards can leave a rounding residue after subtracting the mean; the spec
    # promises an exact zero, so no signal leaks from a group that carries none.
    flat = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # [N/G, 1]
    centered = centered.masked_fill(flat, 0.0)  # [N/G, G]
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True, correction=1)  # [N/G, 1]
    elif scale == "batch":
        std = rewards.std(correction=1)  # []
    else:
        return centered.reshape(-1)  # [N]
    return (centered / (std + eps)).reshape(-1)  # [N]
