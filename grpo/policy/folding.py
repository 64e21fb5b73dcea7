"""The weights sampling decodes with: LoRA adapters folded into their base weights for the length of a decode, and
on a CPU the LM head's weight packed for oneDNN (`sampling_weights`).

Folding: each decoding step then runs one matmul per linear layer instead of peft's base matmul, dropout, A, B,
scaling and sum (about 1,000 small operations a step for SmolLM2-135M with adapters on every linear). The fold
writes W + scale * B @ A into a separate tensor, stored transposed (`x @ W.T` with 16-64 rows reads [in, out]
faster, docs/benchmarks.md), that stands in for the base weight during the decode; the base weight itself is
never written, so the reference (the adapter switched off) stays bit for bit what it was. Layers are folded only
where that is exact enough: float32 base weights (a bf16 sum would round away an update smaller than 1/256 of
the weight), plain torch linears, vanilla LoRA with one active adapter (`plain_lora`).

Packing: only the LM head's product, one call per step over a [V, H] weight, is faster packed (float32 results;
the body's linears are not, at a decoding step's rows: docs/benchmarks.md); its packed copy lives only during the
decode."""
from __future__ import annotations

import contextlib
import sys

import torch

from .int8 import int8_copy


def foldable_layers(model) -> list:
    """The peft LoRA layers of `model` that `sampling_weights` folds; empty when any LoRA layer cannot be
    folded exactly enough (then none is: one rule for the whole decode)."""
    # A model with LoRA layers has imported peft; without them, importing it here would only add to the RSS.
    lora = sys.modules.get("peft.tuners.lora")
    layers = [] if lora is None else [m for m in model.modules() if isinstance(m, lora.LoraLayer)]
    return layers if all(plain_lora(m) and _plain_float32(m.get_base_layer().weight) for m in layers) else []


def plain_lora(layer) -> bool:
    """Whether the peft LoRA layer `layer` adds its one active adapter, vanilla LoRA (no DoRA or LoRA bias),
    unmerged, to a plain torch linear: `W x + scale * B A x`, which a fold or policy/decoder computes."""
    base, names = layer.get_base_layer(), layer.active_adapters
    return not (len(names) != 1 or names[0] not in layer.lora_A or layer.disable_adapters or layer.merged
                or type(base) is not torch.nn.Linear or names[0] in getattr(layer, "lora_variant", {})
                or getattr(layer, "lora_bias", {}).get(names[0], False))


def _plain_float32(weight: torch.Tensor) -> bool:
    return type(weight.data) is torch.Tensor and weight.dtype == torch.float32


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None):
    """A linear layer's forward on `weight` [out, in] reordered for oneDNN (float32, no autograd)."""
    packed = weight.detach().to_mkldnn()
    packed_bias = (bias.detach() if bias is not None else weight.new_zeros(weight.shape[0])).to_mkldnn()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), packed, packed_bias).to_dense()  # [.., out]
    return forward


@contextlib.contextmanager
def sampling_weights(model, int8: bool = False):
    """Within the context, every `foldable_layers` LoRA layer of `model` computes with its folded weight, and
    skips the adapter. Yields the LM head's product on a oneDNN-packed copy (for policy/head's `head_logits`),
    or None where it is not packed (not a float32 torch linear on a CPU); with `int8`, on an int8 copy
    (policy/int8). On exit the original weights (the same tensors, never written) and adapters are back."""
    layers = foldable_layers(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swapped = []
    try:
        with torch.no_grad():
            for layer in layers:
                name, base = layer.active_adapters[0], layer.get_base_layer()
                # [out, in], a new tensor stored transposed: the layout a product with few rows reads fastest
                folded = (base.weight + layer.get_delta_weight(name)).T.contiguous().T
                layer.merged_adapters = [name]  # peft's forward: the base layer alone
                swapped.append((layer, base.weight))
                base.weight = torch.nn.Parameter(folded, requires_grad=False)
            # The head's [V, H] product is a fifth of a SmolLM2 decoding step: packed (a plain float32 torch linear
            # on a CPU whose torch build has oneDNN), used by the decode.
            head_matmul = None
            if (type(head) is torch.nn.Linear and _plain_float32(head.weight) and head.weight.device.type == "cpu"
                    and torch.backends.mkldnn.is_available()):
                head_matmul = int8_copy(head) if int8 else _packed_forward(head.weight, head.bias)
        yield head_matmul
    finally:
        for layer, weight in swapped:
            layer.get_base_layer().weight = weight
            layer.merged_adapters = []
