"""What a TRL 1.16 script hands GRPOTrainer besides its settings, ported by changing its import lines: a tokenizer
without a pad token (padded with EOS, as TRL does), `peft_config=LoraConfig(...)` (our LoRA settings read from
it, what we lack refused in one line), a PeftModel as `model=` (its own adapter trained), and chat prompts with
a tokenizer that has no chat template (one line, when the Trainer is made)."""
import re

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from tiny_setup import digit_prompts, digit_share, text_length, tiny_model, tiny_tokenizer

from grpo import Config as GRPOConfig
from grpo import Trainer as GRPOTrainer
from grpo.errors import ConfigError

LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def args(tmp_path, **settings) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=4, learning_rate=1e-2, optim="adamw",
                      report_to="none", **settings)


def adapted(model) -> set[str]:
    """The names (last part) of the modules that carry a LoRA adapter."""
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}


def trained(trainer) -> dict[str, bool]:
    """Parameter name -> whether one step changed it."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return {n: not torch.equal(before[n], p) for n, p in trainer.model.named_parameters()}


def test_a_tokenizer_without_a_pad_token_pads_with_eos(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    tokenizer.pad_token = None
    trainer = GRPOTrainer(model=model, reward_funcs=digit_share, args=args(tmp_path), train_dataset=digit_prompts(),
                          processing_class=tokenizer)
    trainer.train()
    assert trainer.state.global_step == 1
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>", "TRL's choice, on the tokenizer itself"


def test_peft_config_sets_our_lora_settings(tmp_path):
    tokenizer = tiny_tokenizer()
    peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", bias="none",
                             task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=tiny_model(tokenizer), reward_funcs=text_length, args=args(tmp_path),
                          train_dataset=digit_prompts(), processing_class=tokenizer, peft_config=peft_config)
    config = trainer.args
    assert (config.use_lora, config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_target_modules) == (
        True, 4, 8, 0.0, "all-linear")
    assert adapted(trainer.model) == LINEARS, "peft's all-linear: every linear layer but the output head"
    changed = trained(trainer)
    assert any(changed[n] for n in changed if "lora_" in n) and not any(changed[n] for n in changed if "lora_" not in n)


@pytest.mark.parametrize("peft_config, message", [
    (LoraConfig(r=4, target_modules="all-linear", use_dora=True, modules_to_save=["lm_head"], bias="all"),
     "peft_config sets bias='all', modules_to_save=['lm_head'], use_dora=True, which this trainer does not "
     "implement (bias: biases trained beside LoRA would stay on when the adapter is switched off for the "
     "reference; modules_to_save: only the adapters train here (no fully trained module copies); use_dora: DoRA "
     "is not implemented here): it trains plain LoRA from r, lora_alpha, lora_dropout and target_modules"),
    (LoraConfig(r=4, target_modules=r".*\.q_proj"), "lora_target_modules must be module names"),
    ({"r": 4}, "peft_config must be a peft LoraConfig (this trainer trains LoRA adapters), got dict"),
])
def test_what_peft_config_asks_for_that_we_lack_is_one_line(tmp_path, peft_config, message):
    tokenizer = tiny_tokenizer()
    with pytest.raises(ConfigError) as error:
        GRPOTrainer(model=tiny_model(tokenizer), reward_funcs=digit_share, args=args(tmp_path),
                    train_dataset=digit_prompts(), processing_class=tokenizer, peft_config=peft_config)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("use_lora", [False, True])
def test_a_peft_model_trains_its_own_adapter(tmp_path, use_lora):
    tokenizer = tiny_tokenizer()
    model = get_peft_model(tiny_model(tokenizer), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    trainer = GRPOTrainer(model=model, reward_funcs=text_length, train_dataset=digit_prompts(),
                          args=args(tmp_path, use_lora=use_lora, beta=0.04), processing_class=tokenizer)
    assert trainer.model is model and adapted(model) == {"q_proj", "v_proj"}, "not wrapped again"
    config = trainer.args
    assert (config.use_lora, config.lora_r, config.lora_alpha, config.lora_target_modules) == (
        True, 2, 4, ["q_proj", "v_proj"])
    assert trainer.policy.reference is None, "the reference is the policy with its adapter off, no copy"
    changed = trained(trainer)
    assert any(changed[n] for n in changed if "lora_" in n) and not any(changed[n] for n in changed if "lora_" not in n)
    with pytest.raises(ConfigError, match=re.escape("a PeftModel passed together with peft_config (as in TRL, "
                                                    "refused)")):
        GRPOTrainer(model=model, reward_funcs=digit_share, train_dataset=digit_prompts(), args=args(tmp_path),
                    processing_class=tokenizer, peft_config=LoraConfig(r=2, target_modules="all-linear"))


def test_chat_prompts_with_a_tokenizer_without_a_chat_template_are_one_line_when_the_trainer_is_made(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    tokenizer.chat_template = None
    chats = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Write {k} digits"}]} for k in range(8)])
    with pytest.raises(ConfigError) as error:
        GRPOTrainer(model=model, reward_funcs=digit_share, args=args(tmp_path), train_dataset=chats,
                    processing_class=tokenizer)
    assert str(error.value) == ("train_dataset holds chat prompts (lists of messages), but the tokenizer has no "
                                "chat template to render them: pass an instruct model's tokenizer, set "
                                "tokenizer.chat_template, or give the prompts as text")
