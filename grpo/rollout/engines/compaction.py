"""Batch compaction for the KV-cached decode loop (rollout/engines/decoding.py): rows that have finished (sampled EOS)
leave the batch and the KV cache, so that later steps compute only the rows still decoding, and each step's
tokens go back to their own rows. Sampling draws what the uncompacted loop draws: each row draws from its own
random stream (rollout/streams), whichever rows are left."""
from __future__ import annotations

import torch

from ..streams import uniforms

MIN_SHARE = 0.25  # compact once at least this share of the batch has finished (each compaction copies the cache)
BLOCK = 64  # decoding steps whose uniforms are drawn at once: a draw is a dozen small tensor operations


class DecodingRows:
    """Which of a decoding batch's N rows are still in it, and which of those have finished. `compacts=False`
    keeps them all (a model with a recurrent state, which rows cannot leave: engines/kv_cache). `seeds` [N]: where
    each row's random stream starts (rollout/streams); None when nothing is sampled (greedy decoding)."""

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
        """`tensors` (one row per batch row: the next tokens, attention mask, positions, tokens seen; None passes
        through) without the finished rows, which also leave the KV cache `cache`; only once they are at least
        MIN_SHARE of the batch, since each compaction copies every cache layer."""
        done = int(self.finished.sum()) if self.compacts else 0
        if done == 0 or done < MIN_SHARE * len(self.rows):
            return tensors
        keep = (~self.finished).nonzero().squeeze(1)  # [n']
        self.rows, self.finished = self.rows[keep], self.finished[keep]
        if self.seeds is not None:
            self.seeds, self.drawn = self.seeds[keep], self.drawn[keep]
        return select_rows(cache, keep, *tensors)


def select_rows(cache, index: torch.Tensor, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Rows `index` [n'] of every KV-cache layer and of `tensors` (None passes through): fewer rows when finished
    ones leave, repeated rows when a prefilled prompt is copied. reorder_cache, not batch_select_indices, which
    would miss linear-attention layers' states."""
    cache.reorder_cache(index)
    return tuple(None if t is None else t[index] for t in tensors)
