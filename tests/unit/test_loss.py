import math

import pytest
import torch

from grpo.algo import LOSS_TYPES
from grpo.algo.loss import high_entropy_mask, policy_loss, router_aux_term


def reference_quantile(values, q):
    """torch.quantile's default (linear interpolation), on python floats."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    return xs[lo] + (pos - lo) * (xs[min(lo + 1, len(xs) - 1)] - xs[lo])


def reference_loss(logp, old, ref, adv, mask, *, loss_type="dapo", eps_low=0.2, eps_high=0.2, delta=None,
                   beta=0.0, bias_kl=True, level="token", entropies=None, quantile=1.0, tau_pos=1.0,
                   tau_neg=1.05, max_len=None, num_tokens=None, num_micro_batches=1, policy_only=False,
                   entropy_coef=0.0, off_policy=None):
    """The module docstring's formulas as plain float64 loops over python floats."""
    B, T = logp.shape
    on = [[bool(mask[i, t]) for t in range(T)] for i in range(B)]
    keep = None
    if quantile < 1.0:
        threshold = reference_quantile([float(entropies[i, t]) for i in range(B) for t in range(T) if on[i][t]],
                                       1.0 - quantile)
        keep = [[on[i][t] and float(entropies[i, t]) >= threshold for t in range(T)] for i in range(B)]
    sums, counts = [], []
    for i in range(B):
        a = float(adv[i])
        toks = [t for t in range(T) if on[i][t]]
        seq_log_w = sum(float(logp[i, t]) - float(old[i, t]) for t in toks) / max(1, len(toks))
        dropped = off_policy is not None and a < 0 and -seq_log_w > off_policy  # KL(old || current) = -mean log w
        total = 0.0
        for t in toks:
            lp = float(logp[i, t])
            w = math.exp(seq_log_w if level == "sequence" else lp - float(old[i, t]))
            if loss_type == "cispo":
                value = -min(w, eps_high) * a * lp
            elif loss_type == "sapo":
                tau = tau_pos if a > 0 else tau_neg
                value = -4.0 / tau / (1.0 + math.exp(-tau * (w - 1.0))) * a
            else:
                clipped = min(max(w, 1 - eps_low), 1 + eps_high)
                value = -min((w if delta is None else min(w, delta)) * a, clipped * a)
            if (keep is not None and not keep[i][t]) or dropped:
                value = 0.0
            if beta and ref is not None and not policy_only:
                d = float(ref[i, t]) - lp
                value += beta * (math.exp(d) - d - 1) * (w if bias_kl else 1.0)
            total += value
        sums.append(total)
        counts.append(len(toks))
    K = num_micro_batches
    if loss_type in ("grpo", "sapo"):
        loss = sum(s / max(1, c) for s, c in zip(sums, counts)) / B / K
    elif loss_type == "bnpo":
        loss = sum(sums) / max(1, sum(counts)) / K
    elif loss_type == "dr_grpo":
        loss = sum(sums) / (B * max_len) / K
    elif loss_type in ("dapo", "cispo"):
        loss = sum(sums) / max(1, sum(counts) if num_tokens is None else num_tokens)
    else:  # luspo
        loss = sum(sums) / B / K
    if entropy_coef and not policy_only:  # the mean entropy of the tokens the policy term acts on, / K
        acts = [float(entropies[i, t]) for i in range(B) for t in range(T) if (keep or on)[i][t]]
        loss -= entropy_coef * sum(acts) / max(1, len(acts)) / K
    return loss


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


# old = 0, so w = exp(logp); eps 0.2 -> clip range [0.8, 1.2]
# seq 0, A = +1: w 1.5 -> -min(1.5, 1.2) = -1.2 (clip high); w 0.5 -> -min(0.5, 0.8) = -0.5;
#   third token masked (logp 100: exp overflows float32 if the mask were applied after exp)
# seq 1, A = -2: w 1.1 -> -min(-2.2, -2.2) = 2.2; w 0.5 -> -min(-1.0, -1.6) = 1.6 (clip low); w 1.0 -> 2.0
HAND = dict(logprobs=torch.tensor([[math.log(1.5), math.log(0.5), 100.0], [math.log(1.1), math.log(0.5), 0.0]]),
            old_logprobs=torch.zeros(2, 3), ref_logprobs=None, advantages=torch.tensor([1.0, -2.0]),
            completion_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))
# The hand-computed tests' abs=1e-6: HAND is float32; an exp (1 rounding) and a sum of <= 5 terms whose sizes add
# to <= 7.5, over 5 tokens, round by <= 2 * 5 * 2**-24 * 7.5 / 5 = 9e-7, the hand values (7 decimals) by 5e-8.
# A wrong clip, weight or count moves them by >= 1e-2.


@pytest.mark.parametrize("loss_type, kwargs, expected", [
    ("dapo", {}, 0.82),  # (-1.2 - 0.5 + 2.2 + 1.6 + 2.0) / 5 = 4.1 / 5
    ("bnpo", {}, 0.82),  # one micro-batch: the same token mean
    ("grpo", {}, 0.5416667),  # (-1.7 / 2 + 5.8 / 3) / 2 = (-0.85 + 1.9333333) / 2
    ("dr_grpo", dict(max_completion_length=4), 0.5125),  # 4.1 / (2 * 4)
    ("luspo", {}, 2.05),  # (-1.7 + 5.8) / 2
    ("grpo", dict(num_micro_batches=4), 0.1354167),  # 0.5416667 / 4: one of 4 micro-batches
    ("dapo", dict(num_tokens=10), 0.41),  # 4.1 / 10: the step's token count
    # cispo with eps_max 5 (no weight clipped): -stopgrad(w) * A * logp
    #   seq 0: -(1.5 ln 1.5 + 0.5 ln 0.5) = -0.2616241; seq 1: 2 (1.1 ln 1.1 + 0.5 ln 0.5 + 0) = -0.4834648
    ("cispo", dict(epsilon_high=5.0), -0.1490178),  # -0.7450889 / 5
    # sapo: -4 sigmoid(tau (w - 1)) / tau * A, tau 1 for A > 0, 1.05 for A < 0
    #   seq 0: -4 (sigmoid(0.5) + sigmoid(-0.5)) = -4, mean -2
    #   seq 1: 8 / 1.05 * (sigmoid(0.105) + sigmoid(-0.525) + sigmoid(0)) = 4.0093403 + 2.8318767 + 3.8095238
    #   = 10.6507407, mean 3.5502469; grpo-style mean (-2 + 3.5502469) / 2
    ("sapo", {}, 0.7751235),
])
def test_hand_computed(loss_type, kwargs, expected):
    loss, metrics = policy_loss(**HAND, loss_type=loss_type, **kwargs)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["loss/policy"] == pytest.approx(expected, abs=1e-6)
    assert "kl" not in metrics and "entropy" not in metrics
    # ratio/mean (1.5 + 0.5 + 1.1 + 0.5 + 1.0) / 5 = 0.92
    assert metrics["ratio/mean"] == pytest.approx(0.92)
    if loss_type in ("cispo", "sapo"):
        assert "clip_ratio/region_mean" not in metrics
    else:  # clip high 1/5, clip low 1/5, region 2/5
        assert metrics["clip_ratio/high_mean"] == pytest.approx(0.2)
        assert metrics["clip_ratio/low_mean"] == pytest.approx(0.2)
        assert metrics["clip_ratio/region_mean"] == pytest.approx(0.4)


def test_hand_computed_kl_with_and_without_bias_correction():
    # ref = logp + ln 2: k3 = e^{ln 2} - ln 2 - 1 = 1 - ln 2 = 0.3068528 on every token
    ref = HAND["logprobs"] + math.log(2.0)
    hand = dict(HAND, ref_logprobs=ref)
    # plain k3: dapo 0.82 + 0.1 * 0.3068528 = 0.8506853
    loss, metrics = policy_loss(**hand, beta=0.1, use_bias_correction_kl=False)
    assert loss.item() == pytest.approx(0.8506853, abs=1e-6)
    assert metrics["kl"] == pytest.approx(0.3068528, abs=1e-6)
    assert metrics["loss/policy"] == pytest.approx(0.82, abs=1e-6)
    # k3 * w: mean kl 0.3068528 * 0.92 = 0.2823046; dapo 0.82 + 0.1 * 0.2823046 = 0.8482305
    loss, metrics = policy_loss(**hand, beta=0.1)
    assert loss.item() == pytest.approx(0.8482305, abs=1e-6)
    assert metrics["kl"] == pytest.approx(0.2823046, abs=1e-6)


def test_asymmetric_clip_hand_computed():
    # DAPO clip-higher: eps_low 0.2, eps_high 0.28; w 1.25, A = +1
    # symmetric: -min(1.25, 1.2) = -1.2; asymmetric: -min(1.25, 1.28) = -1.25, unclipped
    logp = torch.tensor([[math.log(1.25)]])
    args = (logp, torch.zeros(1, 1), None, torch.tensor([1.0]), torch.ones(1, 1))
    loss, metrics = policy_loss(*args)
    assert loss.item() == pytest.approx(-1.2) and metrics["clip_ratio/high_mean"] == 1.0
    loss, metrics = policy_loss(*args, epsilon_high=0.28)
    assert loss.item() == pytest.approx(-1.25) and metrics["clip_ratio/high_mean"] == 0.0


def test_two_sided_clipping_hand_computed():
    # A = -2, w = 3: plain clipping keeps the unclipped term -min(3 * -2, 1.2 * -2) = 6, unbounded in w;
    # delta 1.5 bounds it: -min(1.5 * -2, -2.4) = 3. For A > 0 the clip already bounds it: -min(1.5, 1.2) = -1.2.
    args = (torch.tensor([[math.log(3.0)], [math.log(3.0)]]), torch.zeros(2, 1), None)
    mask = torch.ones(2, 1)
    assert policy_loss(*args, torch.tensor([-2.0, 0.0]), mask, loss_type="luspo")[0].item() == pytest.approx(3.0)
    loss, _ = policy_loss(*args, torch.tensor([-2.0, 0.0]), mask, loss_type="luspo", delta=1.5)
    assert loss.item() == pytest.approx(1.5)  # (3 + 0) / 2
    loss, _ = policy_loss(*args, torch.tensor([1.0, 1.0]), mask, loss_type="luspo", delta=1.5)
    assert loss.item() == pytest.approx(-1.2)


def test_router_aux_term_hand_computed():
    # TRL: loss + coef * aux / (accumulation steps); aux = 2, coef = 0.5, 4 micro-batches: 0.5 * 2 / 4 = 0.25, and
    # the metric's share 2 / 4 = 0.5, so that the 4 micro-batches' shares sum to their mean aux.
    aux = torch.tensor(2.0, requires_grad=True)
    term, metrics = router_aux_term(aux, 0.5, num_micro_batches=4)
    term.backward()
    assert term.item() == pytest.approx(0.25) and metrics == {"aux_loss": pytest.approx(0.5)}
    assert aux.grad.item() == pytest.approx(0.125)


def test_sequence_level_importance_sampling_hand_computed():
    # GSPO: one weight per sequence, exp(mean log-ratio). seq 0: (ln 1.5 + ln 0.5) / 2 = ln(0.75) / 2,
    #   w = sqrt(0.75) = 0.8660254, inside [0.8, 1.2]: every token -0.8660254 (A = 1)
    # seq 1: (ln 1.1 + ln 0.5 + 0) / 3, w = 0.55^(1/3) = 0.8193213 (A = -2): -min(-1.6386427, -1.6386427)
    # grpo: (-0.8660254 + 1.6386427) / 2 = 0.3863086
    loss, metrics = policy_loss(**HAND, loss_type="grpo", importance_sampling_level="sequence")
    assert loss.item() == pytest.approx(0.3863086, abs=1e-6)
    # ratio/mean over tokens: (2 * 0.8660254 + 3 * 0.8193213) / 5 = 0.8380029; nothing clipped
    assert metrics["ratio/mean"] == pytest.approx(0.8380029, abs=1e-6)
    assert metrics["clip_ratio/region_mean"] == 0.0


def test_high_entropy_mask_hand_computed():
    # completion tokens' entropies [0.1, 0.9 | 0.5, 0.3, 0.7]; keep the top 40%: at least the 0.6 quantile,
    # sorted [0.1, 0.3, 0.5, 0.7, 0.9] at position 0.6 * 4 = 2.4: 0.5 + 0.4 * 0.2 = 0.58
    entropies = torch.tensor([[0.1, 0.9, 5.0], [0.5, 0.3, 0.7]])  # 5.0 is masked: not counted, not kept
    keep = high_entropy_mask(entropies, HAND["completion_mask"], 0.6)
    assert keep.tolist() == [[False, True, False], [False, False, True]]
    # only -0.5 (seq 0, t 1) and 2.0 (seq 1, t 2) stay: dapo (-0.5 + 2.0) / 5 = 0.3
    loss, metrics = policy_loss(**HAND, entropies=entropies, top_entropy_quantile=0.4)
    assert loss.item() == pytest.approx(0.3, abs=1e-6)
    assert metrics["entropy"] == pytest.approx((0.1 + 0.9 + 0.5 + 0.3 + 0.7) / 5)  # over every completion token
    assert high_entropy_mask(entropies, HAND["completion_mask"], 1.0).sum() == 1  # the highest only
    assert high_entropy_mask(entropies, torch.zeros(2, 3), 0.5).sum() == 0


CASES = [  # (loss_type, extra settings) covering every option at least once
    ("dapo", {}), ("bnpo", {}), ("grpo", {}), ("dr_grpo", {}), ("luspo", {}), ("cispo", dict(eps_high=1.3)),
    ("sapo", {}), ("sapo", dict(tau_pos=0.5, tau_neg=2.0)),
    ("grpo", dict(level="sequence")), ("dapo", dict(level="sequence", bias_kl=False)),
    ("dapo", dict(delta=1.3)), ("grpo", dict(bias_kl=False)), ("dapo", dict(quantile=0.3)),
    ("dr_grpo", dict(num_micro_batches=3)), ("dapo", dict(num_tokens=57.0)),
    ("dapo", dict(entropy_coef=0.05)), ("grpo", dict(entropy_coef=-0.02, quantile=0.3, num_micro_batches=3)),
    # these inputs' sequences have mean KL(old || current) near 0: thresholds <= 0 drop some at each size
    ("bnpo", dict(off_policy=-0.02)), ("cispo", dict(eps_high=1.3, off_policy=0.0, entropy_coef=0.1)),
    ("sapo", dict(level="sequence", off_policy=-0.05, entropy_coef=0.01)),
]
RENAMED = {"eps_high": "epsilon_high", "level": "importance_sampling_level", "bias_kl": "use_bias_correction_kl",
           "quantile": "top_entropy_quantile", "tau_pos": "sapo_temperature_pos",
           "tau_neg": "sapo_temperature_neg", "off_policy": "off_policy_mask_threshold"}


@pytest.mark.parametrize("loss_type, extra", CASES)
# Against the float64 loops: float32 sums <= 16 x 33 = 528 terms, each with an exp or log: rounding ~sqrt(n) * u
# = 1.4e-6 of the terms' size (n * u = 3e-5 the worst case, which random signs never near; measured <= 1.4e-7);
# float64 1e-10, 10^4 x its 528 * 2**-53 = 6e-14. A wrong clip, count or KL term is off by >= 1e-3.
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("B, T, beta", [(1, 5, 0.0), (4, 9, 0.04), (16, 33, 0.5)])
def test_matches_float64_reference(loss_type, extra, dtype, rtol, B, T, beta):
    logp, old, ref, adv, mask = random_inputs(B, T, dtype, seed=B * T, empty_row=B > 1)
    entropies = torch.rand(B, T, generator=torch.Generator().manual_seed(B), dtype=torch.float64).to(dtype) * 4
    kwargs = {RENAMED.get(k, k): v for k, v in extra.items()}
    loss, metrics = policy_loss(logp, old, ref, adv, mask, loss_type=loss_type, beta=beta, entropies=entropies,
                                max_completion_length=T + 3, epsilon_low=0.2, **{"epsilon_high": 0.28, **kwargs})
    args = (logp.double(), old.double(), ref.double(), adv.double(), mask)
    settings = {**dict(loss_type=loss_type, eps_high=0.28, max_len=T + 3, entropies=entropies.double()), **extra}
    assert loss.dtype == dtype
    assert loss.item() == pytest.approx(reference_loss(*args, beta=beta, **settings), rel=rtol, abs=rtol)
    policy_only = reference_loss(*args, beta=beta, policy_only=True, **settings)
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
    # float64 means of <= 96 values both ways: rounding <= 96 * 2**-53 = 1e-14 relative; rel 1e-12
    assert metrics["clip_ratio/low_mean"] == pytest.approx(low, rel=1e-12)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(high, rel=1e-12)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(low + high, rel=1e-12)
    assert metrics["ratio/mean"] == pytest.approx(ratio.mean().item(), rel=1e-12)
    assert metrics["kl"] == pytest.approx(((d.exp() - d - 1) * ratio).mean().item(), rel=1e-12)
    _, metrics = policy_loss(logp, old, ref, adv, mask, loss_type="cispo", epsilon_high=1.2)
    assert metrics["cispo_clip_ratio"] == pytest.approx(high, rel=1e-12)
    assert all(type(v) is float for v in metrics.values())


@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t not in ("cispo", "vespo")])  # those: below
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradcheck(loss_type, level):
    logp, old, ref, adv, mask = random_inputs(3, 4, torch.float64, seed=9)
    logp.requires_grad_()

    def f(lp):
        return policy_loss(lp, old, ref, adv, mask, beta=0.3, loss_type=loss_type, max_completion_length=6,
                           importance_sampling_level=level)[0]

    assert torch.autograd.gradcheck(f, (logp,))


def test_cispo_gradient_is_the_clipped_weight_times_the_advantage():
    # The weight is detached, so the loss is not its gradient's potential (no gradcheck): by hand,
    # d loss / d logp = -min(w, eps_max) * A / (the step's tokens), w off-policy here.
    logp, old, _, adv, mask = random_inputs(3, 5, torch.float64, seed=13)
    logp.requires_grad_()
    loss, _ = policy_loss(logp, old, None, adv, mask, loss_type="cispo", epsilon_high=1.1)
    loss.backward()
    w = (logp - old).detach().exp().clamp(max=1.1)
    assert (w == 1.1).any() and (w < 1.1).any()
    # float64, a product of 3 factors each way: a few ulps (2**-53 = 1.1e-16) of values ~0.1; atol for exact zeros
    torch.testing.assert_close(logp.grad, -w * adv[:, None] * mask / mask.sum(), rtol=1e-12, atol=1e-15)


def test_vespo_gradient_is_the_gamma_weight_times_the_advantage():
    # The weight is detached, as cispo's: by hand, d loss / d logp = -phi_i * A_i / (the step's tokens), with
    # phi_i = e^lambda w^k e^(-lambda w) of the sequence's w = exp(sum of its log-ratios), (k, lambda) by A's sign.
    logp, old, _, adv, mask = random_inputs(3, 5, torch.float64, seed=13)
    adv = adv * torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)  # both signs
    logp.requires_grad_()
    loss, metrics = policy_loss(logp, old, None, adv, mask, loss_type="vespo")
    loss.backward()
    w = (((logp - old) * mask).sum(dim=1)).detach().exp()  # [B]
    k, lam = torch.where(adv >= 0, 2.0, 3.0).double(), torch.where(adv >= 0, 3.0, 2.0).double()
    phi = lam.exp() * w ** k * (-lam * w).exp()  # [B]
    assert (adv > 0).any() and (adv < 0).any() and not torch.allclose(phi, torch.ones_like(phi))
    torch.testing.assert_close(logp.grad, -(phi * adv)[:, None] * mask / mask.sum(), rtol=1e-12, atol=1e-15)
    assert metrics["vespo/phi_seq_mean"] == pytest.approx(phi.mean().item(), rel=1e-12)
    on_policy, metrics = policy_loss(logp.detach(), None, None, adv, mask, loss_type="vespo")
    assert metrics["vespo/phi_seq_mean"] == pytest.approx(1.0)  # phi(1) = 1


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo", "luspo"])
@pytest.mark.parametrize("bias_kl", [True, False])
def test_on_policy_gradient_by_hand(loss_type, bias_kl):
    # With old = logp.detach(), w = 1 with d w / d logp = 1, so per token (times the aggregation weight
    # u: mask / count, mask / (|o_i| B), mask / (B L), mask for luspo) d loss / d logp is
    #   -A + beta * d(k3 * w) = -A + beta * (1 - e^d + k3) = -A - beta * d   (d = ref - logp; the unbiased
    #   reverse-KL gradient) with the bias correction, and -A + beta * (1 - e^d) without it.
    B, T, L, beta = 4, 6, 10, 0.3
    logp, _, ref, adv, mask = random_inputs(B, T, torch.float64, seed=21, empty_row=True)
    logp.requires_grad_()
    loss, metrics = policy_loss(logp, logp.detach(), ref, adv, mask, loss_type=loss_type, max_completion_length=L,
                                beta=beta, use_bias_correction_kl=bias_kl)
    loss.backward()
    m = mask.double()
    u = {"dapo": m / m.sum(), "bnpo": m / m.sum(), "grpo": m / m.sum(1, keepdim=True).clamp(min=1) / B,
         "dr_grpo": m / (B * L), "luspo": m / B}[loss_type]
    d = (ref - logp).detach()
    kl_grad = -d if bias_kl else 1 - d.exp()
    # float64 as above: a few ulps of values ~0.1
    torch.testing.assert_close(logp.grad, (-adv[:, None] + beta * kl_grad) * u, rtol=1e-12, atol=1e-15)
    assert metrics["ratio/mean"] == 1.0 and metrics["clip_ratio/region_mean"] == 0.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_sum_to_the_step_loss_except_bnpo(loss_type):
    # A step of two equal micro-batches: each call normalized with the step's counts (num_tokens for
    # dapo / cispo, num_micro_batches for the rest) sums to the whole-batch loss, except bnpo, which TRL
    # normalizes by each micro-batch's own token count: the mean of the micro-batches' token means.
    B, T, L = 6, 7, 9
    logp, old, ref, adv, mask = random_inputs(B, T, torch.float64, seed=31, empty_row=True)
    kwargs = dict(beta=0.05, loss_type=loss_type, max_completion_length=L)
    full, _ = policy_loss(logp, old, ref, adv, mask, **kwargs)
    halves = (slice(0, 3), slice(3, B))
    parts = [policy_loss(logp[s], old[s], ref[s], adv[s], mask[s], num_tokens=float(mask.sum()),
                         num_micro_batches=2, **kwargs)[0] for s in halves]
    local = [policy_loss(logp[s], old[s], ref[s], adv[s], mask[s], **kwargs)[0] for s in halves]
    assert mask[:3].sum() != mask[3:].sum(), "unequal token counts: bnpo must then differ"
    # float64 sums of <= 42 terms in two groupings: <= 42 * 2**-53 = 5e-15 relative; rel 1e-12. bnpo's own
    # normalization differs from the whole batch's by the token counts' ratio, >= 1e-2 here: rel 1e-6 tells them apart
    if loss_type == "bnpo":
        assert sum(parts).item() == pytest.approx((local[0] + local[1]).item() / 2, rel=1e-12)
        assert sum(parts).item() != pytest.approx(full.item(), rel=1e-6)
    else:
        assert sum(parts).item() == pytest.approx(full.item(), rel=1e-12)
        assert local[0].item() != pytest.approx(parts[0].item())  # else the test would prove nothing


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_empty_completions_give_no_nan(loss_type):
    logp, old, ref, adv, mask = random_inputs(3, 4, torch.float32, seed=4, empty_row=True)
    logp.requires_grad_()
    kwargs = dict(beta=0.1, loss_type=loss_type, max_completion_length=4, importance_sampling_level="sequence",
                  entropies=torch.rand(3, 4), top_entropy_quantile=0.5)
    loss, metrics = policy_loss(logp, old, ref, adv, mask, **kwargs)
    assert torch.isfinite(loss)
    assert torch.isfinite(torch.autograd.grad(loss, logp)[0]).all()
    loss, metrics = policy_loss(logp, old, ref, adv, torch.zeros_like(mask), **kwargs)
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
    with pytest.raises(ValueError, match="dapo, grpo, bnpo, dr_grpo"):
        policy_loss(logp, old, ref, adv, mask, loss_type="token")
    with pytest.raises(ValueError, match="token, sequence"):
        policy_loss(logp, old, ref, adv, mask, importance_sampling_level="sentence")
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(logp, old, ref, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="entropies"):
        policy_loss(logp, old, ref, adv, mask, top_entropy_quantile=0.2)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, ref, adv[:1], mask)
    with pytest.raises(ValueError, match="completion_mask"):
        policy_loss(logp, old, ref, adv, mask[:, :2])
