"""The optimizer (8-bit or torch AdamW) and the warmup + decay learning-rate schedule."""
from __future__ import annotations

import math

import torch

OPTIMIZERS = ("adamw_8bit", "adamw")
SCHEDULES = ("cosine", "linear", "constant")


def build_optimizer(params, name: str, lr: float, betas: tuple[float, float], weight_decay: float):
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    if name == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "adamw":
        # The fused kernel updates each tensor in one pass: the default implementations allocate float32
        # temporaries as large as the largest tensor (CPU) or as all the states together (CUDA, foreach).
        fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused or None)
    raise ValueError(f"unknown optim {name!r}; valid: {', '.join(OPTIMIZERS)}")


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Linear warmup from 0, then cosine or linear decay to 0 (or constant) over the remaining steps."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr_scheduler_type {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def set_hyperparameters(optimizer, scheduler, lr: float, betas: tuple[float, float], weight_decay: float) -> None:
    """Apply the current settings over the ones a loaded optimizer and schedule state brought along,
    keeping the schedule's position."""
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(lr=lr * factor(scheduler.last_epoch), initial_lr=lr, betas=betas, weight_decay=weight_decay)


def build_scheduler(optimizer, total_steps: int, warmup_ratio: float, schedule: str):
    warmup_steps = math.ceil(warmup_ratio * total_steps)
    lr_multiplier(0, total_steps, warmup_steps, schedule)  # fail fast on an unknown schedule
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, total_steps, warmup_steps, schedule)
    )
