"""Dataclasses as typed JSON: ``to_json`` (a dict, keys in declaration order, nested
dataclasses as objects) and ``from_json`` (every key checked against its annotated type, outer
container types only, nested dataclasses parsed in turn). Used by the status snapshot
(:mod:`p2pdiloco.status`); the values checked here come from a node's own files and control
socket, not from peers (those are parsed in :mod:`p2pdiloco.net.records.parse`)."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Annotated, Any, Union


class FormError(ValueError):
    """A JSON value that does not fit its dataclass: not an object, a value of the wrong
    type, or a required key missing."""


class JsonForm:
    """``to_json`` and ``from_json`` of a dataclass (fields in declaration order): mix it in."""

    def to_json(self) -> dict[str, Any]:
        """The JSON-able dict: nested dataclasses as objects, keys in declaration order."""
        return dataclasses.asdict(typing.cast(Any, self))

    @classmethod
    def from_json(cls, data: Any) -> Any:
        """Parse a JSON object into ``cls``: every key checked against its type (nested
        objects parsed in turn), keys it lacks at their defaults, unknown keys ignored (a newer
        node's). Raises FormError on a value of the wrong type or a missing required key."""
        if not isinstance(data, dict):
            raise FormError(f"{cls.__name__}: not a JSON object")
        hints = typing.get_type_hints(cls, include_extras=True)
        values = {f.name: _parse(hints[f.name], data[f.name], f.name) for f in dataclasses.fields(cls) if f.name in data}
        try:
            return cls(**values)
        except TypeError as e:  # a required key missing
            raise FormError(f"{cls.__name__}: {e}") from None


def _bare(t: Any) -> Any:
    """The type of an ``Annotated`` hint without its doc."""
    return typing.get_args(t)[0] if typing.get_origin(t) is Annotated else t


def _parse(t: Any, value: Any, where: str) -> Any:
    t = _bare(t)
    if isinstance(t, types.UnionType) or typing.get_origin(t) is Union:
        if value is None and type(None) in typing.get_args(t):
            return None
        inner = [a for a in typing.get_args(t) if a is not type(None)]
        if len(inner) == 1:
            return _parse(inner[0], value, where)
    if isinstance(t, type) and dataclasses.is_dataclass(t):
        return typing.cast(Any, t).from_json(value)
    args = typing.get_args(t)
    if typing.get_origin(t) is list and args and dataclasses.is_dataclass(args[0]) and isinstance(value, list):
        return [_parse(args[0], v, where) for v in value]
    if not conforms(value, t):
        raise FormError(f"{where}: {value!r:.60} is not {type_name(t)}")
    return value


def conforms(value: Any, t: Any) -> bool:
    """Whether a JSON value fits the type of a key (outer container types only: a list is a
    list, a dict and a nested form are objects; int fits float, bool does not fit int)."""
    args = typing.get_args(t)
    if isinstance(t, types.UnionType) or typing.get_origin(t) is Union:
        return any(conforms(value, a) for a in args)
    if t is type(None):
        return value is None
    if t is Any:
        return True
    if dataclasses.is_dataclass(t):
        return isinstance(value, dict)
    origin = typing.get_origin(t) or t
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin)


def type_name(t: Any) -> str:
    """A type as the docs name it: string, int, number, bool, list, object, null, any."""
    if t is type(None):
        return "null"
    args = typing.get_args(t)
    if isinstance(t, types.UnionType) or typing.get_origin(t) is Union:
        return " or ".join(type_name(a) for a in args)
    origin = typing.get_origin(t)
    if origin in (list, dict) or dataclasses.is_dataclass(t):
        return "list" if origin is list else "object"
    return {str: "string", int: "int", float: "number", bool: "bool"}.get(t, "any")
