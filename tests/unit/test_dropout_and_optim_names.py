"""TRL's disable_dropout (every nn.Dropout of the policy at p = 0, LoRA's included) and transformers' optimizer
names (aliases of ours: the same optimizer, the same memory estimate, the same saved config)."""
import dataclasses

import pytest
import torch

from grpo.settings import Config
from grpo.errors import ConfigError
from grpo.memory.estimate import estimate
from grpo.memory.parts import Architecture
from grpo.memory.fit import memory_savings
from grpo.memory.known_models import KNOWN
from grpo.policy.models import prepare_for_training
from grpo.policy.optim import build_optimizer


def gpt2_with_dropout():
    """A random-weight GPT-2 whose embedding, attention and residual dropouts are all 0.1 (nn.Dropout modules)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(config)


def dropouts(model) -> list[float]:
    return [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]


def two_train_forwards(model):
    ids = torch.arange(12).reshape(2, 6)
    assert model.training
    with torch.no_grad():
        return model(input_ids=ids).logits, model(input_ids=ids).logits


@pytest.mark.parametrize("use_lora", [False, True])
def test_disable_dropout_zeroes_every_dropout_and_makes_train_forwards_deterministic(use_lora):
    settings = dict(use_lora=use_lora, lora_r=2, lora_alpha=4, lora_dropout=0.1, gradient_checkpointing=False)
    noisy = prepare_for_training(gpt2_with_dropout(), Config(**settings))
    lora_dropouts = [m for n, m in noisy.named_modules() if "lora_dropout" in n and isinstance(m, torch.nn.Dropout)]
    assert bool(lora_dropouts) == use_lora and all(p == 0.1 for p in dropouts(noisy))
    a, b = two_train_forwards(noisy)
    assert not torch.equal(a, b), "dropout must make train forwards differ, or the test proves nothing"

    quiet = prepare_for_training(gpt2_with_dropout(), Config(**settings, disable_dropout=True))
    assert len(dropouts(quiet)) == len(dropouts(noisy)) and all(p == 0 for p in dropouts(quiet))
    a, b = two_train_forwards(quiet)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and the same numbers as eval mode, where no dropout ever applies: the same kernels, float32's defaults
    # (rtol 1.3e-6 = 22 ulps) for any reordering (measured: equal); a dropout left on changes ~10% of them
    with torch.no_grad():
        torch.testing.assert_close(a, quiet.eval()(input_ids=torch.arange(12).reshape(2, 6)).logits)


def test_disabled_lora_dropout_is_planned_like_none():
    # p = 0 dropout returns its input, keeping nothing for backward: the planner counts it as lora_dropout=0
    a = Architecture(hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16, vocab_size=100,
                     tie_word_embeddings=True)
    s = Config(use_lora=True, lora_r=2, lora_dropout=0.05, per_device_train_batch_size=2, num_generations=2,
               max_prompt_length=3, max_completion_length=5, gradient_checkpointing=False)
    without = estimate(a, dataclasses.replace(s, lora_dropout=0.0), "cuda").parts
    assert estimate(a, s, "cuda").parts != without
    assert estimate(a, dataclasses.replace(s, disable_dropout=True), "cuda").parts == without
    savings = memory_savings(dataclasses.replace(s, disable_dropout=True))
    assert not any("lora_dropout" in change for change, _ in savings)


@pytest.mark.parametrize("alias, ours", [("adamw_torch", "adamw"), ("adamw_torch_fused", "adamw"),
                                         ("adamw_bnb_8bit", "adamw_8bit")])
def test_transformers_optimizer_names_are_ours(alias, ours):
    config = Config(optim=alias)
    assert config.optim == ours and config == Config(optim=ours)  # saved and compared on resume as ours
    params = [torch.nn.Parameter(torch.ones(300))]
    built, expected = (build_optimizer(params, Config(optim=name).optim, 1e-3, (0.9, 0.99), 0.0)
                       for name in (alias, ours))
    # one implementation each (the 8-bit one is a class made per call, on bitsandbytes' AdamW8bit)
    assert (type(built).__name__, type(built).__bases__) == (type(expected).__name__, type(expected).__bases__)
    arch = KNOWN["Qwen/Qwen2.5-0.5B-Instruct"]  # tensors big enough for 8-bit states (small ones keep float32)
    for device in ("cpu", "cuda"):
        assert estimate(arch, config, device).parts == estimate(arch, Config(optim=ours), device).parts
    other = Config(optim="adamw" if ours != "adamw" else "adamw_8bit")
    assert estimate(arch, config).parts != estimate(arch, other).parts


def test_other_optimizer_names_are_refused():
    with pytest.raises(ConfigError, match="optim must be one of adamw_8bit, adamw \\(or transformers' adamw_torch, "
                                          "adamw_torch_fused, adamw_bnb_8bit\\), got 'adafactor'"):
        Config(optim="adafactor")
