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
