"""Structural rules: io supertasks, declared tensors and devices, tensor roles.

Each tensor is exactly one of: a constant (has `value`, produced by nobody), a
pipeline input (produced by the input supertask), a pipeline output (consumed
by the output supertask) or an intermediate value; every non-constant tensor is
produced exactly once, and a produced tensor is consumed only on its
producer's slot (cross-slot movement is what comm supertasks are for).
"""
from __future__ import annotations

from fastpipe.errors import ValidationError, key_path
from fastpipe.format.model import Pipeline
from fastpipe.validate.dataflow import Dataflow, dataflow


def _st(sid: str) -> str:
    return key_path("supertasks", sid)


def io_supertasks(p: Pipeline) -> tuple[str, str]:
    ids = {kind: [sid for sid, st in p.supertasks.items() if st.kind == kind] for kind in ("input", "output")}
    for kind, found in ids.items():
        if len(found) != 1:
            raise ValidationError(f"supertasks: expected exactly one {kind} supertask, found {len(found)}"
                                  + (f" ({', '.join(found)})" if found else ""))
    in_id, out_id = ids["input"][0], ids["output"][0]
    if p.supertasks[in_id].inputs:
        raise ValidationError(f"{_st(in_id)}.inputs: expected [] for the input supertask, found {len(p.supertasks[in_id].inputs)} tensors")
    if p.supertasks[out_id].outputs:
        raise ValidationError(f"{_st(out_id)}.outputs: expected [] for the output supertask, found {len(p.supertasks[out_id].outputs)} tensors")
    return in_id, out_id


def check_devices(p: Pipeline) -> None:
    used: set[str] = set()
    for sid, st in p.supertasks.items():
        if st.device is None:
            continue
        if st.device not in p.devices:
            raise ValidationError(f"{_st(sid)}.device: expected a declared slot ({', '.join(sorted(p.devices))}), found \"{st.device}\"")
        used.add(st.device)
    for slot in p.devices:
        if slot not in used:
            raise ValidationError(f"{key_path('devices', slot)}: expected every declared slot to run a supertask, found none on slot \"{slot}\"")


def check_device_constraints(p: Pipeline) -> None:
    """`device_constraints` entries name declared slots (they are kept and shown, not enforced)."""
    def leaves(value, path):
        if isinstance(value, tuple):
            for i, v in enumerate(value):
                yield from leaves(v, f"{path}[{i}]")
        else:
            yield path, value

    for i, c in enumerate(p.device_constraints or ()):
        for path, slot in leaves(c.devices or (), f"device_constraints[{i}].devices"):
            if slot not in p.devices:
                raise ValidationError(f"{path}: expected a declared slot ({', '.join(sorted(p.devices))}), found \"{slot}\"")


def check_tensors(p: Pipeline) -> Dataflow:
    in_id, out_id = io_supertasks(p)
    flow = dataflow(p, in_id, out_id)
    referenced = set(flow.producers) | set(flow.consumers)
    for sid, st in p.supertasks.items():
        for i, t in enumerate(st.inputs):
            if t not in p.tensors:
                raise ValidationError(f"{_st(sid)}.inputs[{i}]: expected a tensor declared in tensors, found \"{t}\"")
        for i, t in enumerate(st.outputs):
            if t not in p.tensors:
                raise ValidationError(f"{_st(sid)}.outputs[{i}]: expected a tensor declared in tensors, found \"{t}\"")
    for name, info in p.tensors.items():
        path = key_path("tensors", name)
        prods = flow.producers.get(name, [])
        cons = flow.consumers.get(name, [])
        if name not in referenced:
            raise ValidationError(f"{path}: expected every tensor to be an input or output of some supertask, found it unused")
        if info.is_constant:
            if prods:
                raise ValidationError(f"{path}: expected a constant (it has a value) to be produced by no supertask, found it an output of supertask \"{prods[0]}\"")
            for c in cons:
                if p.supertasks[c].kind in ("input", "output"):
                    raise ValidationError(f"{path}: expected a constant to feed compute or comm supertasks only, found it an input of the {p.supertasks[c].kind} supertask")
            continue
        if len(prods) != 1:
            raise ValidationError(f"{path}: expected a variable tensor to be produced exactly once, found "
                                  + (f"{len(prods)} producers ({', '.join(prods)})" if prods else "no producer (and no value)"))
        producer = p.supertasks[prods[0]]
        if prods[0] == in_id and out_id in cons:
            raise ValidationError(f"{path}: expected a tensor to be exactly one of constant, pipeline input, pipeline output or intermediate, found it both a pipeline input and a pipeline output")
        if prods[0] == in_id:
            if not cons:
                raise ValidationError(f"{path}: expected the pipeline input to be consumed, found no consumer")
            continue
        if prods[0] in cons:
            raise ValidationError(f"{path}: expected a supertask not to consume its own output, found it in both inputs and outputs of supertask \"{prods[0]}\"")
        if not cons:
            raise ValidationError(f"{path}: expected the output of supertask \"{prods[0]}\" to be consumed, found no consumer")
        for c in cons:
            consumer = p.supertasks[c]
            if consumer.device is not None and consumer.device != producer.device:
                raise ValidationError(
                    f"{_st(c)}.inputs: expected \"{name}\" to be consumed on its producer's slot \"{producer.device}\" "
                    f"(cross-slot data needs a comm supertask), found slot \"{consumer.device}\"")
    return flow
