"""Embedded constants: the safetensors blob, external references, binding.

The blob is parsed with ``safetensors.torch.load`` (a plain header + raw
bytes format; no code runs). External constants are only described here;
the caller loads them safely and passes them to :func:`bind_external`.
"""
from __future__ import annotations

import base64
import binascii
import keyword
import re
from typing import Any, Mapping

import safetensors.torch
import torch

from fastpipe.errors import ParamError
from fastpipe.payload.decoded import DecodedGraph, TensorMeta
from fastpipe.payload.jsonread import Reader, entry, item, member

_PLAIN_ATTR = re.compile(r"[A-Za-z][A-Za-z0-9_]*|_[A-Za-z0-9][A-Za-z0-9_]*")


def b64decode_strict(text: str) -> bytes:
    """Standard base64 (ASCII whitespace tolerated, as base64.decodebytes does)."""
    compact = "".join(text.split())
    return base64.b64decode(compact.encode("ascii"), validate=True)


def read_blob(r: Reader, value: Any, path: str) -> dict[str, torch.Tensor]:
    if value is None:
        return {}
    text = r.string(value, path)
    try:
        raw = b64decode_strict(text)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise r.error(path, "standard base64 of a safetensors file", found_text="invalid base64") from None
    try:
        tensors = safetensors.torch.load(raw)
    except Exception as exc:  # SafetensorError and friends; never code execution
        reason = " ".join(str(exc).split())[:120] or type(exc).__name__
        raise r.error(path, "a safetensors file", found_text=f"bytes that are not one ({reason})") from None
    return dict(tensors)


def read_external(r: Reader, info: dict, path: str) -> dict[str, tuple[str, str, str]]:
    """``tensor_to_saved_file_id_and_saved_name`` joined with ``param_files``."""
    files_path = member(path, "param_files")
    files = r.obj(info.get("param_files") or {}, files_path)
    refs_path = member(path, "tensor_to_saved_file_id_and_saved_name")
    refs = r.obj(info.get("tensor_to_saved_file_id_and_saved_name") or {}, refs_path)
    out: dict[str, tuple[str, str, str]] = {}
    for attr, ref in refs.items():
        ref_path = entry(refs_path, attr)
        pair = r.lst(ref, ref_path)
        if len(pair) != 2:
            raise r.error(ref_path, "[file-id, saved-name]", pair)
        file_id = r.string(pair[0], item(ref_path, 0))
        saved_name = r.string(pair[1], item(ref_path, 1))
        if file_id not in files:
            raise r.error(item(ref_path, 0), "a key of param_files", file_id)
        file_path = entry(files_path, file_id)
        record = r.obj(files[file_id], file_path)
        location = r.string(r.key(record, "path", file_path), member(file_path, "path"))
        fmt = r.string(r.key(record, "format", file_path), member(file_path, "format"))
        if fmt != "safetensors":
            raise r.error(member(file_path, "format"), "'safetensors'", fmt)
        if not location or "\x00" in location:
            raise r.error(member(file_path, "path"), "a file path", location)
        out[attr] = (location, fmt, saved_name)
    return out


def buffer_name(attr: str, taken: set[str], root: torch.nn.Module) -> str:
    """A safe buffer name for a payload attribute name (kept when it is a free identifier)."""
    if _PLAIN_ATTR.fullmatch(attr) and not keyword.iskeyword(attr) and attr not in taken and not hasattr(root, attr):
        return attr
    base = "_const_" + re.sub(r"[^A-Za-z0-9_]", "_", attr)[:40]
    name, n = base, 0
    while name in taken or hasattr(root, name):
        n += 1
        name = f"{base}_{n}"
    return name


def bind_external(decoded: DecodedGraph, tensors: Mapping[str, torch.Tensor]) -> None:
    """Install externally loaded constants (by payload attribute name) into ``decoded.gm``."""
    for attr, tensor in tensors.items():
        where = f"{decoded.where}: external constant {attr!r}"
        if attr not in decoded.external_constants:
            raise ParamError(f"{where}: expected one of the payload's external constants, found an unknown name")
        if not isinstance(tensor, torch.Tensor):
            raise ParamError(f"{where}: expected a tensor, found {type(tensor).__name__}")
        meta = decoded.constant_metas.get(attr)
        if meta is not None and (tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype):
            raise ParamError(
                f"{where}: expected shape {list(meta.shape)} dtype {meta.dtype}, "
                f"found shape {list(tensor.shape)} dtype {tensor.dtype}"
            )
        decoded.gm.register_buffer(decoded.constant_attrs[attr], tensor, persistent=False)


def unbound_external(decoded: DecodedGraph) -> list[str]:
    """Names of external constants still holding their ``meta`` placeholder."""
    return [
        attr
        for attr in decoded.external_constants
        if getattr(decoded.gm, decoded.constant_attrs[attr]).device.type == "meta"
    ]


def placeholder_for(meta: TensorMeta) -> torch.Tensor:
    return torch.empty(meta.shape, dtype=meta.dtype, device="meta")
