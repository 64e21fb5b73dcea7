"""Greedy pass@1 on a held-out dataset, scored by the run's own reward functions.

`eval/accuracy` is the share of completions that get full marks (>= 1.0) from the reward function named
as the accuracy one, `eval/format` the same for the format one; `eval/reward/<name>` is every reward
function's mean and `eval/length_mean` the mean completion length in tokens. Used by the Trainer (every
`eval_steps`) and by `python -m grpo.eval`."""
from __future__ import annotations

import time

import torch

from ..errors import ConfigError
from .progress import TokenProgress
from .rewards import compute_rewards, reward_func_names, reward_metrics
from .sampling import PromptEncoder, sample_completions


def check_eval_setup(config, eval_dataset, reward_funcs) -> None:
    """Evaluating during training needs an eval dataset and the config's accuracy / format reward functions."""
    if config.eval_steps > 0 or config.eval_on_start:
        if eval_dataset is None:
            raise ConfigError("eval_steps / eval_on_start need an eval_dataset")
        check_eval_funcs(reward_funcs, config.eval_accuracy_func, config.eval_format_func)


def check_eval_funcs(reward_funcs, accuracy_func: str, format_func: str | None) -> None:
    """Fail early, naming the choices, when the accuracy or format function is not a reward function."""
    reward_names = reward_func_names(reward_funcs)
    for setting, name in (("eval_accuracy_func", accuracy_func), ("eval_format_func", format_func)):
        if name is not None and name not in reward_names:
            raise ConfigError(f"{setting}={name!r} is not one of the reward functions: {', '.join(reward_names)} "
                             f"(set --{setting}=NAME)")


def full_marks_rate(values: torch.Tensor) -> float:
    """Share of the values that are >= 1.0, over those a function applied to (NaN means None)."""
    applied = values[~values.isnan()]  # [n]
    return (applied >= 1.0).float().mean().item() if applied.numel() else float("nan")


@torch.no_grad()
def evaluate(model, tokenizer, dataset, reward_funcs, *, accuracy_func: str, format_func: str | None = None,
             max_prompt_length: int, max_completion_length: int, batch_size: int = 64,
             limit: int | None = None, progress: bool = True, unsharded=None,
             chat_template_kwargs: dict | None = None) -> tuple[dict[str, float], list[dict]]:
    """Greedy-decode one completion per prompt of `dataset` (its first `limit` rows), chat prompts rendered with
    `chat_template_kwargs` as in training, and score it.

    `unsharded(fn)` runs `fn(model)` for each batch (default: directly); the Trainer passes its parallel
    wrapper, so that FSDP ranks generate together. Returns `(metrics, samples)`: `eval/*` metrics and one
    dict per row (prompt, completion, each reward)."""
    unsharded = unsharded or (lambda fn: fn(model))
    check_eval_funcs(reward_funcs, accuracy_func, format_func)
    names = reward_func_names(reward_funcs)
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    encode = PromptEncoder(tokenizer, max_prompt_length, chat_template_kwargs)
    completions, completion_ids, lengths = [], [], []
    t0 = time.perf_counter()
    with TokenProgress("eval", enabled=progress) as bar:
        for start in range(0, len(dataset), batch_size):
            bar.prompts_done(start, len(dataset))
            prompts = dataset[start:start + batch_size]["prompt"]
            rollout = unsharded(lambda m: sample_completions(
                m, tokenizer, encode, prompts, num_generations=1, greedy=True, on_token=bar,
                max_completion_length=max_completion_length, temperature=1.0, top_p=1.0, top_k=0))
            completions += rollout.completions
            completion_ids += rollout.completion_id_lists
            lengths.append(rollout.completion_mask.sum(dim=1).float())  # [b]
    columns = {k: dataset[k] for k in dataset.column_names if k != "prompt"}
    prompts = dataset["prompt"]
    rewards, per_func = compute_rewards(reward_funcs, prompts, completions, columns,
                                        completion_ids=completion_ids)  # [N], [N, F]
    means = reward_metrics(rewards, per_func, names)
    metrics = {"eval/accuracy": full_marks_rate(per_func[:, names.index(accuracy_func)])}
    if format_func is not None:
        metrics["eval/format"] = full_marks_rate(per_func[:, names.index(format_func)])
    metrics["eval/length_mean"] = torch.cat(lengths).mean().item()
    metrics.update({f"eval/reward/{n}": means[f"reward/{n}"] for n in names if f"reward/{n}" in means})
    metrics["eval/num_examples"] = float(len(dataset))
    metrics["eval/seconds"] = time.perf_counter() - t0
    # The dataset's other columns (the expected answer, say) sit next to each completion.
    samples = [{"prompt": p, "completion": c, **{k: v[i] for k, v in columns.items()},
                **{f"reward/{n}": (None if v != v else v) for n, v in zip(names, per_func[i].tolist())}}
               for i, (p, c) in enumerate(zip(prompts, completions))]
    return metrics, samples
