"""policy_loss's entropy bonus (entropy_coef) and off-policy sequence mask (off_policy_mask_threshold): hand-computed
cases, and the bonus's gradient through token_logprobs against float64 full-logits autograd."""
import math

import pytest
import torch

from grpo.algo import LOSS_TYPES
from grpo.algo.logprobs import token_logprobs
from grpo.algo.loss import off_policy_mask, policy_loss

# logp = -1 everywhere; KL(old || current) per sequence = mean of old - logp over its completion tokens; eps 0.2
# seq 0, A = +1: old [-0.5, -0.5], KL 0.5: kept (a positive advantage always is)
# seq 1, A = -1: old [0.25, -1.5], KL (1.25 - 0.5) / 2 = 0.375 > 0.25: dropped
# seq 2, A = -1: old [-0.875, -1], KL (0.125 + 0) / 2 = 0.0625: kept
# seq 3, A = -1: old [-0.75, 50 (masked: not counted)], KL 0.25, not above the threshold: kept
# seq 4, A = 0: old [-0.5, -0.5], KL 0.5: kept (A >= 0)
OFF = dict(logprobs=torch.full((5, 2), -1.0, dtype=torch.float64),
           old_logprobs=torch.tensor([[-0.5, -0.5], [0.25, -1.5], [-0.875, -1.0], [-0.75, 50.0], [-0.5, -0.5]],
                                     dtype=torch.float64),
           ref_logprobs=None, advantages=torch.tensor([1.0, -1.0, -1.0, -1.0, 0.0], dtype=torch.float64),
           completion_mask=torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0], [1, 1]]))


def test_off_policy_mask_hand_computed():
    kept = off_policy_mask(OFF["logprobs"], OFF["old_logprobs"], OFF["advantages"], OFF["completion_mask"], 0.25)
    assert kept.tolist() == [True, False, True, True, True]
    # a threshold above seq 1's KL keeps it; on-policy (old = logp) nothing is dropped, whatever the advantage
    assert off_policy_mask(OFF["logprobs"], OFF["old_logprobs"], OFF["advantages"], OFF["completion_mask"],
                           0.375).all()
    assert off_policy_mask(OFF["logprobs"], OFF["logprobs"], OFF["advantages"], OFF["completion_mask"], 0.0).all()


def test_off_policy_mask_in_the_loss_hand_computed():
    # w = exp(logp - old), luspo: the sum of each sequence's per-token -min(w A, clip(w, 0.8, 1.2) A), over B = 5
    # seq 0: w = e^-0.5 = 0.6065307 twice, A = 1: -0.6065307 each, -1.2130613
    # seq 1: w = e^-1.25 = 0.2865048 -> clipped 0.8; w = e^0.5 = 1.6487213 unclipped for A < 0: 2.4487213
    # seq 2: w = e^-0.125 = 0.8824969 and 1: 1.8824969;  seq 3: w = e^-0.25 = 0.7788008 -> 0.8;  seq 4: A = 0
    # unmasked: (-1.2130613 + 2.4487213 + 1.8824969 + 0.8) / 5 = 3.9181569 / 5 = 0.7836314
    # masked (seq 1 dropped): 1.4694356 / 5 = 0.2938871
    logp = OFF["logprobs"].clone().requires_grad_()
    args = dict(OFF, logprobs=logp, loss_type="luspo")
    plain, metrics = policy_loss(**args)
    # float64 against the hand values above, each kept to 7 decimals (within 5e-8; a sum of 5: 3e-7): abs 1e-6
    assert plain.item() == pytest.approx(0.7836314, abs=1e-6) and "off_policy/masked_ratio" not in metrics
    masked, metrics = policy_loss(**args, off_policy_mask_threshold=0.25)
    assert masked.item() == pytest.approx(0.2938871, abs=1e-6)
    assert metrics["loss/policy"] == pytest.approx(0.2938871, abs=1e-6)
    assert metrics["off_policy/masked_ratio"] == pytest.approx(1 / 5)
    (plain_grad,) = torch.autograd.grad(plain, logp)
    (masked_grad,) = torch.autograd.grad(masked, logp)
    assert plain_grad[1].abs().sum() > 0, "seq 1 must have a gradient to drop, or the test proves nothing"
    assert masked_grad[1].abs().sum() == 0
    keep = [0, 2, 3, 4]
    torch.testing.assert_close(masked_grad[keep], plain_grad[keep], rtol=0, atol=0)
    # one of K = 2 micro-batches: its share of the step's fraction, like the loss's
    _, metrics = policy_loss(**OFF, off_policy_mask_threshold=0.25, num_micro_batches=2)
    assert metrics["off_policy/masked_ratio"] == pytest.approx(1 / 10)


def test_off_policy_mask_comes_before_the_kl_term():
    # beta = 0.1, ref = logp + ln 2: k3 = 1 - ln 2 = 0.3068528 per token, times w (bias correction). Dropping seq 1
    # removes only its policy terms: loss - loss/policy is the whole KL term either way.
    ref = OFF["logprobs"] + math.log(2.0)
    args = dict(OFF, ref_logprobs=ref, beta=0.1, loss_type="luspo")
    plain, plain_metrics = policy_loss(**args)
    masked, metrics = policy_loss(**args, off_policy_mask_threshold=0.25)
    kl_term = plain.item() - plain_metrics["loss/policy"]
    # float64: the same KL sum either way, a difference of O(1) values: rounding ~10 * 2**-53 = 1e-15 of it
    assert kl_term > 0 and masked.item() - metrics["loss/policy"] == pytest.approx(kl_term, rel=1e-12)


# B = 1, T = 3, mask [1, 1, 0], entropies [0.5, 1.5, 9 (masked)]: mean entropy of the completion tokens 1.0;
# entropy_coef 0.1 and K = 2 micro-batches: bonus 0.1 * 1.0 / 2 = 0.05 off the loss, whatever the loss type;
# d loss / d H = -0.1 / (2 * 2 tokens) = -0.025 on each completion token
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_entropy_bonus_hand_computed(loss_type):
    logp = torch.tensor([[-0.7, -1.2, -3.0]], dtype=torch.float64)
    entropies = torch.tensor([[0.5, 1.5, 9.0]], dtype=torch.float64, requires_grad=True)
    args = (logp, logp - 0.1, None, torch.tensor([0.8], dtype=torch.float64), torch.tensor([[1, 1, 0]]))
    kwargs = dict(loss_type=loss_type, max_completion_length=4, num_micro_batches=2, entropies=entropies,
                  epsilon_high=5.0 if loss_type == "cispo" else 0.2)
    without, _ = policy_loss(*args, **kwargs)
    loss, metrics = policy_loss(*args, **kwargs, entropy_coef=0.1)
    # float64 sums of <= 3 terms of size <= 10: rounding <= 1e-14, against exact hand values; abs 1e-12
    assert loss.item() - without.item() == pytest.approx(-0.05, abs=1e-12)
    assert metrics["loss/entropy"] == pytest.approx(-0.05, abs=1e-12)
    assert metrics["loss/policy"] == pytest.approx(without.item(), abs=1e-12)
    (grad,) = torch.autograd.grad(loss, entropies)
    assert grad[0].tolist() == pytest.approx([-0.025, -0.025, 0.0], abs=1e-12)
    # top_entropy_quantile 0.5: the 0.5 quantile of [0.5, 1.5] is 1.0, so the bonus (and the policy term) act on
    # token 1 only: 0.1 * 1.5 / 2 = 0.075, d loss / d H = -0.1 / 2 = -0.05 there
    _, metrics = policy_loss(*args, **kwargs, entropy_coef=0.1, top_entropy_quantile=0.5)
    assert metrics["loss/entropy"] == pytest.approx(-0.075, abs=1e-12)
    loss, _ = policy_loss(*args, **kwargs, entropy_coef=0.1, top_entropy_quantile=0.5)
    (grad,) = torch.autograd.grad(loss, entropies)
    assert grad[0].tolist() == pytest.approx([0.0, -0.05, 0.0], abs=1e-12)


@pytest.mark.parametrize("loss_type, quantile", [("dapo", 1.0), ("grpo", 0.4), ("cispo", 1.0)])
def test_entropy_bonus_gradient_through_token_logprobs(loss_type, quantile):
    # The whole path: hidden -> our chunked log-probs and entropies -> policy_loss with the bonus; against float64
    # full logits, with the bonus written out: - c * sum(m' H) / sum(m') / K.
    B, T, V, H, c, K, tau = 3, 5, 29, 8, 0.3, 2, 0.8
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(B, T, H, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = (torch.rand(B, T, generator=gen) < 0.8).long()
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    kwargs = dict(loss_type=loss_type, num_micro_batches=K, num_tokens=11.0, top_entropy_quantile=quantile,
                  epsilon_high=1.5 if loss_type == "cispo" else 0.28)

    logp, ent = token_logprobs(hidden, weight, targets, temperature=tau, chunk_size=4, return_entropy=True)
    old = logp.detach() + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    loss, _ = policy_loss(logp, old, None, adv, mask, entropies=ent, entropy_coef=c, **kwargs)
    got = torch.autograd.grad(loss, (hidden, weight))

    logp_all = torch.log_softmax(hidden @ weight.T / tau, dim=-1)  # [B, T, V]
    ref_logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)  # [B, T]
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)  # [B, T]
    policy, _ = policy_loss(ref_logp, old, None, adv, mask, entropies=ref_ent.detach(), **kwargs)
    acts_on = mask.bool()
    if quantile < 1:
        threshold = torch.quantile(ref_ent.detach()[acts_on], 1 - quantile)
        acts_on = acts_on & (ref_ent.detach() >= threshold)
    expected = policy - c * (ref_ent * acts_on).sum() / acts_on.sum() / K
    (policy_only,) = torch.autograd.grad(policy, hidden, retain_graph=True)
    want = torch.autograd.grad(expected, (hidden, weight))
    assert (want[0] - policy_only).abs().max() > 1e-3, "the bonus must change the gradient, or this proves nothing"
    # float64 both ways, chunked against full logits: sums of <= V + B * T = 44 terms, rounding ~44 * 2**-53 = 5e-15
    # relative; 1e-12 (gradients: 1e-10, through a softmax's cancellations) leaves 100x, and a term dropped or
    # weighted wrongly is off by 1e-3 (the bonus's own share, asserted above)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_entropy_coef_needs_entropies():
    with pytest.raises(ValueError, match="entropy_coef != 0 needs the per-token entropies"):
        policy_loss(OFF["logprobs"], None, None, OFF["advantages"], OFF["completion_mask"], entropy_coef=0.01)
