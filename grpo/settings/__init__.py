"""A run's settings: the one `Config`, TRL's settings as this trainer takes them, the checks of their values, the
run plan with its batch schedule and each component's settings, `--key=value` parsing and recipe files (a row per
module: docs/architecture.md). Read by every other package; reads none of the runtime, only grpo/algo's choices."""
from .config import Config

__all__ = ["Config"]
