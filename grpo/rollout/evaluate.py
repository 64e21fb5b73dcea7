"""Greedy pass@1 on a held-out dataset, scored by the run's own reward functions, for the Trainer (eval_strategy)
and `python -m grpo.eval`; its metrics: docs/recipes-and-settings.md, "Evaluation"."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import time

import torch

from ..errors import ConfigError
from ..infra.progress import TokenProgress
from ..settings.components import EvalSettings
from .engines.sampling import PromptEncoder, prompt_encoder, sample_completions
from .environments import make_envs
from .prompts import PromptTooLong, check_dataset, eval_sets, first_rows, is_stream
from .rewards import (RewardContext, compute_rewards, required_columns, reward_func_names, reward_metrics,
                      warn_unscored)

MAX_BREAKDOWN_VALUES = 50  # metrics for each value: a column of ids would flood metrics.jsonl


def check_eval_setup(s: EvalSettings, cadence, eval_dataset, reward_funcs, rows: dict) -> None:
    """Evaluating during training (settings/plan.Cadence) needs an eval dataset `check_eval_inputs` accepts (`rows`:
    each set's `checked_rows`, by suffix). eval_steps without eval_strategy evaluates nothing, as in transformers."""
    if cadence.eval_strategy != "no" or cadence.eval_on_start:
        if eval_dataset is None:
            raise ConfigError(f"eval_strategy={cadence.eval_strategy!r} / eval_on_start need an eval_dataset")
        for suffix, dataset in eval_sets(eval_dataset).items():
            check_eval_inputs(s, dataset, reward_funcs, rows[suffix])
    if cadence.eval_strategy == "no" and cadence.eval_steps is not None:
        print(f'warning: eval_steps={cadence.eval_steps} has no effect with eval_strategy="no" (transformers\' '
              f'default, as here): set eval_strategy="steps" to evaluate every {cadence.eval_steps} steps',
              file=sys.stderr)


def check_eval_inputs(s: EvalSettings, dataset, reward_funcs, rows=None) -> None:
    """Before any model loads: the eval functions and breakdown column fit `dataset`, its prompts (`rows`) checked."""
    check_dataset(dataset if rows is None else rows, "eval_dataset")
    eval_funcs(reward_funcs, s.accuracy_func, s.free_accuracy_func, s.format_func, dataset.column_names)
    if not is_stream(dataset):  # a stream's values are read when it is evaluated
        check_breakdown_column(dataset, s.breakdown_column)


def eval_funcs(reward_funcs, accuracy_func: str | None, free_accuracy_func: str | None, format_func: str | None,
               columns: list[str] | None = None) -> dict[str, tuple[str, object]]:
    """{metric: (name, function)} of the functions that score an evaluation: a reward function's name, or for the
    format-free accuracy an importable `module.function`; a ConfigError for one that lacks a column of `columns`."""
    reward_names = reward_func_names(reward_funcs)
    found = {}
    for metric, name in (("accuracy", accuracy_func), ("free_accuracy", free_accuracy_func),
                         ("format", format_func)):
        setting = f"eval_{metric}_func"
        if name is None:
            continue
        if metric == "free_accuracy" and "." in name:
            found[metric] = (name, import_named(setting, name))
        elif name in reward_names:
            found[metric] = (name, reward_funcs[reward_names.index(name)])
        else:
            also = " or an importable module.function" if metric == "free_accuracy" else ""
            raise ConfigError(f"{setting}={name!r} is not one of the reward functions: "
                              f"{', '.join(reward_names)}{also} (set --{setting}=NAME)")
        missing = sorted(required_columns(found[metric][1]) - set(columns)) if columns is not None else []
        if missing:
            raise ConfigError(f"{setting}={name!r} needs the eval dataset column(s) {', '.join(missing)}, "
                              f"which it lacks (it has {', '.join(columns)}; set --{setting}=NAME, or none)")
    return found


def import_named(setting: str, path: str):
    """The object at an importable `module.name` (ConfigError naming `setting` when it cannot be had, or when
    importing the module would train: a TRL-style script with its `trainer.train()` at top level)."""
    module, _, attr = path.rpartition(".")
    try:
        training = _trains_on_import(module)
        if training is None:
            return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError, SyntaxError) as e:  # ValueError: no module named
        raise ConfigError(f"{setting}={path!r} cannot be imported: {e}") from None
    file, line = training
    raise ConfigError(f"{setting}={path!r}: importing {module} would train ({file}:{line} calls .train() at its top "
                      f"level): put its training under `if __name__ == \"__main__\":`, or {attr} in a module of "
                      f"its own")


def _trains_on_import(module: str) -> tuple[str, int] | None:
    """(file, line) of a `.train()` call that importing `module` would run, read from its source without running
    it: one in its top-level statements, outside functions, classes and an `if __name__ == "__main__":` block."""
    if module in sys.modules:  # imported already: importing it runs nothing more
        return None
    spec = importlib.util.find_spec(module)
    if spec is None or not (spec.origin or "").endswith(".py"):
        return None
    with open(spec.origin) as f:
        tree = ast.parse(f.read(), spec.origin)
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            pending += node.orelse
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "train":
            return spec.origin, node.lineno
        pending += ast.iter_child_nodes(node)
    return None


def check_breakdown_column(dataset, column: str | None) -> list | None:
    """The column's values, one per row (None without a column), when metrics can be broken down by it."""
    if column is None:
        return None
    if column not in dataset.column_names or column == "prompt":
        raise ConfigError(f"eval_breakdown_column={column!r} is not a column of the eval dataset: "
                          f"{', '.join(c for c in dataset.column_names if c != 'prompt')}")
    values = dataset[column]
    try:
        distinct = len(set(values))
    except TypeError:
        raise ConfigError(f"eval_breakdown_column={column!r} holds lists or dicts, not plain values") from None
    if distinct > MAX_BREAKDOWN_VALUES:
        raise ConfigError(f"eval_breakdown_column={column!r} has {distinct} distinct values (at most "
                          f"{MAX_BREAKDOWN_VALUES}: each one makes its own metrics)")
    return values


def full_marks_rate(values: torch.Tensor) -> float:
    """Share of the values that are >= 1.0, over those a function applied to (NaN means None)."""
    applied = values[~values.isnan()]  # [n]
    return (applied >= 1.0).float().mean().item() if applied.numel() else float("nan")


def summarize(scores: dict[str, torch.Tensor], lengths: torch.Tensor, prefix: str = "eval/") -> dict[str, float]:
    """`<prefix><metric>`: each score's full-marks rate (`scores`: metric -> [N]), the mean length and the row count."""
    out = {f"{prefix}{metric}": full_marks_rate(values) for metric, values in scores.items()}
    out[f"{prefix}length_mean"] = lengths.float().mean().item()
    out[f"{prefix}num_examples"] = float(lengths.numel())
    return out


def breakdown(scores: dict[str, torch.Tensor], lengths: torch.Tensor, column: str,
              values: list) -> dict[str, float]:
    """`summarize` over the rows of each distinct value of a column (`values`), under `eval/<column>=<value>/`."""
    out = {}
    for value in sorted(set(values), key=lambda v: (v is None, v)):
        rows = torch.tensor([v == value for v in values])  # [N]
        out.update(summarize({m: s[rows] for m, s in scores.items()}, lengths[rows], f"eval/{column}={value}/"))
    return out


def summary_lines(metrics: dict[str, float], key_prefix: str = "eval") -> list[str]:
    """An evaluation's metrics (under `key_prefix`) as text: the whole set's line, then one per breakdown value."""
    whole = f"{key_prefix}/"
    prefixes = [whole] + [k.removesuffix("num_examples") for k in metrics
                          if k.endswith("/num_examples") and k != f"{whole}num_examples"]
    lines = []
    for prefix in prefixes:
        parts = [f"{label} {metrics[prefix + key]:.3f}" for key, label in
                 (("accuracy", "accuracy"), ("free_accuracy", "format-free accuracy"), ("format", "format"))
                 if prefix + key in metrics]
        if prefix == whole and f"{key_prefix}_reward" in metrics:  # the whole set's (absent where none scored)
            parts.insert(0, f"reward {metrics[f'{key_prefix}_reward']:.3f}")
        parts.append(f"mean length {metrics[prefix + 'length_mean']:.1f} tokens")
        n = int(metrics[prefix + "num_examples"])
        lines.append(("" if prefix == whole else f"  {prefix[len(whole):-1]} ({n} prompts): ") + ", ".join(parts))
    return lines


@torch.no_grad()
def evaluate(model, tokenizer, dataset, reward_funcs, settings: EvalSettings, *, batch_size: int = 64,
             progress: bool = True, unsharded=None, encode: PromptEncoder | None = None, trainer_state=None,
             loss_of=None, key_prefix: str = "eval") -> tuple[dict[str, float], list[dict]]:
    """Greedy-decode one completion per prompt of `dataset` (its first `settings.limit` rows) in decodes of
    `batch_size` prompts, prompts rendered as in training by `encode` (None: one of `settings`, without tools;
    with its tools the rows call them as in training), and score it (`settings`: settings/components.EvalSettings).
    `unsharded(fn)` runs `fn(model)` for each batch (default: directly; the Trainer's parallel wrapper, so that FSDP
    ranks generate together); `loss_of(rollout)`: each batch's loss and rows, their mean TRL's `eval_loss`. Returns
    `(metrics, samples)`: `eval/*` and TRL's `eval_*` metrics, `eval` replaced by `key_prefix` (transformers'
    metric_key_prefix), and one dict per row (prompt, completion, each reward, and what an extra function gives)."""
    if dataset is None:
        raise ConfigError("evaluating needs an eval_dataset: pass Trainer(eval_dataset=...)")
    s, names = settings, reward_func_names(reward_funcs)
    dataset = first_rows(dataset, s.limit)  # a stream's read into memory, as transformers' evaluation reads it all
    funcs = eval_funcs(reward_funcs, s.accuracy_func, s.free_accuracy_func, s.format_func, dataset.column_names)
    groups = check_breakdown_column(dataset, s.breakdown_column)
    t0 = time.perf_counter()
    prompts, completions, completion_ids, lengths, environments, losses = _greedy(
        model, tokenizer, dataset, s, batch_size, progress, unsharded, encode or prompt_encoder(model, tokenizer, s),
        loss_of)
    columns = {k: dataset[k] for k in dataset.column_names if k != "prompt"}
    if environments:
        columns["environments"] = environments
    rewards, per_func = compute_rewards(reward_funcs, prompts, completions, columns, s.reward_weights,
                                        completion_ids=completion_ids,
                                        context=RewardContext(trainer_state))  # [N], [N, F]
    warn_unscored(per_func, prompts, completions, columns)
    means = reward_metrics(rewards, per_func, names)
    # A function that is not a reward function (an imported format-free accuracy) scores apart.
    extra = [m for m, (name, _) in funcs.items() if name not in names]
    _, extra_values = compute_rewards([funcs[m][1] for m in extra], prompts, completions, columns,
                                      completion_ids=completion_ids)  # [N, E]
    scores = {m: extra_values[:, extra.index(m)] if m in extra else per_func[:, names.index(name)]
              for m, (name, _) in funcs.items()}  # metric: [N]
    metrics = summarize(scores, lengths)
    if losses:  # the batches' losses weighted by their rows, as transformers averages them
        metrics["eval_loss"] = sum(loss * rows for loss, rows in losses) / sum(rows for _, rows in losses)
    # TRL's names; a function that scored no completion, or a set none scored, has no mean.
    metrics.update({f"eval_{k}": v for k, v in means.items()})
    if groups is not None:
        metrics.update(breakdown(scores, lengths, s.breakdown_column, groups))
    metrics["eval/seconds"] = time.perf_counter() - t0
    # The dataset's other columns (the expected answer, say) sit next to each completion.
    samples = [{"prompt": p, "completion": c, **{k: v[i] for k, v in columns.items()},
                **{f"reward/{n}": (None if v != v else v) for n, v in zip(names, per_func[i].tolist())},
                **{m: (None if v != v else v) for m, v in zip(extra, extra_values[i].tolist())}}
               for i, (p, c) in enumerate(zip(prompts, completions))]
    return {key_prefix + k[len("eval"):]: v for k, v in metrics.items()}, samples


def _greedy(model, tokenizer, dataset, s: EvalSettings, batch_size: int, progress: bool, unsharded,
            encode: PromptEncoder, loss_of):
    """Each row's prompt as the model saw it, its greedy completion, its token ids, the lengths [N], the
    environments the rows ran in and each batch's `loss_of` (none without it)."""
    unsharded, tools = unsharded or (lambda fn: fn(model)), encode.tools
    seen, completions, completion_ids, lengths, environments, losses = [], [], [], [], [], []
    with TokenProgress("eval", enabled=progress) as bar:
        for start in range(0, len(dataset), batch_size):
            prompts, envs = dataset[start:start + batch_size]["prompt"], None
            if tools is not None and tools.environments:
                envs, prompts = make_envs(tools, list(dataset.select(
                    range(start, min(start + batch_size, len(dataset))))), "eval_dataset")
                environments += envs
            seen += prompts
            bar.batch(start, len(prompts), len(dataset))  # prompts done / total as rows finish, tokens/s
            try:
                rollout = unsharded(lambda m: sample_completions(
                    m, tokenizer, encode, prompts, num_generations=1, greedy=True, on_token=bar,
                    max_completion_length=s.max_completion_length,
                    max_tool_calling_iterations=s.max_tool_calling_iterations, envs=envs))
            except PromptTooLong as error:
                raise error.in_dataset(dataset, "eval_dataset") from None
            completions += rollout.completions
            completion_ids += rollout.completion_id_lists
            lengths.append(rollout.completion_mask.sum(dim=1).float())  # [b]
            losses += [loss_of(rollout)] if loss_of is not None else []
    return seen, completions, completion_ids, torch.cat(lengths), environments, losses  # lengths [N]
