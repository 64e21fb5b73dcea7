"""Completion log-probs with each distinct prompt forwarded once: the prompt rows [B, P] run with a KV cache that
keeps its graph, the cache is expanded to the rows that share each prompt, and the completions [N, C] run
against it. The gradient through a shared prompt is then the sum over its copies (the backward of the
expansion), so log-probs and gradients are those of the full rows (models.completion_logprobs), with a group's
prompt computed once instead of G times.

Served: models whose transformers cache is built of plain and sliding-window attention layers. Under gradient
checkpointing a layer's forward is replayed in backward; both caches here give the same states on a replay (the
prompt's layers replace what they hold, the completions' layers only read), which is what transformers'
`_can_checkpoint_with_cache` asks of a cache kept under checkpointing. Others (recurrent state, KV shared across
layers, chunked attention) are refused by `refusal`, and the caller takes the full rows.

Padding free: with sdpa or eager attention the completions' real tokens can run as one packed row [1, T] (no
padding between rows), each token attending to its own prompt and the earlier tokens of its own row through a 4D
mask (`packed_mask`); taken when it costs less than the padded rows (`packing_pays`)."""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect

import torch

from ..algo.logprobs import token_logprobs
from .caches import cache_argument, keeps_recurrent_state
from .head import head_transform, positions
from .models import completion_logprobs, unwrap


def shared_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(first, owner)`: the first row [B] of each run of consecutive rows with the same prompt (ids and mask),
    and each row's run [N]. A group's G rows are consecutive, so a group is one run (or several when trained_rows
    cut rows between them: each run is still exact)."""
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
    `packing_refusal` allows it), as padded rows (False), or whichever costs less (None)."""
    hf = unwrap(model)
    body, head, transform = hf.base_model, hf.get_output_embeddings(), head_transform(hf.config)
    first, owner = shared_prompts(prompt_ids, prompt_mask)  # [B], [N]
    ids, mask = prompt_ids[first], prompt_mask[first]  # [B, P]
    valid = completion_mask.bool()  # [N, C]
    packed = (pack is not False and packing_refusal(hf) is None
              and (pack or packing_pays(hf.config.hidden_size, mask.shape, completion_mask.shape, int(valid.sum()))))
    # use_cache=False: the cache given is used all the same, and checkpointed layers do not warn about it.
    cache, argument = _fresh_cache(hf.config), cache_argument(body)
    with _cache_kept_under_checkpointing(body):
        # [B, H]: the prompt's last state (left padding ends on a real token)
        prompt_hidden = body(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False,
                             **{argument: cache}).last_hidden_state[:, -1]
        if any(layer.keys is None for layer in cache.layers):
            raise CacheDropped(f"{type(hf).__name__} drops the cache in this mode (gradient checkpointing)")
        # Positions continue from each row's real prompt length, as on the whole row.
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [N, P+C]
        completion_positions = positions(attention_mask)[:, prompt_ids.shape[1]:]  # [N, C]
        if packed:
            hidden = body(input_ids=completion_ids[valid][None], position_ids=completion_positions[valid][None],
                          attention_mask=_packed_masks(hf, cache, mask, owner, completion_mask, completion_positions),
                          use_cache=False, **{argument: _expanded(cache, None, prompt_ids.shape[1])}
                          ).last_hidden_state[0]  # [T, H]
        else:
            hidden = body(input_ids=completion_ids, attention_mask=attention_mask, position_ids=completion_positions,
                          use_cache=False, **{argument: _expanded(cache, owner, prompt_ids.shape[1])}
                          ).last_hidden_state  # [N, C, H]
    if packed:
        # The state before each token: its prompt's last for a row's first token, else the token before it.
        row = _rows(valid)  # [T]
        starts = torch.cat([row.new_ones(1, dtype=torch.bool), row[1:] != row[:-1]])  # [T]
        before = torch.where(starts, owner[row], len(first) + torch.arange(len(row), device=row.device) - 1)  # [T]
        hidden = torch.cat([prompt_hidden, hidden]).index_select(0, before)[None]  # [1, T, H]
        targets = completion_ids[valid][None]  # [1, T]
    else:
        # The state before each completion token: the prompt's last for the first, then the completion's own.
        hidden = torch.cat([prompt_hidden.index_select(0, owner)[:, None], hidden[:, :-1]], dim=1)  # [N, C, H]
        targets = completion_ids
    out = token_logprobs(hidden, head.weight, targets, temperature=temperature, bias=head.bias,
                         chunk_size=chunk_size, return_entropy=return_entropy, logit_scale=transform.scale,
                         softcap=transform.softcap)
    if not packed:
        return out

    def unpack(flat):
        return flat.new_zeros(valid.shape).masked_scatter(valid, flat[0])  # [1, T] -> [N, C]

    return (unpack(out[0]), unpack(out[1])) if return_entropy else unpack(out)


PACKED_ATTENTION = ("sdpa", "eager")  # take a 4D mask as it is; flash-attention would need the rows' offsets


def packing_refusal(hf_model) -> str | None:
    """Why the completions cannot run as one packed row under `hf_model`, or None when they can: its attention
    must take a 4D mask, and layers of several kinds (full and sliding) need a body that takes a mask per kind."""
    from transformers.cache_utils import DynamicCache

    implementation = getattr(hf_model.config, "_attn_implementation", None)
    if implementation not in PACKED_ATTENTION:
        return f"{implementation} attention takes no 4D mask"
    windows = _windows(hf_model.config, DynamicCache(config=hf_model.config).layers)
    if len(windows) > 1 and not _takes_masks_by_kind(type(hf_model.base_model)):
        return f"{type(hf_model).__name__} takes one mask for layers of several kinds"
    return None


def packing_pays(hidden_size: int, prompts: tuple, rows: tuple, tokens: int) -> bool:
    """Whether `tokens` real completion tokens packed into one row cost less than their padded rows [N, C] against
    prompts [B, P]. Cost per token and layer, in units of 4 x hidden_size multiply-adds: about 6 x hidden_size for
    the linear layers (12 hidden_size^2 weights), 1 per key attended (keys and values). A packed row attends to
    all B prompts and all of its tokens (the mask only zeroes them), padded rows to one prompt and C tokens. No real
    token (a rank's inert row, kept for the collectives) is left padded: a packed row cannot be empty."""
    (b, p), (n, c) = prompts, rows
    return 0 < tokens and tokens * (6 * hidden_size + b * p + tokens) < n * c * (6 * hidden_size + p + c)


def _windows(config, layers) -> dict:
    """Each kind of attention layer (config.layer_types' names, or one kind) -> its sliding window (None: full),
    read from the model's cache layers, as the model's own masks use them."""
    kinds = getattr(config, "layer_types", None) or ["attention"] * len(layers)
    return {kind: layer.sliding_window if getattr(layer, "is_sliding", False) else None
            for kind, layer in zip(kinds, layers)}


@functools.cache
def _takes_masks_by_kind(body_class) -> bool:
    """transformers' bodies with several layer kinds take `attention_mask` as a dict of masks, one per kind."""
    return "causal_mask_mapping := attention_mask, dict" in inspect.getsource(body_class.forward)


def _packed_masks(hf, cache, prompt_mask: torch.Tensor, owner: torch.Tensor, completion_mask: torch.Tensor,
                  completion_positions: torch.Tensor):
    """The packed row's 4D mask [1, 1, T, B*P + T] (a dict of them by layer kind when kinds differ): booleans for
    sdpa, to be added (0 or the dtype's lowest) for eager."""
    windows = _windows(hf.config, cache.layers)
    masks = {window: packed_mask(prompt_mask, owner, completion_mask, completion_positions, window)
             for window in set(windows.values())}
    if hf.config._attn_implementation == "eager":
        low = torch.finfo(hf.dtype).min
        masks = {w: torch.zeros(m.shape, dtype=hf.dtype, device=m.device).masked_fill(~m, low)
                 for w, m in masks.items()}
    return next(iter(masks.values())) if len(masks) == 1 else {kind: masks[w] for kind, w in windows.items()}


def packed_mask(prompt_mask: torch.Tensor, owner: torch.Tensor, completion_mask: torch.Tensor,
                completion_positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[1, 1, T, B*P + T], True where the packed row's token t (the real completion tokens, row by row) may attend:
    the real tokens of its own prompt (keys laid out prompt by prompt), then the tokens of its own row up to itself;
    with a sliding `window`, only keys fewer than `window` positions back (transformers' sliding layers)."""
    valid = completion_mask.bool()  # [N, C]
    row, position = _rows(valid), completion_positions[valid]  # [T], [T]
    b, p = prompt_mask.shape
    prompt_owner = torch.arange(b, device=valid.device).repeat_interleave(p)  # [B*P]
    prompt_position = positions(prompt_mask).flatten()  # [B*P]
    to_prompt = (owner[row][:, None] == prompt_owner) & prompt_mask.flatten().bool()  # [T, B*P]
    to_row = (row[:, None] == row) & (position[None] <= position[:, None])  # [T, T]
    if window is not None:
        to_prompt &= position[:, None] - prompt_position < window
        to_row &= position[:, None] - position[None] < window
    return torch.cat([to_prompt, to_row], dim=1)[None, None]  # [1, 1, T, B*P+T]


def _rows(valid: torch.Tensor) -> torch.Tensor:
    """The row [T] of each real token of `valid` [N, C], in the packed row's order (row by row)."""
    return torch.arange(len(valid), device=valid.device)[:, None].expand_as(valid)[valid]


def _capturing(base):
    class Capturing(base):
        """Holds the keys and values of the prompt forward; a replay replaces them instead of appending."""

        def update(self, key_states, value_states, *args, **kwargs):
            self.keys, self.values, self.is_initialized = key_states, value_states, True
            return key_states, value_states

    return Capturing


def _reading(base):
    class Reading(base):
        """Holds the prompts' keys and values [B, h, P, d] and each row's prompt (`owner` [N]); returns the
        row's prompt states with the new ones and keeps the new ones out, so that a replay sees the same states
        and `get_mask_sizes` stays that of the prompt alone."""

        def update(self, key_states, value_states, *args, **kwargs):
            # Expanded here, not held expanded: under checkpointing a layer's replay expands again, and only the
            # B prompts' keys and values stay alive between forward and backward.
            if self.owner is None:  # one packed row: the prompts one after another, [1, h, B*P, d]
                keys, values = (s.transpose(0, 1).flatten(1, 2)[None] for s in (self.keys, self.values))
            else:
                keys, values = self.keys.index_select(0, self.owner), self.values.index_select(0, self.owner)  # [N]
            return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)

    return Reading


@functools.cache
def _layer_classes() -> dict:
    """transformers' layer class -> (its capturing, its reading) subclass."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    return {base: (_capturing(base), _reading(base)) for base in (DynamicLayer, DynamicSlidingWindowLayer)}


def _fresh_cache(config):
    """A new cache (nothing shared between forwards) whose layers capture the prompt's keys and values: the layers
    transformers builds for `config`, each turned into its capturing subclass."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=config)
    for layer in cache.layers:
        layer.__class__ = _layer_classes()[type(layer)][0]
    return cache


def _expanded(cache, owner: torch.Tensor | None, prompt_length: int):
    """A new cache giving each layer's prompt keys and values [B, h, P, d] to the rows [N] that share them (`owner`),
    or to one packed row (None: all prompts' tokens whole, the mask chooses among them)."""
    readers = dict(_layer_classes().values())  # capturing -> reading
    expanded = copy.copy(cache)
    expanded.layers = []
    for layer in cache.layers:
        new = copy.copy(layer)  # its settings (a sliding window's size)
        new.__class__ = readers[type(layer)]
        keys, values = layer.keys, layer.values  # [B, h, P, d]
        if getattr(layer, "is_sliding", False) and owner is not None:
            # What a sliding-window layer keeps after P tokens: the last W - 1, which is all the window can reach.
            start = max(keys.shape[2] - (layer.sliding_window - 1), 0)
            keys, values = keys[:, :, start:], values[:, :, start:]  # [B, h, min(P, W-1), d]
            new.cumulative_length = prompt_length
        new.keys, new.values, new.owner = keys, values, owner  # [B, h, *, d], expanded to [N] by update
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
    Returns the largest difference over the tolerance (`agree` makes it the largest over ranks, so that all ranks
    decide alike; above 1, they differ) and the difference. Runs in eval mode (no dropout) and without autocast, as
    the start-up head check does."""
    take = (shared_prompts(rollout.prompt_ids, rollout.prompt_mask)[1] == 0).nonzero().squeeze(1)[:rows]  # [r]
    prompt_ids, prompt_mask = rollout.prompt_ids[take], rollout.prompt_mask[take]  # [r, P]
    completion_ids, completion_mask = rollout.completion_ids[take, :tokens], rollout.completion_mask[take, :tokens]
    if completion_ids.shape[1] == 0:
        return agree(0.0), 0.0
    was_training = model.training
    model.eval()
    try:
        with torch.autocast(prompt_ids.device.type, enabled=False):
            whole = completion_logprobs(model, torch.cat([prompt_ids, completion_ids], 1),
                                        torch.cat([prompt_mask, completion_mask], 1), prompt_ids.shape[1],
                                        temperature=temperature, chunk_size=chunk_size)  # [r, k]
            # Both layouts of the completions, padded rows and (where the model allows it) one packed row.
            error = max((shared_prompt_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                                temperature=temperature, chunk_size=chunk_size, pack=pack) - whole
                         ).abs().masked_fill(completion_mask == 0, 0).max().item()
                        for pack in (False, True)[:1 + (packing_refusal(unwrap(model)) is None)])
    finally:
        model.train(was_training)
    # 16-bit weights: the two paths round differently (batch shapes differ), in the last places of the largest.
    low_precision = unwrap(model).get_output_embeddings().weight.dtype not in (torch.float32, torch.float64)
    tolerance = 1e-3 + (2**-5 * whole.abs().max().item() if low_precision else 0.0)
    return agree(error / tolerance), error
