"""Layer 1 rules: everything fastpipe checks before any weight data is read.

    validate_structure(p)        # pure data: roles, devices, comm groups, order, metadata
    validate(p, opts, store)     # + payloads (decoded, fake-propagated) + param file headers

Both raise the first error found (a FastpipeError naming its JSON path).
"""
from __future__ import annotations

from dataclasses import dataclass

from fastpipe.format.model import Pipeline
from fastpipe.options import LoadOptions
from fastpipe.validate.comm_groups import CommGroup, collect_groups
from fastpipe.validate.dataflow import Dataflow
from fastpipe.validate.metadata import check_metadata
from fastpipe.validate.order import check_acyclic, check_live
from fastpipe.validate.structure import check_device_constraints, check_devices, check_tensors


@dataclass(frozen=True)
class Checked:
    pipeline: Pipeline
    flow: Dataflow
    groups: dict[str, CommGroup]
    order: list[str]           # merged nodes (supertasks and groups) in a dependency order
    graphs: dict | None = None  # supertask id -> DecodedGraph, when payloads were checked


def validate_structure(p: Pipeline) -> Checked:
    check_devices(p)
    check_device_constraints(p)
    flow = check_tensors(p)
    groups = collect_groups(p)
    order = check_acyclic(p, flow, groups)
    check_live(p, flow)
    check_metadata(p, flow)
    return Checked(p, flow, groups, order)


def check_params(p: Pipeline, opts: LoadOptions, store) -> None:
    from fastpipe import dtypes
    from fastpipe.validate.sources import param_ref

    for name, t in p.tensors.items():
        if t.value is None:
            continue
        ref, where = param_ref(p, name, opts)
        store.check(ref, t.shape, dtypes.to_torch(t.dtype), where=where, trust_export=opts.trust_export_archives)


def check_payload_constants(p: Pipeline, graphs: dict, opts: LoadOptions, store) -> None:
    """Constants a payload keeps in param files (metadata.constant_saved_info): confined and
    header-checked like the pipeline's own constants (load binds them the same way)."""
    from pathlib import Path

    from fastpipe.validate.sources import payload_text
    from fastpipe.weights import ParamRef, resolve_param_path

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
    from fastpipe.validate.payloads import decode_all
    from fastpipe.weights import default_store

    opts = opts or LoadOptions()
    checked = validate_structure(p)
    graphs = decode_all(p, opts) if opts.check_payloads else None
    check_params(p, opts, store or default_store())
    if graphs:
        check_payload_constants(p, graphs, opts, store or default_store())
    return Checked(checked.pipeline, checked.flow, checked.groups, checked.order, graphs)


__all__ = ["Checked", "CommGroup", "LoadOptions", "validate", "validate_structure", "check_params"]
