"""Seeded random inputs for `fastpipe run` without --inputs.

Floating inputs are standard normal; integer inputs are uniform in [0, 8)
(small, so that index-like inputs such as token ids stay valid for any vocab
of at least 8); booleans are fair coin flips. Pass --inputs for real data.
"""
from __future__ import annotations

import torch

from fastpipe import dtypes
from fastpipe.errors import InputError
from fastpipe.format.model import Pipeline

INT_HIGH = 8


def random_inputs(p: Pipeline, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in p.input_names:
        try:
            out[name] = _random(p.tensors[name], g)
        except (RuntimeError, MemoryError) as e:
            raise InputError(f"inputs[\"{name}\"]: cannot make a random tensor of shape {list(p.tensors[name].shape)} "
                             f"({' '.join(str(e).split())[:120]}); pass --inputs") from None
    return out


def _random(info, g: torch.Generator) -> torch.Tensor:
    dt = dtypes.to_torch(info.dtype)
    if dt.is_floating_point:
        return torch.randn(info.shape, generator=g, dtype=torch.float32).to(dt)
    if dt == torch.bool:
        return torch.randint(0, 2, info.shape, generator=g).bool()
    return torch.randint(0, INT_HIGH, info.shape, generator=g, dtype=torch.int64).to(dt)
