"""One decoding step of a Llama-shaped model (Llama, Mistral and Qwen2 with full attention), written out for the
few new tokens a decoding step feeds: the same math as transformers' forward with fewer operations.

transformers' forward spends a decoding step of SmolLM2-135M (16 rows) largely outside the matmuls: a mask built
per step, peft's wrappers, rotary embeddings copied per tensor, keys and values repeated for grouped attention,
the attention interface dispatched per layer. Here each layer runs two RMSNorms, one `mm` per linear on the weight
the module holds (policy/folding stores the folded weights transposed, the layout a product with few rows reads
fastest), the rotary product, and attention of each key/value head's group of queries over the preallocated cache
(rollout/engines/kv_cache) as one `scaled_dot_product_attention` call, reading the keys once per group."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .folding import plain_lora
from .int8 import Int8Linear

# The decoder layers whose decoding step `FusedDecoder` computes: their forward is exactly this file's
# (pre-norm RMSNorm, rotary on all of q and k, grouped-query attention scaled by head_dim ** -0.5, gated MLP).
LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"}
NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}


def _plain(module, adapters: bool = False):
    """The module a layer's product computes with: a torch linear (itself, or a peft LoRA layer's base layer when
    its adapter is folded into the base weight: peft's `merged`), or with `adapters` an unfolded LoRA layer whose
    adapter the product adds (policy/folding's `plain_lora`); None for anything else."""
    if type(module) is torch.nn.Linear:
        return module
    if getattr(module, "merged", False) and type(module.get_base_layer()) is torch.nn.Linear:
        return module.get_base_layer()
    return module if adapters and hasattr(module, "lora_A") and plain_lora(module) else None


def _linear(module):
    """`x [n, in] -> [n, out]`: one `mm` (or `addmm`) on the weight as the module holds it; for an unfolded LoRA
    layer, plus its adapter's low-rank product `(x A^T) (scale B)^T` in the base weight's dtype."""
    if type(module) is not torch.nn.Linear:
        base, name = module.get_base_layer(), module.active_adapters[0]
        a = module.lora_A[name].weight.detach().T.to(base.weight.dtype)  # [in, r]
        b = (module.lora_B[name].weight.detach() * module.scaling[name]).T.to(base.weight.dtype)  # [r, out]
        product = _linear(base)
        return lambda x: torch.addmm(product(x), torch.mm(x, a), b)
    weight = module.weight.detach().T  # [in, out]: a view, no copy
    if module.bias is None:
        return lambda x: torch.mm(x, weight)
    bias = module.bias.detach()  # [out]
    return lambda x: torch.addmm(bias, x, weight)


def _products(q, k, v, o, gate, up, down) -> tuple:
    """A layer's products on its modules' own weights: (h -> (q, k, v), a -> o, h -> (gate, up), m -> down)."""
    fq, fk, fv, fo, fg, fu, fd = (_linear(m) for m in (q, k, v, o, gate, up, down))
    return lambda h: (fq(h), fk(h), fv(h)), fo, lambda h: (fg(h), fu(h)), fd


def fused_decoder(body, cache, int8: bool = False, bf16: bool = False) -> FusedDecoder | None:
    """A `FusedDecoder` for the decoder `body` (a transformers base model) writing `cache`'s preallocated layers,
    or None, keeping transformers' forward, where `body` is not one it computes exactly (another family, a layer
    that is not a plain linear: an unfolded adapter outside `bf16`, 4-bit, sharded; sliding windows, q/k norms) or
    its weights are not float32 (`bf16`: or bf16) on a CPU (elsewhere the copies would cost memory the plan does
    not hold). The weights are read as the modules hold them now (within policy/folding's `sampling_weights`: the
    folded ones). `int8` (Config.int8_sampling_weights): on int8 copies (policy/int8). `bf16` (the precision plan's
    bf16 sampling on a CPU): on the bf16 base as it is, a LoRA adapter added by its own low-rank product rather
    than folded (a fold into bf16 would round away the updates smaller than 1/512 of a weight)."""
    layers = getattr(body, "layers", None)
    weight = next(body.parameters(), None)  # float32 on a CPU: what the fused copies are counted for (memory/)
    dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
    if (layers is None or weight is None or weight.device.type != "cpu" or weight.dtype not in dtypes
            or not all(hasattr(body, a) for a in ("embed_tokens", "norm", "rotary_emb"))
            or len(cache.layers) != len(layers) or type(body.norm).__name__ not in NORMS):
        return None
    plan = []
    for layer in layers:
        attn = layer.self_attn
        if (type(layer).__name__ not in LAYERS or getattr(attn, "sliding_window", None) is not None
                or type(layer.input_layernorm).__name__ not in NORMS
                or type(layer.post_attention_layernorm).__name__ not in NORMS
                or attn.scaling != attn.head_dim ** -0.5):
            return None
        linears = [_plain(getattr(attn, name, None), bf16) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [_plain(getattr(layer.mlp, name, None), bf16) for name in ("gate_proj", "up_proj", "down_proj")]
        if any(m is None for m in linears):
            return None
        plan.append(linears)
    return FusedDecoder(body, cache, plan, int8)


class FusedDecoder:
    """`step(ids [n, 1], mask [n, T], position_ids [n, 1]) -> last hidden states [n, H]`, as `body` computes
    them with `cache`, writing the new keys and values into it. It holds the weights the modules hold when it is
    made: make one per decode."""

    def __init__(self, body, cache, plan: list, int8: bool = False):
        config = body.config
        attn = body.layers[0].self_attn
        self.embed, self.rotary, self.cache = body.embed_tokens, body.rotary_emb, cache
        self.norm = body.norm  # the final norm's module: called as transformers' forward calls it
        self.D, self.Hkv = attn.head_dim, config.num_key_value_heads
        self.Hq, self.scale = config.num_attention_heads, attn.scaling
        self.layers = []
        for layer, (q, k, v, o, gate, up, down) in zip(body.layers, plan):
            norms = [(n.weight.detach(), n.variance_epsilon)
                     for n in (layer.input_layernorm, layer.post_attention_layernorm)]
            if int8:  # int8 copies (policy/int8), q/k/v and gate/up each stacked into one product
                products = (Int8Linear([q, k, v]).split, Int8Linear([o]), Int8Linear([gate, up]).split,
                            Int8Linear([down]))
            else:
                products = _products(q, k, v, o, gate, up, down)
            self.layers.append((norms, products, layer.mlp.act_fn))

    @staticmethod
    def _rms(x: torch.Tensor, weight_and_eps) -> torch.Tensor:
        weight, eps = weight_and_eps  # transformers' RMSNorm: float32 statistics, the weight after the cast back
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)  # [n, H]
        return weight * h.to(x.dtype)

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        n, D, Hq, Hkv = len(ids), self.D, self.Hq, self.Hkv
        x = self.embed(ids)[:, 0]  # [n, H]
        cos, sin = self.rotary(x, position_ids)  # [n, 1, D] each: one position per row, broadcast over heads
        attend = mask.bool()[:, None, None, :]  # [n, 1, 1, T]: padding never attended
        half = D // 2

        def rotate(t: torch.Tensor) -> torch.Tensor:  # [n, heads, D]: transformers' apply_rotary_pos_emb
            return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

        for ((norm1, norm2), (qkv, o, gate_up, down), act), cached in zip(self.layers, self.cache.layers):
            q, k, v = qkv(self._rms(x, norm1))  # [n, Hq*D], [n, Hkv*D] x 2
            queries = rotate(q.view(n, Hq, D)).view(n, Hkv, Hq // Hkv, D)  # [n, Hkv, G, D]
            keys, values = cached.update(rotate(k.view(n, Hkv, D))[:, :, None],
                                         v.view(n, Hkv, 1, D))  # [n, Hkv, T, D] each
            # each key/value head's G queries as G query positions: the keys are read once per group
            a = F.scaled_dot_product_attention(queries, keys, values, attn_mask=attend, scale=self.scale)
            x = x + o(a.reshape(n, Hq * D))  # [n, H]
            gate, up = gate_up(self._rms(x, norm2))  # [n, I] each
            x = x + down(act(gate) * up)  # [n, H]
        return self.norm(x)  # [n, H]
