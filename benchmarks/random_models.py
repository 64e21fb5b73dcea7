"""Random-weight model directories with real vocabularies, built offline, that any trainer can load by path."""
from __future__ import annotations

import json
from pathlib import Path

from grpo.tasks.tiny import wide_tokenizer


def qwen2_config(vocab_size: int = 151936, hidden_size: int = 512, num_layers: int = 4, num_heads: int = 8,
                 num_kv_heads: int = 2, intermediate_size: int | None = None, tie_word_embeddings: bool = True):
    """A Qwen2 config; the defaults are Qwen2.5-0.5B's proportions, shrunk to run on a CPU."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size,
                       intermediate_size=intermediate_size or hidden_size * 11 // 2,
                       num_hidden_layers=num_layers, num_attention_heads=num_heads,
                       num_key_value_heads=num_kv_heads, max_position_embeddings=4096,
                       tie_word_embeddings=tie_word_embeddings)


def save_model_dir(path: str | Path, config, seed: int = 0) -> Path:
    """Write a random-weight model built from `config` and a `wide_tokenizer` beside it, once: an existing
    directory made from the same config is reused."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    stamp = path / "built_from.json"
    wanted = json.dumps(config.to_dict(), sort_keys=True, default=str)
    if stamp.exists() and stamp.read_text() == wanted:
        return path
    tokenizer = wide_tokenizer(config.vocab_size)
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    stamp.write_text(wanted)
    return path
