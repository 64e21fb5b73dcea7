import math

import pytest
import torch

from grpo.algo.loss import policy_loss

AGGREGATIONS = ["sequence", "token", "constant"]


def reference_loss(logp, old, ref, adv, mask, eps_low, eps_high, beta, aggregation, max_len):
    """Plain float64 per-sequence, per-token loops over python floats."""
    B, T = logp.shape
    seq_values, total, count = [], 0.0, 0
    for i in range(B):
        a = float(adv[i])
        seq_sum, seq_count = 0.0, 0
        for t in range(T):
            if not mask[i, t]:
                continue
            ratio = math.exp(float(logp[i, t]) - float(old[i, t]))
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            value = -min(ratio * a, clipped * a)
            if beta and ref is not None:
                d = float(ref[i, t]) - float(logp[i, t])
                value += beta * (math.exp(d) - d - 1)
            seq_sum += value
            seq_count += 1
        seq_values.append(seq_sum / max(seq_count, 1))
        total += seq_sum
        count += seq_count
    if aggregation == "sequence":
        return sum(seq_values) / B
    if aggregation == "token":
        return total / max(count, 1)
    return total / (B * max_len)


def random_inputs(B, T, dtype, seed, empty_row=False):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    # ratios spread over roughly [0.6, 1.6]: many tokens land in each clip region
    old = logp + (torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.5)
    ref = logp + (torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.5) * 0.6
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    mask = torch.rand(B, T, generator=gen) < 0.7
    mask[:, 0] = True
    if empty_row:
        mask[-1] = False
    return [x.to(dtype) for x in (logp, old, ref, adv)] + [mask.long()]


def test_hand_computed():
    # old = 0, so ratio = exp(logp); eps 0.2 -> clip range [0.8, 1.2]
    # seq 0, A = +1: ratio 1.5 -> -min(1.5, 1.2) = -1.2 (clip/high); ratio 0.5 -> -min(0.5, 0.8) = -0.5;
    #   third token masked (logp 100: exp overflows float32 if the mask were applied after exp)
    # seq 1, A = -2: ratio 1.1 -> -min(-2.2, -2.2) = 2.2; ratio 0.5 -> -min(-1.0, -1.6) = 1.6 (clip/low);
    #   ratio 1.0 -> 2.0
    logp = torch.tensor([[math.log(1.5), math.log(0.5), 100.0],
                         [math.log(1.1), math.log(0.5), 0.0]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # token:    (-1.2 - 0.5 + 2.2 + 1.6 + 2.0) / 5 = 4.1 / 5 = 0.82
    # sequence: (-1.7 / 2 + 5.8 / 3) / 2 = (-0.85 + 1.9333333) / 2 = 0.5416667
    # constant: 4.1 / (2 * 4) = 0.5125
    expected = {"token": 0.82, "sequence": 0.5416667, "constant": 0.5125}
    for aggregation, value in expected.items():
        loss, metrics = policy_loss(logp, old, None, adv, mask, aggregation=aggregation,
                                    max_completion_length=4)
        assert loss.item() == pytest.approx(value, abs=1e-6)
        assert metrics["loss/policy"] == pytest.approx(value, abs=1e-6)
    # clip/high 1/5, clip/low 1/5, region 2/5; ratio/mean (1.5 + 0.5 + 1.1 + 0.5 + 1.0) / 5 = 0.92
    assert metrics["clip/high"] == pytest.approx(0.2)
    assert metrics["clip/low"] == pytest.approx(0.2)
    assert metrics["clip/region"] == pytest.approx(0.4)
    assert metrics["ratio/mean"] == pytest.approx(0.92)
    assert "kl" not in metrics
    # ref = logp + ln 2: k3 = e^{ln 2} - ln 2 - 1 = 1 - ln 2 = 0.3068528 on every token
    # token loss with beta 0.1: 0.82 + 0.1 * 0.3068528 = 0.8506853
    loss, metrics = policy_loss(logp, old, logp + math.log(2.0), adv, mask, beta=0.1)
    assert loss.item() == pytest.approx(0.8506853, abs=1e-6)
    assert metrics["kl"] == pytest.approx(0.3068528, abs=1e-6)
    assert metrics["loss/policy"] == pytest.approx(0.82, abs=1e-6)


def test_asymmetric_clip_hand_computed():
    # DAPO clip-higher: eps_low 0.2, eps_high 0.28; ratio 1.25, A = +1
    # symmetric: -min(1.25, 1.2) = -1.2; asymmetric: -min(1.25, 1.28) = -1.25, unclipped
    logp = torch.tensor([[math.log(1.25)]])
    args = (logp, torch.zeros(1, 1), None, torch.tensor([1.0]), torch.ones(1, 1))
    loss, metrics = policy_loss(*args)
    assert loss.item() == pytest.approx(-1.2) and metrics["clip/high"] == 1.0
    loss, metrics = policy_loss(*args, epsilon_high=0.28)
    assert loss.item() == pytest.approx(-1.25) and metrics["clip/high"] == 0.0


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("B, T, beta, eps_high", [(1, 5, 0.0, 0.2), (4, 9, 0.04, 0.28), (16, 33, 0.5, 0.2)])
def test_matches_reference(aggregation, dtype, rtol, B, T, beta, eps_high):
    logp, old, ref, adv, mask = random_inputs(B, T, dtype, seed=B * T, empty_row=B > 1)
    loss, metrics = policy_loss(logp, old, ref, adv, mask, epsilon_low=0.2, epsilon_high=eps_high,
                                beta=beta, aggregation=aggregation, max_completion_length=T + 3)
    expected = reference_loss(logp.double(), old.double(), ref.double(), adv.double(), mask,
                              0.2, eps_high, beta, aggregation, T + 3)
    assert loss.dtype == dtype
    assert loss.item() == pytest.approx(expected, rel=rtol, abs=rtol)
    policy_only = reference_loss(logp.double(), old.double(), None, adv.double(), mask,
                                 0.2, eps_high, 0.0, aggregation, T + 3)
    assert metrics["loss/policy"] == pytest.approx(policy_only, rel=rtol, abs=rtol)


def test_metrics_match_reference():
    logp, old, ref, adv, mask = random_inputs(8, 12, torch.float64, seed=3, empty_row=True)
    _, metrics = policy_loss(logp, old, ref, adv, mask, beta=0.1)
    on = mask.bool()
    ratio = (logp - old).exp()[on]
    a = adv[:, None].expand_as(logp)[on]
    d = (ref - logp)[on]
    low = ((a < 0) & (ratio < 0.8)).double().mean().item()
    high = ((a > 0) & (ratio > 1.2)).double().mean().item()
    assert low > 0 and high > 0, "inputs should exercise both clip regions"
    assert metrics["clip/low"] == pytest.approx(low, rel=1e-12)
    assert metrics["clip/high"] == pytest.approx(high, rel=1e-12)
    assert metrics["clip/region"] == pytest.approx(low + high, rel=1e-12)
    assert metrics["ratio/mean"] == pytest.approx(ratio.mean().item(), rel=1e-12)
    assert metrics["kl"] == pytest.approx((d.exp() - d - 1).mean().item(), rel=1e-12)
    assert all(type(v) is float for v in metrics.values())


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gradcheck(aggregation):
    logp, old, ref, adv, mask = random_inputs(3, 4, torch.float64, seed=9)
    logp.requires_grad_()

    def f(lp):
        return policy_loss(lp, old, ref, adv, mask, beta=0.3, aggregation=aggregation,
                           max_completion_length=6)[0]

    assert torch.autograd.gradcheck(f, (logp,))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_on_policy_gradient_is_minus_advantage_times_weights(aggregation):
    # With old = logp.detach() the ratio is 1 and d loss / d logp = -A * w, where w is the
    # aggregation's per-token weight: mask / count, mask / (|o_i| B), mask / (B L).
    B, T, L = 4, 6, 10
    logp, _, _, adv, mask = random_inputs(B, T, torch.float64, seed=21, empty_row=True)
    logp.requires_grad_()
    loss, metrics = policy_loss(logp, logp.detach(), None, adv, mask, aggregation=aggregation,
                                max_completion_length=L)
    loss.backward()
    m = mask.double()
    weights = {
        "token": m / m.sum(),
        "sequence": m / m.sum(1, keepdim=True).clamp(min=1) / B,
        "constant": m / (B * L),
    }[aggregation]
    torch.testing.assert_close(logp.grad, -adv[:, None] * weights, rtol=1e-12, atol=1e-15)
    assert metrics["ratio/mean"] == 1.0 and metrics["clip/region"] == 0.0


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_with_global_counts_sum_to_full_batch(aggregation):
    B, T, L = 6, 7, 9
    logp, old, ref, adv, mask = random_inputs(B, T, torch.float64, seed=31, empty_row=True)
    kwargs = dict(beta=0.05, aggregation=aggregation, max_completion_length=L)
    full, _ = policy_loss(logp, old, ref, adv, mask, **kwargs)
    num_tokens = float(mask.sum())
    parts = [policy_loss(logp[s], old[s], ref[s], adv[s], mask[s], num_tokens=num_tokens,
                         num_sequences=B, **kwargs)[0]
             for s in (slice(0, 2), slice(2, B))]
    # Each part alone, normalized locally, must differ: the test would otherwise prove nothing.
    local = policy_loss(logp[:2], old[:2], ref[:2], adv[:2], mask[:2], **kwargs)[0]
    assert local.item() != pytest.approx(parts[0].item())
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-12)


def test_empty_completions_give_no_nan():
    logp, old, ref, adv, mask = random_inputs(3, 4, torch.float32, seed=4, empty_row=True)
    logp.requires_grad_()
    for aggregation in AGGREGATIONS:
        loss, metrics = policy_loss(logp, old, ref, adv, mask, beta=0.1, aggregation=aggregation,
                                    max_completion_length=4)
        assert torch.isfinite(loss)
        assert torch.isfinite(torch.autograd.grad(loss, logp)[0]).all()
    loss, metrics = policy_loss(logp, old, ref, adv, torch.zeros_like(mask), beta=0.1,
                                aggregation="sequence")
    assert loss.item() == 0.0
    assert all(math.isfinite(v) for v in metrics.values())


def test_reference_untouched_without_beta():
    logp, old, _, adv, mask = random_inputs(2, 3, torch.float32, seed=6)
    nan_ref = torch.full_like(logp, float("nan"))
    loss, metrics = policy_loss(logp, old, nan_ref, adv, mask, beta=0.0)
    assert torch.isfinite(loss) and "kl" not in metrics
    loss_none, _ = policy_loss(logp, old, None, adv, mask, beta=0.1)
    assert loss_none.item() == loss.item()


def test_old_logprobs_none_means_on_policy():
    logp, _, _, adv, mask = random_inputs(2, 3, torch.float64, seed=8)
    a, _ = policy_loss(logp, None, None, adv, mask)
    b, _ = policy_loss(logp, logp.clone(), None, adv, mask)
    assert a.item() == b.item()


def test_bad_arguments_raise():
    logp, old, ref, adv, mask = random_inputs(2, 3, torch.float32, seed=1)
    with pytest.raises(ValueError, match="sequence, token, constant"):
        policy_loss(logp, old, ref, adv, mask, aggregation="mean")
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(logp, old, ref, adv, mask, aggregation="constant")
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, ref, adv[:1], mask)
    with pytest.raises(ValueError, match="completion_mask"):
        policy_loss(logp, old, ref, adv, mask[:, :2])
