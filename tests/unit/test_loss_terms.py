"""The parts policy_loss is composed of (grpo.algo.loss_terms, aggregate, LossSettings), each against a hand-computed
case; then the composition, for every loss type, against a float64 re-derivation (values and gradients) and
against frozen values."""
import math

import pytest
import torch

from grpo.algo import LOSS_TYPES
from grpo.algo.loss import POLICY_TERMS, LossSettings, aggregate, policy_loss
from grpo.algo.loss_terms import clipped_term, cispo_term, entropy_bonus, importance_ratio, k3_kl, sapo_term
from grpo.settings.config import Config

D = torch.float64
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])  # [2, 3]


def test_importance_ratio_hand_computed():
    # log-ratios [ln 2, ln 0.5, 60 (masked)], [ln 1.5, ln 1.5, ln 0.75]
    # token: w = [2, 0.5, 1 (masked: exp(0), not e^60)], [1.5, 1.5, 0.75]
    # sequence: row 0 exp((ln 2 + ln 0.5) / 2) = 1; row 1 exp(ln(1.6875) / 3) = 1.6875^(1/3) = 1.1905508
    old = torch.zeros(2, 3, dtype=D)
    logp = torch.tensor([[math.log(2), math.log(0.5), 60.0], [math.log(1.5), math.log(1.5), math.log(0.75)]],
                        dtype=D)
    torch.testing.assert_close(importance_ratio(logp, old, MASK, "token"),
                               torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.5, 0.75]], dtype=D))
    seq = importance_ratio(logp, old, MASK, "sequence")
    torch.testing.assert_close(seq, torch.tensor([[1.0] * 3, [1.6875 ** (1 / 3)] * 3], dtype=D))
    # GSPO's gradient: d w_i / d lp_it = w_i / |o_i| on each completion token of row i
    logp.requires_grad_()
    (grad,) = torch.autograd.grad(importance_ratio(logp, old, MASK, "sequence")[:, 0].sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[0.5, 0.5, 0.0], [1.6875 ** (1 / 3) / 3] * 3], dtype=D))


def test_clipped_term_hand_computed():
    # clip range [0.8, 1.2]; A = [+1, -2]
    # row 0: w 1.5 -> -min(1.5, 1.2) = -1.2 (high); w 0.5 -> -min(0.5, 0.8) = -0.5; masked w 9 -> -1.2, not counted
    # row 1: w 0.5 -> -min(-1.0, -1.6) = 1.6 (low); w 3 -> -min(-6, -2.4) = 6; w 1 -> 2
    ratio = torch.tensor([[1.5, 0.5, 9.0], [0.5, 3.0, 1.0]], dtype=D)
    adv = torch.tensor([[1.0], [-2.0]], dtype=D)
    loss, metrics = clipped_term(ratio, adv, MASK, 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, -1.2], [1.6, 6.0, 2.0]], dtype=D))
    assert {k: v.item() for k, v in metrics.items()} == pytest.approx(
        {"clip_ratio/low_mean": 1 / 5, "clip_ratio/high_mean": 1 / 5, "clip_ratio/region_mean": 2 / 5})
    # delta 2 bounds the unclipped w for A < 0: w 3 -> -min(2 * -2, -2.4) = 4; eps_high 0.6: row 0 w 1.5 unclipped
    loss, metrics = clipped_term(ratio, adv, MASK, 0.2, 0.6, delta=2.0)
    torch.testing.assert_close(loss, torch.tensor([[-1.5, -0.5, -1.6], [1.6, 4.0, 2.0]], dtype=D))
    assert metrics["clip_ratio/high_mean"].item() == 0.0 and metrics["clip_ratio/low_mean"].item() == 0.2
    assert all(not v.requires_grad for v in metrics.values())


def test_cispo_term_hand_computed():
    # eps_max 1.2, A = [+1, -2], lp as given: l = -min(w, 1.2) * A * lp
    # row 0: -1.2 * 1 * -0.5 = 0.6; -0.5 * 1 * -2 = 1;  row 1: 2 * 1.0 * -1 = -2; 2 * 1.2 * -0.25 = -0.6; 0
    # d l / d lp = -min(w, 1.2) * A (the weight carries no gradient): [-1.2, -0.5, 0], [2, 2.4, 2.4]
    ratio = torch.tensor([[1.5, 0.5, 9.0], [1.0, 3.0, 1.3]], dtype=D, requires_grad=True)
    lp = torch.tensor([[-0.5, -2.0, 7.0], [-1.0, -0.25, 0.0]], dtype=D, requires_grad=True)
    adv = torch.tensor([[1.0], [-2.0]], dtype=D)
    loss, metrics = cispo_term(ratio, adv, lp, MASK, 1.2)
    torch.testing.assert_close(loss, torch.tensor([[0.6, 1.0, 0.0], [-2.0, -0.6, 0.0]], dtype=D))
    assert metrics["cispo_clip_ratio"].item() == pytest.approx(1 / 5)  # A > 0 and w > 1.2: row 0's 1.5 only
    grad_ratio, grad_lp = torch.autograd.grad(loss.sum(), (ratio, lp), allow_unused=True)
    assert grad_ratio is None
    torch.testing.assert_close(grad_lp, torch.tensor([[-1.2, -0.5, 0.0], [2.0, 2.4, 2.4]], dtype=D))


def test_sapo_term_hand_computed():
    # tau 1 for A = +1, 2 for A = -1: l = -sigmoid(tau (w - 1)) * 4 / tau * A
    # w = 1: -4 * 0.5 = -2 (A > 0); +2 * 0.5 = 1 (A < 0, 4 / tau = 2); w = 1.5, A > 0: -4 * 0.6224593 = -2.4898373
    # d l / d w at w = 1: -4 sigmoid'(0) * A = -A, whatever tau: the gate starts as the plain policy gradient
    ratio = torch.tensor([[1.0, 1.5], [1.0, 1.0]], dtype=D, requires_grad=True)
    adv = torch.tensor([[1.0], [-1.0]], dtype=D)
    loss, metrics = sapo_term(ratio, adv, 1.0, 2.0)
    assert metrics == {}
    torch.testing.assert_close(loss, torch.tensor([[-2.0, -2.4898373], [1.0, 1.0]], dtype=D), rtol=0, atol=1e-7)
    (grad,) = torch.autograd.grad(loss.sum(), ratio)
    assert grad[0, 0].item() == pytest.approx(-1.0) and grad[1].tolist() == pytest.approx([1.0, 1.0])


def test_k3_kl_hand_computed():
    # ref - lp = ln 2: e^{ln 2} - ln 2 - 1 = 1 - ln 2 = 0.3068528; ref - lp = 0: 0; masked: 0 (not e^50)
    lp = torch.tensor([[-1.0, -2.0, -50.0]], dtype=D)
    ref = torch.tensor([[-1.0 + math.log(2), -2.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0]])
    torch.testing.assert_close(k3_kl(lp, ref, mask), torch.tensor([[1 - math.log(2), 0.0, 0.0]], dtype=D))
    ratio = torch.tensor([[1.5, 0.5, 2.0]], dtype=D)  # the bias correction: times w
    torch.testing.assert_close(k3_kl(lp, ref, mask, ratio), torch.tensor([[1.5 * (1 - math.log(2)), 0, 0]], dtype=D))


def test_entropy_bonus_hand_computed():
    # H on the kept tokens 0.5, 1.5 (mean 1), 9 where masked: 0.1 * 1 / 2 micro-batches = 0.05
    entropies = torch.tensor([[0.5, 1.5, 9.0]], dtype=D)
    assert entropy_bonus(entropies, torch.tensor([[True, True, False]]), 0.1, 2).item() == pytest.approx(0.05)
    assert entropy_bonus(entropies, torch.zeros(1, 3, dtype=torch.bool), 0.1, 1).item() == 0.0


@pytest.mark.parametrize("loss_type, expected", [
    # per-token loss [1, 2, (5 masked)], [3, 4, 6]: row sums 3 and 13, 5 tokens; B = 2, K = 2, L = 4
    ("grpo", 1.458333), ("sapo", 1.458333),  # (3 / 2 + 13 / 3) / 2 / 2 = 5.8333333 / 4
    ("bnpo", 1.6),  # 16 / 5 / 2
    ("dr_grpo", 1.0),  # 16 / (2 * 4) / 2
    ("dapo", 3.2), ("cispo", 3.2),  # 16 / 5: the step's tokens, here this call's
    ("luspo", 4.0),  # 16 / 2 / 2
])
def test_aggregate_hand_computed(loss_type, expected):
    per_token = torch.tensor([[1.0, 2.0, 5.0], [3.0, 4.0, 6.0]], dtype=D)
    got = aggregate(per_token, MASK, loss_type, max_completion_length=4, num_micro_batches=2)
    assert got.item() == pytest.approx(expected, abs=1e-6)


def test_every_loss_type_has_a_policy_term_and_the_settings_match_config():
    assert set(POLICY_TERMS) == set(LOSS_TYPES)
    settings = LossSettings(**Config(loss_type="dr_grpo", epsilon_high=0.28).loss_settings())
    assert (settings.loss_type, settings.epsilon_low, settings.epsilon_high) == ("dr_grpo", 0.2, 0.28)
    with pytest.raises(ValueError, match="max_completion_length"):
        LossSettings(loss_type="dr_grpo")
    with pytest.raises(TypeError):
        policy_loss(torch.zeros(1, 1), None, None, torch.zeros(1), torch.ones(1, 1), epsilon=0.2)  # not a field


def inputs(seed: int, B: int = 5, T: int = 7):
    """Seeded float64 inputs: ratios around [0.6, 1.6], the last row without completion tokens (garbage there),
    entropies that are float32 values (so a float64 quantile matches the mask's float32 one)."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=gen, dtype=D) * 3  # [B, T]
    old = logp + torch.rand(B, T, generator=gen, dtype=D) - 0.5  # [B, T]
    ref = logp + (torch.rand(B, T, generator=gen, dtype=D) - 0.5) * 0.6  # [B, T]
    adv = torch.randn(B, generator=gen, dtype=D)  # [B]
    mask = (torch.rand(B, T, generator=gen) < 0.7).long()  # [B, T]
    mask[:, 0] = 1
    mask[-1] = 0
    logp[mask == 0] = 80.0
    entropies = (torch.rand(B, T, generator=gen) * 4).to(D)  # [B, T]
    return logp, old, ref, adv, mask, entropies


def reference_loss(logp, old, ref, adv, mask, entropies, s: LossSettings, num_tokens=None, K=1):
    """The module docstring's formulas in float64, one completion at a time, so that autograd gives the gradient."""
    on = mask.bool()
    acts_on = on
    if s.top_entropy_quantile < 1:
        threshold = torch.quantile(entropies.detach()[on], 1 - s.top_entropy_quantile)
        acts_on = on & (entropies.detach() >= threshold)
    sums, counts = [], []
    for i in range(logp.shape[0]):
        toks = on[i].nonzero().flatten()
        counts.append(len(toks))
        if not len(toks):
            sums.append(logp.new_zeros(()))
            continue
        lp, lo, a = logp[i, toks], old[i, toks], adv[i]
        w = (lp - lo).mean().exp().expand(len(toks)) if s.importance_sampling_level == "sequence" else (lp - lo).exp()
        if s.loss_type == "cispo":
            term = -w.detach().clamp(max=s.epsilon_high) * a * lp
        elif s.loss_type == "vespo":  # the sequence's summed log-ratio, whatever the importance-sampling level
            log_w = (lp - lo).detach().clamp(-20, 20).sum().clamp(math.log(1e-8), 20)
            k, lam = (s.vespo_k_pos, s.vespo_lambda_pos) if a >= 0 else (s.vespo_k_neg, s.vespo_lambda_neg)
            term = -math.exp(lam + k * log_w - lam * log_w.exp()) * a * lp
        elif s.loss_type == "sapo":
            tau = s.sapo_temperature_pos if a > 0 else s.sapo_temperature_neg
            term = -4 / tau * a / (1 + torch.exp(-tau * (w - 1)))
        else:
            bounded = w if s.delta is None else w.clamp(max=s.delta)
            term = -torch.minimum(bounded * a, w.clamp(1 - s.epsilon_low, 1 + s.epsilon_high) * a)
        dropped = s.off_policy_mask_threshold is not None and a < 0 and \
            (lo - lp.detach()).mean() > s.off_policy_mask_threshold
        term = term * acts_on[i, toks] * (0.0 if dropped else 1.0)
        if s.beta:
            d = ref[i, toks] - lp
            term = term + s.beta * (d.exp() - d - 1) * (w if s.use_bias_correction_kl else 1.0)
        sums.append(term.sum())
    sums, counts, B = torch.stack(sums), torch.tensor(counts, dtype=D), len(counts)
    n = counts.sum().clamp(min=1)
    loss = {"grpo": (sums / counts.clamp(min=1)).sum() / B / K, "sapo": (sums / counts.clamp(min=1)).sum() / B / K,
            "bnpo": sums.sum() / n / K, "dr_grpo": sums.sum() / (B * s.max_completion_length) / K,
            "dapo": sums.sum() / (n if num_tokens is None else num_tokens),
            "cispo": sums.sum() / (n if num_tokens is None else num_tokens), "luspo": sums.sum() / B / K,
            "vespo": sums.sum() / (n if num_tokens is None else num_tokens)}[s.loss_type]
    if s.entropy_coef:
        loss = loss - s.entropy_coef * entropies[acts_on].sum() / acts_on.sum().clamp(min=1) / K
    return loss


OPTIONS = {  # settings on top of each loss type's
    "plain": {},
    "kl": dict(beta=0.04, epsilon_high=0.28),
    "everything": dict(beta=0.2, use_bias_correction_kl=False, delta=1.3, epsilon_low=0.1, epsilon_high=0.3,
                       entropy_coef=0.05, top_entropy_quantile=0.6, off_policy_mask_threshold=-0.02,
                       sapo_temperature_pos=0.5, sapo_temperature_neg=2.0),
    "sequence": dict(importance_sampling_level="sequence", beta=0.1, entropy_coef=-0.02, off_policy_mask_threshold=0.0),
}


def settings_for(loss_type, option):
    extra = dict(OPTIONS[option])
    if loss_type == "cispo":  # its epsilon_high is eps_max, a bound on w itself
        extra["epsilon_high"] = 1.3
    return dict(loss_type=loss_type, max_completion_length=9, **extra)


def loss_and_grads(loss_fn, logp, entropies, *args):
    logp, entropies = logp.clone().requires_grad_(), entropies.clone().requires_grad_()
    loss = loss_fn(logp, entropies, *args)
    grads = torch.autograd.grad(loss, (logp, entropies), allow_unused=True)
    return loss, [torch.zeros_like(logp) if g is None else g for g in grads]


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_matches_a_float64_rederivation(loss_type, option):
    logp, old, ref, adv, mask, entropies = inputs(seed=len(loss_type) + len(option))
    settings = settings_for(loss_type, option)
    counts = dict(num_tokens=31.0, num_micro_batches=3)

    def ours(lp, ent):
        return policy_loss(lp, old, ref, adv, mask, entropies=ent, **counts, **settings)[0]

    def reference(lp, ent):
        return reference_loss(lp, old, ref, adv, mask, ent, LossSettings(**settings), 31.0, K=3)

    loss, grads = loss_and_grads(ours, logp, entropies)
    want, want_grads = loss_and_grads(reference, logp, entropies)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-15)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-14)
    assert grads[0].abs().sum() > 0


# Frozen values (loss, sum of d loss / d logp * W, of d loss / d entropies * W; W = [1 .. B*T] / (B*T), row-major)
# on inputs(seed=0) with COUNTS: any change to the loss's arithmetic, even one the float64 re-derivation shares,
# shows here.
COUNTS = dict(num_tokens=31.0, num_micro_batches=2, num_sequences=6, micro_batch_tokens=25.0)
GOLDEN = {
    ("dapo", "kl"): (-0.5045294627428765, -0.10694152053568778, 0.0),
    ("dapo", "everything"): (-0.29439827511075456, -0.062336849012951986, -0.009890109890109891),
    ("grpo", "kl"): (-0.20499368924000397, -0.0402837793789462, 0.0),
    ("grpo", "everything"): (-0.1574846031140587, -0.025802551632679156, -0.009890109890109891),
    ("bnpo", "kl"): (-0.3128082669005834, -0.06630374273212644, 0.0),
    ("bnpo", "everything"): (-0.20630853988380643, -0.03864884638803022, -0.009890109890109891),
    ("dr_grpo", "kl"): (-0.14481864208360343, -0.030696177190799277, 0.0),
    ("dr_grpo", "everything"): (-0.12912269975804974, -0.017892984438902887, -0.009890109890109891),
    ("cispo", "kl"): (0.6666635899402922, -0.16267670179564264, 0.0),
    ("cispo", "everything"): (0.29290572414619964, -0.038401135097820095, -0.009890109890109891),
    ("sapo", "kl"): (-0.4326084776267329, -0.062336179442914655, 0.0),
    ("sapo", "everything"): (-0.5180530809659383, -0.015169132795679274, -0.009890109890109891),
    ("luspo", "kl"): (-1.303367778752431, -0.27626559471719353, 0.0),
    ("luspo", "everything"): (-0.6614388385563718, -0.16103685995012593, -0.009890109890109891),
    ("grpo", "sequence"): (-0.20116357671639826, -0.061023903358450274, 0.0040680272108843535),
    ("sapo", "sequence"): (-0.43714897119510704, -0.0614086073507742, 0.0040680272108843535),
}


@pytest.mark.parametrize("loss_type, option", GOLDEN)
def test_policy_loss_keeps_its_frozen_values(loss_type, option):
    logp, old, ref, adv, mask, entropies = inputs(seed=0)
    weights = torch.arange(1, logp.numel() + 1, dtype=D).view_as(logp) / logp.numel()  # [B, T]

    def ours(lp, ent):
        return policy_loss(lp, old, ref, adv, mask, entropies=ent, **COUNTS, **settings_for(loss_type, option))[0]

    loss, (grad_logp, grad_entropies) = loss_and_grads(ours, logp, entropies)
    got = (loss.item(), (grad_logp * weights).sum().item(), (grad_entropies * weights).sum().item())
    assert got == pytest.approx(GOLDEN[loss_type, option], rel=1e-12, abs=1e-15)
