"""Does a run fit on the card, and what to change when it does not: one list of memory-saving changes,
cheapest first, used both by the planner (`python -m grpo.plan`) and by the out-of-memory report."""
from __future__ import annotations

import dataclasses

from ..policy.precision import Precision
from ..settings import Config
from ..settings.choices import planned_prompt_length, prompt_once
from ..settings.cli import format_value
from ..settings.components import MemorySettings
from ..settings.plan import DecodeSizes
from .estimate import GB, estimate, plan_peak, settings_of
from .known_models import architecture_of
from .parts import Architecture, dtypes, prompts_in_micro_batch

EVAL_BATCH_WITHOUT_PLAN = 64  # prompts per evaluation decode when the model's architecture cannot be read
CUDA_CONTEXT_GB = 0.5  # the CUDA context and kernels: outside the allocator, still on the card
FRAGMENTATION = 1.05  # the caching allocator reserves somewhat more than it hands out


def smaller_micro_batches(c: Config) -> list[dict]:
    """Each smaller micro-batch, largest first, with the accumulation (and steps_per_generation, when set)
    that keeps the step's completions: the sizes that divide the current one, down to one prompt's group of
    num_generations (sampling takes whole groups, so a smaller one saves little), or down to half of a
    micro-batch of two groups or less."""
    n, floor = c.per_device_train_batch_size, min(c.num_generations, c.per_device_train_batch_size // 2)
    changes = []
    for size in (d for d in range(n - 1, max(floor, 1) - 1, -1) if n % d == 0):
        factor = n // size
        change = {"per_device_train_batch_size": size,
                  "gradient_accumulation_steps": c.gradient_accumulation_steps * factor}
        if c.steps_per_generation is not None:
            change["steps_per_generation"] = c.steps_per_generation * factor
        changes.append(change)
    return changes


def memory_savings(c: Config, every_micro_batch: bool = False) -> list[tuple[dict, str]]:
    """(settings change, what it does) for each change that lowers peak memory from `c`, cheapest first: free
    ones, slower steps, another kind of training, less work per step. Smaller micro-batches come as the largest
    one (`every_micro_batch`: each of them, for the planner's search)."""
    changes = []
    if c.logprob_chunk_size > 128:
        changes.append(({"logprob_chunk_size": 128}, "smaller LM-head logits chunks"))
    if c.optim != "adamw_8bit":
        changes.append(({"optim": "adamw_8bit"}, "optimizer state 4x smaller"))
    if not c.use_lora and not c.bf16_weights and not c.fsdp:
        changes.append(({"bf16_weights": True}, "bf16 weights and gradients, updated with stochastic rounding"))
    if c.use_lora and c.lora_dropout > 0 and not c.disable_dropout:
        changes.append(({"lora_dropout": 0.0}, "each adapter's dropout keeps a copy of its input for backward"))
    if not c.gradient_checkpointing:
        changes.append(({"gradient_checkpointing": True}, "recompute activations in backward"))
    micro_batches = smaller_micro_batches(c)
    shown = micro_batches if every_micro_batch else micro_batches[:1]
    changes += [(change, "same completions per step") for change in shown]
    lora = {"use_lora": True, "bf16_weights": False} if c.bf16_weights else {"use_lora": True}
    if not c.use_lora:
        changes.append((lora, "train adapters: no full gradients, optimizer state or reference copy"))
    if not c.load_in_4bit:
        changes.append(({**lora, "load_in_4bit": True}, "QLoRA: 4-bit frozen base weights"))
    if c.num_generations > 2:
        changes.append(({"num_generations": c.num_generations // 2}, "fewer completions per prompt"))
    if c.max_completion_length > 64:
        changes.append(({"max_completion_length": c.max_completion_length // 2}, "shorter completions"))
    return changes


def decode_sizes(m: MemorySettings, arch: Architecture | str, precision: Precision) -> DecodeSizes:
    """Prompts per decode, read before loading from the architecture `arch` (a string: why it could not be
    read), the planner's settings `m` and the dtype plan. Sampling: `Estimate.decode_prompts`, None (a
    micro-batch's) where the architecture cannot be read. Evaluation: `m.eval_batch_size` when set, else
    `Estimate.eval_prompts`, else EVAL_BATCH_WITHOUT_PLAN."""
    if isinstance(arch, str):
        return DecodeSizes(None, EVAL_BATCH_WITHOUT_PLAN if m.eval_batch_size is None else m.eval_batch_size)
    e = plan_peak(arch, m, dtypes(precision, m.use_lora))
    return DecodeSizes(e.decode_prompts, e.eval_prompts if m.eval_batch_size is None else m.eval_batch_size)


def eval_batch_size(config: Config, model=None, device: str = "cuda") -> int:
    """Prompts per greedy evaluation decode of `config`'s model (`model` when given) on `device`."""
    m, precision = settings_of(config, device)
    return decode_sizes(m, architecture_of(config.model, model), precision).evaluation


def flags(change: dict) -> str:
    return " ".join(f"--{k}={format_value(v)}" for k, v in change.items())


def predicted_gb(arch: Architecture, config: Config, device: str = "cuda") -> float:
    return estimate(arch, config, device).peak / GB


def needed_gb(arch: Architecture, config: Config) -> float:
    """What the card must hold: the allocator's peak, its slack and the CUDA context."""
    return predicted_gb(arch, config) * FRAGMENTATION + CUDA_CONTEXT_GB


def cheapest_fit(arch: Architecture, config: Config, budget_gb: float) -> tuple[dict, float] | None:
    """The first single change that fits, else the shortest run of cumulative changes that does, with the
    largest micro-batch that still fits beside the others. Every smaller micro-batch down to one group is a
    change of its own (largest first; a later one replaces an earlier one's sizes)."""
    changes = [change for change, _ in memory_savings(config, every_micro_batch=True)]
    for change in changes:
        if needed_gb(arch, _apply(config, [change])) <= budget_gb:
            return change, needed_gb(arch, _apply(config, [change]))
    for k in range(2, len(changes) + 1):
        chosen = changes[:k]
        if needed_gb(arch, _apply(config, chosen)) > budget_gb:
            continue
        for change in changes[:k - 1]:  # drop the earlier changes that the later ones made unnecessary
            rest = [c for c in chosen if c is not change]
            if needed_gb(arch, _apply(config, rest)) <= budget_gb:
                chosen = rest
        sizes = smaller_micro_batches(config)
        kept = [c for c in chosen if c in sizes]  # one at most: an overridden size is always dropped above
        for larger in sizes[:sizes.index(kept[0])] if kept else []:  # largest first
            replaced = [larger if c in sizes else c for c in chosen]
            if needed_gb(arch, _apply(config, replaced)) <= budget_gb:
                chosen = replaced
                break
        return _changed(config, chosen), needed_gb(arch, _apply(config, chosen))
    return None


def _apply(config: Config, changes: list[dict]) -> Config:
    settings = {k: v for c in changes for k, v in c.items()}
    if settings.get("use_lora", config.use_lora) and settings.get("bf16_weights", config.bf16_weights):
        settings["bf16_weights"] = False  # bf16_weights is for full fine-tuning: LoRA replaces it
    return dataclasses.replace(config, **settings)


def _changed(config: Config, changes: list[dict]) -> dict:
    """The settings that `changes`, applied in order, leave different from `config` (a later change may undo
    an earlier one: LoRA turns bf16_weights off again)."""
    final = _apply(config, changes)
    return {k: getattr(final, k) for c in changes for k in c if getattr(final, k) != getattr(config, k)}


def describe(arch: Architecture, config: Config, device: str = "cuda") -> str:
    """The breakdown of the predicted peak, largest parts first."""
    e = estimate(arch, config, device)
    mode = "QLoRA" if config.use_lora and config.load_in_4bit else "LoRA" if config.use_lora else "full fine-tuning"
    extras = [config.optim] + (["checkpointing"] if config.gradient_checkpointing else []) + [f"beta={config.beta:g}"]
    N, size = config.per_device_train_batch_size, arch.num_params()
    size_text = f"{size / 1e9:.2f}B" if size >= 1e8 else f"{size / 1e6:.1f}M"
    P, C = planned_prompt_length(config), config.max_completion_length
    once = ""
    if prompt_once(config.shared_prompt_forward, config.gradient_checkpointing):  # policy/prefix.py
        once = f", each prompt once: {prompts_in_micro_batch(N, config.num_generations)} x {P} + {N} x {C} tokens"
    lines = [f"{arch.name or 'model'}: {size_text} parameters, {mode}, {', '.join(extras)}, "
             f"micro-batch {N} sequences of {P}+{C} tokens{once}",
             f"predicted peak {'GPU' if device == 'cuda' else device.upper()} memory {_size(e.peak)} "
             f"(at {e.peak_moment}):"]
    parts = sorted(((e.parts[p], p) for p in e.moments[e.peak_moment] if e.parts[p] >= 0.005 * e.peak), reverse=True)
    lines += [f"  {name:<34} {_size(size):>10}" for size, name in parts]
    return "\n".join(lines)


def _size(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"


def plan_summary(config: Config, gpu_memory_gb: float | None = None) -> str:
    """A short breakdown of the predicted peak GPU memory and the cheapest change that fits `gpu_memory_gb`
    (default: the current GPU's). Never raises: printed when training runs out of memory."""
    try:
        arch = architecture_of(config.model)
        if isinstance(arch, str):
            return arch
        if gpu_memory_gb is None:
            gpu_memory_gb = cuda_memory_gb()
        return "\n".join([describe(arch, config)] + verdict(arch, config, gpu_memory_gb))
    except Exception as e:  # noqa: BLE001 -- a planning bug must not hide the error that triggered it
        return f"no memory plan ({type(e).__name__}: {e})"


def verdict(arch: Architecture, config: Config, budget_gb: float | None) -> list[str]:
    needed = needed_gb(arch, config)
    head = (f"needs about {needed:.1f} GB on the card (+{FRAGMENTATION - 1:.0%} allocator slack, "
            f"+{CUDA_CONTEXT_GB} GB CUDA context)")
    if budget_gb is None:
        return [head]
    if needed <= budget_gb:
        return [f"{head}: fits in {budget_gb:.1f} GB"]
    fit = cheapest_fit(arch, config, budget_gb)
    if fit is None:
        everything = _changed(config, [c for c, _ in memory_savings(config, every_micro_batch=True)])
        return [f"{head}: does not fit in {budget_gb:.1f} GB, not even with all of: {flags(everything)}"]
    change, after = fit
    return [f"{head}: does not fit in {budget_gb:.1f} GB",
            f"cheapest change that fits: {flags(change)} (about {after:.1f} GB)"]


def cuda_memory_gb() -> float | None:
    try:
        import torch

        return torch.cuda.get_device_properties(0).total_memory / GB if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        return None
