"""The weights sampling decodes with: LoRA adapters folded into their base weights, and on a CPU every body linear
layer's weight packed for oneDNN, for the length of a decode (`sampling_weights`).

Folding: each decoding step then runs one matmul per linear layer instead of peft's base matmul, dropout, A, B,
scaling and sum (about 1,000 small operations a step for SmolLM2-135M with adapters on every linear). The fold
writes W + scale * B @ A into a separate tensor that stands in for the base weight during the decode; the base
weight itself is never written, so the reference (the adapter switched off) stays bit for bit what it was.
Layers are folded only where that is exact enough: float32 base weights (a bf16 sum would round away an update
smaller than 1/256 of the weight, so sampling would not draw from the trained policy), plain torch linears (not
4-bit or sharded ones), vanilla LoRA with one active adapter (no DoRA or LoRA bias).

Packing: oneDNN's float32 matmul on a weight reordered once for it (`to_mkldnn`) takes less time than torch's
default CPU matmul (docs/benchmarks.md, "Sampling and evaluation speed"), with float32 results (differences of a
few float32 roundings, as between any two matmul kernels). The packed copies live only during the decode; the LM
head's is handed to the decode (policy/head's `head_logits`), which reads the head's weight itself."""
from __future__ import annotations

import contextlib
import sys

import torch


def foldable_layers(model) -> list:
    """The peft LoRA layers of `model` that `sampling_weights` folds; empty when any LoRA layer cannot be
    folded exactly enough (then none is: one rule for the whole decode)."""
    layers = _lora_layers(model)
    for layer in layers:
        base = layer.get_base_layer()
        names = layer.active_adapters
        if (len(names) != 1 or names[0] not in layer.lora_A or layer.disable_adapters or layer.merged
                or type(base) is not torch.nn.Linear or not _plain_float32(base.weight)
                or names[0] in getattr(layer, "lora_variant", {})
                or getattr(layer, "lora_bias", {}).get(names[0], False)):
            return []
    return layers


def _lora_layers(model) -> list:
    # A model with LoRA layers has imported peft; without them, importing it here would only add to the RSS.
    lora = sys.modules.get("peft.tuners.lora")
    return [] if lora is None else [m for m in model.modules() if isinstance(m, lora.LoraLayer)]


def _plain_float32(weight: torch.Tensor) -> bool:
    return type(weight.data) is torch.Tensor and weight.dtype == torch.float32


def packable(linear: torch.nn.Module) -> bool:
    """A plain float32 torch linear on a CPU whose torch build has oneDNN."""
    return (type(linear) is torch.nn.Linear and _plain_float32(linear.weight) and linear.weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available())


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None):
    """A linear layer's forward on `weight` [out, in] reordered for oneDNN (float32, no autograd)."""
    packed = weight.detach().to_mkldnn()
    packed_bias = (bias.detach() if bias is not None else weight.new_zeros(weight.shape[0])).to_mkldnn()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), packed, packed_bias).to_dense()  # [.., out]
    return forward


@contextlib.contextmanager
def sampling_weights(model):
    """Within the context, every foldable LoRA layer of `model` (see `foldable_layers`) computes with its base
    weight plus its adapter's update, held in a new tensor, and skips the adapter; on a CPU every packable
    linear of the body runs on a oneDNN-packed copy of its (folded) weight. Yields the LM head's product on a
    packed copy (`hidden -> logits`, for policy/head's `head_logits`), or None where it is not packed. On exit
    the original weights (the same tensors, never written), forwards and adapters are back."""
    layers = foldable_layers(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swapped, packed = [], []
    try:
        with torch.no_grad():
            folded = {}
            for layer in layers:
                name, base = layer.active_adapters[0], layer.get_base_layer()
                folded[base] = base.weight + layer.get_delta_weight(name)  # [out, in], a new tensor
                layer.merged_adapters = [name]  # peft's forward: the base layer alone
                swapped.append(layer)
            adapters = {id(m) for layer in _lora_layers(model) for d in (layer.lora_A, layer.lora_B)
                        for m in d.values()}  # their own small linears: folded, or left to peft
            for module in model.modules():
                if module is head or id(module) in adapters or not isinstance(module, torch.nn.Linear):
                    continue
                if packable(module):
                    module.forward = _packed_forward(folded.pop(module, module.weight), module.bias)
                    packed.append(module)
            for base, weight in folded.items():  # not packed (a GPU): the folded weight stands in
                swapped.append((base, base.weight))
                base.weight = torch.nn.Parameter(weight, requires_grad=False)
            # The head's [V, H] product is a fifth of a SmolLM2 decoding step: packed too, used by the decode.
            head_matmul = _packed_forward(head.weight, head.bias) if head is not None and packable(head) else None
        yield head_matmul
    finally:
        for module in packed:
            del module.forward  # the class's forward again
        for item in swapped:
            if isinstance(item, tuple):
                item[0].weight = item[1]
            else:
                item.merged_adapters = []
