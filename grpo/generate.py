"""`python -m grpo.generate --checkpoint DIR --prompt TEXT [--recipe RECIPE] [--key=value ...]`: one greedy
completion of a trained model for a prompt, with grpo.eval's model and settings (OPTIONS;
docs/recipes-and-settings.md, "Trying a checkpoint on a prompt")."""
from __future__ import annotations

import sys
from pathlib import Path

from .errors import ConfigError, UserError, command_line

USAGE = ("usage: python -m grpo.generate --checkpoint DIR --prompt TEXT [--recipe RECIPE] [--key=value ...] "
         "[--help]")
OPTIONS = """One greedy completion of a trained model for a prompt, with the recipe's tools run as in training.

  --checkpoint DIR  a checkpoint-STEP folder, or a folder Trainer.save_model wrote (a LoRA adapter is loaded
                    onto its base model); with --recipe, default: the model the recipe starts from
  --prompt TEXT     the user's message (plain text for a tokenizer without a chat template)
  --recipe RECIPE   the run's recipe: its settings, its model, its tools called in the decode, and the
                    messages its prompts put before the question (default: the settings the run saved in
                    DIR/grpo_config.json, no tools)
  --key=value       any setting, e.g. --max_completion_length=512"""
OWN_OPTIONS = ("checkpoint", "prompt", "recipe")


def setup(own: dict, overrides: list[str]):
    """(checkpoint or None, Config, base_model, tools or None, the messages before the user's) from the command
    line, as grpo.eval reads them."""
    from .eval import recipe_tools, run_settings
    from .settings.recipe import load_with_overrides

    if not own.get("prompt"):
        raise ConfigError("--prompt TEXT is missing: the user's message to complete")
    checkpoint = Path(own["checkpoint"]) if own.get("checkpoint") else None
    if own.get("recipe"):
        recipe, config = load_with_overrides(own["recipe"], overrides)
        return checkpoint, config, lambda: recipe.resolve_model(config), recipe_tools(recipe), context(recipe)
    if checkpoint is None:
        raise ConfigError("name the model: --checkpoint DIR (a run's checkpoint-STEP folder), or --recipe RECIPE "
                          "for the model the recipe starts from")
    config, base_model = run_settings(checkpoint, overrides)
    return checkpoint, config, base_model, None, []


def context(recipe) -> list[dict]:
    """The messages the recipe's prompts put before the question (a system message, worked examples): those of
    its first eval (else train) prompt before its last user message; none for plain-text prompts."""
    from .settings.recipe import resolve_dataset

    which = "eval_dataset" if recipe.eval_dataset is not None else "train_dataset"
    first = resolve_dataset(getattr(recipe, which), which)[0]["prompt"]
    return list(first[:-1]) if isinstance(first, list) and first and first[-1].get("role") == "user" else []


def completion(model, tokenizer, text: str, settings, tools=None, before=()) -> tuple[str, bool]:
    """The greedy completion of the user message `text` after the messages `before`, the tokens the tools wrote
    marked `[tool: ...]`, and whether it stopped at max_completion_length."""
    from .rollout.engines.sampling import prompt_encoder, sample_completions
    from .rollout.engines.tool_loop import mask_runs
    from .rollout.environments import make_envs

    prompts, envs = [[*before, {"role": "user", "content": text}] if tokenizer.chat_template else text], None
    if tools is not None and tools.environments:
        envs, prompts = make_envs(tools, [{"prompt": prompts[0]}], "--prompt")
    rollout = sample_completions(model, tokenizer, prompt_encoder(model, tokenizer, settings, tools), prompts,
                                 num_generations=1, greedy=True, max_completion_length=settings.max_completion_length,
                                 max_tool_calling_iterations=settings.max_tool_calling_iterations, envs=envs)
    n = int(rollout.completion_mask[0].sum())
    ids, own = rollout.completion_ids[0, :n].tolist(), rollout.loss_mask[0, :n].tolist()
    parts = [(sampled, tokenizer.decode(run, skip_special_tokens=True, clean_up_tokenization_spaces=False))
             for sampled, run in mask_runs(ids, own)]
    return "".join(part if sampled else f"[tool: {part}]" for sampled, part in parts), bool(rollout.truncated[0])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{OPTIONS}" if argv else USAGE)
        return 0 if argv else 2
    from .eval import load_model_of
    from .export import saved_setting
    from .infra.progress import quiet_library_bars
    from .settings.cli import split_options
    from .settings.components import EvalSettings

    with command_line(), quiet_library_bars():  # hints as --key=value; transformers' loading bars, in a log file
        try:
            own, overrides = split_options(argv, OWN_OPTIONS)
            checkpoint, config, base_model, tools, before = setup(own, overrides)
            model, tokenizer = load_model_of(checkpoint, base_model, config)
            used = saved_setting(checkpoint, "tools") if checkpoint is not None and tools is None else None
            if used:
                print(f"note: the run called tools ({', '.join(used)}), which run here only with its recipe: "
                      f"--recipe RECIPE", file=sys.stderr)
            if before and tokenizer.chat_template:
                print(f"prompt: the recipe's first {len(before)} message(s) ({', '.join(m['role'] for m in before)}),"
                      f" as its prompts hold them, then yours", file=sys.stderr)
            text, truncated = completion(model, tokenizer, own["prompt"], EvalSettings.of(config), tools, before)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code
    print(text)
    if truncated:
        print(f"(cut at max_completion_length={config.max_completion_length}: --max_completion_length=N for more)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
