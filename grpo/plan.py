"""`python -m grpo.plan RECIPE [--key=value ...] [--gpu-memory GB]`: predicted peak GPU memory of a run, its
parts, whether it fits, and the cheapest settings change that makes it fit. Nothing is loaded but the model's
config. `python -m grpo.plan --table` prints the predictions for well-known models at the settings of the
"GRPO on a 16 GB GPU" write-up, next to what that write-up measured with TRL."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from .config import Config
from .memory import GB, Architecture, Estimate, Settings, estimate

# Facts from each model's config.json (hidden, layers, heads, KV heads, intermediate, vocab, tied, head_dim, bias).
_FACTS = {
    "Qwen/Qwen2.5-0.5B": (896, 24, 14, 2, 4864, 151936, True, None, True),
    "Qwen/Qwen2.5-1.5B": (1536, 28, 12, 2, 8960, 151936, True, None, True),
    "Qwen/Qwen2.5-3B": (2048, 36, 16, 2, 11008, 151936, True, None, True),
    "Qwen/Qwen2.5-7B": (3584, 28, 28, 4, 18944, 152064, False, None, True),
    "Qwen/Qwen2.5-14B": (5120, 48, 40, 8, 13824, 152064, False, None, True),
    "meta-llama/Llama-3.2-1B": (2048, 16, 32, 8, 8192, 128256, True, 64, False),
    "meta-llama/Llama-3.2-3B": (3072, 28, 24, 8, 8192, 128256, True, 128, False),
    "meta-llama/Llama-3.1-8B": (4096, 32, 32, 8, 14336, 128256, False, 128, False),
}
KNOWN = {name: Architecture(*facts[:5], vocab_size=facts[5], tie_word_embeddings=facts[6], head_dim=facts[7],
                            attention_bias=facts[8], name=name) for name, facts in _FACTS.items()}
KNOWN.update({f"{name}-Instruct": dataclasses.replace(a, name=f"{name}-Instruct") for name, a in list(KNOWN.items())})

# The write-up's table (TRL, H100, GSM8K, 1 x 4 generations, 256 + 786 tokens): peak GB, None where it ran out.
ARTICLE_GB = {"0.5B": (25, 13), "1B": (38, 16), "3B": (58, 32), "8B": (None, 58), "14B": (None, 69)}
TABLE_MODELS = {"0.5B": "Qwen/Qwen2.5-0.5B-Instruct", "1B": "meta-llama/Llama-3.2-1B-Instruct",
                "3B": "Qwen/Qwen2.5-3B-Instruct", "8B": "meta-llama/Llama-3.1-8B-Instruct",
                "14B": "Qwen/Qwen2.5-14B-Instruct"}
ARTICLE_CONFIG = Config(per_device_train_batch_size=1, gradient_accumulation_steps=4, num_generations=4,
                        max_prompt_length=256, max_completion_length=786, beta=0.04, optim="adamw", bf16=True)
TABLE_COLUMNS = {  # cumulative, as the write-up's columns
    "full": {},
    "+8-bit": {"optim": "adamw_8bit"},
    "+ckpt": {"optim": "adamw_8bit", "gradient_checkpointing": True},
    "LoRA": {"optim": "adamw_8bit", "gradient_checkpointing": True, "use_lora": True},
    "QLoRA": {"optim": "adamw_8bit", "gradient_checkpointing": True, "use_lora": True, "load_in_4bit": True},
}
CUDA_CONTEXT_GB = 0.5  # the CUDA context and kernels: outside the allocator, still on the card
FRAGMENTATION = 1.05  # the caching allocator reserves somewhat more than it hands out


def settings_of(config: Config) -> Settings:
    """The memory-relevant settings of a Config (prompts counted at max_prompt_length, the worst case)."""
    targets = tuple(config.lora_target_modules) if config.lora_target_modules else None
    return Settings(
        use_lora=config.use_lora, lora_r=config.lora_r, lora_dropout=config.lora_dropout, lora_targets=targets,
        load_in_4bit=config.load_in_4bit, optim=config.optim, gradient_checkpointing=config.gradient_checkpointing,
        beta=config.beta, bf16=config.bf16, prompts_per_micro_batch=config.per_device_train_batch_size,
        num_generations=config.num_generations, gradient_accumulation_steps=config.gradient_accumulation_steps,
        prompt_length=config.max_prompt_length, completion_length=config.max_completion_length,
        logprob_chunk_size=config.logprob_chunk_size,
    )


def architecture_of(config: Config, model=None, download: bool = False) -> Architecture | str:
    """The model's architecture: from `model` (a model or its HF config) when given, the built-in facts for
    well-known hub ids, else the config.json of `config.model` (a local path, the HF cache, or the hub when
    `download`). A string says why it could not be read."""
    if model is not None:
        hf_config = getattr(model, "config", model)
        return Architecture.from_hf_config(hf_config, name=getattr(hf_config, "name_or_path", "") or "the given model")
    if config.model in KNOWN:
        return KNOWN[config.model]
    try:
        from transformers import AutoConfig

        local = os.path.isdir(config.model) or not download
        return Architecture.from_hf_config(AutoConfig.from_pretrained(config.model, local_files_only=local),
                                           name=config.model)
    except Exception as e:  # noqa: BLE001 -- any failure to read a config is reported, never raised
        return f"cannot read the config of {config.model!r} ({type(e).__name__}), so no memory plan"


def predicted_gb(arch: Architecture, config: Config, device: str = "cuda") -> float:
    return estimate(arch, settings_of(config), device).peak / GB


def needed_gb(arch: Architecture, config: Config) -> float:
    """What the card must hold: the allocator's peak, its slack and the CUDA context."""
    return predicted_gb(arch, config) * FRAGMENTATION + CUDA_CONTEXT_GB


def candidate_changes(config: Config) -> list[dict]:
    """Settings changes, cheapest first: free ones, then slower steps, then a different kind of training, then
    less work per step."""
    c, changes = config, []
    if c.logprob_chunk_size > 128:
        changes.append({"logprob_chunk_size": 128})
    if c.optim != "adamw_8bit":
        changes.append({"optim": "adamw_8bit"})
    if c.use_lora and c.lora_dropout > 0:  # each adapter's dropout keeps a copy of its input for backward
        changes.append({"lora_dropout": 0.0})
    if not c.gradient_checkpointing:
        changes.append({"gradient_checkpointing": True})
    if c.per_device_train_batch_size > 1:
        half = c.per_device_train_batch_size // 2
        accumulation = c.gradient_accumulation_steps * c.per_device_train_batch_size // half
        changes.append({"per_device_train_batch_size": half, "gradient_accumulation_steps": accumulation})
    if not c.use_lora:
        changes.append({"use_lora": True})
    if not c.load_in_4bit:
        changes.append({"use_lora": True, "load_in_4bit": True})
    if c.num_generations > 2:
        changes.append({"num_generations": c.num_generations // 2})
    if c.max_completion_length > 64:
        changes.append({"max_completion_length": c.max_completion_length // 2})
    return changes


def cheapest_fit(arch: Architecture, config: Config, budget_gb: float) -> tuple[dict, float] | None:
    """The first single change that fits, else the shortest run of cumulative changes that does."""
    changes = candidate_changes(config)
    for change in changes:
        if needed_gb(arch, dataclasses.replace(config, **change)) <= budget_gb:
            return change, needed_gb(arch, dataclasses.replace(config, **change))
    for k in range(2, len(changes) + 1):
        chosen = changes[:k]
        if needed_gb(arch, _apply(config, chosen)) > budget_gb:
            continue
        for change in changes[:k - 1]:  # drop the earlier changes that the later ones made unnecessary
            rest = [c for c in chosen if c is not change]
            if needed_gb(arch, _apply(config, rest)) <= budget_gb:
                chosen = rest
        merged = {k: v for c in chosen for k, v in c.items() if getattr(config, k) != v}
        return merged, needed_gb(arch, _apply(config, chosen))
    return None


def _apply(config: Config, changes: list[dict]) -> Config:
    return dataclasses.replace(config, **{k: v for c in changes for k, v in c.items()})


def flags(change: dict) -> str:
    from .config import format_value

    return " ".join(f"--{k}={format_value(v)}" for k, v in change.items())


def describe(arch: Architecture, config: Config, device: str = "cuda") -> str:
    """The breakdown of the predicted peak, largest parts first."""
    e: Estimate = estimate(arch, settings_of(config), device)
    mode = "QLoRA" if config.use_lora and config.load_in_4bit else "LoRA" if config.use_lora else "full fine-tuning"
    extras = [config.optim] + (["checkpointing"] if config.gradient_checkpointing else []) + [f"beta={config.beta:g}"]
    N = config.per_device_train_batch_size * config.num_generations
    size = arch.num_params()
    size_text = f"{size / 1e9:.2f}B" if size >= 1e8 else f"{size / 1e6:.1f}M"
    lines = [f"{arch.name or 'model'}: {size_text} parameters, {mode}, {', '.join(extras)}, "
             f"micro-batch {N} sequences of {config.max_prompt_length}+{config.max_completion_length} tokens",
             f"predicted peak {'GPU' if device == 'cuda' else device.upper()} memory {_size(e.peak)} "
             f"(at {e.peak_moment}):"]
    parts = sorted(((e.parts[p], p) for p in e.moments[e.peak_moment] if e.parts[p] >= 0.005 * e.peak), reverse=True)
    lines += [f"  {name:<34} {_size(size):>10}" for size, name in parts]
    return "\n".join(lines)


def _size(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"


def plan_summary(config: Config, model=None, gpu_memory_gb: float | None = None) -> str:
    """A short breakdown of the predicted peak GPU memory and the cheapest change that fits `gpu_memory_gb`
    (default: the current GPU's memory, when there is one). Never raises: printed when training runs out of
    memory."""
    try:
        arch = architecture_of(config, model)
        if isinstance(arch, str):
            return arch
        if gpu_memory_gb is None:
            gpu_memory_gb = _cuda_memory_gb()
        return "\n".join([describe(arch, config)] + _verdict(arch, config, gpu_memory_gb))
    except Exception as e:  # noqa: BLE001 -- a planning bug must not hide the error that triggered it
        return f"no memory plan ({type(e).__name__}: {e})"


def _verdict(arch: Architecture, config: Config, budget_gb: float | None) -> list[str]:
    needed = needed_gb(arch, config)
    head = (f"needs about {needed:.1f} GB on the card (+{FRAGMENTATION - 1:.0%} allocator slack, "
            f"+{CUDA_CONTEXT_GB} GB CUDA context)")
    if budget_gb is None:
        return [head]
    if needed <= budget_gb:
        return [f"{head}: fits in {budget_gb:.1f} GB"]
    fit = cheapest_fit(arch, config, budget_gb)
    if fit is None:
        return [f"{head}: does not fit in {budget_gb:.1f} GB, not even with all of: "
                f"{flags({k: v for c in candidate_changes(config) for k, v in c.items() if getattr(config, k) != v})}"]
    change, after = fit
    return [f"{head}: does not fit in {budget_gb:.1f} GB",
            f"cheapest change that fits: {flags(change)} (about {after:.1f} GB)"]


def _cuda_memory_gb() -> float | None:
    try:
        import torch

        return torch.cuda.get_device_properties(0).total_memory / GB if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        return None


def table() -> str:
    """Predicted peak GB for the write-up's models and columns, with its measured TRL figures."""
    head = f"{'model':<34}" + "".join(f"{c:>8}" for c in TABLE_COLUMNS) + f"{'article full':>14}{'article LoRA':>14}"
    lines = ["predicted peak GPU memory (GB, allocated), 1 prompt x 4 generations, 256 + 786 tokens, "
             "4 micro-batches per step, beta=0.04, bf16", head]
    for size, name in TABLE_MODELS.items():
        arch = KNOWN[name]
        cells = [predicted_gb(arch, dataclasses.replace(ARTICLE_CONFIG, model=name, **change))
                 for change in TABLE_COLUMNS.values()]
        full, lora = ARTICLE_GB[size]
        article = [f"{v:>14}" if v else f"{'OOM':>14}" for v in (full, lora)]
        lines.append(f"{size + ' ' + name.split('/')[-1]:<34}" + "".join(f"{c:8.1f}" for c in cells) + "".join(article))
    lines.append(f"(the card also holds the CUDA context, ~{CUDA_CONTEXT_GB} GB, "
                 f"and allocator slack, ~{FRAGMENTATION - 1:.0%})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m grpo.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", help="a recipe file (see README)")
    parser.add_argument("--gpu-memory", type=float, help="GB on the card; default: this machine's GPU, if any")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="predict for this device")
    parser.add_argument("--table", action="store_true", help="the write-up's table for well-known models")
    args, overrides = parser.parse_known_args(argv)
    if args.table:
        print(table())
        return 0
    if not args.recipe:
        parser.print_usage()
        return 2
    from .errors import ConfigError
    from .recipe import load_with_overrides

    try:
        recipe, config = load_with_overrides(args.recipe, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        model_config = _recipe_model_config(recipe, config)
    except Exception as e:  # noqa: BLE001 -- e.g. a warm start inside build_model: meta tensors hold no values
        print(f"error: {args.recipe}'s build_model does more than build a model ({type(e).__name__} on the meta "
              f"device, where no weights exist), so no memory plan", file=sys.stderr)
        return 1
    arch = architecture_of(config, model_config, download=True)
    if isinstance(arch, str):
        print(f"error: {arch}", file=sys.stderr)
        return 1
    budget = args.gpu_memory if args.gpu_memory is not None else (_cuda_memory_gb() if args.device == "cuda" else None)
    print(describe(arch, config, args.device))
    if args.device == "cuda":
        print("\n".join(_verdict(arch, config, budget)))
    return 0


def _recipe_model_config(recipe, config: Config):
    """The config of a recipe's own `build_model`, built on the meta device (no weights); None otherwise."""
    if recipe.build_model is None:
        return None
    import torch

    with torch.device("meta"):
        model, _ = recipe.build_model(config)
    model.config.name_or_path = model.config.name_or_path or f"{recipe.path}'s build_model"
    return model.config


if __name__ == "__main__":
    sys.exit(main())
