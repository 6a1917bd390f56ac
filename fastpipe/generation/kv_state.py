"""The KV cache of one decode bucket: allocated once, updated in place by every decode step.

    kv = KVState(decode_session)                 # zeros, one tensor per pipeline cache input (per slot)
    kv.admit(row, prefill_caches, i, length)     # a prefilled prompt's caches into a row
    outs = decode_session.run({**step_inputs, **kv.tensors})   # state_in_place: writes into kv.tensors

The tensors are the decode pipeline's own cache inputs (on tensor-parallel pipelines, each rank's
slice of the KV heads), so a step hands them over as they are: no slicing, no assembling, no
allocation. A prefill's caches ([B, Hkv, S, D], assembled at the model level) are copied into a
row at positions 0..S-1; a right-padded prompt leaves stale keys past its length, which no token
sees (each attends to positions <= its own) and decode steps overwrite.
"""
from __future__ import annotations

from typing import Mapping

import torch

from fastpipe import dtypes
from fastpipe.errors import InputError


class KVState:
    def __init__(self, session):
        p = session.pipeline
        self.slices: dict[str, tuple[str, tuple]] = {}     # pipeline input -> (origin, placements)
        self.tensors: dict[str, torch.Tensor] = {}
        for name in session.state:
            s = p.metadata.slices_inputs[name]
            full = p.metadata.tensors_inputs[s.origin].shape            # [B, Hkv, M, D]
            if s.placements[0] != (0, full[0]) or s.placements[2] != (0, full[2]):
                raise InputError(f"metadata.tensor_slices.inputs[\"{name}\"].placements: expected the whole batch and "
                                 f"all positions of {s.origin}, found {[list(x) for x in s.placements]}")
            info = p.tensors[name]
            device = session.slot_devices[s.device]
            self.tensors[name] = torch.zeros(info.shape, dtype=dtypes.to_torch(info.dtype), device=device)
            self.slices[name] = (s.origin, s.placements)
        if not self.tensors:
            raise InputError(f"{p.name}: expected cache inputs updated in place (a static-cache decode pipeline), found none")

    def admit(self, row: int, caches: Mapping[str, torch.Tensor], i: int) -> None:
        """Row `row` takes the caches of prefill row `i` (caches: origin -> [B', Hkv, S, D])."""
        for name, (origin, pl) in self.slices.items():
            src = caches[origin][i, pl[1][0]:pl[1][1], :, pl[3][0]:pl[3][1]]     # [Hkv_slot, S, D]
            self.tensors[name][row, :, :src.shape[1]].copy_(src)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
