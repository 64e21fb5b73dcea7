"""The bytes of each part a GRPO run holds (docs/memory-planner.md, "What it counts"), from the model's tensors
(`Architecture`: facts from its config.json) and the trainer's dtype plan (`dtypes`, policy/precision.py): pure
arithmetic, which memory/estimate.py adds up into the moments of a step. Sizes are in bytes."""
from __future__ import annotations

from dataclasses import dataclass

from ..algo import HEAD_GRAD_BLOCK
from ..policy.optim import BNB_CPU_SLICE
from ..policy.precision import Precision
from ..settings.components import MemorySettings

NF4_BLOCK = 64  # 4-bit weights: one float32 absmax per block
BNB_8BIT_MIN_SIZE = 4096  # bitsandbytes keeps 32-bit states for smaller tensors
BNB_BLOCK = 256  # 8-bit optimizer states: one float32 absmax per block


@dataclass(frozen=True)
class Architecture:
    """What memory depends on in a Llama / Qwen2-style decoder (facts from a model's config.json)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    attention_bias: bool = False
    name: str = ""

    @property
    def q_dim(self) -> int:
        return self.num_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * (self.head_dim or self.hidden_size // self.num_heads)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer."""
        H, I = self.hidden_size, self.intermediate_size
        return {"q_proj": (H, self.q_dim), "k_proj": (H, self.kv_dim), "v_proj": (H, self.kv_dim),
                "o_proj": (self.q_dim, H), "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}

    def linear_params(self) -> int:
        """Weights of the decoder layers' linear layers (what 4-bit quantizes)."""
        return self.num_layers * sum(i * o for i, o in self.linear_shapes().values())

    def embedding_params(self) -> int:
        """Input embedding plus, when untied, the LM head."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def other_params(self) -> int:
        """Norm weights and attention biases."""
        bias = self.q_dim + 2 * self.kv_dim if self.attention_bias else 0
        return self.num_layers * (2 * self.hidden_size + bias) + self.hidden_size

    def num_params(self) -> int:
        return self.linear_params() + self.embedding_params() + self.other_params()

    def lora_tensors(self, r: int, targets: tuple[str, ...] | None) -> list[int]:
        """Element counts of the LoRA A and B matrices (all decoder linears unless `targets` names some)."""
        shapes = [s for n, s in self.linear_shapes().items() if targets is None or n in targets]
        return [n for i, o in shapes for n in (r * i, o * r)] * self.num_layers

    def trainable_tensors(self) -> list[int]:
        """Element counts of every parameter tensor (full fine-tuning), the big ones first."""
        H, V, L = self.hidden_size, self.vocab_size, self.num_layers
        body = [i * o for i, o in self.linear_shapes().values()] * L
        heads = [V * H] * (1 if self.tie_word_embeddings else 2)
        norms = [H] * (2 * L + 1)
        biases = [self.q_dim, self.kv_dim, self.kv_dim] * L if self.attention_bias else []
        return heads + body + norms + biases


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
    # Full fine-tuning of bf16 weights: no autocast copies, bf16 gradients, and the LM head's gradient accumulated
    # in float32 by the log-prob backward, cast to bf16 at its end.
    bf16_trained: bool


def dtypes(plan: Precision, use_lora: bool) -> Dtypes:
    """Bytes per element under the trainer's dtype plan (policy/precision.Precision.plan, the one plan)."""
    base = plan.base_dtype.itemsize
    bf16_trained = base == 2 and not use_lora  # bf16 weights: no autocast copies, everything flows in bf16
    # CUDA dropout keeps a bool mask; CPU dropout keeps a noise tensor, float32 unless the weights are bf16.
    device = "cuda" if plan.device_type == "cuda" else "cpu"
    mask = 1 if device == "cuda" else 2 if bf16_trained else 4
    return Dtypes(base=base, compute=2 if plan.bf16 or base == 2 else 4, residual=base,
                  autocast=plan.bf16 and base == 4, reference=plan.reference_dtype.itemsize, dropout_mask=mask,
                  device=device, bf16_trained=bf16_trained)


def prompts_in_micro_batch(micro_batch: int, num_generations: int) -> int:
    """The most prompts a micro-batch of `micro_batch` consecutive completions holds, in groups of
    `num_generations` (a group may span two micro-batches)."""
    N, G = micro_batch, num_generations
    return max((k * N + N - 1) // G - k * N // G + 1 for k in range(G))


def part_bytes(a: Architecture, m: MemorySettings, d: Dtypes) -> dict[str, float]:
    """The bytes of every part but the sampling decode's (its size waits on the room the others leave)."""
    trainable = a.lora_tensors(m.lora_r, m.lora_targets) if m.use_lora else a.trainable_tensors()
    return {**_resident(a, m, d, trainable), **_micro_batch(a, m, d, trainable), **_optimizer(m, d, trainable),
            "sampling weight copies": sampling_weight_bytes(a, m, d),
            # async_generation: the trainable weights' copy that the trainer and its sampler process share (the
            # frozen weights are the trainer's own pages: forked, never written)
            "sampler's weight copy": (4 if m.use_lora else d.base) * sum(trainable) if m.async_generation else 0.0}


def _resident(a: Architecture, m: MemorySettings, d: Dtypes, trainable: list[int]) -> dict:
    """What every moment holds but the optimizer states: weights, the reference copy, the generation batch."""
    C, T = m.completion_length, m.prompt_length + m.completion_length
    linear_bytes = a.linear_params() * (0.5 + 4 / NF4_BLOCK) if m.quantized else a.linear_params() * d.base
    weights = linear_bytes + (a.embedding_params() + a.other_params()) * d.base
    if m.use_lora:
        weights += 4 * sum(trainable)  # float32 adapters
    rollout_rows = m.schedule.completions_per_generation  # a generation batch's rows
    return {"weights": weights, "reference model": a.num_params() * d.reference if m.reference_copy else 0.0,
            # ids and masks; the [C] float32 log-probs kept for the whole batch (old, reference)
            "rollouts": rollout_rows * (T * 8 * 2 + C * 4 * m.logprobs_kept)}


def _micro_batch(a: Architecture, m: MemorySettings, d: Dtypes, trainable: list[int]) -> dict:
    """A micro-batch's forward and backward: activations, the log-prob chunk, the gradients."""
    V, H, L = a.vocab_size, a.hidden_size, a.num_layers
    N, P, C = m.schedule.micro_batch, m.prompt_length, m.completion_length  # N: sequences
    parts = {}
    # Whole rows forward N x (P + C) tokens; the shared-prompt forward (policy/prefix.py) each of the micro-batch's
    # prompts once and the N completions against its keys and values: B x P + N x C tokens.
    once = m.prompt_once
    B = prompts_in_micro_batch(N, m.num_generations) if once else N
    tokens = B * P + N * C
    per_token = layer_activations(a, m, d)
    # The shared forward's completions attend to their prompt's keys and values, expanded to their rows: SDPA keeps
    # them with the completions' own (repeated to all heads under a padding mask, as in layer_activations).
    kv = a.q_dim if a.num_kv_heads < a.num_heads else a.kv_dim
    prompt_keys = N * P * 2 * kv * d.compute if once else 0.0
    per_layer = per_token * tokens + prompt_keys
    # With checkpointing each layer keeps only its input, and recomputes its activations in backward, one layer
    # at a time, after the log-prob backward has freed its chunk; that layer's backward also holds gradients
    # of its activations, about a third more (measured on CPU). The shared forward checkpoints the prompts' and
    # the completions' layers apart, and keeps the prompts' keys and values [B, P] of every layer.
    kept_keys = B * P * 2 * a.kv_dim * d.compute if once else 0.0
    parts["activations"] = L * (d.residual * H * tokens + kept_keys if m.gradient_checkpointing else per_layer)
    replayed = per_token * max(B * P, N * C) + prompt_keys if once else per_layer
    parts["recomputed layer"] = 1.35 * replayed if m.gradient_checkpointing else 0.0
    # Final norm, and the completion hidden states the log-prob function keeps (a copy: a strided slice).
    parts["activations"] += tokens * (d.residual + 4) * H + N * C * H * d.residual
    rows = min(m.logprob_chunk_size, N * C)
    # float32 logits, a bf16 head's matmul output
    parts["log-prob chunk"] = rows * V * 4 + (rows * V * 2 if d.base == 2 else 0)
    parts["log-prob chunk"] += N * C * H * d.residual  # the gradient of the hidden states
    head_trained = not m.use_lora
    # A frozen head's d logp / d hidden, kept from the forward for the backward (float32, [N*C, H]).
    parts["log-prob jacobian"] = 0.0 if head_trained else N * C * H * 4
    grad_bytes = d.base if head_trained else 4  # trained weights' gradients in their dtype; adapters float32
    parts["LM-head gradient"] = grad_bytes * V * H if head_trained else 0.0
    parts["LM-head float32 accumulator"] = 4 * V * H if d.bf16_trained else 0.0
    # Each block of it: the bf16 product, its float32 promotion for the add, the block's gradient logits (measured
    # on CPU; tens of MB).
    block = min(V, HEAD_GRAD_BLOCK)
    parts["LM-head gradient block"] = block * (6 * H + 2 * rows) if d.bf16_trained else 0.0
    parts["autocast weight copies"] = 2 * a.linear_params() if d.autocast and not m.use_lora else 0.0
    parts["gradients"] = grad_bytes * sum(trainable)
    accumulating = m.accumulating
    parts["earlier micro-batches' gradients"] = parts["gradients"] if accumulating else 0.0
    # After the first micro-batch, a new [V, H] gradient (the head's, or an untied embedding's) waits to be added
    # to the stored one when backward ends. (A tied embedding's lookup adds a sparse gradient into the head's.)
    parts["pending embedding gradients"] = grad_bytes * V * H if head_trained and accumulating else 0.0
    return parts


def _optimizer(m: MemorySettings, d: Dtypes, trainable: list[int]) -> dict:
    """The optimizer's states (8-bit ones for bitsandbytes' big tensors), and its step's temporaries: torch AdamW
    runs fused (in place); bitsandbytes' CPU kernel works on float32 copies of a slice's states, gradient and
    denominator (about six at once), its CUDA kernel in place. bf16 weights add a slice's float32 weight, gradient
    and rounding noise (torch AdamW: weight, gradient, two temporaries)."""
    if m.optim == "adamw":
        states = 8 * sum(trainable)
    else:
        big = sum(n for n in trainable if n >= BNB_8BIT_MIN_SIZE)
        states = 2 * big * (1 + 4 / BNB_BLOCK) + 8 * (sum(trainable) - big)
    on_cpu_8bit = m.optim != "adamw" and d.device != "cuda"
    float32_slices = (4 if m.optim == "adamw" else 3) if d.bf16_trained else 0
    return {"optimizer states": states,
            "optimizer step temporaries": (6 * on_cpu_8bit + float32_slices) * 4 * min(max(trainable), BNB_CPU_SLICE)}


def layer_activations(a: Architecture, m: MemorySettings, d: Dtypes) -> float:
    """Bytes one decoder layer keeps for backward, per token."""
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


def sampling_weight_bytes(a: Architecture, m: MemorySettings, d: Dtypes) -> float:
    """While sampling (policy/folding), float32 LoRA bases hold a folded copy of every adapted weight; with
    int8_sampling_weights, every linear and the LM head an int8 copy as well (policy/int8: fbgemm keeps the
    quantized weight beside its packed one, 2 bytes a weight)."""
    int8 = 2.0 * (a.linear_params() + a.vocab_size * a.hidden_size) if m.int8_sampling else 0.0
    if m.quantized or d.base != 4 or not m.use_lora:
        return int8
    targets = m.lora_targets
    return int8 + 4.0 * a.num_layers * sum(i * o for n, (i, o) in a.linear_shapes().items()
                                           if targets is None or n in targets)


def prompts_to_sample(a: Architecture, m: MemorySettings, d: Dtypes, room: float) -> int:
    """Prompts one sampling decode takes: this rank's generation batch when it fits in `room` bytes, else as many
    micro-batches' worth of whole prompts as fit, at least one micro-batch's."""
    G, chunk = m.num_generations, m.schedule.prompts_per_micro_batch
    prompts = -(-m.schedule.completions_per_generation // G)  # this rank's share of the generation batch
    kv, buffers = generation_bytes(a, m, d, G, 1)  # one prompt's
    if prompts * (kv + buffers) > room:
        prompts = min(prompts, max(chunk, int(room // (kv + buffers)) // chunk * chunk))
    return prompts


def prompts_to_evaluate(a: Architecture, m: MemorySettings, d: Dtypes, room: float) -> int:
    """Prompts one greedy evaluation decode takes within `room` bytes (one completion each, counted at
    max_prompt_length + max_completion_length), at least one."""
    kv, buffers = generation_bytes(a, m, d, 1, 1)
    return max(1, int(room // (kv + buffers)))


def generation_bytes(a: Architecture, m: MemorySettings, d: Dtypes, rows: int, prompts: int) -> tuple[float, float]:
    """The KV cache and the buffers of a decode of `rows` completions of `prompts` prompts (each prefilled
    once): the cache, allocated for every position at once (rollout/engines/kv_cache), in the weights' dtype (no
    autocast; 4-bit layers compute in the same dtype as the rest), one step's logits, their row-major copy,
    softmax and float64 cumulative sum, and a layer's prefill intermediates."""
    T, kv_bytes = m.prompt_length + m.completion_length, d.base
    # + a layer's copy while compaction or a prompt's copies rewrite the buffers (or a dynamic cache grows)
    kv = 2 * a.num_layers * rows * T * a.kv_dim * kv_bytes * (1 + 1 / a.num_layers)
    prefill = prompts * m.prompt_length * (3 * a.intermediate_size + 4 * a.hidden_size) * kv_bytes
    return kv, 20 * rows * a.vocab_size + prefill
