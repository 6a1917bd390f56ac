"""Compare what a file stores with what the pipeline declares.

All checks run on metadata only (dtype and shape of the stored tensor), before
any tensor data is read. Messages are one line: ``<where>.<field>: expected
..., found ...``.
"""
from __future__ import annotations

import torch

from fastpipe.dtypes import TORCH_TO_NAME
from fastpipe.errors import ParamError

from .ref import FORMATS, ParamRef

Placements = tuple[tuple[int, int], ...]


def dtype_label(dtype: torch.dtype) -> str:
    """The pipeline's dtype name (``bf16``) where there is one, else torch's (``float8_e5m2``)."""
    return TORCH_TO_NAME.get(dtype) or str(dtype).removeprefix("torch.")


def shape_label(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_ref(ref: ParamRef, *, where: str) -> None:
    """Structural checks of the reference itself (format, name, placements' form)."""
    if ref.format not in FORMATS:
        raise ParamError(f"{where}.format: expected one of {', '.join(FORMATS)}, found {ref.format!r}")
    if not isinstance(ref.name, str) or not ref.name:
        raise ParamError(f"{where}.name: expected a non-empty tensor name, found {ref.name!r}")
    if ref.placements is None:
        return
    if not isinstance(ref.placements, (tuple, list)):
        raise ParamError(f"{where}.placements: expected a list of [start, end) pairs, found {ref.placements!r}")
    for i, p in enumerate(ref.placements):
        if not (isinstance(p, (tuple, list)) and len(p) == 2 and all(_is_int(v) for v in p)):
            raise ParamError(f"{where}.placements[{i}]: expected a [start, end) pair of integers, found {p!r}")


def check_stored(ref: ParamRef, shape: tuple[int, ...], dtype: torch.dtype, *, where: str, file_label: str,
                 stored_dtype: torch.dtype | None, stored_dtype_label: str,
                 stored_shape: tuple[int, ...]) -> Placements:
    """Check the stored tensor against the declaration; return the placements in full
    (``((0, d), ...)`` when the reference has none)."""
    what = f"tensor {ref.name!r} in {file_label}"
    if stored_dtype is None or stored_dtype != dtype:
        raise ParamError(f"{where}.name: expected dtype {dtype_label(dtype)} (the declared dtype), "
                         f"found {stored_dtype_label} ({what})")
    shape = tuple(int(d) for d in shape)
    stored_shape = tuple(int(d) for d in stored_shape)
    if ref.placements is None:
        if stored_shape != shape:
            raise ParamError(f"{where}.name: expected shape {shape_label(shape)} (the declared shape; no placements), "
                             f"found {shape_label(stored_shape)} ({what})")
        return tuple((0, d) for d in stored_shape)
    placements = tuple((int(s), int(e)) for s, e in ref.placements)
    if len(placements) != len(stored_shape):
        raise ParamError(f"{where}.placements: expected {len(stored_shape)} [start, end) pairs (one per dim of the "
                         f"stored shape {shape_label(stored_shape)}), found {len(placements)} ({what})")
    for i, ((s, e), d) in enumerate(zip(placements, stored_shape)):
        if not 0 <= s <= e <= d:
            raise ParamError(f"{where}.placements[{i}]: expected 0 <= start <= end <= {d}, found [{s}, {e}]")
    got = tuple(e - s for s, e in placements)
    if got != shape:
        raise ParamError(f"{where}.placements: expected a slice of shape {shape_label(shape)} (the declared shape), "
                         f"found {[list(p) for p in placements]} of shape {shape_label(got)} ({what})")
    return placements
