"""`python -m grpo.plan RECIPE [--key=value ...] [--gpu-memory GB]`: predicted peak GPU memory of a run, its
parts, whether it fits, and the cheapest settings change that makes it fit. Nothing is loaded but the model's
config. `python -m grpo.plan --table` prints the predictions for well-known models at the settings of the
"GRPO on a 16 GB GPU" write-up, next to what that write-up measured with TRL."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from .settings import Config
from .memory.fit import CUDA_CONTEXT_GB, FRAGMENTATION, cuda_memory_gb, describe, predicted_gb, verdict
from .memory.known_models import ARTICLE_CONFIG, ARTICLE_GB, KNOWN, TABLE_COLUMNS, TABLE_MODELS, architecture_of


def table() -> str:
    """Predicted peak GB for the write-up's models and columns, with its measured TRL figures."""
    head = f"{'model':<34}" + "".join(f"{c:>8}" for c in TABLE_COLUMNS) + f"{'article full':>14}{'article LoRA':>14}"
    lines = ["predicted peak GPU memory (GB, allocated), 4 completions (1 prompt x 4), 256 + 786 tokens, "
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
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="predict for this device; default: cuda with --gpu-memory or a GPU here, else cpu")
    parser.add_argument("--table", action="store_true", help="the write-up's table for well-known models")
    args, overrides = parser.parse_known_args(argv)
    if args.table:
        print(table())
        return 0
    if not args.recipe:
        parser.print_usage()
        return 2
    from .errors import ConfigError
    from .policy.precision import Precision
    from .settings.recipe import load_with_overrides

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
    arch = architecture_of(config.model, model_config, download=True)
    if isinstance(arch, str):
        print(f"error: {arch}", file=sys.stderr)
        return 1
    if args.device is None:  # this machine's, unless a card's memory is given
        args.device = "cuda" if args.gpu_memory is not None or cuda_memory_gb() is not None else "cpu"
        if args.device == "cpu":
            print("no GPU here: planning for this CPU (--device=cuda --gpu-memory=GB plans for a card)",
                  file=sys.stderr)
    budget = args.gpu_memory if args.gpu_memory is not None else (cuda_memory_gb() if args.device == "cuda" else None)
    print(describe(arch, config, args.device))
    print(Precision.of(config, args.device).statement)
    if args.device == "cuda":
        print("\n".join(verdict(arch, config, budget)))
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
