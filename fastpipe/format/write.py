"""Pipeline -> JSON data, in one of two styles.

``style="fastpipe"`` (the default) writes the spellings the pipeline was read with, so a file
round-trips (its fields, nulls, device strings, dtype aliases, `FX`, reduce-op spellings).
``style="producer"`` writes what the format's producer, furiosa-llm, writes: every field of its
dataclasses, `null` where absent, in its key order (fastpipe.format.producer_style makes the
pipeline itself producer-shaped first).
"""
from __future__ import annotations

from typing import Any

from fastpipe.format.devices import device_to_json
from fastpipe.format.model import DeviceConstraint, Metadata, ParamValue, Pipeline, SuperTask, TensorInfo

STYLES = ("fastpipe", "producer", "producer-2024.1")


def pipeline_to_json(p: Pipeline, *, every_field: bool = False) -> dict[str, Any]:
    """every_field: the producer's layout (all keys present, its order); otherwise as read."""
    dt = dict(p.dtype_spellings)
    if every_field:
        return {
            "name": p.name,
            "devices": {k: device_to_json(d) for k, d in p.devices.items()},
            "tensors": {k: _tensor(t, dt) for k, t in p.tensors.items()},
            "supertasks": {k: _supertask(s, every_field=True) for k, s in p.supertasks.items()},
            "metadata": _metadata(p.metadata, dt),
            "blobs": dict(p.blobs or {}),
            "param_files": {k: {"path": f.path, "format": f.format} for k, f in (p.param_files or {}).items()},
            # as the producer writes them (asdict of its field-less TopologyDeviceConstraint): its
            # loader reads `{}` and refuses a list of slots
            "device_constraints": [{"kind": c.kind, "devices": {}} for c in p.device_constraints or ()],
            "version": p.version or "0.1.0",
        }
    out: dict[str, Any] = {}
    if p.version is not None:
        out["version"] = p.version
    out["name"] = p.name
    out["devices"] = {k: device_to_json(d) for k, d in p.devices.items()}
    if p.param_files is not None:
        out["param_files"] = {k: {"path": f.path, "format": f.format} for k, f in p.param_files.items()}
    out["tensors"] = {k: _tensor(t, dt) for k, t in p.tensors.items()}
    out["supertasks"] = {k: _supertask(s) for k, s in p.supertasks.items()}
    out["metadata"] = _metadata(p.metadata, dt)
    if p.blobs is not None:
        out["blobs"] = dict(p.blobs)
    if p.device_constraints is not None:
        out["device_constraints"] = [_constraint(c) for c in p.device_constraints]
    return out


def _constraint(c: DeviceConstraint) -> dict[str, Any]:
    def nested(v):
        return [nested(x) for x in v] if isinstance(v, tuple) else v

    return {"kind": c.kind, "devices": {} if c.devices is None else nested(c.devices)}


def _tensor(t: TensorInfo, dt: dict[str, str]) -> dict[str, Any]:
    d: dict[str, Any] = {"shape": list(t.shape), "dtype": dt.get(t.dtype, t.dtype)}
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


def _supertask(s: SuperTask, *, every_field: bool = False) -> dict[str, Any]:
    d: dict[str, Any] = {"kind": s.kind_spelling or s.kind, "inputs": list(s.inputs), "outputs": list(s.outputs)}
    if every_field:
        keys = {"compute": ("device", "data", "data_blob"), "comm": ("device", "group", "device_idx", "metadata")}
        family = "compute" if s.is_compute else "comm" if s.is_comm else None
        for key in keys.get(family, ()):
            d[key] = _field(s, key)
        return d
    for key in ("device", "data", "data_blob", "group", "device_idx"):
        if key in s.null_fields:
            d[key] = None
        elif getattr(s, key) is not None:
            d[key] = getattr(s, key)
    if s.metadata is not None:
        d["metadata"] = dict(s.metadata)
    return d


def _field(s: SuperTask, key: str) -> Any:
    if key in s.null_fields:
        return None
    value = getattr(s, key)
    return dict(value) if key == "metadata" and value is not None else value


def _metadata(m: Metadata, dt: dict[str, str]) -> dict[str, Any]:
    def orig(items):
        return {k: {"shape": list(o.shape), "dtype": dt.get(o.dtype, o.dtype), "idx": o.idx} for k, o in items.items()}

    def slices(items):
        return {k: {"placements": [list(p) for p in s.placements], "origin": s.origin, "dtype": dt.get(s.dtype, s.dtype),
                    "device": s.device} for k, s in items.items()}

    return {
        "tensors": {"inputs": orig(m.tensors_inputs), "outputs": orig(m.tensors_outputs)},
        "tensor_slices": {"inputs": slices(m.slices_inputs), "outputs": slices(m.slices_outputs)},
    }
