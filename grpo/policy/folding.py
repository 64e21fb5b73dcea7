"""LoRA adapters folded into their base weights while sampling: each decoding step then runs one matmul per
linear layer instead of peft's base matmul, dropout, A, B, scaling and sum (about 1,000 small operations a step
for SmolLM2-135M with adapters on every linear).

The fold writes W + scale * B @ A into a separate tensor that stands in for the base weight during the decode;
the base weight itself is never written, so the reference (the adapter switched off) stays bit for bit what it
was. Layers are folded only where that is exact enough: float32 base weights (a bf16 sum would round away an
update smaller than 1/256 of the weight, so sampling would not draw from the trained policy), plain torch
linears (not 4-bit or sharded ones), vanilla LoRA with one active adapter (no DoRA or LoRA bias)."""
from __future__ import annotations

import contextlib

import torch


def foldable_layers(model) -> list:
    """The peft LoRA layers of `model` that `folded_adapters` folds; empty when any LoRA layer cannot be
    folded exactly enough (then none is: one rule for the whole decode)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        base = layer.get_base_layer()
        names = layer.active_adapters
        if (len(names) != 1 or names[0] not in layer.lora_A or layer.disable_adapters or layer.merged
                or type(base) is not torch.nn.Linear or type(base.weight.data) is not torch.Tensor
                or base.weight.dtype != torch.float32 or names[0] in getattr(layer, "lora_variant", {})
                or getattr(layer, "lora_bias", {}).get(names[0], False)):
            return []
    return layers


@contextlib.contextmanager
def folded_adapters(model):
    """Within the context, every foldable LoRA layer of `model` (see `foldable_layers`) computes with its base
    weight plus its adapter's update, held in a new tensor, and skips the adapter; on exit the original base
    weights (the same tensors, never written) and the adapters are back."""
    layers = foldable_layers(model)
    originals = []
    try:
        with torch.no_grad():
            for layer in layers:
                name, base = layer.active_adapters[0], layer.get_base_layer()
                originals.append((layer, base.weight))
                folded = base.weight + layer.get_delta_weight(name)  # [out, in], a new tensor
                base.weight = torch.nn.Parameter(folded, requires_grad=False)
                layer.merged_adapters = [name]  # peft's forward: the base layer alone
        yield
    finally:
        for layer, weight in originals:
            layer.get_base_layer().weight = weight
            layer.merged_adapters = []
