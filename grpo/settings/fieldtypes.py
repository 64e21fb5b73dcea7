"""What each `Config` field's annotation allows, read in one place for both the checks of a value
(checks.py) and the parsing of `--key=value` text (cli.py)."""
from __future__ import annotations

import functools
import types
import typing
from dataclasses import dataclass

SCALARS = (int, float, bool, str)


@dataclass(frozen=True)
class FieldType:
    """A field's annotation, as the checks and the command line read it. `form` is "scalar" (of `item`),
    "list" (of `item`), "dict" (a JSON object), "text" (several types, str among them, e.g. `str | list[str]`:
    the field's rule reads the value, which on the command line is its text) or "other" (not checked, and not
    settable from the command line)."""

    form: str
    item: type | None = None  # int, float, bool or str: the scalar's type, or the list's items'
    optional: bool = False  # None is allowed


def field_type(tp) -> FieldType:
    """The FieldType of the annotation `tp`: int, float, bool, str, list[X], dict, or a union of them."""
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        optional = type(None) in typing.get_args(tp)
        options = [t for t in typing.get_args(tp) if t is not type(None)]
        if len(options) != 1:
            return FieldType("text" if str in options else "other", optional=optional)
        (tp,) = options
    if tp is dict:
        return FieldType("dict", optional=optional)
    if typing.get_origin(tp) is list and typing.get_args(tp)[0] in SCALARS:
        return FieldType("list", typing.get_args(tp)[0], optional)
    if tp in SCALARS:
        return FieldType("scalar", tp, optional)
    return FieldType("other", optional=optional)


@functools.lru_cache(maxsize=None)
def field_types(cls) -> dict[str, FieldType]:
    """Each field of the dataclass `cls` with its FieldType, in declaration order."""
    return {name: field_type(tp) for name, tp in typing.get_type_hints(cls).items()}
