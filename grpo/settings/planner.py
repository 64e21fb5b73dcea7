"""What the memory planner (grpo/memory) reads of the settings and of the run plan, resolved once
(RunPlan.memory): the planner is handed these, never the Config."""
from __future__ import annotations

from dataclasses import dataclass

from .choices import lora_targets, planned_prompt_length, prompt_once
from .schedule import Schedule


@dataclass(frozen=True)
class MemorySettings:
    """What the memory planner (memory/estimate, memory/parts) reads of the settings and the plan, resolved:
    the kind of training, the lengths it counts, a micro-batch and a generation batch of this rank, the
    log-probs the run keeps, and `eval_batch_size` (set: evaluation decodes that many, the planner is not
    asked)."""

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
