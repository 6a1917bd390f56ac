"""torch.compile for fx supertasks: once per distinct graph, constants and device per process, never silently.

Identical graphs share one compiled graph: tensor-parallel replicas and buckets of one model on one
device, and sessions over one pipeline and one WeightStore. The key is the payload's hash, the
device, the compile policy and the IDENTITY of the graph's bound constants (its parameters,
buffers and get_attr targets): the text alone does not say what a constant loaded from a file
(`constant_saved_info.param_files`) holds, so two pipelines with the same graph text and other
constants get a compiled graph each. A graph with no constants of its own (weights are pipeline
tensors, passed as inputs) is keyed by its text and device alone. The cache holds its entries
weakly: the sessions' steps (and `Binder.compiled`) hold them, so closing every session that uses a
compiled graph frees it, its module and its constants. An entry keeps its constants alive (its
module holds them), so their ids cannot be reused while it can be found; a lookup also checks that
they are the very objects asked for.

Compilation happens at warm-up
(`Session.compile()`: one whole run on seeded inputs, so every graph sees the same kinds of
tensors - constants, pipeline inputs, inference-mode intermediates - as real runs and its
guards hold), so compile time is reported apart from run time. If a graph cannot
be compiled (a graph break under fullgraph=True, an inductor error) the policy decides:
"warn" runs that supertask eagerly and warns with the reason; "raise" raises CompileError.
A recompile after warm-up (a guard failed: new shapes, dtypes or devices) is warned
about once per graph.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
import warnings
import weakref
from dataclasses import dataclass

import torch

from fastpipe.errors import CompileError
from fastpipe.runtime.release import release_with
from fastpipe.torch_compat import unique_graphs as _unique_graphs

log = logging.getLogger("fastpipe")

# (payload hash, device, policy, ((constant name, id), ...)) -> CompiledGraph, while something holds it
_CACHE: "weakref.WeakValueDictionary[tuple, CompiledGraph]" = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def payload_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def bound_constants(gm: torch.nn.Module) -> tuple[tuple[str, object], ...]:
    """The objects a graph module reads besides its inputs, by name: parameters, buffers and the
    targets of get_attr nodes (plain tensor attributes too)."""
    out: dict[str, object] = dict(gm.named_parameters())
    out.update(gm.named_buffers())
    graph = getattr(gm, "graph", None)
    for n in (graph.nodes if graph is not None else ()):
        if n.op == "get_attr" and n.target not in out:
            obj = gm
            for part in n.target.split("."):
                obj = getattr(obj, part, None)
            out[n.target] = obj
    return tuple(sorted(out.items(), key=lambda kv: kv[0]))


class CompiledGraph:
    """A graph compiled with inductor; falls back to eager only by the policy, with a warning."""

    def __init__(self, gm: torch.nn.Module, where: str, policy: str, what: str = "supertask"):
        # the constants it was made for (its module holds the same objects): the cache checks them
        self.constants = tuple(obj for _, obj in bound_constants(gm))
        # the decoder builds lazy GraphModules (code generated on first use), which dynamo will not
        # trace: compile a regular GraphModule over the same validated graph and the same buffers
        gm = torch.fx.GraphModule(gm, gm.graph)
        release_with(self, [gm])       # its own module (a cycle, as every GraphModule): freed with this object
        self.gm, self.where, self.policy, self.what = gm, where, policy, what
        # the bound forward, not the module: skips nn.Module call machinery (hooks) on every call
        self.fn = torch.compile(gm.forward, backend="inductor", fullgraph=True, dynamic=False)
        self.compiled = False
        self.eager = False
        self.compile_seconds = 0.0
        self._recompile_warned = False
        self._lock = threading.Lock()

    def _first_call(self, xs):
        """Compiles (timed) on the first real call. A failure follows the policy."""
        with self._lock:
            if self.compiled:
                return self.fn(*xs)
            if self.eager:
                return self.gm(*xs)
            t = time.perf_counter()
            try:
                out = self.fn(*xs)
                self.compiled = True
            except Exception as e:  # noqa: BLE001 - reported with its reason, per policy
                reason = " ".join(str(e).split())[:300] or type(e).__name__
                if self.policy == "raise":
                    raise CompileError(f"{self.where}: torch.compile failed: {type(e).__name__}: {reason}") from e
                warnings.warn(f"fastpipe: {self.where}: torch.compile failed ({type(e).__name__}: {reason}); "
                              f"running this {self.what} eagerly", RuntimeWarning, stacklevel=2)
                self.eager = True
                out = self.gm(*xs)
            self.compile_seconds = time.perf_counter() - t
            return out

    def __call__(self, *xs):
        if self.eager:
            return self.gm(*xs)
        if not self.compiled:
            return self._first_call(xs)
        before = _unique_graphs()
        out = self.fn(*xs)
        if _unique_graphs() != before and self.compiled and not self._recompile_warned:
            self._recompile_warned = True
            warnings.warn(f"fastpipe: {self.where}: torch.compile recompiled this graph after warm-up "
                          "(inputs changed shape, dtype or device?)", RuntimeWarning, stacklevel=2)
        return out


def compiled_graph(text: str, gm: torch.nn.Module, device: torch.device, where: str, policy: str) -> CompiledGraph:
    """The compiled graph for `gm` (whose payload is `text`) on `device`: shared with every live caller
    that passed the same text, device, policy and constant objects; made (not yet compiled) otherwise.
    The caller holds it: the cache does not keep it alive."""
    consts = bound_constants(gm)
    key = (payload_key(text), str(device), policy, tuple((name, id(obj)) for name, obj in consts))
    with _LOCK:
        cg = _CACHE.get(key)
        if cg is None or len(cg.constants) != len(consts) or any(a is not b for a, (_, b) in zip(cg.constants, consts)):
            cg = CompiledGraph(gm, where, policy)
            _CACHE[key] = cg
        return cg


def live_graphs() -> int:
    """Compiled graphs some session still holds (the cache's live entries)."""
    with _LOCK:
        return len(_CACHE)


def clear_cache() -> None:
    """Forget compiled graphs: later callers compile anew (tests). Memory is freed when the
    sessions holding them close."""
    with _LOCK:
        _CACHE.clear()


@dataclass(frozen=True)
class CompileReport:
    graphs: int            # distinct graphs compiled (or attempted) by this session
    seconds: float         # wall time of this session's warm-up compile
    eager: tuple[str, ...] # supertasks running eagerly after a failed compile (policy "warn")


def warmup_inputs(p) -> dict[str, torch.Tensor]:
    """Pipeline inputs for the warm-up run: seeded random floats, zeros for integers (valid indices)."""
    from fastpipe import dtypes

    g = torch.Generator().manual_seed(0)
    out = {}
    for name in p.input_names:
        t = p.tensors[name]
        dt = dtypes.to_torch(t.dtype)
        out[name] = (torch.randn(t.shape, generator=g).to(dt) if dt.is_floating_point
                     else torch.zeros(t.shape, dtype=dt))
    return out
