"""`python -m grpo.eval`: greedy pass@1 of a model on a recipe's `eval_dataset`, or of a run made from Python (no
recipe: the settings it saved in its checkpoint) on a dataset named on the command line (USAGE, OPTIONS)."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from .errors import ConfigError, UserError, command_line
from .settings.cli import split_options
from .settings.components import EvalSettings

USAGE = ("usage: python -m grpo.eval RECIPE [--checkpoint DIR] [--limit N] [--output FILE] [--key=value ...] "
         "[--help]\n   or: python -m grpo.eval --checkpoint DIR --eval_dataset DATA --reward_funcs module.f[,...] "
         "[--limit N] [--output FILE] [--key=value ...]")
OPTIONS = """Greedy pass@1 of a model on RECIPE's eval_dataset: prints the mean reward, accuracy, format rate and
mean length, and writes them with every prompt, completion and reward (and the dataset's other columns) to JSON.

  --checkpoint DIR  a checkpoint-STEP folder, or a folder Trainer.save_model wrote (a LoRA adapter is loaded
                    onto the recipe's base model); default: the model the recipe starts from
  --limit N         the first N prompts only (default: the recipe's eval_limit, else every prompt)
  --output FILE     where the JSON goes (default: DIR/eval.json, or OUTPUT_DIR/eval.json)
  --key=value       any setting of the recipe; python -m grpo.eval RECIPE --help lists them

Without a recipe (a run made from Python), the settings are those the run saved in DIR/grpo_config.json
(--key=value still overrides them), and:
  --eval_dataset DATA   a .json/.jsonl/.csv/.parquet file, a folder Dataset.save_to_disk wrote, or an
                        importable module.name of a datasets.Dataset (or a function returning one); it needs
                        a `prompt` column
  --reward_funcs LIST   comma-separated importable module.function names, the run's reward functions (the
                        current folder is importable: train.accuracy for a function in ./train.py)"""
OWN_OPTIONS = ("checkpoint", "limit", "output")
RUN_OPTIONS = (*OWN_OPTIONS, "eval_dataset", "reward_funcs")


@dataclasses.dataclass
class Job:
    """One evaluation, its inputs checked: what the recipe form and the run form both come to."""

    kind: str  # "recipe", or "run" for a run made from Python: the key `source` is written under
    source: str  # the recipe's path, or the checkpoint's for a run made from Python
    config: object
    reward_funcs: list
    dataset: object
    checkpoint: Path | None
    output: Path
    limit: int | None
    base_model: object  # () -> (model, tokenizer), either None to load config.model
    tools: object = None


def load_checkpoint(path: Path, base_model, config):
    """(model, tokenizer) from a checkpoint-STEP folder: full weights, or a LoRA adapter on `base_model()`'s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .policy.models import load_model, load_tokenizer
    from .run.checkpoint import check_model_folder

    check_model_folder(path, "--checkpoint")
    if (path / "adapter_config.json").exists():
        from peft import PeftModel

        base, tokenizer = base_model()
        model = PeftModel.from_pretrained(base if base is not None else load_model(config), path)
    else:
        import torch

        model = AutoModelForCausalLM.from_pretrained(path).to("cuda" if torch.cuda.is_available() else "cpu")
        tokenizer = None
    if (path / "tokenizer_config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer if tokenizer is not None else load_tokenizer(config.model)


def load_model_of(checkpoint: Path | None, base_model, config):
    """(model, tokenizer) of `checkpoint` (`load_checkpoint`), else `base_model()`'s, else config.model's."""
    from .policy.models import load_model, load_tokenizer

    model, tokenizer = load_checkpoint(checkpoint, base_model, config) if checkpoint is not None else base_model()
    return (model if model is not None else load_model(config),
            tokenizer if tokenizer is not None else load_tokenizer(config.model))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{OPTIONS}" if argv else USAGE)
        return 0 if argv else 2
    from .infra.progress import quiet_library_bars

    with command_line(), quiet_library_bars():  # hints as --key=value; the libraries' bars, in a log file
        try:
            job = run_job(argv) if argv[0].startswith("--") else recipe_job(argv)
            if job is None:  # --help was printed
                return 0
            return evaluate_job(job, *load_model_of(job.checkpoint, job.base_model, job.config))
        except UserError as e:  # a bad input found while evaluating too (a prompt longer than the model's context)
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code


def _limit(own: dict) -> int | None:
    if "limit" in own and not (own["limit"].isdigit() and int(own["limit"]) >= 1):
        raise ConfigError(f"--limit must be a positive integer, got {own['limit']!r}")
    return int(own["limit"]) if "limit" in own else None


def _output(own: dict, default_dir: Path) -> Path:
    from .run.lock import check_output_dir

    output = Path(own.get("output") or default_dir / "eval.json")
    if output.is_dir():
        raise ConfigError(f"--output={output} is a folder: name a file in it, such as {output / 'eval.json'}")
    check_output_dir(str(output.parent), "output")
    return output


def recipe_job(argv: list[str]) -> Job | None:
    """`grpo.eval RECIPE ...`: the recipe's settings, eval dataset, reward functions, tools and model."""
    from .rollout.evaluate import check_eval_inputs
    from .run.startup import reward_sources
    from .settings.cli import BUILT_MODEL, format_help
    from .settings.recipe import load_with_overrides, resolve_dataset

    own, overrides = split_options([a for a in argv[1:] if a not in ("-h", "--help")], OWN_OPTIONS)
    limit = _limit(own)
    recipe, config = load_with_overrides(argv[0], overrides)
    if any(a in ("-h", "--help") for a in argv[1:]):
        unused = BUILT_MODEL if recipe.build_model else None
        print(f"{USAGE}\n\n{OPTIONS}\n\nsettings of {argv[0]}:\n{format_help(config, unused)}")
        return None
    if recipe.eval_dataset is None:  # said before anything about the functions that would score it
        raise ConfigError(f"recipe {argv[0]} defines no eval_dataset: grpo.eval evaluates on it")
    checkpoint = Path(own["checkpoint"]) if "checkpoint" in own else None
    output = _output(own, checkpoint or Path(config.output_dir))
    tools = recipe_tools(recipe)  # reward models become functions; an environment's own reward comes after them
    reward_funcs, config = reward_sources(config, recipe.reward_funcs, recipe.reward_processing_classes, tools)
    dataset = resolve_dataset(recipe.eval_dataset, "eval_dataset")
    check_eval_inputs(EvalSettings.of(config), dataset, reward_funcs)
    return Job("recipe", argv[0], config, reward_funcs, dataset, checkpoint, output, limit,
               lambda: recipe.resolve_model(config), tools)


def recipe_tools(recipe):
    """The recipe's tools (rollout/tools.Tools), None when it has none."""
    from .rollout.tools import Tools

    return Tools.of(recipe.tools, recipe.environment_factory) if recipe.tools or recipe.environment_factory else None


def run_job(argv: list[str]) -> Job:
    """`grpo.eval --checkpoint DIR --eval_dataset DATA --reward_funcs ...`: a run made from Python, its
    settings read from the checkpoint (grpo_config.json), a LoRA adapter on the base model it names."""
    from .rollout.evaluate import check_eval_inputs, import_named

    own, overrides = split_options(argv, RUN_OPTIONS)
    missing = [f"--{k}" for k in ("checkpoint", "eval_dataset", "reward_funcs") if not own.get(k)]
    if missing:
        raise ConfigError(f"without a recipe, grpo.eval needs --checkpoint (the run's checkpoint-STEP folder), "
                          f"--eval_dataset and --reward_funcs; missing {', '.join(missing)} (or give a recipe "
                          f"first: python -m grpo.eval RECIPE ...)")
    limit, checkpoint = _limit(own), Path(own["checkpoint"])
    config, base_model = run_settings(checkpoint, overrides)
    output = _output(own, checkpoint)
    reward_funcs = [import_named("--reward_funcs", name.strip()) for name in own["reward_funcs"].split(",")]
    dataset = read_dataset(own["eval_dataset"])
    check_eval_inputs(EvalSettings.of(config), dataset, reward_funcs)
    return Job("run", str(checkpoint), config, reward_funcs, dataset, checkpoint, output, limit, base_model)


def run_settings(checkpoint: Path, overrides: list[str]):
    """(Config, base_model) of a run made from Python: the settings it saved in `checkpoint` with `overrides`
    (--key=value), and `() -> (model, None)` loading the base model of its LoRA adapter
    (policy/sources.checkpoint_base; --model names another)."""
    from .policy.models import load_model
    from .policy.sources import checkpoint_base
    from .run.checkpoint import saved_config
    from .settings.cli import apply_overrides, config_of_record

    if not (checkpoint / "grpo_config.json").exists():
        raise ConfigError(f"{checkpoint} has no grpo_config.json, the settings a run saves in each "
                          f"checkpoint-STEP folder: name one of those, or name the run's recipe")
    saved = saved_config(checkpoint)
    config = apply_overrides(config_of_record(saved), overrides)
    lora = (checkpoint / "adapter_config.json").exists() and config.model == saved.get("model")
    base = checkpoint_base(checkpoint, "--model") if lora else None
    return config, lambda: (load_model(dataclasses.replace(config, model=base) if base else config), None)


def read_dataset(text: str):
    """--eval_dataset: a data file, a save_to_disk folder, or an importable module.name of a Dataset."""
    import datasets

    from .rollout.evaluate import import_named
    from .settings.recipe import resolve_dataset

    path = Path(text)
    kinds = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
    if path.is_file() and path.suffix in kinds:
        return datasets.load_dataset(kinds[path.suffix], data_files=str(path), split="train")
    if path.is_dir():
        return datasets.load_from_disk(str(path))
    if path.exists() or "." not in text or "/" in text:
        raise ConfigError(f"--eval_dataset={text!r} is not a .json/.jsonl/.csv/.parquet file, a folder "
                          f"Dataset.save_to_disk wrote, or an importable module.name of a dataset")
    return resolve_dataset(import_named("--eval_dataset", text), "--eval_dataset")


def evaluate_job(job: Job, model, tokenizer) -> int:
    from .memory.fit import eval_batch_size
    from .policy.models import device_of
    from .rollout.engines.sampling import prompt_encoder
    from .rollout.evaluate import evaluate, summary_lines
    from .rollout.reward_models import place_reward_models

    place_reward_models(job.reward_funcs, device_of(model))
    batch_size = eval_batch_size(job.config, model, device_of(model).type)
    settings = EvalSettings.of(job.config)
    settings = dataclasses.replace(settings, limit=job.limit) if job.limit is not None else settings
    metrics, samples = evaluate(model, tokenizer, job.dataset, job.reward_funcs, settings, batch_size=batch_size,
                                encode=prompt_encoder(model, tokenizer, settings, job.tools))
    first, *groups = summary_lines(metrics)
    print("\n".join([f"greedy pass@1 on {int(metrics['eval/num_examples'])} prompts: {first}", *groups]))
    job.output.parent.mkdir(parents=True, exist_ok=True)
    checkpoint = str(job.checkpoint) if job.checkpoint else None
    job.output.write_text(json.dumps({job.kind: job.source, "checkpoint": checkpoint, "decoding": "greedy",
                                      "metrics": metrics, "samples": samples}, indent=1))
    print(f"wrote {job.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
