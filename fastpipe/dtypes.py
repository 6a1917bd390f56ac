"""The format's dtype names and their torch / safetensors equivalents."""
from __future__ import annotations

import torch

# SPEC §1 DType. `f8` is float8 e4m3fn; `u8` is accepted as well.
NAME_TO_TORCH: dict[str, torch.dtype] = {
    "f64": torch.float64,
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f8": torch.float8_e4m3fn,
    "bool": torch.bool,
    "i64": torch.int64,
    "i32": torch.int32,
    "i16": torch.int16,
    "i8": torch.int8,
    "u8": torch.uint8,
}
TORCH_TO_NAME: dict[torch.dtype, str] = {v: k for k, v in NAME_TO_TORCH.items()}

# Other spellings producers write for the same dtypes (furiosa-llm 2026.x: `f8e4m3fn`). A file's
# spelling is read as the canonical name above and kept for writing (Pipeline.dtype_spellings).
ALIASES: dict[str, str] = {"f8e4m3fn": "f8"}
# The producer's spelling of each canonical name (its get_pipeline_dtype), where it differs.
PRODUCER_SPELLING: dict[str, str] = {"f8": "f8e4m3fn"}
SPELLINGS: tuple[str, ...] = tuple(NAME_TO_TORCH) + tuple(ALIASES)

# safetensors header dtype strings
SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BOOL": torch.bool,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
}


def to_torch(name: str) -> torch.dtype:
    return NAME_TO_TORCH[name]


def to_name(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_NAME[dtype]
    except KeyError:
        raise KeyError(f"dtype {dtype} has no pipeline.json name") from None


def is_floating(name: str) -> bool:
    return NAME_TO_TORCH[name].is_floating_point
