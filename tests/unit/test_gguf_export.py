"""The GGUF writer on models built here (no training): transformers' `gguf_file=` loader reads back a float32
file as the same model (Llama's permuted query / key rows, Qwen2's biases, a tied or untied head), a q8_0 one as
the model rounded alike, and the tokenizer as the same tokenizer."""
import importlib.util

import pytest
import torch
from gguf_rounding import rounded_like_gguf
from tiny_setup import tiny_tokenizer

from grpo.errors import ConfigError
from grpo.policy.gguf_export import llama_permute, write_gguf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package")


def build(kind: str, tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    sizes = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**sizes, tie_word_embeddings=False)).eval()
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**sizes, tie_word_embeddings=True)).eval()
    return GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("type_name", ["f32", "q8_0"])
def test_transformers_reads_the_file_back_as_the_model(tmp_path, kind, type_name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = tiny_tokenizer()
    model = build(kind, tokenizer)
    write_gguf(model, tokenizer, tmp_path / "m.gguf", type_name)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    reference = model
    if type_name != "f32":
        reference = build(kind, tokenizer)
        for p in reference.parameters():
            p.data = rounded_like_gguf(p.data, type_name)
    ids = tokenizer("Write 5 digits: 01234", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
    text = "Write 12 digits: <|im_start|>x<|im_end|>"
    rebuilt = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    assert rebuilt(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_llamas_rows_are_permuted_as_llama_cpp_stores_them():
    w = torch.arange(8.0)[:, None]  # [heads * head_dim, 1]: 2 heads of 4 rows, halves (0 1 | 2 3)
    assert llama_permute(w, heads=2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_another_architecture_is_refused_in_one_line(tmp_path):
    tokenizer = tiny_tokenizer()
    with pytest.raises(ConfigError, match="this one is 'gpt2'.*convert_hf_to_gguf"):
        write_gguf(build("gpt2", tokenizer), tokenizer, tmp_path / "m.gguf", "f16")
    assert not list(tmp_path.iterdir())


def test_the_base_model_is_named_portably():
    from grpo.policy.sources import adapter_base, portable_name

    assert portable_name("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert portable_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert portable_name(__file__) == "test_gguf_export.py"  # a path of this machine: its name alone
    assert portable_name("/models/x/tiny.Q8_0.gguf") == "tiny.Q8_0.gguf"
    # what an adapter records as its base: the hub id wherever there is one, never the cache folder it loaded
    assert adapter_base("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert adapter_base("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
