import math

import pytest
import torch

from grpo.algo.advantages import group_advantages, normalized_sum_advantages, zero_std_fraction


def reference_advantages(rewards, group_size, scale, eps):
    """Plain float64 loop over groups, independent of the vectorized implementation."""
    r = [float(x) for x in rewards]
    n = len(r)

    def unbiased_std(xs):
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    out = []
    for g in range(0, n, group_size):
        group = r[g:g + group_size]
        mean = sum(group) / group_size
        if scale == "group":
            div = unbiased_std(group) + eps
        elif scale == "batch":
            div = unbiased_std(r) + eps
        else:
            div = 1.0
        out += [(x - mean) / div for x in group]
    return torch.tensor(out, dtype=torch.float64)


def test_hand_computed_group_scale():
    # group 1: [1, 0, 1], mean 2/3, centered [1/3, -2/3, 1/3]
    #   unbiased var = (1/9 + 4/9 + 1/9) / (3 - 1) = 1/3, std = 0.5773503
    #   A = (1/3) / (0.5773503 + 1e-4) = 0.5772503, -2/3 / ... = -1.1545006
    # group 2: [2, 2, 2] -> exactly 0
    rewards = torch.tensor([1.0, 0.0, 1.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    adv = group_advantages(rewards, group_size=3)
    std = math.sqrt(1 / 3)
    expected = [1 / 3 / (std + 1e-4), -2 / 3 / (std + 1e-4), 1 / 3 / (std + 1e-4), 0, 0, 0]
    # float64 against the formula: a mean, a std and a division, a few ulps (2**-53) each: rel 1e-12; the hand
    # value is kept to 7 decimals (within 5e-8): abs 1e-7
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    assert adv[0].item() == pytest.approx(0.5772503, abs=1e-7)
    assert torch.all(adv[3:] == 0)


def test_convention_is_bessel_corrected_and_eps_is_1e_4():
    # [0, 1]: centered [-0.5, 0.5]; unbiased std = sqrt((0.25 + 0.25) / 1) = 0.7071068
    # A = 0.5 / (0.7071068 + 1e-4) = 0.7070068; the biased std (0.5) would give 0.9998
    adv = group_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), 2)
    assert adv[1].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4), rel=1e-12)
    assert adv[1].item() == pytest.approx(0.7070068, abs=1e-7)
    # an explicit eps is used as given: 0.5 / (0.7071068 + 0.3) = 0.4964617
    adv = group_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), 2, eps=0.3)
    assert adv[1].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 0.3), rel=1e-12)


def test_hand_computed_batch_scale():
    # groups [0, 1] and [1, 1]: group means 0.5 and 1 -> centered [-0.5, 0.5, 0, 0]
    # batch: mean 0.75, squared deviations 0.5625 + 3 * 0.0625 = 0.75, / (4 - 1) = 0.25, std 0.5
    # A = +-0.5 / (0.5 + 1e-4) = +-0.9998000
    adv = group_advantages(torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64), 2, scale="batch")
    expected = torch.tensor([-0.5 / 0.5001, 0.5 / 0.5001, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=0)


def test_hand_computed_no_scale():
    # Dr. GRPO: only centering. [3, 1] -> mean 2 -> [1, -1]; [0, 4] -> mean 2 -> [-2, 2]
    adv = group_advantages(torch.tensor([3.0, 1.0, 0.0, 4.0]), 2, scale="none")
    assert adv.tolist() == [1.0, -1.0, -2.0, 2.0]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
# Against float64 loops: float32 means and stds of <= 128 rewards (batch scale) of size ~4, std ~3, so advantages
# ~1: n * u = 7.6e-6 of them (measured 3.6e-7); float64 1e-10, 10^5 x its 128 * 2**-53. A wrong std (biased, or
# per batch) is off by 1e-2.
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("groups, group_size", [(1, 2), (3, 4), (16, 8), (5, 7)])
def test_matches_reference(scale, dtype, rtol, groups, group_size):
    gen = torch.Generator().manual_seed(groups * 100 + group_size)
    rewards = torch.randn(groups * group_size, generator=gen, dtype=torch.float64) * 3 + 1
    expected = reference_advantages(rewards, group_size, scale, 1e-4)
    adv = group_advantages(rewards.to(dtype), group_size, scale=scale)
    assert adv.dtype == dtype
    torch.testing.assert_close(adv.double(), expected, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flat_group_is_exactly_zero(scale, dtype):
    # 0.1 * 7 / 7 != 0.1 in floating point: a plain subtraction leaves a tiny residue.
    rewards = torch.tensor([0.1] * 7 + [0.7] * 7 + [0.0, 1, 0, 1, 0, 1, 1], dtype=dtype)
    adv = group_advantages(rewards, 7, scale=scale)
    assert torch.all(adv[:14] == 0)
    assert torch.all(adv[14:] != 0)


def test_all_groups_flat_batch_scale_is_zero_not_nan():
    adv = group_advantages(torch.ones(8), 4, scale="batch")
    assert torch.all(adv == 0)


def test_integer_rewards_become_float():
    adv = group_advantages(torch.tensor([1, 0, 0, 0]), 2, scale="none")
    assert adv.dtype == torch.float32
    assert adv.tolist() == [0.5, -0.5, 0.0, 0.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_raise_with_positions(bad):
    rewards = torch.tensor([0.0, bad, 1.0, 1.0, bad, 0.0])
    with pytest.raises(ValueError, match=r"positions \[1, 4\]"):
        group_advantages(rewards, 3)


def test_bad_shapes_and_options_raise():
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="group, batch, none"):
        group_advantages(torch.zeros(4), 2, scale="std")
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2)


def test_unscored_completions_are_left_out_and_get_zero():
    # Group 1 [1, x, 0, 1] with x unscored (every reward function returned None; its summed reward is 0):
    #   scored [1, 0, 1]: mean 2/3, centered [1/3, -2/3, 1/3], unbiased std sqrt(1/3) = 0.5773503
    #   A = [0.5772503, 0, -1.1545006, 0.5772503]; counting x as 0 would give mean 1/2 instead.
    # Group 2 [2, x, x, 5]: two scored, mean 3.5, centered [-1.5, 1.5], std sqrt(4.5) = 2.1213203
    #   A = [-0.7070734, 0, 0, 0.7070734]
    # Group 3 [x, 3, x, x]: one scored: no std (TRL: NaN), so every advantage is 0.
    rewards = torch.tensor([1.0, 0, 0, 1, 2, 0, 0, 5, 0, 3, 0, 0], dtype=torch.float64)
    scored = torch.tensor([1, 0, 1, 1, 1, 0, 0, 1, 0, 1, 0, 0], dtype=torch.bool)
    adv = group_advantages(rewards, 4, scored=scored)
    s1, s2 = math.sqrt(1 / 3) + 1e-4, math.sqrt(4.5) + 1e-4
    expected = [1 / 3 / s1, 0, -2 / 3 / s1, 1 / 3 / s1, -1.5 / s2, 0, 0, 1.5 / s2, 0, 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    assert adv[0].item() == pytest.approx(0.5772503, abs=1e-7)
    # batch scale: the std over the 6 scored rewards [1, 0, 1, 2, 5, 3] only: mean 2,
    #   squared deviations 1 + 4 + 1 + 0 + 9 + 1 = 16, / 5 = 3.2, std 1.7888544
    adv = group_advantages(rewards, 4, scale="batch", scored=scored)
    sb = math.sqrt(3.2) + 1e-4
    assert adv[0].item() == pytest.approx(1 / 3 / sb, rel=1e-12) and adv[7].item() == pytest.approx(1.5 / sb)
    assert adv[[1, 5, 6, 8, 9, 10, 11]].abs().sum() == 0
    # all scored: the same as without the mask
    everything = torch.ones(12, dtype=torch.bool)
    torch.testing.assert_close(group_advantages(rewards, 4, scored=everything), group_advantages(rewards, 4))


def test_zero_std_fraction_hand_computed():
    # groups: [1, 1] flat; [0, 1] signal; [2, x] one scored: no signal; [0.3, 0.3] flat -> 3 of 4
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 0.0, 0.3, 0.3])
    scored = torch.tensor([1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    assert zero_std_fraction(rewards, 2, scored) == 0.75
    assert zero_std_fraction(rewards, 2) == 0.5  # [2, 0] has signal once its 0 counts
    assert zero_std_fraction(torch.tensor([1, 1, 1, 0]), 4) == 0.0


def test_has_signal_marks_the_groups_dynamic_sampling_keeps():
    from grpo.algo.advantages import has_signal

    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 3.0, 5.0, 4.0, 4.0, 5.0])  # 4 groups of 3
    scored = torch.tensor([True] * 6 + [True, False, False] + [True, True, False])
    # equal; differ; one scored completion only (no std); the two scored are equal (4, 4) though 5 is not scored
    assert has_signal(rewards, 3).tolist() == [False, True, True, True]
    assert has_signal(rewards, 3, scored).tolist() == [False, True, False, False]
    assert zero_std_fraction(rewards, 3, scored) == 0.75  # the groups without signal, as TRL counts them


def test_normalize_then_sum_by_hand():
    # Two groups of 2, two functions weighted 1 and 0.5. Group 1: f1 = 1, 3 (mean 2, unbiased std sqrt 2), f2 all 0
    # (std 0: 0/0 with eps=0, dropped). Group 2: f1 all 0, f2 = 2, 4. Sums: -1/sqrt 2, 1/sqrt 2, -0.5/sqrt 2,
    # 0.5/sqrt 2; their mean is 0, their unbiased std sqrt((2 x 1/2 + 2 x 1/8) / 3) = sqrt(5/12).
    per_func = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 4.0]])
    got = normalized_sum_advantages(per_func, torch.tensor([1.0, 0.5]), group_size=2, eps=0.0)
    a = (1 / math.sqrt(2)) / math.sqrt(5 / 12)  # sqrt(1.2)
    assert torch.allclose(got, torch.tensor([-a, a, -a / 2, a / 2]))


def test_normalize_then_sum_leaves_unscored_completions_out():
    nan = float("nan")
    # Row 1 unscored by every function: advantage 0, out of the batch's mean and std; row 3's f2 None: f2's
    # group 2 has one value left, no std, and adds nothing.
    per_func = torch.tensor([[1.0, 5.0], [nan, nan], [2.0, 5.0], [4.0, nan], [1.0, 1.0], [3.0, 3.0]])
    got = normalized_sum_advantages(per_func, torch.ones(2), group_size=2, eps=0.0)
    assert got[1] == 0 and not got.isnan().any()
    scored = torch.tensor([0, 2, 3, 4, 5])
    sums = torch.tensor([0.0, -1 / math.sqrt(2), 1 / math.sqrt(2), -math.sqrt(2), math.sqrt(2)])
    assert torch.allclose(got[scored], (sums - sums.mean()) / sums.std())
