"""Trace each distinct rank-local form once, and give every rank of that form a copy.

The tensor-parallel ranks of a model are, nearly always, one function of different weight slices:
the same layers at the same local shapes. Tracing a rank-local module (make_fx on fake tensors) is
most of a build's time, so a build that traced every rank took tp times as long: a 32-layer model at
tp=8 traced eight identical graphs. A rank's own values reach its graph after the trace instead:
the sharding pass (fastpipe.builder.sharding.apply_sharding) writes in its slices and vocab offset.

A rank-local module's *form* is what its forward can depend on besides its weights' values:
- every submodule's name and class, and the number of hooks on it (hooks may not read the rank);
- its parameters' and buffers' shapes and dtypes, and a real (not meta) buffer's bytes, which make_fx
  bakes into the graph;
- its plain attributes (numbers, strings, dtypes, and tuples, lists and dicts of them), except those
  its class names in ``RANK_FIELDS``: values that reach the graph only through a marker op;
- and the caller's own key (the inputs' shapes, ...).
Ranks that differ anywhere in it (a last vocab block that is short, a row bias only rank 0 adds) are
traced apart; tests/test_build_rank_forms.py builds every tp layout both ways and compares the files.

    forms = RankForms()
    for rank in range(tp):
        local = ...                                      # the rank's module
        gm = forms.graph(local, key, lambda: make_fx(...)(...))   # a fresh copy, the rank's to rewrite
        apply_sharding(gm, rank, tp)
"""
from __future__ import annotations

import copy
import hashlib
from typing import Callable, Hashable

import torch
import torch.fx as fx
from torch import nn

from fastpipe.torch_compat import make_graph_module

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _plain(value):
    """``value`` as a hashable key where it is plain data (recursively), else None (left out of the form)."""
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        return None if any(i is None for i in items) else (type(value).__name__, tuple(items))
    if isinstance(value, dict):
        items = [(k, _plain(v)) for k, v in value.items() if isinstance(k, str)]
        return None if any(v is None for _, v in items) else ("dict", tuple(sorted(items)))
    return None


def _tensor_key(t: torch.Tensor, *, with_bytes: bool) -> tuple:
    key = (tuple(t.shape), t.dtype)
    if with_bytes and t.device.type != "meta":
        data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        key += (hashlib.sha256(data).hexdigest(),)
    return key


def form_of(module: nn.Module) -> tuple:
    """What ``module``'s traced graph can depend on besides its weights' values (module docstring)."""
    parts = []
    for name, m in module.named_modules(remove_duplicate=False):
        skip = set(getattr(type(m), "RANK_FIELDS", ()))
        attrs = tuple(sorted((k, p) for k, v in vars(m).items()
                             if not k.startswith("_") and k not in skip and (p := _plain(v)) is not None))
        hooks = tuple(len(getattr(m, h, ())) for h in ("_forward_pre_hooks", "_forward_hooks"))
        params = tuple((k, _tensor_key(p, with_bytes=False)) for k, p in m._parameters.items() if p is not None)
        buffers = tuple((k, _tensor_key(b, with_bytes=True)) for k, b in m._buffers.items() if b is not None)
        parts.append((name, type(m).__module__, type(m).__qualname__, hooks, attrs, params, buffers))
    return tuple(parts)


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose graph can be rewritten without touching ``gm``'s: the nodes copied (names,
    targets and meta alike; the fake values in meta are shared, never changed), attributes shared. The
    builders trace flat functions, whose graphs use fx's default code generator, as the copy does."""
    graph = fx.Graph()
    value, old_output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(value).meta = copy.copy(old_output.meta)
    return make_graph_module(gm, graph, type(gm).__name__)


class RankForms:
    """The traced graph of each form seen so far; ``traced`` counts the traces actually run."""

    def __init__(self) -> None:
        self._graphs: dict[Hashable, fx.GraphModule] = {}
        self.traced = 0

    def graph(self, local: nn.Module, key: Hashable, trace: Callable[[], fx.GraphModule]) -> fx.GraphModule:
        """A copy of the graph of ``local``'s form (with ``key``), traced by ``trace()`` the first time."""
        form = (form_of(local), key)
        if form not in self._graphs:
            self._graphs[form] = trace()
            self.traced += 1
        return copy_graph_module(self._graphs[form])
