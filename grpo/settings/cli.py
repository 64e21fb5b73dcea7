"""A `Config` as text: `--key=value` command-line overrides (type-checked, typos named), `--help`, and values
written as the command line would take them."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import textwrap
import types
import typing

from .config import Config
from .checks import check_key
from ..errors import ConfigError


def apply_overrides(config: Config, args: list[str]) -> Config:
    """Apply `--key=value` command-line overrides (a bare `--flag` sets a bool field to True).
    Each one is applied in turn, so later ones win."""
    hints = typing.get_type_hints(Config)
    for arg in args:
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"expected --key=value, got {arg!r}")
        key, has_value, text = arg[2:].partition("=")
        key = key.replace("-", "_")
        check_key(key, list(Config.__dataclass_fields__))
        if not has_value:
            if hints[key] not in (bool, bool | None):
                raise ConfigError(f"--{key} needs a value: --{key}=VALUE")
            text = "true"
        value = parse_value(key, text, hints[key])
        try:
            config = dataclasses.replace(config, **{key: value})
        except (TypeError, ValueError) as e:  # raised by Config.__post_init__ checks
            raise ConfigError(f"--{key}={text}: {e}") from None
    return config


_SCALARS = {int: ("an integer", "integers"), float: ("a float", "floats"),
            bool: ("a boolean (true/false)", "booleans"), str: ("a string", "strings")}
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_value(key: str, text: str, tp):
    """Parse the text of `--key=text` into a value of type `tp` (a field's annotation)."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    optional = union and type(None) in typing.get_args(tp)
    if optional:
        if text.strip().lower() == "none":
            return None
        (tp,) = [t for t in typing.get_args(tp) if t is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and str in typing.get_args(tp):
        return text  # `str | list[str]` (report_to): the field's own check reads the text
    if tp is dict:
        return _parse_json_object(key, text, optional)
    is_list = typing.get_origin(tp) is list
    item = typing.get_args(tp)[0] if is_list else tp
    if item not in _SCALARS:
        raise ConfigError(f"--{key}: a setting of type {tp} cannot be set from the command line")
    try:
        if is_list:
            return [_parse_scalar(part, item) for part in text.split(",")] if text.strip() else []
        return _parse_scalar(text, item)
    except ValueError:
        single, plural = _SCALARS[item]
        expected = f"a comma-separated list of {plural}" if is_list else single
        expected += " or none" if optional else ""
        raise ConfigError(f"--{key}: expected {expected}, got {text!r}") from None


def _parse_json_object(key: str, text: str, optional: bool) -> dict:
    """A dict setting's JSON text (`--generation_kwargs='{"top_k": 5}'`); the field's own check reads its keys."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        expected = 'a JSON object (such as {"top_k": 5})' + (" or none" if optional else "")
        raise ConfigError(f"--{key}: expected {expected}, got {text!r}")
    return value


def _parse_scalar(text: str, tp):
    """int, float, bool or str from text; ValueError if it does not parse."""
    text = text.strip() if tp is not str else text
    if tp is bool:
        if text.lower() not in _BOOLS:
            raise ValueError(text)
        return _BOOLS[text.lower()]
    return tp(text)  # int("1.5") and float("abc") raise ValueError


def field_docs() -> dict[str, str]:
    """Each Config field's docstring: the string literal right after the field in the class body."""
    return {name: doc for name, _, doc in _describe_fields()}


def _describe_fields() -> list[tuple[str, str, str]]:
    """(name, group, docstring) of each Config field in declaration order; the group is the
    `# --- group ---` comment above it. Read from the source, since Python keeps neither."""
    source = inspect.getsource(Config)
    headings = [(n, m.group(1)) for n, line in enumerate(source.splitlines(), 1)
                if (m := re.fullmatch(r"#\s*---\s*(.*?)\s*---", line.strip()))]
    body = ast.parse(source).body[0].body
    described = []
    for stmt, after in zip(body, body[1:] + [None]):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        groups = [name for lineno, name in headings if lineno < stmt.lineno]
        is_doc = (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                  and isinstance(after.value.value, str))
        doc = inspect.cleandoc(after.value.value) if is_doc else ""
        described.append((stmt.target.id, groups[-1] if groups else "", doc))
    return described


def format_value(value) -> str:
    """A value as it would be written on the command line (`--key=<this>`)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def format_help(config: Config) -> str:
    """Every setting with its current value and docstring, grouped as declared in Config."""
    lines, group = ["settings (override with --key=value):"], None
    for name, field_group, doc in _describe_fields():
        if field_group != group:
            group = field_group
            lines += ["", f"{group}:"]
        lines.append(f"  --{name}={format_value(getattr(config, name))}")
        lines.append(textwrap.fill(doc, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def config_to_dict(config: Config) -> dict:
    """The config as plain JSON-serialisable data (for saving next to a run)."""
    return dataclasses.asdict(config)
