"""`python -m grpo.train RECIPE [--key=value ...]`: run a recipe file, with type-checked overrides (`--help`: every
setting with its value in that recipe), under torchrun data-parallel. A mistake prints one `error:` line and exits 1
(2 for settings); a signal saves a checkpoint (docs/checkpoints-and-failures.md)."""
from __future__ import annotations

import os
import shlex
import sys

from .errors import UserError, command_line

USAGE = "usage: python -m grpo.train RECIPE [--key=value ...] [--help]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):  # no recipe: every setting at its default
        if not argv:
            print(USAGE)
            return 2
        from .settings import Config
        from .settings.cli import format_help

        print(f"{USAGE}\n\nA recipe is a Python file defining `config` (a grpo.Config), `reward_funcs` and "
              f"`train_dataset` (recipes/ holds examples; README). The settings at their defaults:\n"
              f"{format_help(Config())}")
        return 0
    with command_line():  # every message's hint names settings as --key=value
        try:
            from .infra.progress import quiet_library_bars
            from .settings.cli import BUILT_MODEL, format_help
            from .settings.recipe import load_with_overrides

            recipe_path, overrides = argv[0], argv[1:]
            recipe, config = load_with_overrides(recipe_path, [a for a in overrides if a not in ("-h", "--help")])
            if any(a in ("-h", "--help") for a in overrides):
                unused = BUILT_MODEL if recipe.build_model else None
                print(f"{USAGE}\n\nsettings of {recipe_path}:\n{format_help(config, unused)}")
                return 0
            with quiet_library_bars():  # transformers' loading and saving bars, in a log file
                return run(recipe, config, argv)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code
        except KeyboardInterrupt:  # Ctrl-C while loading, before training could save anything
            print("interrupted before training started", file=sys.stderr)
            return 130


def run(recipe, config, argv: list[str]) -> int:
    """Train; when a run stops early (signal, out of memory, a user error), say what was saved and how to resume."""
    import torch

    from .infra.distributed import shutdown
    from .settings.recipe import resolve_dataset
    from .infra.interrupts import TrainingInterrupted
    from .trainer import Trainer

    train_dataset = resolve_dataset(recipe.train_dataset, "train_dataset")
    eval_dataset = resolve_dataset(recipe.eval_dataset, "eval_dataset")
    trainer = None
    try:
        model, tokenizer = recipe.resolve_model(config)
        trainer = Trainer(config, model=model, tokenizer=tokenizer, reward_funcs=recipe.reward_funcs,
                          train_dataset=train_dataset, eval_dataset=eval_dataset, rollout_func=recipe.rollout_func,
                          reward_processing_classes=recipe.reward_processing_classes, tools=recipe.tools,
                          environment_factory=recipe.environment_factory, callbacks=recipe.callbacks)
        trainer.train()
    except TrainingInterrupted as e:
        saved = f"saved {e.checkpoint}\n{resume_hint(argv, e.checkpoint)}" if e.checkpoint else e.unsaved
        if trainer is None or trainer.dist.is_main:  # under torchrun every rank stops, and says so once
            print(f"{e.summary}: {saved}", file=sys.stderr)
        return 128 + e.signum
    except torch.cuda.OutOfMemoryError as e:  # the same class as torch.OutOfMemoryError
        print(out_of_memory_report(config, e, trainer), file=sys.stderr)
        return 1
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        if trainer is not None and trainer.session.last_checkpoint is not None:
            print(resume_hint(argv, trainer.session.last_checkpoint), file=sys.stderr)
        return e.exit_code
    finally:
        if trainer is not None:  # DDP's reducer must not outlive the process group it holds
            trainer.policy.parallel.close()
        shutdown()  # under torchrun; nothing to do otherwise
    if trainer.dist.is_main:
        print(f"done: {trainer.step} steps; metrics in {config.output_dir}/metrics.jsonl")
    return 0


def resume_hint(argv: list[str], checkpoint) -> str:
    args = [a for a in argv if not a.startswith(("--resume_from_checkpoint=", "--resume-from-checkpoint="))]
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # set by torchrun: resume with as many ranks
    launcher = f"torchrun --nproc_per_node={ranks}" if ranks > 1 else "python"
    resume = f"--resume_from_checkpoint={shlex.quote(str(checkpoint))}"
    return f"resume with: {launcher} -m grpo.train {shlex.join(args)} {resume}"


def out_of_memory_report(config, error: Exception, trainer) -> str:
    """What ran out, the settings that need less memory (the planner's list, cheapest first), the planner's
    estimate for this configuration, and where the last checkpoint is."""
    from .memory import fit

    where = "while loading the model" if trainer is None else f"in step {trainer.step + 1}"
    lines = [f"error: out of GPU memory {where}: {str(error).splitlines()[0]}", "settings that need less memory:"]
    lines += [f"  {fit.flags(change)} ({why})" for change, why in fit.memory_savings(config)]
    try:
        plan = fit.plan_summary(config).splitlines()
        lines += ["memory plan for this configuration:", *(f"  {line}" for line in plan)]
    except Exception:  # noqa: BLE001, S110 -- the planner must never hide the message above
        pass
    if trainer is not None and trainer.session.last_checkpoint is not None:
        lines.append(f"the last checkpoint is {trainer.session.last_checkpoint}; after changing settings, "
                     f"--resume_from_checkpoint=latest continues from it")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
