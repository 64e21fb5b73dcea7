"""The run plan: what a Config and the number of ranks decide about a run, resolved once, before anything loads.
The trainer reads it, and the memory planner reads the same plan, so what the planner counts is what the run
keeps (old and reference log-probs above all). A Config resolves it when made, on the ranks torchrun announces,
so its errors come from `Config(...)` itself; the trainer resolves it again on its process group's ranks."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType

from .choices import prompt_once
from .planner import MemorySettings
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


@dataclass(frozen=True)
class SessionSettings:
    """What saving and resuming read of the settings (run/session)."""

    record: dict  # the Config as a checkpoint records it, and as resuming compares it with the saved one
    save_strategy: str  # when to save is the plan's Cadence; "no" here: no checkpoint on a signal or an error either
    save_total_limit: int | None
    seed: int
    num_generations: int
    optim: OptimSettings  # the hyperparameters a resumed run sets again

    @classmethod
    def of(cls, c) -> SessionSettings:
        return cls(asdict(c), c.save_strategy, c.save_total_limit, c.seed, c.num_generations,
                   OptimSettings.of(c))


@dataclass(frozen=True)
class TrackerSettings:
    """What the experiment trackers (run/trackers) read of the settings."""

    output_dir: str
    report_to: str | list[str]
    log_completions: bool
    num_completions_to_print: int | None

    @classmethod
    def of(cls, c) -> TrackerSettings:
        return cls(c.output_dir, c.report_to, c.log_completions, c.num_completions_to_print)


@dataclass(frozen=True)
class LogprobSettings:
    """What the policy's forwards (policy/forwards.Policy) read of the settings: the temperature the loss
    scores at, the LM head's chunk, where the reference comes from (`reference_kind`), FSDP, and whether each
    distinct prompt is forwarded once (settings/choices.prompt_once), and a mixture-of-experts router's loss
    weight (policy/router.py)."""

    temperature: float
    logprob_chunk_size: int
    reference: str  # "none", "adapter" or "copy"
    fsdp: bool
    prompt_once: bool
    router_aux_loss_coef: float | None

    @classmethod
    def of(cls, c) -> LogprobSettings:
        return cls(c.temperature, c.logprob_chunk_size, reference_kind(c.use_lora, c.beta), c.fsdp,
                   prompt_once(c.shared_prompt_forward, c.gradient_checkpointing), c.router_aux_loss_coef)


@dataclass(frozen=True)
class EvalSettings:
    """What the greedy evaluation (rollout/evaluate.evaluate) reads of the settings."""

    accuracy_func: str | None
    free_accuracy_func: str | None
    format_func: str | None
    breakdown_column: str | None
    limit: int | None  # the first rows of the eval dataset only
    reward_weights: tuple[float, ...] | None
    max_prompt_length: int | None
    max_completion_length: int
    chat_template_kwargs: Mapping | None
    max_tool_calling_iterations: int | None

    @classmethod
    def of(cls, c) -> EvalSettings:
        weights = None if c.reward_weights is None else tuple(c.reward_weights)
        kwargs = None if c.chat_template_kwargs is None else MappingProxyType(dict(c.chat_template_kwargs))
        return cls(c.eval_accuracy_func, c.eval_free_accuracy_func, c.eval_format_func, c.eval_breakdown_column,
                   c.eval_limit, weights, c.max_prompt_length, c.max_completion_length, kwargs,
                   c.max_tool_calling_iterations)


def interval_due(strategy: str, every: int, step: int, total: int, epoch_ended: bool) -> bool:
    """transformers' IntervalStrategy once optimizer step `step` (1-based) of `total` is done, as its
    DefaultFlowCallback reads it: "steps" every `every` steps and at the last, "epoch" at a step that ended a pass
    over the training prompts (`epoch_ended`) and at the last, "no" never."""
    if strategy == "no":
        return False
    return step >= total or (epoch_ended if strategy == "epoch" else step % every == 0)


@dataclass(frozen=True)
class SamplingKnobs:
    """The sampling knobs, as a decode applies them (rollout/engines/decoding.DecodeSettings); the defaults filter
    nothing, a greedy decode's. A run's are Config.sampling_knobs(): its fields, generation_kwargs applied."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class SamplingSettings:
    """What the trainer's sampler reads of the settings: prompts and completions' lengths, the sampling knobs
    (Config.sampling_knobs: generation_kwargs applied), the tool rounds, the seed of every prompt's random
    stream, and a micro-batch's prompts (the smallest decode)."""

    num_generations: int
    max_prompt_length: int | None  # None: prompts whole
    max_completion_length: int
    knobs: SamplingKnobs
    stop_at_eos: bool
    chat_template_kwargs: Mapping | None
    max_tool_calling_iterations: int | None
    seed: int
    micro_batch_prompts: int
    int8: bool = False  # int8_sampling_weights: int8 decoding steps, the sampler's log-probs kept
    bf16: bool = False  # policy/precision's bf16_sampling: bf16 decoding steps, the sampler's log-probs kept

    @classmethod
    def of(cls, c, bf16: bool = False) -> SamplingSettings:
        kwargs = None if c.chat_template_kwargs is None else MappingProxyType(dict(c.chat_template_kwargs))
        return cls(c.num_generations, c.max_prompt_length, c.max_completion_length,
                   c.sampling_knobs(), c.stop_at_eos, kwargs, c.max_tool_calling_iterations,
                   c.seed, max(1, c.per_device_train_batch_size // c.num_generations), c.int8_sampling_weights,
                   bf16)


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
class GenerationSettings:
    """What the generation pipeline (rollout/pipeline) reads of the settings: the prompts of a generation batch
    over all ranks and their random streams' seed, the rewards' weights, dynamic sampling's rounds, how
    advantages are scaled and truncated rows masked, how the batch is cut, which log-probs it fixes, and
    whether a sampler process makes it ahead."""

    num_generations: int
    prompts_per_generation: int
    seed: int  # of every prompt's random stream
    data_seed: int  # of the prompts' order (data_seed, else seed)
    shuffle_dataset: bool
    reward_weights: tuple[float, ...] | None
    refill_rounds: int | None  # dynamic_sampling_max_rounds; None: no dynamic sampling
    scale_rewards: str
    multi_objective_aggregation: str
    mask_truncated_completions: bool
    micro_batch: int  # rows per micro-batch
    old_logprobs: bool  # RunPlan.keeps_old_logprobs
    ref_logprobs: bool  # RunPlan.has_reference
    max_staleness: int | None  # async_generation's; None: made when the step needs it
    sampling_correction: Mapping | None  # a server's samples reweighted (RunPlan.sampling_correction)

    @classmethod
    def of(cls, c, schedule: Schedule, old_logprobs: bool, ref_logprobs: bool,
           sampling_correction: Mapping | None) -> GenerationSettings:
        return cls(c.num_generations, schedule.prompts_per_generation, c.seed,
                   c.seed if c.data_seed is None else c.data_seed, c.shuffle_dataset,
                   None if c.reward_weights is None else tuple(c.reward_weights),
                   c.dynamic_sampling_max_rounds if c.dynamic_sampling else None, c.scale_rewards,
                   c.multi_objective_aggregation, c.mask_truncated_completions, schedule.micro_batch, old_logprobs,
                   ref_logprobs, c.max_staleness if c.async_generation else None, sampling_correction)


@dataclass(frozen=True)
class LoadSettings:
    """What loading the policy and preparing it for training (policy/models: load_model, prepare_for_training,
    and policy/lora.with_adapter) read of the settings; the Config's own names, so a Config reads the same."""

    model: str
    model_init_kwargs: Mapping | None
    bf16: bool | None  # the precision plan when none is given (load_model)
    bf16_weights: bool
    load_in_4bit: bool
    gradient_checkpointing: bool
    use_lora: bool
    lora_r: int
    lora_alpha: int
    lora_dropout: float
    lora_target_modules: list[str] | str | None  # as peft's LoraConfig takes them
    disable_dropout: bool

    @classmethod
    def of(cls, c) -> LoadSettings:
        kwargs = None if c.model_init_kwargs is None else MappingProxyType(dict(c.model_init_kwargs))
        return cls(c.model, kwargs, c.bf16, c.bf16_weights, c.load_in_4bit, c.gradient_checkpointing, c.use_lora,
                   c.lora_r, c.lora_alpha, c.lora_dropout, c.lora_target_modules, c.disable_dropout)


@dataclass(frozen=True)
class DecodeSizes:
    """Prompts per decode, resolved before loading from the memory plan (memory/fit.decode_sizes) or the
    settings: `sampling` for our sampler (None: a micro-batch's prompts), `evaluation` for the greedy
    evaluation (Config.per_device_eval_batch_size when set)."""

    sampling: int | None
    evaluation: int


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
    generation: GenerationSettings
    session: SessionSettings
    trackers: TrackerSettings
    logprobs: LogprobSettings
    evaluation: EvalSettings
    loading: LoadSettings
    memory: MemorySettings
    server: ServerSettings | None = None  # sampling on an inference server (use_vllm)
    sampling_correction: Mapping | None = None  # TRL's importance-sampling correction of another engine's samples
    # Known once the run's data and model are (run/startup.prepare), before the model loads:
    total_steps: int | None = None  # optimizer steps of the run
    decode: DecodeSizes | None = None  # prompts per decode, the memory planner's

    @classmethod
    def resolve(cls, config, world_size: int, bf16_sampling: bool = False) -> RunPlan:
        """The plan of `config` on `world_size` ranks; ConfigError for a schedule that cannot work
        (Schedule.resolve). `bf16_sampling`: our decode samples on bf16 copies of the weights (the precision
        plan's, known where the device is: run/startup)."""
        correction = sampling_correction_of(config, bf16_sampling)
        reference = reference_kind(config.use_lora, config.beta)
        schedule = Schedule.resolve(config, world_size)
        ahead = config.async_generation and config.max_staleness > 0
        old = schedule.optimizer_steps_per_generation > 1 or ahead or correction is not None
        generation = GenerationSettings.of(config, schedule, old, reference != "none", correction)
        return cls(schedule, MappingProxyType(config.loss_settings()), old, reference, OptimSettings.of(config),
                   SamplingSettings.of(config, bf16_sampling), Cadence.of(config), generation,
                   SessionSettings.of(config), TrackerSettings.of(config), LogprobSettings.of(config),
                   EvalSettings.of(config), LoadSettings.of(config),
                   MemorySettings.of(config, schedule, old, reference),
                   ServerSettings.of(config), correction)

    @property
    def has_reference(self) -> bool:
        """Whether the loss has reference log-probs (a KL penalty): a frozen copy or the adapter-disabled policy."""
        return self.reference != "none"
