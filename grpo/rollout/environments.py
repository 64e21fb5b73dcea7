"""TRL's environments (`environment_factory`) as a run uses them (docs/tools.md): one instance per completion
(`make_envs`), the reward of one that owns it (`environment_reward`), the rows a run draws when one owns the data
(`training_rows`), and the one-line failures of `reset` and `get_reward`."""
from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable

from ..errors import ConfigError, DatasetError, UserError
from .prompts import is_stream

EMPTY_PROMPT = [{"role": "user", "content": ""}]  # TRL's: what a row without a prompt starts from, reset() adds to


def make_envs(tools, rows: list[dict], dataset: str = "train_dataset") -> tuple[list, list]:
    """One environment per completion (`rows`: the dataset rows, one per completion) and the prompts as the model
    sees them, made as TRL makes them (docs/tools.md): `env.reset(**row)`, a string it returns appended to the
    prompt. DatasetError for a row naming none of a dict's environments."""
    named = isinstance(tools.environment_factory, dict)
    envs, prompts = [], []
    for row in rows:
        name = row.get("environment") if named else None
        if name not in tools.environments:
            raise DatasetError(f"a {dataset} row has environment={name!r}, which is not among the environments of "
                               f"environment_factory ({', '.join(map(repr, tools.environments))}): give each row "
                               f"the name of one in its `environment` column")
        factory = tools.environments[name]
        env = factory()
        try:
            observation = env.reset(**({k: v for k, v in row.items() if k != "environment"} if named else row))
        except Exception as error:
            raise EnvironmentFailed(f"environment {factory.__name__}.reset raised {_short(error, 300)} on the dataset "
                                    f"row {_short(row)}") from error
        prompt = row.get("prompt", EMPTY_PROMPT)
        if observation is not None and isinstance(prompt, str):
            prompt = prompt + observation
        elif observation is not None:
            prompt = [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]
        envs.append(env)
        prompts.append(prompt)
    return envs, prompts


def training_rows(train_dataset, tools, max_steps: int, num_prompts: int):
    """The rows a run draws: `train_dataset` or, when it is None and the environment owns the data (its `reset()`
    returns each prompt), TRL's: a generation batch's `num_prompts` rows of an empty user message, drawn again every
    batch. A ConfigError, saying what to pass, where neither can be drawn."""
    named = tools is not None and isinstance(tools.environment_factory, dict)
    if is_stream(train_dataset) and max_steps <= 0:
        raise ConfigError("train_dataset is a stream (an IterableDataset), which has no length to count epochs "
                          "over: set max_steps, as TRL requires")
    if train_dataset is not None:
        if named and "environment" not in (getattr(train_dataset, "column_names", None) or ["environment"]):
            raise DatasetError(f"environment_factory is a dict, so each train_dataset row names its environment "
                               f"({', '.join(map(repr, tools.environments))}) in an `environment` column, which "
                               f"train_dataset lacks (its columns: {', '.join(train_dataset.column_names)})")
        return train_dataset
    if tools is None or not tools.environments:
        raise ConfigError("`train_dataset` is required unless an environment_factory's reset() returns each prompt "
                          "(the environment owns the data; then set max_steps)")
    if named:
        raise ConfigError("environment_factory as a dict requires a `train_dataset` with an `environment` column "
                          "naming each row's environment: pass one, or a single environment class")
    if max_steps <= 0:
        raise ConfigError("with no train_dataset (the environment's reset() returns each prompt) set max_steps: "
                          "there are no rows to count epochs over")
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [EMPTY_PROMPT] * num_prompts})


def environment_reward(environment: type) -> Callable:
    """TRL's reward of an environment that owns it: a reward function named after the class `environment`, each
    completion whose environment is of exactly that class scored by its `get_reward()` (maybe async), others None."""
    if inspect.iscoroutinefunction(environment.get_reward):
        async def reward(environments, prompts=None, **kwargs) -> list[float | None]:
            return [await _awaited_reward(env, i, prompts) if type(env) is environment else None
                    for i, env in enumerate(environments)]
    else:
        def reward(environments, prompts=None, **kwargs) -> list[float | None]:
            return [_reward(env, i, prompts) if type(env) is environment else None
                    for i, env in enumerate(environments)]
    reward.__name__ = reward.__qualname__ = environment.__name__  # TRL's metric key: rewards/<class>/mean
    return reward


def _reward(env, i: int, prompts):
    try:
        return env.get_reward()
    except Exception as error:
        raise get_reward_failed(env, error, i, None if prompts is None else prompts[i]) from error


async def _awaited_reward(env, i: int, prompts):
    try:
        return await env.get_reward()
    except Exception as error:
        raise get_reward_failed(env, error, i, None if prompts is None else prompts[i]) from error


def get_reward_failed(env, error: BaseException, i: int, prompt=None, where: str = "") -> EnvironmentFailed:
    """The one line for `env.get_reward()` raising `error` on completion `i` of the batch (its `prompt`)."""
    shown = f" (prompt {_short(prompt)})" if prompt is not None else ""
    return EnvironmentFailed(f"environment {type(env).__name__}.get_reward raised {_short(error, 300)} for completion "
                             f"{i} of the batch{shown}{where}")


def environment_in(error: BaseException):
    """The environment whose `get_reward` raised `error` (the innermost such frame's `self`), or None."""
    found = [frame.f_locals["self"] for frame, _ in traceback.walk_tb(error.__traceback__)
             if frame.f_code.co_name == "get_reward" and "self" in frame.f_locals]
    return found[-1] if found else None


class EnvironmentFailed(UserError):
    """An environment's `reset` or `get_reward` raised: the message names the class, the row and the error."""


def _short(value, limit: int = 200) -> str:
    """`value` on one line of at most `limit` characters: an error as its type and message, anything else its repr."""
    text = " ".join((f"{type(value).__name__}: {value}" if isinstance(value, BaseException) else repr(value)).split())
    return text if len(text) <= limit else text[:limit] + "..."
