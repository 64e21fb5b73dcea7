"""`Decoder`, the engine over our KV-cached decode loop (engines/decoding.py); the prompt encoder a run sets up once
(`prompt_encoder`); `rollout_of`, where every engine's completions become a Rollout."""
from __future__ import annotations

import warnings

import torch

from ...policy.folding import sampling_weights
from ...policy.models import context_length, eval_mode, unwrap
from ...settings.components import SamplingKnobs
from ..batches import Rollout
from ..prompts import PromptTooLong
from ..streams import PromptStreams
from .chat import check_tool_template, is_chat, render
from .decoding import Decoded, DecodeSettings, decode
from .tool_loop import ToolLoop


class PromptEncoder:
    """Tokenizes prompts (chat ones rendered with `chat_template_kwargs`, and with the schemas of `tools`
    (rollout/tools.Tools) when the model calls some in chat turns), cutting overlong ones from the left; a prompt
    still longer than the model's context is an error (PromptTooLong). `eos_ids` (`eos_token_ids`): what a
    template for tools is checked with."""

    def __init__(self, tokenizer, max_prompt_length: int | None, chat_template_kwargs: dict | None = None, tools=None,
                 eos_ids: list[int] | None = None):
        self.tokenizer, self.max_prompt_length, self.tools = tokenizer, max_prompt_length, tools
        self.chat_template_kwargs, self.warned = chat_template_kwargs, False
        if tools is not None and tools.chat:  # a template that cannot serve the tools: said once, up front
            check_tool_template(tokenizer, chat_template_kwargs, eos_ids)

    def __call__(self, prompts: list, context: int | None = None, max_completion_length: int = 0,
                 envs: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts' ids and mask [B, P], left-padded; `context`: the model's positions (None: unchecked), of
        which a completion needs `max_completion_length`; `envs`: each prompt's environment, whose tools it shows."""
        chat = self.tools is not None and self.tools.chat
        envs = envs if envs is not None else [None] * len(prompts)
        texts = [render(self.tokenizer, p, self.chat_template_kwargs, self.tools.schemas_for(env) if chat else None)
                 for p, env in zip(prompts, envs)]
        # A chat template already writes any BOS it wants; plain text gets the tokenizer's default.
        rows = [self.tokenizer(t, add_special_tokens=not is_chat(prompts[0]))["input_ids"] for t in texts]
        if self.max_prompt_length is not None and any(len(r) > self.max_prompt_length for r in rows):
            if not self.warned:
                warnings.warn(f"a prompt of {max(len(r) for r in rows)} tokens is longer than max_prompt_length="
                              f"{self.max_prompt_length}; prompts are cut from the left (warned once)")
                self.warned = True
            rows = [r[-self.max_prompt_length:] for r in rows]
        longest = max(range(len(rows)), key=lambda i: len(rows[i]))
        if context is not None and len(rows[longest]) > context:
            room = max(1, context - max_completion_length)
            raise PromptTooLong(prompts[longest], len(rows[longest]), context, self.max_prompt_length, room)
        return left_pad(rows, self.tokenizer.pad_token_id)

    def tool_loop(self, prompts: list, repeats: int, max_iterations: int | None, envs: list | None,
                  eos_ids: list[int]) -> ToolLoop | None:
        """The tool loop of one decode of `prompts`, each `repeats` times in a row (None without tools)."""
        repeated = [p for p in prompts for _ in range(repeats)]
        return None if self.tools is None else ToolLoop(self.tools, self.tokenizer, repeated, max_iterations, envs,
                                                         eos_ids, self.chat_template_kwargs)


def prompt_encoder(model, tokenizer, settings, tools=None) -> PromptEncoder:
    """The run's one prompt encoder (its engine's and evaluation's), from `settings`' prompt length and kwargs."""
    kwargs = None if settings.chat_template_kwargs is None else dict(settings.chat_template_kwargs)
    return PromptEncoder(tokenizer, settings.max_prompt_length, kwargs, tools,
                         None if tools is None else eos_token_ids(tokenizer, model))


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)  # [N, P]
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)  # [N, P]
    return ids, mask


def eos_token_ids(tokenizer, model) -> list[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = ids if ids is not None else tokenizer.eos_token_id
    return [ids] if isinstance(ids, int) else list(ids)


@torch.no_grad()
def sample_completions(model, tokenizer, encode: PromptEncoder, prompts: list, *, num_generations: int,
           max_completion_length: int, knobs: SamplingKnobs = SamplingKnobs(), stop_at_eos: bool = True,
           greedy: bool = False, streams: PromptStreams | None = None, on_token=None,
           max_tool_calling_iterations: int | None = None, envs: list | None = None, int8: bool = False,
           bf16: bool = False) -> Rollout:
    """Sample `num_generations` completions per prompt of `prompts` (encoded by `encode`) with our KV-cached decode
    (engines/decoding.decode, whose `DecodeSettings` say what `knobs`, `stop_at_eos` and `greedy` do), as a Rollout
    (`rollout_of`). `streams`: the prompts' random streams (None: drawn from torch's generator). With the tools of
    `encode`, rows call them within the decode (`envs`: one environment per completion). `int8`, `bf16`: the steps
    on int8 weights or on the bf16 base, each sampled token's log-prob kept as `sampling_logprobs`."""
    prompt_ids, prompt_mask = encode(prompts, context_length(model), max_completion_length,  # [B, P]
                                     None if envs is None else envs[::num_generations])
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)  # [B, P]
    eos_ids = eos_token_ids(tokenizer, model)
    settings = DecodeSettings(max_completion_length, eos_ids, tokenizer.pad_token_id, knobs, stop_at_eos, greedy)
    seeds = None if streams is None else streams.seeds(len(prompts), num_generations, device)  # [N]
    # Our own loop, not model.generate: a checkpoint's generation-config defaults never apply, only the run's knobs.
    # Eval mode: the KV cache on (gradient checkpointing would disable it), dropout off.
    loop = encode.tool_loop(prompts, num_generations, max_tool_calling_iterations, envs, eos_ids)
    with eval_mode(model), sampling_weights(model, int8) as head_matmul:
        decoded = decode(unwrap(model), prompt_ids, prompt_mask, settings, repeats=num_generations, seeds=seeds,
                         on_token=on_token, head_matmul=head_matmul, tools=loop, int8=int8, bf16=bf16,
                         with_logprobs=int8 or bf16)
    return rollout_of(prompt_ids, prompt_mask, decoded, tokenizer, eos_ids, chat=is_chat(prompts[0]), loop=loop,
                      repeats=num_generations)


def rollout_of(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, decoded: Decoded, tokenizer, eos_ids: list[int],
               *, chat: bool, loop: ToolLoop | None = None, repeats: int = 1) -> Rollout:
    """The Rollout of completions after their prompts [B, P], each prompt `repeats` times in a row (N = B * repeats),
    however they were made (our decoder, a server, a rollout_func: `decoded_rows`): each completion its first
    `decoded.lengths` tokens; "truncated" unless the model's own EOS ended it (an EOS it sampled, not one it was
    fed); the fed tokens attended to but out of the loss mask. The completions as TRL gives them to rewards: texts,
    or chat messages after chat prompts (`chat`), with the tool loop `loop`'s assistant and tool messages."""
    ids, fed, lengths = decoded.completion_ids, decoded.fed, decoded.lengths  # [N, C], [N, C], [N]
    prompt_ids = prompt_ids.repeat_interleave(repeats, dim=0)  # [N, P]
    prompt_mask = prompt_mask.repeat_interleave(repeats, dim=0)  # [N, P]
    N, C = ids.shape
    completion_mask = (torch.arange(C, device=ids.device)[None] < lengths[:, None]).long()  # [N, C]
    last = (lengths - 1).clamp(min=0)[:, None]  # [N, 1]
    own_eos = torch.zeros(N, dtype=torch.bool, device=ids.device) if C == 0 else (  # [N]
        torch.isin(ids.gather(1, last), torch.tensor(eos_ids, device=ids.device)) & (fed.gather(1, last) == 0))[:, 0]
    truncated = ~(own_eos & (lengths > 0))  # [N]
    ids = ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id)  # [N, C]
    if chat and loop is not None:
        completions = [loop.completion_messages(i, row[:n].tolist(), (1 - f[:n]).tolist())
                       for i, (row, f, n) in enumerate(zip(ids, fed, lengths.tolist()))]
    else:
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
    rollout = Rollout(prompt_ids, prompt_mask, ids, completion_mask, completions, truncated,
                      loss_mask=completion_mask * (1 - fed))
    if decoded.logprobs is not None:  # for the importance-sampling correction: NaN on tokens out of the loss
        rollout.sampling_logprobs = decoded.logprobs.masked_fill(rollout.loss_mask == 0, torch.nan)  # [N, C]
    if loop is not None:
        calls, failures = loop.row_counts()
        rollout.tool_calls = torch.tensor(calls, device=ids.device)  # [N]
        rollout.tool_failures = torch.tensor(failures, device=ids.device)  # [N]
        rollout.tool_notes = loop.row_failures()
    return rollout


def decoded_rows(rows: list[list[int]], pad_id: int, eos_ids: list[int] | None, fed: list[list[int]] | None = None,
                 logprobs: list[list[float]] | None = None) -> Decoded:
    """Completions made elsewhere (a server, a rollout_func), as lists of token ids, as our decode returns them: a
    completion runs up to and including its first EOS of `eos_ids`, or whole (`eos_ids` None: the tool loop ended
    it); `fed`: 1 on each token a tool wrote (None: none); `logprobs`: each token's sampled log-prob."""
    width, eos = max(1, max(len(r) for r in rows)), set(eos_ids or ())

    def padded(lists: list[list], value, dtype: torch.dtype) -> torch.Tensor:  # [N, C]
        return torch.tensor([list(r) + [value] * (width - len(r)) for r in lists], dtype=dtype)

    ids = padded(rows, pad_id, torch.long)  # [N, C]
    lengths = torch.tensor([next((i + 1 for i, t in enumerate(r) if t in eos), len(r)) for r in rows])  # [N]
    return Decoded(ids, torch.zeros_like(ids) if fed is None else padded(fed, 0, torch.long), lengths,
                   None if logprobs is None else padded(logprobs, torch.nan, torch.float32))


class Decoder:
    """The engine on our decoder (engines/engine.Engine): the prompts in as few decodes as the memory plan allows
    (`prompts_per_decode`; None: a micro-batch's); `settings`: settings/components.SamplingSettings."""

    def __init__(self, policy, tokenizer, encode: PromptEncoder, settings, prompts_per_decode: int | None = None):
        self.policy, self.tokenizer, self.encode, self.settings = policy, tokenizer, encode, settings
        k = settings.micro_batch_prompts
        self.prompts_per_decode = k if prompts_per_decode is None else max(k, prompts_per_decode // k * k)

    @torch.no_grad()
    def __call__(self, prompts: list, on_token=None, streams: PromptStreams | None = None,
                 envs: list | None = None) -> tuple[Rollout, dict[str, list]]:
        s, k, G = self.settings, self.prompts_per_decode, self.settings.num_generations
        streams = streams if streams is not None else PromptStreams(s.seed)
        decodes = [self.policy.parallel.unsharded(lambda model: sample_completions(
            model, self.tokenizer, self.encode, prompts[start:start + k], num_generations=G,
            max_completion_length=s.max_completion_length, knobs=s.knobs, stop_at_eos=s.stop_at_eos,
            streams=streams.after(start), on_token=on_token, max_tool_calling_iterations=s.max_tool_calling_iterations,
            envs=None if envs is None else envs[start * G:(start + k) * G], int8=s.int8, bf16=s.bf16))
            for start in range(0, len(prompts), k)]
        return Rollout.cat(decodes, self.tokenizer.pad_token_id), {}
