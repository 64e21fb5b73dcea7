"""Architectures of well-known models (so the planner needs no download), the "GRPO on a 16 GB GPU"
write-up's settings and measured peaks, and reading any other model's architecture from its config."""
from __future__ import annotations

import dataclasses
import os

from ..settings import Config
from .parts import Architecture

# Facts from each model's config.json (hidden, layers, heads, KV heads, intermediate, vocab, tied, head_dim, bias).
_FACTS = {
    "Qwen/Qwen2.5-0.5B": (896, 24, 14, 2, 4864, 151936, True, None, True),
    "Qwen/Qwen2.5-1.5B": (1536, 28, 12, 2, 8960, 151936, True, None, True),
    "Qwen/Qwen2.5-3B": (2048, 36, 16, 2, 11008, 151936, True, None, True),
    "Qwen/Qwen2.5-7B": (3584, 28, 28, 4, 18944, 152064, False, None, True),
    "Qwen/Qwen2.5-14B": (5120, 48, 40, 8, 13824, 152064, False, None, True),
    "meta-llama/Llama-3.2-1B": (2048, 16, 32, 8, 8192, 128256, True, 64, False),
    "meta-llama/Llama-3.2-3B": (3072, 28, 24, 8, 8192, 128256, True, 128, False),
    "meta-llama/Llama-3.1-8B": (4096, 32, 32, 8, 14336, 128256, False, 128, False),
}
KNOWN = {name: Architecture(*facts[:5], vocab_size=facts[5], tie_word_embeddings=facts[6], head_dim=facts[7],
                            attention_bias=facts[8], name=name) for name, facts in _FACTS.items()}
KNOWN.update({f"{name}-Instruct": dataclasses.replace(a, name=f"{name}-Instruct") for name, a in list(KNOWN.items())})

# The write-up's table (TRL, H100, GSM8K, 1 x 4 generations, 256 + 786 tokens): peak GB, None where it ran out.
ARTICLE_GB = {"0.5B": (25, 13), "1B": (38, 16), "3B": (58, 32), "8B": (None, 58), "14B": (None, 69)}
TABLE_MODELS = {"0.5B": "Qwen/Qwen2.5-0.5B-Instruct", "1B": "meta-llama/Llama-3.2-1B-Instruct",
                "3B": "Qwen/Qwen2.5-3B-Instruct", "8B": "meta-llama/Llama-3.1-8B-Instruct",
                "14B": "Qwen/Qwen2.5-14B-Instruct"}
# The write-up ran TRL ~0.14, whose per_device_train_batch_size=1 counted prompts (x 4 generations): 4 completions.
ARTICLE_CONFIG = Config(per_device_train_batch_size=4, gradient_accumulation_steps=4, num_generations=4,
                        max_prompt_length=256, max_completion_length=786, beta=0.04, optim="adamw", bf16=True,
                        gradient_checkpointing=False)  # the table's columns add it
TABLE_COLUMNS = {  # cumulative, as the write-up's columns
    "full": {},
    "+8-bit": {"optim": "adamw_8bit"},
    "+ckpt": {"optim": "adamw_8bit", "gradient_checkpointing": True},
    "+bf16w": {"optim": "adamw_8bit", "gradient_checkpointing": True, "bf16_weights": True},
    "LoRA": {"optim": "adamw_8bit", "gradient_checkpointing": True, "use_lora": True},
    "QLoRA": {"optim": "adamw_8bit", "gradient_checkpointing": True, "use_lora": True, "load_in_4bit": True},
}


def architecture_of(name: str, model=None, download: bool = False) -> Architecture | str:
    """The model's architecture: from `model` (a model or its HF config) when given, the built-in facts for
    well-known hub ids, else the config.json of `name` (Config.model; from the hub only when `download`). A
    string says why it could not be read."""
    if model is not None:
        config = getattr(model, "config", model)
        label = getattr(config, "name_or_path", "") or "the given model"
        unreadable = (AttributeError, KeyError, TypeError, ValueError)  # a config without the usual fields
    elif name in KNOWN:
        return KNOWN[name]
    else:
        label, unreadable = name, Exception  # any failure to find or read a config is reported, never raised
    try:
        if model is None:  # a .gguf file's or short name's config: its converted folder's
            from transformers import AutoConfig

            from ..policy.gguf import resolve_model_path

            path = resolve_model_path(name)
            config = AutoConfig.from_pretrained(path, local_files_only=os.path.isdir(path) or not download)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        return Architecture(
            hidden_size=text.hidden_size, num_layers=text.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            intermediate_size=text.intermediate_size, vocab_size=text.vocab_size,
            tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
            head_dim=getattr(text, "head_dim", None),
            # Qwen2 has q/k/v biases without saying so in its config.
            attention_bias=bool(getattr(text, "attention_bias", False)) or text.model_type == "qwen2", name=label)
    except unreadable as error:  # noqa: BLE001
        if model is None:
            return f"cannot read the config of {name!r} ({type(error).__name__}), so no memory plan"
        return f"the architecture of {label} ({type(config).__name__}) could not be read: {error}"
