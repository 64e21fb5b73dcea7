"""grpo's checks of a `Config`'s values, run when one is made (in a recipe, by an override or from Python), so
that a mistake costs seconds, not a model load: each field's type against its annotation, then its range or
choices, then the settings that cannot work together, the batch schedule's included, each failure one sentence
naming the setting. The keys, and TRL's spellings of values, are trl_names.py's."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import typing

from ..algo import AGGREGATIONS, IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, SAMPLING_CORRECTION_MODES, SCALES
from ..errors import ConfigError
from .choices import ALL_LINEAR, EVAL_STRATEGIES, OPTIMIZERS, SAVE_STRATEGIES, SCHEDULES, TRACKERS, tracker_names
from .components import SamplingKnobs
from .combinations import check_combinations
from .fieldtypes import FieldType, field_types
from .plan import RunPlan, ranks_from_env
from .trl_names import OPTIMIZER_ALIASES, as_ours, bf16_of_dtype

# field: (holds, requirement as read after "must be"), shared ones first; optional fields' None is not checked.
RULES: dict[str, tuple[typing.Callable, str]] = {
    **dict.fromkeys(("max_nonfinite_steps", "gradient_accumulation_steps", "max_completion_length",
                     "ref_model_sync_steps", "num_iterations", "dynamic_sampling_max_rounds", "lora_r",
                     "logprob_chunk_size", "logging_steps", "save_steps"), (lambda v: v >= 1, ">= 1")),
    **dict.fromkeys(("learning_rate", "weight_decay", "beta", "epsilon_high", "max_staleness",
                     "entropy_coef_delta"), (lambda v: v >= 0, ">= 0")),
    **dict.fromkeys(("adam_beta1", "adam_beta2", "epsilon", "lora_dropout"), (lambda v: 0 <= v < 1, "in [0, 1)")),
    **dict.fromkeys(("warmup_ratio", "ref_model_mixup_alpha", "top_entropy_quantile"),
                    (lambda v: 0 <= v <= 1, "in [0, 1]")),
    **dict.fromkeys(("num_train_epochs", "temperature", "lora_alpha", "sapo_temperature_neg", "sapo_temperature_pos"),
                    (lambda v: v > 0, "> 0")),
    "max_grad_norm": (lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    "lr_scheduler_type": (lambda v: v in SCHEDULES, f"one of {', '.join(SCHEDULES)}"),
    "warmup_steps": (lambda v: v >= 0 and (v < 1 or v == int(v)), ">= 0: whole steps, or a fraction < 1"),
    "optim": (lambda v: v in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)} (or transformers' "
                                         f"{', '.join(OPTIMIZER_ALIASES)})"),
    "per_device_train_batch_size": (lambda v: v >= 1, ">= 1 (completions per micro-batch)"),
    "steps_per_generation": (lambda v: v >= 1, ">= 1, or None for gradient_accumulation_steps"),
    "generation_batch_size": (lambda v: v >= 1, ">= 1, or None for per_device_train_batch_size x ranks x "
                                                "steps_per_generation"),
    "num_generations": (lambda v: v >= 2, ">= 2: GRPO scores each completion against the others of its "
                                          "prompt, so a group of one has no signal"),
    "max_steps": (lambda v: v > 0 or v == -1, "> 0, or -1 to train for num_train_epochs"),
    "pad_to_multiple_of": (lambda v: v >= 1, '>= 1, or None (TRL\'s "auto") for no padding'),
    "max_prompt_length": (lambda v: v >= 1, ">= 1, or None to leave prompts whole"),
    "max_tool_calling_iterations": (lambda v: v >= 1, ">= 1, or None for no limit"),
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
    "delta": (lambda v: v > 0, "> 0, or None for one-sided clipping"),
    "scale_rewards": (lambda v: v in SCALES, f"one of {', '.join(SCALES)}"),
    "multi_objective_aggregation": (lambda v: v in AGGREGATIONS, f"one of {', '.join(AGGREGATIONS)}"),
    "loss_type": (lambda v: v in LOSS_TYPES, f"one of {', '.join(LOSS_TYPES)}"),
    "importance_sampling_level": (lambda v: v in IMPORTANCE_SAMPLING_LEVELS,
                                  f"one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}"),
    "entropy_coef": (math.isfinite, "finite (0 disables the entropy bonus)"),
    "off_policy_mask_threshold": (lambda v: 0 <= v < math.inf, ">= 0 and finite (a KL bound, e.g. 0.5: below 0 even "
                                                               "on-policy completions would drop), or None"),
    **dict.fromkeys(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
                    (math.isfinite, "finite")),
    "reward_weights": (lambda v: all(math.isfinite(w) for w in v), "finite numbers"),
    "lora_target_modules": (lambda v: v == ALL_LINEAR or (isinstance(v, list) and all(
        isinstance(m, str) and re.fullmatch(r"[\w.]+", m) for m in v)),
        f'module names (a list, or comma-separated) or "{ALL_LINEAR}" (peft\'s regex strings are not read here)'),
    "save_strategy": (lambda v: v in SAVE_STRATEGIES, f"one of {', '.join(SAVE_STRATEGIES)}"),
    "save_total_limit": (lambda v: v >= 1, ">= 1, or None to keep every checkpoint"),
    "resume_from_checkpoint": (lambda v: isinstance(v, bool) or (isinstance(v, str) and v.strip() != ""),
                               'a checkpoint folder, "latest", or True / False'),
    "report_to": (lambda v: tracker_names(v) is not None,
                  f'"none" or one or more (a list, or comma-separated) of {", ".join(TRACKERS)}'),
    "num_completions_to_print": (lambda v: v >= 1, ">= 1, or None for all of them"),
    "eval_strategy": (lambda v: v in EVAL_STRATEGIES, f"one of {', '.join(EVAL_STRATEGIES)}"),
    "eval_steps": (lambda v: v >= 1, ">= 1, or None for logging_steps (eval_strategy=\"no\" evaluates never)"),
    "eval_limit": (lambda v: v >= 1, ">= 1, or None to evaluate every prompt"),
    "per_device_eval_batch_size": (lambda v: v >= 1, ">= 1, or None for as many as the memory plan fits"),
}


def check_config(config) -> None:
    """Raise ConfigError on the first field of the wrong type or out of range (each stored as
    `checked_field` returns it), then on settings that cannot work together (`check_combinations`), the batch
    schedule's included: the run plan resolved on the ranks torchrun announces, as the trainer resolves it."""
    for name in field_types(type(config)):
        setattr(config, name, checked_field(type(config), name, getattr(config, name)))
    config.bf16 = bf16_of_dtype(config.model_init_kwargs, config.bf16)
    check_combinations(config)
    RunPlan.resolve(config, ranks_from_env())


def checked_field(cls, name: str, value):
    """`value` as field `name` of the Config class `cls` stores it, or ConfigError: TRL's spellings become ours
    (trl_names.as_ours), an int given for a float field becomes a float (so the saved config reads the same however it
    was written), then the field's rule; generation_kwargs entries are checked as the fields they override."""
    value = _module_names(value) if name == "lora_target_modules" else as_ours(name, value)
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


def _checked_value(name: str, field: str, value, tp: FieldType):
    """`value` type-checked against `tp`, then against `field`'s rule; `name` is what an error calls it."""
    value = _checked_type(name, value, tp)
    if field in RULES and value is not None:
        holds, requirement = RULES[field]
        if not holds(value):
            raise ConfigError(f"{name} must be {requirement}, got {value!r}")
    return value


# The generation_kwargs our decoder implements: each overrides the Config field of its name (Config.sampling_knobs).
GENERATION_KWARGS = tuple(f.name for f in dataclasses.fields(SamplingKnobs))
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
