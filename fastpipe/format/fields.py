"""Typed field access with JSON-path errors, shared by the parser."""
from __future__ import annotations

import json
from typing import Any, Iterable

from fastpipe.errors import FormatError


def show(value: Any) -> str:
    """How a found value appears in a message."""
    text = json.dumps(value) if not isinstance(value, (set, frozenset)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def bad(path: str, expected: str, found: Any) -> FormatError:
    return FormatError(f"{path}: expected {expected}, found {show(found)}")


def obj(value: Any, path: str, *, required: Iterable[str] = (), optional: Iterable[str] = ()) -> dict:
    """An object with exactly these keys: required ones present, nothing unknown."""
    if not isinstance(value, dict):
        raise FormatError(f"{path}: expected an object, found {type_name(value)}")
    required = tuple(required)
    allowed = set(required) | set(optional)
    for k in value:
        if k not in allowed:
            raise FormatError(f"{path + '.' + k if path else k}: unknown field (allowed: {', '.join(sorted(allowed))})")
    for k in required:
        if k not in value:
            raise FormatError(f"{path or '<top>'}: missing required field {json.dumps(k)}")
    return value


def string(value: Any, path: str, *, nonempty: bool = True) -> str:
    if not isinstance(value, str) or (nonempty and not value):
        raise FormatError(f"{path}: expected a {'non-empty ' if nonempty else ''}string, found {type_name(value) if not isinstance(value, str) else show(value)}")
    return value


def uint(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad(path, "a non-negative integer", value)
    return value


def string_list(value: Any, path: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise FormatError(f"{path}: expected an array of strings, found {type_name(value)}")
    return tuple(string(v, f"{path}[{i}]") for i, v in enumerate(value))


def shape(value: Any, path: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise FormatError(f"{path}: expected an array of non-negative integers, found {type_name(value)}")
    return tuple(uint(v, f"{path}[{i}]") for i, v in enumerate(value))


def placements(value: Any, path: str) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list):
        raise FormatError(f"{path}: expected an array of [start, end] pairs, found {type_name(value)}")
    out = []
    for i, pair in enumerate(value):
        p = f"{path}[{i}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise bad(p, "a [start, end] pair", pair)
        start, end = uint(pair[0], f"{p}[0]"), uint(pair[1], f"{p}[1]")
        if start > end:
            raise bad(p, "start <= end", pair)
        out.append((start, end))
    return tuple(out)


def mapping(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise FormatError(f"{path}: expected an object, found {type_name(value)}")
    return value
