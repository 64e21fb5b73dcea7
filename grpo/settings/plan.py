"""The run plan: what a Config and the number of ranks decide about a run, resolved once, before anything loads,
and each component's settings (components.py). The memory planner reads the same plan as the trainer, so what it
counts is what the run keeps (old and reference log-probs above all). A Config resolves it when made, on the ranks
torchrun announces, so its errors come from `Config(...)`; the trainer resolves it on its process group's ranks."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from .choices import reference_kind
from .components import (EntropySettings, EvalSettings, GenerationSettings, LoadSettings, LogprobSettings,
                         MemorySettings, OptimSettings, SamplingSettings, ServerSettings, SessionSettings,
                         TrackerSettings)
from .schedule import Schedule


def ranks_from_env() -> int:
    """The number of ranks torchrun starts (its WORLD_SIZE), 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def interval_due(strategy: str, every: int, step: int, total: int, epoch_ended: bool) -> bool:
    """transformers' IntervalStrategy once optimizer step `step` (1-based) of `total` is done, as its
    DefaultFlowCallback reads it: "steps" every `every` steps and at the last, "epoch" at a step that ended a pass
    over the training prompts (`epoch_ended`) and at the last, "no" never."""
    if strategy == "no":
        return False
    return step >= total or (epoch_ended if strategy == "epoch" else step % every == 0)


def sampling_correction_of(c, bf16_sampling: bool = False) -> Mapping | None:
    """The keyword arguments of algo/sampling_correction.sampling_correction a run applies, or None: samples of
    another engine than the trained policy (a vLLM server, or our decode on int8 or, `bf16_sampling`, bf16
    weights), corrected unless vllm_importance_sampling_correction is off (TRL's default: on)."""
    other_engine = c.use_vllm or c.int8_sampling_weights or bf16_sampling
    if not (other_engine and c.vllm_importance_sampling_correction):
        return None
    return MappingProxyType(dict(mode=c.vllm_importance_sampling_mode, clip_min=c.vllm_importance_sampling_clip_min,
                                 clip_max=c.vllm_importance_sampling_clip_max))


@dataclass(frozen=True)
class DecodeSizes:
    """Prompts per decode, resolved before loading from the memory plan (memory/fit.decode_sizes) or the
    settings: `sampling` for our sampler (None: a micro-batch's prompts), `evaluation` for the greedy
    evaluation (Config.per_device_eval_batch_size when set)."""

    sampling: int | None
    evaluation: int


@dataclass(frozen=True)
class Cadence:
    """When a run writes a metrics line (every `logging_steps` and at the last step), evaluates (eval_strategy, and
    eval_on_start: at step 0) and saves a checkpoint (save_strategy), each as transformers reads it (`interval_due`)."""

    logging_steps: int
    eval_strategy: str
    eval_steps: int | None  # None: logging_steps (transformers' fallback)
    eval_on_start: bool
    save_strategy: str
    save_steps: int

    @classmethod
    def of(cls, config) -> Cadence:
        return cls(config.logging_steps, config.eval_strategy, config.eval_steps, config.eval_on_start,
                   config.save_strategy, config.save_steps)

    def due(self, step: int, total: int, epoch_ended: bool) -> tuple[bool, bool, bool]:
        """(log, evaluate, save) once optimizer step `step` of `total` is done; `epoch_ended`: it ended a pass
        over the training prompts (Schedule.ends_epoch)."""
        return (step % self.logging_steps == 0 or step == total,
                interval_due(self.eval_strategy, self.eval_steps or self.logging_steps, step, total, epoch_ended),
                interval_due(self.save_strategy, self.save_steps, step, total, epoch_ended))


@dataclass(frozen=True)
class RunPlan:
    schedule: Schedule
    output_dir: Path  # the run's folder: checkpoints, logs, a vLLM server's adapters
    loss: Mapping  # the keyword arguments of algo.loss.policy_loss that settings decide (Config.loss_settings)
    entropy: EntropySettings  # how the loss's entropy_coef adapts (use_adaptive_entropy)
    sync_ref_model: bool  # TRL's SyncRefModelCallback added, which reads its settings from `args` (run/callbacks)
    optim: OptimSettings
    sampling: SamplingSettings
    cadence: Cadence
    generation: GenerationSettings
    session: SessionSettings
    trackers: TrackerSettings
    logprobs: LogprobSettings
    evaluation: EvalSettings
    loading: LoadSettings
    memory: MemorySettings
    server: ServerSettings | None = None  # sampling on an inference server (use_vllm)
    # Known once the run's data and model are (run/startup.prepare), before the model loads:
    total_steps: int | None = None  # optimizer steps of the run
    decode: DecodeSizes | None = None  # prompts per decode, the memory planner's

    @classmethod
    def resolve(cls, config, world_size: int, bf16_sampling: bool = False, tools: list[str] | None = None) -> RunPlan:
        """The plan of `config` on `world_size` ranks; ConfigError for a schedule that cannot work (Schedule.resolve).
        `bf16_sampling`: our decode samples on bf16 copies of the weights (the precision plan's, known where the
        device is: run/startup); `tools`: the names of the tools the run calls, which checkpoints record."""
        correction = sampling_correction_of(config, bf16_sampling)
        reference = reference_kind(config.use_lora, config.beta)
        schedule = Schedule.resolve(config, world_size)
        # Old log-probs are taken once per generation batch only when optimizer steps train on it off-policy: later
        # steps of the batch, or a batch sampled ahead (async_generation, max_staleness > 0) with older weights; on
        # policy, the loss's own detached log-probs are the old ones. With another engine's samples corrected
        # (sampling_correction), always: the correction compares them with the sampler's.
        ahead = config.async_generation and config.max_staleness > 0
        old = schedule.optimizer_steps_per_generation > 1 or ahead or correction is not None
        generation = GenerationSettings.of(config, schedule, old, reference != "none", correction)
        return cls(schedule, Path(config.output_dir), MappingProxyType(config.loss_settings()),
                   EntropySettings.of(config), config.sync_ref_model, OptimSettings.of(config),
                   SamplingSettings.of(config, schedule, bf16_sampling), Cadence.of(config), generation,
                   SessionSettings.of(config, tools), TrackerSettings.of(config), LogprobSettings.of(config),
                   EvalSettings.of(config), LoadSettings.of(config),
                   MemorySettings.of(config, schedule, old, reference), ServerSettings.of(config))
