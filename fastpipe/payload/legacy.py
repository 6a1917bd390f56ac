"""furiosa-llm 2024.1.x payloads (torch 2.1) -> the spelling the decoder reads.

2024.1's ``serialize_gm`` writes ``dataclasses.asdict`` of torch 2.1's serialized ``Graph``:
- every union is an object with *all* its members, the unset ones null
  (``{"as_none": null, "as_tensor": {"name": "x"}, "as_int": null, ...}``), not the one-key
  object later torch writes;
- ``tensor_values`` entries wrap the TensorMeta in ``{"meta": ...}``; ``storage_offset`` is a
  plain integer;
- there is no ``metadata`` key: no node names, no lifted constants. Tensor constants
  (``get_attr`` nodes) sit in a top-level ``constants`` map, name -> base64 of a
  ``torch.save`` file, and nodes refer to them by name.
:func:`normalize` rewrites such a payload into the later spelling: one-key unions, plain
TensorMetas, and each constant lifted into a leading input filled from
``metadata.constant_saved_info.blob`` (a safetensors file), as later releases store them.
The ``torch.save`` bytes are read with ``torch.load(weights_only=True)`` (tensors only, as
fastpipe reads torch.save param files): nothing is unpickled beyond plain tensors.
A payload in the later spelling passes through unchanged.
"""
from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import safetensors.torch
import torch

from fastpipe.payload.constants import b64decode_strict
from fastpipe.payload.jsonread import Reader, entry
from fastpipe.payload.metas import tensor_meta_json


def is_legacy(root: dict) -> bool:
    return "constants" in root or any(isinstance(v, dict) and set(v) == {"meta"}
                                      for v in (root.get("tensor_values") or {}).values())


def normalize(r: Reader, root: dict) -> dict:
    if not is_legacy(root):
        return root
    out = {k: _compact(r, v, k) for k, v in root.items() if k != "constants"}
    values = r.obj(out.get("tensor_values", {}), "tensor_values")
    out["tensor_values"] = {k: _meta(r, v, entry("tensor_values", k)) for k, v in values.items()}
    constants = r.obj(root.get("constants") or {}, "constants")
    if constants:
        _lift(r, out, constants)
    return out


def _compact(r: Reader, value: Any, path: str) -> Any:
    """Full-member unions (all keys `as_*`, one non-null) -> one-key unions, recursively."""
    if isinstance(value, list):
        return [_compact(r, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if len(value) > 1 and all(isinstance(k, str) and k.startswith("as_") for k in value):
        set_ = [(k, v) for k, v in value.items() if v is not None]
        if len(set_) != 1:
            raise r.error(path, "a union with exactly one member set", found_text=f"{len(set_)} members set")
        (k, v), = set_
        return {k: _compact(r, v, f"{path}.{k}")}
    return {k: _compact(r, v, f"{path}.{k}") for k, v in value.items()}


def _meta(r: Reader, value: Any, path: str) -> Any:
    if isinstance(value, dict) and set(value) == {"meta"}:
        value = r.obj(value["meta"], f"{path}.meta")
    if isinstance(value, dict) and isinstance(value.get("storage_offset"), int) \
            and not isinstance(value["storage_offset"], bool):
        value = dict(value, storage_offset={"as_int": value["storage_offset"]})
    return value


def _lift(r: Reader, out: dict, constants: dict) -> None:
    metadata = r.obj(out.setdefault("metadata", {}), "metadata")
    if metadata.get("getattr_node_targets"):
        raise r.error("constants", "constants in one place (a torch 2.1 `constants` map or metadata, not both)",
                      found_text="both")
    tensors: dict[str, torch.Tensor] = {}
    for name, text in constants.items():
        path = entry("constants", name)
        raw_text = r.string(text, path)
        try:
            raw = b64decode_strict(raw_text)
        except (binascii.Error, ValueError, UnicodeEncodeError):
            raise r.error(path, "base64 of a torch.save file", found_text="invalid base64") from None
        try:
            tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
        except Exception as exc:  # refused by the weights-only unpickler, or not a torch.save file
            reason = " ".join(str(exc).split())[:120]
            raise r.error(path, "a torch.save file holding one tensor (read with weights_only=True)",
                          found_text=f"bytes it refuses ({reason})") from None
        if not isinstance(tensor, torch.Tensor):
            raise r.error(path, "a torch.save file holding one tensor", found_text=type(tensor).__name__)
        if name in out["tensor_values"]:
            raise r.error(path, "a constant name unused by tensor_values", name)
        tensors[name] = tensor.contiguous()
        out["tensor_values"][name] = tensor_meta_json(tensor)
    out["inputs"] = [{"as_tensor": {"name": n}} for n in tensors] + list(out.get("inputs") or [])
    metadata["getattr_node_targets"] = {n: n for n in tensors}
    blob = base64.b64encode(safetensors.torch.save(tensors)).decode("ascii")
    metadata["constant_saved_info"] = {"param_files": {}, "tensor_to_saved_file_id_and_saved_name": {}, "blob": blob}
