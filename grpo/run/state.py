"""The run's own state, which the trainer keeps and hands to what reads it: transformers' `TrainerState`
(reward functions' `trainer_state`, callbacks' `state`), the watch on steps without a learning signal, and the
random generators' states a checkpoint or an undone step restores."""
from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm


@dataclass
class TrainerState:
    """transformers' TrainerState, the fields of it most read (docs/coming-from-trl.md)."""

    global_step: int = 0  # optimizer steps done
    max_steps: int = 0  # optimizer steps of the run
    epoch: float = 0.0  # passes over the training prompts done, a fraction within one (Schedule.epoch)
    log_history: list[dict] = field(default_factory=list)  # every logged line (run/report.py)
    is_world_process_zero: bool = True  # rank 0 of all, the one that writes
    is_local_process_zero: bool = True  # rank 0 of this machine

    @classmethod
    def of(cls, max_steps: int, dist) -> TrainerState:
        """A run's state at its start: `max_steps` optimizer steps on `dist`'s ranks (infra/distributed)."""
        return cls(max_steps=max_steps, is_world_process_zero=dist.is_main,
                   is_local_process_zero=dist.local_rank == 0)


class NoSignalWatch:
    """Says once, on stderr, when `patience` steps in a row had no group with unequal rewards: every advantage
    was 0 and the policy could not change. `update` takes each step's frac_reward_zero_std."""

    def __init__(self, patience: int = 3):
        self.patience, self.streak, self.warned = patience, 0, False

    def update(self, frac_zero_std: float, show: bool = True) -> str | None:
        self.streak = self.streak + 1 if frac_zero_std >= 1.0 else 0
        if self.warned or self.streak < self.patience:
            return None
        self.warned = True
        message = (f"warning: no learning signal for {self.streak} steps in a row: in every group all completions "
                   f"got the same reward, so every advantage is 0 and the policy does not change "
                   f"(frac_reward_zero_std = 1). What usually fixes it: a worked example turn in the prompt showing "
                   f"the expected format, a higher --temperature or more --num_generations (more varied "
                   f"completions), or partial-credit rewards (e.g. 0.5 for a near-miss) so that some completions "
                   f"score differently. (warned once)")
        if show:
            tqdm.write(message, file=sys.stderr)
        return message


def rng_state() -> dict:
    """Every generator sampling, dropout or a reward function may draw from."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (name, keys.tolist(), pos, has_gauss, gauss),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][:torch.cuda.device_count()])
