"""TRL's importance-sampling correction for completions sampled by another engine (a vLLM server): its
log-probs of the sampled tokens differ from the trainer's own (other kernels, precision, or a stale adapter),
and the loss is reweighted towards the trainer's policy (`vllm_importance_sampling_correction`).

Per completion token t of row i (m the loss mask: the tokens the model wrote; old the trainer's log-probs of the
policy that sampled, s the engine's)::

    d_it = m_it * (old_it - s_it)             0 where the engine gave no log-prob (NaN)
    token_*    modes: rho_it = exp(d_it)
    sequence_* modes: rho_i  = exp(sum_t d_it), the same for every token of the row
    *_truncate: rho = clamp(rho, C_min, C_max)     (a bound that is None: no bound on that side)
    *_mask:     rho = 0 where rho < C_min or rho > C_max

The per-token loss (policy term and KL term) is multiplied by rho (`policy_loss(sampling_weights=...)`)."""
from __future__ import annotations

import torch
from torch import Tensor

from . import SAMPLING_CORRECTION_MODES


def sampling_correction(old_logprobs: Tensor, sampling_logprobs: Tensor, mask: Tensor, mode: str = "sequence_mask",
                        clip_min: float | None = None, clip_max: float | None = 3.0) -> tuple[Tensor, Tensor, Tensor]:
    """(weights [B, T], |old - s| of the masked tokens with a log-prob [k], the ratios the metrics read [j]: rho
    of the masked tokens, or of the rows in sequence modes) for `old_logprobs`, `sampling_logprobs` and `mask`
    [B, T] (module docstring); TRL's defaults."""
    if mode not in SAMPLING_CORRECTION_MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(SAMPLING_CORRECTION_MODES)}")
    on = mask.bool()  # [B, T]
    scored = on & ~torch.isnan(sampling_logprobs)  # [B, T]
    diff = torch.where(scored, old_logprobs - sampling_logprobs, torch.zeros_like(old_logprobs))  # [B, T]
    sequence = mode.startswith("sequence")
    rho = torch.exp(diff.sum(dim=1, keepdim=True) if sequence else diff)  # [B, 1] or [B, T]
    if mode.endswith("truncate"):
        rho = torch.clamp(rho, min=clip_min, max=clip_max)
    else:
        low = clip_min if clip_min is not None else -float("inf")
        high = clip_max if clip_max is not None else float("inf")
        rho = rho.masked_fill((rho < low) | (rho > high), 0.0)
    ratios = rho.flatten() if sequence else rho[on]  # [B] or [k]
    return rho.expand_as(old_logprobs), diff.abs()[scored], ratios


def correction_metrics(differences: Tensor, ratios: Tensor) -> dict[str, float]:
    """TRL's metrics of one generation batch from `sampling_correction`'s differences and ratios (all its calls'
    concatenated); 0 where there are none, as in TRL."""
    zero = torch.zeros(1, dtype=ratios.dtype)
    d = differences if differences.numel() else zero
    r = ratios if ratios.numel() else zero
    return {"sampling/sampling_logp_difference/mean": d.mean().item(),
            "sampling/sampling_logp_difference/max": d.max().item(),
            "sampling/importance_sampling_ratio/min": r.min().item(),
            "sampling/importance_sampling_ratio/mean": r.mean().item(),
            "sampling/importance_sampling_ratio/max": r.max().item()}
