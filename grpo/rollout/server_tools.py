"""Tools through an inference server: each completion is sampled in segments, one request per segment, that stop
where a tool may run (the end of an assistant message for chat tools, an inline tool's trigger); the row's tokens
go through the same `ToolLoop` our decode loop uses (rollout/tool_loop.py), and a tool's output (with the turn
headers around it) is appended as tokens the model did not write, out of the loss mask; the next segment's
prompt is the prompt and everything so far (the server's prefix cache keeps that cheap)."""
from __future__ import annotations

import torch

from .decoding import ToolDecode
from .streams import int64

NAN = float("nan")


class ServerToolRow:
    """One completion row `row` of `loop` (a ToolLoop) sampled on `sample(prompt_ids, seed, max_tokens, stop)`,
    which returns (token ids, log-probs) of one segment; `width`: the completion's length bound."""

    def __init__(self, loop, row: int, width: int, eos_ids: list[int], stops: list[str]):
        self.loop, self.row, self.width, self.eos, self.stops = loop, row, width, set(eos_ids), stops
        self.ids: list[int] = []
        self.own: list[int] = []  # 1: sampled by the model, 0: fed by a tool
        self.logprobs: list[float] = []

    def run(self, prompt: list[int], seed: int, sample) -> None:
        for segment in range(self.width):  # each segment adds at least one token, or the row ends
            room = self.width - len(self.ids)
            if room <= 0:
                return
            tokens, logprobs = sample(prompt + self.ids, int64(seed + segment), room, self.stops)
            if not tokens:
                return
            reaction, ended = None, False
            for token, logprob in zip(tokens, logprobs):
                self.ids.append(token), self.own.append(1), self.logprobs.append(logprob)
                out = self.loop.after_tokens([self.row], [token], [self.width - len(self.ids)])
                if self.row in out:
                    reaction = out[self.row]
                    ended = reaction is None
                    break
                if token in self.eos:
                    return
            if ended:
                return
            if reaction:
                self.ids += reaction
                self.own += [0] * len(reaction)
                self.logprobs += [NAN] * len(reaction)


def tool_decode(rows: list[ServerToolRow], pad_id: int) -> tuple[ToolDecode, torch.Tensor]:
    """The rows as our decode loop returns them with tools (ids [N, C], tool mask [N, C], lengths [N]), and their
    sampled log-probs [N, C] (NaN on fed tokens and padding)."""
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
    return ToolDecode(ids, fed, lengths), logprobs
