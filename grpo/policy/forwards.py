"""The policy as a GRPO step uses it: named forwards (`logprobs`, `reference_logprobs`) that own the routing
through the DDP / FSDP wrapper, the run's autocast (policy/precision.py) and the switch to the reference
policy. Sampling with it is rollout/engines/sampling.py's."""
from __future__ import annotations

import copy
import sys

import torch

from .models import (check_logprobs_match_forward, completion_logprobs, device_of, float32_head, reference_context,
                     unwrap)
from .parallel import ParallelPolicy
from .precision import Precision
from .prefix import CacheDropped, check_shared_prompt_forward, refusal, shared_prompt_logprobs
from .router import router_aux_coef


class Policy:
    """`model` (prepared for training) with its reference, wrapped for `world_size` ranks (`parallel` saves and
    loads it); `settings`: settings/components.LogprobSettings; `is_main`: this rank says what every rank does."""

    def __init__(self, model, settings, world_size: int, precision: Precision, *, is_main: bool):
        self.model, self.settings, self.precision, self.is_main = model, settings, precision, is_main
        self.reference = None  # the adapter-disabled policy serves (LoRA), or no reference is needed (beta == 0)
        if settings.reference == "copy":  # full fine-tuning's frozen copy (settings/choices.reference_kind)
            self.reference = copy.deepcopy(unwrap(model)).eval().requires_grad_(False).to(precision.reference_dtype)
            if settings.cast_lm_head_to_fp32:
                float32_head(self.reference)
        # Before the optimizer exists: FSDP replaces the parameters by their shards.
        self.parallel = ParallelPolicy(model, world_size, fsdp=settings.fsdp, bf16=precision.bf16)
        self.device = device_of(model)
        self.head_checked = False
        self.router_aux_coef = router_aux_coef(unwrap(model), settings.router_aux_loss_coef)  # 0: none
        # Each distinct prompt forwarded once (policy/prefix.py), unless the model's cache cannot serve it. Not
        # with a router loss: TRL's is over whole rows, each prompt's tokens as many times as it has completions.
        why = None if not settings.prompt_once else (
            "the router's load-balancing loss is over whole rows" if self.router_aux_coef else refusal(unwrap(model)))
        self.shared_prompt = settings.prompt_once and why is None
        if why is not None:
            self._whole_rows(why)

    def logprobs(self, rollout, with_entropy: bool = False):
        """Per-token log-probs [N, C] of the rollout's completions under the policy (with grad when enabled);
        with `with_entropy`, `(logprobs, entropies)`, the entropies [N, C] with grad too (an entropy bonus trains)."""
        with self.precision.autocast():
            return self.parallel(lambda model: self._logprobs(model, rollout, with_entropy))

    def training_logprobs(self, rollout):
        """`(logprobs, entropies, aux_loss)` [N, C], [N, C] and a scalar, all with grad: a mixture-of-experts
        router's load-balancing loss over the rows, or None when `router_aux_coef` is 0 (policy/router.py)."""
        if not self.router_aux_coef:
            return *self.logprobs(rollout, with_entropy=True), None
        with self.precision.autocast():  # whole rows: the shared-prompt forward is off with a router loss
            return self.parallel(lambda model: self._logprobs(model, rollout, True, router_aux=True))

    @torch.no_grad()
    def reference_logprobs(self, rollout) -> torch.Tensor:
        """Per-token log-probs [N, C] under the reference: the frozen copy, or the policy with its adapter off."""
        def forward(policy_model):
            model, context = reference_context(policy_model, self.reference)
            with context, self.precision.autocast():
                return self._logprobs(model, rollout)

        return self.parallel(forward)

    def fixed_logprobs(self, rollout, *, old: bool, reference: bool) -> dict[str, torch.Tensor]:
        """A micro-batch's log-probs [n, c] fixed for the whole generation batch: the old policy's (`old`: when
        later steps train on it off-policy), the reference's (`reference`: when the loss has a KL penalty)."""
        fixed = {"old_logprobs": self.logprobs(rollout)} if old else {}
        return {**fixed, "ref_logprobs": self.reference_logprobs(rollout)} if reference else fixed

    @torch.no_grad()
    def mix_into_reference(self, alpha: float) -> None:
        """TRL's sync_ref_model (TR-DPO): the reference copy becomes alpha x the policy + (1 - alpha) x itself,
        parameter by parameter, in the reference's dtype."""
        for ref, param in zip(self.reference.parameters(), unwrap(self.model).parameters(), strict=True):
            ref.mul_(1.0 - alpha).add_(param.to(ref.dtype), alpha=alpha)

    def check_head_once(self, rollout, agree) -> None:
        """On the first call only: models.check_logprobs_match_forward (a family whose logits we get wrong stops
        the run), then prefix.check_shared_prompt_forward (a difference turns it off, with one line). `agree(x)`
        is the largest x over the ranks, so that they act together."""
        if not self.head_checked:
            c = self.settings
            self.parallel(lambda model: check_logprobs_match_forward(
                model, rollout.input_ids, rollout.attention_mask, rollout.prompt_ids.shape[1],
                temperature=c.temperature, chunk_size=c.logprob_chunk_size, agree=agree))
            if self.shared_prompt:
                excess, error = self.parallel(lambda model: check_shared_prompt_forward(
                    model, rollout, temperature=c.temperature, chunk_size=c.logprob_chunk_size, agree=agree))
                if excess > 1:
                    self._whole_rows(f"its log-probs differ from the whole rows' by up to {error:.3g} on the first "
                                     "step's check")
            self.head_checked = True

    def _whole_rows(self, why: str) -> None:
        self.shared_prompt = False
        if self.is_main:  # all ranks turn it off
            print(f"grpo: shared_prompt_forward is off: {why}; log-probs forward whole rows", file=sys.stderr)

    def _logprobs(self, model, rollout, with_entropy: bool = False, router_aux: bool = False):
        c, ro = self.settings, rollout
        # Taken even where no row shares its prompt: under FSDP every rank must run as many forwards.
        if self.shared_prompt:
            try:
                return shared_prompt_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                              ro.completion_mask, temperature=c.temperature,
                                              chunk_size=c.logprob_chunk_size, return_entropy=with_entropy)
            except CacheDropped as dropped:
                self._whole_rows(str(dropped))
        return completion_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_ids.shape[1],
                                   temperature=c.temperature, chunk_size=c.logprob_chunk_size,
                                   return_entropy=with_entropy, router_aux=router_aux)
