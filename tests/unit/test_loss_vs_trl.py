"""Our policy_loss against TRL 1.16's own GRPOTrainer._compute_loss on the same tensors: a step of two
micro-batches, each loss type with TRL's defaults and with each option; losses, gradients (to the log-probs and
to the entropies, which the entropy bonus trains) and metrics.
Skipped without trl (pip install -e ".[bench]"); `python tests/unit/test_loss_vs_trl.py` prints the table."""
import math
import types

import pytest
import torch

from grpo.algo.loss import policy_loss

B, T, K, L = 4, 6, 2, 8  # rows per micro-batch, completion tokens, micro-batches, max_completion_length
CASES = [  # (loss_type, settings) with TRL's names
    *[(t, {}) for t in ("dapo", "grpo", "bnpo", "dr_grpo", "luspo")],
    # TRL's torch.where(A > 0, 1.0, 1.05) makes the temperatures float32: given as float32 values, they agree
    # exactly; with 1.05 itself the losses differ by 6e-8, TRL's rounding.
    ("sapo", dict(sapo_temperature_neg=float(torch.tensor(1.05, dtype=torch.float32)))),
    ("cispo", dict(epsilon_high=1.3)),
    ("dapo", dict(use_bias_correction_kl=False)),
    ("grpo", dict(importance_sampling_level="sequence")),
    ("dapo", dict(delta=1.25, epsilon_high=0.28)),
    ("bnpo", dict(top_entropy_quantile=0.3)),
    ("dapo", dict(entropy_coef=0.05)), ("grpo", dict(entropy_coef=0.1, top_entropy_quantile=0.3)),
    ("luspo", dict(off_policy_mask_threshold=0.0)),
    ("cispo", dict(epsilon_high=1.3, off_policy_mask_threshold=0.05, entropy_coef=0.02)),
    ("vespo", {}), ("vespo", dict(vespo_k_pos=1.5, vespo_lambda_pos=2.0, vespo_k_neg=2.5, vespo_lambda_neg=1.0)),
    ("vespo", dict(top_entropy_quantile=0.5, off_policy_mask_threshold=0.05, use_bias_correction_kl=False)),
]


VESPO = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)  # TRL's defaults


def inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    logp = -rand(K * B, T) * 3
    mask = (rand(K * B, T) < 0.75).long()
    mask[:, 0] = 1
    mask[-1, 2:] = 0
    return dict(logp=logp, old=logp + rand(K * B, T) - 0.5, ref=logp + (rand(K * B, T) - 0.5) * 0.6,
                adv=torch.randn(K * B, generator=gen, dtype=torch.float64), mask=mask, entropy=rand(K * B, T) * 4)


def trl_step(trl_trainer, data, loss_type, settings, beta):
    """TRL's loss on each micro-batch, summed as its gradient accumulation does; logp's gradient; metrics."""
    args = types.SimpleNamespace(use_bias_correction_kl=settings.get("use_bias_correction_kl", True),
                                 delta=settings.get("delta"), sapo_temperature_pos=1.0,
                                 sapo_temperature_neg=settings.get("sapo_temperature_neg", 1.05),
                                 steps_per_generation=K, **{k: settings.get(k, v) for k, v in VESPO.items()})
    accelerator = types.SimpleNamespace(num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t,
                                        pad_across_processes=lambda t, dim, pad_index: t, sync_gradients=True)
    entropy_coef = settings.get("entropy_coef", 0.0)
    fake = types.SimpleNamespace(
        args=args, accelerator=accelerator, loss_type=loss_type, beta=beta, epsilon_low=0.2,
        epsilon_high=settings.get("epsilon_high", 0.2), importance_sampling_level=settings.get(
            "importance_sampling_level", "token"), top_entropy_quantile=settings.get("top_entropy_quantile", 1.0),
        off_policy_mask_threshold=settings.get("off_policy_mask_threshold"), use_vllm=False,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=K, max_completion_length=L,
        aux_loss_enabled=False, entropy_coef=entropy_coef, use_adaptive_entropy=False,
        _entropy_bonus_enabled=entropy_coef != 0, _metrics={"train": __import__("collections").defaultdict(list)})
    fake.get_high_entropy_mask = lambda *a: trl_trainer.get_high_entropy_mask(fake, *a)
    fake.get_off_policy_mask = trl_trainer.get_off_policy_mask
    fake.get_gamma_weights = trl_trainer.get_gamma_weights
    logp, entropy = data["logp"].clone().requires_grad_(), data["entropy"].clone().requires_grad_()
    total = 0.0
    for k in range(K):
        rows = slice(k * B, (k + 1) * B)
        fake._get_per_token_logps_and_entropies = lambda *a, rows=rows, **kw: (logp[rows], entropy[rows], None)
        batch = dict(prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
                     completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=data["mask"][rows],
                     advantages=data["adv"][rows], old_per_token_logps=data["old"][rows],
                     ref_per_token_logps=data["ref"][rows], num_items_in_batch=data["mask"].sum().double())
        total = total + trl_trainer._compute_loss(fake, None, batch)
    total.backward()
    metrics = {k: sum(v) / len(v) for k, v in fake._metrics["train"].items()}
    return total.item(), logp.grad, entropy_grad(entropy), metrics


def entropy_grad(entropy):
    """The gradient the loss sent to the entropies: zeros when they are out of it (no entropy bonus)."""
    return torch.zeros_like(entropy) if entropy.grad is None else entropy.grad


def our_step(data, loss_type, settings, beta):
    logp, entropy = data["logp"].clone().requires_grad_(), data["entropy"].clone().requires_grad_()
    eps_high = settings.get("epsilon_high", 0.2)
    kwargs = dict(loss_type=loss_type, beta=beta, epsilon_high=eps_high, max_completion_length=L,
                  num_tokens=float(data["mask"].sum()), num_micro_batches=K,
                  **{k: v for k, v in settings.items() if k != "epsilon_high"})
    total, metrics = 0.0, []
    for k in range(K):
        rows = slice(k * B, (k + 1) * B)
        loss, m = policy_loss(logp[rows], data["old"][rows], data["ref"][rows], data["adv"][rows], data["mask"][rows],
                              entropies=entropy[rows], **kwargs)
        total, metrics = total + loss, metrics + [m]
    total.backward()
    return total.item(), logp.grad, entropy_grad(entropy), {k: sum(m[k] for m in metrics) / K for k in metrics[0]}


def compare(loss_type, settings, beta=0.04, seed=0):
    from trl.trainer.grpo_trainer import GRPOTrainer

    data = inputs(seed)
    trl_loss, trl_grad, trl_entropy_grad, trl_metrics = trl_step(GRPOTrainer, data, loss_type, settings, beta)
    loss, grad, ent_grad, metrics = our_step(data, loss_type, settings, beta)
    shared = [k for k in ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                          "cispo_clip_ratio", "vespo/phi_seq_mean") if k in trl_metrics]
    assert all(k in metrics for k in shared), set(shared) - set(metrics)
    return dict(loss=abs(loss - trl_loss), grad=(grad - trl_grad).abs().max().item(),
                entropy_grad=(ent_grad - trl_entropy_grad).abs().max().item(), trl_entropy_grad=trl_entropy_grad,
                metrics=max([abs(metrics[k] - trl_metrics[k]) for k in shared], default=0.0), trl_loss=trl_loss,
                masked=metrics.get("off_policy/masked_ratio", 0.0) * K)


@pytest.mark.slow  # importing TRL's trainer takes a while
@pytest.mark.parametrize("loss_type, settings", CASES)
def test_policy_loss_matches_trl(loss_type, settings):
    pytest.importorskip("trl")
    diff = compare(loss_type, settings)
    assert math.isfinite(diff["trl_loss"]) and diff["trl_loss"] != 0
    # float64 both sides, the same sums of <= 100 terms of size <= 10: rounding <= 100 * 2**-53 * 10 = 1e-13; TRL
    # counts tokens in float32 for its metrics: agreement to float32 rounding there (2**-24 = 6e-8 of values <= 1)
    assert diff["loss"] < 1e-12 and diff["grad"] < 1e-12 and diff["metrics"] < 1e-7, diff
    assert diff["entropy_grad"] < 1e-12, diff
    # each option must act here, or its row proves nothing
    assert (diff["trl_entropy_grad"].abs().max() > 0) == ("entropy_coef" in settings)
    if "off_policy_mask_threshold" in settings:
        assert 0 < diff["masked"] < 1, diff


if __name__ == "__main__":
    import trl

    print(f"TRL {trl.__version__}, float64, {K} micro-batches of {B} x {T}, beta 0.04; max abs differences")
    print("| loss_type | settings | loss | d loss / d logp | d loss / d entropy | kl, entropy, clip metrics |")
    print("|---|---|---|---|---|---|")
    for loss_type, settings in CASES:
        d = compare(loss_type, settings)
        print(f"| {loss_type} | {settings or 'defaults'} | {d['loss']:.1e} | {d['grad']:.1e} | "
              f"{d['entropy_grad']:.1e} | {d['metrics']:.1e} |")
