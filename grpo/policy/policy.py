"""The policy as a GRPO step uses it: named forwards (`sample`, `logprobs`, `reference_logprobs`) that own
the routing through the DDP / FSDP wrapper, the run's autocast (policy/precision.py) and the switch to the
reference policy."""
from __future__ import annotations

import contextlib

import torch

from ..rollout.progress import TokenProgress
from ..run.allocator import return_freed_memory
from ..rollout.sampling import PromptEncoder, Rollout, sample
from . import reference_kind
from .models import check_logprobs_match_forward, completion_logprobs, device_of, make_reference, reference_context
from .parallel import ParallelPolicy
from .precision import Precision


class Policy:
    """`model` (prepared for training) with its reference, wrapped for the ranks; `config` gives the sampling
    and log-prob settings. Trains on `model`; `parallel` saves and loads it."""

    def __init__(self, model, tokenizer, config, dist, precision: Precision):
        self.model, self.tokenizer, self.config, self.dist = model, tokenizer, config, dist
        self.precision = precision
        self.has_reference = reference_kind(config.use_lora, config.beta) != "none"
        self.reference = make_reference(model, config.use_lora, config.beta, precision.reference_dtype)
        # Before the optimizer exists: FSDP replaces the parameters by their shards.
        self.parallel = ParallelPolicy(model, dist, fsdp=config.fsdp, bf16=precision.bf16)
        self.device = device_of(model)
        if self.device.type == "cpu":  # freed activations and logits go back to the OS (run/allocator)
            return_freed_memory()
        self.encode = PromptEncoder(tokenizer, config.max_prompt_length, config.chat_template_kwargs)
        self.reference_forwards = 0
        self.on_token = None  # the open progress bar's counter, if any
        self.head_checked = False

    @torch.no_grad()
    def sample(self, prompts: list) -> Rollout:
        """`num_generations` completions per prompt, drawn with the run's sampling settings (tokens counted on the
        `progress` bar while one is open)."""
        c = self.config
        return self.parallel.generate(lambda model: sample(
            model, self.tokenizer, self.encode, prompts, num_generations=c.num_generations,
            max_completion_length=c.max_completion_length, **c.sampling_settings(),
            stop_at_eos=c.stop_at_eos, on_token=self.on_token))

    @contextlib.contextmanager
    def progress(self, desc: str, enabled: bool):
        """A tokens and tokens/s bar for the sampling inside the block (a step's takes minutes on a CPU)."""
        with TokenProgress(desc, enabled=enabled) as self.on_token:
            try:
                yield
            finally:
                self.on_token = None

    def logprobs(self, rollout: Rollout, with_entropy: bool = False):
        """Per-token log-probs [N, C] of the rollout's completions under the policy (with grad when enabled);
        with `with_entropy`, `(logprobs, entropies)`, the entropies [N, C] with grad too (an entropy bonus trains)."""
        with self.precision.autocast():
            return self.parallel(lambda model: self._logprobs(model, rollout, with_entropy))

    @torch.no_grad()
    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """Per-token log-probs [N, C] under the reference: the frozen copy, or the policy with its adapter off."""
        def forward(policy_model):
            model, context = reference_context(policy_model, self.reference)
            with context, self.precision.autocast():
                return self._logprobs(model, rollout)

        self.reference_forwards += 1
        return self.parallel(forward)

    def check_head_once(self, rollout: Rollout) -> None:
        """On the first call only: log-probs and sampling logits of two of the rollout's rows against the model's
        own forward (models.check_logprobs_match_forward); a family whose logits we get wrong stops the run."""
        if not self.head_checked:
            c = self.config
            self.parallel(lambda model: check_logprobs_match_forward(
                model, rollout.input_ids, rollout.attention_mask, rollout.prompt_ids.shape[1],
                temperature=c.temperature, chunk_size=c.logprob_chunk_size,
                agree=lambda excess: self.dist.reduce({"excess": excess}, "max")["excess"]))
            self.head_checked = True

    def _logprobs(self, model, rollout: Rollout, with_entropy: bool = False):
        return completion_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_ids.shape[1],
                                   temperature=self.config.temperature, chunk_size=self.config.logprob_chunk_size,
                                   return_entropy=with_entropy)

