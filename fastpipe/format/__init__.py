"""Layer 1: the pipeline format — types, strict JSON reading and writing.

    read_pipeline(path) -> Pipeline       # parse + type-check every field (no validation rules)
    write_pipeline(p, path)               # atomic; round-trips what was read
"""
from __future__ import annotations

import os
from pathlib import Path

from fastpipe.atomic import write_text
from fastpipe.errors import FormatError
from fastpipe.format import strict_json
from fastpipe.format.model import (Device, Metadata, OriginalTensor, ParamFile, ParamValue, Pipeline,
                                   SuperTask, TensorInfo, TensorSlice)
from fastpipe.format.parse import parse_pipeline
from fastpipe.format.write import pipeline_to_json


def loads_pipeline(text: str | bytes, *, source_dir: Path | None = None, source: str = "pipeline.json") -> Pipeline:
    return parse_pipeline(strict_json.loads(text, source=source), source_dir=source_dir)


def read_pipeline(path: str | os.PathLike) -> Pipeline:
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as e:
        raise FormatError(f"{path}: cannot read pipeline file: {e.strerror or e}") from None
    return loads_pipeline(text, source_dir=path.resolve().parent, source=str(path))


def dumps_pipeline(p: Pipeline) -> str:
    return strict_json.dumps(pipeline_to_json(p))


def write_pipeline(p: Pipeline, path: str | os.PathLike) -> None:
    write_text(path, dumps_pipeline(p))


__all__ = ["Device", "Metadata", "OriginalTensor", "ParamFile", "ParamValue", "Pipeline", "SuperTask",
           "TensorInfo", "TensorSlice", "loads_pipeline", "read_pipeline", "dumps_pipeline", "write_pipeline",
           "parse_pipeline", "pipeline_to_json"]
