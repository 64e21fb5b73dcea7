"""A checkpoint's weight files read into a model: the LoRA adapter under peft, else every weight, with a
one-line error when they do not fit (another model, another LoRA rank). Writing them is run/checkpoint.py's."""
from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError


def load_weights(model, checkpoint: Path) -> None:
    """Load the checkpoint's weights into `model`: the adapter under peft, else every weight (tied ones
    are saved once, under one of their names)."""
    from safetensors.torch import load_file

    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        state = load_file(checkpoint / "adapter_model.safetensors")
        check_shapes(state, get_peft_model_state_dict(model), checkpoint)
        result = set_peft_model_state_dict(model, state)
        missing = [k for k in result.missing_keys if "lora_" in k]
    else:
        state = read_weights(checkpoint)
        check_shapes(state, model.state_dict(), checkpoint)
        result = model.load_state_dict(state, strict=False)
        own = model.state_dict()
        loaded = {own[name].data_ptr() for name in state if name in own}
        missing = [k for k in result.missing_keys if own[k].data_ptr() not in loaded]
    if missing or result.unexpected_keys:
        raise ConfigError(f"{checkpoint} does not fit this model: missing {missing[:3]}, "
                          f"unexpected {result.unexpected_keys[:3]} (is --model the one it was trained from?)")


def check_shapes(saved: dict, own: dict, checkpoint: Path) -> None:
    """ConfigError, instead of torch's size-mismatch traceback, when the checkpoint's tensors do not fit the
    model's (another model, or another LoRA rank): the first few, and how many in all."""
    clashes = [f"{name} {tuple(saved[name].shape)} vs {tuple(own[name].shape)}" for name in saved
               if name in own and saved[name].shape != own[name].shape]
    if clashes:
        raise ConfigError(f"{checkpoint} does not fit this model: {len(clashes)} tensors of another shape "
                          f"(saved vs this model), e.g. {', '.join(clashes[:2])}; resume with the model it was "
                          f"trained from (--model, or the recipe's build_model, as when it was saved)")


def read_weights(checkpoint: Path) -> dict:
    """Every weight a full (not LoRA) checkpoint holds, by name."""
    from safetensors.torch import load_file

    state = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        state.update(load_file(shard))
    return state
