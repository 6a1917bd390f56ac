"""Serialized TensorMeta (``tensor_values`` entries) <-> :class:`TensorMeta`.

Only static shapes are accepted: every SymInt must be ``{"as_int": n}``; a
symbolic ``as_expr`` (an expression string) is refused, never evaluated.
"""
from __future__ import annotations

import torch

from fastpipe.payload.decoded import TensorMeta
from fastpipe.payload.jsonread import Reader, item, member
from fastpipe.payload.schema_enums import (
    DTYPE_TO_SCALAR_TYPE,
    LAYOUT_STRIDED,
    SCALAR_TYPE_TO_DTYPE,
    device_json,
)


def read_static_int(r: Reader, value: object, path: str, *, minimum: int = 0) -> int:
    tag, inner = r.union(value, path)
    if tag == "as_expr":
        raise r.error(member(path, "as_expr"), "a static integer (as_int)", found_text="a symbolic expression")
    if tag != "as_int":
        raise r.error(member(path, tag), "a static integer (as_int)", found_text=repr(tag))
    number = r.integer(inner, member(path, "as_int"))
    if number < minimum:
        raise r.error(member(path, "as_int"), f"an integer >= {minimum}", number)
    return number


def read_dtype(r: Reader, value: object, path: str) -> torch.dtype:
    code = r.integer(value, path)
    dtype = SCALAR_TYPE_TO_DTYPE.get(code)
    if dtype is None:
        raise r.error(path, "a known ScalarType", code)
    return dtype


def read_tensor_meta(r: Reader, value: object, path: str) -> TensorMeta:
    meta = r.obj(value, path)
    dtype = read_dtype(r, r.key(meta, "dtype", path), member(path, "dtype"))
    sizes_path = member(path, "sizes")
    sizes = r.lst(r.key(meta, "sizes", path), sizes_path)
    shape = tuple(read_static_int(r, s, item(sizes_path, i)) for i, s in enumerate(sizes))
    strides = meta.get("strides")
    if strides is not None:
        strides_path = member(path, "strides")
        for i, s in enumerate(r.lst(strides, strides_path)):
            read_static_int(r, s, item(strides_path, i), minimum=-(1 << 62))
    if meta.get("storage_offset") is not None:
        read_static_int(r, meta["storage_offset"], member(path, "storage_offset"))
    layout = meta.get("layout", LAYOUT_STRIDED)
    if layout != LAYOUT_STRIDED:
        raise r.error(member(path, "layout"), f"{LAYOUT_STRIDED} (strided)", layout)
    return TensorMeta(shape=shape, dtype=dtype)


def tensor_meta_json(t: torch.Tensor) -> dict:
    """TensorMeta JSON for a real or fake tensor (field order as torch writes it)."""
    if t.dtype not in DTYPE_TO_SCALAR_TYPE:
        raise ValueError(f"dtype {t.dtype} has no serialized ScalarType")
    if t.layout != torch.strided:
        raise ValueError(f"layout {t.layout} is not supported (strided only)")
    return {
        "dtype": DTYPE_TO_SCALAR_TYPE[t.dtype],
        "sizes": [{"as_int": int(s)} for s in t.shape],
        "requires_grad": bool(t.requires_grad),
        "device": device_json(t.device),
        "strides": [{"as_int": int(s)} for s in t.stride()],
        "storage_offset": {"as_int": int(t.storage_offset())},
        "layout": LAYOUT_STRIDED,
    }
