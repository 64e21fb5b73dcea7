"""QLoRA: a model loaded from a local path with 4-bit NF4 linear layers trains its LoRA adapters for real on CPU,
the 4-bit base stays 4-bit and untouched, and the reference is the adapter-disabled model."""
import pytest
import torch
from tiny_setup import digit_prompts, digit_share, logged, text_length, tiny_4bit_model, tiny_model, tiny_tokenizer

from grpo import Config, Trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(path)
    tiny_4bit_model(tokenizer).save_pretrained(path)
    return path


def qlora_config(tmp_path, model_dir, **overrides) -> Config:
    settings = dict(model=str(model_dir), output_dir=str(tmp_path / "run"), use_lora=True, load_in_4bit=True,
                    lora_r=4, lora_alpha=8, max_steps=2, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                    num_generations=4, max_prompt_length=16, max_completion_length=8, learning_rate=1e-2,
                    optim="adamw", beta=0.04, seed=0)
    return Config(**{**settings, **overrides})


@pytest.mark.slow
def test_qlora_trains_adapters_on_a_frozen_4bit_base(tmp_path, model_dir):
    import bitsandbytes as bnb

    trainer = Trainer(qlora_config(tmp_path, model_dir, gradient_checkpointing=True), reward_funcs=[text_length],
                      train_dataset=digit_prompts())
    quantized = {n: m for n, m in trainer.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(quantized) == 2 * 7, "every linear layer of both decoder layers is 4-bit"
    packed = {n: (m.weight.detach().clone(), m.weight.quant_state.absmax.clone()) for n, m in quantized.items()}
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert trainer.policy.reference is None, "the reference is the base model with the adapter disabled"

    reference_forwards = []
    reference_logprobs = trainer.policy.reference_logprobs
    trainer.policy.reference_logprobs = lambda rollout: reference_forwards.append(1) or reference_logprobs(rollout)
    trainer.train()

    assert any(not torch.equal(p, adapters[n]) for n, p in trainer.model.named_parameters() if n in adapters)
    for name, module in quantized.items():
        assert isinstance(module.weight, bnb.nn.Params4bit) and module.weight.dtype == torch.uint8
        weight, absmax = packed[name]
        assert torch.equal(module.weight, weight) and torch.equal(module.weight.quant_state.absmax, absmax), \
            f"{name}: the 4-bit base changed"
    assert len(reference_forwards) == 2  # one micro-batch per step, each with the adapter disabled
    assert logged(trainer)[-1]["kl"] > 0, "after an update the adapted policy differs from the 4-bit reference"
    assert (tmp_path / "run" / "checkpoint-2" / "adapter_model.safetensors").exists()


def test_load_in_4bit_needs_lora_and_a_model_loaded_by_the_trainer(tmp_path, model_dir):
    with pytest.raises(ValueError, match="needs use_lora=True"):  # the Config refuses it (settings/combinations.py)
        qlora_config(tmp_path, model_dir, use_lora=False)
    tokenizer = tiny_tokenizer()
    with pytest.raises(ValueError, match="applies when the trainer loads config.model"):
        Trainer(qlora_config(tmp_path, model_dir), model=tiny_model(tokenizer), tokenizer=tokenizer,
                reward_funcs=[digit_share], train_dataset=digit_prompts())
