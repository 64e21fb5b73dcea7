"""Rows whose gradient is exactly 0 (advantage 0 without a KL term) get no forward or backward: the Trainer's
gradients and updates are those of training every row, for every loss type, and the metrics say how many."""
import dataclasses
import json

import pytest
import torch
from distributed_worker import FixedSampler
from tiny_setup import digit_prompts, logged, odd_digit_share, tiny_model, tiny_tokenizer
from tolerances import adamw_rounding, f32_sum

from grpo import Config, Trainer
from grpo.algo import LOSS_TYPES


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def make_trainer(tmp_path, tokenizer, name, reward=odd_digit_share, **overrides) -> Trainer:
    """Completions that depend on the prompt text alone (FixedSampler): runs with and without skipping see the
    same ones."""
    config = Config(**{"output_dir": str(tmp_path / name), "max_steps": 2, "per_device_train_batch_size": 8,
                       "gradient_accumulation_steps": 2, "num_generations": 4, "max_prompt_length": 16,
                       "max_completion_length": 8, "learning_rate": 1e-2, "optim": "adamw", "beta": 0.0, "seed": 0,
                       "save_steps": 10**6, **overrides})
    model = tiny_model(tokenizer)
    return Trainer(config, model=model, tokenizer=tokenizer, reward_funcs=[reward], train_dataset=digit_prompts(8),
                   sampler=FixedSampler(model, tokenizer, config))


def step_gradients(trainer: Trainer) -> tuple[dict, dict]:
    totals = trainer.accumulate(trainer.batches.take(trainer.step).micro_batches)
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}, totals


def no_skipping(trainer: Trainer) -> Trainer:
    """`trainer` training every row with a completion token, zero-advantage rows included."""
    trainer.pipeline.cut = dataclasses.replace(trainer.pipeline.cut, skip_zero_advantage=False)
    return trainer


def count_forwards(trainer: Trainer) -> list:
    """The rollouts the training forward sees, as they come."""
    seen, logprobs = [], trainer.policy.logprobs
    trainer.policy.logprobs = lambda rollout, **kwargs: seen.append(rollout) or logprobs(rollout, **kwargs)
    return seen


@pytest.mark.parametrize("settings", [*({"loss_type": t} for t in LOSS_TYPES),
                                      {"loss_type": "grpo", "importance_sampling_level": "sequence"},
                                      {"loss_type": "dapo", "delta": 1.5, "scale_rewards": "none"}])
def test_skipping_zero_advantage_rows_leaves_the_gradient_unchanged(tmp_path, tokenizer, settings):
    skipped = make_trainer(tmp_path, tokenizer, "skipped", **settings)
    forwards = count_forwards(skipped)
    grads, totals = step_gradients(skipped)
    full_grads, full_totals = step_gradients(no_skipping(make_trainer(tmp_path, tokenizer, "full", **settings)))

    advantages = skipped.generation.batch.advantages  # [N]
    assert 0 < (advantages == 0).sum() < len(advantages), "some groups must have equal rewards, not all"
    assert totals["skipped/zero_gradient"] == pytest.approx((advantages == 0).float().mean().item())
    assert full_totals["skipped/zero_gradient"] == 0.0
    assert sum(len(r.completions) for r in forwards) == (advantages != 0).sum(), "forwards of trained rows only"
    assert grads.keys() == full_grads.keys() and grads
    # The same nonzero terms (a skipped row's are exact zeros), but fewer rows may block a matmul otherwise:
    # f32_sum(800) = 4.8e-5 of each gradient's largest entry (tolerances.py), for the ~800 terms along a
    # gradient's path (192 tokens, V = 200, 2 layers of 128 + 32 + 24 keys + 32); measured: equal on 5 CPU
    # variants. A trained row left out changes the gradients by ~1/16 of their size.
    rtol = f32_sum(800)
    for name, g in grads.items():
        full = full_grads[name]
        torch.testing.assert_close(g, full, rtol=rtol, atol=rtol * full.abs().max().item(), msg=name)
    # The loss: float32 sums of <= 16 x 8 = 128 terms of size <= 2 max |A| (on-policy, w = 1; sapo's 4 sigmoid(0)),
    # so f32_sum(128) of that (grpo's cancels to rounding, -1.5e-8 here); a row left out moves it by ~max |A| / 16.
    loss_abs = f32_sum(128) * 2 * advantages.abs().max().item()
    assert totals["loss"] == pytest.approx(full_totals["loss"], rel=1e-5, abs=loss_abs)
    assert totals["loss/policy"] == pytest.approx(full_totals["loss/policy"], rel=1e-5, abs=loss_abs)


def test_off_policy_steps_skip_the_old_logprobs_too_and_train_alike(tmp_path, tokenizer):
    # num_iterations=2: the old log-probs, computed once per generation batch, are computed for trained rows only;
    # two optimizer steps (the second off-policy) end at the weights of training every row.
    skipped = make_trainer(tmp_path, tokenizer, "skipped", num_iterations=2, loss_type="grpo")
    skipped.train()
    batches = skipped.generation.micro_batches
    assert any(b.empty for b in batches) and any(0 < len(b.rollout.advantages) < b.rows for b in batches)
    assert all(b.rollout.old_logprobs.shape[0] == len(b.rollout.advantages) for b in batches if not b.empty)
    full = no_skipping(make_trainer(tmp_path, tokenizer, "full", num_iterations=2, loss_type="grpo"))
    full.train()
    worst = max((a - b).abs().max().item() for a, b in zip(skipped.model.parameters(), full.model.parameters()))
    # 2 AdamW steps of the same gradients (skipped rows add exact zeros; fewer rows may sum in another order):
    # steps * lr / 100 = 2e-4 (tolerances.py; measured exactly 0 on 5 CPU variants). Old log-probs of the
    # wrong rows, or a trained row left out, would move elements by ~lr.
    assert worst < adamw_rounding(2, 1e-2), worst
    lines = [json.loads(line) for line in (tmp_path / "skipped" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < line["skipped/zero_gradient"] < 1 for line in lines)
    assert lines[1]["ratio/mean"] != pytest.approx(1.0, abs=1e-9), "the second step is off-policy"


def test_a_step_where_every_advantage_is_zero_runs_no_forward(tmp_path, tokenizer, monkeypatch):
    trainer = make_trainer(tmp_path, tokenizer, "flat", reward=lambda completions, **_: [1.0] * len(completions),
                           max_steps=1)
    monkeypatch.setattr(trainer.policy, "logprobs", lambda *a, **kw: pytest.fail("no row needs a forward"))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    (line,) = logged(trainer)
    assert line["skipped/zero_gradient"] == 1.0 and line["loss"] == 0.0 and line["grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # AdamW's first step on 0


def test_the_entropy_bonus_trains_zero_advantage_rows(tmp_path, tokenizer):
    # entropy_coef != 0: every row's tokens feed the bonus, so none is skipped even when every advantage is 0,
    # and the weights move on the bonus alone; with the off-policy mask on, its metric is logged too.
    trainer = make_trainer(tmp_path, tokenizer, "bonus", reward=lambda completions, **_: [1.0] * len(completions),
                           max_steps=1, entropy_coef=0.01, off_policy_mask_threshold=0.1)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    (line,) = logged(trainer)
    assert line["skipped/zero_gradient"] == 0.0 and line["grad_norm"] > 0 and line["loss/entropy"] < 0
    assert line["off_policy/masked_ratio"] == 0.0  # on-policy: nothing to mask
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_a_step_with_no_row_trained_logs_the_off_policy_metric_as_zero(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, "flat_opsm", reward=lambda completions, **_: [1.0] * len(completions),
                           max_steps=1, off_policy_mask_threshold=0.1)
    trainer.train()
    (line,) = logged(trainer)
    assert line["skipped/zero_gradient"] == 1.0 and line["off_policy/masked_ratio"] == 0.0
