"""Batch compaction for the KV-cached decode loop (rollout/decoding.py): rows that have finished (sampled EOS)
leave the batch and the KV cache, so that later steps compute only the rows still decoding, and each step's
tokens go back to their own rows. Sampling draws what the uncompacted loop draws: every step takes one uniform
for each of the N original rows and a row uses its own, whichever rows are left."""
from __future__ import annotations

import torch

MIN_SHARE = 0.25  # compact once at least this share of the batch has finished (each compaction copies the cache)


class DecodingRows:
    """Which of a decoding batch's N rows are still in it, and which of those have finished. `compacts=False`
    keeps them all (a model with a recurrent state, which rows cannot leave: rollout/kv_cache)."""

    def __init__(self, N: int, device: torch.device, compacts: bool = True):
        self.N, self.compacts = N, compacts
        self.rows = torch.arange(N, device=device)  # [n]: each batch row's original row (n = N at first)
        self.finished = torch.zeros(N, dtype=torch.bool, device=device)  # [n]

    def uniforms(self) -> torch.Tensor:
        """This step's uniforms [n, 1] (float64), one per original row and drawn for all N: a row's draw does not
        depend on which rows have left, and the random stream advances as in the uncompacted loop."""
        return torch.rand(self.N, 1, dtype=torch.float64, device=self.rows.device)[self.rows]  # [n, 1]

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
        return select_rows(cache, keep, *tensors)


def select_rows(cache, index: torch.Tensor, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Rows `index` [n'] of every KV-cache layer and of `tensors` (None passes through): fewer rows when finished
    ones leave, repeated rows when a prefilled prompt is copied. reorder_cache, not batch_select_indices, which
    would miss linear-attention layers' states."""
    cache.reorder_cache(index)
    return tuple(None if t is None else t[index] for t in tensors)
