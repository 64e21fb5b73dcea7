"""grpo: a small, memory-lean GRPO trainer for language models."""
from .config import Config

__all__ = ["Config", "Trainer"]
__version__ = "0.1.0"


def __getattr__(name):
    # Imported on first use, so that `from grpo import Config` (recipes, --help) does not load torch.
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
