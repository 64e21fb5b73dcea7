"""The bytes of each part a run holds, per element or per token, under the trainer's dtype plan: the pieces
memory/estimate.py adds up into its moments (pure arithmetic)."""
from __future__ import annotations

from dataclasses import dataclass

from ..policy.precision import Precision

BNB_8BIT_MIN_SIZE = 4096  # bitsandbytes keeps 32-bit states for smaller tensors
BNB_BLOCK = 256  # 8-bit optimizer states: one float32 absmax per block


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of each kind of tensor a run holds."""

    base: int  # bytes per frozen or trained base weight element
    compute: int  # activations inside the layers (bf16 under autocast)
    residual: int  # the residual stream between layers
    autocast: bool  # float32 weights under bf16 autocast: each linear keeps a bf16 copy of its weight
    reference: int  # bytes per element of full fine-tuning's frozen reference copy
    dropout_mask: int
    device: str  # "cuda" or "cpu": where they live


def dtypes(plan: Precision, use_lora: bool) -> Dtypes:
    """Bytes per element under the trainer's dtype plan (policy/precision.Precision.plan, the one plan)."""
    base = plan.base_dtype.itemsize
    bf16_trained = base == 2 and not use_lora  # bf16 weights: no autocast copies, everything flows in bf16
    # CUDA dropout keeps a bool mask; CPU dropout keeps a noise tensor, float32 unless the weights are bf16.
    device = "cuda" if plan.device_type == "cuda" else "cpu"
    mask = 1 if device == "cuda" else 2 if bf16_trained else 4
    return Dtypes(base=base, compute=2 if plan.bf16 or base == 2 else 4, residual=base,
                  autocast=plan.bf16 and base == 4, reference=plan.reference_dtype.itemsize, dropout_mask=mask,
                  device=device)


def layer_activations(a, m, d: Dtypes) -> float:
    """Bytes one decoder layer keeps for backward, per token (`m`: settings/plan.MemorySettings)."""
    targets = m.lora_targets
    H, I, q, c = a.hidden_size, a.intermediate_size, a.q_dim, d.compute
    # SDPA keeps q, k, v and its output; under a padding mask transformers repeats k and v to all heads.
    kv = q if a.num_kv_heads < a.num_heads else a.kv_dim
    attention = c * (2 * q + 2 * kv)
    if not m.use_lora:
        norms = 2 * (d.residual * H + 4 * H)  # each RMSNorm keeps its input and its float32 normalized value
        if d.autocast:
            inputs = c * (5 * H + q)  # each linear keeps its own bf16 cast of its input (q, k, v, gate, up, o)
        else:
            inputs = c * (2 * H + q)  # each norm's output (shared by the linears reading it), o_proj's input
        return norms + attention + inputs + 4 * c * I  # MLP: gate, silu(gate), up, their product
    # Frozen linears keep no inputs; the frozen norms keep only their float32 input.
    norms = 2 * 4 * H
    shapes = {n: sh for n, sh in a.linear_shapes().items() if targets is None or n in targets}
    lora = c * m.lora_r * len(shapes)  # A's output, kept by B
    if m.lora_dropout:  # p = 0 dropout returns its input: nothing kept
        lora += sum((c + d.dropout_mask) * i for i, _ in shapes.values())  # each adapter's dropout output and mask
    else:  # A keeps its input, shared by the adapters reading the same tensor
        lora += c * sum(dict((sh[0] if n not in ("o_proj", "down_proj") else n, sh[0])
                             for n, sh in shapes.items()).values())
    return norms + attention + 3 * c * I + lora  # MLP: gate (silu's input), silu(gate), up


def optimizer_bytes(tensors: list[int], optim: str) -> float:
    if optim == "adamw":
        return 8 * sum(tensors)
    big = sum(n for n in tensors if n >= BNB_8BIT_MIN_SIZE)
    return 2 * big * (1 + 4 / BNB_BLOCK) + 8 * (sum(tensors) - big)


def generation_bytes(a, m, d: Dtypes, rows: int, prompts: int) -> tuple[float, float]:
    """The KV cache and the buffers of a decode of `rows` completions of `prompts` prompts (each prefilled
    once): the cache, allocated for every position at once (rollout/kv_cache), in the weights' dtype (no
    autocast; 4-bit layers compute in the same dtype as the rest),
    one step's logits, their row-major copy, softmax and float64 cumulative sum, and a layer's prefill
    intermediates."""
    T, kv_bytes = m.prompt_length + m.completion_length, d.base
    # + a layer's copy while compaction or a prompt's copies rewrite the buffers (or a dynamic cache grows)
    kv = 2 * a.num_layers * rows * T * a.kv_dim * kv_bytes * (1 + 1 / a.num_layers)
    prefill = prompts * m.prompt_length * (3 * a.intermediate_size + 4 * a.hidden_size) * kv_bytes
    return kv, 20 * rows * a.vocab_size + prefill


def sampling_weight_bytes(a, m, d: Dtypes) -> float:
    """While sampling (policy/folding), float32 LoRA bases hold a folded copy of every adapted weight; with
    int8_sampling_weights, every linear and the LM head an int8 copy as well (policy/int8: fbgemm keeps the
    quantized weight beside its packed one, 2 bytes a weight)."""
    int8 = 2.0 * (a.linear_params() + a.vocab_size * a.hidden_size) if m.int8_sampling else 0.0
    if m.quantized or d.base != 4 or not m.use_lora:
        return int8
    targets = m.lora_targets
    return int8 + 4.0 * a.num_layers * sum(i * o for n, (i, o) in a.linear_shapes().items()
                                           if targets is None or n in targets)
