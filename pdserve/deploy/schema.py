"""Frozen dataclasses from plain data (a YAML deployment file, flags, a Ray call's arguments)
and back, with errors that name the field: `load(RayClusterSpec, data, "deploy.yaml")`.

Rules, the same for every dataclass of the deployment schema:
- a key that is not a field is an error (with the closest field name, if there is one);
- a nested dataclass given as a mapping is merged onto that field's default, so a file says
  only what differs (`decode: {replicas: 4}` keeps the decode pool's other defaults);
- scalars are checked against the field's type (an int is a valid float, a bool is not an int);
  `tuple[str, ...]` takes a list, `dict[str, X]` a mapping; `X | None` takes null;
- then the dataclass's own `__post_init__` checks values and their relations.

`dump` is the inverse (`dataclasses.asdict`, tuples as lists): what crosses into a Ray actor.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class SchemaError(ValueError):
    """A deployment description that does not fit the schema; the message names where."""


def load(cls: type[T], data: Any, where: str = "") -> T:
    """An instance of dataclass `cls` from `data` (a mapping), validated."""
    return _load_dataclass(cls, data, where, base=None)


def dump(obj: Any) -> Any:
    """Plain data (dict / list / str / numbers / None) for a dataclass instance."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: dump(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [dump(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: dump(v) for k, v in obj.items()}
    return obj


def _load_dataclass(cls: type, data: Any, where: str, base: Any) -> Any:
    if dataclasses.is_dataclass(data) and isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise SchemaError(f"{where or cls.__name__}: expected a mapping of {cls.__name__} "
                          f"fields, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise SchemaError(f"{_join(where, str(key))}: unknown field of {cls.__name__}"
                              f"{hint}; known: {', '.join(fields)}")
    values = {}
    for name, f in fields.items():
        path = _join(where, name)
        default = getattr(base, name) if base is not None else _default(f)
        if name in data:
            values[name] = _convert(hints[name], data[name], path, default)
        elif default is not dataclasses.MISSING:
            values[name] = default
        else:
            raise SchemaError(f"{path}: missing (a required field of {cls.__name__})")
    try:
        return cls(**values)
    except SchemaError:
        raise
    except ValueError as exc:
        raise SchemaError(f"{where + ': ' if where else ''}{exc}") from None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _convert(hint: Any, value: Any, where: str, default: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        base = default if dataclasses.is_dataclass(default) else None
        if dataclasses.is_dataclass(inner):
            return _load_dataclass(inner, value, where, base or _default_instance(inner))
        return _convert(inner, value, where, default)
    if dataclasses.is_dataclass(hint):
        return _load_dataclass(hint, value, where,
                               default if dataclasses.is_dataclass(default) else None)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise SchemaError(f"{where}: expected a list, got {_kind(value)}")
        return tuple(_convert(args[0], v, f"{where}[{i}]", dataclasses.MISSING)
                     for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise SchemaError(f"{where}: expected a mapping, got {_kind(value)}")
        return {_convert(args[0], k, where, dataclasses.MISSING):
                _convert(args[1], v, f"{where}.{k}", dataclasses.MISSING)
                for k, v in value.items()}
    return _scalar(hint, value, where)


def _default_instance(cls: type) -> Any:
    try:
        return cls()
    except TypeError:
        return None


def _scalar(hint: Any, value: Any, where: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif hint is Any:
        return value
    else:
        raise SchemaError(f"{where}: unsupported field type {hint!r}")
    raise SchemaError(f"{where}: expected {_NAMES[hint]}, got {_kind(value)}")


_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"{type(value).__name__} {value!r}"


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name
