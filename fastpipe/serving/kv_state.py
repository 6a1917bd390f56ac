"""The engine's KV cache: allocated once, written in place by the prefills and every decode step.

    kv = KVState(decode_session, rows=R)         # zeros, one tensor per cache input of the decode (per slot)
    outs = decode_session.run({**step_inputs, **kv.tensors})    # state_in_place: writes into kv.tensors
    outs = prefill.run({**prompt_inputs, **kv.inputs_of(prefill)})   # a prefill into the cache (cache_row)
    kv.admit(row, prefill_caches, i)             # an older prefill's returned caches copied into a row

Each tensor is [R, Hkv_slot, M, D]: R rows (the serving set's prefills write into R cache rows, the
largest batch it was built for; default: the decode step's batch B <= R) of which the decode step
gets the first B (`tensors`: views made once, so a captured CUDA graph keeps its buffers). On
tensor-parallel pipelines each rank's slice of the KV heads is its own tensor, so a step hands them
over as they are: no slicing, no assembling, no allocation.

Prompts come in two ways. A prefill into the cache (fastpipe.builder.hf.trace: cache_row [B] and the
caches [R, Hkv, M, D], state in place) writes each prompt's keys/values into its row itself:
`inputs_of(session)` gives it the whole tensors under its own input names. An older prefill returns
caches [B', Hkv, S, D] (assembled at the model level), which `admit` copies into a row at positions
0..S-1. Either way a right-padded prompt leaves stale keys past its length, which no token sees (each
attends to positions <= its own) and decode steps overwrite.
"""
from __future__ import annotations

from typing import Mapping

import torch

from fastpipe import dtypes
from fastpipe.errors import InputError


def _where(session, name: str) -> str:
    return f"{session.pipeline.name}: metadata.tensor_slices.inputs[\"{name}\"]"


def cache_rows(session) -> int:
    """The rows of the static caches a prefill writes into (its first cache input's dim 0; inputs_of
    checks every one against the engine's cache)."""
    meta = session.pipeline.metadata
    return meta.tensors_inputs[meta.slices_inputs[next(iter(session.state))].origin].shape[0]


def _cache_keys(session) -> dict[str, tuple]:
    """Each cache input of the session, in slot order -> (origin, heads, positions, dims, device, replica):
    the replica is the k-th slice with the same rest in slot order (tensor parallelism wider than the KV
    heads gives several ranks the same head on one device, each writing its own tensor; a prefill's ranks
    match the decode step's in slot order)."""
    slices = session.pipeline.metadata.slices_inputs
    order = {slot: i for i, slot in enumerate(session.pipeline.devices)}
    keys: dict[str, tuple] = {}
    for name in sorted(session.state, key=lambda n: order.get(slices[n].device, len(order))):
        s = slices[name]
        base = (s.origin, tuple(s.placements[1:]), str(session.slot_devices[s.device]))
        keys[name] = (*base, sum(k[:-1] == base for k in keys.values()))
    return keys


class KVState:
    def __init__(self, session, rows: int | None = None):
        p = session.pipeline
        batch = None
        self.slices: dict[str, tuple[str, tuple]] = {}     # decode input -> (origin, placements)
        self.full: dict[str, torch.Tensor] = {}            # decode input -> [R, Hkv_slot, M, D]
        self.tensors: dict[str, torch.Tensor] = {}         # decode input -> full[:B], the decode step's
        self._keys: dict[tuple, str] = {}                  # (origin, heads, positions, dims, device, replica) -> input
        for name, key in _cache_keys(session).items():
            s = p.metadata.slices_inputs[name]
            full = p.metadata.tensors_inputs[s.origin].shape            # [B, Hkv, M, D]
            if s.placements[0] != (0, full[0]) or s.placements[2] != (0, full[2]):
                raise InputError(f"{_where(session, name)}.placements: expected the whole batch and "
                                 f"all positions of {s.origin}, found {[list(x) for x in s.placements]}")
            info = p.tensors[name]
            batch = info.shape[0]
            n_rows = batch if rows is None else rows
            if n_rows < batch:
                raise InputError(f"rows: expected at least the decode step's batch ({batch}), found {n_rows}")
            device = session.slot_devices[s.device]
            t = torch.zeros((n_rows, *info.shape[1:]), dtype=dtypes.to_torch(info.dtype), device=device)
            self.full[name] = t
            self.tensors[name] = t if n_rows == batch else t[:batch]
            self.slices[name] = (s.origin, s.placements)
            self._keys[key] = name
        if not self.tensors:
            raise InputError(f"{p.name}: expected cache inputs updated in place (a static-cache decode pipeline), found none")
        self.rows = next(iter(self.full.values())).shape[0]

    def inputs_of(self, session) -> dict[str, torch.Tensor]:
        """A prefill into the cache's state inputs (its own names) -> the whole cache tensors, matched by
        origin, the slot's heads, device and replica (slot order); one that does not fit is refused by name."""
        p = session.pipeline
        out = {}
        for name, key in _cache_keys(session).items():
            s = p.metadata.slices_inputs[name]
            mine = self._keys.get(key)
            if mine is None or s.placements[0] != (0, self.rows) or p.tensors[name].shape != self.full[mine].shape:
                want = self.full[mine].shape if mine is not None else "a cache slice of the decode step's"
                raise InputError(f"{_where(session, name)}: expected the engine's cache {list(want) if mine else want} "
                                 f"({self.rows} rows, the decode step's heads and positions), found "
                                 f"{list(p.tensors[name].shape)} of {s.origin} at {[list(x) for x in s.placements]}")
            out[name] = self.full[mine]
        return out

    def admit(self, row: int, caches: Mapping[str, torch.Tensor], i: int) -> None:
        """Row `row` takes the caches of an older prefill's row `i` (caches: origin -> [B', Hkv, S, D])."""
        for name, (origin, pl) in self.slices.items():
            src = caches[origin][i, pl[1][0]:pl[1][1], :, pl[3][0]:pl[3][1]]     # [Hkv_slot, S, D]
            self.full[name][row, :, :src.shape[1]].copy_(src)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.full.values())
