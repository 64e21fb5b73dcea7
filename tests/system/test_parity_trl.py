"""benchmarks/parity_trl.py: 2 optimizer steps here and in TRL 1.16's GRPOTrainer on the same fixed
completions end with the same weights. Skipped without trl (pip install -e ".[bench]")."""
import sys
from pathlib import Path

import pytest
from tolerances import adamw_rounding

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.slow  # two tiny trainings per loss type: about 20 s on one CPU thread
@pytest.mark.parametrize("loss_type, settings", [
    ("dapo", {}), ("bnpo", {}),  # token-level, and normalized per micro-batch
    ("dapo", dict(gradient_accumulation_steps=1, steps_per_generation=2)),  # a generation batch feeds 2 steps
])
def test_weights_match_trl_after_two_steps(loss_type, settings):
    pytest.importorskip("trl", reason="the TRL comparison needs trl (the bench extra)")
    from parity_trl import compare

    result = compare(loss_type, steps=2, **settings)
    assert result["max_weight_change"] > 1e-3, "the weights must move for the comparison to mean anything"
    # 2 AdamW steps at lr 1e-2 of the same gradients computed by two implementations: steps * lr / 100 = 2e-4
    # (tolerances.py); another normalization or clip of a row of the 16 per step moves elements by ~lr / 16 and more
    assert result["max_weight_diff"] < adamw_rounding(2, 1e-2), result
    for ours, trl in zip(result["ours"], result["trl"]):
        # float32 means of <= 128 token terms of size ~1: n * u = 7.6e-6
        assert ours["loss"] == pytest.approx(trl["loss"], abs=1e-5)
