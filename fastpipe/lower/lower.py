"""Pipeline -> Program: per-slot ordered steps, cross-slot waits, frees and buffer sizes.

    program = lower(validate_structure(pipeline))

Each step reads its supertask's inputs and writes its outputs (for a comm step: its member's
share); binding (fastpipe.runtime.binding.bind) and passes (fastpipe.runtime.passes.fuse) may change both.

Ordering. ``checked.order`` is ONE dependency order of the merged nodes (a compute
supertask, or a whole comm group counted as one node). Every slot's list is that order
projected onto the slot: compute supertasks become "compute" steps on their slot, each
comm group one "comm" step on every member slot (a send/recv pair is a group of two),
input/output supertasks no step. Any two groups are therefore issued in the same relative
order by every slot they share, by construction (a mismatch would hang real NCCL).

Waits. A comm step on slot A waits, for each other member slot B whose step of the group
has index i > 0, for (B, i - 1): B's inputs to the group are ready once B has finished
everything before its own step of the group. Compute steps have no cross-slot waits
(validation guarantees a produced tensor is read only on its producer's slot; data
crosses slots through comm steps only).

Frees. Every intermediate produced on a slot (compute outputs, this slot's comm outputs)
is freed once, on its producer slot, after its last reader there. A tensor read by a comm
step is read by the whole group, so it lives until the group's step on its producer slot,
which completes together with the group's step on every other member. A tensor nobody
reads is freed right after the step that made it. Pipeline outputs, pipeline inputs and
constants are never freed.

Buffers. ``peak_bytes[slot]``: walk the slot's steps; each step first allocates its
outputs (shape x itemsize), the running total is compared with the maximum, then the
step's ``frees`` are released. Pipeline inputs and constants are not counted (they are
owned by the caller and the weight store); pipeline outputs are (they are produced here
and kept), except, in ``peak_bytes(p, steps, in_place=...)``, outputs a processor writes
into their inputs (state in place: fastpipe.runtime.passes.region_state, fastpipe.runtime.binding.bind). ``constant_bytes[slot]``: the bytes of the distinct constants read on the slot.
"""
from __future__ import annotations

import math

from fastpipe import dtypes
from fastpipe.errors import ValidationError, key_path
from fastpipe.format.model import Pipeline
from fastpipe.lower.program import Program, Step
from fastpipe.validate import Checked
from fastpipe.validate.order import node_of


def tensor_bytes(p: Pipeline, name: str) -> int:
    """Bytes of tensor ``name`` as declared: prod(shape) x itemsize."""
    t = p.tensors[name]
    return math.prod(t.shape) * dtypes.to_torch(t.dtype).itemsize


def lower(checked: Checked) -> Program:
    p, flow = checked.pipeline, checked.flow
    by_node: dict[str, str] = {}
    for sid in p.supertasks:
        by_node.setdefault(node_of(p, sid), sid)

    slots = tuple(p.devices)
    raw: dict[str, list[list]] = {s: [] for s in slots}        # slot -> [kind, supertask, group]
    where: dict[str, tuple[str, int]] = {}                       # supertask id -> (slot, index)
    groups: dict[str, tuple[tuple[str, int], ...]] = {}
    for node in checked.order:
        sid = by_node[node]
        st = p.supertasks[sid]
        if st.is_compute:
            where[sid] = (st.device, len(raw[st.device]))
            raw[st.device].append(["compute", sid, None])
        elif st.is_comm:
            g = checked.groups[st.group]
            members = []
            for m in g.members:
                slot = p.supertasks[m].device
                where[m] = (slot, len(raw[slot]))
                members.append(where[m])
                raw[slot].append(["comm", m, g.name])
            groups[g.name] = tuple(members)

    waits: dict[tuple[str, int], tuple[tuple[str, int], ...]] = {}
    for members in groups.values():
        for a, ia in members:
            waits[(a, ia)] = tuple((b, ib - 1) for b, ib in members if b != a and ib > 0)

    outputs = set(p.output_names)
    frees: dict[tuple[str, int], list[str]] = {}
    for slot in slots:
        for i, (_, sid, _) in enumerate(raw[slot]):
            for t in p.supertasks[sid].outputs:
                if t in outputs:
                    continue
                last = i
                for c in flow.consumers.get(t, []):
                    last = max(last, _read_on(p, slot, t, c, where, groups))
                frees.setdefault((slot, last), []).append(t)

    steps = {
        slot: tuple(Step(slot, kind, sid, group, waits.get((slot, i), ()), tuple(frees.get((slot, i), ())),
                         tuple(p.supertasks[sid].inputs), tuple(p.supertasks[sid].outputs))
                    for i, (kind, sid, group) in enumerate(raw[slot]))
        for slot in slots
    }
    peak = {slot: peak_bytes(p, steps[slot]) for slot in slots}
    const = {slot: sum(tensor_bytes(p, t) for t in _constants_read(p, steps[slot])) for slot in slots}
    return Program(slots, steps, groups, peak, const, tuple(p.input_names), tuple(p.output_names))


def _read_on(p: Pipeline, slot: str, t: str, consumer: str, where, groups) -> int:
    """The index on ``slot`` (the producer's) of the step after which ``consumer`` has read ``t``."""
    c_slot, c_idx = where[consumer]
    if c_slot == slot:
        return c_idx
    st = p.supertasks[consumer]
    if st.is_comm:
        for m_slot, m_idx in groups[st.group]:
            if m_slot == slot:
                return m_idx       # the group completes on every member at once
    raise ValidationError(f"{key_path('supertasks', consumer)}.inputs: expected \"{t}\" to be read on its producer's "
                          f"slot \"{slot}\" (or by a comm group with a member there), found slot \"{c_slot}\"")


def peak_bytes(p: Pipeline, steps: tuple[Step, ...], *, in_place=frozenset()) -> int:
    """The most bytes of intermediates alive at once over one slot's steps (module docstring); the
    tensors in `in_place` are written into memory the caller owns, so they count nothing."""
    live = peak = 0
    for st in steps:
        live += sum(tensor_bytes(p, t) for t in st.writes if t not in in_place)
        peak = max(peak, live)
        live -= sum(tensor_bytes(p, t) for t in st.frees)
    return peak


def _constants_read(p: Pipeline, steps: tuple[Step, ...]) -> set[str]:
    return {t for st in steps for t in st.reads if p.tensors[t].is_constant}
