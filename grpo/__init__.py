"""grpo: a small, memory-lean GRPO trainer for language models.

`Config` and `Trainer` run it; `load_model` and `load_tokenizer` load a model as the trainer does (a hub id,
a folder, a .gguf file, or a model shipped for offline use such as "smollm2-135m-instruct");
`group_advantages`, `token_logprobs` and `policy_loss` are its math, pure tensor functions to unit-test or reuse
(grpo/algo/)."""
from .infra.libraries import quiet_library_notices
from .settings import Config

# Before any library is imported: see grpo/infra/libraries.py.
quiet_library_notices()

__all__ = ["Config", "Trainer", "load_model", "load_tokenizer", "group_advantages", "token_logprobs", "policy_loss"]
__version__ = "0.1.0"

# Imported on first use, so that `from grpo import Config` (recipes, --help) does not load torch.
_LAZY = {"Trainer": ".trainer", "load_model": ".policy.models", "load_tokenizer": ".policy.models",
         "group_advantages": ".algo.advantages", "token_logprobs": ".algo.logprobs",
         "policy_loss": ".algo.loss"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
