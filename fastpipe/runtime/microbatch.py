"""Micro-batching (SPEC §4): inputs carrying k times the pipeline's batch along dim 0, split into k parts."""
from __future__ import annotations

from typing import Mapping

import torch


def split_chunks(inputs: Mapping[str, torch.Tensor], chunks: int, batch: Mapping[str, int]) -> list[dict]:
    """Split each input along dim 0 into `chunks` micro-batches of the pipeline's batch size."""
    from fastpipe.errors import InputError

    out = [dict() for _ in range(chunks)]
    for name, t in inputs.items():
        want = batch[name]
        if t.dim() == 0 or t.shape[0] != want * chunks:
            found = list(t.shape)
            raise InputError(f"inputs[\"{name}\"].shape[0]: expected {want * chunks} (chunks={chunks} x the pipeline's "
                             f"batch {want}), found {found[0] if found else 'a scalar'}")
        for c, piece in enumerate(t.split(want, dim=0)):
            out[c][name] = piece
    return out
