"""bf16 weights with stochastic rounding: the rounding is unbiased, small updates survive where round-to-nearest
loses them, both optimizers update bf16 weights like float32 master weights on average."""
import math

import pytest
import torch

from grpo.policy.optim import build_optimizer
from grpo.policy.rounding import StochasticRoundingAdamW, stochastic_round_to_bf16


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above |x| (float64), from the float32 bit pattern by hand."""
    bits = x.abs().view(torch.int32).long()
    down = (bits & ~0xFFFF).int().view(torch.float32).double()
    exponent = torch.floor(torch.log2(down))
    return down, down + 2.0 ** (exponent - 7)  # 7 stored mantissa bits


def test_rounds_to_a_neighbour_with_the_probability_that_makes_it_unbiased():
    # Values spanning 12 orders of magnitude, both signs, none exactly representable in bf16.
    x = torch.cat([torch.tensor([1 + 2**-10, -(1 + 2**-10), 3.14159, -2.71828e-5, 1e6 + 7, 123.456]),
                   torch.randn(58, generator=gen(1)) * 10.0 ** torch.randint(-6, 6, (58,), generator=gen(2))])
    draws = 20_000
    y = stochastic_round_to_bf16(x.expand(draws, -1).contiguous(), generator=gen()).double()  # [draws, 64]
    down, up = bf16_neighbours(x)
    assert torch.all((y.abs() == down) | (y.abs() == up)) and torch.all(torch.sign(y) == torch.sign(x.double()))
    # P(up) = (|x| - down) / spacing, e.g. 1/8 for 1 + 2^-10 (2^-10 of a 2^-7 spacing).
    p_up = (x.abs().double() - down) / (up - down)
    assert p_up[0].item() == 1 / 8
    # The mean of `draws` two-valued draws has standard deviation <= spacing / (2 sqrt(draws)): allow 5 of them.
    tolerance = 5 * (up - down) / (2 * math.sqrt(draws))
    assert torch.all((y.mean(dim=0) - x.double()).abs() <= tolerance)
    assert torch.all(((y.abs() == up).double().mean(dim=0) - p_up).abs() <= 5 * 0.5 / math.sqrt(draws))


def test_bf16_values_and_specials_are_kept_exactly():
    largest = torch.finfo(torch.bfloat16).max
    exact = torch.tensor([0.0, -0.0, 1.0, -2.0, 1.0078125, largest, -largest, float("inf"), -float("inf")])
    rounded = stochastic_round_to_bf16(exact.expand(100, -1).contiguous(), generator=gen())
    assert torch.equal(rounded.float(), exact.expand(100, -1))
    assert torch.equal(torch.signbit(rounded[:, 1]), torch.ones(100, dtype=torch.bool))
    assert stochastic_round_to_bf16(torch.tensor([float("nan")])).isnan().all()
    with pytest.raises(TypeError):
        stochastic_round_to_bf16(torch.ones(2, dtype=torch.float64))


def test_a_one_in_a_million_update_survives_on_average_where_round_to_nearest_loses_it():
    # bf16 spacing in [1, 2) is 2^-7 ~ 7.8e-3: adding 1e-6 moves 1.0 by 1.3e-4 of a spacing, so round-to-nearest
    # gives back 1.0 at every step. Stochastic rounding moves up one spacing with probability 1.28e-4 per step.
    steps, n, delta = 1000, 10_000, 1e-6
    nearest = torch.ones(n, dtype=torch.bfloat16)
    stochastic = torch.ones(n, dtype=torch.bfloat16)
    g = gen()
    for _ in range(steps):
        nearest = (nearest.float() + delta).to(torch.bfloat16)
        stochastic = stochastic_round_to_bf16(stochastic.float() + delta, generator=g)
    assert torch.all(nearest == 1.0)
    gain = stochastic.double().mean().item() - 1.0  # expected steps * delta = 1e-3
    # Per weight: 2^-7 times a count of ~Poisson(0.128) ups, std 2^-7 sqrt(0.128) = 2.8e-3; over n: 2.8e-5.
    assert abs(gain - steps * delta) < 5 * 2**-7 * math.sqrt(steps * delta / 2**-7) / math.sqrt(n)


def test_sliced_adamw_on_float32_weights_is_torch_adamw():
    torch.manual_seed(0)
    weights = [torch.randn(50, 40), torch.randn(7)]
    grads = [[torch.randn_like(w) for w in weights] for _ in range(3)]
    results = []
    for make in (lambda ps: StochasticRoundingAdamW(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1,
                                                    slice_size=300),  # 2000 elements: slices end mid-row
                 lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        optimizer = make(params)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            optimizer.step()
        results.append(params)
    for ours, torchs in zip(*results):  # float32, the same formula slice by slice: ulps (measured: equal)
        torch.testing.assert_close(ours, torchs)


@pytest.mark.parametrize("optim", ["adamw", "adamw_8bit"])
def test_bf16_weights_follow_float32_master_weights_on_average(optim):
    # A constant gradient makes every Adam step about -lr; at lr = 2e-5 that is 1/195 of bf16's spacing just
    # below 1.0 (2^-8): torch's AdamW on bf16 weights never moves them, ours moves them by -50 lr on average.
    # 16384 elements: bitsandbytes keeps 8-bit states; the 64-element bias keeps float32 states.
    lr, steps = 2e-5, 50
    shapes = [(128, 128), (64,)]
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.nn.Parameter(torch.ones(s, dtype=dtype)) for s in shapes]
        optimizer = build_optimizer(params, optim, lr, (0.9, 0.99), 0.0)
        torch.manual_seed(0)
        for _ in range(steps):
            for p in params:
                p.grad = torch.ones_like(p)
            optimizer.step()
        assert all(p.dtype == dtype for p in params)
        moved[dtype] = [p.double().mean().item() - 1.0 for p in params]
    plain = [torch.nn.Parameter(torch.ones(s, dtype=torch.bfloat16)) for s in shapes]
    torch_adamw = torch.optim.AdamW(plain, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    for _ in range(steps):
        for p in plain:
            p.grad = torch.ones_like(p)
        torch_adamw.step()
    assert all(torch.all(p == 1.0) for p in plain)  # round-to-nearest loses every step
    for (n, reference, ours) in zip((128 * 128, 64), moved[torch.float32], moved[torch.bfloat16]):
        # float32 weights near 1 round each step of 2e-5 by <= 2**-24 (0.3% of it), 8-bit states add their
        # quantization (measured 0.14% in all)
        assert reference == pytest.approx(-steps * lr, rel=0.02)
        # Per weight: 2^-8 times ~Poisson(100 lr / 2^-8) downs; std of the mean over n weights, times 5.
        assert abs(ours - reference) < 5 * 2**-8 * math.sqrt(steps * lr / 2**-8) / math.sqrt(n)


def test_bf16_optimizer_state_stays_float32_through_a_checkpoint():
    param = torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16))
    optimizer = build_optimizer([param], "adamw", 1e-3, (0.9, 0.99), 0.0)
    param.grad = torch.randn_like(param)
    optimizer.step()
    saved = optimizer.state_dict()
    restored = build_optimizer([param], "adamw", 1e-3, (0.9, 0.99), 0.0)
    restored.load_state_dict(saved)
    for key in ("exp_avg", "exp_avg_sq"):
        assert restored.state[param][key].dtype == torch.float32
        assert torch.equal(restored.state[param][key], optimizer.state[param][key])
        assert restored.state[param][key].data_ptr() != optimizer.state[param][key].data_ptr()  # a copy, as torch's

