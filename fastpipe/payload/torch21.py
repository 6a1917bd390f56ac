"""Payloads for furiosa-llm 2024.1.x, whose deserializer is torch 2.1's.

    to_torch21(payload) -> payload      # the later (torch >= 2.4) spelling -> torch 2.1's

torch 2.1 reads its serialized ``Graph`` with ``cls(**data)`` at every level, so it needs the
spelling its own ``dataclasses.asdict`` writes (fastpipe.payload.legacy reads it back):
- every union written with all of torch 2.1's members, the unset ones null, a selected
  ``as_none`` as ``[]``;
- ``tensor_values`` entries wrapped in ``{"meta": ...}``, ``storage_offset`` a plain integer;
- no keys torch 2.1 lacks (``custom_obj_values``, ``NamedArgument.kind``, ``Node.name``);
- no ``metadata`` key (2024.1's deserialize_gm does not read one): embedded constants go to
  ``constants`` (name -> base64 of ``torch.save`` of the tensor), referenced by name, as torch
  2.1 serialized ``get_attr`` tensors.
"""
from __future__ import annotations

import base64
import io
import json
import torch

from fastpipe.payload.constants import read_blob
from fastpipe.payload.decode import load_json
from fastpipe.payload.jsonread import Reader
from fastpipe.payload.legacy import is_legacy

# torch 2.1's torch/_export/serde/schema.py, union classes and their members in order
ARGUMENT = ("as_none", "as_tensor", "as_tensors", "as_int", "as_ints", "as_float", "as_floats", "as_string",
            "as_strings", "as_sym_int", "as_sym_ints", "as_scalar_type", "as_memory_format", "as_layout",
            "as_device", "as_bool", "as_bools", "as_sym_bool", "as_sym_bools", "as_graph",
            "as_optional_tensors", "as_custom_obj")
SYM_INT = ("as_expr", "as_int")
SYM_BOOL = ("as_expr", "as_bool")
SYM_INT_ARGUMENT = ("as_name", "as_int")
SYM_BOOL_ARGUMENT = ("as_name", "as_bool")
OPTIONAL_TENSOR = ("as_tensor", "as_none")


def to_torch21(payload: str) -> str:
    """A payload in the later spelling, rewritten for torch 2.1's deserializer."""
    r = Reader("to_torch21")
    root = load_json(r, payload)
    if is_legacy(root):
        return payload
    metadata = root.get("metadata") or {}
    lifted = dict(metadata.get("getattr_node_targets") or {})
    info = metadata.get("constant_saved_info") or {}
    if info.get("tensor_to_saved_file_id_and_saved_name"):
        raise ValueError("to_torch21: constants kept in param files have no torch 2.1 spelling")
    blob = read_blob(r, info.get("blob"), "metadata.constant_saved_info.blob")
    constants = {}
    for placeholder, attr in lifted.items():
        buf = io.BytesIO()
        torch.save(blob[attr].contiguous(), buf)
        constants[placeholder] = base64.b64encode(buf.getvalue()).decode("ascii")
    out = {
        "inputs": [_union(a, ARGUMENT) for a in root["inputs"] if a.get("as_tensor", {}).get("name") not in lifted],
        "outputs": [_union(a, ARGUMENT) for a in root["outputs"]],
        "nodes": [_node(n) for n in root["nodes"]],
        "tensor_values": {k: {"meta": _meta(v)} for k, v in root["tensor_values"].items() if k not in lifted},
        "sym_int_values": {k: _union(v, SYM_INT) for k, v in (root.get("sym_int_values") or {}).items()},
        "sym_bool_values": {k: _union(v, SYM_BOOL) for k, v in (root.get("sym_bool_values") or {}).items()},
        "is_single_tensor_return": bool(root.get("is_single_tensor_return", False)),
        "constants": constants,
    }
    return base64.b64encode(json.dumps(out).encode("utf-8")).decode("ascii")


def _union(value: dict, members: tuple[str, ...]) -> dict:
    ((tag, inner),) = value.items()
    if tag not in members:
        raise ValueError(f"to_torch21: {tag} has no torch 2.1 spelling")
    if tag == "as_none":
        inner = []
    elif tag in ("as_sym_int", "as_sym_bool"):
        inner = _union(inner, SYM_INT_ARGUMENT if tag == "as_sym_int" else SYM_BOOL_ARGUMENT)
    elif tag in ("as_sym_ints", "as_sym_bools"):
        inner = [_union(x, SYM_INT_ARGUMENT if tag == "as_sym_ints" else SYM_BOOL_ARGUMENT) for x in inner]
    elif tag == "as_optional_tensors":
        inner = [_union(x, OPTIONAL_TENSOR) for x in inner]
    return {m: (inner if m == tag else None) for m in members}


def _node(n: dict) -> dict:
    return {
        "target": n["target"],
        "inputs": [{"name": a["name"], "arg": _union(a["arg"], ARGUMENT)} for a in n["inputs"]],
        "outputs": [_union(a, ARGUMENT) for a in n["outputs"]],
        "metadata": dict(n.get("metadata") or {}),
    }


def _meta(m: dict) -> dict:
    offset = m.get("storage_offset", {"as_int": 0})
    return {
        "dtype": m["dtype"],
        "sizes": [_union(s, SYM_INT) for s in m["sizes"]],
        "requires_grad": bool(m.get("requires_grad", False)),
        "device": m["device"],
        "strides": [_union(s, SYM_INT) for s in m["strides"]],
        "storage_offset": offset["as_int"] if isinstance(offset, dict) else offset,
        "layout": m["layout"],
    }
