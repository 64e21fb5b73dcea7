"""Rows whose gradient is exactly 0 need no forward or backward: per loss type, leaving them out of the loss
call (with the micro-batch's counts from before) gives the same loss and gradient; the micro-batch cut keeps
what the divisors need; a step with nothing back-propagated still steps the optimizer as a zero gradient does."""
import dataclasses

import pytest
import torch

from grpo.algo import LOSS_TYPES
from grpo.algo.loss import policy_loss, zero_advantage_has_no_gradient
from grpo.policy.optim import Updates
from grpo.rollout.batches import Cut, Generation, MicroBatch, Rollout, StepCounts
from grpo.settings.components import OptimSettings

SETTINGS = [{}, {"importance_sampling_level": "sequence"}, {"delta": 1.3}, {"epsilon_high": 0.28}]


def inputs(seed: int, B: int = 6, T: int = 7):
    """Off-policy float64 inputs (ratios around [0.6, 1.6]); rows 1, 3 and 4 have advantage exactly 0."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3  # [B, T]
    old = logp + torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.5  # [B, T]
    ref = logp + (torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.5) * 0.6  # [B, T]
    adv = torch.randn(B, generator=gen, dtype=torch.float64)  # [B]
    adv[[1, 3, 4]] = 0.0
    mask = (torch.rand(B, T, generator=gen) < 0.7).long()  # [B, T]
    mask[:, 0] = 1
    entropies = torch.rand(B, T, generator=gen, dtype=torch.float64) * 4  # [B, T]
    return logp, old, ref, adv, mask, entropies


def loss_and_grad(logp, old, ref, adv, mask, entropies, **kwargs):
    logp = logp.clone().requires_grad_()
    loss, metrics = policy_loss(logp, old, ref, adv, mask, entropies=entropies, max_completion_length=9,
                                num_micro_batches=3, num_tokens=50.0, **kwargs)
    loss.backward()
    return loss.item(), logp.grad, metrics


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("extra", SETTINGS)
def test_leaving_zero_advantage_rows_out_keeps_loss_and_gradient(loss_type, extra):
    logp, old, ref, adv, mask, entropies = inputs(seed=len(loss_type))
    assert zero_advantage_has_no_gradient(beta=0.0, top_entropy_quantile=1.0)
    settings = {"loss_type": loss_type, "beta": 0.0, **extra}
    loss, grad, metrics = loss_and_grad(logp, old, ref, adv, mask, entropies, **settings)
    assert (grad[[1, 3, 4]] == 0).all(), "a zero-advantage row's gradient must be exactly 0"
    kept = adv != 0  # [B]
    cut = [t[kept] for t in (logp, old, ref, adv, mask, entropies)]
    loss_cut, grad_cut, metrics_cut = loss_and_grad(*cut, **settings, num_sequences=len(adv),
                                                    micro_batch_tokens=float(mask.sum()))
    # float64, the same terms without the zero rows' (exact 0) ones: a few ulps (2**-53) of sums of <= 42 terms
    assert loss_cut == pytest.approx(loss, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad_cut, grad[kept], rtol=1e-12, atol=1e-15)
    assert metrics_cut["loss/policy"] == pytest.approx(metrics["loss/policy"], rel=1e-12, abs=1e-15)
    if loss_type in ("grpo", "bnpo", "dr_grpo", "luspo", "sapo"):  # the counts matter: without them it differs
        loss_wrong, _, _ = loss_and_grad(*cut, **settings)
        assert loss_wrong != pytest.approx(loss, rel=1e-6)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_the_kl_term_and_the_entropy_mask_make_zero_advantage_rows_count(loss_type):
    # What zero_advantage_has_no_gradient rules out: a KL term pulls every row (its gradient is not 0), and the
    # high-entropy mask's quantile over every row's tokens moves when rows leave, changing the kept rows' gradient.
    logp, old, ref, adv, mask, entropies = inputs(seed=7)
    kept = adv != 0
    assert not zero_advantage_has_no_gradient(beta=0.04, top_entropy_quantile=1.0)
    _, grad, _ = loss_and_grad(logp, old, ref, adv, mask, entropies, loss_type=loss_type, beta=0.04)
    assert (grad[[1, 3, 4]].abs() > 0).any()
    assert not zero_advantage_has_no_gradient(beta=0.0, top_entropy_quantile=0.5)
    assert not zero_advantage_has_no_gradient(beta=0.0, top_entropy_quantile=1.0, entropy_coef=0.01)
    settings = {"loss_type": loss_type, "beta": 0.0, "top_entropy_quantile": 0.5}
    _, grad, _ = loss_and_grad(logp, old, ref, adv, mask, entropies, **settings)
    cut = [t[kept] for t in (logp, old, ref, adv, mask, entropies)]
    _, grad_cut, _ = loss_and_grad(*cut, **settings, num_sequences=len(adv), micro_batch_tokens=float(mask.sum()))
    assert not torch.allclose(grad_cut, grad[kept])


def rollout(prompt_lengths: list[int], completion_lengths: list[int], truncated=None) -> Rollout:
    """Left-padded prompts and right-padded completions of the given lengths; ids count up from 10."""
    N, P, C = len(prompt_lengths), max(prompt_lengths), max(completion_lengths)
    prompt_mask = torch.tensor([[0] * (P - n) + [1] * n for n in prompt_lengths])  # [N, P]
    completion_mask = torch.tensor([[1] * n + [0] * (C - n) for n in completion_lengths])  # [N, C]
    ids = torch.arange(10, 10 + N * (P + C)).view(N, P + C)  # [N, P+C]
    return Rollout(ids[:, :P] * prompt_mask, prompt_mask, ids[:, P:] * completion_mask, completion_mask,
                   [f"c{i}" for i in range(N)], torch.zeros(N, dtype=torch.bool) if truncated is None else truncated)


def trained_rows(rollout: Rollout, advantages: torch.Tensor, skip_zero_advantage: bool, keep_one: bool) -> MicroBatch:
    """`rollout` cut as one micro-batch."""
    cut = Cut(len(advantages), skip_zero_advantage, keep_one)
    (micro_batch,) = dataclasses.replace(rollout, advantages=advantages).micro_batches(cut)
    return micro_batch


def test_trained_rows_drop_zero_gradient_rows_and_keep_the_counts():
    # Row 0: long prompt, advantage 0; row 1: no completion token in the loss (masked truncation); row 2: long
    # completion, advantage 0; rows 3 and 4 train.
    r = rollout([5, 3, 2, 3, 2], [2, 0, 6, 3, 1])
    b = trained_rows(r, torch.tensor([0.0, 1.0, 0.0, -0.5, 0.5]), skip_zero_advantage=True, keep_one=False)
    assert (b.rows, b.tokens, b.trained_tokens, b.skipped) == (5, 12, 4, 3)
    assert b.rollout.completions == ["c3", "c4"] and b.rollout.advantages.tolist() == [-0.5, 0.5]
    # Only the padding the kept rows need: 3 prompt columns (of 5), 3 completion columns (of 6).
    assert b.rollout.prompt_ids.tolist() == r.prompt_ids[3:, 2:].tolist()
    assert b.rollout.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    # Without skipping zero advantages (a KL term), only the row without tokens goes.
    b = trained_rows(r, torch.tensor([0.0, 1.0, 0.0, -0.5, 0.5]), skip_zero_advantage=False, keep_one=False)
    assert b.rollout.completions == ["c0", "c2", "c3", "c4"] and (b.rows, b.tokens, b.skipped) == (5, 12, 1)
    whole = trained_rows(r, torch.ones(5), False, False)
    assert trained_rows(rollout([2], [3]), torch.ones(1), True, False).rows == 1
    assert whole.rows == 5 and whole.tokens == 12


def test_a_routers_loss_keeps_every_row():
    # A mixture-of-experts router's load-balancing loss is over every row's tokens: neither the row without a
    # token in the loss (row 1) nor those of advantage 0 (rows 0 and 2) may go.
    r = dataclasses.replace(rollout([5, 3, 2, 3, 2], [2, 0, 6, 3, 1]), advantages=torch.tensor([0.0, 1, 0, -0.5, 0.5]))
    (b,) = r.micro_batches(Cut(5, skip_zero_advantage=False, keep_one=False, every_row=True))
    assert b.rollout.completions == ["c0", "c1", "c2", "c3", "c4"] and (b.rows, b.tokens) == (5, 12)
    assert b.skipped == 1, "as a row kept only to run the forward: no token of its own in the loss"


def test_a_micro_batch_with_no_row_left_is_empty_or_keeps_one_inert_row():
    r = rollout([4, 2, 3], [2, 5, 1])
    alone = trained_rows(r, torch.zeros(3), skip_zero_advantage=True, keep_one=False)
    assert alone.empty and alone.rollout.completion_ids.shape[0] == 0
    assert (alone.rows, alone.tokens, alone.trained_tokens, alone.skipped) == (3, 8, 0, 3)
    # Several ranks: every rank must run each micro-batch's forward and backward; the row kept adds nothing.
    ranked = trained_rows(r, torch.zeros(3), skip_zero_advantage=True, keep_one=True)
    assert not ranked.empty and ranked.rollout.completions == ["c0"]
    assert ranked.rollout.completion_mask.sum() == 0 and ranked.rollout.completion_ids.shape == (1, 1)
    assert (ranked.rows, ranked.tokens, ranked.trained_tokens, ranked.skipped) == (3, 8, 0, 3)
    logp = torch.randn(1, 1, requires_grad=True)
    loss, metrics = policy_loss(logp, None, None, ranked.rollout.advantages, ranked.rollout.loss_mask,
                                loss_type="grpo", num_sequences=ranked.rows, entropies=torch.ones(1, 1))
    loss.backward()
    assert loss.item() == 0.0 and logp.grad.abs().sum() == 0 and metrics["entropy"] == 0.0


def test_step_counts_are_from_before_the_cut():
    # Two micro-batches of 4 rows: the first with two rows of advantage 0, the second all trained.
    r = dataclasses.replace(rollout([2] * 6, [3, 1, 2, 4, 5, 5]), advantages=torch.tensor([0.0, 1.0, 0.0, -1.0, 1, 1]))
    generation = Generation(r, Cut(4, skip_zero_advantage=True, keep_one=False), {})
    counts = generation.step_counts(generation.micro_batches[:1], lambda values: values)
    assert counts == StepCounts(tokens=20, trained=5, micro_batches=1, rows=4, skipped=2, divisor=10.0)


def test_a_step_with_no_gradient_at_all_steps_as_a_zero_gradient():
    # AdamW on a zero gradient still moves the weights (momentum, weight decay); a step whose rows were all
    # skipped back-propagates nothing, so Updates.apply must stand in the zero gradient.
    settings = OptimSettings(name="adamw", learning_rate=0.1, betas=(0.9, 0.999), weight_decay=0.1,
                             lr_scheduler_type="constant", lr_scheduler_kwargs=None, warmup_ratio=0.0, warmup_steps=0,
                             max_grad_norm=1.0, max_nonfinite_steps=3)

    def adamw_after_two_steps(second_grad):
        w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
        updates = Updates([w], settings, total_steps=2)
        w.grad = torch.tensor([0.5, -1.0, 0.25])
        updates.apply(1.0, step=0)
        w.grad = second_grad
        metrics = updates.apply(0.0, step=1)
        return w.detach().clone(), updates.optimizer.state[w]["step"], metrics

    skipped, zero = adamw_after_two_steps(None), adamw_after_two_steps(torch.zeros(3))
    assert torch.equal(skipped[0], zero[0]) and skipped[1] == zero[1] == 2
    assert skipped[2]["grad_norm"] == 0.0 and skipped[2]["skipped/nonfinite"] == 0.0
