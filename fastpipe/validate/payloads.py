"""Compute supertasks: decode each payload and check it against the supertask (reads files).

Payloads come through sources.payload_text (inline, or read from their side file) and
are decoded with torch (fastpipe.payload); this is the file layer of validation, not a
pure-data rule.

The decoded graph must have as many inputs/outputs as the supertask, declare
the same shapes and dtypes, and fake-tensor propagation from the supertask's
input shapes must give its output shapes. Identical payloads (tensor-parallel
replicas, shared blobs) are decoded once.
"""
from __future__ import annotations

from fastpipe import dtypes
from fastpipe.compute_handlers import required_handler
from fastpipe.errors import PayloadError, key_path
from fastpipe.format.model import Pipeline
from fastpipe.options import LoadOptions
from fastpipe.payload import DecodedGraph, TensorMeta, decode_payload, propagate_metas
from fastpipe.validate.sources import payload_text


def _metas(p: Pipeline, names) -> tuple[TensorMeta, ...]:
    return tuple(TensorMeta(p.tensors[n].shape, dtypes.to_torch(p.tensors[n].dtype)) for n in names)


def _fmt(m: TensorMeta) -> str:
    return f"{dtypes.TORCH_TO_NAME.get(m.dtype, str(m.dtype))}{list(m.shape)}"


def decode_all(p: Pipeline, opts: LoadOptions, *, check: bool = True) -> dict[str, DecodedGraph]:
    """Decode every fx payload (once per distinct text); check each if asked."""
    cache: dict[str, DecodedGraph] = {}
    checked: set[tuple[str, tuple, tuple]] = set()
    out: dict[str, DecodedGraph] = {}
    for sid, st in p.supertasks.items():
        if st.kind in ("dfg", "edf"):
            required_handler(st.kind, sid)
            continue
        if st.kind != "fx":
            continue
        text, where = payload_text(p, sid, opts)
        if text not in cache:
            cache[text] = decode_payload(text, where=where)
        g = cache[text]
        out[sid] = g
        if not check:
            continue
        ins, outs = _metas(p, st.inputs), _metas(p, st.outputs)
        key = (text, ins, outs)
        if key in checked:
            continue
        _check_against(sid, where, g, ins, outs)
        checked.add(key)
    return out


def _check_against(sid: str, where: str, g: DecodedGraph, ins, outs) -> None:
    sp = key_path("supertasks", sid)
    if len(g.input_metas) != len(ins):
        raise PayloadError(f"{where}: expected {len(ins)} graph inputs (the inputs of supertask \"{sid}\"), found {len(g.input_metas)}")
    if len(g.output_metas) != len(outs):
        raise PayloadError(f"{where}: expected {len(outs)} graph outputs (the outputs of supertask \"{sid}\"), found {len(g.output_metas)}")
    for i, (a, b) in enumerate(zip(g.input_metas, ins)):
        if (tuple(a.shape), a.dtype) != (tuple(b.shape), b.dtype):
            raise PayloadError(f"{sp}.inputs[{i}]: expected {_fmt(a)} (graph input {i} in {where}), found {_fmt(b)}")
    for i, (a, b) in enumerate(zip(g.output_metas, outs)):
        if (tuple(a.shape), a.dtype) != (tuple(b.shape), b.dtype):
            raise PayloadError(f"{sp}.outputs[{i}]: expected {_fmt(a)} (graph output {i} in {where}), found {_fmt(b)}")
    got = propagate_metas(g, ins)
    for i, (a, b) in enumerate(zip(got, outs)):
        if (tuple(a.shape), a.dtype) != (tuple(b.shape), b.dtype):
            raise PayloadError(f"{sp}.outputs[{i}]: expected {_fmt(a)} (computed by the graph from the supertask's inputs), found {_fmt(b)}")
