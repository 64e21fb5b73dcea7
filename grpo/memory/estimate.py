"""Predicted peak memory of a GRPO run, from architecture numbers and settings alone (pure arithmetic).

It follows what this trainer allocates. On CUDA: full fine-tuning keeps float32 weights and runs the forward
under bf16 autocast (which keeps a bf16 copy of every linear weight until backward), its frozen reference is
a bf16 copy (only when beta > 0); LoRA keeps a bf16 base (no reference: the adapter is disabled instead) and
float32 adapters; QLoRA stores the body's linear weights as 4-bit NF4. On CPU everything is float32 unless
`bf16=True` asks for the same plan there. With `bf16_weights` (full fine-tuning, either device) weights,
gradients, activations and the reference are bf16, the optimizer states stay as they are, and the optimizer
updates slices of float32 copies.
Generation samples the generation batch (steps_per_generation micro-batches of per_device_train_batch_size
completions) with a KV cache outside autocast (so in the weights' dtype), each prompt prefilled once, and keeps the
batch until it is trained on, with the log-probs the run plan keeps (settings/plan.py). It decodes the whole batch
at once when that fits within the peak of the training moments, else as many micro-batches' worth of whole prompts
as fit (at least one micro-batch's, at least one prompt): `Estimate.decode_prompts`, which the Sampler follows, so
one decode never raises the peak above what decoding a micro-batch at a time gave. Greedy evaluation decodes as many
prompts at once as fit beside what training keeps within the peak (`eval_prompts_per_batch`). The loss runs per
micro-batch: activations of the whole micro-batch, the LM head applied in chunks of `logprob_chunk_size` token rows
(float32 logits), and the head's gradient in backward. With `shared_prompt_forward` (on by default without
checkpointing) each of a micro-batch's prompts is forwarded once and its completions against its keys and values:
activations for P + G x C tokens a group instead of G x (P + C).

With `async_generation` the sampler process decodes during every training moment (its KV cache, buffers and
weight copies added to them), and the trainable weights have one more copy, in memory the two processes share.

Peak = the largest of six moments: generation, the end of a micro-batch's forward, the start of its backward,
the recomputation of a layer (gradient checkpointing), the end of the backward, and the optimizer step.
Optimizer states exist from the first step on, gradients only between the first backward and the optimizer
step (they are freed, not zeroed). Sizes are in bytes; `GB` is 1e9 bytes, as the trainer's
`memory/peak_gb` metric.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..algo import HEAD_GRAD_BLOCK
from ..policy.optim import BNB_CPU_SLICE
from ..policy.precision import Precision
from ..settings.plan import RunPlan
from ..settings.planner import MemorySettings
from .parts import Dtypes, dtypes, generation_bytes, layer_activations, optimizer_bytes, sampling_weight_bytes

GB = 1e9
NF4_BLOCK = 64  # 4-bit weights: one float32 absmax per block
KEPT = ("weights", "optimizer states", "reference model", "rollouts")  # parts every moment holds


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


@dataclass
class Estimate:
    """Bytes per part, the parts each moment holds, and the peak moment."""

    parts: dict[str, float]
    moments: dict[str, tuple[str, ...]]
    decode_prompts: int = 1  # prompts one sampling decode takes (this rank's)

    def total(self, moment: str) -> float:
        return sum(self.parts[p] for p in self.moments[moment])

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=self.total)

    @property
    def peak(self) -> float:
        return self.total(self.peak_moment)


def eval_prompts_per_batch(a: Architecture, m: MemorySettings, d: Dtypes) -> int:
    """Prompts one greedy evaluation decode may take (one completion each, counted at max_prompt_length +
    max_completion_length): as many as fit beside what training keeps (weights, optimizer states, reference,
    rollouts) within the training peak that the run needs anyway, at least one."""
    e = plan_peak(a, m, d)
    free = e.peak - sum(e.parts[p] for p in KEPT) - e.parts["sampling weight copies"]
    kv, buffers = generation_bytes(a, m, d, 1, 1)
    return max(1, int(free // (kv + buffers)))


def prompts_in_micro_batch(micro_batch: int, num_generations: int) -> int:
    """The most prompts a micro-batch of `micro_batch` consecutive completions holds, in groups of
    `num_generations` (a group may span two micro-batches)."""
    N, G = micro_batch, num_generations
    return max((k * N + N - 1) // G - k * N // G + 1 for k in range(G))


def settings_of(config, device: str = "cuda") -> tuple[MemorySettings, Precision]:
    """What the planner reads of a `grpo.Config` on `device` ("cuda" or "cpu"): the settings as the run plan
    resolves them for one rank (the ranks are not known here), and the dtype plan."""
    precision = Precision.plan(config.bf16, config.use_lora, device, config.bf16_weights)
    return RunPlan.resolve(config, world_size=1).memory, precision


def estimate(a: Architecture, config, device: str = "cuda") -> Estimate:
    """Peak memory of training `a` with the settings of `config` (a `grpo.Config`) on `device` ("cuda" or
    "cpu"): `plan_peak` of `settings_of`."""
    m, precision = settings_of(config, device)
    return plan_peak(a, m, dtypes(precision, m.use_lora))


def plan_peak(a: Architecture, m: MemorySettings, d: Dtypes) -> Estimate:
    """Peak memory of training `a` with the planner's settings `m` under the dtype plan `d`, prompts counted at
    max_prompt_length (the worst case); see the module docstring."""
    trainable = a.lora_tensors(m.lora_r, m.lora_targets) if m.use_lora else a.trainable_tensors()
    parts = {**_resident(a, m, d, trainable), **_micro_batch(a, m, d, trainable), **_optimizer_step(m, d, trainable)}
    moments = _moments(m, low_precision_head=parts["LM-head float32 accumulator"] > 0)
    parts["sampling weight copies"] = sampling_weight_bytes(a, m, d)
    prompts = _decode_prompts(a, m, d, parts, moments)
    parts["KV cache"], parts["sampling buffers"] = generation_bytes(a, m, d, prompts * m.num_generations, prompts)
    # async_generation: the sampler process decodes while the trainer trains (run/ahead.py), so every training
    # moment holds a decode too, and the trainable weights' copy the two share; the frozen weights are the
    # trainer's own pages (forked, never written).
    parts["sampler's weight copy"] = (4 if m.use_lora else d.base) * sum(trainable) if m.async_generation else 0.0
    if m.async_generation:
        decoding = ("KV cache", "sampling buffers", "sampling weight copies", "sampler's weight copy")
        moments = {name: held + (decoding if name != "generation" else ("sampler's weight copy",))
                   for name, held in moments.items()}
    return Estimate(parts, moments, prompts)


def _resident(a: Architecture, m: MemorySettings, d: Dtypes, trainable: list[int]) -> dict:
    """What every moment holds: weights, optimizer states, the reference copy, the generation batch."""
    C, T = m.completion_length, m.prompt_length + m.completion_length
    linear_bytes = a.linear_params() * (0.5 + 4 / NF4_BLOCK) if m.quantized else a.linear_params() * d.base
    weights = linear_bytes + (a.embedding_params() + a.other_params()) * d.base
    if m.use_lora:
        weights += 4 * sum(trainable)  # float32 adapters
    rollout_rows = m.schedule.completions_per_generation  # a generation batch's rows
    return {"weights": weights, "optimizer states": optimizer_bytes(trainable, m.optim),
            "reference model": a.num_params() * d.reference if m.reference_copy else 0.0,
            # ids and masks; the [C] float32 log-probs kept for the whole batch (old, reference)
            "rollouts": rollout_rows * (T * 8 * 2 + C * 4 * m.logprobs_kept)}


def _micro_batch(a: Architecture, m: MemorySettings, d: Dtypes, trainable: list[int]) -> dict:
    """A micro-batch's forward and backward: activations, the log-prob chunk, the LM head's gradient, the
    gradients."""
    V, H, L = a.vocab_size, a.hidden_size, a.num_layers
    N, P, C = m.schedule.micro_batch, m.prompt_length, m.completion_length  # N: sequences
    parts = {}
    # Whole rows forward N x (P + C) tokens; the shared-prompt forward (policy/prefix.py) each of the micro-batch's
    # prompts once and the N completions against its keys and values: B x P + N x C tokens.
    once = m.prompt_once  # policy/prefix.py
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
    # The log-prob backward accumulates the head's gradient in float32, cast at its end to a bf16 head's dtype.
    parts["LM-head gradient"] = grad_bytes * V * H if head_trained else 0.0
    low_precision_head = head_trained and grad_bytes != 4
    parts["LM-head float32 accumulator"] = 4 * V * H if low_precision_head else 0.0
    # Each block of it: the bf16 product, its float32 promotion for the add, the block's gradient logits (measured
    # on CPU; tens of MB).
    block = min(V, HEAD_GRAD_BLOCK)
    parts["LM-head gradient block"] = block * (6 * H + 2 * rows) if low_precision_head else 0.0
    parts["autocast weight copies"] = 2 * a.linear_params() if d.autocast and not m.use_lora else 0.0
    parts["gradients"] = grad_bytes * sum(trainable)
    accumulating = m.accumulating
    parts["earlier micro-batches' gradients"] = parts["gradients"] if accumulating else 0.0
    # After the first micro-batch, a new [V, H] gradient (the head's, or an untied embedding's) waits to be added
    # to the stored one when backward ends. (A tied embedding's lookup adds a sparse gradient into the head's.)
    parts["pending embedding gradients"] = grad_bytes * V * H if head_trained and accumulating else 0.0
    return parts


def _optimizer_step(m: MemorySettings, d: Dtypes, trainable: list[int]) -> dict:
    """The optimizer step's temporaries: torch AdamW runs fused (in place); bitsandbytes' CPU kernel works on
    float32 copies of a slice's states, gradient and denominator (about six at once), its CUDA kernel in place.
    bf16 weights add a slice's float32 weight, gradient and rounding noise (torch AdamW: weight, gradient, two
    temporaries)."""
    on_cpu_8bit = m.optim != "adamw" and d.device != "cuda"
    float32_slices = (4 if m.optim == "adamw" else 3) if d.base == 2 and not m.use_lora else 0
    return {"optimizer step temporaries": (6 * on_cpu_8bit + float32_slices) * 4 * min(max(trainable), BNB_CPU_SLICE)}


def _moments(m: MemorySettings, low_precision_head: bool) -> dict[str, tuple[str, ...]]:
    """The parts each moment holds."""
    kept = KEPT
    # Autocast keeps its weight copies until the forward ends; for backward too, unless checkpointing
    # recomputes them layer by layer.
    copies = () if m.gradient_checkpointing else ("autocast weight copies",)
    # While the log-prob backward runs, the head's gradient grows in the float32 accumulator, when there is one.
    head_accumulating = (("LM-head float32 accumulator", "LM-head gradient block") if low_precision_head
                         else ("LM-head gradient",))
    return {
        "generation": kept + ("KV cache", "sampling buffers", "sampling weight copies"),
        "forward end": kept + ("activations", "autocast weight copies", "log-prob chunk", "log-prob jacobian",
                               "earlier micro-batches' gradients"),
        "backward start": kept + ("activations", "log-prob chunk", "log-prob jacobian",
                                  "earlier micro-batches' gradients") + head_accumulating + copies,
        "log-prob backward end": kept + ("activations", "LM-head float32 accumulator", "LM-head gradient",
                                         "earlier micro-batches' gradients"),
        "layer recompute": kept + ("activations", "recomputed layer", "LM-head gradient",
                                   "earlier micro-batches' gradients"),
        "backward end": kept + ("gradients", "pending embedding gradients"),
        "optimizer step": kept + ("gradients", "optimizer step temporaries"),
    }


def _decode_prompts(a: Architecture, m: MemorySettings, d: Dtypes, parts: dict, moments: dict) -> int:
    """Prompts one sampling decode takes: the whole generation batch (this rank's share) when it fits within the
    other moments' peak, else whole micro-batches' worth, at least one."""
    G, chunk = m.num_generations, m.schedule.prompts_per_micro_batch
    prompts = -(-m.schedule.completions_per_generation // G)  # this rank's share of the generation batch
    free = max(sum(parts.get(p, 0.0) for p in m) for m in moments.values()) - sum(parts[p] for p in KEPT) \
        - parts["sampling weight copies"]
    kv, buffers = generation_bytes(a, m, d, G, 1)  # one prompt's
    if prompts * (kv + buffers) > free:
        prompts = min(prompts, max(chunk, int(free // (kv + buffers)) // chunk * chunk))
    return prompts
