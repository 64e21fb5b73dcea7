"""KV-cached sampling, written out instead of `model.generate` (whose per-step overhead rivals a small model on a
CPU: docs/benchmarks.md): one body forward per new token, the LM head on the last position only, and one uniform
number per row to pick a token, from the row's own random stream (rollout/streams). Logits are computed as the
loss computes log-probs (policy/head, float32 softmax), so the sampling policy is the one being trained."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ...policy.caches import cache_argument, keeps_recurrent_state
from ...policy.decoder import fused_decoder
from ...policy.head import head_logits, positions
from ...settings.components import SamplingKnobs
from .kv_cache import DecodingRows, in_place, preallocated_cache, select_rows


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  min_p: float | None = None) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filtering (transformers' order), in place: removed tokens get -inf."""
    if temperature != 1.0:
        logits /= temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [N, 1]
        logits.masked_fill_(logits < kth, -torch.inf)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [N, V]
        probs = sorted_logits.softmax(-1)  # [N, V]
        # Keep the smallest prefix whose mass reaches top_p (so always the most likely token).
        drop_sorted = probs.cumsum(-1) - probs >= top_p  # [N, V]
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)  # [N, V], back in vocab order
        logits.masked_fill_(drop, -torch.inf)
    if min_p is not None:
        probs = logits.softmax(-1)  # [N, V]
        # The most likely token always stays: its probability is the bound's largest value.
        logits.masked_fill_(probs < min_p * probs.amax(-1, keepdim=True), -torch.inf)
    return logits


def seen_tokens(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] bool: the vocabulary entries each row's prompt [N, P] holds (padding and ids past the head left out)."""
    ids = prompt_ids.masked_fill(prompt_mask == 0, vocab_size).clamp(max=vocab_size)  # [N, P]; V: not counted
    seen = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)  # [N, V+1]
    return seen.scatter_(1, ids, True)[:, :vocab_size]  # [N, V]


def penalize_repetitions(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty, on the raw logits [N, V]: those of tokens already seen [N, V] divided by
    `penalty` where positive and multiplied where negative."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)  # [N, V]
    return torch.where(seen, penalized, logits)  # [N, V]


CDF_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def sample_from_logits(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token id per row [N], drawn from softmax(logits) by inverse CDF in float64 with the rows' uniforms `u`
    [N, 1] (float64); -inf logits are never drawn. Two levels, so that no float64 cumulative sum runs over the
    whole vocabulary: the blocks' cumulative mass picks a block, the cumulative sum inside it the token."""
    N, V = logits.shape
    probs = logits.softmax(-1)  # [N, V]
    padded = (F.pad(probs, (0, -V % CDF_BLOCK)) if V % CDF_BLOCK else probs).view(N, -1, CDF_BLOCK)  # [N, nb, B]
    block_mass = padded.double().sum(-1)  # [N, nb]
    block_cdf = block_mass.cumsum(-1)  # [N, nb]
    target = u * block_cdf[:, -1:]  # [N, 1]
    block = torch.searchsorted(block_cdf, target, right=True)  # [N, 1]: first block whose cdf exceeds the target
    block = torch.minimum(block, (block_cdf < block_cdf[:, -1:]).sum(-1, keepdim=True))  # [N, 1]: one with mass
    rest = target - (block_cdf.gather(1, block) - block_mass.gather(1, block))  # [N, 1]: the mass left inside it
    inside = padded.gather(1, block[:, :, None].expand(N, 1, CDF_BLOCK)).squeeze(1).cumsum(-1, dtype=torch.float64)
    j = torch.searchsorted(inside, rest, right=True)  # [N, 1]
    j = torch.minimum(j, (inside < inside[:, -1:]).sum(-1, keepdim=True))  # [N, 1]: never a zero-mass entry
    return (block * CDF_BLOCK + j).squeeze(1)  # [N]


MIN_SHARED_PREFIX = 16  # tokens all prompts must share before the prefix is read once for all of them


def shared_prefix_length(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """How many first real tokens all left-padded prompts [B, P] share, leaving each at least one token of its
    own (the last token's hidden state starts its completion); 0 for a single prompt."""
    lengths = prompt_mask.sum(1)  # [B]
    shortest, P = int(lengths.min()), prompt_ids.shape[1]
    if len(prompt_ids) < 2 or shortest < 2:
        return 0
    columns = (P - lengths)[:, None] + torch.arange(shortest - 1, device=prompt_ids.device)  # [B, L-1]
    aligned = prompt_ids.gather(1, columns)  # [B, L-1]: each prompt's first tokens, left-aligned
    differs = (aligned != aligned[:1]).any(0)  # [L-1]
    return int(differs.nonzero()[0]) if differs.any() else shortest - 1


def suffixes(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each left-padded prompt [B, P] without its first `k` real tokens: ids and mask [B, S], left-padded to the
    longest rest (S); the prefix tokens of shorter rows that fall inside the S columns are masked out."""
    lengths = prompt_mask.sum(1)  # [B]
    P, S = prompt_ids.shape[1], int(lengths.max()) - k
    first = (P - lengths + k)[:, None]  # [B, 1]: each row's first own column
    own = torch.arange(P - S, P, device=prompt_ids.device)[None] >= first  # [B, S]
    return prompt_ids[:, P - S:], own.to(prompt_mask.dtype)  # [B, S] each


@dataclass(frozen=True)
class DecodeSettings:
    """What a decode samples: up to `max_new_tokens` tokens per row, with the sampling `knobs` (a run's:
    settings/components.SamplingSettings.knobs; the default filters nothing). With `stop_at_eos`, rows that sampled
    one of `eos_ids` continue with `pad_id` and the decode ends when all have; without it, EOS is never sampled and
    every row gets `max_new_tokens` tokens. `greedy` takes the most likely token instead of sampling (evaluation): the
    filters (`filter_logits`) are skipped, a repetition penalty still applies (as in transformers)."""

    max_new_tokens: int
    eos_ids: Sequence[int]
    pad_id: int
    knobs: SamplingKnobs = SamplingKnobs()
    stop_at_eos: bool = True
    greedy: bool = False


def prefill(forward, cache, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
            repeats: int, stateful: bool,
            seen: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reads left-padded prompts [B, P] into `cache` (`forward(ids, mask, positions)`: a body forward writing
    it) for N = B * repeats rows, each prompt `repeats` times in a row. Returns the rows' last prompt hidden
    states [N, H], the attention mask of every position the decode will reach [N, P'+C], 1 past the prompt, the
    last prompt tokens' positions [N, 1] and the tokens seen `seen` [B, V] repeated (None passes).

    A prompt is read once and its KV cache repeated for its copies; with a cache written in place, the first
    tokens all prompts share are read once for all of them (positions count real tokens, so the keys are the
    same). A model keeping a recurrent state (`stateful`) has its rows prefilled one by one."""
    if stateful and repeats > 1:
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(repeats, 0), prompt_mask.repeat_interleave(repeats, 0)
        seen = None if seen is None else seen.repeat_interleave(repeats, 0)  # [N, V]
        repeats = 1  # [N, P] prompts
    ids, mask = prompt_ids, prompt_mask  # [B, P]
    k = shared_prefix_length(prompt_ids, prompt_mask) if not stateful and in_place(cache) else 0
    if k >= MIN_SHARED_PREFIX:  # prompts that start alike (a system prompt, a worked example): read it once
        start = prompt_ids.shape[1] - int(prompt_mask[0].sum())  # row 0's first real token
        forward(prompt_ids[:1, start:start + k], prompt_mask.new_ones(1, k), torch.arange(k, device=ids.device)[None])
        cache.reorder_cache(torch.zeros(len(ids), dtype=torch.long, device=ids.device))  # its KV for every row
        ids, mask = suffixes(prompt_ids, prompt_mask, k)  # [B, S]
        mask = torch.cat([mask.new_ones(len(mask), k), mask], 1)  # [B, k+S]: the prefix, then each suffix
    full_mask = torch.cat([mask, mask.new_ones(len(mask), max_new_tokens)], 1)  # [B, P'+C]
    position_ids = positions(mask)[:, mask.shape[1] - ids.shape[1]:]  # [B, S]: those of the tokens fed
    hidden = forward(ids, mask, position_ids)[:, -1]  # [B, H]
    position_ids = position_ids[:, -1:]  # [B, 1]
    if repeats > 1:  # the B prefilled prompts become their N copies
        copies = torch.arange(len(hidden), device=hidden.device).repeat_interleave(repeats)  # [N]
        hidden, full_mask, position_ids, seen = select_rows(cache, copies, hidden, full_mask, position_ids, seen)
    return hidden, full_mask, position_ids, seen


class Decoded(NamedTuple):
    """What a decode returns: the completions [N, C] (`pad_id` after each row's end), which of their tokens were
    fed rather than sampled [N, C] (a tool's output and the turn headers around it) and each row's length [N], up
    to and including the token that ended it (C for a row nothing ended)."""

    completion_ids: torch.Tensor
    fed: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor | None = None  # [N, C] the sampled tokens' log-probs (NaN elsewhere), when asked for


class ForcedTokens:
    """Tokens queued for some rows of a decode (a tool's output), fed one per step in place of a sampled one, into
    the row's own KV cache positions (docs/tools.md). `tools.row_ends` (engines/tool_loop.ToolLoop) sees every token
    a row samples and says what to queue, or that a row ends."""

    def __init__(self, tools, N: int, C: int, device: torch.device):
        self.tools, self.queued = tools, {}  # original row -> its tokens still to feed
        self.mask = torch.zeros(N, C, dtype=torch.long, device=device)  # [N, C]

    def apply(self, token: torch.Tensor, rows: torch.Tensor, step: int) -> torch.Tensor:
        """This step's tokens [n] of rows `rows` [n] with queued ones in place of sampled ones; [n] bool: which were."""
        forced = torch.zeros_like(token, dtype=torch.bool)  # [n]
        if self.queued:
            where = {r: i for i, r in enumerate(rows.tolist())}
            for r in list(self.queued):
                token[where[r]], forced[where[r]] = self.queued[r].pop(0), True
                if not self.queued[r]:
                    del self.queued[r]
            self.mask[rows[forced], step] = 1
        return forced

    def react(self, token: torch.Tensor, rows: torch.Tensor, own: torch.Tensor, eos: torch.Tensor,
              room: int) -> torch.Tensor:
        """Show the tools the tokens [n] that batch rows `rows` [n] sampled this step (`own` [n]: a token of their
        own; `eos` [n]: an EOS of their own); [n] bool: the rows that end now. A row whose tool ran gets its output
        queued."""
        ends, own = eos.clone(), own.nonzero().squeeze(1)  # [n], [k]: positions that sampled a token of their own
        if own.numel() == 0:
            return ends
        ended, fed = self.tools.row_ends(rows[own].tolist(), token[own].tolist(), [room] * own.numel(),
                                         eos[own].tolist())
        ends[own] = torch.tensor(ended, device=ends.device)
        self.queued.update({r: list(ids) for r, ids in fed.items() if ids})
        return ends


def next_tokens(logits: torch.Tensor, s: DecodeSettings, seen: torch.Tensor | None, eos: torch.Tensor,
                u: torch.Tensor | None, with_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decoding step's tokens [n] from its logits [n, V] (`seen` [n, V]: the tokens a repetition penalty counts;
    `u` [n, 1]: the rows' uniforms) and, `with_logprobs`, each one's log-prob [n] where it was drawn from."""
    k = s.knobs
    if seen is not None:
        logits = penalize_repetitions(logits, seen, k.repetition_penalty)  # [n, V]
    if not s.stop_at_eos:
        logits[:, eos] = -torch.inf
    if s.greedy:
        token = logits.argmax(dim=-1)  # [n]
    else:
        token = sample_from_logits(filter_logits(logits, k.temperature, k.top_k, k.top_p, k.min_p), u=u)  # [n]
    if not with_logprobs:
        return token, None
    return token, logits.gather(1, token[:, None]).squeeze(1) - logits.logsumexp(-1)  # [n], [n]


def decoding_step(hf_model, cache, forward, int8: bool, bf16: bool = False):
    """`step(ids [n, 1], mask [n, T], position_ids [n, 1]) -> hidden [n, H]`: a Llama-shaped model's fused step
    (policy/decoder), on int8 weights or its bf16 base; else the last position of `forward`, the body's."""
    fused = fused_decoder(hf_model.base_model, cache, int8, bf16) if in_place(cache) else None
    if int8 and fused is None:
        raise ConfigError("int8_sampling_weights=True needs decoding steps that run fused (policy/decoder): a "
                          "Llama, Mistral or Qwen2 model with full attention and float32 weights on a CPU, LoRA "
                          f"folded; this {type(hf_model).__name__} is not one: set int8_sampling_weights=false")
    return fused or (lambda ids, mask, position_ids: forward(ids, mask, position_ids)[:, -1])  # [n, H]


@torch.no_grad()
def decode(hf_model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, settings: DecodeSettings, *,
           repeats: int = 1, seeds: torch.Tensor | None = None, on_token=None, head_matmul=None,
           tools=None, int8: bool = False, bf16: bool = False, with_logprobs: bool = False) -> Decoded:
    """Completions [N, C] (`Decoded`) sampled after left-padded prompts [B, P] as `settings` say, each prompt
    `repeats` times in a row (N = B * repeats), by a transformers causal LM: the prompts read by `prefill`, then one
    step per token, finished rows leaving the batch and the cache. `seeds` [N] (int64): where each row's random
    stream starts (None: drawn from torch's generator). `on_token(n)`: called after every step with the tokens it
    generated. `head_matmul`: the LM head's product (policy/folding). `tools` (engines/tool_loop.ToolLoop): the
    tools' output fed (`ForcedTokens`). `int8`, `bf16`: `decoding_step`'s. `with_logprobs`: each sampled token's
    log-prob (vLLM's processed log-probs) as `Decoded.logprobs` [N, C], NaN where no token was sampled."""
    s, k, N, device = settings, settings.knobs, len(prompt_ids) * repeats, prompt_ids.device
    if s.max_new_tokens == 0:
        return Decoded(prompt_ids.new_empty(N, 0), prompt_ids.new_empty(N, 0), prompt_ids.new_zeros(N))
    body, logits_of = hf_model.base_model, head_logits(hf_model, head_matmul)
    argument = cache_argument(body) or "past_key_values"  # the model's own error if it takes no cache
    cache = preallocated_cache(hf_model.config, prompt_ids.shape[1] + s.max_new_tokens)

    def forward(ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return body(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                    **{argument: cache}).last_hidden_state  # [n, t, H]

    stateful = keeps_recurrent_state(hf_model, cache)  # its rows can neither leave nor be repeated
    # Tokens seen so far, kept only when penalized: the default path does no extra work per step.
    seen = None if k.repetition_penalty == 1.0 else seen_tokens(
        prompt_ids, prompt_mask, hf_model.get_output_embeddings().weight.shape[0])  # [B, V]
    hidden, full_mask, position_ids, seen = prefill(forward, cache, prompt_ids, prompt_mask, repeats=repeats,
                                                    max_new_tokens=s.max_new_tokens, stateful=stateful, seen=seen)
    P = full_mask.shape[1] - s.max_new_tokens  # the prompt's columns of the mask
    step_forward = decoding_step(hf_model, cache, forward, int8, bf16)
    if seeds is None and not s.greedy:
        seeds = torch.randint(-2 ** 63, 2 ** 63 - 1, (N,), device=device)  # [N]
    batch = DecodingRows(N, device, compacts=not stateful, seeds=None if s.greedy else seeds)  # rows decoding
    eos = torch.tensor(list(s.eos_ids), device=device)
    turns = None if tools is None else ForcedTokens(tools, N, s.max_new_tokens, device)
    lengths = torch.full((N,), s.max_new_tokens, dtype=torch.long, device=device)  # [N]: as long as the decode
    tokens, logprobs = [], [] if with_logprobs else None
    for step in range(s.max_new_tokens):
        token, sampled = next_tokens(logits_of(hidden), s, seen, eos, None if s.greedy else batch.uniforms(step),
                                     with_logprobs)  # [n], [n] or None
        forced = None if turns is None else turns.apply(token, batch.rows, step)  # [n] a tool's tokens
        if logprobs is not None:  # [n]: NaN where the row had finished or a tool wrote the token
            unsampled = batch.finished if forced is None else batch.finished | forced
            logprobs.append(batch.scatter(sampled.masked_fill(unsampled, torch.nan), torch.nan))  # [N]
        if seen is not None:  # before padding: a finished row's mark does not matter, and pad may be past V
            seen.scatter_(1, token[:, None], True)
        token = token.masked_fill(batch.finished, s.pad_id)
        tokens.append(batch.scatter(token, s.pad_id))  # [N]
        if on_token is not None:
            on_token(int((~batch.finished).sum()))
        was = batch.finished.clone()  # [n]
        ended = torch.isin(token, eos) if s.stop_at_eos else torch.zeros_like(was)  # [n]: a sampled EOS ends a row
        if turns is not None:  # unless it closed a tool call; the tools may end a row, or take it on past its EOS
            ended = turns.react(token, batch.rows, ~was & ~forced, ended & ~forced, s.max_new_tokens - step - 1)
        batch.finished |= ended
        lengths[batch.rows[batch.finished & ~was]] = step + 1
        if step + 1 == s.max_new_tokens:
            break
        if s.stop_at_eos:
            if batch.finished.all():
                break
            token, full_mask, position_ids, seen = batch.compact(cache, token, full_mask, position_ids, seen)
        position_ids = position_ids + 1  # [n, 1]
        hidden = step_forward(token[:, None], full_mask[:, :P + step + 1], position_ids)  # [n, H]; mask a view
    completion_ids = torch.stack(tokens, dim=1)  # [N, C]
    C = completion_ids.shape[1]
    fed = turns.mask[:, :C] if turns is not None else torch.zeros_like(completion_ids)  # [N, C]
    return Decoded(completion_ids, fed, lengths.clamp(max=C), None if logprobs is None else torch.stack(logprobs, 1))
