"""Strict JSON: duplicate keys, NaN and Infinity are errors, with JSON paths."""
from __future__ import annotations

import json
from typing import Any

from fastpipe.errors import FormatError, key_path


class _Pairs(list):
    """An object's (key, value) pairs, kept until the path is known."""


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def loads(text: str | bytes, *, source: str = "pipeline.json") -> Any:
    """Parse JSON text; objects become dicts. Raises FormatError on any defect."""
    try:
        raw = json.loads(text, object_pairs_hook=_Pairs, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise FormatError(f"{source}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except ValueError as e:  # NaN / Infinity / -Infinity, or bad bytes
        raise FormatError(f"{source}: invalid JSON: {e}") from None
    except RecursionError:
        raise FormatError(f"{source}: invalid JSON: nested too deeply") from None
    try:
        return _to_plain(raw, "")
    except RecursionError:
        raise FormatError(f"{source}: invalid JSON: nested too deeply") from None


# objects whose keys are names chosen by the producer (rendered ["key"]); other keys are fields (.key)
USER_MAPS = {"devices", "tensors", "supertasks", "param_files", "blobs", "metadata.tensors.inputs",
             "metadata.tensors.outputs", "metadata.tensor_slices.inputs", "metadata.tensor_slices.outputs"}


def _child(path: str, k: str) -> str:
    if path in USER_MAPS:
        return key_path(path, k)
    return f"{path}.{k}" if path else k


def _to_plain(value: Any, path: str) -> Any:
    if isinstance(value, _Pairs):
        out: dict[str, Any] = {}
        for k, v in value:
            if k in out:
                raise FormatError(f"{_child(path, k)}: duplicate key {json.dumps(k)}")
            out[k] = _to_plain(v, _child(path, k))
        return out
    if isinstance(value, list):
        return [_to_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


def dumps(obj: Any) -> str:
    """Serialize with NaN/Infinity refused (so what we write we can read)."""
    return json.dumps(obj, indent=1, allow_nan=False) + "\n"
