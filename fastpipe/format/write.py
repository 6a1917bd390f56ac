"""Pipeline -> JSON data, in the spellings it was read with (round trip)."""
from __future__ import annotations

from typing import Any

from fastpipe.format.devices import device_to_json
from fastpipe.format.model import Metadata, ParamValue, Pipeline, SuperTask, TensorInfo


def pipeline_to_json(p: Pipeline) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if p.version is not None:
        out["version"] = p.version
    out["name"] = p.name
    out["devices"] = {k: device_to_json(d) for k, d in p.devices.items()}
    if p.param_files is not None:
        out["param_files"] = {k: {"path": f.path, "format": f.format} for k, f in p.param_files.items()}
    out["tensors"] = {k: _tensor(t) for k, t in p.tensors.items()}
    out["supertasks"] = {k: _supertask(s) for k, s in p.supertasks.items()}
    out["metadata"] = _metadata(p.metadata)
    if p.blobs is not None:
        out["blobs"] = dict(p.blobs)
    if p.device_constraints is not None:
        out["device_constraints"] = list(p.device_constraints)
    return out


def _tensor(t: TensorInfo) -> dict[str, Any]:
    d: dict[str, Any] = {"shape": list(t.shape), "dtype": t.dtype}
    if t.value is not None:
        d["value"] = _value(t.value)
    return d


def _value(v: ParamValue) -> dict[str, Any]:
    d: dict[str, Any] = {}
    if v.param_file is not None:
        d["param_file"] = v.param_file
    else:
        d["path"], d["format"] = v.path, v.format
    d["name"] = v.name
    if v.name_in_graph is not None:
        d["name_in_graph"] = v.name_in_graph
    if v.placements is not None:
        d["placements"] = [list(p) for p in v.placements]
    return d


def _supertask(s: SuperTask) -> dict[str, Any]:
    d: dict[str, Any] = {"kind": s.kind_spelling or s.kind, "inputs": list(s.inputs), "outputs": list(s.outputs)}
    for key in ("device", "data", "data_blob", "group", "device_idx"):
        val = getattr(s, key)
        if val is not None:
            d[key] = val
    if s.metadata is not None:
        d["metadata"] = dict(s.metadata)
    return d


def _metadata(m: Metadata) -> dict[str, Any]:
    def orig(items):
        return {k: {"shape": list(o.shape), "dtype": o.dtype, "idx": o.idx} for k, o in items.items()}

    def slices(items):
        return {k: {"placements": [list(p) for p in s.placements], "origin": s.origin, "dtype": s.dtype,
                    "device": s.device} for k, s in items.items()}

    return {
        "tensors": {"inputs": orig(m.tensors_inputs), "outputs": orig(m.tensors_outputs)},
        "tensor_slices": {"inputs": slices(m.slices_inputs), "outputs": slices(m.slices_outputs)},
    }
