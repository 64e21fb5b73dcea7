"""`bf16_weights`: a real full fine-tuning run on CPU keeps bf16 weights and trains them."""
import math

import pytest
import torch
from tiny_setup import digit_prompts, digit_share, logged, tiny_model, tiny_tokenizer

from grpo import Config, Trainer


@pytest.mark.parametrize("optim", ["adamw", "adamw_8bit"])
def test_a_tiny_full_finetuning_run_trains_bf16_weights_on_cpu(tmp_path, optim):
    tokenizer = tiny_tokenizer()
    config = Config(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=2,
                    gradient_accumulation_steps=2, num_generations=4, max_prompt_length=16, max_completion_length=8,
                    learning_rate=1e-3, optim=optim, beta=0.04, seed=0, bf16_weights=True)
    trainer = Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[digit_share],
                      train_dataset=digit_prompts())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    history = logged(trainer)
    params = dict(trainer.model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    assert all(math.isfinite(line["loss"]) and math.isfinite(line["grad_norm"]) for line in history)
    changed = [n for n, p in params.items() if not torch.equal(p, before[n])]
    # lr 1e-3 is below half of bf16's spacing for most weights: only stochastic rounding moves them.
    assert len(changed) == len(params), set(params) - set(changed)
