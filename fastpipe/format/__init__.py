"""Layer 1: the pipeline format — types, strict JSON reading and writing.

    read_pipeline(path) -> Pipeline       # parse + type-check every field (no validation rules)
    write_pipeline(p, path)               # atomic; round-trips what was read
    write_pipeline(p, path, style="producer")   # what furiosa-llm writes and its loader reads
"""
from __future__ import annotations

import os
from pathlib import Path

from fastpipe.atomic import write_text
from fastpipe.errors import FormatError
from fastpipe.format import strict_json
from fastpipe.format.model import (Device, DeviceConstraint, Metadata, OriginalTensor, ParamFile, ParamValue,
                                   Pipeline, SuperTask, TensorInfo, TensorSlice)
from fastpipe.format.parse import parse_pipeline
from fastpipe.format.producer_style import producer_form
from fastpipe.format.write import STYLES, pipeline_to_json


def loads_pipeline(text: str | bytes, *, source_dir: Path | None = None, source: str = "pipeline.json") -> Pipeline:
    return parse_pipeline(strict_json.loads(text, source=source), source_dir=source_dir)


def read_pipeline(path: str | os.PathLike) -> Pipeline:
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as e:
        raise FormatError(f"{path}: cannot read pipeline file: {e.strerror or e}") from None
    return loads_pipeline(text, source_dir=path.resolve().parent, source=str(path))


def _style(style: str) -> str:
    if style not in STYLES:
        raise FormatError(f"style: expected one of {', '.join(STYLES)}, found {style!r}")
    return style


def _producer_form(p: Pipeline, style: str, rewrite_payload):
    rewrite = None
    if style == "producer-2024.1":
        # the payload dialect belongs to the payload layer, above this one: the caller hands it in
        if rewrite_payload is None:
            raise FormatError("rewrite_payload: expected the torch 2.1 payload rewriter for style 'producer-2024.1' "
                              "(fastpipe.payload.to_torch21), found none")
        rewrite = rewrite_payload

    def blob_text(bid: str) -> str:
        if p.source_dir is None:
            raise FormatError(f"blobs[\"{bid}\"]: expected the payload (inline, or in {bid}.fx beside a pipeline read "
                              "from a file), found null and no source folder")
        return (p.source_dir / f"{bid}.fx").read_text(encoding="ascii")

    return producer_form(p, blob_text=blob_text, rewrite_payload=rewrite)


def dumps_pipeline(p: Pipeline, *, style: str = "fastpipe", rewrite_payload=None) -> str:
    """The JSON text; in the producer styles its blobs are null (see write_pipeline for the side files)."""
    if _style(style) != "fastpipe":
        return strict_json.dumps(pipeline_to_json(_producer_form(p, style, rewrite_payload)[0], every_field=True))
    return strict_json.dumps(pipeline_to_json(p))


def write_pipeline(p: Pipeline, path: str | os.PathLike, *, style: str = "fastpipe", rewrite_payload=None) -> None:
    """Write atomically. style="fastpipe" keeps the spellings p was read with; style="producer"
    writes what furiosa-llm 2024.2.0 and later write and read (fastpipe.format.producer_style),
    with each payload blob in a `<blob-id>.fx` file beside the pipeline; "producer-2024.1" also
    rewrites every payload for the torch 2.1 deserializer of furiosa-llm 2024.1.x with
    `rewrite_payload=fastpipe.payload.to_torch21` (the format layer imports no payload code). Param file
    paths are written as they are: relative ones resolve against the folder written to, so
    write beside the weights (or copy them)."""
    path = Path(path)
    if _style(style) == "fastpipe":
        write_text(path, dumps_pipeline(p))
        return
    q, side = _producer_form(p, style, rewrite_payload)
    folder = path.resolve().parent
    for name, text in side.items():
        write_text(folder / name, text)
    for bid, text in (p.blobs or {}).items():   # payloads already in side files travel with the pipeline
        src = (p.source_dir / f"{bid}.fx") if p.source_dir is not None else None
        target = folder / f"{bid}.fx"
        if f"{bid}.fx" not in side and src is not None and src.is_file() and src.resolve() != target.resolve():
            write_text(target, src.read_text())
    write_text(path, strict_json.dumps(pipeline_to_json(q, every_field=True)))


__all__ = ["Device", "DeviceConstraint", "Metadata", "OriginalTensor", "ParamFile", "ParamValue", "Pipeline",
           "STYLES", "SuperTask", "TensorInfo", "TensorSlice", "loads_pipeline", "read_pipeline", "dumps_pipeline",
           "write_pipeline", "parse_pipeline", "pipeline_to_json"]
