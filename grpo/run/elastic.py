"""Resuming a checkpoint on another number of ranks (docs/several-gpus.md says what is exact). The prompt stream
is global (every rank draws the same prompts), so the data position holds for any number. What cannot carry over
is each rank's sampling state: its RNG states are seeded anew, and a generation batch that later steps were
still to reuse is drawn and sampled again."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch

from ..errors import ConfigError
from ..settings.schedule import Schedule


def saved_ranks(state: dict) -> int:
    """How many ranks wrote `state` (Trainer.state_dict): one keeps its own state at the top level."""
    return len(state["ranks"]) if "ranks" in state else 1


def rank_state(state: dict, rank: int, world_size: int) -> dict | None:
    """This rank's saved sampling state ({"rng", "batches"}: run/supply's), or None when the checkpoint was saved by
    another number of ranks and has none for it."""
    if saved_ranks(state) != world_size:
        return None
    return state if world_size == 1 else state["ranks"][rank]


def unfinished_prompts(state: dict, num_generations: int) -> int:
    """Prompts (over all saved ranks) of the generation batch a checkpoint holds for later steps to reuse; 0
    when it holds none. Resuming on another number of ranks draws this many of the stream's rows again."""
    ranks = state.get("ranks", [state])
    kept = [r["batches"]["generation"] for r in ranks]  # the batch in training (run/synchronous)
    return sum(len(g["batch"]["prompts"]) for g in kept if g) // num_generations


def seed_rank(seed: int, rank: int, step: int) -> None:
    """Seed every generator sampling, dropout or a reward function draws from, from (seed, rank, step): ranks
    differ, and resuming the same checkpoint on as many ranks samples the same again."""
    value = int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)  # and every CUDA device's generator


def rank_change_notes(saved_config: dict, state: dict, config: dict, world_size: int) -> list[str]:
    """What changes when a checkpoint resumes on another number of ranks (none on as many); a global batch
    that changes with the rank count is allowed, as other changed settings are, and said."""
    before = saved_ranks(state)
    if before == world_size:
        return []
    if config["fsdp"] and 1 in (before, world_size):
        # FSDP keeps the optimizer state by parameter name, one process by position (and torch's converter
        # needs a process group): the two formats are not translated.
        where = "one process" if before == 1 else "more than one rank"
        raise ConfigError(f"this checkpoint was saved with fsdp=true by {before} rank(s): FSDP (several ranks) and "
                          f"one process store the optimizer state differently, so resume it on {where}")
    notes = [f"resuming on {world_size} rank(s) a checkpoint of {before}: weights, optimizer, schedule, data "
             f"position and step are as saved; sampling is seeded anew from (seed, rank, step)"]
    unfinished = unfinished_prompts(state, config["num_generations"])
    if unfinished:
        notes.append(f"the generation batch that step {state['step'] + 1} would reuse was sampled by {before} "
                     f"rank(s): its {unfinished} prompts are drawn again and sampled on {world_size}")
    old = Schedule.resolve(SimpleNamespace(**saved_config), before).global_batch
    new = Schedule.resolve(SimpleNamespace(**config), world_size).global_batch
    if old != new:
        per_rank = config["per_device_train_batch_size"] * world_size
        fix = (f"--gradient_accumulation_steps={old // per_rank} keeps it" if old % per_rank == 0 else
               f"per_device_train_batch_size x gradient_accumulation_steps = {old // world_size} keeps it"
               if old % world_size == 0 else f"no batch setting on {world_size} rank(s) keeps it")
        notes.append(f"warning: the global batch changes from {old} to {new} completions per step "
                     f"(per_device_train_batch_size x gradient_accumulation_steps x ranks); {fix}")
    return notes
