"""GRPO measurably improves a model: the offline arithmetic recipe at a smaller budget, one seed.

The held-out greedy accuracy after GRPO must beat the accuracy right after the warm start by a wide margin.
It must fail when the algorithm is broken; check that by hand with
    GRPO_SABOTAGE=flip_sign pytest tests/system/test_learning.py         # policy gradient pointing the wrong way
    GRPO_SABOTAGE=zero_advantages pytest tests/system/test_learning.py   # no learning signal
"""
import dataclasses
import os
from pathlib import Path

import pytest
import torch

import grpo.rollout.pipeline
from grpo import Trainer
from grpo.settings.recipe import load_recipe, resolve_dataset

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "arithmetic_tiny.py"
SABOTAGES = {
    "flip_sign": lambda advantages: -advantages,
    "zero_advantages": lambda advantages: advantages * 0,
}


@pytest.fixture
def sabotage(monkeypatch):
    """Break the advantages the trainer sees when GRPO_SABOTAGE names a sabotage (see the module docstring)."""
    name = os.environ.get("GRPO_SABOTAGE")
    if name:
        if name not in SABOTAGES:
            raise ValueError(f"GRPO_SABOTAGE={name!r}; valid: {', '.join(SABOTAGES)}")
        original = grpo.rollout.pipeline.with_advantages  # where the advantages join the generation batch
        monkeypatch.setattr(grpo.rollout.pipeline, "with_advantages",
                            lambda rollout, advantages, mask: original(rollout, SABOTAGES[name](advantages), mask))
    return name


@pytest.fixture
def keep_threads():
    """The recipe pins torch to one thread (see its build_model); give the rest of the session its own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_grpo_raises_held_out_accuracy(tmp_path, sabotage, keep_threads):
    recipe = load_recipe(str(RECIPE))
    # The recipe's warm start in full (a shorter one leaves the worked strategy unlearned, nothing for GRPO
    # to find), then a third of its GRPO steps and a quarter of its held-out prompts.
    config = dataclasses.replace(recipe.config, output_dir=str(tmp_path / "run"), max_steps=20, eval_steps=20,
                                 eval_limit=128, save_steps=10**9, seed=0)
    model, tokenizer = recipe.build_model(config)
    trainer = Trainer(config, model=model, tokenizer=tokenizer, reward_funcs=recipe.reward_funcs,
                      train_dataset=resolve_dataset(recipe.train_dataset),
                      eval_dataset=resolve_dataset(recipe.eval_dataset))
    trainer.train()
    evals = [line for line in trainer.state.log_history if "eval/accuracy" in line]
    before, after = evals[0], evals[-1]
    assert (before["step"], after["step"]) == (0, 20)
    assert before["eval/accuracy"] < 0.3, "the warm start must leave GRPO room to improve"
    assert after["eval/accuracy"] >= before["eval/accuracy"] + 0.3, (before, after)
