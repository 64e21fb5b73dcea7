"""Multi-turn tool calling inside one batched decode: `ToolLoop`, the per-row state machine to which the decode loop
hands, each step, the rows that sampled a token of their own (`after_tokens`). A row whose tool ran gets tokens back
(the tool's output, then the next assistant header), fed one per step in place of sampling, with loss mask 0: chat
tools' calls run at EOS, unless the row made `max_iterations` rounds (TRL's `max_tool_calling_iterations`; None: no
limit); an inline tool's when the text completes its trigger. Failures, and how they count: docs/tools.md."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ..tools import InlineTool, MalformedCall, ToolCall, Tools, parse_hermes, strip_hermes
from .chat import render, tool_turn_text


@dataclass
class _Row:
    """One completion's state."""

    prompt: object
    env: object
    ids: list[int] = field(default_factory=list)  # every completion id so far, its own and forced
    start: int = 0  # where its current assistant message starts
    history: list[dict] = field(default_factory=list)  # the conversation after the prompt, as the template renders it
    events: list = field(default_factory=list)  # the messages each tool round adds for rewards (None: inline)
    rounds: int = 0
    span_end: int = 0  # where in the current message the last inline result ends
    prompt_text: str | None = None
    calls: int = 0  # tool calls made, and those that failed (TRL's tools/* metrics)
    failures: int = 0
    notes: list[str] = field(default_factory=list)  # what went wrong, one line per failed call

    def failed(self, note: str, calls: int = 1) -> None:
        self.failures += calls
        self.notes.append(note)


@dataclass
class _Pending:
    """A row's calls of this step, waiting for their outcomes."""

    row: int
    room: int
    thunks: list
    calls: list[ToolCall] | None = None  # chat calls
    message: str = ""  # the assistant message's text (chat) or the text so far (inline)
    inline: InlineTool | None = None


class ToolLoop:
    """Tool calling for one decode of N rows. `prompts[i]`: row i's prompt (chat messages, or a string when only
    inline tools are used); `envs[i]`: its environment when the tools have environments; `eos_ids`: the ids that end
    a turn (the tokenizer's EOS by default); `chat_template_kwargs`: as the prompts were rendered with."""

    def __init__(self, tools: Tools, tokenizer, prompts: list, max_iterations: int | None = None,
                 envs: list | None = None, eos_ids=None, chat_template_kwargs: dict | None = None):
        if tools.environments and (envs is None or len(envs) != len(prompts)):
            raise ValueError("the tools have environments: pass envs= (make_envs), one per prompt")
        if tools.chat and any(isinstance(p, str) for p in prompts):
            raise ValueError("chat tools need chat prompts (lists of messages); text prompts take inline tools")
        self.tools, self.tokenizer, self.max_iterations = tools, tokenizer, max_iterations
        self.chat_template_kwargs = chat_template_kwargs
        self.eos = set(eos_ids) if eos_ids is not None else {tokenizer.eos_token_id}
        self.rows = [_Row(p, e) for p, e in zip(prompts, envs or [None] * len(prompts))]
        self._trigger_chars = {t.trigger[-1] for t in tools.inline}
        self._triggering: dict[int, bool] = {}  # token id -> whether its text holds a trigger's last character

    def after_tokens(self, rows: list[int], tokens: list[int], room: list[int]) -> dict[int, list[int] | None]:
        """Called every decode step with the rows (original indices) that just sampled a token of their own, those
        tokens, and `room[k]`: how many tokens row `rows[k]` may still take. Returns, for the rows whose tool ran,
        the token ids to feed next, or None for a row that must end now; rows left out go on as sampled."""
        ended, pending = {}, []
        for r, token, space in zip(rows, tokens, room):
            row = self.rows[r]
            row.ids.append(token)
            if self.max_iterations is not None and row.rounds >= self.max_iterations:
                continue
            if token in self.eos:
                if self.tools.chat and not self._chat_calls(r, space, pending):
                    ended[r] = None
            elif self._trigger_chars and self._may_trigger(token):
                self._inline_call(r, space, pending)
        outcomes = self.tools.runner.run([p.thunks for p in pending])  # rollout/engines/tool_runner
        forced = {p.row: self._finish(p, o) for p, o in zip(pending, outcomes)}
        return {**forced, **ended}

    def row_ends(self, rows: list[int], tokens: list[int], room: list[int],
                 eos: list[bool]) -> tuple[list[bool], dict[int, list[int]]]:
        """The end of a row, as our decode and a server's segments both take it: after the token each of `rows`
        sampled (`eos[k]`: one that ends a turn), whether the row ends (its tools end it, or an EOS after which no
        tool ran), and the tokens to feed each row whose tools ran, which goes on past its EOS."""
        reaction = self.after_tokens(rows, tokens, room)
        ends = [reaction[r] is None if r in reaction else e for r, e in zip(rows, eos)]
        return ends, {r: ids for r, ids in reaction.items() if ids is not None}

    def _chat_calls(self, r: int, space: int, pending: list) -> bool:
        """Queue the calls of row r's message that just ended; False when the row must end now (malformed, unknown)."""
        row = self.rows[r]
        message = self._text(row.ids[row.start:-1])
        try:
            calls = parse_hermes(message)
        except MalformedCall as error:
            row.calls += 1
            row.failed(f"malformed call, the row ended: {error}")
            return False
        if not calls:
            return True
        functions = [self.tools.resolve(c.name, row.env) for c in calls]
        row.calls += len(calls)
        if None in functions:
            unknown = [c.name for c, f in zip(calls, functions) if f is None]
            row.failed(f"unknown tool {', '.join(map(repr, unknown))}, the row ended", calls=len(unknown))
            return False
        thunks = [functools.partial(f, **c.arguments) for f, c in zip(functions, calls)]
        pending.append(_Pending(r, space, thunks, calls=calls, message=message))
        return True

    def _inline_call(self, r: int, space: int, pending: list) -> None:
        row = self.rows[r]
        text = self._text(row.ids[row.start:])
        for tool in self.tools.inline:
            expression = tool.expression(text, row.span_end)
            if expression is not None:
                row.calls += 1
                pending.append(_Pending(r, space, [functools.partial(tool.fn, expression)], message=text,
                                        inline=tool))
                return

    def _finish(self, p: _Pending, outcomes: list) -> list[int] | None:
        """The tokens row `p.row` is fed after its calls' `outcomes` (None: they do not fit its room)."""
        row = self.rows[p.row]
        names = [getattr(p.inline.fn, "__name__", "inline tool") if p.inline is not None else c.name
                 for c in p.calls or [None]]
        for name, o in zip(names, outcomes):
            if o.failed:
                row.failed(f"{name} {o.why}")
        if p.inline is not None:
            text = outcomes[0].text + p.inline.close
        else:
            tool_calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                          for c in p.calls]
            tool_messages = [{"role": "tool", "name": c.name, "content": o.text} for c, o in zip(p.calls, outcomes)]
            held = self._prompt_text(row) + self._text(row.ids)
            text, assistant = tool_turn_text(self.tokenizer, [*row.prompt, *row.history], p.message, tool_calls,
                                             tool_messages, held, self.tools.schemas_for(row.env),
                                             self.chat_template_kwargs)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > p.room:  # the row ends: each of its calls that had not failed already fails now
            ok = [name for name, o in zip(names, outcomes) if not o.failed]
            row.failed(f"the result of {', '.join(names)} ({len(ids)} tokens) did not fit in the {p.room} tokens "
                       f"left, the row ended", calls=len(ok))
            return None
        if p.inline is not None:
            row.span_end = len(p.message) + len(self._text(ids))
            row.events.append(None)
        else:
            row.history += [assistant, *tool_messages]
            row.events.append([{"role": "assistant", "content": strip_hermes(p.message), "tool_calls": tool_calls},
                               *tool_messages])
            row.span_end, row.start = 0, len(row.ids) + len(ids)
        row.ids += ids
        row.rounds += 1
        return ids

    def completion_messages(self, row: int, completion_ids: list[int], own: list[int]) -> list[dict]:
        """Row `row`'s completion as TRL gives it to reward functions when tools are used: assistant and tool
        messages in turn; an inline tool's results stay in their assistant message's content. `completion_ids`:
        the row's ids without padding; `own`: 1 on the tokens it sampled, 0 on those it was fed."""
        events = iter(self.rows[row].events)
        messages, text, own_since = [], "", True
        for sampled, ids in mask_runs(completion_ids, own):
            if sampled:
                text, own_since = text + self._text(ids, skip_special=True), True
                continue
            event = next(events, ())
            if event == ():
                raise ValueError(f"row {row}'s mask has more fed runs than the row had tool rounds")
            if event is None:
                text += self._text(ids, skip_special=True)
            else:
                messages, text, own_since = messages + event, "", False
        return messages + [{"role": "assistant", "content": text}] if own_since else messages

    def row_counts(self) -> tuple[list[int], list[int]]:
        """Each row's tool calls and failed calls (TRL's tools/* metrics: rollout/batches.tool_metrics)."""
        return [row.calls for row in self.rows], [row.failures for row in self.rows]

    def row_failures(self) -> list[list[str]]:
        """Each row's failed calls, a line each: what completions.jsonl shows as `tool_failures`."""
        return [list(row.notes) for row in self.rows]

    def _text(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)

    def _prompt_text(self, row: _Row) -> str:
        if row.prompt_text is None:
            row.prompt_text = render(self.tokenizer, row.prompt, self.chat_template_kwargs,
                                     self.tools.schemas_for(row.env))
        return row.prompt_text

    def _may_trigger(self, token: int) -> bool:
        """Whether `token`'s text holds a trigger's last character: a cheap test before the row's message is decoded."""
        if token not in self._triggering:
            self._triggering[token] = any(c in self._text([token]) for c in self._trigger_chars)
        return self._triggering[token]


def mask_runs(ids: list[int], mask: list[int]):
    """(mask value, ids) for each maximal run of equal mask values."""
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            yield bool(mask[start]), ids[start:i]
            start = i
