"""pipeline.json (as plain JSON data) -> Pipeline, checking every field's type.

This checks the *form* of each field; cross-field rules live in
fastpipe.validate. Every error names its JSON path.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fastpipe import dtypes
from fastpipe.errors import FormatError, key_path
from fastpipe.format import fields
from fastpipe.format.devices import parse_device
from fastpipe.format.model import (COMM_KINDS, COMPUTE_KINDS, NULL_GROUP_PREFIX, DeviceConstraint,
                                   Metadata, OriginalTensor, ParamFile, ParamValue, Pipeline, SuperTask, TensorInfo,
                                   TensorSlice, all_kinds)

TOP_REQUIRED = ("name", "devices", "tensors", "supertasks")
TOP_OPTIONAL = ("metadata", "version", "param_files", "blobs", "device_constraints")
PARAM_FORMATS = ("safetensors", "torch.save", "torch.export")
KIND_ALIASES = {"FX": "fx", "DFG": "dfg", "EDF": "edf"}    # every kind is also spelled as itself (all_kinds())
# Optional fields a producer writes as null (furiosa-llm serializes with dataclasses.asdict, so
# every optional field of its dataclasses is present): null reads as absent.
NULLABLE = {"compute": ("data", "data_blob"), "comm": ("group",)}
MAX_TENSOR_BYTES = 2**48      # 256 TiB: beyond any device; larger sizes overflow allocator arithmetic


def parse_pipeline(doc: Any, *, source_dir: Path | None = None) -> Pipeline:
    _refuse_next_gen(doc)
    top = fields.obj(doc, "", required=TOP_REQUIRED, optional=TOP_OPTIONAL)
    spellings: dict[str, str] = {}
    devices = {k: parse_device(v, key_path("devices", k)) for k, v in fields.mapping(top["devices"], "devices").items()}
    tensors = {k: _tensor(v, key_path("tensors", k), spellings) for k, v in fields.mapping(top["tensors"], "tensors").items()}
    supertasks = {k: _supertask(v, key_path("supertasks", k), k) for k, v in fields.mapping(top["supertasks"], "supertasks").items()}
    param_files = None
    if "param_files" in top:
        param_files = {k: _param_file(v, key_path("param_files", k)) for k, v in fields.mapping(top["param_files"], "param_files").items()}
    blobs = None
    if "blobs" in top:
        blobs = {}
        for k, v in fields.mapping(top["blobs"], "blobs").items():
            blobs[k] = None if v is None else fields.string(v, key_path("blobs", k))
    constraints = None
    if "device_constraints" in top:
        items = top["device_constraints"]
        if not isinstance(items, list):
            raise FormatError(f"device_constraints: expected an array, found {fields.type_name(items)}")
        constraints = tuple(_constraint(c, f"device_constraints[{i}]") for i, c in enumerate(items))
    return Pipeline(
        name=fields.string(top["name"], "name", nonempty=False),
        devices=devices,
        tensors=tensors,
        supertasks=supertasks,
        metadata=_metadata(top.get("metadata", {}), "metadata", spellings),
        version=fields.string(top["version"], "version") if "version" in top else None,
        param_files=param_files,
        blobs=blobs,
        device_constraints=constraints,
        source_dir=source_dir,
        dtype_spellings=spellings,
    )


def _refuse_next_gen(top: Any) -> None:
    """furiosa-llm 2026.x's experimental stage-based format (parallelize/pipeline/next_gen.py)."""
    if isinstance(top, dict) and "stages" in top and not {"devices", "supertasks"} & set(top):
        raise FormatError("stages: expected the supertask format (devices, tensors, supertasks), found furiosa-llm's "
                          "experimental stage-based format (next_gen.py: inputs, outputs, stages), which fastpipe does not read")


def _constraint(value: Any, path: str) -> DeviceConstraint:
    c = fields.obj(value, path, required=("kind", "devices"))
    kind = fields.string(c["kind"], f"{path}.kind")
    devices = c["devices"]
    if devices == {}:
        return DeviceConstraint(kind=kind, devices=None)

    def nested(v: Any, p: str):
        if isinstance(v, list):
            return tuple(nested(x, f"{p}[{i}]") for i, x in enumerate(v))
        return _slot_ref(v, p)

    if not isinstance(devices, list):
        raise fields.bad(f"{path}.devices", "a nested array of slot ids (or {})", devices)
    return DeviceConstraint(kind=kind, devices=nested(devices, f"{path}.devices"))


def _dtype(value: Any, path: str, spellings: dict[str, str]) -> str:
    """The canonical dtype name; an alias (f8e4m3fn) is recorded to be written back."""
    if not isinstance(value, str) or value not in dtypes.SPELLINGS:
        raise fields.bad(path, f"one of {' '.join(dtypes.SPELLINGS)}", value)
    if value in dtypes.ALIASES:
        spellings[dtypes.ALIASES[value]] = value
        return dtypes.ALIASES[value]
    return value


def _tensor(value: Any, path: str, spellings: dict[str, str]) -> TensorInfo:
    t = fields.obj(value, path, required=("shape", "dtype"), optional=("value",))
    pv = _param_value(t["value"], f"{path}.value") if "value" in t and t["value"] is not None else None
    shape, dtype = fields.shape(t["shape"], f"{path}.shape"), _dtype(t["dtype"], f"{path}.dtype", spellings)
    nbytes = dtypes.to_torch(dtype).itemsize
    for s in shape:
        nbytes *= s
    if nbytes > MAX_TENSOR_BYTES:
        raise FormatError(f"{path}.shape: expected a tensor of at most 2**48 bytes, found {list(shape)} {dtype} ({nbytes} bytes)")
    return TensorInfo(shape=shape, dtype=dtype, value=pv)


def _param_file(value: Any, path: str) -> ParamFile:
    p = fields.obj(value, path, required=("path", "format"))
    fmt = fields.string(p["format"], f"{path}.format")
    if fmt not in PARAM_FORMATS:
        raise fields.bad(f"{path}.format", "one of " + ", ".join(PARAM_FORMATS), fmt)
    return ParamFile(path=fields.string(p["path"], f"{path}.path"), format=fmt)


def _param_value(value: Any, path: str) -> ParamValue:
    v = fields.obj(value, path, required=("name",),
                   optional=("path", "format", "param_file", "name_in_graph", "placements"))
    inline = "path" in v or "format" in v
    if inline and "param_file" in v:
        raise FormatError(f"{path}: expected either path/format or param_file, found both")
    if not inline and "param_file" not in v:
        raise FormatError(f"{path}: missing required field \"path\" (or \"param_file\")")
    fmt = None
    if inline:
        if "path" not in v or "format" not in v:
            missing = "format" if "path" in v else "path"
            raise FormatError(f"{path}: missing required field \"{missing}\"")
        fmt = fields.string(v["format"], f"{path}.format")
        if fmt not in PARAM_FORMATS:
            raise fields.bad(f"{path}.format", "one of " + ", ".join(PARAM_FORMATS), fmt)
    placements = None
    if v.get("placements") is not None:
        placements = fields.placements(v["placements"], f"{path}.placements")
    return ParamValue(
        name=fields.string(v["name"], f"{path}.name"),
        placements=placements,
        path=fields.string(v["path"], f"{path}.path") if inline else None,
        format=fmt,
        param_file=fields.string(v["param_file"], f"{path}.param_file") if "param_file" in v else None,
        name_in_graph=fields.string(v["name_in_graph"], f"{path}.name_in_graph") if v.get("name_in_graph") is not None else None,
    )


def _supertask(value: Any, path: str, sid: str) -> SuperTask:
    raw_kind = fields.obj(value, path, required=("kind",), optional=(
        "inputs", "outputs", "device", "data", "data_blob", "group", "device_idx", "metadata"))["kind"]
    kinds = all_kinds()
    if not isinstance(raw_kind, str) or (raw_kind not in kinds and raw_kind not in KIND_ALIASES):
        raise fields.bad(f"{path}.kind", "one of " + ", ".join(kinds) + " (or FX)", raw_kind)
    kind = KIND_ALIASES.get(raw_kind, raw_kind)
    if kind in COMPUTE_KINDS:
        allowed, family = ("device", "data", "data_blob"), "compute"
    elif kind in COMM_KINDS:
        allowed, family = ("device", "group", "device_idx", "metadata"), "comm"
    else:
        allowed, family = (), "io"
    s = dict(fields.obj(value, path, required=("kind", "inputs", "outputs"), optional=allowed))
    nulls = tuple(k for k in NULLABLE.get(family, ()) if k in s and s[k] is None)
    for k in nulls:
        del s[k]
    for needed in allowed:
        if needed in ("data", "data_blob") or needed in nulls:
            continue
        if needed not in s:
            raise FormatError(f"{path}: missing required field \"{needed}\" for a {kind} supertask")
    if kind in COMPUTE_KINDS and ("data" in s) == ("data_blob" in s):
        raise FormatError(f"{path}: expected exactly one of \"data\" or \"data_blob\" for a {kind} supertask "
                          f"(the other absent or null), found {'both' if 'data' in s else 'neither'}")
    metadata = None
    if kind in COMM_KINDS:
        metadata = fields.mapping(s["metadata"], f"{path}.metadata")
        for k, mv in metadata.items():
            if isinstance(mv, bool) or not isinstance(mv, (int, str)):
                raise fields.bad(f"{path}.metadata.{k}",
                                 "a non-negative integer or a string", mv)
    group = None
    if "group" in nulls:
        group = f"{NULL_GROUP_PREFIX}{sid}>"
    elif "group" in s:
        group = fields.string(s["group"], f"{path}.group")
    return SuperTask(
        kind=kind,
        inputs=fields.string_list(s["inputs"], f"{path}.inputs"),
        outputs=fields.string_list(s["outputs"], f"{path}.outputs"),
        device=fields.string(s["device"], f"{path}.device") if "device" in s else None,
        data=fields.string(s["data"], f"{path}.data") if "data" in s else None,
        data_blob=fields.string(s["data_blob"], f"{path}.data_blob") if "data_blob" in s else None,
        group=group,
        device_idx=fields.uint(s["device_idx"], f"{path}.device_idx") if "device_idx" in s else None,
        metadata=metadata,
        kind_spelling=raw_kind if raw_kind != kind else None,
        null_fields=nulls,
    )


def _metadata(value: Any, path: str, spellings: dict[str, str]) -> Metadata:
    m = fields.obj(value, path, optional=("tensors", "tensor_slices"))
    t = fields.obj(m.get("tensors", {}), f"{path}.tensors", optional=("inputs", "outputs"))
    s = fields.obj(m.get("tensor_slices", {}), f"{path}.tensor_slices", optional=("inputs", "outputs"))

    def originals(v, p):
        return {k: _original(x, key_path(p, k), spellings) for k, x in fields.mapping(v, p).items()}

    def slices(v, p):
        return {k: _slice(x, key_path(p, k), spellings) for k, x in fields.mapping(v, p).items()}

    return Metadata(
        tensors_inputs=originals(t.get("inputs", {}), f"{path}.tensors.inputs"),
        tensors_outputs=originals(t.get("outputs", {}), f"{path}.tensors.outputs"),
        slices_inputs=slices(s.get("inputs", {}), f"{path}.tensor_slices.inputs"),
        slices_outputs=slices(s.get("outputs", {}), f"{path}.tensor_slices.outputs"),
    )


def _original(value: Any, path: str, spellings: dict[str, str]) -> OriginalTensor:
    o = fields.obj(value, path, required=("shape", "dtype", "idx"))
    return OriginalTensor(shape=fields.shape(o["shape"], f"{path}.shape"), dtype=_dtype(o["dtype"], f"{path}.dtype", spellings),
                          idx=fields.uint(o["idx"], f"{path}.idx"))


def _slice(value: Any, path: str, spellings: dict[str, str]) -> TensorSlice:
    o = fields.obj(value, path, required=("placements", "origin", "dtype", "device"))
    return TensorSlice(placements=fields.placements(o["placements"], f"{path}.placements"),
                       origin=fields.string(o["origin"], f"{path}.origin"),
                       dtype=_dtype(o["dtype"], f"{path}.dtype", spellings),
                       device=_slot_ref(o["device"], f"{path}.device"))


def _slot_ref(value: Any, path: str) -> str:
    """A slot id; producers write it as a string key or as an integer."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise fields.bad(path, "a slot id (string or integer)", value)
    return str(value)
