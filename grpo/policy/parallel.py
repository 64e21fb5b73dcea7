"""The policy wrapped for data parallelism across ranks: DDP keeps a full replica on every rank and averages
gradients; FSDP2 (`fully_shard`) keeps only a shard of the weights, gradients and optimizer state per rank.

Both act through hooks on a module's forward, but the trainer's log-probs skip the transformers forward
(they never build the full logits). So every forward that trains, or needs the weights, runs as
`policy(fn)`: `fn(model)` called inside the forward of a root module that DDP or FSDP wraps."""
from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from .models import device_of, unwrap


class _Root(nn.Module):
    """Its forward runs `fn(model)`, so that DDP / FSDP hooks fire around whatever `fn` does."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, fn):
        out = fn(self.model)
        # FSDP2 hooks the output for backward and warns that an in-place op on a view would lose the hook.
        unview = lambda t: t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t  # noqa: E731
        return tuple(map(unview, out)) if isinstance(out, tuple) else unview(out)


class ParallelPolicy:
    """Forward, backward and saving of `model` as its wrapping needs them. One process: no wrapper, every
    call goes straight to the model."""

    def __init__(self, model, world_size: int, fsdp: bool = False, bf16: bool = False):
        self.model = model
        self.world_size = world_size
        self.kind = "single" if world_size == 1 else "fsdp" if fsdp else "ddp"
        self.layers: list[nn.Module] = []
        self.root = None
        if self.kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            device = device_of(model)
            ids = [device.index] if device.type == "cuda" else None
            # DDP broadcasts rank 0's weights here, so every rank starts from the same (e.g. LoRA) initialization.
            self.root = DistributedDataParallel(_Root(model), device_ids=ids, gradient_as_bucket_view=True)
        elif self.kind == "fsdp":
            self.root, self.layers = _wrap_fsdp(model, bf16)

    def close(self) -> None:
        """Let go of the DDP wrapper before the process group ends (infra/distributed.shutdown). Its C++
        reducer holds the group and is freed with the GIL held: were it the group's last holder, gloo's
        destructor would wait, GIL held, for its worker thread, which needs the GIL: a hang at exit. Nothing
        runs through the policy after this."""
        if self.kind == "ddp":  # FSDP holds the group from Python alone
            self.root = None

    def __call__(self, fn):
        """`fn(model)`, inside the wrapper's forward."""
        return fn(self.model) if self.root is None else self.root(fn)

    def unsharded(self, fn):
        """`fn(model)` with the whole weights at hand, for sampling. Under FSDP every layer is gathered once for
        the whole call instead of once per generated token, at the cost of holding the full weights meanwhile."""
        if self.kind != "fsdp":
            return fn(self.model)
        try:
            return self.root(lambda model: self._gathered(fn, model))
        finally:
            self.reshard()

    def reshard(self) -> None:
        """After forwards that no backward follows (sampling, an eval loss): under FSDP the root unit keeps its
        weights gathered for the backward it expects, where a checkpoint saved next would find whole tensors."""
        if self.kind == "fsdp":
            self.root.reshard()

    def _gathered(self, fn, model):
        for layer in self.layers:
            layer.set_reshard_after_forward(False, recurse=False)
            layer.unshard()
        try:
            return fn(model)
        finally:
            for layer in self.layers:
                layer.reshard()
                layer.set_reshard_after_forward(True, recurse=False)

    def sync_gradients(self, sync: bool):
        """Context for one micro-batch's forward and backward. DDP all-reduces only on the last one (gradients
        accumulate locally before); FSDP reduce-scatters every one, so gradients stay sharded."""
        return self.root.no_sync() if self.kind == "ddp" and not sync else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Each rank's loss is already divided by the step's global token (or sequence) count, so the ranks'
        gradients must add up; DDP and FSDP average them, hence the world-size factor."""
        (loss if self.root is None else loss * self.world_size).backward()

    # --- checkpoints: FSDP gathers the shards into whole tensors on rank 0, and cuts them up again to load ---
    def full_state_dict(self) -> dict | None:
        """Under FSDP the full weights, gathered onto rank 0's CPU (others get {}); a collective, so every rank
        calls it. None otherwise: the model's own state dict is whole."""
        if self.kind != "fsdp":
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # Gathering unties tied weights (embeddings and LM head): keep one name each, as save_pretrained does.
        first: dict[int, str] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if first.setdefault(id(param), name) != name:
                state.pop(name, None)
        return state

    def optimizer_state(self, optimizer) -> dict:
        """The optimizer's state dict; under FSDP gathered whole onto rank 0 (a collective; {} elsewhere)."""
        if self.kind != "fsdp":
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole, on rank 0's CPU
        return get_optimizer_state_dict(self.model, optimizer, options=options)

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        if self.kind != "fsdp":
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def load_weights(self, checkpoint: Path) -> None:
        """A checkpoint's weights into the model, each rank reading the files: the adapter under peft, else every
        weight (FSDP keeps its shards of them); a one-line error when they do not fit (another model, another
        LoRA rank). Writing them is run/checkpoint.py's."""
        from safetensors.torch import load_file

        if hasattr(self.model, "peft_config"):  # never sharded: fsdp is for full fine-tuning (check_settings)
            from peft import get_peft_model_state_dict, set_peft_model_state_dict

            state = load_file(checkpoint / "adapter_model.safetensors")
            _check_shapes(state, get_peft_model_state_dict(self.model), checkpoint)
            result = set_peft_model_state_dict(self.model, state)
            missing = [k for k in result.missing_keys if "lora_" in k]
        else:
            state = {}
            for shard in sorted(checkpoint.glob("*.safetensors")):
                state.update(load_file(shard))
            _check_shapes(state, self.model.state_dict(), checkpoint)  # DTensors report their full shape
            if self.kind == "fsdp":
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

                # Not strict: tied weights (embeddings and LM head) are saved under one name only.
                set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=False))
                return
            result = self.model.load_state_dict(state, strict=False)  # tied weights: saved under one name too
            own = self.model.state_dict()
            loaded = {own[name].data_ptr() for name in state if name in own}
            missing = [k for k in result.missing_keys if own[k].data_ptr() not in loaded]
        if missing or result.unexpected_keys:
            raise ConfigError(f"{checkpoint} does not fit this model: missing {missing[:3]}, "
                              f"unexpected {result.unexpected_keys[:3]} (is --model the one it was trained from?)")


def _check_shapes(saved: dict, own: dict, checkpoint: Path) -> None:
    """ConfigError, instead of torch's size-mismatch traceback, when the checkpoint's tensors do not fit the
    model's (another model, or another LoRA rank): the first few, and how many in all."""
    clashes = [f"{name} {tuple(saved[name].shape)} vs {tuple(own[name].shape)}" for name in saved
               if name in own and saved[name].shape != own[name].shape]
    if clashes:
        raise ConfigError(f"{checkpoint} does not fit this model: {len(clashes)} tensors of another shape "
                          f"(saved vs this model), e.g. {', '.join(clashes[:2])}; resume with the model it was "
                          f"trained from (--model, or the recipe's build_model, as when it was saved)")


def check_settings(world_size: int, fsdp: bool, optim: str, use_lora: bool) -> None:
    """Fail before any model is loaded on settings the wrapping cannot run."""
    if world_size == 1 or not fsdp:
        return
    if use_lora:
        raise ConfigError("fsdp=true is for full fine-tuning: LoRA's adapters and optimizer state are small, and "
                          "sampling needs the whole base model on every GPU anyway; use DDP (fsdp=false)")
    if optim != "adamw":
        raise ConfigError(f'fsdp=true needs optim="adamw" (got {optim!r}): bitsandbytes\' 8-bit AdamW does not '
                          f"accept FSDP's sharded (DTensor) parameters")


def _wrap_fsdp(model, bf16: bool) -> tuple[nn.Module, list[nn.Module]]:
    """One FSDP unit per transformer block (as transformers names them in `_no_split_modules`), and the
    root unit holding the rest: embeddings, final norm, LM head."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    block_names = set(getattr(unwrap(model), "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in block_names]
    if not layers:
        raise ConfigError(f"fsdp: no transformer blocks found to shard in {type(unwrap(model)).__name__} "
                         f"(looked for its _no_split_modules: {sorted(block_names) or 'none declared'})")
    # fully_shard keeps each rank's own values: start from rank 0's, as DDP does.
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        dist.broadcast(tensor.detach(), src=0)
    # bf16 (Precision.bf16: decided in policy/precision.py) all-gathers and computes in bf16, with float32
    # gradient reduction and float32 sharded master weights.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    return fully_shard(_Root(model), mp_policy=mp), layers
