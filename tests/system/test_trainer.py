"""The Trainer trains a tiny offline model for real, through the API."""
import json
import math

import pytest
import torch
from datasets import Dataset
from tiny_setup import digit_prompts, digit_share, logged, tiny_model, tiny_tokenizer
from tolerances import adamw_rounding, max_abs_diff

from grpo import Config, Trainer
from grpo.errors import ConfigError
from grpo.policy.models import completion_logprobs

REQUIRED_KEYS = {
    "step", "epoch", "loss/policy", "kl", "reward", "reward_std", "rewards/digit_share/mean", "clip_ratio/low_mean",
    "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy", "frac_reward_zero_std", "completions/mean_length",
    "completions/min_length", "completions/max_length", "completions/clipped_ratio", "learning_rate", "grad_norm",
    "completions/mean_terminated_length", "completions/min_terminated_length", "completions/max_terminated_length",
    "step_time", "perf/tokens_per_s", "memory/peak_gb",
}


def make_config(tmp_path, **overrides) -> Config:
    settings = dict(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=8,
                    gradient_accumulation_steps=2, num_generations=4, max_prompt_length=16,
                    max_completion_length=8, learning_rate=1e-2, optim="adamw", beta=0.04, seed=0)
    settings.update(overrides)
    return Config(**settings)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def logprobs_of(model, tokenizer, text="Write 3 digits: 012"):
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        return completion_logprobs(model.eval(), ids, torch.ones_like(ids), 2, temperature=1.0, chunk_size=4)


def test_full_finetune_trains_logs_and_checkpoints(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    trainer = Trainer(make_config(tmp_path), model=tiny_model(tokenizer), tokenizer=tokenizer,
                      reward_funcs=[digit_share], train_dataset=digit_prompts())
    before = snapshot(trainer.model)
    trainer.train()
    history = logged(trainer)

    assert trainer.step == 2 and len(history) == 2
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before), "every trainable parameter should move under lr=1e-2"
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert REQUIRED_KEYS <= line.keys(), REQUIRED_KEYS - line.keys()
        assert math.isfinite(line["loss"]) and math.isfinite(line["grad_norm"])
    rows = [json.loads(r) for r in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2 * 4  # steps x micro-batches x prompts x generations
    assert {"prompt", "completion", "reward", "advantage", "reward/digit_share"} <= rows[0].keys()

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-2")
    # the same float32 weights and kernels: float32's defaults (rtol 1.3e-6) for any reordering (measured: equal)
    torch.testing.assert_close(logprobs_of(reloaded, tokenizer), logprobs_of(trainer.model, tokenizer))


def test_lora_8bit_adamw_gradient_checkpointing(tmp_path, tokenizer):
    from peft import PeftModel

    config = make_config(tmp_path, use_lora=True, lora_r=4, lora_alpha=8, optim="adamw_8bit",
                         gradient_checkpointing=True)
    trainer = Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[digit_share],
                      train_dataset=digit_prompts())
    import bitsandbytes as bnb

    assert isinstance(trainer.optimizer, bnb.optim.AdamW8bit)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    before = snapshot(trainer.model)
    assert before and all("lora_" in n for n in before)
    trainer.train()

    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if n in before)
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen)
    assert trainer.policy.reference is None, "LoRA's reference is the adapter-disabled policy, not a copy"
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").exists()
    reloaded = PeftModel.from_pretrained(tiny_model(tokenizer), checkpoint)  # compared as in the test above
    torch.testing.assert_close(logprobs_of(reloaded, tokenizer), logprobs_of(trainer.model, tokenizer))


@pytest.mark.parametrize("beta, expected_forwards", [(0.0, 0), (0.04, 2 * 2)])
def test_reference_forward_only_when_beta_positive(tmp_path, tokenizer, beta, expected_forwards):
    trainer = Trainer(make_config(tmp_path, beta=beta), model=tiny_model(tokenizer), tokenizer=tokenizer,
                      reward_funcs=[digit_share], train_dataset=digit_prompts())
    reference_forwards = []
    reference_logprobs = trainer.policy.reference_logprobs
    trainer.policy.reference_logprobs = lambda rollout: reference_forwards.append(1) or reference_logprobs(rollout)
    trainer.train()
    history = logged(trainer)
    assert len(reference_forwards) == expected_forwards  # steps x micro-batches
    assert (trainer.policy.reference is None) == (beta == 0)
    if beta == 0:
        assert all(line["kl"] == 0.0 for line in history)


def test_trl_style_reward_with_chat_prompts_and_answer_column(tmp_path, tokenizer):
    seen = {}

    def trl_reward(prompts, completions, answer, **kwargs):
        # Written for TRL: chat prompts in, completions as [{"role": "assistant", "content": ...}] lists.
        seen["completion"], seen["answer"], seen["kwargs"] = completions[0], answer[0], set(kwargs)
        return [1.0 if c[0]["content"].strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]

    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Say {d}"}], "answer": str(d),
                               "source": "test"} for d in range(8)])
    trainer = Trainer(make_config(tmp_path, max_steps=1), model=tiny_model(tokenizer), tokenizer=tokenizer,
                      reward_funcs=[trl_reward], train_dataset=data)
    trainer.train()
    assert isinstance(seen["completion"], list) and seen["completion"][0]["role"] == "assistant"
    assert seen["answer"] in {str(d) for d in range(8)}
    assert "source" in seen["kwargs"]


def test_num_iterations_reuses_one_generation_batch(tmp_path, tokenizer):
    # seed 1: a draw whose completions hold digits in some groups and not others (a reward signal to train on)
    trainer = Trainer(make_config(tmp_path, max_steps=2, num_iterations=2, beta=0.0, seed=1),
                      model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[digit_share],
                      train_dataset=digit_prompts())
    trainer.train()
    history = logged(trainer)
    assert trainer.prompts.position == 4, "two optimizer steps on one generation batch of 2 x 2 prompts"
    assert history[0]["ratio/mean"] == pytest.approx(1.0)
    assert history[1]["ratio/mean"] != pytest.approx(1.0, abs=1e-9), "second pass sees an updated policy"


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("use_lora", [False, True])
def test_shared_prompt_forward_trains_as_whole_rows(tmp_path, tokenizer, use_lora, packed, monkeypatch):
    """Old-policy, reference and policy log-probs with each prompt forwarded once (completions as padded rows, or
    as one packed row): the same steps as whole rows (same sampled completions, then the same losses and weights),
    under checkpointing and num_iterations = 2. Dropout is off: with it, the copies of a prompt would share one
    dropout mask."""
    monkeypatch.setattr("grpo.policy.packing.packing_pays", lambda *args: packed)
    runs = []
    for shared in (True, False):
        config = make_config(tmp_path / str(shared), max_steps=2, num_iterations=2, use_lora=use_lora, lora_r=4,
                             gradient_checkpointing=True, entropy_coef=0.01, disable_dropout=True,
                             shared_prompt_forward=shared)
        trainer = Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[digit_share],
                          train_dataset=digit_prompts())
        assert trainer.policy.shared_prompt == shared
        trainer.train()
        runs.append((logged(trainer), snapshot(trainer.model)))
    (shared_history, shared_weights), (whole_history, whole_weights) = runs
    # 2 AdamW steps of the same gradients summed in another order: steps * lr / 100 = 2e-4 (tolerances.py;
    # measured 7e-8 .. 4e-6 on 5 CPU variants). A row of the step's 16 that lost its gradient on the shared path
    # moves typical elements by ~lr / 16 = 6e-4 and the worst by ~lr (tried: one row's gradient dropped, 3e-2;
    # scaled by 1.1, 2.9e-2).
    worst = max_abs_diff(shared_weights, whole_weights)
    assert worst < adamw_rounding(2, 1e-2), worst
    for a, b in zip(shared_history, whole_history):
        for key in ("loss", "kl", "entropy", "grad_norm"):
            # means (and a norm) of float32 values over ~200 tokens: rounding <= n * u = 1.2e-5 of them, and
            # step 2's weights differ by rounding too (measured: <= 0.6% of this bound; the row dropped above
            # moved grad_norm by 3.4%, 340x it)
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_entropy_bonus_off_policy_mask_and_no_dropout(tmp_path, tokenizer):
    config = make_config(tmp_path, max_steps=2, num_iterations=2, beta=0.0, entropy_coef=0.01,
                         off_policy_mask_threshold=0.1, disable_dropout=True, use_lora=True, lora_r=4, lora_alpha=8,
                         lora_dropout=0.1, optim="adamw_torch_fused")
    trainer = Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[digit_share],
                      train_dataset=digit_prompts())
    lora_dropouts = [m for n, m in trainer.model.named_modules()
                     if "lora_dropout" in n and isinstance(m, torch.nn.Dropout)]
    assert lora_dropouts and all(m.p == 0 for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout))
    assert trainer.config.optim == "adamw" and isinstance(trainer.optimizer, torch.optim.AdamW)
    trainer.train()
    first, second = logged(trainer)
    for line in (first, second):
        assert all(math.isfinite(v) for v in line.values() if isinstance(v, float))
        # beta 0: the loss is the policy term plus the bonus, -0.01 x the micro-batches' mean entropy (float32
        # sums of 2 micro-batches' values ~1: a few ulps, 2**-24 = 6e-8 each; measured: equal)
        assert line["loss"] == pytest.approx(line["loss/policy"] + line["loss/entropy"], abs=1e-6)
        assert -line["loss/entropy"] / 0.01 == pytest.approx(line["entropy"], rel=0.25)
        assert 0 <= line["off_policy/masked_ratio"] <= 1
    # The first pass is on-policy (no dropout: the old log-probs are the loss's own): nothing to drop, and ratios
    # exp(logp - old) of the same float32 log-probs, exactly 1 (abs 1e-6 = 17 ulps of 1)
    assert first["ratio/mean"] == pytest.approx(1.0, abs=1e-6) and first["off_policy/masked_ratio"] == 0.0
    assert second["ratio/mean"] != pytest.approx(1.0, abs=1e-9), "the second pass sees an updated policy"


def test_trl_loss_settings_and_unscored_completions(tmp_path, tokenizer):
    # A TRL GRPOConfig's settings, verbatim; a reward that gives up (None) on every completion of odd length,
    # with no other reward function: those completions must get advantage 0.
    def picky(completions, **kwargs):
        return [None if len(c) % 2 else sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]

    trl_settings = dict(per_device_train_batch_size=8, num_generations=4, loss_type="dr_grpo", epsilon_high=0.28,
                        mask_truncated_completions=True, importance_sampling_level="sequence",
                        top_entropy_quantile=0.5, delta=2.0, beta=0.04, max_completion_length=4)
    config = Config(**{**trl_settings, "output_dir": str(tmp_path / "run"), "max_steps": 2,
                              "max_prompt_length": 16, "learning_rate": 1e-2, "optim": "adamw", "seed": 0})
    trainer = Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[picky],
                      train_dataset=digit_prompts())
    trainer.train()
    history = logged(trainer)
    for line in history:
        assert REQUIRED_KEYS - {"rewards/digit_share/mean"} <= line.keys()
        assert all(math.isfinite(v) for v in line.values())
        assert line["completions/max_length"] <= 4 and 0 <= line["frac_reward_zero_std"] <= 1
    rows = [json.loads(r) for r in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    unscored = [r for r in rows if r["reward/picky"] is None]
    assert unscored and all(r["advantage"] == 0.0 for r in unscored)
    # max_completion_length 4 truncates most completions; masked, they leave the loss and with it the micro-batches
    # (no token in the loss: no forward), though not its counts
    assert all(line["completions/clipped_ratio"] > 0 for line in history)
    assert all(line["skipped/zero_gradient"] >= line["completions/clipped_ratio"] for line in history)
    for b in trainer.generation.micro_batches:
        assert not b.rollout.truncated.any() and b.rows == 8 and len(b.rollout.completions) == 8 - b.skipped


@pytest.mark.parametrize("model_given", [False, True])
def test_a_schedule_error_comes_before_any_model_loads(tmp_path, tokenizer, model_given):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the model was prepared for training before the schedule was checked")

    # A model to load that is not there: loading it first would be another error than the schedule's.
    config = make_config(tmp_path, model=str(tmp_path / "no-model-here"))
    config.steps_per_generation = 3  # changed after the Config checked it: the Trainer checks it again
    model = tiny_model(tokenizer) if model_given else None
    if model is not None:
        model.train = must_not_run  # preparing a model for training ends in train mode
    with pytest.raises(ConfigError, match="steps_per_generation=3 must be a multiple of gradient_accumulation_steps=2"):
        Trainer(config, model=model, tokenizer=tokenizer, reward_funcs=[digit_share], train_dataset=digit_prompts())
    assert not (tmp_path / "run").exists()
