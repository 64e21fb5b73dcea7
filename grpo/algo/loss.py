"""The GRPO policy loss with TRL's `loss_type`s, importance-sampling levels, two-sided clipping, the
(bias-corrected) k3 KL penalty, the off-policy sequence mask, the high-entropy token mask and the entropy
bonus; TRL 1.16's formulas, term by term.

Per completion token t of sequence i (m the completion mask, A_i the advantage, H the token entropy)::

    log_w = lp - old                                   importance_sampling_level="token"
    log_w = sum_t m * (lp - old) / max(1, |o_i|)       "sequence" (GSPO): one weight per sequence
    w     = exp(log_w)                                 differentiable; 1 on-policy, its gradient is not 0
    grpo, bnpo, dr_grpo, dapo, luspo:
        l = -min(min(w, delta) * A, clip(w, 1 - epsilon_low, 1 + epsilon_high) * A)
            (min(w, delta) only when delta is set: INTELLECT-2's two-sided clipping bounds w for A < 0 too)
    cispo:  l = -stopgrad(min(w, epsilon_high)) * A * lp            (MiniMax-M1: epsilon_high is eps_max)
    sapo:   l = -sigmoid(tau * (w - 1)) * 4 / tau * A,  tau = sapo_temperature_pos if A > 0 else _neg
    l     = l * [A_i >= 0  or  KL_i <= off_policy_mask_threshold]  only when the threshold is set (DeepSeek-V3.2),
            KL_i = sum_t m (old - stopgrad(lp)) / max(1, |o_i|)   0 on-policy (old = lp): nothing is dropped
    l     = l * [H >= q-quantile of H over this call's tokens]    only when top_entropy_quantile q < 1
    kl    = exp(ref - lp) - (ref - lp) - 1   (k3, >= 0);  kl * w when use_bias_correction_kl
    l     = l + beta * kl

Aggregation: what one call (one micro-batch) contributes, such that the calls of a step summed over
micro-batches and ranks give the step's loss (ranks' gradients add up). K = ``num_micro_batches``, the
step's micro-batches over all ranks (TRL divides by the accumulation steps and DDP averages the ranks);
B = ``num_sequences`` and the micro-batch's tokens ``micro_batch_tokens`` default to this call's::

    grpo, sapo:   sum_i( sum_t m l / max(1, |o_i|) ) / B / K   each sequence's token mean, then their mean
    bnpo:         sum_{i,t} m l / max(1, micro_batch_tokens) / K   token mean of THIS micro-batch only
    dr_grpo:      sum_{i,t} m l / (B * max_completion_length) / K
    dapo, cispo:  sum_{i,t} m l / max(1, num_tokens)           num_tokens: the whole step's (all ranks)
    luspo:        sum_i( sum_t m l ) / B / K                   sums, not means: length-weighted

The entropy bonus (``entropy_coef`` c, when not 0) is then subtracted whatever the loss type, the mean entropy
of the tokens the policy term acts on (m' = m, times the high-entropy mask when q < 1), with gradient::

    loss  = loss - c * sum_{i,t} m' H / max(1, sum m') / K     summed over a step: c times the mean over its
                                                               micro-batches (and ranks) of their mean entropy

Masked positions never reach the loss (nor ``exp``: garbage there cannot overflow into inf * 0). Rows whose
gradient is exactly 0 may be left out of the call (`zero_advantage_has_no_gradient`) when B and the
micro-batch's tokens are passed as counted before: the loss and its gradient stay those of all rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES

CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the loss types with PPO's clipped objective
# Prefixes of the metrics that are this call's share of the step's value, like the loss (the step's calls sum to
# it); every other metric is a mean over this call's completion tokens.
STEP_SHARES = ("loss/", "off_policy/")


def _check_inputs(logprobs, old_logprobs, ref_logprobs, advantages, completion_mask, entropies, loss_type,
                  importance_sampling_level, max_completion_length, top_entropy_quantile, entropy_coef) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(LOSS_TYPES)}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}; "
                         f"valid: {', '.join(IMPORTANCE_SAMPLING_LEVELS)}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs),
                    ("completion_mask", completion_mask), ("entropies", entropies)):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages must be [B] = {tuple(logprobs.shape[:1])}, got {tuple(advantages.shape)}"
        )
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError('loss_type "dr_grpo" needs max_completion_length (a positive int)')
    if top_entropy_quantile < 1.0 and entropies is None:
        raise ValueError("top_entropy_quantile < 1 needs the per-token entropies")
    if entropy_coef != 0 and entropies is None:
        raise ValueError("entropy_coef != 0 needs the per-token entropies (with grad, for the bonus to train)")


def zero_advantage_has_no_gradient(beta: float, top_entropy_quantile: float, entropy_coef: float = 0.0) -> bool:
    """Whether a completion whose advantage is exactly 0 adds exactly 0 to the gradient (and to the loss), so
    that it needs no forward or backward. Every loss type's policy term is A times a finite factor: clipped
    ``-min(min(w, delta) A, clip(w) A)``, cispo ``-sg(min(w, eps)) A lp``, sapo ``-sigmoid(tau (w - 1)) 4 / tau A``,
    at token or sequence level (GSPO's w is the row's own), so A = 0 zeroes its value and gradient. Not so with a
    KL term (beta != 0), which pulls every row towards the reference, nor with the high-entropy mask
    (top_entropy_quantile < 1): its quantile is over every row's tokens, and leaving some out moves it, nor
    with the entropy bonus (entropy_coef != 0), which every row's tokens feed."""
    return beta == 0 and top_entropy_quantile >= 1.0 and entropy_coef == 0


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over positions where ``mask`` is true; 0 when the mask is empty."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def high_entropy_mask(entropies: Tensor, completion_mask: Tensor, quantile: float) -> Tensor:
    """``[B, T]`` bool: completion tokens whose entropy is at least the ``1 - quantile`` quantile
    (linear interpolation, ``torch.quantile``) of this call's completion tokens' entropies: the top
    ``quantile`` share of tokens by entropy ("Beyond the 80/20 rule"; TRL's ``top_entropy_quantile``)."""
    on = completion_mask.bool()  # [B, T]
    values = entropies[on].float()  # [n]
    if values.numel() == 0:
        return torch.zeros_like(on)
    threshold = torch.quantile(values, 1.0 - quantile)
    return (entropies >= threshold) & on  # [B, T]


def off_policy_mask(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, completion_mask: Tensor,
                    threshold: float) -> Tensor:
    """``[B]`` bool, True for the sequences whose policy terms stay: DeepSeek-V3.2's off-policy sequence mask
    drops a sequence with a negative advantage whose mean per-token KL(old || current) estimate, old - lp over
    its completion tokens (lp without grad), exceeds ``threshold``: pushing down a sample the policy has already
    drifted away from destabilizes training. Positive advantages always stay."""
    on = completion_mask.bool()  # [B, T]
    kl = torch.where(on, old_logprobs - logprobs.detach(), 0.0).sum(dim=1) / on.sum(dim=1).clamp(min=1)  # [B]
    return (advantages >= 0) | (kl <= threshold)  # [B]


def aggregate(per_token: Tensor, completion_mask: Tensor, loss_type: str = "dapo",
              max_completion_length: int | None = None, num_tokens: float | None = None,
              num_micro_batches: int = 1, num_sequences: int | None = None,
              micro_batch_tokens: float | None = None) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss to this call's share of the step's loss (module docstring)."""
    mask = completion_mask.to(per_token.dtype)  # [B, T]
    masked_sum = (per_token * mask).sum(dim=1)  # [B]
    B = per_token.shape[0] if num_sequences is None else num_sequences
    if loss_type in ("grpo", "sapo"):
        return (masked_sum / mask.sum(dim=1).clamp(min=1)).sum() / max(1, B) / num_micro_batches
    if loss_type == "bnpo":
        n_tok = mask.sum().clamp(min=1) if micro_batch_tokens is None else max(1.0, float(micro_batch_tokens))
        return masked_sum.sum() / n_tok / num_micro_batches
    if loss_type == "dr_grpo":
        return masked_sum.sum() / (max(1, B) * max_completion_length) / num_micro_batches
    if loss_type in ("dapo", "cispo"):
        n_tok = mask.sum().clamp(min=1) if num_tokens is None else max(1.0, float(num_tokens))
        return masked_sum.sum() / n_tok
    if loss_type == "luspo":
        return masked_sum.sum() / max(1, B) / num_micro_batches
    raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(LOSS_TYPES)}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    beta: float = 0.0,
    use_bias_correction_kl: bool = True,
    importance_sampling_level: str = "token",
    entropies: Tensor | None = None,
    top_entropy_quantile: float = 1.0,
    entropy_coef: float = 0.0,
    off_policy_mask_threshold: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    max_completion_length: int | None = None,
    num_tokens: float | None = None,
    num_micro_batches: int = 1,
    num_sequences: int | None = None,
    micro_batch_tokens: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The loss of one micro-batch, as written in the module docstring; TRL's defaults.

    Args:
        logprobs: ``[B, T]`` log-probs of the current policy (with grad).
        old_logprobs: ``[B, T]`` log-probs of the policy that sampled the completions;
            None means ``logprobs.detach()`` (one optimizer step per generation, w = 1).
        ref_logprobs: ``[B, T]`` reference log-probs, or None. Not used at all when
            ``beta == 0`` or it is None (then no KL term and no ``kl`` metric).
        advantages: ``[B]`` one advantage per completion.
        completion_mask: ``[B, T]`` 1 on completion tokens, 0 on prompt/padding. Values
            at masked positions are ignored (must only be finite).
        loss_type: one of ``LOSS_TYPES`` (module docstring).
        epsilon_low, epsilon_high: clip range ``[1 - epsilon_low, 1 + epsilon_high]``.
        delta: upper bound of w in the unclipped term (two-sided clipping), or None.
        beta: KL coefficient.
        use_bias_correction_kl: multiply the k3 KL by w (DeepSeek-V3.2's unbiased KL gradient).
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO).
        entropies: ``[B, T]`` per-token entropies: the ``entropy`` metric, the high-entropy mask when
            ``top_entropy_quantile < 1``, and the bonus when ``entropy_coef != 0`` (trained through their grad).
        top_entropy_quantile: keep only the policy term of the top this share of tokens by entropy.
        entropy_coef: weight of the entropy bonus (module docstring; 0: none).
        off_policy_mask_threshold: drop the policy terms of negative-advantage sequences whose KL(old ||
            current) exceeds it (``off_policy_mask``), or None.
        sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures.
        max_completion_length: the L of ``"dr_grpo"`` (required there).
        num_tokens: for ``"dapo"`` / ``"cispo"``, the step's token count (default: this call's).
        num_micro_batches: K of the module docstring (default 1: this call is the whole step).
        num_sequences, micro_batch_tokens: the micro-batch's rows (grpo, sapo, dr_grpo, luspo) and completion
            tokens (bnpo), counted before rows with exactly zero gradient were left out (default: this call's).

    Returns:
        ``(loss, metrics)``: a scalar tensor and detached python floats, TRL's names where TRL logs
        the same thing: ``loss/policy`` (the policy term aggregated like the loss), ``ratio/mean``
        (w), ``clip_ratio/low_mean`` (A < 0 and w < 1 - epsilon_low), ``clip_ratio/high_mean``
        (A > 0 and w > 1 + epsilon_high), ``clip_ratio/region_mean`` (either) for the clipped
        loss types, ``cispo_clip_ratio`` (A > 0 and w > epsilon_high) for cispo, ``kl`` when the
        KL term is used, ``entropy`` when entropies are given: masked means over this call's completion
        tokens. Shares of the step like the loss (``STEP_SHARES``): ``loss/entropy`` (the bonus term,
        -c * mean H / K) when ``entropy_coef != 0``, ``off_policy/masked_ratio`` (the sequences dropped,
        over B, / K) when ``off_policy_mask_threshold`` is set.
    """
    _check_inputs(logprobs, old_logprobs, ref_logprobs, advantages, completion_mask, entropies, loss_type,
                  importance_sampling_level, max_completion_length, top_entropy_quantile, entropy_coef)
    on = completion_mask.bool()  # [B, T]
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    adv = advantages.to(logprobs.dtype)[:, None]  # [B, 1]
    log_ratio = torch.where(on, logprobs - old_logprobs, 0.0)  # [B, T]
    if importance_sampling_level == "sequence":
        count = on.sum(dim=1, keepdim=True).clamp(min=1)  # [B, 1]
        log_ratio = (log_ratio.sum(dim=1, keepdim=True) / count).expand_as(log_ratio)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]

    if loss_type in CLIPPED:
        clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)  # [B, T]
        unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)  # [B, T]
        policy = -torch.minimum(unclipped * adv, clipped * adv)  # [B, T]
    elif loss_type == "cispo":
        weight = torch.clamp(ratio, max=epsilon_high).detach()  # [B, T]
        policy = -weight * adv * torch.where(on, logprobs, 0.0)  # [B, T]
    else:  # sapo
        tau = torch.full_like(adv, sapo_temperature_neg).masked_fill(adv > 0, sapo_temperature_pos)  # [B, 1]
        policy = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv  # [B, T]
    if off_policy_mask_threshold is not None:
        kept = off_policy_mask(logprobs, old_logprobs, advantages, on, off_policy_mask_threshold)  # [B]
        policy = policy * kept[:, None].to(policy.dtype)  # [B, T]
    acts_on = on  # [B, T]: the tokens the policy term (and the entropy bonus) acts on
    if top_entropy_quantile < 1.0:
        acts_on = high_entropy_mask(entropies, on, top_entropy_quantile)  # [B, T]
        policy = policy * acts_on.to(policy.dtype)  # [B, T]
    agg = {"loss_type": loss_type, "max_completion_length": max_completion_length, "num_tokens": num_tokens,
           "num_micro_batches": num_micro_batches, "num_sequences": num_sequences,
           "micro_batch_tokens": micro_batch_tokens}
    per_token = policy  # [B, T]
    use_kl = beta != 0 and ref_logprobs is not None
    if use_kl:
        ref_diff = torch.where(on, ref_logprobs - logprobs, 0.0)  # [B, T]
        kl = torch.exp(ref_diff) - ref_diff - 1.0  # [B, T]
        if use_bias_correction_kl:
            kl = kl * ratio  # [B, T]
        per_token = policy + beta * kl  # [B, T]
    loss = aggregate(per_token, completion_mask, **agg)
    if entropy_coef != 0:
        bonus = entropy_coef * masked_mean(entropies.to(logprobs.dtype), acts_on) / num_micro_batches
        loss = loss - bonus

    with torch.no_grad():
        metrics = {"loss/policy": aggregate(policy, completion_mask, **agg).item(),
                   "ratio/mean": masked_mean(ratio, on).item()}
        w = ratio if delta is None or loss_type not in CLIPPED else torch.clamp(ratio, max=delta)  # TRL's coef_1
        if loss_type in CLIPPED:
            low = masked_mean(((adv < 0) & (w < 1.0 - epsilon_low)).to(w.dtype), on)
            high = masked_mean(((adv > 0) & (w > 1.0 + epsilon_high)).to(w.dtype), on)
            metrics["clip_ratio/low_mean"] = low.item()
            metrics["clip_ratio/high_mean"] = high.item()
            metrics["clip_ratio/region_mean"] = (low + high).item()  # the two regions never overlap
        elif loss_type == "cispo":
            metrics["cispo_clip_ratio"] = masked_mean(((adv > 0) & (w > epsilon_high)).to(w.dtype), on).item()
        if use_kl:
            metrics["kl"] = masked_mean(kl, on).item()
        if entropies is not None:
            metrics["entropy"] = masked_mean(entropies.to(ratio.dtype), on).item()
        if entropy_coef != 0:
            metrics["loss/entropy"] = -bonus.item()
        if off_policy_mask_threshold is not None:
            rows = num_sequences if num_sequences is not None else kept.numel()  # counted before any cut
            metrics["off_policy/masked_ratio"] = (~kept).sum().item() / max(1, rows) / num_micro_batches
    return loss, metrics


def no_token_metrics(**settings) -> dict[str, float]:
    """The metrics `policy_loss` with `settings` gives a call without completion tokens, all 0: a step's where no
    row was trained (all skipped: zero gradients), so that every step logs the same keys."""
    empty = torch.zeros(0, 0)  # [0, 0]
    return policy_loss(empty, None, empty, torch.zeros(0), empty, entropies=empty, **settings)[1]


def add_metrics(totals: dict[str, float], metrics: dict[str, float], share: float) -> None:
    """Add one call's `policy_loss` metrics to a step's `totals`: `loss/*` add up as the losses do; the others,
    means over the call's completion tokens, weighted by `share`, its part of the step's tokens, so that the
    sums over micro-batches and ranks are the step's means."""
    for k, v in metrics.items():
        totals[k] = totals.get(k, 0.0) + (v if k.startswith(STEP_SHARES) else v * share)
