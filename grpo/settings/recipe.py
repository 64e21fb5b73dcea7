"""Recipe files: a Python file that defines a run's `config`, `reward_funcs` and datasets. Loading one
executes it and checks what it defines; its datasets may be factories, resolved only when training needs them."""
from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import traceback
import types
from dataclasses import dataclass

from .config import Config
from ..errors import ConfigError
from .cli import apply_overrides


@dataclass
class Recipe:
    """What a recipe file defines. The datasets may still be zero-argument callables, kept unresolved
    so that loading a recipe (e.g. for `--help`) stays fast; see `resolve_dataset`."""

    config: Config
    reward_funcs: list
    train_dataset: object
    eval_dataset: object = None
    path: str = ""
    build_model: object = None
    """Optional `build_model(config) -> (model, tokenizer)`, for recipes that make their own (offline) model."""
    rollout_func: object = None
    """Optional TRL `rollout_func(prompts, trainer) -> {"prompt_ids", "completion_ids"}` replacing our decoder."""
    reward_processing_classes: object = None
    """Optional, as in TRL: the tokenizer of each reward model in `reward_funcs` (None for plain functions)."""
    tools: list | None = None
    """Optional, as in TRL: functions the model may call (and our inline tools, rollout/tools.InlineTool)."""
    environment_factory: object = None
    """Optional, as in TRL: a class, one instance per completion, whose public methods are tools."""
    callbacks: list | None = None
    """Optional, as in TRL: transformers TrainerCallbacks (run/callbacks.py)."""

    def resolve_model(self, config: Config) -> tuple:
        """(model, tokenizer) from the recipe's `build_model`, or (None, None) to load `config.model`."""
        return (None, None) if self.build_model is None else self.build_model(config)


RECIPE_CONTRACT = (
    "a recipe must define `config` (a grpo.Config), `reward_funcs` (a list of reward "
    "functions, reward models or reward model paths) and `train_dataset` (a datasets.Dataset or a function "
    "returning one); `eval_dataset`, `build_model(config) -> (model, tokenizer)`, `rollout_func`, "
    "`reward_processing_classes`, `tools`, `environment_factory` and `callbacks` are optional"
)
_recipe_ids = itertools.count()


def load_recipe(path: str) -> Recipe:
    """Execute the recipe file at `path` as a module and check what it defines."""
    if not os.path.isfile(path):
        raise ConfigError(f"recipe not found: {path}")
    module = _import_file(path)
    missing = [n for n in ("config", "reward_funcs", "train_dataset") if not hasattr(module, n)]
    problems = [f"does not define {', '.join(missing)}"] if missing else []
    if hasattr(module, "config") and not isinstance(module.config, Config):  # said even when others are missing
        problems.append(f"defines `config` as {type(module.config).__name__} {module.config!r:.60}, "
                        f"not a grpo.Config (write config = Config(...))")
    if problems:
        raise ConfigError(f"recipe {path} {' and '.join(problems)}: {RECIPE_CONTRACT}")
    optional = ("build_model", "rollout_func", "reward_processing_classes", "tools", "environment_factory", "callbacks")
    return Recipe(config=module.config, reward_funcs=_check_reward_funcs(module.reward_funcs, path),
                  train_dataset=_check_dataset(module.train_dataset, "train_dataset", path),
                  eval_dataset=_check_dataset(getattr(module, "eval_dataset", None), "eval_dataset", path),
                  path=path, **{name: getattr(module, name, None) for name in optional})


def _import_file(path: str) -> types.ModuleType:
    """Import a Python file under a fresh module name, with its folder on sys.path so that it can
    import helper files that sit next to it."""
    name = f"grpo_recipe_{next(_recipe_ids)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ConfigError(f"recipe {path} is not a Python file (expected a .py file)")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    sys.modules[name] = module  # dataclasses and pickle look a class's module up here
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(name)
        raise ConfigError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    except ConfigError as e:  # e.g. Config(num_generations=1): the message says it all
        sys.modules.pop(name)
        lines = [frame.lineno for frame in traceback.extract_tb(e.__traceback__) if frame.filename == spec.origin]
        raise ConfigError(f"{path}{f':{lines[-1]}' if lines else ''}: {e}") from None
    except BaseException:
        sys.modules.pop(name)
        raise  # an error in the recipe's own code: its traceback is the useful message
    finally:
        sys.path.remove(folder)
    return module


def _check_reward_funcs(funcs, path: str) -> list:
    """A single entry is wrapped in a list; anything else must be a non-empty list of callables (functions or
    reward models) and reward models' local folders or hub ids, loaded only when training or evaluating
    (rollout/reward_models.py). A string without "/" that is no folder is taken for a function's name, a
    common slip, rather than for a namespace-less hub id (no reward model has one)."""
    if callable(funcs) or isinstance(funcs, str):
        funcs = [funcs]
    if not isinstance(funcs, (list, tuple)) or not funcs:
        raise ConfigError(f"recipe {path}: `reward_funcs` must be a non-empty list of functions, got {funcs!r:.100}")
    for i, f in enumerate(funcs):
        if not callable(f) and not (isinstance(f, str) and ("/" in f or os.path.isdir(f))):
            raise ConfigError(f"recipe {path}: reward_funcs[{i}] is not callable: {f!r:.100} (a function goes in "
                              f"itself, not its name; a reward model as a local folder or hub id 'namespace/name')")
    return list(funcs)


def _check_dataset(obj, what: str, path: str):
    """Accept a datasets.Dataset or a zero-argument callable (resolved later by `resolve_dataset`)."""
    if obj is None and what == "eval_dataset":
        return None
    if callable(obj) or _is_dataset(obj):
        return obj
    raise ConfigError(f"recipe {path}: `{what}` must be a datasets.Dataset or a function returning one, got "
                      f"{type(obj).__name__}")


def _is_dataset(obj) -> bool:
    import datasets  # imported here: `datasets` takes a second to import and --help does not need it

    return isinstance(obj, datasets.Dataset)


def resolve_dataset(obj, what: str = "dataset"):
    """Call a dataset factory from a recipe (if it is one) and check the result is a datasets.Dataset.
    None stays None (no eval dataset)."""
    if obj is None:
        return None
    dataset = obj() if callable(obj) else obj
    if not _is_dataset(dataset):
        raise ConfigError(f"`{what}` must be a datasets.Dataset, got {type(dataset).__name__}")
    return dataset


def load_with_overrides(path: str, overrides: list[str]) -> tuple[Recipe, Config]:
    """The recipe at `path` and its config with the `--key=value` `overrides` applied (ConfigError if
    either is wrong): what every `python -m grpo.X RECIPE [--key=value ...]` command starts with."""
    recipe = load_recipe(path)
    config = apply_overrides(recipe.config, overrides)
    keys = [a[2:].partition("=")[0].replace("-", "_") for a in overrides]  # apply_overrides checked their form
    if recipe.build_model is not None and "model" in keys:
        raise ConfigError(f"recipe {path} builds its own model in build_model; --model is not used: drop "
                          f"--model={config.model}, or use a recipe without build_model to load that model")
    return recipe, config
