"""validate: the pure-data rules, then the checks that read files.

Unlike fastpipe.validate.rules, this module opens files: it decodes every graph payload
(inline, or its ``<blob-id>.fx`` side file) and checks it against its supertask
(payloads.py, through sources.payload_text), and reads the header of every param file a
constant or a payload names (through the weight store) -- never the weight data itself.
"""
from __future__ import annotations

from pathlib import Path

from fastpipe import dtypes
from fastpipe.format.model import Pipeline
from fastpipe.options import LoadOptions
from fastpipe.validate.lazy_graphs import LazyGraphs
from fastpipe.validate.payloads import decode_all
from fastpipe.validate.rules import Checked, validate_structure
from fastpipe.validate.written import written_inputs
from fastpipe.validate.sources import param_ref, payload_text
from fastpipe.weights import ParamRef, default_store, resolve_param_path


def check_params(p: Pipeline, opts: LoadOptions, store) -> None:
    """Each constant's param file: path confined, header read and checked against the declaration."""
    for name, t in p.tensors.items():
        if t.value is None:
            continue
        ref, where = param_ref(p, name, opts)
        store.check(ref, t.shape, dtypes.to_torch(t.dtype), where=where, trust_export=opts.trust_export_archives)


def check_payload_constants(p: Pipeline, graphs: dict, opts: LoadOptions, store) -> None:
    """Constants a payload keeps in param files (metadata.constant_saved_info): confined and
    header-checked like the pipeline's own constants (load binds them the same way)."""
    seen = set()
    for sid, g in graphs.items():
        if id(g) in seen or not g.external_constants:
            continue
        seen.add(id(g))
        _, where = payload_text(p, sid, opts)
        for attr, (raw, fmt, saved) in g.external_constants.items():
            w = f"{where}: metadata.constant_saved_info[\"{attr}\"]"
            path = resolve_param_path(p.source_dir or Path.cwd(), raw, where=w, allow_outside=opts.allow_outside_paths)
            meta = g.constant_metas.get(attr)
            if meta is not None:
                store.check(ParamRef(path, fmt, saved, None), tuple(meta.shape), meta.dtype, where=w,
                            trust_export=opts.trust_export_archives)


def validate(p: Pipeline, opts: LoadOptions | None = None, store=None) -> Checked:
    """validate_structure(p), then payloads (if opts.check_payloads) and param-file headers. The
    result's graphs: every payload decoded and checked, or (check_payloads=False) each decoded at
    its first use (LazyGraphs), for binding and the passes alike."""
    opts = opts or LoadOptions()
    checked = validate_structure(p)
    graphs = decode_all(p, opts) if opts.check_payloads else LazyGraphs(p, opts)
    check_params(p, opts, store or default_store())
    if opts.check_payloads:
        check_payload_constants(p, graphs, opts, store or default_store())
    written = written_inputs(p, checked.flow, graphs)      # decodes every graph (LazyGraphs too): binding will anyway
    return Checked(checked.pipeline, checked.flow, checked.groups, checked.order, graphs, written)


__all__ = ["check_params", "check_payload_constants", "validate"]
