"""A KV cache allocated once for a whole decode and written in place (transformers' DynamicCache copies the whole
cache each token: docs/benchmarks.md); the decode's rows (`DecodingRows`): finished rows leave the batch and the
KV cache, each row drawing from its own random stream (rollout/streams) whichever rows are left."""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from ..streams import uniforms


class PreallocatedLayer(CacheLayerMixin):
    """One attention layer's keys and values in buffers of `max_length` positions (transformers' layer interface)."""

    def __init__(self, max_length: int):
        super().__init__()
        self.max_length, self.length = max_length, 0
        self.key_buffer = self.value_buffer = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        B, H, _, D = key_states.shape  # keys and values may differ in head size (MLA): each its own
        self.key_buffer = key_states.new_empty(B, H, self.max_length, D)  # [B, H, T_max, D]
        self.value_buffer = value_states.new_empty(B, value_states.shape[1], self.max_length,
                                                   value_states.shape[-1])  # [B, H, T_max, Dv]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        self.key_buffer[:, :, self.length:self.length + t].copy_(key_states)
        self.value_buffer[:, :, self.length:self.length + t].copy_(value_states)
        self.length += t
        self._views()
        return self.keys, self.values

    def _views(self) -> None:
        # Views of the positions written so far: attention reads no unwritten position, so no mask column
        # for them is needed.
        self.keys = self.key_buffer[:, :, :self.length]  # [B, H, t, D]
        self.values = self.value_buffer[:, :, :self.length]  # [B, H, t, Dv]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0  # keys the queries see, from offset 0

    def get_max_length(self) -> int:
        return -1  # as a growing cache: attention reads views of the written positions only

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows `beam_idx` of the buffers: fewer when finished rows leave, repeated for a prompt's copies."""
        if self.is_initialized:
            index = beam_idx.to(self.device)
            self.key_buffer = self.key_buffer.index_select(0, index)
            self.value_buffer = self.value_buffer.index_select(0, index)
            self._views()


def preallocated_cache(config, max_length: int) -> Cache:
    """A cache of `max_length` positions written in place when all layers are full attention; else DynamicCache."""
    text_config = config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(text_config)
    if not layer_types or any(t != "full_attention" for t in layer_types):
        return DynamicCache(config=config)
    return Cache(layers=[PreallocatedLayer(max_length) for _ in layer_types])


def in_place(cache: Cache) -> bool:
    """Whether every layer of `cache` is a PreallocatedLayer: plain attention, where a token's keys and values
    depend only on the tokens before it and their positions, so a shared prefix can be read once."""
    return bool(cache.layers) and all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)


MIN_SHARE = 0.25  # compact once at least this share of the batch has finished (each compaction copies the cache)
BLOCK = 64  # decoding steps whose uniforms are drawn at once: a draw is a dozen small tensor operations


class DecodingRows:
    """Which of a decoding batch's N rows are still in it, and which of those have finished. `compacts=False`
    keeps them all (a recurrent state); `seeds` [N]: where each row's random stream starts (None: greedy)."""

    def __init__(self, N: int, device: torch.device, compacts: bool = True, seeds: torch.Tensor | None = None):
        self.N, self.compacts, self.seeds = N, compacts, seeds
        self.rows = torch.arange(N, device=device)  # [n]: each batch row's original row (n = N at first)
        self.finished = torch.zeros(N, dtype=torch.bool, device=device)  # [n]
        self.drawn = None  # [n, BLOCK]: the rows' uniforms for this block of steps

    def uniforms(self, step: int) -> torch.Tensor:
        """Decoding step `step`'s uniforms [n, 1] (float64), each row's from its own stream."""
        if step % BLOCK == 0:
            steps = torch.arange(step, step + BLOCK, device=self.rows.device)  # [BLOCK]
            self.drawn = uniforms(self.seeds, steps)  # [n, BLOCK]
        return self.drawn[:, step % BLOCK, None]  # [n, 1]

    def scatter(self, token: torch.Tensor, pad_id: int) -> torch.Tensor:
        """This step's tokens [n] at their original rows [N]; rows that have left get `pad_id`."""
        if len(self.rows) == self.N:
            return token
        out = token.new_full((self.N,), pad_id)  # [N]
        out[self.rows] = token
        return out

    def compact(self, cache, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """`tensors` (None passes) without the finished rows, which leave `cache` too, once MIN_SHARE of the batch."""
        done = int(self.finished.sum()) if self.compacts else 0
        if done == 0 or done < MIN_SHARE * len(self.rows):
            return tensors
        keep = (~self.finished).nonzero().squeeze(1)  # [n']
        self.rows, self.finished = self.rows[keep], self.finished[keep]
        if self.seeds is not None:
            self.seeds, self.drawn = self.seeds[keep], self.drawn[keep]
        return select_rows(cache, keep, *tensors)


def select_rows(cache, index: torch.Tensor, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Rows `index` [n'] of every KV-cache layer and of `tensors` (None passes through). reorder_cache, not
    batch_select_indices, which would miss linear-attention layers' states."""
    cache.reorder_cache(index)
    return tuple(None if t is None else t[index] for t in tensors)
