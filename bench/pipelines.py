"""Pipelines made for benchmarks (written to a folder you give)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from fastpipe.builder.assemble import Assembler


def write_load_pipeline(folder: Path, total_mb: int = 256, tensors: int = 16, slots: int = 2,
                        dtype: str = "f32") -> tuple[Path, Path]:
    """A checkpoint of `tensors` matrices (total_mb MiB; `dtype` a format dtype name: f32, bf16, f16)
    and a pipeline whose constants are row slices of all of them, split over `slots` (as
    tensor-parallel shards are)."""
    from fastpipe import dtypes

    folder.mkdir(parents=True, exist_ok=True)
    cols = 1024
    tdt = dtypes.to_torch(dtype)
    rows = total_mb * 2**20 // (tensors * cols * tdt.itemsize)
    rows -= rows % slots
    g = torch.Generator().manual_seed(0)
    ckpt = {f"w{i}": torch.randn(rows, cols, generator=g).to(tdt) for i in range(tensors)}
    weights = folder / "model.safetensors"
    save_file(ckpt, str(weights))
    del ckpt
    a = Assembler("load_bench")
    a.input("x", (cols,), "f32")
    per = rows // slots
    for s in range(slots):
        a.slot(str(s), {"kind": "cpu", "idx": s})
        names = []
        for i in range(tensors):
            n = f"w{i}_{s}"
            a.constant(n, shape=(per, cols), dtype=dtype, path=weights.name, name_in_file=f"w{i}",
                       placements=[[s * per, (s + 1) * per], [0, cols]])
            names.append(n)
        a.fx(str(s), lambda x, *ws: x + sum(w[0] for w in ws), ["x", *names], [f"y{s}"], blob="sum_first_rows")
    a.output([f"y{s}" for s in range(slots)])
    pipeline = folder / "pipeline.json"
    pipeline.write_text(json.dumps(a.to_json()))
    return pipeline, weights


def write_chain_pipeline(folder: Path, n: int = 1000, size: int = 4) -> Path:
    """One slot, a chain of n tiny fx supertasks y_{i+1} = y_i * 1.0001 + 1 (one shared graph)."""
    folder.mkdir(parents=True, exist_ok=True)
    a = Assembler("dispatch_bench")
    a.slot("0", {"kind": "cpu", "idx": 0})
    a.input("y0", (size,), "f32")
    for i in range(n):
        a.fx("0", lambda y: y * 1.0001 + 1, [f"y{i}"], [f"y{i + 1}"], blob="step")
    a.output([f"y{n}"])
    pipeline = folder / "pipeline.json"
    pipeline.write_text(json.dumps(a.to_json()))
    return pipeline


def chain_reference(y: torch.Tensor, n: int) -> torch.Tensor:
    """The same chain as plain eager torch ops: the ops' own time."""
    for _ in range(n):
        y = y * 1.0001 + 1
    return y


def touch_all(tensors) -> float:
    """Read every byte once (both safetensors' load_file and fastpipe's slices are lazy mmap views)."""
    total = 0.0
    for t in tensors:
        total += float(t.sum())
    return total


def session_constants(sess) -> list:
    """The distinct constant tensors a session bound (each once)."""
    seen = {}
    for steps in sess.program.steps.values():
        for step in steps:
            for r in step.constants.values():
                seen[id(r)] = r
    return list(seen.values())


def evict_from_page_cache(path) -> None:
    """Drop a file's clean pages from the page cache (no root needed), for cold-read timings."""
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load_slices_only(pipeline_path):
    """Just the weight store's part of loading: every constant of the pipeline as a slice."""
    from fastpipe import dtypes
    from fastpipe.format import read_pipeline
    from fastpipe.options import LoadOptions
    from fastpipe.validate.sources import param_ref
    from fastpipe.weights import WeightStore

    p = read_pipeline(pipeline_path)
    store, opts = WeightStore(), LoadOptions()
    out = []
    for name, t in p.tensors.items():
        if t.value is not None:
            ref, where = param_ref(p, name, opts)
            out.append(store.load(ref, t.shape, dtypes.to_torch(t.dtype), where=where))
    return out
