"""Apply a tensor-parallel plan to a module: a rank-local copy with sharded layers.

A plan maps module names to layer kinds:
    "column"          ColumnLinear (output sharded; the next layer must be row-parallel)
    "column_gather"   ColumnLinear whose output is all-gathered
    "row"             RowLinear (partial sums reduced; bias added once, after the reduction)
    "vocab"           VocabEmbedding
    {"kind": "column", "parts": [...], "transposed": True, ...}   the same with options
Unplanned parameters stay whole on every rank.
"""
from __future__ import annotations

import copy
import logging
from typing import Mapping

import torch
from torch import nn

from fastpipe.builder import markers
from fastpipe.builder.sources import Source
from fastpipe.builder.tp_layers import ColumnLinear, RowLinear, VocabEmbedding
from fastpipe.errors import BuildError

log = logging.getLogger("fastpipe")


def _spec(v) -> dict:
    return {"kind": v} if isinstance(v, str) else dict(v)


def make_layer(name: str, mod: nn.Module, spec: dict, rank: int, tp: int, sequence_parallel: bool,
               sequence_dim: int = 1):
    kind = spec["kind"]
    weight = mod.weight
    has_bias = getattr(mod, "bias", None) is not None
    transposed = spec.get("transposed", False)
    reduce_to = spec.get("reduce_to") or (f"shard:{sequence_dim}" if sequence_parallel else "replicate")
    input_layout = f"shard:{sequence_dim}" if sequence_parallel else None
    if kind == "column_gather" and weight.shape[1 if transposed else 0] % tp:
        # SPEC §5: an LM head whose vocab does not divide by tp stays whole on every rank
        log.info("plan[%r]: %d output features do not divide by tp=%d: kept whole on every rank",
                 name, weight.shape[1 if transposed else 0], tp)
        return None
    if kind in ("column", "column_gather"):
        return ColumnLinear(name, tuple(weight.shape), has_bias, rank, tp, transposed=transposed,
                            parts=spec.get("parts"), part_ranges=spec.get("part_ranges"),
                            gather=kind == "column_gather", input_layout=input_layout, dtype=weight.dtype)
    if kind == "row":
        return RowLinear(name, tuple(weight.shape), has_bias, rank, tp, transposed=transposed, reduce_to=reduce_to,
                         dtype=weight.dtype)
    if kind == "vocab":
        return VocabEmbedding(name, tuple(weight.shape), rank, tp, reduce_to=reduce_to, dtype=weight.dtype)
    raise BuildError(f"plan[{name!r}]: expected column, column_gather, row or vocab, found {kind!r}")


def shard_module(model: nn.Module, plan: Mapping[str, object], rank: int, tp: int, *,
                 sequence_parallel: bool = False, sequence_dim: int = 1,
                 split_points: Mapping[str, int] | None = None):
    """Return (local_model on meta, sources: local parameter name -> Source)."""
    local = copy.deepcopy(model).to("meta")
    mods = dict(local.named_modules())
    originals = dict(model.named_modules())
    for name, v in plan.items():
        if name not in mods:
            raise BuildError(f"plan: no submodule named {name!r}")
        parent_name, _, attr = name.rpartition(".")
        parent = mods[parent_name] if parent_name else local
        layer = make_layer(name, originals[name], _spec(v), rank, tp, sequence_parallel, sequence_dim) if tp > 1 else None
        if layer is None:
            continue
        if layer is not None:
            setattr(parent, attr, layer)
    sources: dict[str, Source] = {}
    for mname, m in local.named_modules():
        if hasattr(m, "sources") and isinstance(m.sources, dict):
            for pname, src in m.sources.items():
                sources[f"{mname}.{pname}"] = src
    for pname, p in local.named_parameters():
        if pname not in sources:
            sources[pname] = Source.whole(pname, p.shape)
    for stage_name, stage in (split_points or {}).items():
        sub = dict(local.named_modules()).get(stage_name)
        if sub is None:
            raise BuildError(f"split_points: no submodule named {stage_name!r}")
        sub.register_forward_pre_hook(_splitter(stage))
    return local, sources


def _splitter(stage: int):
    def hook(module, args):
        if args and isinstance(args[0], torch.Tensor):
            return (markers.pipe_split(args[0], stage),) + tuple(args[1:])
        return None
    return hook
