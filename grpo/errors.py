"""Exceptions that mean "the input or the run went wrong", not "grpo has a bug": `python -m grpo.train`
prints their message alone, without a traceback, and exits with `exit_code`."""
from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix from the message alone."""

    exit_code = 1


class ConfigError(UserError, ValueError):
    """A bad recipe, setting or override (a ValueError too, for code that catches those)."""

    exit_code = 2


class DatasetError(UserError, ValueError):
    """A dataset the trainer cannot use: no `prompt` column, empty, prompts of the wrong type."""


class TrainingStopped(UserError):
    """Training cannot usefully go on (e.g. the loss stayed non-finite); the message says why and what to do."""


def nonfinite_stop(step: int, streak: int, max_nonfinite_steps: int, newest_checkpoint) -> TrainingStopped:
    """The error that ends a run after `streak` skipped updates in a row."""
    return TrainingStopped(
        f"stopped at step {step}: the loss or gradient norm was NaN/inf for {streak} steps in a row "
        f"(max_nonfinite_steps={max_nonfinite_steps}); their updates were skipped, so the weights are those of "
        f"step {step - streak}. Newest checkpoint: {newest_checkpoint or 'none yet'}. Try a lower --learning_rate "
        f"or --max_grad_norm, or check the rewards, then --resume_from_checkpoint=latest.")
