"""Completion log-probs with each distinct prompt forwarded once: the prompt rows [B, P] run with a KV cache that
keeps its graph, the cache is expanded to the rows that share each prompt, and the completions [N, C] run
against it. The gradient through a shared prompt is then the sum over its copies (the backward of the
expansion), so log-probs and gradients are those of the full rows (models.completion_logprobs), with a group's
prompt computed once instead of G times.

Served: models whose transformers cache is built of plain and sliding-window attention layers (`refusal`).
Under gradient checkpointing a layer's forward is replayed in backward; both caches here give the same states on
a replay (the prompt's layers replace what they hold, the completions' layers only read). The completions run as
their padded rows [N, C] (`PaddedRows`), or as one packed row under a 4D mask (policy/packing.py)."""
from __future__ import annotations

import contextlib
import copy
import functools

import torch

from ..algo.logprobs import token_logprobs
from .caches import cache_argument, keeps_recurrent_state
from .head import head_transform, positions
from .models import agreement_tolerance, completion_logprobs, eval_mode, unwrap
from .packing import PackedRow, packing_refusal, packs


def shared_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(first, owner)`: the first row [B] of each run of consecutive rows with the same prompt (ids and mask),
    and each row's run [N]. A group's G rows are consecutive: one run (or several when rows between were cut)."""
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(1) & (prompt_mask[1:] == prompt_mask[:-1]).all(1)  # [N-1]
    starts = torch.cat([same.new_ones(1), ~same])  # [N]: a row whose prompt differs from the one before
    return starts.nonzero().squeeze(1), starts.long().cumsum(0) - 1  # [B], [N]


class CacheDropped(RuntimeError):
    """The model ran the prompt without filling the cache given (GPT-2 drops it under gradient checkpointing):
    nothing was computed that the full rows need; take them instead."""


def refusal(hf_model) -> str | None:
    """Why `hf_model` cannot take the shared-prompt forward, or None when it can."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    name = type(hf_model).__name__
    try:
        cache = DynamicCache(config=hf_model.config)
    except Exception as error:  # a config transformers builds no cache from
        return f"no cache is built from {type(hf_model.config).__name__} ({error})"
    if keeps_recurrent_state(hf_model, cache):
        return (f"{name} keeps a recurrent or linear-attention state, which the shared-prompt forward cannot "
                f"share between a prompt's completions")
    if cache_argument(hf_model.base_model) is None:
        return f"{name}'s body takes no cache"
    layers = cache.layers
    kinds = {type(layer) for layer in layers} - {DynamicLayer, DynamicSlidingWindowLayer}
    if not layers or kinds:
        return f"{name}'s cache has layers of kind {sorted(k.__name__ for k in kinds) or 'none'}"
    return None


def shared_prompt_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                           completion_mask: torch.Tensor, *, temperature: float, chunk_size: int,
                           return_entropy: bool = False, pack: bool | None = None):
    """Log-probs `[N, C]` of the completions under `model` (a transformers causal LM, or peft over one, that
    `refusal` accepts), as `models.completion_logprobs` on the whole rows gives them (0 on padding);
    `(logprobs, entropies)` with `return_entropy`. `pack`: run the completions as one packed row (True, where
    `packing_refusal` allows it), as padded rows (False), or whichever costs less (None): `packing.packs`."""
    from transformers.cache_utils import DynamicCache

    hf = unwrap(model)
    body, head, transform = hf.base_model, hf.get_output_embeddings(), head_transform(hf.config)
    first, owner = shared_prompts(prompt_ids, prompt_mask)  # [B], [N]
    ids, mask = prompt_ids[first], prompt_mask[first]  # [B, P]
    # Positions continue from each row's real prompt length, as on the whole row.
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [N, P+C]
    completion_positions = positions(attention_mask)[:, prompt_ids.shape[1]:]  # [N, C]
    if packs(hf, pack, mask.shape, completion_mask.shape, int(completion_mask.bool().sum())):
        layout = PackedRow(hf, mask, owner, completion_ids, completion_mask, completion_positions)
    else:
        layout = PaddedRows(owner, completion_ids, attention_mask, completion_positions)
    cache = DynamicCache(config=hf.config)  # a new one: nothing shared between forwards
    for layer in cache.layers:  # each captures the prompt's keys and values
        layer.__class__ = _shared_layer(type(layer))
    argument = cache_argument(body)
    # use_cache=False: the cache given is used all the same, and checkpointed layers do not warn about it.
    with _cache_kept_under_checkpointing(body):
        # [B, H]: the prompt's last state (left padding ends on a real token)
        prompt_hidden = body(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False,
                             **{argument: cache}).last_hidden_state[:, -1]
        if any(layer.keys is None for layer in cache.layers):
            raise CacheDropped(f"{type(hf).__name__} drops the cache in this mode (gradient checkpointing)")
        hidden = body(**layout.inputs(cache), use_cache=False,
                      **{argument: _expanded(cache, layout.cache_rows, prompt_ids.shape[1])}).last_hidden_state
    hidden, targets = layout.states(prompt_hidden, hidden)
    return layout.unpack(token_logprobs(hidden, head.weight, targets, temperature=temperature, bias=head.bias,
                                        chunk_size=chunk_size, return_entropy=return_entropy,
                                        logit_scale=transform.scale, softcap=transform.softcap))


class PaddedRows:
    """The completions [N, C] as their padded rows, row i against the keys and values of its prompt `owner[i]`."""

    def __init__(self, owner: torch.Tensor, completion_ids: torch.Tensor, attention_mask: torch.Tensor,
                 completion_positions: torch.Tensor):
        self.cache_rows, self.completion_ids = owner, completion_ids  # [N], [N, C]
        self.attention_mask, self.positions = attention_mask, completion_positions  # [N, P+C], [N, C]

    def inputs(self, cache) -> dict:
        """The body's inputs besides the cache."""
        return dict(input_ids=self.completion_ids, attention_mask=self.attention_mask, position_ids=self.positions)

    def states(self, prompt_hidden: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The state before each completion token [N, C, H], from the prompts' last states [B, H] and the rows'
        [N, C, H]: the prompt's last for the first, then the completion's own; and the tokens [N, C]."""
        before = torch.cat([prompt_hidden.index_select(0, self.cache_rows)[:, None], hidden[:, :-1]], 1)  # [N, C, H]
        return before, self.completion_ids

    def unpack(self, out):
        """Log-probs (and entropies) [N, C]: already in the rows."""
        return out


@functools.cache
def _shared_layer(base):
    """`base` (transformers' DynamicLayer or DynamicSlidingWindowLayer) as a layer of the shared-prompt forward."""
    class SharedPromptLayer(base):
        """Captures the prompt forward's keys and values [B, h, P, d] (a replay replaces them instead of
        appending). Once `_expanded` sets `reading` and `owner` (each row's prompt [N]), it returns a row's prompt
        states with the new ones and keeps the new ones out, so that a replay sees the same states and
        `get_mask_sizes` stays that of the prompt alone."""

        reading = False

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.reading:
                self.keys, self.values, self.is_initialized = key_states, value_states, True
                return key_states, value_states
            # Expanded here, not held expanded: under checkpointing a layer's replay expands again, and only the
            # B prompts' keys and values stay alive between forward and backward.
            if self.owner is None:  # one packed row: the prompts one after another, [1, h, B*P, d]
                keys, values = (s.transpose(0, 1).flatten(1, 2)[None] for s in (self.keys, self.values))
            else:
                keys, values = self.keys.index_select(0, self.owner), self.values.index_select(0, self.owner)  # [N]
            return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)

    return SharedPromptLayer


def _expanded(cache, owner: torch.Tensor | None, prompt_length: int):
    """A new cache giving each layer's prompt keys and values [B, h, P, d] to the rows [N] that share them (`owner`),
    or to one packed row (None: all prompts' tokens whole, the mask chooses among them)."""
    expanded = copy.copy(cache)
    expanded.layers = []
    for layer in cache.layers:
        new = copy.copy(layer)  # its settings (a sliding window's size)
        keys, values = layer.keys, layer.values  # [B, h, P, d]
        if getattr(layer, "is_sliding", False) and owner is not None:
            # What a sliding-window layer keeps after P tokens: the last W - 1, which is all the window can reach.
            start = max(keys.shape[2] - (layer.sliding_window - 1), 0)
            keys, values = keys[:, :, start:], values[:, :, start:]  # [B, h, min(P, W-1), d]
            new.cumulative_length = prompt_length
        new.keys, new.values, new.owner, new.reading = keys, values, owner, True  # [B, h, *, d], expanded by update
        expanded.layers.append(new)
    return expanded


@contextlib.contextmanager
def _cache_kept_under_checkpointing(body):
    """Let checkpointed decoder layers keep the cache (transformers drops it otherwise): both caches here give
    the same states when backward replays a layer."""
    layers = [m for m in body.modules() if hasattr(type(m), "_can_checkpoint_with_cache")]
    set_here = [m for m in layers if "_can_checkpoint_with_cache" not in vars(m)]
    for m in set_here:
        m._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for m in set_here:
            del m._can_checkpoint_with_cache


@torch.no_grad()
def check_shared_prompt_forward(model, rollout, *, temperature: float, chunk_size: int, rows: int = 4,
                                tokens: int = 16, agree=lambda excess: excess) -> tuple[float, float]:
    """The first-step check: log-probs of the first `tokens` completion tokens of (at most `rows` of) the rows
    sharing the rollout's first prompt, by `shared_prompt_logprobs` (padded and packed) and by the whole rows.
    Returns the largest difference over the tolerance (`agree` makes it the largest over ranks; above 1, they
    differ) and the difference. Runs in eval mode and without autocast, as the start-up head check does."""
    take = (shared_prompts(rollout.prompt_ids, rollout.prompt_mask)[1] == 0).nonzero().squeeze(1)[:rows]  # [r]
    prompt_ids, prompt_mask = rollout.prompt_ids[take], rollout.prompt_mask[take]  # [r, P]
    completion_ids, completion_mask = rollout.completion_ids[take, :tokens], rollout.completion_mask[take, :tokens]
    if completion_ids.shape[1] == 0:
        return agree(0.0), 0.0
    with eval_mode(model), torch.autocast(prompt_ids.device.type, enabled=False):
        whole = completion_logprobs(model, torch.cat([prompt_ids, completion_ids], 1),
                                    torch.cat([prompt_mask, completion_mask], 1), prompt_ids.shape[1],
                                    temperature=temperature, chunk_size=chunk_size)  # [r, k]
        # Both layouts of the completions, padded rows and (where the model allows it) one packed row.
        error = max((shared_prompt_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                            temperature=temperature, chunk_size=chunk_size, pack=pack) - whole
                     ).abs().masked_fill(completion_mask == 0, 0).max().item()
                    for pack in (False, True)[:1 + (packing_refusal(unwrap(model)) is None)])
    return agree(error / agreement_tolerance(unwrap(model), whole.abs().max().item())), error
