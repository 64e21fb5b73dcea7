"""One optimizer step's gradients: the GRPO loss (algo/loss) of each of its micro-batches back-propagated
through the policy, normalized with the step's counts over all ranks."""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..algo.loss import add_metrics, no_token_metrics, policy_loss, router_aux_term
from ..infra.progress import progress_bar
from ..settings.components import EntropySettings


def accumulate(policy, micro_batches: list, counts, loss: Mapping, reduce, *, step: int = 0,
               show: bool = False) -> dict:
    """Back-propagate the loss of every micro-batch (rollout/batches.MicroBatch), each normalized as
    `loss_type` says with `counts` (rollout/batches.StepCounts, over all ranks; `reduce` sums over ranks), so
    that the ranks' summed gradients are those of the step's loss; `loss`: policy_loss's keyword arguments;
    `show`: a bar of optimizer step `step`'s micro-batches. Returns the step's metrics."""
    totals: dict[str, float] = {"kl": 0.0, "loss": 0.0}  # kl: logged as 0 when there is no reference
    trained = [m for m in micro_batches if not m.empty]  # one process: no forward where no row is left
    with progress_bar(f"training step {step + 1}", total=len(trained), unit="micro-batch", enabled=show,
                      leave=False) as bar:  # the step's second half, after sampling's bar
        for i, m in enumerate(trained):
            b = m.rollout
            with policy.parallel.sync_gradients(i == len(trained) - 1):
                logprobs, entropies, aux = policy.training_logprobs(b)  # [n, C] each, a scalar or None
                # old_logprobs None: on policy, the loss's own detached log-probs are the old ones (algo/loss)
                step_loss, metrics = policy_loss(
                    logprobs, b.old_logprobs, b.ref_logprobs, b.advantages, b.loss_mask, entropies=entropies,
                    **loss, num_tokens=counts.divisor, num_sequences=m.rows, micro_batch_tokens=m.tokens,
                    num_micro_batches=counts.micro_batches, sampling_weights=b.sampling_weights)
                if aux is not None:  # a mixture-of-experts router's load-balancing loss (policy/router.py)
                    term, aux_metrics = router_aux_term(aux, policy.router_aux_coef, counts.micro_batches)
                    step_loss, metrics = step_loss + term, {**metrics, **aux_metrics}
                policy.parallel.backward(step_loss)
            add_metrics(totals, metrics, share=m.trained_tokens / max(1, counts.trained))  # the rows trained's
            totals["loss"] += step_loss.item()
            bar.update(1)
    # Per-token metrics (entropy, ratio, clip ratios) are the rows trained's; 0 where no row was trained.
    totals = {**no_token_metrics(**loss), **reduce(totals)}
    return {**totals, "skipped/zero_gradient": counts.skipped / counts.rows}


@torch.no_grad()
def eval_loss(policy, loss: Mapping, rollout) -> tuple[float, int]:
    """TRL's eval loss of one batch of greedy completions (rollout/batches.Rollout, one per prompt) and its rows:
    the loss `loss` sets, each completion the one of its group, so its advantage is 0 as TRL's is with
    num_generations_eval=1. What is left is beta x the KL to the reference minus the entropy bonus (0 when both
    are off, as by default), plus a mixture-of-experts router's load-balancing term."""
    try:
        logprobs, entropies, aux = policy.training_logprobs(rollout)  # [N, C] each, a scalar or None
        reference = policy.reference_logprobs(rollout) if loss["beta"] != 0 else None  # [N, C]
    finally:
        policy.parallel.reshard()  # no backward follows
    mask = rollout.completion_mask if rollout.loss_mask is None else rollout.loss_mask  # [N, C]
    value, _ = policy_loss(logprobs, None, reference, torch.zeros(len(logprobs)), mask, entropies=entropies, **loss)
    if aux is not None:  # TRL's eval loss has the router's load-balancing loss too
        value = value + router_aux_term(aux, policy.router_aux_coef)[0]
    return value.item(), len(logprobs)


class EntropyControl:
    """Adaptive entropy control (TRL's `use_adaptive_entropy`, from Skywork-OR1, arXiv 2505.22312): after each
    optimizer step the entropy bonus's coefficient c moves by `entropy_coef_delta`, up while the step's mean token
    entropy H (over every rank's loss tokens) is at or below `entropy_target`, down above it:
    c <- min(c + delta, c_max) if H <= target, else max(c - delta, c_min). A step applies c only when the step
    before it ended at or below the target (the first step: not at all), the same c in all its micro-batches.
    Without it, c is `entropy_coef` throughout. `settings`: policy_loss's keywords from the settings, `bounds`: c_min,
    c_max, delta and the target (settings/plan.RunPlan.loss and .entropy)."""

    def __init__(self, settings: Mapping, bounds: EntropySettings):
        self.settings, self.bounds, self.adaptive = settings, bounds, settings["use_adaptive_entropy"]
        self.coef = settings["entropy_coef"]  # c now (TRL's trainer.entropy_coef)
        self.last_entropy = math.inf  # H of the last step; none yet: above any target

    def loss(self) -> Mapping:
        """policy_loss's keywords for this step: the settings, with this step's coefficient."""
        if not self.adaptive:
            return self.settings
        return {**self.settings, "entropy_coef": self.coef if self.last_entropy <= self.bounds.target else 0.0}

    def update(self, entropy: float) -> dict[str, float]:
        """After a step whose mean token entropy was `entropy`: c for the next; returns TRL's metric of c."""
        if not self.adaptive:
            return {}
        if entropy <= self.bounds.target:
            self.coef = min(self.coef + self.bounds.delta, self.bounds.coef_max)
        else:
            self.coef = max(self.coef - self.bounds.delta, self.bounds.coef_min)
        self.last_entropy = entropy
        return {"entropy_coef": self.coef}

    def state_dict(self) -> dict[str, float]:  # TRL's entropy_ctrl_state.json keys
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}

    def load_state_dict(self, state: Mapping) -> None:
        self.coef, self.last_entropy = state["entropy_coef"], state["last_world_entropy"]
