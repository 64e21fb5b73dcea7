"""`python -m grpo.train RECIPE [--key=value ...]`: run a recipe file, with type-checked overrides.

`python -m grpo.train RECIPE --help` lists every setting with its value in that recipe and what it means.
`torchrun --nproc_per_node=N -m grpo.train RECIPE [...]` trains data-parallel on N GPUs (or CPU processes)."""
from __future__ import annotations

import sys

USAGE = "usage: python -m grpo.train RECIPE [--key=value ...] [--help]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    from .config import ConfigError, apply_overrides, format_help, load_recipe, resolve_dataset

    recipe_path, overrides = argv[0], argv[1:]
    wants_help = any(a in ("-h", "--help") for a in overrides)
    try:
        recipe = load_recipe(recipe_path)
        config = apply_overrides(recipe.config, [a for a in overrides if a not in ("-h", "--help")])
        if wants_help:
            print(f"{USAGE}\n\nsettings of {recipe_path}:\n{format_help(config)}")
            return 0
        train_dataset = resolve_dataset(recipe.train_dataset, "train_dataset")
        eval_dataset = resolve_dataset(recipe.eval_dataset, "eval_dataset")
        model, tokenizer = recipe.resolve_model(config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from .distributed import shutdown
    from .trainer import Trainer

    try:
        trainer = Trainer(config, model=model, tokenizer=tokenizer, reward_funcs=recipe.reward_funcs,
                          train_dataset=train_dataset, eval_dataset=eval_dataset)
        trainer.train()
    finally:
        shutdown()  # under torchrun; nothing to do otherwise
    if trainer.dist.is_main:
        print(f"done: {trainer.step} steps; metrics in {config.output_dir}/metrics.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
