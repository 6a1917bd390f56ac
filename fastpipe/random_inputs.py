"""Seeded random inputs for `fastpipe run` without --inputs.

Floating inputs are standard normal; booleans are fair coin flips; integer inputs are uniform in
[0, 8) (small, so that index-like inputs such as token ids stay valid for any vocab of at least 8),
and in [0, bound) where the pipeline uses the input as indices into something smaller (`bounds`,
from fastpipe.runtime.binding.index_bounds: e.g. token_type_ids into an embedding of 2 rows). Pass
--inputs for real data.

    random_inputs(p, seed)                               # every integer input in [0, 8)
    random_inputs(p, seed, bounds=index_bounds(p))       # ... capped at each input's index bound

The draws depend only on the seed, the inputs' shapes and dtypes, and the bounds: a caller who
knows those can draw the same inputs again.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from fastpipe import dtypes
from fastpipe.errors import InputError
from fastpipe.format.model import Pipeline

INT_HIGH = 8


def random_inputs(p: Pipeline, seed: int = 0, bounds: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Pipeline input name -> a seeded random tensor of its shape and dtype. `bounds`: input name ->
    the exclusive upper bound of its valid values (an int, or an IndexBound: its `high`); an integer
    input with one is drawn in [0, min(bound, INT_HIGH))."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in p.input_names:
        bound = None if bounds is None or name not in bounds else int(getattr(bounds[name], "high", bounds[name]))
        if bound is not None and bound < 1:
            raise InputError(f"inputs[\"{name}\"]: cannot make random indices into a dim of size {bound}; pass --inputs")
        try:
            out[name] = _random(p.tensors[name], g, INT_HIGH if bound is None else min(bound, INT_HIGH))
        except (RuntimeError, MemoryError) as e:
            raise InputError(f"inputs[\"{name}\"]: cannot make a random tensor of shape {list(p.tensors[name].shape)} "
                             f"({' '.join(str(e).split())[:120]}); pass --inputs") from None
    return out


def _random(info, g: torch.Generator, int_high: int = INT_HIGH) -> torch.Tensor:
    dt = dtypes.to_torch(info.dtype)
    if dt.is_floating_point:
        return torch.randn(info.shape, generator=g, dtype=torch.float32).to(dt)
    if dt == torch.bool:
        return torch.randint(0, 2, info.shape, generator=g).bool()
    return torch.randint(0, int_high, info.shape, generator=g, dtype=torch.int64).to(dt)
