"""A tiny offline model, tokenizer and dataset shared by the integration tests."""
import math

import torch
from datasets import Dataset
from transformers import TrainerCallback

from grpo.rollout.batches import tool_metrics
from grpo.rollout.engines.decoding import DecodeSettings
from grpo.settings.components import SamplingKnobs
from grpo.tasks.tiny import model_for, train_tokenizer

CORPUS = [f"Write {k} digits: " + "0123456789"[:k] for k in range(1, 10)] * 20 + [
    "<reasoning> think </reasoning> <answer> 42 </answer>"] * 20


def tiny_tokenizer():
    return train_tokenizer(CORPUS, vocab_size=200)


def tiny_model(tokenizer, seed: int = 0):
    return model_for(tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=seed)


def saved_tiny_model(path):
    """The tiny model and its tokenizer saved in folder `path`, as a TRL script names a model: by path. Returns it."""
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_4bit_model(tokenizer, seed: int = 0):
    """Layer sizes real models have, which bitsandbytes' 4-bit CPU kernels need: in_features multiples of 64
    (the 4-bit block), out_features multiples of 32 (tiny_model's are 32 and 16)."""
    return model_for(tokenizer, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1,
                     seed=seed)


def decode_settings(max_new_tokens: int, eos_ids, pad_id: int, *, stop_at_eos: bool = True, greedy: bool = False,
                    **knobs) -> DecodeSettings:
    """rollout/engines/decoding.DecodeSettings with the sampling knobs (settings/components.SamplingKnobs) as
    keywords."""
    return DecodeSettings(max_new_tokens, eos_ids, pad_id, SamplingKnobs(**knobs), stop_at_eos, greedy)


def loop_metrics(loop) -> dict[str, float]:
    """TRL's tool metrics of a rollout/engines/tool_loop.ToolLoop's rows, as a generation batch computes them."""
    return tool_metrics(*(torch.tensor(counts, dtype=torch.float32) for counts in loop.row_counts()))


def digit_prompts(n: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"Write {1 + i % 9} digits:", "num_digits": 1 + i % 9} for i in range(n)])


def digit_share(completions, **kwargs):
    return [sum(c.isdigit() for c in t) / max(1, len(t)) for t in completions]


def text_length(completions, **kwargs):
    """Characters / 100: a reward that varies within the groups of a random-weight model with real layer sizes,
    whose completions often hold no digit at all (every advantage 0, no update)."""
    return [len(t) / 100 for t in completions]


def tiny_reward_model(tokenizer, seed: int = 0, name: str = "org/tiny-rm", num_labels: int = 1):
    """A random-weight GPT-2 sequence classifier (TRL's reward-model shape) sized to `tokenizer`. Its absolute
    positions make wrong padding visible in the scores (rotary ones shift with it); its dropout (0.1) makes a
    model left in train mode visible. The score head is drawn with std 1 (not 0.02): scores are O(1) and differ
    clearly between texts."""
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification

    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=256,
                        bos_token_id=None, eos_token_id=None, num_labels=num_labels,
                        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = GPT2ForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    model.config._name_or_path = name
    return model


def odd_digit_share(completions, num_digits, **kwargs):
    """digit_share where the prompt asks for an odd number of digits, 0.5 where even: those groups' rewards
    are all equal, so every one of their advantages is exactly 0."""
    return [s if n % 2 else 0.5 for s, n in zip(digit_share(completions), num_digits)]


def logged(trainer) -> list[dict]:
    """The lines `trainer`'s run logged, as metrics.jsonl holds them: its state.log_history without the metrics
    each train() call closes it with (transformers' TrainOutput ones)."""
    return [line for line in trainer.state.log_history if "train_runtime" not in line]


class NanLoss(TrainerCallback):
    """A fault injected through TRL's `callbacks=`: NaN embeddings in the training (grad-enabled) forwards of
    optimizer steps `first`..`last` (1-based), so their loss and gradients are NaN; sampling and the fixed
    log-probs (no grad) stay finite. `model`: the model the trainer trains; `made`: every one made."""
    made: list = []

    def __init__(self, first: int, last: int = 10**9):
        self.steps, self.model, self.bad = range(first, last + 1), None, False
        NanLoss.made.append(self)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.model is None:
            self.model = model
            model.get_input_embeddings().register_forward_hook(self.poison)
        self.bad = state.global_step + 1 in self.steps

    def poison(self, module, inputs, output):
        return output * math.nan if self.bad and torch.is_grad_enabled() else None


HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 16, 2, 4, 2, 32


def byte_tokens() -> list[str]:
    """The 256 byte-level symbols of GPT-2's BPE (printable bytes as themselves, the rest shifted past 255)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, n = [], 0
    for b in range(256):
        if b in keep:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + n))
            n += 1
    return symbols


def write_tiny_gguf(path, seed: int = 0):
    """A tiny llama as a GGUF file (needs the gguf package), with a byte-level BPE tokenizer and a ChatML
    template like SmolLM2's."""
    import gguf
    import numpy as np

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_tokens() + ["Ġt", "Ġth", "he"]
    merges = ["Ġ t", "Ġt h", "h e"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rng = np.random.default_rng(seed)

    def tensor(name, *shape):  # numpy shape is (rows, cols) = torch's [out, in]
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    tensor("token_embd.weight", vocab, HIDDEN)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        tensor(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Mixture-of-experts families TRL's tests train (its tiny Hub models), as tiny random configs: model_type -> the
# settings beyond a 2-layer, 32-wide decoder. Qwen3-MoE and GPT-OSS declare a router loss weight (0.001), Glm4-MoE
# and NemotronH (a Mamba / MoE / attention hybrid) declare none.
MOE_FAMILIES = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"]),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                     n_group=1, topk_group=1),
    "nemotron_h": dict(layers_block_type=["mamba", "moe", "attention"], num_hidden_layers=3, mamba_num_heads=4,
                       mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=16, n_routed_experts=4,
                       moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, use_mamba_kernels=False),
}


def tiny_moe(tokenizer, model_type: str, seed: int = 0, **settings):
    """A random-weight causal LM of a mixture-of-experts family (`MOE_FAMILIES`) sized to `tokenizer`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{
        "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None, **MOE_FAMILIES[model_type], **settings})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = (tokenizer.pad_token_id,
                                                                                   tokenizer.eos_token_id)
    return model
