"""TRL's importance-sampling correction of an engine's samples (algo/sampling_correction) on hand-computed
cases, every mode; and `policy_loss` multiplying its per-token loss by the weights."""
import math

import pytest
import torch

from grpo.algo.loss import policy_loss
from grpo.algo.sampling_correction import correction_metrics, sampling_correction

NAN = float("nan")
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.3, 0.0]], dtype=torch.float64)
# the engine's log-probs: one it did not give (NaN), one under the mask (ignored)
SAMPLED = torch.tensor([[-1.5, -1.0, NAN], [-0.3, -1.0, -9.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# d = old - s where counted: row 0 (0.5, -1.0, 0 for the NaN), row 1 (0, 0.7, masked)
e = math.exp


@pytest.mark.parametrize("mode, clip_min, clip_max, rows, ratios", [
    ("token_truncate", None, 3.0, [[e(0.5), e(-1), 1], [1, e(0.7), 1]], [e(0.5), e(-1), 1, 1, e(0.7)]),
    ("token_truncate", 0.5, 1.5, [[1.5, 0.5, 1], [1, 1.5, 1]], [1.5, 0.5, 1, 1, 1.5]),
    ("token_mask", 0.5, 2.0, [[e(0.5), 0, 1], [1, 0, 1]], [e(0.5), 0, 1, 1, 0]),
    ("sequence_truncate", None, 2.0, [[e(-0.5)] * 3, [2.0] * 3], [e(-0.5), 2.0]),
    ("sequence_mask", None, 3.0, [[e(-0.5)] * 3, [e(0.7)] * 3], [e(-0.5), e(0.7)]),  # TRL's defaults
    ("sequence_mask", None, 2.0, [[e(-0.5)] * 3, [0.0] * 3], [e(-0.5), 0.0]),
    ("sequence_mask", 0.7, None, [[0.0] * 3, [e(0.7)] * 3], [0.0, e(0.7)]),
])
def test_weights_by_hand(mode, clip_min, clip_max, rows, ratios):
    weights, differences, got = sampling_correction(OLD, SAMPLED, MASK, mode, clip_min, clip_max)
    torch.testing.assert_close(weights, torch.tensor(rows, dtype=torch.float64))
    torch.testing.assert_close(got, torch.tensor(ratios, dtype=torch.float64))
    torch.testing.assert_close(differences, torch.tensor([0.5, 1.0, 0.0, 0.7], dtype=torch.float64))


def test_metrics_are_trls_keys_and_values():
    _, differences, ratios = sampling_correction(OLD, SAMPLED, MASK, "token_truncate", None, 3.0)
    m = correction_metrics(differences, ratios)
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(0.55)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(1.0)
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(e(-1))
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx((e(0.5) + e(-1) + 1 + 1 + e(0.7)) / 5)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(e(0.7))
    assert set(correction_metrics(torch.zeros(0), torch.zeros(0)).values()) == {0.0}


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="token_truncate"):
        sampling_correction(OLD, SAMPLED, MASK, "token")


def test_the_loss_is_reweighted_token_by_token():
    """On-policy (w = 1), dapo: each token's loss is -A, times its weight; a masked weight counts nowhere."""
    lp = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([[2.0, 1.0, 0.5], [1.0, 3.0, 7.0]], dtype=torch.float64)
    loss, _ = policy_loss(lp, None, None, torch.tensor([1.0, -1.0]), MASK, sampling_weights=weights)
    assert loss.item() == pytest.approx((-(2 + 1 + 0.5) + (1 + 3)) / 5)
    loss.backward()
    plain = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    policy_loss(plain, None, None, torch.tensor([1.0, -1.0]), MASK)[0].backward()
    torch.testing.assert_close(lp.grad, plain.grad * weights * MASK)
