"""What a model family's cache allows, asked by the decode loop (rollout/engines/decoding) and the shared-prompt forward
(policy/prefix): the name its forward takes the cache by, and whether it keeps a state that rows can neither
leave nor share."""
from __future__ import annotations

import inspect


def cache_argument(body) -> str | None:
    """The keyword `body`'s forward takes its cache by (`cache` from transformers 5.24, `past_key_values` in 5.23
    and some families); None when it takes none."""
    parameters = inspect.signature(body.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def keeps_recurrent_state(hf_model, cache) -> bool:
    """Whether `hf_model` keeps a recurrent or linear-attention state, which decoding rows can neither leave, be
    repeated in nor share a prefix of: transformers marks it `_is_stateful`, or builds the model's cache
    (`cache`) with linear-attention layers. (A model may hold the state in its own modules instead, leaving
    the layer empty: RecurrentGemma does.)"""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return getattr(hf_model, "_is_stateful", False) or any(
        isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)
