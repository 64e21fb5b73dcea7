"""Checks of a `Config`'s keys and values, run when one is made (in a recipe, by an override or from Python),
so that a typo costs seconds, not a model load: each key (a TRL setting we lack says so), each field's type
against its annotation, then ranges and choices, each failure one sentence naming the setting."""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import sys
import typing

from ..algo import AGGREGATIONS, IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, SAMPLING_CORRECTION_MODES, SCALES
from ..errors import ConfigError
from .choices import (ALL_LINEAR, EVAL_STRATEGIES, OPTIMIZER_ALIASES, OPTIMIZERS, SAVE_STRATEGIES, SCHEDULES, TRACKERS,
                      tracker_names)
from .combinations import check_combinations
from .fieldtypes import FieldType, field_types
from .plan import RunPlan, ranks_from_env
from .trl_names import NO_EFFECT, OFF_VALUES, RENAMED, TRL_ONLY, TRL_REASONS

# field: (holds, requirement as read after "must be"); None values of optional fields are not checked.
RULES: dict[str, tuple[typing.Callable, str]] = {
    "learning_rate": (lambda v: v >= 0, ">= 0"),
    "adam_beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "adam_beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "max_grad_norm": (lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    "lr_scheduler_type": (lambda v: v in SCHEDULES, f"one of {', '.join(SCHEDULES)}"),
    "warmup_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "warmup_steps": (lambda v: v >= 0 and (v < 1 or v == int(v)), ">= 0: whole steps, or a fraction < 1"),
    "optim": (lambda v: v in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)} (or transformers' "
                                         f"{', '.join(OPTIMIZER_ALIASES)})"),
    "max_nonfinite_steps": (lambda v: v >= 1, ">= 1"),
    "per_device_train_batch_size": (lambda v: v >= 1, ">= 1 (completions per micro-batch)"),
    "gradient_accumulation_steps": (lambda v: v >= 1, ">= 1"),
    "steps_per_generation": (lambda v: v >= 1, ">= 1, or None for gradient_accumulation_steps"),
    "generation_batch_size": (lambda v: v >= 1, ">= 1, or None for per_device_train_batch_size x ranks x "
                                                "steps_per_generation"),
    "num_generations": (lambda v: v >= 2, ">= 2: GRPO scores each completion against the others of its "
                                          "prompt, so a group of one has no signal"),
    "num_train_epochs": (lambda v: v > 0, "> 0"),
    "max_steps": (lambda v: v > 0 or v == -1, "> 0, or -1 to train for num_train_epochs"),
    "pad_to_multiple_of": (lambda v: v >= 1, '>= 1, or None (TRL\'s "auto") for no padding'),
    "max_prompt_length": (lambda v: v >= 1, ">= 1, or None to leave prompts whole"),
    "max_completion_length": (lambda v: v >= 1, ">= 1"),
    "max_tool_calling_iterations": (lambda v: v >= 1, ">= 1, or None for no limit"),
    "temperature": (lambda v: v > 0, "> 0"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: v >= 0, ">= 0 (0 disables it)"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1], or None to disable it"),
    "repetition_penalty": (lambda v: v > 0, "> 0 (1.0 disables it)"),
    "vllm_mode": (lambda v: v in ("server", "colocate"), 'one of server, colocate'),
    "vllm_server_port": (lambda v: 0 < v < 65536, "a port number (1-65535)"),
    "vllm_server_timeout": (lambda v: v > 0, "> 0 (seconds)"),
    "vllm_server_base_url": (lambda v: v.startswith(("http://", "https://")), "an http:// or https:// URL"),
    "vllm_importance_sampling_mode": (lambda v: v in SAMPLING_CORRECTION_MODES,
                                      f"one of {', '.join(SAMPLING_CORRECTION_MODES)}"),
    "vllm_importance_sampling_clip_max": (lambda v: v > 0, "> 0, or None for no upper bound"),
    "vllm_importance_sampling_clip_min": (lambda v: v >= 0, ">= 0, or None for no lower bound"),
    "beta": (lambda v: v >= 0, ">= 0"),
    "ref_model_mixup_alpha": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "ref_model_sync_steps": (lambda v: v >= 1, ">= 1"),
    "epsilon": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "epsilon_high": (lambda v: v >= 0, ">= 0"),
    "delta": (lambda v: v > 0, "> 0, or None for one-sided clipping"),
    "num_iterations": (lambda v: v >= 1, ">= 1"),
    "dynamic_sampling_max_rounds": (lambda v: v >= 1, ">= 1"),
    "max_staleness": (lambda v: v >= 0, ">= 0"),
    "scale_rewards": (lambda v: v in SCALES, f"one of {', '.join(SCALES)}"),
    "multi_objective_aggregation": (lambda v: v in AGGREGATIONS, f"one of {', '.join(AGGREGATIONS)}"),
    "loss_type": (lambda v: v in LOSS_TYPES, f"one of {', '.join(LOSS_TYPES)}"),
    "importance_sampling_level": (lambda v: v in IMPORTANCE_SAMPLING_LEVELS,
                                  f"one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}"),
    "top_entropy_quantile": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "entropy_coef": (math.isfinite, "finite (0 disables the entropy bonus)"),
    "entropy_coef_delta": (lambda v: v >= 0, ">= 0"),
    "off_policy_mask_threshold": (lambda v: 0 <= v < math.inf, ">= 0 and finite (a KL bound, e.g. 0.5: below 0 even "
                                                               "on-policy completions would drop), or None"),
    **dict.fromkeys(("sapo_temperature_neg", "sapo_temperature_pos"), (lambda v: v > 0, "> 0")),
    **dict.fromkeys(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
                    (math.isfinite, "finite")),
    "reward_weights": (lambda v: all(math.isfinite(w) for w in v), "finite numbers"),
    "lora_r": (lambda v: v >= 1, ">= 1"),
    "lora_alpha": (lambda v: v > 0, "> 0"),
    "lora_dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "lora_target_modules": (lambda v: v == ALL_LINEAR or (isinstance(v, list) and all(
        isinstance(m, str) and re.fullmatch(r"[\w.]+", m) for m in v)),
        f'module names (a list, or comma-separated) or "{ALL_LINEAR}" (peft\'s regex strings are not read here)'),
    "logprob_chunk_size": (lambda v: v >= 1, ">= 1"),
    "logging_steps": (lambda v: v >= 1, ">= 1"),
    "save_strategy": (lambda v: v in SAVE_STRATEGIES, f"one of {', '.join(SAVE_STRATEGIES)}"),
    "save_steps": (lambda v: v >= 1, ">= 1"),
    "save_total_limit": (lambda v: v >= 1, ">= 1, or None to keep every checkpoint"),
    "resume_from_checkpoint": (lambda v: isinstance(v, bool) or (isinstance(v, str) and v.strip() != ""),
                               'a checkpoint folder, "latest", or True / False'),
    "report_to": (lambda v: tracker_names(v) is not None,
                  f'"none" or one or more (a list, or comma-separated) of {", ".join(TRACKERS)}'),
    "num_completions_to_print": (lambda v: v >= 1, ">= 1, or None for all of them"),
    "eval_strategy": (lambda v: v in EVAL_STRATEGIES, f"one of {', '.join(EVAL_STRATEGIES)}"),
    # transformers reads 0 as None: refused here, where 0 used to mean "never" (eval_strategy="no" says that now).
    "eval_steps": (lambda v: v >= 1, ">= 1, or None for logging_steps (eval_strategy=\"no\" evaluates never)"),
    "eval_limit": (lambda v: v >= 1, ">= 1, or None to evaluate every prompt"),
    "per_device_eval_batch_size": (lambda v: v >= 1, ">= 1, or None for as many as the memory plan fits"),
}


class CheckedKeywords(type):
    """Every construction of a Config (dataclasses.replace too) passes its keywords through `__call__`
    before the generated __init__, which would answer an unknown one with a TypeError: here a TRL setting we
    lack says so and a typo gets the closest field's name, all in one ConfigError, and a TRL setting that
    changes nothing here is dropped with a warning saying why."""

    def __call__(cls, *args, **settings):
        no_effect = check_keys(settings, [f.name for f in dataclasses.fields(cls)])
        warn_no_effect(no_effect)
        return super().__call__(*args, **{k: v for k, v in settings.items() if k not in no_effect})


def check_keys(settings: dict, names: list[str]) -> dict[str, str]:
    """The keys of `settings` that are not `names` (Config's fields) but change nothing here, each with the
    warning that says why (TRL's NO_EFFECT settings, and OFF_VALUES at a value that leaves a feature off; a
    value may be given as command-line text). ConfigError naming every other key at once: TRL's settings we
    lack get their own message (why, or what to use instead), anything else the closest field's name."""
    accepted, problems = {}, []
    for key, value in settings.items():
        if key in names:
            continue
        if key in NO_EFFECT:
            accepted[key] = f"TRL's `{key}` has no effect here: {NO_EFFECT[key]}"
        elif key in OFF_VALUES and any(value == v or _as_text(value) == _as_text(v) for v in OFF_VALUES[key]):
            reason = TRL_REASONS.get(key, "this trainer does not implement it")
            accepted[key] = f"TRL's `{key}={_as_text(value)}` has no effect here: {reason}"
        elif key in RENAMED:
            problems.append(f"'{key}' is gone: {RENAMED[key]}")
        elif key in TRL_ONLY:
            reason = TRL_REASONS.get(key, "this trainer does not implement it")
            problems.append(f"TRL's `{key}` is not supported here: {reason}")
        else:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else " (see --help for the settings)"
            problems.append(f"unknown setting '{key}'{hint}")
    if len(problems) > 1:
        raise ConfigError(f"{len(problems)} settings are not accepted: {'; '.join(problems)}")
    if problems:
        raise ConfigError(problems[0])
    return accepted


def _as_text(value) -> str:
    """A value as the command line writes it (`--use_vllm=false`), from a value or from such text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value.strip().lower()
    return "none" if value is None else json.dumps(value).lower()


def warn_no_effect(warnings: dict[str, str]) -> None:
    for line in warnings.values():
        print(f"warning: {line}", file=sys.stderr)


def check_config(config) -> None:
    """Raise ConfigError on the first field of the wrong type or out of range (each stored as
    `checked_field` returns it), then on settings that cannot work together (`check_combinations`), the batch
    schedule's included: the run plan resolved on the ranks torchrun announces, as the trainer resolves it."""
    for name in field_types(type(config)):
        setattr(config, name, checked_field(type(config), name, getattr(config, name)))
    config.bf16 = _bf16_of_dtype(config.model_init_kwargs, config.bf16)
    check_combinations(config)
    RunPlan.resolve(config, ranks_from_env())


def checked_field(cls, name: str, value):
    """`value` as field `name` of the Config class `cls` stores it, or ConfigError: TRL's spellings become
    ours, an int given for a float field becomes a float (so the saved config reads the same however it was
    written), then the field's rule; generation_kwargs entries are checked as the fields they override."""
    if name == "scale_rewards" and isinstance(value, bool):  # TRL 1.16 takes a bool, stored as its string
        value = "group" if value else "none"
    if name == "optim" and isinstance(value, str):  # transformers' names: the rest of grpo sees only ours
        value = OPTIMIZER_ALIASES.get(value, value)
    if name == "resume_from_checkpoint" and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        value = value.strip().lower() == "true"  # --resume_from_checkpoint=true: transformers' True
    if name == "pad_to_multiple_of" and value == "auto":  # TRL's default: pads on AWS Neuron only
        value = None
    if name == "lora_target_modules":
        value = _module_names(value)
    if name == "model_init_kwargs" and isinstance(value, dict):
        value = _init_kwargs(value)
    types = field_types(cls)
    value = _checked_value(name, name, value, types[name])
    if name == "generation_kwargs" and value:
        value = {key: _generation_kwarg(key, entry, types) for key, entry in value.items()}
    return value


def _module_names(value):
    """lora_target_modules as stored: "all-linear", or a list from a list, tuple, set (peft's own form) or
    comma-separated text (the command line's form); anything else as it is, for the rule to refuse."""
    if isinstance(value, str):
        return value.strip() if value.strip() == ALL_LINEAR else [m.strip() for m in value.split(",") if m.strip()]
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return list(value) if isinstance(value, tuple) else value


# model_init_kwargs' dtypes -> bf16 (policy/precision.py plans each tensor's dtype from it); "auto": bf16's choice
DTYPES = {"bfloat16": True, "float32": False, "auto": None}


def _init_kwargs(kwargs: dict) -> dict:
    """model_init_kwargs as stored: TRL's older torch_dtype named dtype (transformers 5's), a torch.dtype by
    its name (the config is saved as JSON); the loading keys the trainer sets itself refused."""
    kwargs = dict(kwargs)
    if "torch_dtype" in kwargs:
        if "dtype" in kwargs:
            raise ConfigError("model_init_kwargs sets both dtype and torch_dtype: keep dtype (transformers 5's)")
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    if type(kwargs.get("dtype")).__name__ == "dtype":  # a torch.dtype, without importing torch here
        kwargs["dtype"] = str(kwargs["dtype"]).removeprefix("torch.")
    if kwargs.get("dtype", "auto") not in DTYPES:
        raise ConfigError(f"model_init_kwargs dtype must be one of {', '.join(DTYPES)} (fp16 is not supported "
                          f"here: bf16 or float32), got {kwargs['dtype']!r}")
    for key in ("quantization_config", "device_map"):
        if key in kwargs:
            raise ConfigError(f"model_init_kwargs {key} is set by the trainer: use load_in_4bit=True for 4-bit "
                              f"(QLoRA) loading; the device is the GPU when there is one")
    return kwargs


def _bf16_of_dtype(kwargs: dict | None, bf16: bool | None) -> bool | None:
    """`bf16` as model_init_kwargs' dtype sets it; ConfigError when the two say different things."""
    wanted = DTYPES[(kwargs or {}).get("dtype", "auto")]
    if wanted is None or bf16 == wanted:
        return bf16
    if bf16 is not None:
        raise ConfigError(f"model_init_kwargs dtype={kwargs['dtype']!r} and bf16={bf16} disagree: set one of them")
    return wanted


def _checked_value(name: str, field: str, value, tp: FieldType):
    """`value` type-checked against `tp`, then against `field`'s rule; `name` is what an error calls it."""
    value = _checked_type(name, value, tp)
    if field in RULES and value is not None:
        holds, requirement = RULES[field]
        if not holds(value):
            raise ConfigError(f"{name} must be {requirement}, got {value!r}")
    return value


# The generation_kwargs our decoder implements: each overrides the Config field of its name (Config.sampling_knobs).
GENERATION_KWARGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
def _generation_kwarg(key: str, value, types: dict[str, FieldType]):
    """One generation_kwargs entry, checked as the field it overrides; do_sample=true (TRL's own) is allowed and
    ignored. Any other key is refused: decoding here is our own loop, not transformers' GenerationConfig."""
    name = f"generation_kwargs[{key!r}]"
    if key == "do_sample":
        if value is not True:
            raise ConfigError(f"{name} must be true, got {value!r}: GRPO samples its completions")
        return value
    if key not in GENERATION_KWARGS:
        hint = " (set max_completion_length instead)" if key == "max_new_tokens" else ""
        raise ConfigError(f"{name} is not supported{hint}: sampling here is its own loop, not model.generate, "
                          f"and takes {', '.join(GENERATION_KWARGS)} (and do_sample=true)")
    return _checked_value(name, key, value, types[key])


def _checked_type(name: str, value, tp: FieldType):
    """`value` if it fits `tp` (int, float, bool, str, a list of one, dict, each maybe None), an int widened
    to float where a float is wanted, JSON text parsed where a dict is; ConfigError otherwise. The "text" and
    "other" forms are not checked here (a "text" field's rule reads it)."""
    if value is None and tp.optional:
        return None
    if tp.form == "dict":
        return _json_object(name, value)
    if tp.form == "list":
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list of {_NAMES[tp.item][1]}, got {value!r:.100}")
        return [_scalar(f"{name}[{i}]", v, tp.item) for i, v in enumerate(value)]
    if tp.form == "scalar":
        return _scalar(name, value, tp.item)
    return value


def _json_object(name: str, value) -> dict:
    """A dict setting from a dict or, as TRL accepts, its JSON text; JSON data either way, since the config is
    saved with the run (grpo_config.json, trackers)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ConfigError(f'{name} must be a JSON object such as \'{{"key": 1}}\', got {value!r:.100}') from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{name} must be a dict with string keys (or its JSON text), got {value!r:.100}")
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must hold JSON data (it is saved with the run), got {value!r:.100}") from None
    return dict(value)


_NAMES = {int: ("an int", "ints"), float: ("a float", "floats"), bool: ("a bool", "bools"),
          str: ("a string", "strings")}


def _scalar(name: str, value, tp: type):
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    # bool is an int to Python, but `max_steps=True` is a mistake, not 1.
    if not isinstance(value, tp) or (isinstance(value, bool) and tp is not bool):
        raise ConfigError(f"{name} must be {_NAMES[tp][0]}, got {type(value).__name__} {value!r:.100}")
    return value
