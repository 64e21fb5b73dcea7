"""The optimizer (8-bit or torch AdamW) and transformers' learning-rate schedules."""
from __future__ import annotations

import math
import sys

import torch
from tqdm.auto import tqdm

from ..errors import ConfigError, nonfinite_stop
from ..settings.choices import OPTIMIZERS, SCHEDULES
from .rounding import StochasticRoundingAdamW, stochastic_round_to_bf16

# Elements per 8-bit optimizer update on CPU (a multiple of bitsandbytes' 256-element block): bounds its
# float32 temporaries; the memory planner counts them
BNB_CPU_SLICE = 1 << 22


def build_optimizer(params, name: str, lr: float, betas: tuple[float, float], weight_decay: float):
    """AdamW over the trainable `params`; bf16 ones (`bf16_weights`) are updated in float32 and written back
    with stochastic rounding, by either optimizer."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters (all frozen: with use_lora=false, unfreeze them)")
    if name == "adamw_8bit":
        return _sliced_adamw_8bit()(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "adamw" and any(p.dtype == torch.bfloat16 for p in params):
        return StochasticRoundingAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, slice_size=BNB_CPU_SLICE)
    if name == "adamw":
        # The fused kernel updates each tensor in one pass: the default implementations allocate float32
        # temporaries as large as the largest tensor (CPU) or as all the states together (CUDA, foreach).
        fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused or None)
    raise ValueError(f"unknown optim {name!r}; valid: {', '.join(OPTIMIZERS)}")


def _sliced_adamw_8bit():
    """bitsandbytes' AdamW8bit, except that big tensors on CPU, and bf16 weights anywhere, are updated in slices
    of whole quantization blocks, to the same result. Its CPU kernel works on float32 copies of a whole tensor's
    two states, gradient and update (1.9 GB for a 152k x 512 embedding). A bf16 weight's slice and gradient are
    updated as float32 copies, then written back with stochastic rounding (the kernel itself would round to
    nearest and lose small updates)."""
    import bitsandbytes as bnb

    F = bnb.functional

    class SlicedAdamW8bit(bnb.optim.AdamW8bit):
        @torch.no_grad()
        def update_step(self, group, p, gindex, pindex):
            state = self.state[p]
            eight_bit, bf16 = state["state1"].dtype == torch.uint8, p.dtype == torch.bfloat16
            if not bf16 and (p.device.type != "cpu" or not eight_bit or p.numel() <= BNB_CPU_SLICE):
                return super().update_step(group, p, gindex, pindex)
            config = self.get_config(gindex, pindex, group)
            if config["max_unorm"] > 0:  # a whole-tensor norm: slices cannot apply it
                raise ValueError("max_unorm needs whole-tensor updates")
            state["step"] += 1
            p.data = p.data.contiguous()
            betas = config["betas"]
            flat = [t.view(-1) for t in (p.grad.contiguous(), p.data, state["state1"], state["state2"])]
            for start in range(0, p.numel(), BNB_CPU_SLICE):
                end = min(start + BNB_CPU_SLICE, p.numel())
                grad, weight, state1, state2 = (t[start:end] for t in flat)
                weight32, grad = weight.float(), grad.float()  # copies when bf16, the tensors themselves if not
                if eight_bit:
                    blocks = slice(start // 256, -(-end // 256))
                    F.optimizer_update_8bit_blockwise(
                        self.optimizer_name, grad, weight32, state1, state2, betas[0], betas[1],
                        betas[2] if len(betas) >= 3 else 0.0, config.get("alpha", 0.0), config["eps"],
                        state["step"], config["lr"], state["qmap1"], state["qmap2"], state["absmax1"][blocks],
                        state["absmax2"][blocks], config["weight_decay"], gnorm_scale=1.0,
                        skip_zeros=config["skip_zeros"])
                else:  # bitsandbytes keeps float32 states for small tensors
                    F.optimizer_update_32bit(
                        self.optimizer_name, grad, weight32, state1, betas[0], config["eps"], state["step"],
                        config["lr"], state2, betas[1], betas[2] if len(betas) >= 3 else 0.0,
                        config.get("alpha", 0.0), config["weight_decay"], 1.0, None, max_unorm=0.0,
                        skip_zeros=config["skip_zeros"])
                if bf16:
                    weight.copy_(stochastic_round_to_bf16(weight32))

    return SlicedAdamW8bit


def schedule_of(total_steps: int, warmup_steps: int, schedule: str, kwargs: dict | None = None):
    """transformers' learning-rate schedule `schedule` with `kwargs` (TRL's lr_scheduler_kwargs) as a function of
    the step: the multiplier of the peak rate. ConfigError when transformers refuses the kwargs."""
    from transformers import get_scheduler

    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown lr_scheduler_type {schedule!r}; valid: {', '.join(SCHEDULES)}")
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        return get_scheduler(schedule, probe, num_warmup_steps=warmup_steps, num_training_steps=total_steps,
                             scheduler_specific_kwargs=dict(kwargs or {})).lr_lambdas[0]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"lr_scheduler_type={schedule!r} with lr_scheduler_kwargs={kwargs or {}}: {e}") from None


def set_hyperparameters(optimizer, scheduler, lr: float, betas: tuple[float, float], weight_decay: float) -> None:
    """The current settings over those a loaded optimizer and schedule state brought, at the same position."""
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(lr=lr * factor(scheduler.last_epoch), initial_lr=lr, betas=betas, weight_decay=weight_decay)


def warmup_of(total_steps: int, warmup_ratio: float, warmup_steps: float) -> int:
    """Warmup optimizer steps: transformers 5's warmup_steps (whole steps, or below 1 a fraction of the total,
    rounded up), else warmup_ratio's fraction."""
    return int(warmup_steps) if warmup_steps >= 1 else math.ceil(total_steps * (warmup_steps or warmup_ratio))


def build_scheduler(optimizer, total_steps: int, warmup_steps: int, schedule: str, kwargs: dict | None = None):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_of(total_steps, warmup_steps, schedule, kwargs))


def rescheduled(saved_total: int, total_steps: int, step: int, lr: float, warmup_steps: int,
                schedule: str, kwargs: dict | None = None) -> str:
    """What a resume into another number of optimizer steps does to the learning rate: the schedule is the new
    total's (warmup included), continued from the restored step, not the saved run's ended one."""
    head = f"resuming a run of {saved_total} steps as one of {total_steps}"
    if step >= total_steps:
        return f"{head}: step {step} is past its end, so no step is trained"
    now = lr * schedule_of(total_steps, warmup_steps, schedule, kwargs)(step)
    return (f"{head}: the {schedule} learning-rate schedule is now that of {total_steps} steps, from step {step} "
            f"on (lr {now:.3g} for step {step + 1})")


class Updates:
    """The optimizer over `params`' trainable tensors and its learning-rate schedule over `total_steps`, as `s`
    (settings/components.OptimSettings) says, applying the accumulated gradients once per step. A NaN/inf loss or
    gradient norm skips the update (the weights stay finite); `nonfinite` counts the skipped steps (in a row, in
    all), which a checkpoint keeps, and `check` stops the run once `max_nonfinite_steps` were skipped in a row."""

    def __init__(self, params, s, total_steps: int):
        self.params = [p for p in params if p.requires_grad]
        self.optimizer = build_optimizer(self.params, s.name, s.learning_rate, s.betas, s.weight_decay)
        self.warmup_steps = warmup_of(total_steps, s.warmup_ratio, s.warmup_steps)
        self.scheduler = build_scheduler(self.optimizer, total_steps, self.warmup_steps, s.lr_scheduler_type,
                                         s.lr_scheduler_kwargs)
        self.max_grad_norm, self.max_nonfinite_steps = s.max_grad_norm, s.max_nonfinite_steps
        self.nonfinite = (0, 0)

    def apply(self, loss: float, step: int) -> dict:
        """Step `step`'s update of the accumulated gradients (clipped unless max_grad_norm is 0), the schedule
        advanced and the gradients freed; returns its metrics."""
        params, optimizer = self.params, self.optimizer
        if all(p.grad is None for p in params):  # every row's gradient was exactly 0 and skipped (rollout/batches)
            for p in params:  # step as on the zero gradient it stands for: momentum, weight decay, step count go on
                p.grad = torch.zeros_like(p)
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
        # The rate this update uses (the schedule's last one is the saved run's after a resume that changed it).
        metrics = {"learning_rate": optimizer.param_groups[0]["lr"], "grad_norm": grad_norm}
        applied = math.isfinite(loss) and math.isfinite(grad_norm)
        if applied:
            optimizer.step()
        self.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        streak, total = self.nonfinite
        self.nonfinite = (0, total) if applied else (streak + 1, total + 1)
        if not applied:
            tqdm.write(f"step {step + 1}: loss {loss}, grad norm {grad_norm}: update skipped "
                       f"({self.nonfinite[0]} in a row; stopping at {self.max_nonfinite_steps})", file=sys.stderr)
        return {**metrics, "skipped/nonfinite": float(self.nonfinite[1])}

    def check(self, step: int, newest_checkpoint) -> None:
        """TrainingStopped once `max_nonfinite_steps` updates in a row were skipped, at optimizer step `step`."""
        if self.nonfinite[0] >= self.max_nonfinite_steps:
            raise nonfinite_stop(step, self.nonfinite[0], self.max_nonfinite_steps, newest_checkpoint)
