"""Parse a safetensors header ourselves, with every bound checked.

Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON (an object
mapping tensor name -> {dtype, shape, data_offsets}, plus an optional
``__metadata__`` object of strings), then the data area. ``data_offsets`` are
[begin, end) byte offsets into the data area. The checks mirror what the
safetensors library itself enforces (tensors cover the data area exactly,
contiguously, each with dtype x shape bytes), so a file that passes here opens
there, and a truncated or corrupt file gets a precise reason instead of a
crash. Reads only the header bytes.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# Same limit as the safetensors library.
MAX_HEADER_BYTES = 100_000_000

# Bits per element of every dtype the safetensors format defines.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}


class CorruptHeader(Exception):
    """The header is unreadable or inconsistent; ``str()`` is the reason."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str                 # safetensors spelling, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int                 # [begin, end) inside the data area
    end: int


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] | None
    data_start: int            # file offset of the data area (8 + N)
    data_len: int


def _is_uint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_header(path: Path, file_size: int) -> Header:
    """Read and check the header of ``path`` (``file_size`` from its stat)."""
    if file_size < 8:
        raise CorruptHeader(f"file is {file_size} bytes, shorter than the 8-byte header length")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > file_size - 8:
            raise CorruptHeader(f"header length {n} past end of file ({file_size} bytes)")
        if n > MAX_HEADER_BYTES:
            raise CorruptHeader(f"header length {n} over the {MAX_HEADER_BYTES}-byte limit")
        raw = f.read(n)
    if len(raw) != n:
        raise CorruptHeader(f"file ended inside the {n}-byte header (changed while reading?)")
    return parse_header(raw, file_size - 8 - n)


def parse_header(raw: bytes, data_len: int) -> Header:
    """Check header JSON ``raw`` against a data area of ``data_len`` bytes."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptHeader(f"header is not UTF-8 (bad byte at header offset {e.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise CorruptHeader(f"header is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise CorruptHeader("header JSON is nested too deeply") from None
    if not isinstance(obj, dict):
        raise CorruptHeader(f"header is JSON {type(obj).__name__}, expected an object")

    metadata = None
    tensors: dict[str, TensorEntry] = {}
    for name, info in obj.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise CorruptHeader("__metadata__ is not an object of strings")
            metadata = info
            continue
        tensors[name] = _entry(name, info, data_len)

    covered = 0
    for name, e in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin != covered:
            raise CorruptHeader(
                f"tensor {name!r} data_offsets [{e.begin}, {e.end}] start at {e.begin}, expected {covered} "
                "(tensors must cover the data area without gaps or overlaps)")
        covered = e.end
    if covered != data_len:
        raise CorruptHeader(f"data area is {data_len} bytes but its tensors cover {covered}")
    return Header(tensors, metadata, 8 + len(raw), data_len)


def _entry(name: str, info: object, data_len: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise CorruptHeader(f"tensor {name!r} entry is JSON {type(info).__name__}, expected an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise CorruptHeader(f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise CorruptHeader(f"tensor {name!r} has shape {shape!r}, expected a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise CorruptHeader(f"tensor {name!r} has data_offsets {offsets!r}, expected [begin, end]")
    begin, end = offsets
    if end < begin:
        raise CorruptHeader(f"tensor {name!r} data_offsets [{begin}, {end}] end before they begin")
    if end > data_len:
        raise CorruptHeader(
            f"tensor {name!r} data_offsets [{begin}, {end}] past end of data area ({data_len} bytes; truncated file?)")
    nbits = math.prod(shape) * DTYPE_BITS[dtype]
    if nbits % 8:
        raise CorruptHeader(f"tensor {name!r} of {dtype} x {shape} is not a whole number of bytes")
    if end - begin != nbits // 8:
        raise CorruptHeader(
            f"tensor {name!r} data_offsets [{begin}, {end}] hold {end - begin} bytes, "
            f"but {dtype} x {shape} needs {nbits // 8}")
    return TensorEntry(dtype, tuple(shape), begin, end)
