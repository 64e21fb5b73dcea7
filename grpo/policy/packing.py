"""The shared-prompt forward's packed layout (policy/prefix.py takes it): the completions' real tokens as one row
[1, T], with no padding between rows, each token attending to its own prompt and the earlier tokens of its own
row through a 4D mask (`packed_mask`). Taken where the model's attention takes such a mask (`packing_refusal`)
and it costs less than the padded rows (`packing_pays`); `packs` decides."""
from __future__ import annotations

import functools
import inspect

import torch

from .head import positions

PACKED_ATTENTION = ("sdpa", "eager")  # take a 4D mask as it is; flash-attention would need the rows' offsets


def packs(hf_model, pack: bool | None, prompts: tuple, rows: tuple, tokens: int) -> bool:
    """Whether the completions [N, C] (`rows`, with `tokens` real ones) against prompts [B, P] run as one packed
    row: `pack` True where `packing_refusal` allows it, False never, None where it also costs less."""
    return pack is not False and packing_refusal(hf_model) is None and (
        pack or packing_pays(hf_model.config.hidden_size, prompts, rows, tokens))


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
    the linear layers, 1 per key attended. A packed row attends to all B prompts and all of its tokens (the mask
    only zeroes them), padded rows to one prompt and C tokens. A packed row cannot be empty."""
    (b, p), (n, c) = prompts, rows
    return 0 < tokens and tokens * (6 * hidden_size + b * p + tokens) < n * c * (6 * hidden_size + p + c)


class PackedRow:
    """The completions [N, C] of rows whose prompts (`prompt_mask` [B, P]) are row `owner` [N] as one row [1, T]
    of their real tokens, against every prompt's keys and values laid out prompt by prompt."""

    cache_rows = None  # the prompts' keys and values go to the one row whole; the mask chooses among them

    def __init__(self, hf, prompt_mask: torch.Tensor, owner: torch.Tensor, completion_ids: torch.Tensor,
                 completion_mask: torch.Tensor, completion_positions: torch.Tensor):
        self.hf, self.prompt_mask, self.owner = hf, prompt_mask, owner
        self.valid, self.positions = completion_mask.bool(), completion_positions  # [N, C], [N, C]
        self.targets = completion_ids[self.valid][None]  # [1, T]

    def inputs(self, cache) -> dict:
        """The body's inputs besides the cache; `cache`: the prompts' (its layers' kinds choose the masks)."""
        return dict(input_ids=self.targets, position_ids=self.positions[self.valid][None],
                    attention_mask=self._masks(cache.layers))

    def states(self, prompt_hidden: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The state before each token [1, T, H], from the prompts' last states [B, H] and the row's [1, T, H]:
        its prompt's last for a row's first token, else the token before it; and the tokens [1, T]."""
        row = _rows(self.valid)  # [T]
        starts = torch.cat([row.new_ones(1, dtype=torch.bool), row[1:] != row[:-1]])  # [T]
        before = torch.where(starts, self.owner[row],
                             len(prompt_hidden) + torch.arange(len(row), device=row.device) - 1)  # [T]
        return torch.cat([prompt_hidden, hidden[0]]).index_select(0, before)[None], self.targets  # [1, T, H]

    def unpack(self, out):
        """Log-probs (and entropies) [1, T] back in the rows [N, C], 0 on padding."""
        def unpack(flat):
            return flat.new_zeros(self.valid.shape).masked_scatter(self.valid, flat[0])  # [1, T] -> [N, C]

        return tuple(unpack(part) for part in out) if isinstance(out, tuple) else unpack(out)

    def _masks(self, layers):
        """The row's 4D mask [1, 1, T, B*P + T] (a dict of them by layer kind when kinds differ): booleans for
        sdpa, to be added (0 or the dtype's lowest) for eager."""
        hf = self.hf
        windows = _windows(hf.config, layers)
        masks = {window: packed_mask(self.prompt_mask, self.owner, self.valid, self.positions, window)
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


def _rows(valid: torch.Tensor) -> torch.Tensor:
    """The row [T] of each real token of `valid` [N, C], in the packed row's order (row by row)."""
    return torch.arange(len(valid), device=valid.device)[:, None].expand_as(valid)[valid]
