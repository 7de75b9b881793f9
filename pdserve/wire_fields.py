"""The field checks and the wire form shared by the messages of `pdserve.messages`: a value of the
wanted type (ints within int64), a list of non-negative ints, a map with no unknown fields, and a
message's fields as the dict msgpack sends."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar

T = TypeVar("T")
MAX_INT64 = 2**63 - 1


def check(name: str, value: Any, kind: type | tuple[type, ...], optional: bool = False) -> Any:
    """`value` when it is a `kind` (None too when `optional`; an int within int64), else a
    ValueError naming the field `name`."""
    if value is None and optional:
        return None
    if isinstance(value, bool) and kind in (int, float):  # bool is an int subclass
        raise ValueError(f"{name} must be {kind.__name__}, got bool")
    if not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ValueError(f"{name} must be {want}, got {type(value).__name__}")
    if isinstance(value, int) and not -MAX_INT64 - 1 <= value <= MAX_INT64:
        raise ValueError(f"{name} is outside int64")
    return value


def ints(name: str, value: Any, minimum: int = 0) -> list[int]:
    """`value` when it is a list of ints from `minimum` to int64's largest, else a ValueError."""
    check(name, value, list)
    # `type(v) is int` leaves out bool; min and max run in C (a prompt has thousands of ids)
    if not all(type(v) is int for v in value) or (
        value and not minimum <= min(value) <= max(value) <= MAX_INT64
    ):
        raise ValueError(f"{name} must be a list of integers >= {minimum}")
    return value


@functools.cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def wire_dict(message: Any) -> dict:
    """A message's fields as a dict, the values shared: `dataclasses.asdict` copies lists item by
    item, and a 4K-token prompt's copies (three a request) took ~3 ms of the router's event loop
    each, which a burst of 32 conversations waited for in turn (issue 9, session 16)."""
    return {name: getattr(message, name) for name in _names(type(message))}


def fields_of(cls: type[T], msg: Any) -> dict:
    """`msg` when it is a map holding only fields of the message class `cls`, else a ValueError."""
    if not isinstance(msg, dict):
        raise ValueError(f"{cls.__name__} must be a map, got {type(msg).__name__}")
    names = _names(cls)
    unknown = sorted(str(k) for k in msg if k not in names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {unknown}")
    return msg
