"""Strict, typed reading of decoded JSON with one-line error paths.

Every failure is a :class:`PayloadError` whose message is
``<where>: <json path>: expected ..., found ...``.
"""
from __future__ import annotations

import json
import math
from typing import Any

from fastpipe.errors import PayloadError

MISSING: Any = object()
_NONFINITE = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def describe(value: Any) -> str:
    """A short, single-line rendering of a JSON value for error messages."""
    if value is MISSING:
        return "nothing (missing key)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        text = repr(value)
        return text if len(text) <= 80 else text[:77] + "...'"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        keys = sorted(str(k) for k in value)
        shown = ", ".join(repr(k if len(k) <= 30 else k[:27] + "...") for k in keys[:5])
        more = ", ..." if len(keys) > 5 else ""
        return f"an object with keys [{shown}{more}]"
    return type(value).__name__


def member(path: str, key: str) -> str:
    """``member('nodes[2]', 'target') -> 'nodes[2].target'``."""
    return f"{path}.{key}" if path else key


def item(path: str, index: int) -> str:
    return f"{path}[{index}]"


def entry(path: str, key: str) -> str:
    """A JSON object entry with an arbitrary key: ``tensor_values["x"]``."""
    shown = json.dumps(key if len(key) <= 60 else key[:57] + "...")
    return f"{path}[{shown}]"


class Reader:
    """Typed accessors bound to the ``where`` prefix of every message."""

    def __init__(self, where: str):
        self.where = where

    def error(self, path: str, expected: str, found: Any = MISSING, *, found_text: str | None = None) -> PayloadError:
        prefix = f"{self.where}: {path}" if path else self.where
        shown = found_text if found_text is not None else describe(found)
        return PayloadError(f"{prefix}: expected {expected}, found {shown}")

    # -- containers -------------------------------------------------------
    def obj(self, value: Any, path: str) -> dict:
        if not isinstance(value, dict):
            raise self.error(path, "a JSON object", value)
        return value

    def lst(self, value: Any, path: str) -> list:
        if not isinstance(value, list):
            raise self.error(path, "a JSON list", value)
        return value

    def key(self, parent: dict, key: str, path: str, *, default: Any = MISSING) -> Any:
        value = parent.get(key, MISSING)
        if value is MISSING:
            if default is not MISSING:
                return default
            raise self.error(member(path, key), f"key {key!r}", MISSING)
        return value

    # -- scalars ----------------------------------------------------------
    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise self.error(path, "a string", value)
        return value

    def integer(self, value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(path, "an integer", value)
        return value

    def boolean(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise self.error(path, "true or false", value)
        return value

    def number(self, value: Any, path: str) -> float:
        """A float; accepts ints and the spellings torch uses for inf/nan."""
        if isinstance(value, bool):
            raise self.error(path, "a number", value)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str) and value in _NONFINITE:
            return _NONFINITE[value]
        raise self.error(path, "a number", value)

    def union(self, value: Any, path: str) -> tuple[str, Any]:
        """A torch serde union: an object with exactly one key (the tag)."""
        if not isinstance(value, dict) or len(value) != 1:
            raise self.error(path, "an object with exactly one key (a union)", value)
        ((tag, inner),) = value.items()
        return str(tag), inner
