"""Exceptions that mean "the input or the run went wrong", not "grpo has a bug": `python -m grpo.train`
prints their message alone, without a traceback, and exits with `exit_code`. Their hints name settings in the
caller's language: `--key=value` under the command line (`command_line()`), `key=value` from Python."""
from __future__ import annotations

import contextlib
import contextvars

# Set by the entry points (grpo.train, grpo.eval) for their run: an explicit mark, so that a script whose own
# sys.argv holds --flags still reads Python in its messages.
_COMMAND_LINE = contextvars.ContextVar("grpo_command_line", default=False)


@contextlib.contextmanager
def command_line():
    """Within it, messages name settings as `python -m grpo.train` takes them (`--key=value`)."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def setting(key: str, value=None, cli: str | None = None) -> str:
    """Setting `key` (set to `value`) as the caller writes it: `--key=text` on the command line (`cli`: its text
    there when that is not the value's own, such as "latest" for True), `key=value` as a Config keyword from
    Python; the name alone without a value."""
    if _COMMAND_LINE.get():
        if value is None and cli is None:
            return f"--{key}"
        text = cli if cli is not None else str(value).lower() if isinstance(value, bool) else str(value)
        return f"--{key}={text}"
    return key if value is None else f"{key}={value!r}"


def resume_hint() -> str:
    """How the caller continues a run from the newest checkpoint in its output_dir."""
    return setting("resume_from_checkpoint", True, cli="latest") + ("" if _COMMAND_LINE.get() else " in the Config")


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
        f"step {step - streak}. Newest checkpoint: {newest_checkpoint or 'none yet'}. Try a lower "
        f"{setting('learning_rate')} or {setting('max_grad_norm')}, or check the rewards, then {resume_hint()}.")
