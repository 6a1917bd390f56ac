"""torch.export serde enums (ScalarType, MemoryFormat, Layout, Device) <-> torch.

The integer values are those of torch/_export/serde/schema.py; they are part
of the file format and are written out here so that decoding does not depend
on torch's private serde module.
"""
from __future__ import annotations

import re

import torch

# ScalarType value -> torch dtype attribute name (resolved with getattr so an
# older torch lacking a dtype simply does not accept it).
_SCALAR_TYPE_NAMES: dict[int, str] = {
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float16",
    7: "float32",
    8: "float64",
    9: "complex32",
    10: "complex64",
    11: "complex128",
    12: "bool",
    13: "bfloat16",
    28: "uint16",
    29: "float8_e4m3fn",
    30: "float8_e5m2",
    31: "float8_e4m3fnuz",
    32: "float8_e5m2fnuz",
    33: "float8_e8m0fnu",
    34: "uint32",
    35: "uint64",
}
SCALAR_TYPE_TO_DTYPE: dict[int, torch.dtype] = {
    code: getattr(torch, name) for code, name in _SCALAR_TYPE_NAMES.items() if hasattr(torch, name)
}
DTYPE_TO_SCALAR_TYPE: dict[torch.dtype, int] = {v: k for k, v in SCALAR_TYPE_TO_DTYPE.items()}

MEMORY_FORMAT_TO_TORCH: dict[int, torch.memory_format] = {
    1: torch.contiguous_format,
    2: torch.channels_last,
    3: torch.channels_last_3d,
    4: torch.preserve_format,
}
TORCH_TO_MEMORY_FORMAT: dict[torch.memory_format, int] = {v: k for k, v in MEMORY_FORMAT_TO_TORCH.items()}

# Only dense tensors are supported; sparse / mkldnn layouts are refused.
LAYOUT_STRIDED = 7
LAYOUT_TO_TORCH: dict[int, torch.layout] = {LAYOUT_STRIDED: torch.strided}
TORCH_TO_LAYOUT: dict[torch.layout, int] = {torch.strided: LAYOUT_STRIDED}

_DEVICE_TYPE = re.compile(r"[a-z][a-z0-9_]{0,31}")


def make_device(device_type: str, index: int | None) -> torch.device | None:
    """torch.device for a serialized Device, or None if it is not a valid one."""
    if not _DEVICE_TYPE.fullmatch(device_type):
        return None
    if index is not None and not (0 <= index < 1 << 16):
        return None
    try:
        return torch.device(device_type) if index is None else torch.device(device_type, index)
    except (RuntimeError, ValueError, TypeError):
        return None


def device_json(device: torch.device) -> dict:
    return {"type": device.type, "index": device.index}
