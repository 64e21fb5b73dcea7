"""The run plan: what a Config and the number of ranks decide about a run, resolved once, before anything loads.
The trainer reads it, and the memory planner reads the same plan, so what the planner counts is what the run
keeps (old and reference log-probs above all). A Config resolves it when made, on the ranks torchrun announces,
so its errors come from `Config(...)` itself; the trainer resolves it again on its process group's ranks."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..errors import ConfigError
from .schedule import Schedule


def ranks_from_env() -> int:
    """The number of ranks torchrun starts (its WORLD_SIZE), 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def reference_kind(use_lora: bool, beta: float) -> str:
    """Where the KL penalty's reference policy comes from: "none" (beta == 0: no reference forward at all),
    "adapter" (LoRA: the policy with its adapter disabled) or "copy" (full fine-tuning: a frozen copy)."""
    if beta == 0:
        return "none"
    return "adapter" if use_lora else "copy"


@dataclass(frozen=True)
class OptimSettings:
    """What the optimizer, its learning-rate schedule and the update guard read of the settings."""

    name: str  # Config.optim
    learning_rate: float
    betas: tuple[float, float]
    weight_decay: float
    lr_scheduler_type: str
    lr_scheduler_kwargs: Mapping | None
    warmup_ratio: float
    warmup_steps: float
    max_grad_norm: float
    max_nonfinite_steps: int

    @classmethod
    def of(cls, c) -> OptimSettings:
        return cls(c.optim, c.learning_rate, (c.adam_beta1, c.adam_beta2), c.weight_decay, c.lr_scheduler_type,
                   c.lr_scheduler_kwargs, c.warmup_ratio, c.warmup_steps, c.max_grad_norm, c.max_nonfinite_steps)


def interval_due(strategy: str, every: int, step: int, total: int, epoch_ended: bool) -> bool:
    """transformers' IntervalStrategy once optimizer step `step` (1-based) of `total` is done, as its
    DefaultFlowCallback reads it: "steps" every `every` steps and at the last, "epoch" at a step that ended a pass
    over the training prompts (`epoch_ended`) and at the last, "no" never."""
    if strategy == "no":
        return False
    return step >= total or (epoch_ended if strategy == "epoch" else step % every == 0)


@dataclass(frozen=True)
class SamplingSettings:
    """What the trainer's sampler reads of the settings: prompts and completions' lengths, the sampling knobs
    (Config.sampling_settings: generation_kwargs applied), the tool rounds, the seed of every prompt's random
    stream, and a micro-batch's prompts (the smallest decode)."""

    num_generations: int
    max_prompt_length: int | None  # None: prompts whole
    max_completion_length: int
    knobs: Mapping  # temperature, top_p, top_k, min_p, repetition_penalty
    stop_at_eos: bool
    chat_template_kwargs: Mapping | None
    max_tool_calling_iterations: int | None
    seed: int
    micro_batch_prompts: int

    @classmethod
    def of(cls, c) -> SamplingSettings:
        kwargs = None if c.chat_template_kwargs is None else MappingProxyType(dict(c.chat_template_kwargs))
        return cls(c.num_generations, c.max_prompt_length, c.max_completion_length,
                   MappingProxyType(c.sampling_settings()), c.stop_at_eos, kwargs, c.max_tool_calling_iterations,
                   c.seed, max(1, c.per_device_train_batch_size // c.num_generations))


@dataclass(frozen=True)
class ServerSettings:
    """Where an inference server samples the completions (use_vllm, vllm_mode="server"): its base URL, and how
    long it may take to come up or to answer a request."""

    base_url: str
    timeout: float

    @classmethod
    def of(cls, c) -> ServerSettings | None:
        if not c.use_vllm:
            return None
        url = c.vllm_server_base_url or f"http://{c.vllm_server_host}:{c.vllm_server_port}"
        return cls(url.rstrip("/"), c.vllm_server_timeout)


def sampling_correction_of(c) -> Mapping | None:
    """The keyword arguments of algo/sampling_correction.sampling_correction a run applies, or None."""
    if not (c.use_vllm and c.vllm_importance_sampling_correction):
        return None
    return MappingProxyType(dict(mode=c.vllm_importance_sampling_mode, clip_min=c.vllm_importance_sampling_clip_min,
                                 clip_max=c.vllm_importance_sampling_clip_max))


@dataclass(frozen=True)
class Cadence:
    """When a run writes a metrics line (every `logging_steps` and at the last step), evaluates (eval_strategy)
    and saves a checkpoint (save_strategy), each strategy as transformers reads it (`interval_due`)."""

    logging_steps: int
    eval_strategy: str
    eval_steps: int  # eval_steps, else logging_steps (transformers' fallback)
    save_strategy: str
    save_steps: int

    @classmethod
    def of(cls, config) -> Cadence:
        return cls(config.logging_steps, config.eval_strategy, config.eval_steps or config.logging_steps,
                   config.save_strategy, config.save_steps)

    def due(self, step: int, total: int, epoch_ended: bool) -> tuple[bool, bool, bool]:
        """(log, evaluate, save) once optimizer step `step` of `total` is done; `epoch_ended`: it ended a pass
        over the training prompts (Schedule.ends_epoch)."""
        return (step % self.logging_steps == 0 or step == total,
                interval_due(self.eval_strategy, self.eval_steps, step, total, epoch_ended),
                interval_due(self.save_strategy, self.save_steps, step, total, epoch_ended))


@dataclass(frozen=True)
class RunPlan:
    schedule: Schedule
    loss: Mapping  # the keyword arguments of algo.loss.policy_loss that settings decide (Config.loss_settings)
    # Old log-probs are taken once per generation batch only when optimizer steps train on it off-policy: later
    # steps of the batch, or a batch sampled ahead (async_generation, max_staleness > 0) with older weights; on
    # policy, the loss's own detached log-probs are the old ones. With a server's samples corrected
    # (sampling_correction), always: the correction compares them with the server's.
    keeps_old_logprobs: bool
    reference: str  # reference_kind: "none", "adapter" or "copy"
    optim: OptimSettings
    sampling: SamplingSettings
    cadence: Cadence
    server: ServerSettings | None = None  # sampling on an inference server (use_vllm)
    sampling_correction: Mapping | None = None  # TRL's importance-sampling correction of the server's samples

    @classmethod
    def resolve(cls, config, world_size: int) -> RunPlan:
        """The plan of `config` on `world_size` ranks; ConfigError for a schedule that cannot work
        (Schedule.resolve)."""
        schedule = Schedule.resolve(config, world_size)
        if config.async_generation and world_size > 1:
            raise ConfigError(f"async_generation=True runs one trainer process and its sampler; under torchrun "
                              f"({world_size} ranks) set async_generation=False")
        ahead = config.async_generation and config.max_staleness > 0
        correction = sampling_correction_of(config)
        return cls(schedule, MappingProxyType(config.loss_settings()),
                   schedule.optimizer_steps_per_generation > 1 or ahead or correction is not None,
                   reference_kind(config.use_lora, config.beta), OptimSettings.of(config), SamplingSettings.of(config),
                   Cadence.of(config), ServerSettings.of(config), correction)

    @property
    def has_reference(self) -> bool:
        """Whether the loss has reference log-probs (a KL penalty): a frozen copy or the adapter-disabled policy."""
        return self.reference != "none"
