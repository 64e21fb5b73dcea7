"""TRL's GRPOTrainer call shape on our Trainer (docs/coming-from-trl.md): `args=`, `processing_class=`, a model
id, `peft_config=` or a PeftModel; TRL's keywords this Trainer lacks are refused with what to do instead
(settings/trl_names.py)."""
from __future__ import annotations

import dataclasses

import torch

from .errors import ConfigError
from .policy.lora import adapter_settings, is_peft_model, lora_settings
from .policy.models import with_pad_token
from .policy.sources import model_type
from .rollout.reward_models import RewardModel
from .rollout.rewards import reward_func_names
from .settings import Config
from .settings.trl_names import TRAINER_ONLY


def trl_call(config, args, model, tokenizer, processing_class, trl_only: dict, samplers: tuple):
    """(config, model, tokenizer) from either call shape, ours or TRL's; ConfigError for what cannot work.
    `samplers`: the Trainer's sampler, rollout_func and tools (or environment_factory), one at most given."""
    if sum(x is not None for x in samplers) > 1:
        raise ConfigError("pass one of a sampler, a rollout_func, tools/environment_factory: the tools are "
                          "called within our own decoder, which the other two replace")
    trl_only = dict(trl_only)
    peft_config = trl_only.pop("peft_config", None)
    refused = [f"Trainer's `{k}`: {TRAINER_ONLY[k]}" for k, v in trl_only.items()
               if k in TRAINER_ONLY and v not in (None, (None, None), [])]
    unknown = [k for k in trl_only if k not in TRAINER_ONLY]
    if unknown:
        raise TypeError(f"Trainer() got an unexpected keyword argument '{unknown[0]}'")
    if refused:
        raise ConfigError("; ".join(refused))
    if config is not None and not isinstance(config, Config):  # e.g. TRL's positional (model, reward_funcs)
        raise ConfigError(f"Trainer's first argument is a grpo Config (TRL's `args=`), got "
                          f"{type(config).__name__} {config!r:.60}: pass the model as model=, the settings "
                          f"as args=Config(...)")
    if args is not None and config is not None:
        raise ConfigError("pass the Config once: as `config` or as TRL's `args=`, not both")
    if processing_class is not None and tokenizer is not None:
        raise ConfigError("pass the tokenizer once: as `tokenizer=` or as TRL's `processing_class=`, not both")
    config = args if args is not None else config if config is not None else Config()
    if not isinstance(config, Config):
        raise ConfigError(f"args= must be a grpo Config, got {type(config).__name__}: build it with "
                          f"grpo.Config(...) (TRL's GRPOConfig keywords work there)")
    if isinstance(model, str):  # TRL: a hub id or folder to load
        config, model = dataclasses.replace(config, model=model), None
    if config.load_in_4bit and model is not None:
        raise ConfigError("load_in_4bit applies when the trainer loads config.model itself; a model passed in is "
                          "used as built (load it with a transformers BitsAndBytesConfig, or pass config.model)")
    config = dataclasses.replace(config, **lora) if (lora := _lora(peft_config, model, config)) else config
    tokenizer = tokenizer if tokenizer is not None else processing_class
    return config, model, with_pad_token(tokenizer) if tokenizer is not None else None


def _lora(peft_config, model, config: Config) -> dict:
    """The LoRA settings TRL's `peft_config` or a PeftModel passed in asks for, as TRL takes them: either trains
    LoRA whatever use_lora says, and the two together are refused."""
    if peft_config is not None and is_peft_model(model):
        raise ConfigError("a PeftModel passed together with peft_config (as in TRL, refused): merge and unload "
                          "its adapter and pass the base model with peft_config, or pass the PeftModel alone to "
                          "train its adapter")
    if peft_config is not None:
        return lora_settings(peft_config, model_type=lambda: model_type(model, config.model))
    return adapter_settings(model) if is_peft_model(model) else {}


def trl_attributes(trainer) -> dict:
    """TRL GRPOTrainer's attributes that a script reads, from the Trainer `trainer`'s own (docs/coming-from-trl.md
    says which, what each holds here, and why); `reward_weights` are the run plan's (an environment's own reward
    weighs 1, after the config's), 1.0 each unless set."""
    reward_funcs, policy, weights = trainer.reward_funcs, trainer.policy, trainer.plan.generation.reward_weights
    weights = weights if weights is not None else [1.0] * len(reward_funcs)
    return {"args": trainer.config, "processing_class": trainer.tokenizer,
            "reward_func_names": reward_func_names(reward_funcs),
            "reward_processing_classes": [f.tokenizer if isinstance(f, RewardModel) else None for f in reward_funcs],
            "reward_weights": torch.tensor(weights, dtype=torch.float32), "ref_model": policy.reference,
            "train_dataset": trainer.prompts.dataset, "aux_loss_enabled": policy.router_aux_coef != 0,
            "router_aux_loss_coef": policy.router_aux_coef}
