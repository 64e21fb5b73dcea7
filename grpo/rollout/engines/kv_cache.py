"""A KV cache allocated once for a whole decode (prompt + max_new_tokens positions) and written in place, for
rollout/engines/decoding.py: transformers' DynamicCache concatenates every layer's keys and values at every step, which
copies the whole cache each token (SmolLM2-135M, 16 rows of 384 positions: about 280 MB a step) and, past glibc's
mmap threshold (infra/allocator), makes every copy fresh pages to fault in.

Each layer keeps buffers [B, H, T_max, D] and hands attention views of the positions written so far; rows leave
or are repeated (rollout/engines/compaction) by one copy of the buffers. Families whose cache is not
a plain per-position key/value store (sliding windows, chunked or linear attention, recurrent state) keep
transformers' DynamicCache (`preallocated_cache` returns it)."""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs


class PreallocatedLayer(CacheLayerMixin):
    """One attention layer's keys and values in buffers of `max_length` positions, filled from the left
    (transformers' layer interface; the attention mask is sized as for a cache that grows)."""

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

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.reorder_cache(torch.arange(self.key_buffer.shape[0], device=self.device).repeat_interleave(repeats))


def preallocated_cache(config, max_length: int) -> Cache:
    """A cache of `max_length` positions for a model with `config`, written in place, when all its layers are
    plain full attention; else transformers' DynamicCache (sliding or chunked windows keep only their last
    positions, linear attention and recurrent layers a state, which in-place positions do not describe)."""
    text_config = config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(text_config)
    if not layer_types or any(t != "full_attention" for t in layer_types):
        return DynamicCache(config=config)
    return Cache(layers=[PreallocatedLayer(max_length) for _ in layer_types])


def in_place(cache: Cache) -> bool:
    """Whether every layer of `cache` is a PreallocatedLayer: plain attention, where a token's keys and values
    depend only on the tokens before it and their positions, so a shared prefix can be read once."""
    return bool(cache.layers) and all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)

