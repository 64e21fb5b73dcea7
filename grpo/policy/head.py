"""What a model's forward does to the LM head's output before returning its logits, read from its config, so
that the chunked log-probs (algo/logprobs) and sampling (rollout/engines/decoding) use the model's own distribution.

Most families return `hidden @ W.T (+ b)`. Some transform it; in transformers 5.24 (each family's
`ForCausalLM.forward`, right after `self.lm_head`):

| config attribute | the forward does | families |
|---|---|---|
| `logit_scale` | `logits * s` | Cohere, Cohere2, Cohere2-MoE, CohereCompass |
| `logits_scaling` | `logits / s` | Granite (all variants); MiniCPM3 (`hidden / s`: the same, having no head bias) |
| `logits_scaling` | `logits * s` | HyperCLOVAX (same name, opposite meaning) |
| `logits_mup_width_multiplier` | `hidden / s` | Inkling |
| `lm_head_multiplier` | `logits * s` | FalconH1 |
| `output_multiplier` | `logits * s`, before the cap | MuseGlimmer, MuseSpark |
| `final_logit_softcapping` | `c * tanh(logits / c)` | Gemma 2/3/3n/4, VaultGemma, NanoChat, Beam, Inkling2, ... |
| `logits_soft_cap`, `output_logit_soft_cap` | `c * tanh(logits / c)` | RecurrentGemma, xLSTM |

A multimodal model reads them from its `text_config`; AyaVision, Cohere2Vision and Gemma3's
ForConditionalGeneration do not apply them. MiniCPM (v1, remote code) divides the hidden states by
`hidden_size / dim_model_base`; Inkling drops the logits past `unpadded_vocab_size`, which is refused. A config
that declares a logit transform not in this table is refused (ConfigError) rather than trained on wrong
log-probs; the start-up check (models.check_logprobs_match_forward) catches a forward that does anything else."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..algo.logprobs import transform_logits_
from ..errors import ConfigError


@dataclass(frozen=True)
class HeadTransform:
    """`logits = softcap * tanh(scale * x / softcap)`, or `scale * x` without a cap, for `x = hidden @ W.T + b`."""

    scale: float = 1.0
    softcap: float | None = None


_MULTIPLY = ("logit_scale", "lm_head_multiplier", "output_multiplier")
_DIVIDE = ("logits_scaling", "logits_mup_width_multiplier")
_SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
# Multimodal wrappers whose forward returns the plain head output whatever their text config declares.
_PLAIN_WRAPPERS = ("aya_vision", "cohere2_vision", "gemma3")
# (model_type, attribute) whose forward differs from the attribute's usual meaning.
_EXCEPTIONS = {("hyperclovax", "logits_scaling"): "multiply"}
_UNSUPPORTED = {
    ("mpt", "logit_scale"): "transformers' MptForCausalLM ignores it while MPT's original code multiplies the "
                            "logits by it, so which one this model does is unknown",
}
# Names that look like a transform of the output logits (attention and router caps do not match).
_LOOKS_LIKE_A_HEAD_TRANSFORM = re.compile(
    r"^(final_|output_)?logits?_(soft_?cap(ping)?|scale|scaling|multiplier|temperature)$"
    r"|^(lm_head|output|logits?)_(multiplier|scale|scaling)$")


def _number(config, name: str) -> float | None:
    """A positive number, or None when unset."""
    value = getattr(config, name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{type(config).__name__}.{name} = {value!r}: a logit transform needs a positive number")
    return float(value)


def head_transform(config) -> HeadTransform:
    """The transform a transformers causal LM with this config applies to its LM head's output."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    family, where = getattr(text, "model_type", ""), type(text).__name__
    if text is not config and getattr(config, "model_type", "") in _PLAIN_WRAPPERS:
        return HeadTransform()
    for (kind, name), why in _UNSUPPORTED.items():
        if family == kind and getattr(text, name, None) is not None:
            raise ConfigError(f"{where}.{name} = {getattr(text, name)!r}: {why}; set it to None to train with "
                              f"transformers' forward")
    scale, softcap = 1.0, None
    for name in _MULTIPLY + _DIVIDE + _SOFTCAPS:
        value = _number(text, name)
        if value is None:
            continue
        how = _EXCEPTIONS.get((family, name), "multiply" if name in _MULTIPLY else
                              "divide" if name in _DIVIDE else "softcap")
        if how == "softcap":
            if softcap is not None and softcap != value:
                raise ConfigError(f"{where} declares two logit soft caps ({softcap} and {value})")
            softcap = value
        else:
            scale = scale * value if how == "multiply" else scale / value
    if family == "minicpm" and getattr(text, "dim_model_base", None) is not None:
        scale *= _number(text, "dim_model_base") / text.hidden_size  # remote code: lm_head(h / (H / dim_model_base))
    unpadded = getattr(text, "unpadded_vocab_size", None)  # Inkling2 sizes its head by it: nothing to drop
    if family == "inkling_text" and unpadded is not None and unpadded < text.vocab_size:
        raise ConfigError(f"{where}.unpadded_vocab_size = {unpadded} < vocab_size = {text.vocab_size}: its forward "
                          f"drops the padding logits, which log-probs here do not do")
    known = set(_MULTIPLY + _DIVIDE + _SOFTCAPS)
    for name, value in sorted(vars(text).items()):
        if name not in known and _LOOKS_LIKE_A_HEAD_TRANSFORM.match(name) and value not in (None, 1, 1.0, False):
            raise ConfigError(f"{where}.{name} = {value!r}: a transform of the logits that grpo does not implement "
                              f"(see grpo/policy/head.py), so its log-probs would be wrong")
    return HeadTransform(scale, softcap)


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [N, T] that count real tokens only: left padding shifts where each sequence starts, and
    sampling and the loss must agree on every token's position."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


def head_logits(hf_model, matmul=None):
    """`hidden [N, H] -> logits [N, V]` (float32) as `hf_model`'s forward makes them from its last hidden
    states: its LM head (or `matmul`, the head's product with its bias on a packed copy of its weight,
    policy/folding) and `head_transform`, as the log-probs do."""
    head, transform = hf_model.get_output_embeddings(), head_transform(hf_model.config)

    def logits_of(hidden: torch.Tensor) -> torch.Tensor:
        weight = head.weight  # read at each call: FSDP swaps the parameter when it gathers it
        if matmul is not None:
            logits = matmul(hidden.to(weight.dtype)).float()  # [N, V]
        else:
            logits = torch.mm(weight, hidden.to(weight.dtype).T).T.contiguous().float()  # [N, V]; W @ h.T: faster
            if head.bias is not None:
                logits += head.bias  # [N, V]
        return transform_logits_(logits, transform.scale, transform.softcap)  # [N, V]
    return logits_of
