"""The one place that imports private torch APIs (torch 2.11 - 2.13).

Every other fastpipe module takes what it needs from here, so a torch upgrade that moves
one of them is fixed in one file (tests/test_layering.py checks that no other module
names ``torch._<something>``).

    OpOverload, OpOverloadPacket   aten operator classes (torch._ops)
    parse_schema(text)             an operator schema string parsed (torch._C.FunctionSchema)
    FakeTensorMode, FakeTensor     fake tensors for shape propagation (torch._subclasses)
    unique_graphs()                dynamo's count of graphs compiled so far (torch._dynamo)
    counting_inductor(on_compile)  inductor as a torch.compile backend that calls on_compile() per graph it compiles
    compiled_calls_beside_fx_tracing()  let compiled functions run while another thread FX-traces (torch._dynamo.config)
    fx_tracing_lock()              the lock every torch.compile holds while it traces; make_fx elsewhere takes it too
    inductor_default_cache_dir()   the folder inductor caches in when TORCHINDUCTOR_CACHE_DIR is unset (torch._inductor)
    make_graph_module(...)         a GraphModule whose code is generated lazily (torch.fx)
    lazy_graph_modules()           inside it, make_fx's GraphModules generate their code lazily too (torch.fx)
    end_pool_routing(device, pool) stop routing allocations into a failed capture's pool (torch._C)
    foreach_copy_(dst, src)        dst[i].copy_(src[i]) for every i in one launch where it can (torch._foreach_copy_)

``make_graph_module`` builds a GraphModule without generating and exec-ing
its Python code yet. torch.fx compiles a GraphModule's ``forward`` by
generating source from the graph and calling ``exec`` on it; with the lazy
variant that happens on the first call (or ``.code`` access), not while a
payload is decoded. The generated code comes from a graph whose targets,
names and constants decoding has validated; nothing from the file is
executed as code either way.
"""
from __future__ import annotations

import os

import torch

OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
parse_schema = torch._C.parse_schema

from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402, F401  (re-exported)

FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


def foreach_copy_(dst: list, src: list, non_blocking: bool = False) -> None:
    """dst[i].copy_(src[i]) for every i: on CUDA one multi-tensor launch where every tensor shares a device and a
    dtype and is dense (else torch copies them one by one); what inductor's cudagraph trees copy inputs with."""
    torch._foreach_copy_(dst, src, non_blocking=non_blocking)


def unique_graphs() -> int:
    """Graphs torch.compile (dynamo) has produced in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def counting_inductor(on_compile):
    """A torch.compile backend: inductor (torch._inductor.compile_fx, what backend="inductor" runs), calling
    on_compile() first for each graph dynamo hands it. One per compiled function, it counts that function's
    own compiles and recompiles (unique_graphs() counts every thread's)."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        on_compile()
        return compile_fx(gm, example_inputs)

    return backend


def compiled_calls_beside_fx_tracing() -> str:
    """FX's "tracing now" flag is one global (torch.fx._symbolic_trace), and dynamo refuses to run a compiled
    function while it is set ("Detected that you are using FX to symbolically trace a dynamo-optimized
    function"): a compile in one thread (AOTAutograd traces with FX) would make every compiled call in
    another thread fail. Turn that refusal off, process-wide: where torch has force_compile_during_fx_trace,
    compiled functions run (and compile) as usual whatever another thread traces; older versions get
    error_on_nested_fx_trace=False, under which such a call runs its function uncompiled instead. torch's
    config overrides are per thread (a ContextVar), so the setting's default is changed, which every thread
    without an override of its own reads. Returns the setting changed."""
    import torch._dynamo.config as dynamo_config

    name, value = (("force_compile_during_fx_trace", True) if hasattr(dynamo_config, "force_compile_during_fx_trace")
                   else ("error_on_nested_fx_trace", False))
    entry = getattr(dynamo_config, "_config", {}).get(name)
    if entry is not None and hasattr(entry, "default"):
        entry.default = value
    setattr(dynamo_config, name, value)
    return f"{name}={value}"


def fx_tracing_lock():
    """Dynamo's compile lock (an RLock, torch._dynamo.convert_frame): every torch.compile holds it while it
    traces and compiles. FX's tracing state is process-global (the patcher, the "tracing now" flag), so
    fastpipe's own make_fx tracing (the builder) takes this lock too: it never runs beside a compile in
    another thread (the background compiler's)."""
    from torch._dynamo.convert_frame import compile_lock

    return compile_lock


def inductor_default_cache_dir() -> str:
    """Inductor's own default cache folder (/tmp/torchinductor_<user>), which importing torch._dynamo writes
    into TORCHINDUCTOR_CACHE_DIR: a value equal to it was not chosen by the user."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def cudagraph_skips() -> int:
    """Times inductor has run a torch.compile(mode="reduce-overhead") graph without CUDA graphs in this
    process (it says why only through the torch._inductor logger, not as a Python warning)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def profiler_enabled() -> bool:
    """A torch.profiler is recording (record_function costs ~6 us a call; the hot path labels only then)."""
    return torch.autograd._profiler_enabled()


def is_mutable_op(target) -> bool:
    """An aten OpOverload whose schema writes an argument (in-place or out=)."""
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def is_pure_op(target) -> bool:
    """An aten OpOverload that writes nothing and draws no random numbers (safe to compute once)."""
    return (isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in target.tags)


try:  # private since torch 2.3; present in 2.11 - 2.13
    from torch.fx._lazy_graph_module import _LazyGraphModule as _Lazy
except ImportError:  # pragma: no cover - fallback for a torch without it
    _Lazy = None


def make_graph_module(root: torch.nn.Module, graph: torch.fx.Graph, class_name: str) -> torch.fx.GraphModule:
    if _Lazy is not None:
        return _Lazy(root, graph, class_name)
    return torch.fx.GraphModule(root, graph, class_name)  # pragma: no cover


def lazy_graph_modules():
    """A context inside which torch.fx's own GraphModules (make_fx's among them) are lazy, as
    ``make_graph_module``'s are: the builder makes hundreds and calls none of them."""
    import contextlib

    try:  # private, beside _LazyGraphModule
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # pragma: no cover - the GraphModules generate their code at once
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


def end_pool_routing(device_index: int, pool) -> bool:
    """After a CUDA-graph capture whose ``capture_end`` raised: tell the caching allocator the
    capture is over. Up to torch 2.11 ``CUDAGraph::capture_end`` throws on a failed
    ``cudaStreamEndCapture`` before ``endAllocateToPool`` (pytorch#180395 moved it before the
    check), which leaves the allocator believing a capture is underway: it then defers freeing
    every block used on another stream (record_stream), ``empty_cache`` keeps them, and a later
    synchronize can fail its ``captures_underway.empty()`` assertion. Where torch already ended
    it, the allocator refuses (no capture routes to that pool) and nothing changes. Returns
    whether the routing was still there. The pool's own memory is not released here: a torch
    that releases it itself after a failed capture would then release it twice (pytorch#190348)."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return False
    try:
        end(device_index, pool)
    except RuntimeError:
        return False
    return True
