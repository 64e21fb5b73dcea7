"""Clipped GRPO policy loss with a k3 KL penalty and the three usual aggregations.

Aggregations differ only in the weight each completion token gets:
``"sequence"`` (DeepSeekMath GRPO) 1 / (|o_i| * B): long completions are under-weighted per token;
``"token"`` (DAPO) 1 / sum_i |o_i|: every token counts the same;
``"constant"`` (Dr. GRPO) 1 / (B * L_max): no length-dependent normalization at all.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import AGGREGATIONS


def _check_inputs(logprobs, old_logprobs, ref_logprobs, advantages, completion_mask,
                  aggregation, max_completion_length) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; valid: {', '.join(AGGREGATIONS)}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs),
                    ("completion_mask", completion_mask)):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages must be [B] = {tuple(logprobs.shape[:1])}, got {tuple(advantages.shape)}"
        )
    if aggregation == "constant" and not max_completion_length:
        raise ValueError('aggregation "constant" needs max_completion_length (a positive int)')


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over positions where ``mask`` is true; 0 when the mask is empty."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def aggregate(
    per_token: Tensor,
    completion_mask: Tensor,
    aggregation: str = "token",
    max_completion_length: int | None = None,
    num_tokens: float | None = None,
    num_sequences: int | None = None,
) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss over completion tokens to a scalar.

    ``num_tokens`` / ``num_sequences`` replace the local token count / B as divisors, so
    micro-batches each normalized by the whole step's counts sum to the full-batch value.
    """
    mask = completion_mask.to(per_token.dtype)  # [B, T]
    masked_sum = (per_token * mask).sum(dim=1)  # [B]
    n_seq = per_token.shape[0] if num_sequences is None else num_sequences
    if aggregation == "sequence":
        # An empty completion contributes 0, not 0 / 0.
        per_seq = masked_sum / mask.sum(dim=1).clamp(min=1)  # [B]
        return per_seq.sum() / n_seq
    if aggregation == "token":
        n_tok = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
        return masked_sum.sum() / n_tok
    if aggregation == "constant":
        return masked_sum.sum() / (n_seq * max_completion_length)
    raise ValueError(f"unknown aggregation {aggregation!r}; valid: {', '.join(AGGREGATIONS)}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    aggregation: str = "token",
    max_completion_length: int | None = None,
    num_tokens: float | None = None,
    num_sequences: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO clipped surrogate loss plus ``beta`` times the k3 KL to the reference policy.

    Per completion token, with ``ratio = exp(logprobs - old_logprobs)`` and A the
    sequence's advantage::

        policy = -min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)
        kl     = exp(ref - logprobs) - (ref - logprobs) - 1          (k3, always >= 0)
        loss   = aggregate(policy + beta * kl)

    Args:
        logprobs: ``[B, T]`` log-probs of the current policy (with grad).
        old_logprobs: ``[B, T]`` log-probs of the policy that sampled the completions;
            None means ``logprobs.detach()`` (one optimizer step per generation, ratio 1).
        ref_logprobs: ``[B, T]`` reference log-probs, or None. Not used at all when
            ``beta == 0`` or it is None (then no KL term and no ``kl`` metric).
        advantages: ``[B]`` one advantage per completion.
        completion_mask: ``[B, T]`` 1 on completion tokens, 0 on prompt/padding. Values
            at masked positions are ignored (must only be finite).
        epsilon_low, epsilon_high: clip range ``[1 - epsilon_low, 1 + epsilon_high]``.
        beta: KL coefficient.
        aggregation: ``"sequence"``, ``"token"`` or ``"constant"`` (see module docstring).
        max_completion_length: the divisor L_max of ``"constant"`` (required there).
        num_tokens: for ``"token"``, divide by this instead of the local mask sum.
        num_sequences: for ``"sequence"`` and ``"constant"``, use this instead of B.

    Returns:
        ``(loss, metrics)``: a scalar tensor and detached python floats: ``loss/policy``
        (the policy term aggregated like the loss), ``ratio/mean``, ``clip/low``
        (A < 0 and ratio < 1 - epsilon_low), ``clip/high`` (A > 0 and ratio > 1 +
        epsilon_high), ``clip/region`` (their sum: tokens whose gradient clipping
        zeroes) and, when the KL term is used, ``kl``. These are masked means over
        this call's completion tokens.
    """
    _check_inputs(logprobs, old_logprobs, ref_logprobs, advantages, completion_mask,
                  aggregation, max_completion_length)
    on = completion_mask.bool()  # [B, T]
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    adv = advantages.to(logprobs.dtype)[:, None]  # [B, 1]
    # where() instead of a multiply: garbage at padding then cannot overflow exp into inf*0.
    log_ratio = torch.where(on, logprobs - old_logprobs, 0.0)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)  # [B, T]
    policy = -torch.minimum(ratio * adv, clipped * adv)  # [B, T]
    agg = dict(aggregation=aggregation, max_completion_length=max_completion_length,
               num_tokens=num_tokens, num_sequences=num_sequences)
    per_token = policy  # [B, T]
    use_kl = beta != 0 and ref_logprobs is not None
    if use_kl:
        ref_diff = torch.where(on, ref_logprobs - logprobs, 0.0)  # [B, T]
        kl = torch.exp(ref_diff) - ref_diff - 1.0  # [B, T]
        per_token = policy + beta * kl  # [B, T]
    loss = aggregate(per_token, completion_mask, **agg)

    with torch.no_grad():
        clip_low = (adv < 0) & (ratio < 1.0 - epsilon_low)  # [B, T]
        clip_high = (adv > 0) & (ratio > 1.0 + epsilon_high)  # [B, T]
        low = masked_mean(clip_low.to(ratio.dtype), on)
        high = masked_mean(clip_high.to(ratio.dtype), on)
        metrics = {
            "loss/policy": aggregate(policy, completion_mask, **agg).item(),
            "ratio/mean": masked_mean(ratio, on).item(),
            "clip/low": low.item(),
            "clip/high": high.item(),
            "clip/region": (low + high).item(),
        }
        if use_kl:
            metrics["kl"] = masked_mean(kl, on).item()
    return loss, metrics
