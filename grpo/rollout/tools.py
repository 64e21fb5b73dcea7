"""Tools a model may call while it decodes (TRL's `tools=` / `environment_factory=`), and running them.

- `Tools.of(...)`: plain functions and an environment class's public methods become JSON schemas
  (transformers' `get_json_schema`: type hints and a Google-style docstring), which the chat template renders
  into the prompt (`rollout/chat.py`); inline tools (`InlineTool`, e.g. GSM8K's `<<12+7=19>>`) run
  inside the text instead.
- `parse_hermes`: Hermes / Qwen calls, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- `rollout/tool_runner.ToolRunner` (`Tools.runner`, one per run): one decode step's calls, the rows' at once
  and each row's in order, each in a process that its timeout kills. A call that raises or times out returns
  TRL's error text, `{'error': '...'}`.
- `make_envs`: one environment per completion, reset with its dataset row, as TRL does.

The per-row state machine that uses these is `rollout/tool_loop.py`.
"""
from __future__ import annotations

import inspect
import json
import re
import types
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ConfigError, UserError
from .tool_runner import ToolRunner

PARSERS = ("hermes",)
NOT_TOOLS = ("reset", "get_reward")  # an environment's methods that the model may not call
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict


class MalformedCall(ValueError):
    """A `<tool_call>` block that is not a JSON object with a string `name` and an object `arguments`."""


def parse_hermes(text: str) -> list[ToolCall]:
    """The calls in one assistant message, in order ([] when there are none); MalformedCall for a block that
    is not valid JSON of the right shape, or an opened block that is never closed."""
    calls = []
    for body in CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            raise MalformedCall(f"not JSON: {body!r} ({e})") from None
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            raise MalformedCall(f"not a call: {body!r}")
        calls.append(ToolCall(call["name"], arguments))
    if text.count("<tool_call>") != len(calls):
        raise MalformedCall(f"an unclosed <tool_call> in {text!r}")
    return calls


def strip_hermes(text: str) -> str:
    """An assistant message's text without its `<tool_call>` blocks: the `content` TRL gives reward functions
    beside the parsed `tool_calls`."""
    return CALL.sub("", text).strip()


@dataclass(frozen=True)
class InlineTool:
    """A tool written inside the text: when the model's text ends with `trigger` inside a span opened by
    `open` (and not yet closed by `close`), `fn(expression)` runs on what lies between, and its result plus
    `close` is forced. GSM8K's calculator annotations: `InlineTool("<<", "=", ">>", calculate)` turns
    `<<12+7=` into `<<12+7=19>>`."""

    open: str
    trigger: str
    close: str
    fn: Callable

    def expression(self, text: str, since: int = 0) -> str | None:
        """The expression to evaluate when `text` (one assistant message) has just completed the trigger;
        None otherwise. Spans opened before character `since` (the end of the last forced result) are
        done with."""
        if not text.endswith(self.trigger):
            return None
        body = text[:len(text) - len(self.trigger)]
        start = body.rfind(self.open)
        if start < since or start < 0:
            return None
        expression = body[start + len(self.open):]
        return None if self.close and self.close in expression else expression


@dataclass(frozen=True)
class Tools:
    """What a decode may call: `functions` by name, an `environment_factory` whose instances' public
    methods (`methods`) are tools of their row, their JSON `schemas` (for the chat template) and the
    `inline` tools; the call `parser`, each call's `timeout_s`, and the `runner` that runs the calls (made
    with the Tools, once per run: its worker processes serve every step)."""

    functions: dict
    environment_factory: type | None
    methods: tuple[str, ...]
    schemas: list
    inline: tuple[InlineTool, ...]
    parser: str
    timeout_s: float
    runner: ToolRunner

    @classmethod
    def of(cls, tools=(), environment_factory=None, parser: str = "hermes", inline=(),
           timeout_s: float = 10.0) -> Tools:
        """Tools from TRL's arguments (`tools=[fn, ...]`, `environment_factory=`) plus `inline` ones (also
        accepted within `tools`); a
        ConfigError naming the tool that has no schema, a clash of names, an unknown parser."""
        if isinstance(tools, Tools):  # already made, with its own parser, timeout and environments
            if environment_factory is not None and environment_factory is not tools.environment_factory:
                raise ConfigError("pass the environment_factory inside the Tools made "
                                  "(Tools.of(tools, environment_factory)), not beside it: its environments' methods "
                                  "are tools the decode must know")
            return tools
        if parser not in PARSERS:
            raise ConfigError(f"tool parser {parser!r} is not known; known: {', '.join(PARSERS)}")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
        given = list(tools or ())  # TRL's functions, and our inline tools among them
        inline = (*(inline or ()), *(t for t in given if isinstance(t, InlineTool)))
        tools = [t for t in given if not isinstance(t, InlineTool)]
        methods = environment_methods(environment_factory) if environment_factory is not None else {}
        named = [getattr(f, "__name__", repr(f)) for f in tools] + list(methods)
        if len(set(named)) < len(named):
            clash = sorted({n for n in named if named.count(n) > 1})
            raise ConfigError(f"two tools are named {', '.join(clash)}: each tool needs a name of its own")
        if not named and not inline:
            raise ConfigError("no tools: give tools=[...], environment_factory= or inline=[...]")
        functions = dict(zip(named, tools))
        schemas = [schema_of(f) for f in tools] + list(methods.values())
        return cls(functions, environment_factory, tuple(methods), schemas, inline, parser, timeout_s,
                   ToolRunner(timeout_s))

    @property
    def chat(self) -> bool:
        """Whether the model calls tools in chat turns (schemas in the prompt, calls parsed at EOS)."""
        return bool(self.schemas)

    @property
    def names(self) -> list[str]:
        """The tools as a checkpoint records them (grpo_config.json's `tools`): functions and an environment's
        methods by name, an inline tool by its function's name and the text that calls it."""
        inline = [f"{getattr(t.fn, '__name__', 'inline')} as {t.open}...{t.trigger}" for t in self.inline]
        return [*self.functions, *self.methods, *inline]

    def resolve(self, name: str, env) -> Callable | None:
        """The callable a row's call of `name` runs (an environment's method on that row's `env`); None for
        a name that is not a tool of that row."""
        if name in self.functions:
            return self.functions[name]
        return getattr(env, name) if env is not None and name in self.methods else None


def schema_of(fn) -> dict:
    """`fn`'s JSON schema as chat templates take it; a ConfigError saying what its docstring or hints lack."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers' own parsing exceptions, which share no base class but Exception
        raise ConfigError(f"tool {getattr(fn, '__name__', fn)!r} cannot be described to the model: {e} (a tool "
                          f"needs type hints and a Google-style docstring with an Args: section)") from None


def environment_methods(factory) -> dict[str, dict]:
    """An environment class's tools, name -> JSON schema: its public methods except `reset` and
    `get_reward`. The schema is read from the method bound to a stand-in, so `self` is not an argument."""
    if not inspect.isclass(factory):
        raise ConfigError(f"environment_factory must be a class (one instance is made per completion), got "
                          f"{type(factory).__name__}")
    if not callable(getattr(factory, "reset", None)):
        raise ConfigError(f"environment_factory {factory.__name__} has no reset(**row) method")
    methods = {}
    for name in dir(factory):
        if name.startswith("_") or name in NOT_TOOLS or not callable(getattr(factory, name)):
            continue
        static = isinstance(inspect.getattr_static(factory, name), (staticmethod, classmethod))
        method = getattr(factory, name)
        methods[name] = schema_of(method if static else types.MethodType(method, object()))
    return methods


def make_envs(factory, rows: list[dict]) -> tuple[list, list]:
    """One environment per completion (`rows`: the dataset rows, one per completion, with their `prompt`) and
    the prompts as the model sees them: `env.reset(**row)` gets every column, and a string it returns is
    appended to the prompt's last message (to the prompt itself for a text prompt), as TRL does."""
    envs, prompts = [], []
    for row in rows:
        env = factory()
        try:
            observation = env.reset(**row)
        except Exception as error:
            raise EnvironmentFailed(f"environment {factory.__name__}.reset raised {_one_line(error)} on the dataset "
                                    f"row {_short(row)}") from error
        prompt = row["prompt"]
        if observation is not None:
            if isinstance(prompt, str):
                prompt = prompt + observation
            else:
                prompt = [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]
        envs.append(env)
        prompts.append(prompt)
    return envs, prompts


def environment_reward(environments, prompts=None, **kwargs) -> list[float | None]:
    """A reward function (TRL's contract, `environments=` passed by the trainer): each environment's
    `get_reward()`, None where it has none; EnvironmentFailed naming the class, the completion and its prompt
    when one raises."""
    rewards = []
    for i, env in enumerate(environments):
        try:
            rewards.append(env.get_reward() if callable(getattr(env, "get_reward", None)) else None)
        except Exception as error:
            raise get_reward_failed(env, error, i, None if prompts is None else prompts[i]) from error
    return rewards


def get_reward_failed(env, error: BaseException, i: int, prompt=None, where: str = "") -> EnvironmentFailed:
    """The one line for `env.get_reward()` raising `error` on completion `i` of the batch (its `prompt`)."""
    shown = f" (prompt {_short(prompt)})" if prompt is not None else ""
    return EnvironmentFailed(f"environment {type(env).__name__}.get_reward raised {_one_line(error)} for completion "
                             f"{i} of the batch{shown}{where}")


def environment_in(error: BaseException):
    """The environment whose `get_reward` raised `error` (the `self` of a `get_reward` frame in its traceback,
    innermost first), or None."""
    tb, found = error.__traceback__, None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "get_reward" and "self" in frame.f_locals:
            found = frame.f_locals["self"]
        tb = tb.tb_next
    return found


class EnvironmentFailed(UserError):
    """An environment's `reset` or `get_reward` raised: the message names the class, the row and the error."""


def _one_line(error: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[:limit] + "..."


def _short(value, limit: int = 200) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit] + "..."
