"""Reshape a pipeline into what the producer, furiosa-llm, writes and its Pipeline.load accepts.

    q, side_files = producer_form(p)    # q: a Pipeline; side_files: {"<blob-id>.fx": payload text}

Spelling (what its dataclasses and converter write):
- every optional field present, `null` where absent (compute supertasks carry both `data` and
  `data_blob`), top-level keys name, devices, tensors, supertasks, metadata, blobs,
  param_files, device_constraints, version;
- devices as strings: a `{kind, idx}` device becomes `cpu:N`, `npu:N:*` (the npu spelling every
  release accepts) or `cuda:N`; string devices keep their spelling;
- dtypes in its names (`f8e4m3fn` for f8); kind `fx`, `dfg`, `edf` in lower case;
- comm metadata as its single-device comm ops write it: reduce_op the RedOpType integer for
  reduce and all_reduce, `"RedOpType.X"` for reduce_scatter; dst/src slot ids as strings;
- constants as `{param_file, name, name_in_graph, placements}` with a top-level `param_files`;
- payload blobs in `<blob-id>.fx` side files, `null` in the JSON (its 2026.x loader refuses an
  inline blob); inline `data` payloads stay inline.
Structure (rules its Pipeline.validate enforces):
- supertask ids are decimal integers (its get_gms sorts them with int): renumbered in order if
  any is not;
- every tensor is consumed on one slot (validate_supertask_dataflow): a pipeline input or a
  constant read on several slots becomes one tensor per slot (`<name>_slot<slot>`), each tied
  to the same original through metadata.tensor_slices (inputs) or the same stored value
  (constants);
- metadata covers every pipeline input and output (a missing entry describes the tensor as a
  whole original input/output of its own name);
- a comm supertask with a null group gets a group name of its own.
What it cannot express is refused with a FormatError naming the field: a pipeline output that
another supertask also reads (its validator classifies every tensor as exactly one of input,
output, constant or intermediate), and, where several compute/comm supertasks exist, one that
exchanges no tensor with any other (its validator calls it dead: a replicated pipeline whose
slots never communicate).
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import replace
from typing import Callable

from fastpipe import dtypes
from fastpipe.errors import FormatError, key_path
from fastpipe.format.comm_kinds import COMM_KINDS
from fastpipe.format.model import Device, Metadata, OriginalTensor, ParamFile, Pipeline, SuperTask, TensorSlice
from fastpipe.format.reduce_ops import canonical_reduce_op

SCHEMA_VERSION = "0.1.0"
_DECIMAL = re.compile(r"0|[1-9][0-9]*")


def producer_form(p: Pipeline, *, blob_text: Callable[[str], str] | None = None,
                  rewrite_payload: Callable[[str], str] | None = None) -> tuple[Pipeline, dict[str, str]]:
    """The producer-shaped pipeline and the blob side files it needs ({file name: payload}).
    blob_text(blob_id) reads a blob that is already null (a side file) when it must be
    rewritten; rewrite_payload turns each fx payload into another dialect (furiosa-llm
    2024.1.x: fastpipe.payload.torch21)."""
    _check_no_isolated_supertask(p)
    p = _one_slot_per_tensor(p)
    p = _complete_metadata(p)
    p = _param_files(p)
    if rewrite_payload is not None:
        p = _rewrite_payloads(p, rewrite_payload, blob_text)
    p, side = _blobs(p)
    p = _supertasks(p)
    return replace(p, devices={k: _device(d) for k, d in p.devices.items()}, dtype_spellings=dict(dtypes.PRODUCER_SPELLING),
                   version=p.version or SCHEMA_VERSION), side


# ----------------------------------------------------------------------------- devices
_NPU_CHIP = re.compile(r"npu:\d+")


def _device(d: Device) -> Device:
    """Strings; a whole npu chip as `npu:N:*` (furiosa-llm up to 2025.2 refuses `npu:N`, later
    releases read both as all of the chip's processing elements)."""
    if d.spelling is not None:
        parts = [part.strip() for part in d.spelling.split(",")]
        parts = [f"{part}:*" if _NPU_CHIP.fullmatch(part) else part for part in parts]
        return replace(d, spelling=",".join(parts))
    text = {"cpu": f"cpu:{d.idx}", "npu": f"npu:{d.idx}:*", "cuda": f"cuda:{d.idx}"}[d.kind]
    return replace(d, spelling=text, pe="*" if d.kind == "npu" else d.pe)


# ----------------------------------------------------------------------------- dataflow rules
def _check_no_isolated_supertask(p: Pipeline) -> None:
    """furiosa-llm's validate_supertask_dataflow: with more than one compute/comm supertask, each
    must produce a tensor another one reads, or read one another one produces (constants and
    pipeline inputs/outputs do not count)."""
    placed = [sid for sid, st in p.supertasks.items() if st.device is not None]
    if len(placed) <= 1:
        return
    producers: dict[str, set[str]] = defaultdict(set)
    consumers: dict[str, set[str]] = defaultdict(set)
    for sid in placed:
        st = p.supertasks[sid]
        for t in st.outputs:
            producers[t].add(sid)
        for t in st.inputs:
            if not p.tensors[t].is_constant:
                consumers[t].add(sid)
    related = set()
    for t in p.tensors:
        if producers[t] and consumers[t]:
            related |= producers[t] | consumers[t]
    for sid in placed:
        if sid not in related:
            raise FormatError(f"{key_path('supertasks', sid)}: expected a supertask that passes a tensor to or from "
                              "another compute or comm supertask (furiosa-llm's loader refuses any other as dead), "
                              "found none; producer style cannot express it")


# ----------------------------------------------------------------------------- one slot per tensor
def _consumer_slots(p: Pipeline) -> dict[str, list[str]]:
    slots: dict[str, list[str]] = defaultdict(list)
    for st in p.supertasks.values():
        if st.device is None:
            continue
        for t in st.inputs:
            if st.device not in slots[t]:
                slots[t].append(st.device)
    return slots


def _fresh(base: str, taken: set[str]) -> str:
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name


def _one_slot_per_tensor(p: Pipeline) -> Pipeline:
    in_id, in_st = p.input_supertask()
    outputs = set(p.output_names)
    readers = {t for st in p.supertasks.values() if st.device is not None for t in st.inputs}
    for name in outputs & readers:
        if name not in in_st.outputs:
            raise FormatError(f"{key_path('tensors', name)}: expected a pipeline output that no supertask reads (the "
                              "producer's loader classifies a tensor as exactly one of input, output, constant or "
                              "intermediate), found it also read by a supertask; producer style cannot express it")
    taken = set(p.tensors)
    renames: dict[tuple[str, str], str] = {}      # (tensor, slot) -> its name on that slot
    copies: dict[str, list[str]] = {}            # tensor -> names, first slot first
    for name, slots in _consumer_slots(p).items():
        if len(slots) < 2 or not (name in in_st.outputs or p.tensors[name].is_constant):
            continue
        copies[name] = [name]
        for slot in slots[1:]:
            renames[(name, slot)] = _fresh(f"{name}_slot{slot}", taken)
            copies[name].append(renames[(name, slot)])
    if not copies:
        return p
    tensors = dict(p.tensors)
    for (name, _), new in renames.items():
        info = tensors[name]
        value = info.value and replace(info.value, name_in_graph=new)
        tensors[new] = replace(info, value=value)
    supertasks = {}
    for sid, st in p.supertasks.items():
        if sid == in_id:
            st = replace(st, outputs=tuple(c for t in st.outputs for c in copies.get(t, [t])))
        elif st.device is not None:
            st = replace(st, inputs=tuple(renames.get((t, st.device), t) for t in st.inputs))
        supertasks[sid] = st
    slices = dict(p.metadata.slices_inputs)
    for (name, slot), new in renames.items():
        if name in slices:
            slices[new] = replace(slices[name], device=slot)
    return replace(p, tensors=tensors, supertasks=supertasks, metadata=replace(p.metadata, slices_inputs=slices))


# ----------------------------------------------------------------------------- metadata
def _complete_metadata(p: Pipeline) -> Pipeline:
    """Every pipeline input/output described in metadata; a missing one as a whole original of its own."""
    m = p.metadata
    slots = _consumer_slots(p)
    producers = {t: st.device for st in p.supertasks.values() if st.device is not None for t in st.outputs}
    t_in, t_out = dict(m.tensors_inputs), dict(m.tensors_outputs)
    s_in, s_out = dict(m.slices_inputs), dict(m.slices_outputs)
    for names, originals, sl, slot_of in ((p.input_names, t_in, s_in, lambda t: slots[t][0]),
                                          (p.output_names, t_out, s_out, lambda t: producers[t])):
        for name in names:
            if name in sl:
                continue
            info = p.tensors[name]
            origin = _fresh(name, set(originals) - {name}) if name in originals else name
            originals[origin] = OriginalTensor(shape=info.shape, dtype=info.dtype, idx=len(originals))
            sl[name] = TensorSlice(placements=tuple((0, s) for s in info.shape), origin=origin, dtype=info.dtype,
                                   device=slot_of(name))
    return replace(p, metadata=Metadata(t_in, t_out, s_in, s_out))


# ----------------------------------------------------------------------------- constants
def _param_files(p: Pipeline) -> Pipeline:
    files = dict(p.param_files or {})
    ids = {(f.path, f.format): k for k, f in files.items()}
    tensors = {}
    for name, info in p.tensors.items():
        v = info.value
        if v is not None:
            if v.param_file is None:
                key = (v.path, v.format)
                if key not in ids:
                    ids[key] = _fresh(str(len(files)), set(files))
                    files[ids[key]] = ParamFile(path=v.path, format=v.format)
                v = replace(v, param_file=ids[key], path=None, format=None)
            placements = v.placements if v.placements is not None else tuple((0, s) for s in info.shape)
            v = replace(v, placements=placements, name_in_graph=v.name_in_graph or name)
            info = replace(info, value=v)
        tensors[name] = info
    return replace(p, tensors=tensors, param_files=files)


# ----------------------------------------------------------------------------- payloads
def _rewrite_payloads(p: Pipeline, rewrite: Callable[[str], str], blob_text) -> Pipeline:
    fx_blobs = {st.data_blob for st in p.supertasks.values() if st.kind == "fx" and st.data_blob is not None}
    blobs = {}
    for bid, text in (p.blobs or {}).items():
        if bid in fx_blobs:
            text = rewrite(text if text is not None else blob_text(bid))
        blobs[bid] = text
    supertasks = {sid: replace(st, data=rewrite(st.data)) if st.kind == "fx" and st.data is not None else st
                  for sid, st in p.supertasks.items()}
    return replace(p, blobs=blobs if p.blobs is not None else None, supertasks=supertasks)



def _blobs(p: Pipeline) -> tuple[Pipeline, dict[str, str]]:
    """Inline blobs move to `<blob-id>.<kind>` files (fx payloads: `.fx`), null in the JSON."""
    kind = {st.data_blob: st.kind for st in p.supertasks.values() if st.data_blob is not None}
    side = {f"{bid}.{kind.get(bid, 'fx')}": text for bid, text in (p.blobs or {}).items() if text is not None}
    return replace(p, blobs={bid: None for bid in (p.blobs or {})}), side


# ----------------------------------------------------------------------------- supertasks
_RED_OP_VALUE = {"sum": 0, "avg": 1, "min": 3, "max": 4}     # torch's ReduceOp.RedOpType


def _comm_metadata(st: SuperTask) -> dict:
    """reduce ops as the producer spells them for the kind (its spec's producer_op), slots as strings."""
    spec = COMM_KINDS[st.kind]
    out = {}
    for k, v in (st.metadata or {}).items():
        type_ = spec.param(k).type if spec.param(k) is not None else None
        if type_ == "reduce_op":
            try:
                op = canonical_reduce_op(v)
            except (KeyError, ValueError):
                out[k] = v            # refused by validation with its path; written as found
                continue
            v = f"RedOpType.{op.upper()}" if spec.producer_op == "name" else _RED_OP_VALUE[op]
        elif type_ == "slot":
            v = str(v)
        out[k] = v
    return out


def _supertasks(p: Pipeline) -> Pipeline:
    renumber = not all(_DECIMAL.fullmatch(sid) for sid in p.supertasks)
    groups = {st.group for st in p.supertasks.values() if st.is_comm and not st.group_is_null}
    out = {}
    for i, (sid, st) in enumerate(p.supertasks.items()):
        new_id = str(i) if renumber else sid
        fields: dict = {"kind_spelling": None, "null_fields": ()}
        if st.is_compute:
            fields["null_fields"] = ("data",) if st.data is None else ("data_blob",)
        if st.is_comm:
            fields["metadata"] = _comm_metadata(st)
            if st.group_is_null:
                fields["group"] = _fresh(f"null_{new_id}", groups)
        out[new_id] = replace(st, **fields)
    return replace(p, supertasks=out)


__all__ = ["producer_form", "SCHEMA_VERSION"]
