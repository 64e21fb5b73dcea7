"""Offline stand-ins for hub downloads: a tokenizer trained in seconds and a small random-weight model
built from a transformers config. Tests, the offline recipes and the benchmarks use these."""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen models use: enough for chat-formatted prompts to exercise the real code path.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts`, digits always split one per token.

    `<|im_end|>` doubles as EOS, so chat completions end the way Qwen's do."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return _chat_tokenizer(tok)


def wide_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with exactly `vocab_size` ids, as wide as a real model's vocabulary: the special
    tokens, the 256 byte symbols and filler words (" w1234"). Text encodes one token per byte (no merges), and
    every id decodes to text, so random-weight models with real vocabularies can sample freely."""
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for i in range(vocab_size - len(vocab)):
        vocab[f"\u0120w{i}"] = len(vocab)  # \u0120 is the byte-level symbol of a space
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return _chat_tokenizer(tok)


def _chat_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """`tok` with a byte-level decoder, as a transformers tokenizer with our special tokens and CHAT_TEMPLATE."""
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>", bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_qwen2(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
               num_kv_heads: int = 2, intermediate_size: int | None = None, seed: int = 0,
               tie_word_embeddings: bool = True, **overrides) -> Qwen2ForCausalLM:
    """A random-weight Qwen2 causal LM; with real dimensions it has that model's memory and speed profile."""
    import torch

    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=intermediate_size or 4 * hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=4096, tie_word_embeddings=tie_word_embeddings, **overrides)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def tiny_gpt2(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
              max_positions: int = 128, seed: int = 0) -> GPT2LMHeadModel:
    """A random-weight GPT-2 causal LM. Its learned absolute positions let a tiny model line up the digits of
    fixed-layout arithmetic in a few hundred steps, several times faster than rotary positions do."""
    import torch

    config = GPT2Config(vocab_size=vocab_size, n_embd=hidden_size, n_layer=num_layers, n_head=num_heads,
                        n_positions=max_positions,
                        bos_token_id=None, eos_token_id=None,  # GPT-2's own ids are not in this vocabulary
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # dropout would make log-probs noisy
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    # transformers picks a model's loss by its class name, which here names none: the first loss computed (a
    # supervised warm start's) would log that `loss_type=None` is unrecognized, then use this one anyway.
    model.loss_type = "ForCausalLM"
    return model


def model_for(tokenizer, build=tiny_qwen2, **kwargs):
    """A tiny model (`build`: `tiny_qwen2` or `tiny_gpt2`) sized to `tokenizer`, with its pad/eos ids
    written into the model config."""
    model = build(len(tokenizer), **kwargs)
    for config in (model.config, model.generation_config):
        config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    return model
