"""Reward models as reward functions: a sequence-classification model (or its hub id / local path) in TRL's
`reward_funcs` becomes a callable following rewards.py's contract (docs/coming-from-trl.md, "Reward models")."""
from __future__ import annotations

import torch

from ..errors import ConfigError
from .engines.chat import is_chat
from .rewards import RewardError


class RewardModel:
    """A sequence-classification model and its tokenizer as a reward function of (prompts, completions)."""

    def __init__(self, model: torch.nn.Module, tokenizer, chat_template_kwargs: dict | None = None):
        self.model, self.tokenizer = model.eval(), tokenizer  # eval: no dropout (TRL relies on from_pretrained's)
        self.chat_template_kwargs = chat_template_kwargs or {}  # as for the policy's prompts (TRL passes them too)
        self.__name__ = model.config._name_or_path.split("/")[-1] or type(model).__name__

    def __call__(self, prompts: list, completions: list) -> list[float]:
        if is_chat(prompts[0]):
            texts = [self.tokenizer.apply_chat_template(p + c, tokenize=False, **self.chat_template_kwargs)
                     for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        device = next(self.model.parameters()).device
        inputs = self.tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                                add_special_tokens=False).to(device)  # input_ids, attention_mask [N, T]
        with torch.inference_mode():
            logits = self.model(**inputs).logits  # [N, num_labels]
        if logits.shape != (len(texts), 1):
            raise RewardError(f"reward model '{self.__name__}' returned logits of shape {tuple(logits.shape)}; "
                              f"expected ({len(texts)}, 1): one score per completion")
        return logits[:, 0].float().tolist()  # [N]


def reward_callables(reward_funcs, reward_processing_classes=None, chat_template_kwargs: dict | None = None,
                     required: bool = True) -> list:
    """`reward_funcs` (one or a list of functions, reward models and model paths) with every model wrapped as a
    `RewardModel` (on the CPU when loaded here: see `place_reward_models`). `required`: none is an error (False when
    an environment owns the reward, as TRL allows)."""
    funcs = [reward_funcs] if isinstance(reward_funcs, str) or callable(reward_funcs) else list(reward_funcs or ())
    if not funcs and required:
        raise ConfigError("No reward source provided: Trainer needs at least one reward function in reward_funcs, "
                          "or an environment_factory whose class defines get_reward() (the environment owns the "
                          "reward)")
    classes = [None] * len(funcs) if reward_processing_classes is None else reward_processing_classes
    classes = classes if isinstance(classes, (list, tuple)) else [classes]
    if len(classes) != len(funcs):
        raise ConfigError(f"reward_processing_classes has {len(classes)} entries but there are {len(funcs)} reward "
                          f"functions: give one per reward function, None for plain functions")
    return [_wrap(f, tokenizer, i, chat_template_kwargs) for i, (f, tokenizer) in enumerate(zip(funcs, classes))]


def place_reward_models(reward_funcs: list, device) -> None:
    """Put every reward model on `device` (the policy's), where its inputs will go."""
    for f in reward_funcs:
        if isinstance(f, RewardModel):
            f.model.to(device)


def _wrap(f, tokenizer, i: int, chat_template_kwargs: dict | None):
    """Entry `i` of reward_funcs as a callable: a model (or path) becomes a RewardModel, a function stays."""
    if isinstance(f, str):
        f = _load_model(f)
    if not isinstance(f, torch.nn.Module):
        if not callable(f):
            raise ConfigError(f"reward_funcs[{i}] is {type(f).__name__} {f!r:.80}: expected a function, a "
                              f"sequence-classification model or its hub id / path")
        return f
    config = getattr(f, "config", None)
    if getattr(config, "num_labels", None) != 1:
        raise ConfigError(f"reward_funcs[{i}] is a {type(f).__name__} with num_labels="
                          f"{getattr(config, 'num_labels', None)}: a reward model must be a sequence-classification "
                          f"model with one label (AutoModelForSequenceClassification.from_pretrained(path, "
                          f"num_labels=1))")
    tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(config._name_or_path, i)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"the tokenizer of reward_funcs[{i}] has neither a pad nor an EOS token to pad with: "
                              f"set tokenizer.pad_token")
        tokenizer.pad_token = tokenizer.eos_token
    config.get_text_config().pad_token_id = tokenizer.pad_token_id  # where the model finds each text's last token
    return RewardModel(f, tokenizer, chat_template_kwargs)


def _load_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification

    try:
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    except (OSError, ValueError) as error:
        raise ConfigError(f"reward model {path!r} cannot be loaded as a sequence-classification model: "
                          f"{_first_line(error)}") from None


def _load_tokenizer(name: str, i: int):
    from transformers import AutoTokenizer

    if not name:
        raise ConfigError(f"reward_funcs[{i}] is a model without a config._name_or_path to load its tokenizer "
                          f"from: pass its tokenizer in reward_processing_classes")
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise ConfigError(f"the tokenizer of reward model {name!r} cannot be loaded ({_first_line(error)}): pass "
                          f"it in reward_processing_classes") from None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
