"""Saving a `Trainer` into checkpoint-STEP and resuming one from it: the weights, optimizer, schedule, data
position, step and skipped-step counters, with each rank's RNG states and unfinished generation batch.
checkpoint.py does the files (atomic writes, finding a checkpoint, trimming the logs); this module knows
which parts of a Trainer make up its state."""
from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from .batches import generation_from_dict
from .checkpoint import (changed_settings, check_no_earlier_run, drop_log_lines_after, find_checkpoint, load_state,
                         rng_state, save_checkpoint, set_rng_state)
from .errors import ConfigError
from .optim import set_hyperparameters

if TYPE_CHECKING:
    from .trainer import Trainer


def save(trainer: Trainer) -> Path:
    """Write checkpoint-STEP with everything `resume` needs (once per step); returns its path. Under
    torchrun every rank calls it (gathering is collective) and rank 0 writes, with every rank's RNG
    states and generation batch; the others wait until the checkpoint is complete."""
    t = trainer
    if t.saved_step != t.step:
        # A generation batch that later steps still use travels with the checkpoint.
        mid_batch = t.step % t.config.num_iterations != 0
        own = {"rng": rng_state(), "generation": asdict(t.generation) if mid_batch else None}
        state = {"step": t.step, "optimizer": t.policy.optimizer_state(t.optimizer),
                 "scheduler": t.scheduler.state_dict(), "prompts": t.prompts.state_dict(),
                 "nonfinite": (t.nonfinite_streak, t.nonfinite_total),
                 **(own if t.dist.world_size == 1 else {"ranks": t.dist.gather_to_main(own)})}
        model_state = t.policy.full_state_dict()  # gathered from the shards under FSDP
        if t.dist.is_main:
            save_checkpoint(str(t.output_dir), t.step, t.model, t.tokenizer, asdict(t.config),
                            state, t.config.save_total_limit, model_state=model_state)
        t.dist.barrier()
        t.last_checkpoint = t.output_dir / f"checkpoint-{t.step}"
        t.saved_step = t.step
    return t.last_checkpoint


def resume(trainer: Trainer, checkpoint: str) -> None:
    """Continue from `checkpoint`, a folder or "latest" (the newest complete one in output_dir; none
    yet means step 0): weights, optimizer, schedule, RNG states, data position and step. Lines of the
    run's logs written after that step are dropped, so the metrics stream continues without repeats."""
    t = trainer
    path = find_checkpoint(checkpoint, str(t.output_dir))
    state = load_state(path) if path is not None else {"step": 0}
    if path is None:
        print(f"no checkpoint in {t.output_dir} yet: starting from step 0", file=sys.stderr)
    else:
        for change in changed_settings(path, asdict(t.config)):
            print(f"resuming with a changed setting: {change}", file=sys.stderr)
        t.policy.load_weights(path)
        _load_state(t, state, path)
        t.last_checkpoint = path
        t.saved_step = state["step"]
    t.step = state["step"]
    if t.dist.is_main:  # the one writer of the logs
        drop_log_lines_after(str(t.output_dir), t.step)


def _load_state(t: Trainer, state: dict, path: Path) -> None:
    cfg = t.config
    saved_ranks = len(state.get("ranks", [state]))
    if saved_ranks != t.dist.world_size:
        raise ConfigError(f"{path} was saved by {saved_ranks} rank(s) and holds each one's sampling state: "
                          f"resume it with as many (torchrun --nproc_per_node={saved_ranks}), not "
                          f"{t.dist.world_size}")
    own = state if saved_ranks == 1 else state["ranks"][t.dist.rank]
    t.policy.load_optimizer_state(t.optimizer, state["optimizer"])
    t.scheduler.load_state_dict(state["scheduler"])
    set_hyperparameters(t.optimizer, t.scheduler, cfg.learning_rate, (cfg.adam_beta1, cfg.adam_beta2),
                        cfg.weight_decay)
    t.prompts.load_state_dict(state["prompts"])
    t.nonfinite_streak, t.nonfinite_total = state["nonfinite"]
    if own["generation"] is not None:
        t.generation = generation_from_dict(own["generation"], t.device)
    set_rng_state(own["rng"])


def start_or_resume(trainer: Trainer) -> None:
    """Resume `config.resume_from_checkpoint` when set; otherwise refuse an output_dir that holds an
    earlier run. Either way the output_dir exists afterwards."""
    if trainer.step == 0 and trainer.config.resume_from_checkpoint:
        trainer.resume(trainer.config.resume_from_checkpoint)
    elif trainer.step == 0:
        check_no_earlier_run(str(trainer.output_dir))
    trainer.output_dir.mkdir(parents=True, exist_ok=True)


def save_if_trained(trainer: Trainer) -> Path | None:
    return trainer.save() if trainer.step > 0 else None


def save_after_error(trainer: Trainer) -> None:
    """Keep the steps done before a failing one; never let the save hide the error itself."""
    try:
        path = save_if_trained(trainer)
    except Exception as save_error:
        print(f"could not save a checkpoint after the error below: {save_error!r}", file=sys.stderr)
        return
    if path is not None:
        print(f"step {trainer.step + 1} failed; {path} holds the state after step {trainer.step}", file=sys.stderr)
