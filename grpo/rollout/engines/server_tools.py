"""Tools through an inference server: each completion is sampled in segments, one request per segment, that stop
where a tool may run (the end of an assistant message for chat tools, an inline tool's trigger); the row's tokens
go through the same `ToolLoop` our decode loop uses (rollout/engines/tool_loop.py), and a tool's output (with the turn
headers around it) is appended as tokens the model did not write, out of the loss mask; the next segment's
prompt is the prompt and everything so far (the server's prefix cache keeps that cheap)."""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import torch

from ..streams import int64
from .decoding import Decoded

NAN = float("nan")


class ServerToolRow:
    """One completion row `row` of `loop` (a ToolLoop), sampled one segment at a time: `request()` says what to
    sample next (prompt ids, seed, room, stop strings; None once the row is done), `take(tokens, logprobs)` runs the
    segment's tokens through the tool loop. Requests may run in threads; `take` runs where the caller runs the
    tool loop (its tool runner forks its workers from the caller's thread)."""

    def __init__(self, loop, row: int, prompt: list[int], seed: int, width: int, eos_ids: list[int],
                 stops: list[str]):
        self.loop, self.row, self.prompt, self.seed = loop, row, prompt, seed
        self.width, self.eos, self.stops = width, set(eos_ids), stops
        self.ids: list[int] = []
        self.own: list[int] = []  # 1: sampled by the model, 0: fed by a tool
        self.logprobs: list[float] = []
        self.segments, self.done = 0, False

    def request(self) -> tuple[list[int], int, int, list[str]] | None:
        room = self.width - len(self.ids)
        if self.done or room <= 0:
            self.done = True
            return None
        self.segments += 1
        return self.prompt + self.ids, int64(self.seed + self.segments - 1), room, self.stops

    def take(self, tokens: list[int], logprobs: list[float]) -> None:
        """The segment's tokens, up to the first a tool reacts to (its output appended) or that ends the row."""
        if not tokens:
            self.done = True
            return
        for token, logprob in zip(tokens, logprobs):
            self.ids.append(token), self.own.append(1), self.logprobs.append(logprob)
            (ends,), fed = self.loop.row_ends([self.row], [token], [self.width - len(self.ids)], [token in self.eos])
            fed = fed.get(self.row)
            if fed is not None:  # a tool ran: its output appended, the next segment starts after it
                self.ids += fed
                self.own += [0] * len(fed)
                self.logprobs += [NAN] * len(fed)
            if ends or fed is not None:
                self.done = ends
                return


def sample_rows(rows: list[ServerToolRow], sample, workers: int = 32) -> None:
    """Sample every row to its end: each row's segments in order, the rows' requests at once (threads), their
    tokens taken in this thread as the answers come."""
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(rows)))) as pool:
        pending = {pool.submit(sample, *r.request()): r for r in rows}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                row = pending.pop(future)
                row.take(*future.result())
                nxt = row.request()
                if nxt is not None:
                    pending[pool.submit(sample, *nxt)] = row


def tool_decode(rows: list[ServerToolRow], pad_id: int) -> Decoded:
    """The rows as our decode loop returns them (ids [N, C], fed [N, C], lengths [N]: where the tool loop ended
    them), with their sampled log-probs [N, C] (NaN on fed tokens and padding)."""
    width = max(1, max(len(r.ids) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [N, C]
    fed = torch.zeros((len(rows), width), dtype=torch.long)  # [N, C]
    logprobs = torch.full((len(rows), width), NAN)  # [N, C]
    for i, r in enumerate(rows):
        n = len(r.ids)
        ids[i, :n] = torch.tensor(r.ids, dtype=torch.long)
        fed[i, :n] = 1 - torch.tensor(r.own, dtype=torch.long)
        logprobs[i, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
    lengths = torch.tensor([len(r.ids) for r in rows], dtype=torch.long)  # [N]
    return Decoded(ids, fed, lengths, logprobs)
