"""`python -m grpo.eval RECIPE [--checkpoint DIR] [--limit N] [--output FILE] [--key=value ...]`: greedy
pass@1 of a model on the recipe's `eval_dataset`; prints the mean reward, accuracy, format-free accuracy, format
rate (those the recipe sets) and mean length (and them by `eval_breakdown_column`'s values), writes JSON.

Without --checkpoint it evaluates the model the recipe starts from (for a recipe with a warm start, the model
right after it). The JSON (default: DIR/eval.json, or OUTPUT_DIR/eval.json) holds the metrics and every
prompt, completion and reward."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from .errors import ConfigError, UserError, command_line

USAGE = ("usage: python -m grpo.eval RECIPE [--checkpoint DIR] [--limit N] [--output FILE] [--key=value ...] "
         "[--help]")
OPTIONS = """Greedy pass@1 of a model on RECIPE's eval_dataset: prints the mean reward, accuracy, format rate and
mean length, and writes them with every prompt, completion and reward (and the dataset's other columns) to JSON.

  --checkpoint DIR  a checkpoint-STEP folder, or a folder Trainer.save_model wrote (a LoRA adapter is loaded
                    onto the recipe's base model); default: the model the recipe starts from
  --limit N         the first N prompts only (default: the recipe's eval_limit, else every prompt)
  --output FILE     where the JSON goes (default: DIR/eval.json, or OUTPUT_DIR/eval.json)
  --key=value       any setting of the recipe; python -m grpo.eval RECIPE --help lists them"""
OWN_OPTIONS = ("checkpoint", "limit", "output")


def split_options(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """This command's own options (`--name=value` or `--name value`) apart from Config overrides."""
    own, rest, i = {}, [], 0
    while i < len(args):
        key, has_value, value = args[i][2:].partition("=") if args[i].startswith("--") else ("", False, "")
        if key in OWN_OPTIONS:
            if not has_value:
                if i + 1 == len(args):
                    raise ConfigError(f"--{key} needs a value")
                value, i = args[i + 1], i + 1
            own[key] = value
        else:
            rest.append(args[i])
        i += 1
    return own, rest


def load_checkpoint(path: Path, recipe, config):
    """(model, tokenizer) from a checkpoint-STEP folder: full weights, or a LoRA adapter on the recipe's base."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .policy.models import load_model, load_tokenizer
    from .run.checkpoint import damage, unloadable

    if not (path / "config.json").exists() and not (path / "adapter_config.json").exists():
        raise ConfigError(f"{path} is not a checkpoint folder (no config.json or adapter_config.json)")
    problem = damage(path, weights_only=True)
    if problem is not None:
        raise unloadable("--checkpoint", path, problem, weights_only=True)
    if (path / "adapter_config.json").exists():
        from peft import PeftModel

        base, tokenizer = recipe.resolve_model(config)
        model = PeftModel.from_pretrained(base if base is not None else load_model(config), path)
    else:
        import torch

        model = AutoModelForCausalLM.from_pretrained(path).to("cuda" if torch.cuda.is_available() else "cpu")
        tokenizer = None
    if (path / "tokenizer_config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer if tokenizer is not None else load_tokenizer(config.model)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{OPTIONS}" if argv else USAGE)
        return 0 if argv else 2
    from .infra.progress import quiet_library_bars

    with command_line(), quiet_library_bars():  # hints as --key=value; transformers' loading bars, in a log file
        return evaluate_recipe(argv)


def evaluate_recipe(argv: list[str]) -> int:
    from .rollout.evaluate import check_eval_inputs, evaluate, summary_lines
    from .rollout.reward_models import place_reward_models, reward_callables
    from .run.checkpoint import check_output_dir
    from .settings.cli import BUILT_MODEL, format_help
    from .settings.plan import EvalSettings
    from .settings.recipe import load_with_overrides, resolve_dataset

    try:
        own, overrides = split_options([a for a in argv[1:] if a not in ("-h", "--help")])
        if "limit" in own and not (own["limit"].isdigit() and int(own["limit"]) >= 1):
            raise ConfigError(f"--limit must be a positive integer, got {own['limit']!r}")
        limit = int(own["limit"]) if "limit" in own else None
        recipe, config = load_with_overrides(argv[0], overrides)
        if any(a in ("-h", "--help") for a in argv[1:]):
            unused = BUILT_MODEL if recipe.build_model else None
            print(f"{USAGE}\n\n{OPTIONS}\n\nsettings of {argv[0]}:\n{format_help(config, unused)}")
            return 0
        if recipe.eval_dataset is None:  # said before anything about the functions that would score it
            raise ConfigError(f"recipe {argv[0]} defines no eval_dataset: grpo.eval evaluates on it")
        checkpoint = Path(own["checkpoint"]) if "checkpoint" in own else None
        output = Path(own.get("output") or (checkpoint or Path(config.output_dir)) / "eval.json")
        if output.is_dir():
            raise ConfigError(f"--output={output} is a folder: name a file in it, such as "
                              f"{output / 'eval.json'}")
        check_output_dir(str(output.parent), "output")
        reward_funcs = reward_callables(recipe.reward_funcs, recipe.reward_processing_classes,
                                        config.chat_template_kwargs)  # reward models become functions
        dataset = resolve_dataset(recipe.eval_dataset, "eval_dataset")
        check_eval_inputs(config, dataset, reward_funcs)
        if checkpoint is not None:
            model, tokenizer = load_checkpoint(checkpoint, recipe, config)
        else:
            model, tokenizer = recipe.resolve_model(config)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code

    from .policy.models import device_of, load_model, load_tokenizer
    from .rollout.tools import Tools

    model = model if model is not None else load_model(config)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
    place_reward_models(reward_funcs, device_of(model))
    from .memory.fit import eval_batch_size

    batch_size = eval_batch_size(config, model, device_of(model).type)
    settings = EvalSettings.of(config)
    settings = dataclasses.replace(settings, limit=limit) if limit is not None else settings
    tools = Tools.of(recipe.tools, recipe.environment_factory) if recipe.tools or recipe.environment_factory else None
    metrics, samples = evaluate(model, tokenizer, dataset, reward_funcs, settings, batch_size=batch_size,
                                tools=tools)
    first, *groups = summary_lines(metrics)
    print("\n".join([f"greedy pass@1 on {int(metrics['eval/num_examples'])} prompts: {first}", *groups]))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"recipe": argv[0], "checkpoint": str(checkpoint) if checkpoint else None,
                                  "decoding": "greedy", "metrics": metrics, "samples": samples}, indent=1))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
