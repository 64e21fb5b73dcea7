"""What each component of the runtime reads of the settings, one frozen dataclass each, built once by the run plan
(plan.py) from a Config and the plan's own decisions, so that no component reads the Config itself."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType

from .choices import lora_targets, planned_prompt_length, prompt_once, reference_kind
from .schedule import Schedule


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
    """What saving and resuming read of the settings (run/session), besides the plan's OptimSettings."""

    record: dict  # the Config as a checkpoint records it, with the tools a run calls (grpo.export reads them)
    save_strategy: str  # when to save is the plan's Cadence; "no" here: no checkpoint on a signal or an error either
    save_total_limit: int | None
    seed: int
    num_generations: int

    @classmethod
    def of(cls, c, tools: list[str] | None = None) -> SessionSettings:  # tools: rollout/tools.Tools.names
        record = asdict(c) if tools is None else {**asdict(c), "tools": tools}
        return cls(record, c.save_strategy, c.save_total_limit, c.seed, c.num_generations)


@dataclass(frozen=True)
class EntropySettings:
    """How adaptive entropy control moves the loss's entropy_coef (policy/gradients.EntropyControl)."""

    coef_min: float
    coef_max: float
    delta: float
    target: float

    @classmethod
    def of(cls, c) -> EntropySettings:
        return cls(c.entropy_coef_min, c.entropy_coef_max, c.entropy_coef_delta, c.entropy_target)


@dataclass(frozen=True)
class TrackerSettings:
    """What the experiment trackers (run/trackers) read of the settings; their folder is the plan's output_dir."""

    report_to: str | list[str]
    log_completions: bool
    num_completions_to_print: int | None

    @classmethod
    def of(cls, c) -> TrackerSettings:
        return cls(c.report_to, c.log_completions, c.num_completions_to_print)


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
    cast_lm_head_to_fp32: bool  # the reference copy's head too (policy/models.float32_head)

    @classmethod
    def of(cls, c) -> LogprobSettings:
        return cls(c.temperature, c.logprob_chunk_size, reference_kind(c.use_lora, c.beta), c.fsdp,
                   prompt_once(c.shared_prompt_forward, c.gradient_checkpointing), c.router_aux_loss_coef,
                   c.cast_lm_head_to_fp32)


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
    """What the trainer's sampler (rollout/engines: ours, a server's, a rollout_func's) reads of the settings."""

    num_generations: int
    max_prompt_length: int | None  # None: prompts whole
    max_completion_length: int
    knobs: SamplingKnobs  # Config.sampling_knobs: generation_kwargs applied
    stop_at_eos: bool
    chat_template_kwargs: Mapping | None
    max_tool_calling_iterations: int | None  # the tool rounds
    seed: int  # of every prompt's random stream
    micro_batch_prompts: int  # Schedule.prompts_per_micro_batch: the smallest decode
    int8: bool = False  # int8_sampling_weights: int8 decoding steps, the sampler's log-probs kept
    bf16: bool = False  # policy/precision's bf16_sampling: bf16 decoding steps, the sampler's log-probs kept

    @classmethod
    def of(cls, c, schedule: Schedule, bf16: bool = False) -> SamplingSettings:
        kwargs = None if c.chat_template_kwargs is None else MappingProxyType(dict(c.chat_template_kwargs))
        return cls(c.num_generations, c.max_prompt_length, c.max_completion_length, c.sampling_knobs(), c.stop_at_eos,
                   kwargs, c.max_tool_calling_iterations, c.seed, schedule.prompts_per_micro_batch,
                   c.int8_sampling_weights, bf16)


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


@dataclass(frozen=True)
class GenerationSettings:
    """What the generation pipeline (rollout/pipeline: draw, score, refill, cut, log-probs) reads of the settings."""

    num_generations: int
    prompts_per_generation: int  # over all ranks
    seed: int  # of every prompt's random stream
    data_seed: int  # of the prompts' order (data_seed, else seed)
    shuffle_dataset: bool
    reward_weights: tuple[float, ...] | None
    refill_rounds: int | None  # dynamic_sampling_max_rounds; None: no dynamic sampling
    scale_rewards: str
    multi_objective_aggregation: str
    mask_truncated_completions: bool
    micro_batch: int  # rows per micro-batch
    pad_to_multiple_of: int | None  # TRL's: each micro-batch's widths
    old_logprobs: bool  # the plan's choice: RunPlan.resolve
    ref_logprobs: bool  # a reference (beta > 0)
    max_staleness: int | None  # async_generation's; None: made when the step needs it
    sampling_correction: Mapping | None  # a server's samples reweighted (plan.sampling_correction_of)

    @classmethod
    def of(cls, c, schedule: Schedule, old_logprobs: bool, ref_logprobs: bool,
           sampling_correction: Mapping | None) -> GenerationSettings:
        return cls(c.num_generations, schedule.prompts_per_generation, c.seed,
                   c.seed if c.data_seed is None else c.data_seed, c.shuffle_dataset,
                   None if c.reward_weights is None else tuple(c.reward_weights),
                   c.dynamic_sampling_max_rounds if c.dynamic_sampling else None, c.scale_rewards,
                   c.multi_objective_aggregation, c.mask_truncated_completions, schedule.micro_batch,
                   c.pad_to_multiple_of, old_logprobs, ref_logprobs, c.max_staleness if c.async_generation else None,
                   sampling_correction)


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
    cast_lm_head_to_fp32: bool

    @classmethod
    def of(cls, c) -> LoadSettings:
        kwargs = None if c.model_init_kwargs is None else MappingProxyType(dict(c.model_init_kwargs))
        return cls(c.model, kwargs, c.bf16, c.bf16_weights, c.load_in_4bit, c.gradient_checkpointing, c.use_lora,
                   c.lora_r, c.lora_alpha, c.lora_dropout, c.lora_target_modules, c.disable_dropout,
                   c.cast_lm_head_to_fp32)


@dataclass(frozen=True)
class MemorySettings:
    """What the memory planner (memory/estimate, memory/parts) reads of the settings and the plan, resolved: the kind
    of training, the lengths it counts, a micro-batch and a generation batch of this rank, the log-probs the run
    keeps, and `eval_batch_size` (set: evaluation decodes that many, the planner is not asked)."""

    use_lora: bool
    quantized: bool  # QLoRA: the body's linear weights in 4 bits
    lora_r: int
    lora_targets: tuple[str, ...] | None  # settings/choices.lora_targets; None: every linear layer
    lora_dropout: bool  # an adapter's dropout runs (lora_dropout > 0, dropout not disabled)
    optim: str
    num_generations: int
    prompt_length: int  # settings/choices.planned_prompt_length
    completion_length: int  # max_completion_length
    gradient_checkpointing: bool
    prompt_once: bool  # settings/choices.prompt_once
    logprob_chunk_size: int
    accumulating: bool  # gradient_accumulation_steps > 1
    async_generation: bool
    schedule: Schedule
    logprobs_kept: int  # per-token log-prob rows kept for the generation batch: old, reference
    reference_copy: bool  # full fine-tuning's frozen reference copy
    eval_batch_size: int | None
    int8_sampling: bool  # int8_sampling_weights: int8 copies while sampling

    @classmethod
    def of(cls, c, schedule: Schedule, old_logprobs: bool, reference: str) -> MemorySettings:
        return cls(c.use_lora, c.use_lora and c.load_in_4bit, c.lora_r, lora_targets(c.lora_target_modules),
                   c.lora_dropout > 0 and not c.disable_dropout, c.optim, c.num_generations,
                   planned_prompt_length(c), c.max_completion_length, c.gradient_checkpointing,
                   prompt_once(c.shared_prompt_forward, c.gradient_checkpointing), c.logprob_chunk_size,
                   c.gradient_accumulation_steps > 1, c.async_generation, schedule,
                   old_logprobs + (reference != "none"), reference == "copy", c.per_device_eval_batch_size,
                   c.int8_sampling_weights)
