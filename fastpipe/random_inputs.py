"""Seeded random inputs for `fastpipe run` without --inputs.

Floating inputs are standard normal; integer inputs are uniform in [0, 8)
(small, so that index-like inputs such as token ids stay valid for any vocab
of at least 8); booleans are fair coin flips. Pass --inputs for real data.
"""
from __future__ import annotations

import torch

from fastpipe import dtypes
from fastpipe.format.model import Pipeline

INT_HIGH = 8


def random_inputs(p: Pipeline, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in p.input_names:
        info = p.tensors[name]
        dt = dtypes.to_torch(info.dtype)
        if dt.is_floating_point:
            out[name] = torch.randn(info.shape, generator=g, dtype=torch.float32).to(dt)
        elif dt == torch.bool:
            out[name] = torch.randint(0, 2, info.shape, generator=g).bool()
        else:
            out[name] = torch.randint(0, INT_HIGH, info.shape, generator=g, dtype=torch.int64).to(dt)
    return out
