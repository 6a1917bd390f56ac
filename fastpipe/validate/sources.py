"""Where a supertask's payload text and a constant's file come from (reads files).

A payload is inline `data`, or `data_blob` naming an entry of `blobs`; a null
blob means the payload sits in `<blob-id>.fx` beside the pipeline file, which
payload_text reads. A constant names its file inline (`path`/`format`) or
through `param_files`. Both kinds of path are confined to the pipeline's folder
unless allowed.

payload_text reads each side file once per Pipeline object: validation, binding
and the session all ask for the same payloads, and get the text read the first
time. The cache belongs to the Pipeline (it goes when the Pipeline does); a
Pipeline read again, or made with dataclasses.replace, reads the files again.
"""
from __future__ import annotations

import threading
import weakref
from pathlib import Path

from fastpipe.errors import (
    FormatError,
    ParamError,
    PayloadError,
    ValidationError,
    key_path,
)
from fastpipe.format.model import Pipeline
from fastpipe.options import LoadOptions
from fastpipe.weights import ParamRef, resolve_param_path


def _base_dir(p: Pipeline) -> Path:
    return p.source_dir if p.source_dir is not None else Path.cwd()


# id(pipeline) -> (weak reference to it, {(real path, as text): contents}). Pipeline is a frozen
# dataclass holding dicts (unhashable), so a WeakKeyDictionary cannot key on it; the weak
# reference's callback drops the entry when the pipeline is collected, before its id can be reused.
_side_files: dict[int, tuple[weakref.ref, dict[tuple[Path, bool], str | bytes]]] = {}
_side_files_lock = threading.Lock()


def _side_file_cache(p: Pipeline) -> dict[tuple[Path, bool], str | bytes]:
    key = id(p)
    with _side_files_lock:
        entry = _side_files.get(key)
        if entry is None or entry[0]() is not p:
            entry = (weakref.ref(p, lambda _ref: _side_files.pop(key, None)), {})
            _side_files[key] = entry
        return entry[1]


def _read_side_file(p: Pipeline, file: Path, name: str, where: str, as_text: bool) -> str | bytes:
    cache = _side_file_cache(p)
    if (file, as_text) in cache:
        return cache[(file, as_text)]
    if file.exists() and not file.is_file():      # a FIFO or device would block or stream forever
        raise PayloadError(f"{where}: expected the payload file \"{name}\" to be a regular file, found "
                           f"{'a folder' if file.is_dir() else 'a special file (FIFO, device or socket)'}")
    try:
        data = file.read_text(encoding="ascii") if as_text else file.read_bytes()
    except FileNotFoundError:
        raise PayloadError(f"{where}: expected the payload file \"{name}\" beside the pipeline (the blob is null), found no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PayloadError(f"{where}: cannot read \"{name}\": {e}") from None
    return cache.setdefault((file, as_text), data)


def payload_text(p: Pipeline, sid: str, opts: LoadOptions) -> tuple[str | bytes, str]:
    """Return (payload, where) for a compute supertask; `where` is the JSON path errors name.
    A null blob is read from `<blob-id>.fx` beside the pipeline (text), or for an NPU graph
    (dfg, edf) from `<blob-id>.<kind>` (bytes: the producer saves an edf blob as its
    CompiledGraph's serialized bytes). A side file is read once per Pipeline object (the
    path rules are applied on every call)."""
    st = p.supertasks[sid]
    if st.data is not None:
        return st.data, key_path("supertasks", sid) + ".data"
    path = key_path("supertasks", sid) + ".data_blob"
    if p.blobs is None or st.data_blob not in p.blobs:
        known = ", ".join(sorted(p.blobs or {})) or "none declared"
        raise ValidationError(f"{path}: expected an id in blobs ({known}), found \"{st.data_blob}\"")
    where = key_path("blobs", st.data_blob)
    text = p.blobs[st.data_blob]
    if text is not None:
        return text, where
    name = f"{st.data_blob}.{st.kind}"
    file = resolve_param_path(_base_dir(p), name, where=where, allow_outside=opts.allow_outside_paths)
    return _read_side_file(p, file, name, where, st.kind == "fx"), where


def param_ref(p: Pipeline, name: str, opts: LoadOptions) -> tuple[ParamRef, str]:
    """Resolve a constant's file reference; return (ref, where)."""
    where = key_path("tensors", name) + ".value"
    v = p.tensors[name].value
    if v.param_file is not None:
        if p.param_files is None or v.param_file not in p.param_files:
            known = ", ".join(sorted(p.param_files or {})) or "none declared"
            raise ValidationError(f"{where}.param_file: expected an id in param_files ({known}), found \"{v.param_file}\"")
        f = p.param_files[v.param_file]
        raw, fmt, path_where = f.path, f.format, key_path("param_files", v.param_file)
    else:
        raw, fmt, path_where = v.path, v.format, where
    path = resolve_param_path(_base_dir(p), raw, where=path_where, allow_outside=opts.allow_outside_paths)
    return ParamRef(path=path, format=fmt, name=v.name, placements=v.placements), where


__all__ = ["FormatError", "ParamError", "param_ref", "payload_text"]
