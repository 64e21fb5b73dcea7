"""The GRPO policy loss with TRL's `loss_type`s, importance-sampling levels, two-sided clipping, the
(bias-corrected) k3 KL penalty, the off-policy sequence mask, the high-entropy token mask and the entropy
bonus; TRL 1.16's formulas, term by term.

Per completion token (the formulas are `grpo.algo.loss_terms`'s, one function a term), with w the
importance ratio (`importance_ratio`, per token or per sequence) and A the advantage::

    l = the `loss_type`'s policy term: clipped_term (grpo, bnpo, dr_grpo, dapo, luspo), cispo_term, sapo_term,
        vespo_term
    l = l * off_policy_mask         only when off_policy_mask_threshold is set (DeepSeek-V3.2)
    l = l * high_entropy_mask       only when top_entropy_quantile < 1
    l = l + beta * k3_kl            (times w when use_bias_correction_kl)
    l = l * rho                     only with `sampling_weights` rho (algo/sampling_correction)

Aggregation: what one call (one micro-batch) contributes, such that the calls of a step summed over
micro-batches and ranks give the step's loss (ranks' gradients add up). K = ``num_micro_batches``, the
step's micro-batches over all ranks (TRL divides by the accumulation steps and DDP averages the ranks);
B = ``num_sequences`` and the micro-batch's tokens ``micro_batch_tokens`` default to this call's::

    grpo, sapo:   sum_i( sum_t m l / max(1, |o_i|) ) / B / K   each sequence's token mean, then their mean
    bnpo:         sum_{i,t} m l / max(1, micro_batch_tokens) / K   token mean of THIS micro-batch only
    dr_grpo:      sum_{i,t} m l / (B * max_completion_length) / K
    dapo, cispo, vespo:  sum_{i,t} m l / max(1, num_tokens)    num_tokens: the whole step's (all ranks)
    luspo:        sum_i( sum_t m l ) / B / K                   sums, not means: length-weighted

The entropy bonus (``entropy_coef``, `loss_terms.entropy_bonus`) is then subtracted whatever the loss type,
on the tokens the policy term acts on.

Masked positions never reach the loss (nor ``exp``: garbage there cannot overflow into inf * 0). Rows whose
gradient is exactly 0 may be left out of the call (`zero_advantage_has_no_gradient`) when B and the
micro-batch's tokens are passed as counted before: the loss and its gradient stay those of all rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES
from .loss_terms import (clipped_term, cispo_term, entropy_bonus, high_entropy_mask, importance_ratio, k3_kl,
                         masked_mean, off_policy_mask, sapo_term, vespo_term)

CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the loss types with PPO's clipped objective
# Prefixes of the metrics that are this call's share of the step's value, like the loss (the step's calls sum to
# it); every other metric is a mean over this call's completion tokens.
STEP_SHARES = ("loss/", "off_policy/", "policy_loss", "aux_loss")


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    """What a run's settings decide of `policy_loss`, TRL's names and defaults (`Config.loss_settings()` gives
    them as keywords); checked when made."""

    loss_type: str = "dapo"  # one of LOSS_TYPES (module docstring)
    epsilon_low: float = 0.2  # the clip range [1 - epsilon_low, 1 + epsilon_high]
    epsilon_high: float = 0.2  # also cispo's eps_max
    delta: float | None = None  # the bound of w in the unclipped term (two-sided clipping), or None
    beta: float = 0.0  # the KL coefficient
    use_bias_correction_kl: bool = True  # k3 * w (DeepSeek-V3.2's unbiased KL gradient)
    importance_sampling_level: str = "token"  # or "sequence" (GSPO)
    top_entropy_quantile: float = 1.0  # the policy term acts on the top this share of tokens by entropy only
    entropy_coef: float = 0.0  # the entropy bonus's weight (0: none)
    use_adaptive_entropy: bool = False  # the bonus and its metrics even at weight 0 (policy/gradients.EntropyControl)
    # drop the policy terms of negative-advantage sequences whose KL(old || current) exceeds it, or None
    off_policy_mask_threshold: float | None = None
    sapo_temperature_pos: float = 1.0  # SAPO's gate temperatures for A > 0 and A <= 0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0  # VESPO's gamma weight's shape k and rate lambda for A >= 0 and A < 0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    max_completion_length: int | None = None  # the L of "dr_grpo" (required there)

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; valid: {', '.join(LOSS_TYPES)}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"unknown importance_sampling_level {self.importance_sampling_level!r}; "
                             f"valid: {', '.join(IMPORTANCE_SAMPLING_LEVELS)}")
        if self.loss_type == "dr_grpo" and not self.max_completion_length:
            raise ValueError('loss_type "dr_grpo" needs max_completion_length (a positive int)')


# loss_type -> its policy term (loss_terms), given (w, A, lp, old, m, settings): returns ([B, T] terms, metrics)
POLICY_TERMS = {
    **dict.fromkeys(CLIPPED, lambda ratio, adv, lp, old, on, s: clipped_term(ratio, adv, on, s.epsilon_low,
                                                                             s.epsilon_high, s.delta)),
    "cispo": lambda ratio, adv, lp, old, on, s: cispo_term(ratio, adv, lp, on, s.epsilon_high),
    "sapo": lambda ratio, adv, lp, old, on, s: sapo_term(ratio, adv, s.sapo_temperature_pos,
                                                         s.sapo_temperature_neg),
    "vespo": lambda ratio, adv, lp, old, on, s: vespo_term(lp, old, adv, on, s.vespo_k_pos, s.vespo_lambda_pos,
                                                           s.vespo_k_neg, s.vespo_lambda_neg),
}


def _check_inputs(logprobs, old_logprobs, ref_logprobs, advantages, completion_mask, entropies,
                  settings: LossSettings) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs),
                    ("completion_mask", completion_mask), ("entropies", entropies)):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(logprobs.shape[:1])}, "
                         f"got {tuple(advantages.shape)}")
    if settings.top_entropy_quantile < 1.0 and entropies is None:
        raise ValueError("top_entropy_quantile < 1 needs the per-token entropies")
    if settings.entropy_coef != 0 and entropies is None:
        raise ValueError("entropy_coef != 0 needs the per-token entropies (with grad, for the bonus to train)")


def zero_advantage_has_no_gradient(beta: float, top_entropy_quantile: float, entropy_coef: float = 0.0) -> bool:
    """Whether a completion whose advantage is exactly 0 adds exactly 0 to the gradient (and to the loss), so
    that it needs no forward or backward. Every loss type's policy term is A times a finite factor (GSPO's w is
    the row's own), so A = 0 zeroes its value and gradient. Not so with a KL term (beta != 0), which pulls every
    row towards the reference, nor with the high-entropy mask (its quantile is over every row's tokens), nor
    with the entropy bonus (entropy_coef != 0), which every row's tokens feed."""
    return beta == 0 and top_entropy_quantile >= 1.0 and entropy_coef == 0


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
    if loss_type in ("dapo", "cispo", "vespo"):
        n_tok = mask.sum().clamp(min=1) if num_tokens is None else max(1.0, float(num_tokens))
        return masked_sum.sum() / n_tok
    if loss_type == "luspo":
        return masked_sum.sum() / max(1, B) / num_micro_batches
    raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(LOSS_TYPES)}")


def policy_loss(logprobs: Tensor, old_logprobs: Tensor | None, ref_logprobs: Tensor | None, advantages: Tensor,
                completion_mask: Tensor, *, entropies: Tensor | None = None, num_tokens: float | None = None,
                num_micro_batches: int = 1, num_sequences: int | None = None, micro_batch_tokens: float | None = None,
                sampling_weights: Tensor | None = None, **settings) -> tuple[Tensor, dict[str, float]]:
    """The loss of one micro-batch (module docstring), and its metrics.

    Args:
        logprobs: ``[B, T]`` log-probs of the current policy (with grad).
        old_logprobs: ``[B, T]`` those of the policy that sampled; None: ``logprobs.detach()`` (w = 1).
        ref_logprobs: ``[B, T]`` reference log-probs, or None; unused (no KL term, no ``kl`` metric) when
            ``beta == 0`` or None.
        advantages: ``[B]`` one advantage per completion.
        completion_mask: ``[B, T]`` 1 on completion tokens; values at masked positions need only be finite.
        entropies: ``[B, T]`` per-token entropies: the ``entropy`` metric, the high-entropy mask and the bonus
            (trained through their grad).
        num_tokens, num_micro_batches, num_sequences, micro_batch_tokens: the aggregation's (module docstring),
            counted before rows with exactly zero gradient were left out (default: this call's).
        sampling_weights: ``[B, T]`` rho (algo/sampling_correction), or None.
        settings: `LossSettings`'s fields as keywords; TRL's defaults for those not given.

    Returns:
        ``(loss, metrics)``: a scalar tensor and python floats, TRL's names where TRL logs the same thing:
        ``loss/policy`` (the policy term aggregated like the loss), ``ratio/mean`` (w), the policy term's own,
        ``kl`` and ``entropy`` when used: masked means over this call's completion tokens. Shares of the step
        (``STEP_SHARES``): ``loss/entropy`` (minus the bonus), TRL's ``policy_loss`` (the loss before it) and
        ``entropy_coef`` when ``entropy_coef != 0``, ``off_policy/masked_ratio`` (the sequences dropped, over
        B, / K) when ``off_policy_mask_threshold`` is set."""
    s = LossSettings(**settings)
    _check_inputs(logprobs, old_logprobs, ref_logprobs, advantages, completion_mask, entropies, s)
    on = completion_mask.bool()  # [B, T]
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    adv = advantages.to(logprobs.dtype)[:, None]  # [B, 1]
    ratio = importance_ratio(logprobs, old_logprobs, on, s.importance_sampling_level)  # [B, T]
    policy, term_metrics = POLICY_TERMS[s.loss_type](ratio, adv, logprobs, old_logprobs, on, s)  # [B, T]
    if s.off_policy_mask_threshold is not None:
        kept = off_policy_mask(logprobs, old_logprobs, advantages, on, s.off_policy_mask_threshold)  # [B]
        policy = policy * kept[:, None].to(policy.dtype)  # [B, T]
    acts_on = on  # [B, T]: the tokens the policy term (and the entropy bonus) acts on
    if s.top_entropy_quantile < 1.0:
        acts_on = high_entropy_mask(entropies, on, 1.0 - s.top_entropy_quantile)  # [B, T]
        policy = policy * acts_on.to(policy.dtype)  # [B, T]
    agg = {"loss_type": s.loss_type, "max_completion_length": s.max_completion_length, "num_tokens": num_tokens,
           "num_micro_batches": num_micro_batches, "num_sequences": num_sequences,
           "micro_batch_tokens": micro_batch_tokens}
    with torch.no_grad():
        metrics = {"loss/policy": aggregate(policy, completion_mask, **agg), "ratio/mean": masked_mean(ratio, on),
                   **term_metrics}  # 0-dim tensors until the end
    per_token = policy  # [B, T]
    if s.beta != 0 and ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs, on, ratio if s.use_bias_correction_kl else None)  # [B, T]
        per_token = policy + s.beta * kl  # [B, T]
        metrics["kl"] = masked_mean(kl.detach(), on)
    if sampling_weights is not None:
        per_token = per_token * sampling_weights.to(per_token.dtype)  # [B, T]
    loss = aggregate(per_token, completion_mask, **agg)
    if entropies is not None:
        metrics["entropy"] = masked_mean(entropies.detach().to(ratio.dtype), on)
    if s.entropy_coef != 0 or s.use_adaptive_entropy:
        bonus = entropy_bonus(entropies.to(logprobs.dtype), acts_on, s.entropy_coef, num_micro_batches)
        metrics["policy_loss"], metrics["entropy_coef"] = loss.detach(), torch.tensor(s.entropy_coef)  # TRL's
        loss = loss - bonus
        metrics["loss/entropy"] = -bonus.detach()
    metrics = {k: v.item() for k, v in metrics.items()}
    if s.off_policy_mask_threshold is not None:
        rows = num_sequences if num_sequences is not None else kept.numel()  # counted before any cut
        metrics["off_policy/masked_ratio"] = (~kept).sum().item() / max(1, rows) / num_micro_batches
    return loss, metrics


def router_aux_term(aux_loss: Tensor, coef: float, num_micro_batches: int = 1) -> tuple[Tensor, dict[str, float]]:
    """A mixture-of-experts router's load-balancing loss `aux_loss` of one micro-batch as TRL adds it to the loss,
    ``coef * aux_loss / K`` (K as `policy_loss`'s), and TRL's metric ``aux_loss``: this call's ``aux_loss / K``."""
    share = aux_loss / num_micro_batches
    return coef * share, {"aux_loss": share.item()}


def no_token_metrics(**settings) -> dict[str, float]:
    """The metrics `policy_loss` with `settings` gives a call without completion tokens, all 0: a step's where no
    row was trained (all skipped: zero gradients), so that every step logs the same keys."""
    empty = torch.zeros(0, 0)  # [0, 0]
    return policy_loss(empty, None, empty, torch.zeros(0), empty, entropies=empty, **settings)[1]


def add_metrics(totals: dict[str, float], metrics: dict[str, float], share: float) -> None:
    """Add one call's `policy_loss` metrics to a step's `totals`: STEP_SHARES add up as the losses do; the others
    weighted by `share`, the call's part of the step's tokens, so that the sums are the step's means."""
    for k, v in metrics.items():
        totals[k] = totals.get(k, 0.0) + (v if k.startswith(STEP_SHARES) else v * share)


def loss_warnings(loss_type: str, importance_sampling_level: str) -> list[str]:
    """TRL's warnings (its GRPOTrainer's, in its words) on a loss that runs but is not the paper's it names."""
    warnings = []
    if importance_sampling_level == "sequence" and loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        warnings.append(f"importance_sampling_level='sequence' with loss_type='{loss_type}': the loss sums per-token "
                        f"contributions, which effectively weights each sequence by its completion length instead of "
                        f"optimizing the per-sequence objective; to reproduce the GSPO paper's setup, set "
                        f"loss_type='grpo'")
    if loss_type == "luspo" and importance_sampling_level != "sequence":
        warnings.append("loss_type='luspo': set importance_sampling_level='sequence' to mirror the paper's setup")
    if loss_type == "vespo" and importance_sampling_level != "token":
        warnings.append("loss_type='vespo' computes sequence-level importance weights internally: "
                        "importance_sampling_level should be 'token' (the default)")
    return warnings
