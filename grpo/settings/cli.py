"""A `Config` as text: `--key=value` command-line overrides (type-checked, typos named), `--help`, and values
written as the command line would take them."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import textwrap

from ..errors import ConfigError
from .checks import checked_field
from .config import Config
from .fieldtypes import FieldType, field_types
from .trl_names import check_keys


def apply_overrides(config: Config, args: list[str]) -> Config:
    """Apply `--key=value` command-line overrides (a bare `--flag` sets a bool field to True); later ones win.
    Each value is checked on its own as it is read, so an error names its override; the settings that must
    agree are checked once all are applied, so their order does not matter."""
    types, changes = field_types(Config), {}
    for arg in args:
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"expected --key=value, got {arg!r}")
    keys = [arg[2:].partition("=")[0].replace("-", "_") for arg in args]
    # TRL settings that change nothing here (warned about); every other unknown key is one error
    no_effect = check_keys({k: a.partition("=")[2] or "true" for k, a in zip(keys, args)}, list(types))
    for key, arg in zip(keys, args):
        _, has_value, text = arg[2:].partition("=")
        if key in no_effect:
            continue
        if not has_value:
            if (types[key].form, types[key].item) != ("scalar", bool):
                raise ConfigError(f"--{key} needs a value: --{key}=VALUE")
            text = "true"
        value = parse_value(key, text, types[key])
        try:
            changes[key] = checked_field(Config, key, value)
        except ConfigError as e:
            raise ConfigError(f"--{key}={text}: {e}") from None
    return dataclasses.replace(config, **changes) if changes else config


_SCALARS = {int: ("an integer", "integers"), float: ("a float", "floats"),
            bool: ("a boolean (true/false)", "booleans"), str: ("a string", "strings")}
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def config_of_record(record: dict) -> Config:
    """The Config a checkpoint's grpo_config.json records (fields added since it was written keep their
    defaults; keys no longer settings are dropped)."""
    names = {f.name for f in dataclasses.fields(Config)}
    return Config(**{k: v for k, v in record.items() if k in names})


def parse_value(key: str, text: str, tp: FieldType):
    """Parse the text of `--key=text` into a value of the field type `tp` (fieldtypes.py)."""
    if tp.optional and text.strip().lower() == "none":
        return None
    if tp.form == "text":
        return text  # `str | list[str]` (report_to): the field's own check reads the text
    if tp.form == "dict":
        return _parse_json_object(key, text, tp.optional)
    if tp.form == "other":
        raise ConfigError(f"--{key}: a setting of this type cannot be set from the command line")
    try:
        if tp.form == "list":
            return [_parse_scalar(part, tp.item) for part in text.split(",")] if text.strip() else []
        return _parse_scalar(text, tp.item)
    except ValueError:
        single, plural = _SCALARS[tp.item]
        expected = f"a comma-separated list of {plural}" if tp.form == "list" else single
        expected += " or none" if tp.optional else ""
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


BUILT_MODEL = {"model": "not used: the recipe's build_model builds the model"}  # format_help's `unused`


def format_help(config: Config, unused: dict[str, str] | None = None) -> str:
    """Every setting with its current value and docstring, grouped as declared in Config; a setting in `unused` (name:
    why) is shown with that reason instead of a value (`model` on a recipe that builds its own)."""
    lines, group, unused = ["settings (override with --key=value):"], None, unused or {}
    for name, field_group, doc in _describe_fields():
        if field_group != group:
            group = field_group
            lines += ["", f"{group}:"]
        lines.append(f"  --{name}: {unused[name]}" if name in unused else
                     f"  --{name}={format_value(getattr(config, name))}")
        lines.append(textwrap.fill(doc, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def split_options(args: list[str], names: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """A command's own options, `names` (`--name=value` or `--name value`), apart from Config overrides."""
    own, rest, i = {}, [], 0
    while i < len(args):
        key, has_value, value = args[i][2:].partition("=") if args[i].startswith("--") else ("", False, "")
        if key in names:
            if not has_value:
                if i + 1 == len(args):
                    raise ConfigError(f"--{key} needs a value")
                value, i = args[i + 1], i + 1
            own[key] = value
        else:
            rest.append(args[i])
        i += 1
    return own, rest
