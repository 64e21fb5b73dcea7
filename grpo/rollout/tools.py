"""Tools a model may call while it decodes (TRL's `tools=` / `environment_factory=`; docs/tools.md): `Tools.of`
makes plain functions and an environment class's public methods JSON schemas, which the chat template renders into
each prompt (engines/chat.py); inline tools (`InlineTool`) run inside the text; `parse_hermes` reads Hermes / Qwen
calls."""
from __future__ import annotations

import contextlib
import inspect
import json
import re
import types
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ConfigError
from .engines.tool_runner import ToolRunner
from .environments import environment_reward

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
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            raise MalformedCall(f"not a call: {body!r}")
        calls.append(ToolCall(call["name"], arguments))
    if text.count("<tool_call>") != len(calls):
        raise MalformedCall(f"an unclosed <tool_call> in {text!r}")
    return calls


def strip_hermes(text: str) -> str:
    """An assistant message's text without its `<tool_call>` blocks (TRL's `content` beside the parsed `tool_calls`)."""
    return CALL.sub("", text).strip()


@dataclass(frozen=True)
class InlineTool:
    """A tool written inside the text: when the model's text ends with `trigger` inside a span opened by `open` (and
    not yet closed by `close`), `fn(expression)` runs on what lies between, and its result plus `close` is forced:
    `InlineTool("<<", "=", ">>", calculate)` turns `<<12+7=` into `<<12+7=19>>`."""

    open: str
    trigger: str
    close: str
    fn: Callable

    def expression(self, text: str, since: int = 0) -> str | None:
        """The expression to evaluate when `text` (one assistant message) has just completed the trigger; None
        otherwise. Spans opened before character `since` (the end of the last forced result) are done with."""
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
    """What a decode may call: `functions` by name; TRL's `environment_factory` as given, its `environments` by
    name (`named_environments`) and each class's tools (`methods`: name -> JSON schema); the functions' schemas, the
    `inline` tools, the call `parser`, each call's `timeout_s`, and the `runner` of the calls (one per run)."""

    functions: dict
    environment_factory: object
    environments: dict
    methods: dict
    function_schemas: list
    inline: tuple[InlineTool, ...]
    parser: str
    timeout_s: float
    runner: ToolRunner

    @classmethod
    def of(cls, tools=(), environment_factory=None, parser: str = "hermes", inline=(),
           timeout_s: float = 10.0) -> Tools:
        """Tools from TRL's arguments (`tools=[fn, ...]`, `environment_factory=`) plus `inline` ones (also accepted
        within `tools`); a ConfigError naming the tool that has no schema, a clash of names, an unknown parser."""
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
        environments = named_environments(environment_factory)
        methods = {factory: environment_methods(factory) for factory in environments.values()}
        named = [getattr(f, "__name__", repr(f)) for f in tools]
        for own in [*methods.values()] or [{}]:  # a row sees the functions and its own environment's methods
            both = named + list(own)
            if len(set(both)) < len(both):
                clash = sorted({n for n in both if both.count(n) > 1})
                raise ConfigError(f"two tools are named {', '.join(clash)}: each tool needs a name of its own")
        if not named and not inline and not environments:
            raise ConfigError("no tools: give tools=[...], environment_factory= or inline=[...]")
        return cls(dict(zip(named, tools)), environment_factory, environments, methods,
                   [schema_of(f) for f in tools], inline, parser, timeout_s, ToolRunner(timeout_s))

    @property
    def schemas(self) -> list:
        """Every tool's JSON schema: the functions', then each environment class's methods' (a name once)."""
        every = {}
        for own in self.methods.values():
            for name, schema in own.items():
                every.setdefault(name, schema)
        return [*self.function_schemas, *every.values()]

    def schemas_for(self, env) -> list:
        """The schemas a row's prompt renders: the functions' and its environment's (`env`: the row's, or None)."""
        return self.schemas if env is None else [*self.function_schemas, *self.methods[type(env)].values()]

    @property
    def chat(self) -> bool:
        """Whether the model calls tools in chat turns (schemas in the prompt, calls parsed at EOS)."""
        return bool(self.schemas)

    @property
    def names(self) -> list[str]:
        """The tools as a checkpoint records them (grpo_config.json's `tools`): functions and the environments'
        methods by name, an inline tool by its function's name and the text that calls it."""
        inline = [f"{getattr(t.fn, '__name__', 'inline')} as {t.open}...{t.trigger}" for t in self.inline]
        return [s["function"]["name"] for s in self.schemas] + inline

    def __iter__(self):
        """TRL's `trainer.tools`: the callables the model may call, the functions and then each environment
        class's methods (as its class defines them: each row calls its own instance's)."""
        seen = {*self.functions}
        yield from self.functions.values()
        for factory, own in self.methods.items():
            yield from (getattr(factory, name) for name in own if name not in seen)
            seen |= {*own}

    def resolve(self, name: str, env) -> Callable | None:
        """The callable a row's call of `name` runs (a method of its environment `env`); None: no tool of that row."""
        if name in self.functions:
            return self.functions[name]
        return getattr(env, name) if env is not None and name in self.methods[type(env)] else None

    def rewards(self) -> list:
        """TRL's rewards of the environments that own theirs: one reward function per class that defines
        `get_reward` (environments.environment_reward), in the environments' order, a class named twice once."""
        return [environment_reward(f) for f in self.methods if callable(getattr(f, "get_reward", None))]


def schema_of(fn) -> dict:
    """`fn`'s JSON schema as chat templates take it; a ConfigError saying what its docstring or hints lack."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers' own parsing exceptions, which share no base class but Exception
        raise ConfigError(f"tool {getattr(fn, '__name__', fn)!r} cannot be described to the model: {e} (a tool "
                          f"needs type hints and a Google-style docstring with an Args: section)") from None


def named_environments(environment_factory) -> dict:
    """TRL's `environment_factory` as `{name: class}`: a dict as given (each row's `environment` column names its
    own), a single class under None; ConfigError for a factory that is not a class with `reset`."""
    if environment_factory is None:
        return {}
    named = dict(environment_factory) if isinstance(environment_factory, dict) else {None: environment_factory}
    for name, factory in named.items():
        where = "environment_factory" if name is None else f"environment_factory[{name!r}]"
        if not inspect.isclass(factory):
            raise ConfigError(f"{where} must be a class (one instance is made per completion), got "
                              f"{type(factory).__name__}")
        if not callable(getattr(factory, "reset", None)):
            raise ConfigError(f"{where} {factory.__name__} has no reset(**row) method")
    return named


def environment_methods(factory) -> dict[str, dict]:
    """An environment class's tools, name -> JSON schema: its public methods except `reset` and
    `get_reward`. The schema is read from the method bound to a stand-in, so `self` is not an argument."""
    methods = {}
    for name in dir(factory):
        if name.startswith("_") or name in NOT_TOOLS or not callable(getattr(factory, name)):
            continue
        static = isinstance(inspect.getattr_static(factory, name), (staticmethod, classmethod))
        method = getattr(factory, name)
        methods[name] = schema_of(method if static else types.MethodType(method, object()))
    return methods
