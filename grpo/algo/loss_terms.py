"""The per-token parts of the GRPO policy loss, which `grpo.algo.loss.policy_loss` composes: pure functions of
tensors and plain numbers, each with its formula. B completions of T positions; m the completion mask, lp the
current policy's log-probs, w the importance ratio, A the advantages as ``[B, 1]`` (one per completion, the
same on each of its tokens), H the token entropies. Masked positions never reach ``exp``: garbage there cannot
overflow into inf * 0."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over positions where ``mask`` is true; 0 when the mask is empty."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def importance_ratio(logprobs: Tensor, old_logprobs: Tensor, completion_mask: Tensor, level: str) -> Tensor:
    """``[B, T]`` importance ratio w of the current policy to the one that sampled the completions::

        log_w = m * (lp - old)                          level "token": one ratio per token
        log_w = sum_t m * (lp - old) / max(1, |o_i|)    "sequence" (GSPO): one per sequence, on each of its tokens
        w     = exp(log_w)

    Differentiable: on-policy (old = lp) w is 1 and its gradient is not 0."""
    on = completion_mask.bool()  # [B, T]
    log_ratio = torch.where(on, logprobs - old_logprobs, 0.0)  # [B, T]
    if level == "sequence":
        count = on.sum(dim=1, keepdim=True).clamp(min=1)  # [B, 1]
        log_ratio = (log_ratio.sum(dim=1, keepdim=True) / count).expand_as(log_ratio)  # [B, T]
    return torch.exp(log_ratio)  # [B, T]


def clipped_term(ratio: Tensor, advantages: Tensor, completion_mask: Tensor, epsilon_low: float,
                 epsilon_high: float, delta: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped objective per token (loss types grpo, bnpo, dr_grpo, dapo, luspo), and its clip fractions::

        l = -min(min(w, delta) * A, clip(w, 1 - epsilon_low, 1 + epsilon_high) * A)

    ``min(w, delta)`` only when delta is set: INTELLECT-2's two-sided clipping, which bounds w for A < 0 too.
    The metrics, means over the completion tokens: ``clip_ratio/low_mean`` A < 0 and ``min(w, delta)`` <
    1 - epsilon_low, ``clip_ratio/high_mean`` A > 0 and it > 1 + epsilon_high, ``clip_ratio/region_mean`` either."""
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)  # [B, T]
    unclipped_ratio = ratio if delta is None else torch.clamp(ratio, max=delta)  # [B, T]
    loss = -torch.minimum(unclipped_ratio * advantages, clipped_ratio * advantages)  # [B, T]
    with torch.no_grad():
        low = masked_mean(((advantages < 0) & (unclipped_ratio < 1.0 - epsilon_low)).to(ratio.dtype), completion_mask)
        high = masked_mean(((advantages > 0) & (unclipped_ratio > 1.0 + epsilon_high)).to(ratio.dtype),
                           completion_mask)
    # the two regions never overlap (they need opposite signs of A): their sum is the share clipped
    return loss, {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low + high}


def cispo_term(ratio: Tensor, advantages: Tensor, logprobs: Tensor, completion_mask: Tensor,
               epsilon_max: float) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO's objective per token (MiniMax-M1; TRL passes ``epsilon_high`` as epsilon_max)::

        l = -stopgrad(min(w, epsilon_max)) * A * lp

    The clip bounds the weight, not the token: every token keeps its gradient, which PPO's clip zeroes. The metric:
    ``cispo_clip_ratio``, the mean over the completion tokens of [A > 0 and w > epsilon_max]."""
    on = completion_mask.bool()  # [B, T]
    weight = torch.clamp(ratio, max=epsilon_max).detach()  # [B, T]
    loss = -weight * advantages * torch.where(on, logprobs, 0.0)  # [B, T]
    with torch.no_grad():
        clipped = masked_mean(((advantages > 0) & (ratio > epsilon_max)).to(ratio.dtype), on)
    return loss, {"cispo_clip_ratio": clipped}


def sapo_term(ratio: Tensor, advantages: Tensor, temperature_pos: float,
              temperature_neg: float) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO's soft-gated objective per token, no metrics::

        l = -sigmoid(tau * (w - 1)) * 4 / tau * A,    tau = temperature_pos if A > 0 else temperature_neg

    A smooth gate in place of the hard clip: its gradient, A * 4 sigmoid' (tau (w - 1)), is A at w = 1 and fades
    as w leaves 1; a larger tau for A <= 0 fades it faster there, where off-policy tokens destabilize more."""
    tau = torch.full_like(advantages, temperature_neg).masked_fill(advantages > 0, temperature_pos)  # [B, 1]
    return -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * advantages, {}  # [B, T]


def vespo_term(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, completion_mask: Tensor,
               k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float) -> tuple[Tensor, dict[str, Tensor]]:
    """VESPO's objective per token (TRL 1.16's `get_gamma_weights`): a smooth, sequence-level weight of the
    token's log-prob gradient in place of a clip::

        log_w = clamp(sum_t m * clamp(lp - old, -20, 20), log 1e-8, 20)     the sequence's log-ratio (a sum)
        phi   = exp(lambda + k * log_w - lambda * exp(log_w))               e^lambda w^k e^(-lambda w): phi(1) = 1
        l     = -stopgrad(phi) * A * lp,    (k, lambda) = (k_pos, lambda_pos) if A >= 0 else (k_neg, lambda_neg)

    phi fades as w leaves 1 (lambda is clamped to >= 1e-4; a NaN or inf phi counts as 0). The metric:
    ``vespo/phi_seq_mean``, the mean of phi over the sequences."""
    on = completion_mask.bool()  # [B, T]
    with torch.no_grad():
        log_ratio = torch.where(on, (logprobs - old_logprobs).clamp(-20.0, 20.0), 0.0)  # [B, T]
        log_w = log_ratio.sum(dim=1, keepdim=True).clamp(math.log(1e-8), 20.0)  # [B, 1]
        nonneg = advantages >= 0  # [B, 1]
        k = torch.where(nonneg, k_pos, k_neg)  # [B, 1], the default dtype, as TRL's
        lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)  # [B, 1]
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    loss = -phi * advantages * torch.where(on, logprobs, 0.0)  # [B, T]
    return loss, {"vespo/phi_seq_mean": phi.mean() if phi.numel() else phi.sum()}


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor, completion_mask: Tensor, ratio: Tensor | None = None) -> Tensor:
    """``[B, T]`` k3 estimate (Schulman's; >= 0) of KL(current || reference) per token, 0 where masked::

        kl = exp(ref - lp) - (ref - lp) - 1
        kl = kl * w                                  with ``ratio`` w (TRL's use_bias_correction_kl)

    The tokens were sampled by the old policy, not the current one: weighting by w (DeepSeek-V3.2) makes the
    estimate's gradient that of the KL itself."""
    log_ratio_ref = torch.where(completion_mask.bool(), ref_logprobs - logprobs, 0.0)  # [B, T]
    kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1.0  # [B, T]
    return kl if ratio is None else kl * ratio  # [B, T]


def off_policy_mask(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, completion_mask: Tensor,
                    threshold: float) -> Tensor:
    """``[B]`` bool, True for the sequences whose policy terms stay (DeepSeek-V3.2's off-policy sequence mask)::

        keep_i = A_i >= 0  or  KL_i <= threshold,    KL_i = sum_t m (old - stopgrad(lp)) / max(1, |o_i|)

    Pushing down a sample the policy has already drifted away from destabilizes training; on-policy (old = lp)
    KL_i is 0 and nothing is dropped."""
    on = completion_mask.bool()  # [B, T]
    kl = torch.where(on, old_logprobs - logprobs.detach(), 0.0).sum(dim=1) / on.sum(dim=1).clamp(min=1)  # [B]
    return (advantages >= 0) | (kl <= threshold)  # [B]


def trl_off_policy_mask(advantages: Tensor, per_token_logps: Tensor, sampling_per_token_logps: Tensor, mask: Tensor,
                        off_policy_threshold: float) -> Tensor:
    """TRL's ``GRPOTrainer.get_off_policy_mask``: `off_policy_mask` in TRL's argument order and shapes, the
    advantages ``[B, 1]``, the result ``[B, 1]`` in ``mask``'s dtype, 1 keep and 0 drop."""
    kept = off_policy_mask(per_token_logps, sampling_per_token_logps, advantages.reshape(-1), mask,
                           off_policy_threshold)  # [B]
    return kept[:, None].to(mask.dtype)  # [B, 1]


def high_entropy_mask(entropies: Tensor, completion_mask: Tensor, level: float) -> Tensor:
    """``[B, T]`` bool: the completion tokens whose entropy is at least the ``level`` quantile of this call's
    completion tokens' ("Beyond the 80/20 rule": TRL's ``top_entropy_quantile`` q keeps the top q share, level
    1 - q; TRL's ``get_high_entropy_mask`` with ``threshold`` = level)::

        keep = m * [H >= the level quantile of H over the completion tokens]

    the quantile by linear interpolation (``torch.quantile``'s)."""
    on = completion_mask.bool()  # [B, T]
    values = entropies[on].float()  # [n]
    if values.numel() == 0:
        return torch.zeros_like(on)
    threshold = torch.quantile(values, level)
    return (entropies >= threshold) & on  # [B, T]


def entropy_bonus(entropies: Tensor, acts_on: Tensor, entropy_coef: float, num_micro_batches: int) -> Tensor:
    """The entropy bonus, to subtract from the loss: ``entropy_coef`` c times the mean entropy of the tokens the
    policy term acts on (m'), this call's share of a step of K micro-batches (summed over a step: c times the
    mean over its micro-batches and ranks of their mean entropy)::

        bonus = c * sum_{i,t} m' H / max(1, sum m') / K"""
    return entropy_coef * masked_mean(entropies, acts_on) / num_micro_batches
