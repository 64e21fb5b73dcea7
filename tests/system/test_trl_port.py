"""Issue 13's "done when": a TRL 1.16 user's GRPOConfig settings, ported verbatim. The dict a TRL script passes
to `GRPOConfig(...)` goes to `Config(**settings)` (less the TRL-only keys, which are refused, not ignored) with
every value in TRL's meaning, and trains a tiny model through `Trainer` with TRL's own reward helpers."""
import json
import math

import pytest
from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_tokenizer

from grpo import Config, Trainer
from grpo.errors import ConfigError
from grpo.settings.trl_names import TRL_ONLY

# As a TRL 1.16 user writes it: a Dr. GRPO run with DAPO's clip-higher and overlong masking. TRL 1.16 has no
# max_prompt_length (ours keeps its default). output_dir is replaced by a scratch folder in the tests.
TRL_SETTINGS = dict(  # noqa: C408 -- keywords, as GRPOConfig(...) is written
    output_dir="Qwen2.5-0.5B-GRPO", learning_rate=1e-5, lr_scheduler_type="cosine", max_grad_norm=1.0,
    optim="adamw_8bit", per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
    max_completion_length=8, temperature=0.9, loss_type="dr_grpo", scale_rewards=False, beta=0.04,
    epsilon_high=0.28, mask_truncated_completions=True, max_steps=2, logging_steps=1, seed=42, bf16=False,
    gradient_checkpointing=True, disable_dropout=True, report_to="none", use_vllm=False, remove_unused_columns=False,
    logging_strategy="steps",
)
# TRL settings this trainer lacks (grpo/trl_settings.py): Config refuses them, so a port drops them.
DROPPED = {"use_vllm", "remove_unused_columns", "logging_strategy"}


def ported(output_dir: str | None = None) -> dict:
    settings = {k: v for k, v in TRL_SETTINGS.items() if k not in TRL_ONLY}
    return {**settings, "output_dir": output_dir} if output_dir else settings


def test_only_trl_only_keys_are_dropped_and_they_are_refused():
    assert set(TRL_SETTINGS) & TRL_ONLY == DROPPED
    with pytest.raises(ConfigError, match="TRL's `use_vllm` is not supported here"):
        Config(**TRL_SETTINGS)


def test_config_keeps_every_value_with_trls_meaning():
    config = Config(**ported())
    assert all(getattr(config, k) == v for k, v in ported().items() if k != "scale_rewards")
    assert config.scale_rewards == "none", "TRL's scale_rewards=False: no std scaling (Dr. GRPO)"
    settings = config.loss_settings()
    assert (settings["epsilon_low"], settings["epsilon_high"], settings["loss_type"]) == (0.2, 0.28, "dr_grpo")


def test_trl_resolves_the_same_values():
    trl = pytest.importorskip("trl", reason="trl (a test peer) is not installed")
    args, config = trl.GRPOConfig(**TRL_SETTINGS, use_cpu=True), Config(**ported())
    # TRL normalizes report_to="none" into a list; everything else it holds as we do.
    same = {k for k in ported() if k != "report_to"}
    assert {k: getattr(config, k) for k in same} == {k: getattr(args, k) for k in same}
    assert (args.epsilon, args.epsilon_high) == (config.epsilon, config.epsilon_high)


def test_a_ported_config_trains_with_trls_reward_helpers(tmp_path):
    trl_rewards = pytest.importorskip("trl.rewards", reason="trl (a test peer) is not installed")
    trl = pytest.importorskip("trl")
    rewards = [trl_rewards.get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4),
               trl_rewards.get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0), digit_share]
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    # Half the vocabulary ends a completion: most completions end within 8 tokens and so stay in the loss.
    model.generation_config.eos_token_id = list(range(4, len(tokenizer), 2))
    trainer = Trainer(Config(**ported(str(tmp_path / "run"))), model=model, tokenizer=tokenizer,
                      reward_funcs=rewards, train_dataset=digit_prompts(8))
    args = trl.GRPOConfig(**TRL_SETTINGS, use_cpu=True)
    # The generation batch TRL resolves: steps_per_generation micro-batches, generation_batch_size completions.
    assert trainer.schedule.micro_batches_per_generation == args.steps_per_generation == 2
    assert trainer.schedule.prompts_per_generation * args.num_generations == args.generation_batch_size == 16
    before = [p.detach().clone() for p in model.parameters()]
    history = trainer.train()
    assert trainer.step == 2 and [line["step"] for line in history] == [1, 2]
    lines = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines == history
    for line in lines:  # TRL's reward helpers are named as in TRL's logs
        assert {"loss", "kl", "grad_norm", "reward/soft_overlong_punishment_reward",
                "reward/repetition_penalty_reward", "reward/digit_share"} <= line.keys()
        assert all(math.isfinite(v) for v in line.values())
    assert max((a - b).abs().max().item() for a, b in zip(before, model.parameters())) > 0
