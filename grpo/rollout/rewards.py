"""Calling reward functions, weighting and checking what they return (the GSM8K rewards: tasks/gsm8k.py). A reward
function follows TRL 1.16's contract, so TRL reward functions work unchanged (docs/recipes-and-settings.md, "The
reward contract"):
    f(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **columns) -> list[float | None]
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import math
import numbers
import os
import sys
import traceback

import torch
from torch import Tensor

from ..errors import ConfigError, UserError
from ..infra.interrupts import StepAbandoned
from .environments import environment_in, get_reward_failed


logger = logging.getLogger(__name__)

# What every reward function may take besides the dataset's columns.
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")


class RewardError(UserError):
    """A reward function raised, or returned the wrong number or kind of values."""


def reward_func_name(f) -> str:
    """The name used in metrics: a function's __name__ (a partial's function's), else a callable's class name."""
    while isinstance(f, functools.partial):
        f = f.func
    name = getattr(f, "__name__", None) or type(f).__name__
    return name.strip("<>")  # "<lambda>" -> "lambda"


def reward_func_names(funcs) -> list[str]:
    """Names of `funcs`; repeats get `_2`, `_3`, ... so that metric keys stay unique."""
    names = []
    for f in funcs:
        base = name = reward_func_name(f)
        k = 1
        while name in names:
            k += 1
            name = f"{base}_{k}"
        names.append(name)
    return names


class RewardContext:
    """TRL's per-call reward arguments besides the batch (`trainer_state`: None outside a run), and what is logged."""

    def __init__(self, trainer_state=None):
        self.trainer_state = trainer_state
        self.metrics: dict[str, list[float]] = {}
        self.extras: dict[str, list] = {}  # column: one value per completion

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.extras.setdefault(column, []).extend(values)

    def take_extras(self, n: int) -> dict[str, list]:
        """The log_extra columns logged since the last call, `n` values each (None where none was), emptied."""
        extras, self.extras = self.extras, {}
        return {c: (values + [None] * n)[:n] for c, values in extras.items()}

    def kwargs(self) -> dict:
        return {"trainer_state": self.trainer_state, "log_metric": self.log_metric, "log_extra": self.log_extra}

    def metrics_over(self, dist) -> dict[str, float]:
        """Each logged metric's mean over its values on every rank (`dist`: infra/distributed's, or None)."""
        names = sorted(set(dist.gather_objects(list(self.metrics)) if dist else self.metrics))
        totals = {f"{k} {n}": f(self.metrics.get(n, [])) for n in names for k, f in (("sum", sum), ("count", len))}
        totals = dist.reduce(totals) if dist else totals
        return {n: totals[f"sum {n}"] / max(1, totals[f"count {n}"]) for n in names}


def compute_rewards(reward_funcs, prompts, completions, columns: dict[str, list],
                    weights: list[float] | None = None, *, completion_ids: list[list[int]] | None = None,
                    context: RewardContext | None = None) -> tuple[Tensor, Tensor]:
    """Call every reward function on the batch and combine their rewards. `columns`: the dataset's other columns,
    one entry per completion; `context` receives what the functions log. Returns `rewards` [N] (weighted sum over
    functions, Nones left out; 0.0 where no function applies) and `per_func` [N, F] (raw values, NaN for None)."""
    n, names = len(completions), reward_func_names(reward_funcs)
    if len(prompts) != n or any(len(v) != n for v in columns.values()):
        raise ValueError("prompts, completions and every column must have one entry per completion")
    check_reward_weights(weights, names)
    weights = [1.0] * len(reward_funcs) if weights is None else weights
    batch = {"prompts": prompts, "completions": completions,
             "completion_ids": completion_ids if completion_ids is not None else [[] for _ in range(n)], **columns}
    context = context or RewardContext()
    values, pending = {}, {}
    for j, f in enumerate(reward_funcs):
        out = _call(f, names[j], batch, context)
        (pending if inspect.isawaitable(out) else values)[j] = out
    for j, out in zip(pending, _await_all(list(pending.values()))):  # async functions, concurrently
        values[j] = out if not isinstance(out, BaseException) else _raise(reward_funcs[j], names[j], out, batch,
                                                                          context)
    per_func = torch.full((n, len(reward_funcs)), math.nan)
    for j, name in enumerate(names):
        per_func[:, j] = torch.tensor(_to_floats(values[j], name, n), dtype=torch.float32)
    # NaN * weight stays NaN and nansum skips it: a None never counts, not even as 0.
    rewards = torch.nansum(per_func * torch.tensor(weights, dtype=torch.float32), dim=1)
    return rewards, per_func


def warn_unscored(per_func: Tensor, prompts: list, completions: list, columns: dict[str, list]) -> None:
    """TRL's warning, on a logger as TRL gives it, naming the first completion every reward function returned None
    for (`per_func` [N, F] and the arguments of `compute_rewards`)."""
    unscored = per_func.isnan().all(dim=1).nonzero().flatten().tolist()  # [n]
    if unscored:
        i = unscored[0]
        row = {"prompt": prompts[i], "completion": completions[i], **{k: v[i] for k, v in columns.items()}}
        kwargs = ", ".join(f"{k}={_preview(v)}" for k, v in row.items())
        logger.warning(f"All reward functions returned None for the following kwargs: {kwargs} ({len(unscored)} of "
                       f"{len(prompts)} completions unscored): such a completion gets no reward and advantage 0; "
                       f"make at least one reward function score it")


def check_reward_weights(weights: list[float] | None, names: list[str]) -> None:
    """A ConfigError (a settings mistake: exit 2) unless `weights` is None or has one weight per function."""
    if weights is not None and len(weights) != len(names):
        raise ConfigError(f"reward_weights has {len(weights)} values but there are {len(names)} reward "
                          f"functions ({', '.join(names)}): give one weight per function")


def reward_metrics(rewards: Tensor, per_func: Tensor, names: list[str]) -> dict[str, float]:
    """TRL's reward metrics from `compute_rewards`' `rewards` [N] and `per_func` [N, F] (every rank's rows: stds do
    not average across ranks): `rewards/<name>/mean` and `/std` over the completions a function applied to, and
    `reward`, `reward_std` over those some function scored (absent where none was: a 0 would read as a score)."""
    metrics = {}
    for j, name in enumerate(names):
        applied = per_func[:, j][~per_func[:, j].isnan()]
        if applied.numel():
            metrics[f"rewards/{name}/mean"] = applied.mean().item()
            metrics[f"rewards/{name}/std"] = sample_std(applied)
    scored = ~per_func.isnan().all(dim=1)  # [N]
    if scored.any():
        metrics["reward"] = rewards[scored].mean().item()
        metrics["reward_std"] = sample_std(rewards[scored])
    return metrics


def sample_std(values: Tensor) -> float:
    """The std with Bessel's correction (TRL's `nanstd`), 0.0 for one value (where it is undefined)."""
    return values.std(correction=1).item() if values.numel() > 1 else 0.0


def _call(f, name: str, batch: dict, context: RewardContext):
    """`f` on the whole batch, given only the arguments it accepts (an async function's coroutine returned
    unawaited); a RewardError if it needs a column the batch lacks, or if it raises."""
    missing = sorted(required_columns(f) - set(batch))
    if missing:  # before the call: Python's "missing 1 required positional argument" names no column
        raise _lacks_columns(name, missing, ["prompt"] + [k for k in batch if k not in REWARD_ARGUMENTS])
    try:
        return f(**_accepted(f, {**batch, **context.kwargs()}))
    except Exception as batch_error:
        _raise(f, name, batch_error, batch, context)


def check_reward_columns(funcs: list, dataset) -> None:
    """Before anything loads, the RewardError `_call` would raise for a column `dataset` lacks (a factory: later)."""
    names = getattr(dataset, "column_names", None)
    if names is None:
        return
    available = (set(names) - {"prompt"}) | {"environments"}  # environment_factory's, passed beside the columns
    for f, name in zip(funcs, reward_func_names(funcs)):
        missing = sorted(required_columns(f) - available)
        if missing:
            raise _lacks_columns(name, missing, names)


def _lacks_columns(name: str, missing: list[str], columns: list[str]) -> RewardError:
    what = "a column" if len(missing) == 1 else f"{len(missing)} columns"
    return RewardError(f"reward function '{name}' takes {what} the dataset does not have: {', '.join(missing)} "
                       f"(its columns: {', '.join(columns)})")


def _accepted(f, kwargs: dict) -> dict:
    try:
        params = inspect.signature(f).parameters
    except (TypeError, ValueError):  # no signature to read (some builtins): pass everything, as TRL does
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def required_columns(f) -> set[str]:
    """The dataset columns `f` cannot do without: its parameters without a default, besides REWARD_ARGUMENTS
    (none known when it has no signature to read)."""
    try:
        params = inspect.signature(f).parameters
    except (TypeError, ValueError):
        return set()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {n for n, p in params.items() if p.kind in named and p.default is p.empty} - set(REWARD_ARGUMENTS)


def _await_all(coroutines: list) -> list:
    """The coroutines' results (or exceptions), run concurrently on an event loop of their own (in a worker
    thread when the caller already runs one, e.g. a notebook)."""
    if not coroutines:
        return []

    async def gather():
        return await asyncio.gather(*coroutines, return_exceptions=True)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def _raise(f, name: str, batch_error: BaseException, batch: dict, context: RewardContext):
    """Raise a RewardError for `f` failing on `batch`, naming the first item it fails on alone (an error path:
    retrying item by item is affordable; what the retries log is dropped). StepAbandoned goes on as it is."""
    if isinstance(batch_error, (StepAbandoned, UserError)):  # a UserError already says what went wrong
        raise batch_error
    i, error, note = 0, batch_error, " (fails on the whole batch only; showing its first item)"
    for k in range(len(batch["completions"])):
        try:
            item = {key: v[k:k + 1] for key, v in batch.items()}
            out = f(**_accepted(f, {**item, **RewardContext(context.trainer_state).kwargs()}))
            if inspect.isawaitable(out) and isinstance(err := _await_all([out])[0], BaseException):
                raise err
        except StepAbandoned:
            raise
        except Exception as item_error:
            i, error, note = k, item_error, ""
            break
    prompts, completions = batch["prompts"], batch["completions"]
    environment = environment_in(error)
    if environment is not None:  # the function asked an environment for its reward: that one failed
        raise get_reward_failed(environment, error, i, prompts[i], f", in reward function '{name}'") from error
    raise RewardError(f"reward function '{name}' raised {type(error).__name__}: {error}{note}\n"
                      f"  at {_where(error)}\n  prompt {i}: {_preview(prompts[i])}\n"
                      f"  completion {i}: {_preview(completions[i])}") from error


def _where(error: BaseException) -> str:
    """file:line of `error`'s innermost frame outside Python's own and installed libraries (no traceback printed)."""
    frames = traceback.extract_tb(error.__traceback__)[1:]  # [0] is _call itself
    libraries = (sys.prefix, sys.base_prefix)
    own = [f for f in frames if not f.filename.startswith(libraries)] or frames
    return f"{os.path.basename(own[-1].filename)}:{own[-1].lineno}" if own else "?"


def _to_floats(values, name: str, n: int) -> list[float]:
    """Check one function's return value: n numbers or Nones (-> NaN), all finite."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RewardError(f"reward function '{name}' returned {_preview(values)}; "
                          f"expected a list of {n} floats (or None)")
    if len(values) != n:
        raise RewardError(f"reward function '{name}' returned {len(values)} values; "
                          f"expected {n}, one per completion")
    floats = []
    for i, v in enumerate(values):
        if v is None:
            floats.append(math.nan)
        elif isinstance(v, numbers.Real) or (isinstance(v, Tensor) and v.numel() == 1):
            floats.append(float(v))  # bools count as 0/1; numpy and torch scalars convert too
        else:
            raise RewardError(f"reward function '{name}' returned a non-number at position {i}: "
                              f"{_preview(v)} ({type(v).__name__}); expected a float or None")
    bad = [i for i, (v, x) in enumerate(zip(values, floats)) if v is not None and not math.isfinite(x)]
    if bad:
        raise RewardError(f"reward function '{name}' returned NaN or inf at positions {bad[:10]}"
                          f"{' ...' if len(bad) > 10 else ''}; return None for 'does not apply'")
    return floats


def _preview(x, limit: int = 200) -> str:
    """A short repr for error messages; for a chat, its last message says the most."""
    if isinstance(x, list) and x and isinstance(x[-1], dict) and "content" in x[-1]:
        x = x[-1]["content"]
    text = repr(x)
    return text if len(text) <= limit else text[:limit] + "..."
