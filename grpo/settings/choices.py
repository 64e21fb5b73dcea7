"""What a setting may say, where the runtime implements the choices: optimizers and schedules (policy/optim.py),
trackers (run/trackers.py), save and evaluation strategies (plan.py's Cadence); and what a value means where several
components read the answer (the reference, each prompt once, LoRA's targets, the prompt length planned). The math's
choice lists (loss types, reward scales...) stay in grpo/algo, which settings reads; nothing here imports torch."""
from __future__ import annotations

OPTIMIZERS = ("adamw_8bit", "adamw")  # policy/optim.build_optimizer; transformers' names: trl_names.py
# transformers' schedules (get_scheduler's names) but those that step on an evaluation metric
# (reduce_lr_on_plateau, greedy): policy/optim.build_scheduler
SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
             "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")
TRACKERS = ("tensorboard", "trackio", "wandb")  # run/trackers.Trackers
SAVE_STRATEGIES = ("steps", "epoch", "no")  # settings/plan.interval_due; transformers' "best": not implemented
EVAL_STRATEGIES = ("no", "steps", "epoch")  # settings/plan.interval_due: transformers' IntervalStrategy
PLANNED_PROMPT_TOKENS = 512  # max_prompt_length=None (prompts whole): the length the memory plan counts them at
ALL_LINEAR = "all-linear"  # peft's lora target: every linear layer but the output head (policy/lora.py)


def tracker_names(report_to) -> list[str] | None:
    """The trackers `report_to` names ("none", a name, comma-separated names or a list); None if malformed."""
    names = report_to.split(",") if isinstance(report_to, str) else report_to
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return None
    names = [n.strip() for n in names if n.strip()]
    if names == ["none"] or not names:
        return []
    return names if all(n in TRACKERS for n in names) and len(set(names)) == len(names) else None


def planned_prompt_length(config) -> int:
    """The prompt length the memory plan counts: max_prompt_length, or PLANNED_PROMPT_TOKENS when prompts are
    left whole (None)."""
    return config.max_prompt_length or PLANNED_PROMPT_TOKENS


def lora_targets(names) -> tuple[str, ...] | None:
    """The linear layers' own names (q_proj, ...) that lora_target_modules `names` adapts, a full name counting
    as its last part, for the memory planner; None: every one ("all-linear")."""
    return None if not names or names == ALL_LINEAR else tuple(sorted({n.rsplit(".", 1)[-1] for n in names}))


def prompt_once(shared_prompt_forward: bool | None, gradient_checkpointing: bool) -> bool:
    """Whether the training forwards run each distinct prompt once (policy/prefix.py): as asked, and when not asked
    (None) only without gradient checkpointing: with it, the measured peaks were higher than whole rows' on some
    shapes (docs/benchmarks.md, "Each prompt once in the training forwards")."""
    return not gradient_checkpointing if shared_prompt_forward is None else shared_prompt_forward


def reference_kind(use_lora: bool, beta: float) -> str:
    """Where the KL penalty's reference policy comes from: "none" (beta == 0: no reference forward at all),
    "adapter" (LoRA: the policy with its adapter disabled) or "copy" (full fine-tuning: a frozen copy)."""
    return "none" if beta == 0 else "adapter" if use_lora else "copy"
