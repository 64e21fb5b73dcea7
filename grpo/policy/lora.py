"""LoRA as peft describes it: a `LoraConfig` (TRL's `peft_config=`) or the adapter of a `PeftModel` passed in,
read into the Config's LoRA settings where it asks for what this trainer implements (plain LoRA on linear
layers), and the adapter added to a model that has none (`with_adapter`)."""
from __future__ import annotations

import dataclasses
import sys
import warnings

from ..errors import ConfigError
from ..settings.choices import ALL_LINEAR

# LoraConfig fields the Config holds: peft's name -> ours.
FIELDS = {"r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
          "target_modules": "lora_target_modules"}
# Fields peft fills in itself, or that say nothing about the adapter trained.
BOOKKEEPING = {"peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "task_type"}
# Why a field this trainer does not implement is refused, where there is more to say than that.
REASONS = {
    "bias": "biases trained beside LoRA would stay on when the adapter is switched off for the reference",
    "use_dora": "DoRA is not implemented here",
    "modules_to_save": "only the adapters train here (no fully trained module copies)",
    "inference_mode": "the adapter is frozen: load it with is_trainable=True",
}


def save_options(model) -> dict:
    """`save_pretrained`'s options for `model`. An adapter is saved without the base model's embeddings: the
    vocabulary is never resized here, and peft's "auto" would otherwise ask the Hub whether it was (offline, two
    warnings at the first save; behind a firewall that drops packets, a wait)."""
    return {"save_embedding_layers": False} if is_peft_model(model) else {}


def is_peft_model(model) -> bool:
    """Whether `model` is a peft PeftModel (peft is imported only where one can exist: it was built with it)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def lora_settings(lora, source: str = "peft_config", model_type=None) -> dict:
    """The Config settings that train what the peft LoraConfig `lora` describes; ConfigError naming every field
    it sets that this trainer does not implement, at once. `source` is what messages call it; `model_type` (a
    callable giving the model's config.model_type) is read only when `lora` names no target_modules."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(lora, peft.LoraConfig):
        raise ConfigError(f"{source} must be a peft LoraConfig (this trainer trains LoRA adapters), got "
                          f"{type(lora).__name__}")
    defaults = type(lora)()
    unsupported = [f.name for f in dataclasses.fields(lora) if f.name not in FIELDS and f.name not in BOOKKEEPING
                   and getattr(lora, f.name) != getattr(defaults, f.name)]
    if lora.task_type not in (None, "CAUSAL_LM"):
        unsupported.insert(0, "task_type")
    if unsupported:
        said = ", ".join(f"{name}={getattr(lora, name)!r}" for name in unsupported)
        why = "; ".join(f"{name}: {REASONS[name]}" for name in unsupported if name in REASONS)
        raise ConfigError(f"{source} sets {said}, which this trainer does not implement{f' ({why})' if why else ''}"
                          f": it trains plain LoRA from r, lora_alpha, lora_dropout and target_modules")
    return {"use_lora": True, **{ours: getattr(lora, theirs) for theirs, ours in FIELDS.items()
                                 if theirs != "target_modules"},
            "lora_target_modules": _target_modules(lora.target_modules, source, model_type)}


def _target_modules(target_modules, source: str, model_type):
    """peft's target_modules as the Config holds them: "all-linear" or a list of names (a regex string is refused
    by the Config's own check); None: peft's default for the model's architecture, as get_peft_model picks it."""
    if target_modules is None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        kind = model_type() if model_type is not None else None
        if kind not in DEFAULTS:
            raise ConfigError(f"{source} has target_modules=None, peft's default for the model's architecture, and "
                              f"peft has none for model_type {kind!r}: name them, target_modules=\"{ALL_LINEAR}\" "
                              f"(every linear layer but the output head) or a list such as [\"q_proj\", \"v_proj\"]")
        return sorted(DEFAULTS[kind])
    return target_modules if isinstance(target_modules, str) else sorted(target_modules)


def adapter_settings(model) -> dict:
    """`lora_settings` of the active adapter of the PeftModel `model`, the one that trains."""
    return lora_settings(model.peft_config[model.active_adapter], "the PeftModel's adapter")


def with_adapter(model, config):
    """`model` with a new LoRA adapter from `config`'s LoRA settings (settings/components.LoadSettings, or a Config),
    peft's `get_peft_model`; a PeftModel passed in (its settings read by `adapter_settings`) trains its own
    adapter and is returned as it is. ConfigError for an adapter on the LM head."""
    if not is_peft_model(model):
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                          target_modules=config.lora_target_modules or ALL_LINEAR, task_type="CAUSAL_LM")
        try:
            with warnings.catch_warnings():  # peft 0.21 reads transformers 5's deprecated alias: not the user's to fix
                warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
                model = get_peft_model(model, lora)
        except ValueError as e:  # peft's refusal of these settings on this model, e.g. dropout on fused MoE experts
            raise ConfigError(f"peft cannot add this LoRA adapter to the model: {e}") from None
    if hasattr(model.get_base_model().get_output_embeddings(), "base_layer"):  # peft's layer wraps the head
        raise ConfigError("a LoRA adapter on the LM head (lm_head) is not supported, as in TRL: the log-probs are "
                          "computed from its weight directly, so the adapter would never train; remove it from "
                          "target_modules")
    return model
