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

Two ways to compile (RunOptions.compile). "background" (tiered, the default): a graph runs eagerly
from its first call while one background thread compiles it, and the compiled graph is swapped in
between calls once ready and measured faster (CompiledGraph says how; on the CPU a cheap estimate,
fastpipe.runtime.compiling.compile_estimate, first decides whether a compile can pay at all). "wait": the
compile happens at warm-up (`Session.compile()`: one whole run on seeded inputs, so every graph sees
the same kinds of tensors - constants, pipeline inputs, inference-mode intermediates - as real runs
and its guards hold), so compile time is reported apart from run time. If a graph cannot
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
from fastpipe.runtime.binding.release import release_with
from fastpipe.torch_compat import counting_inductor

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


MEASURED_CALLS = 3         # tiered, on the CPU: compiled and eager calls each timed this often, then the faster kept
MAX_RETRIES = 5            # tiered: background compiles that compiled nothing, tried again
DECIDED_AT_CALL = 2        # tiered: whether to compile is decided at this call (a graph run once never compiles)


class CompiledGraph:
    """A graph compiled with inductor; falls back to eager only by the policy, with a warning.

    Two ways to compile (`background`):
    - False ("wait"): the first call compiles (timed) and runs compiled; Session.compile() makes that
      call at warm-up. RegionProcessor.tune() may then settle on eager where it measured it faster.
    - True (tiered): every call runs the graph eagerly until a compiled version is ready. At the second
      call (a graph run once is not worth a compile), on the CPU, fastpipe.runtime.compiling.compile_estimate decides whether a
      compile can pay (`skipped` says why not); if so the graph is queued on the process's background compiler
      (fastpipe.runtime.compiling.background_compile), which compiles it on zero-filled tensors shaped, strided and
      typed as that call's arguments, under the same grad / inference mode. Once ready it is swapped in
      between calls: on the CPU the next calls alternate compiled and eager, each timed on the real
      inputs (MEASURED_CALLS of each, while no other graph compiles beside them), and the faster is kept (`timing`, `use_eager`); on a GPU the
      compiled graph is kept. A failed background compile is reported at the next call, by the policy.
    `state()` says where a graph stands, in a phrase.
    """

    def __init__(self, gm: torch.nn.Module, where: str, policy: str, what: str = "supertask",
                 background: bool = False, device: torch.device | str | None = None):
        from fastpipe.runtime.compiling.compile_cache import use_persistent_cache

        use_persistent_cache()          # compiled code outlives the process (a second one hits the cache)
        # the constants it was made for (its module holds the same objects): the cache checks them
        self.constants = tuple(obj for _, obj in bound_constants(gm))
        # the decoder builds lazy GraphModules (code generated on first use), which dynamo will not
        # trace: compile a regular GraphModule over the same validated graph and the same buffers
        gm = torch.fx.GraphModule(gm, gm.graph)
        release_with(self, [gm])       # its own module (a cycle, as every GraphModule): freed with this object
        self.gm, self.where, self.policy, self.what = gm, where, policy, what
        # the bound forward, not the module: skips nn.Module call machinery (hooks) on every call
        # inductor, counting this graph's own compiles (a recompile after warm-up is warned about)
        # (a counter the backend shares, not a method of this object: no reference cycle through the backend)
        self._variants = counter = [0]
        self.fn = torch.compile(gm.forward, backend=counting_inductor(lambda: counter.__setitem__(0, counter[0] + 1)),
                                fullgraph=True, dynamic=False)
        self.compiled = False           # a compiled version exists and has been adopted (or measured)
        self.eager = False              # its compile failed: eager from then on (CompileReport.eager)
        self.use_eager = False          # run eagerly although compiled or never compiled: measured faster, or skipped
        self.compile_seconds = 0.0
        self.background = background
        self.device_type = torch.device(device).type if device is not None else None
        self.calls = 0                  # calls so far (tiered: the background compiler's priority)
        self.skipped: str | None = None            # tiered: why the estimate chose not to compile
        self.timing: tuple[float, float] | None = None   # (compiled, eager) seconds a call, measured
        self.measured_at = ""           # "at warm-up" (RegionProcessor.tune) or "on real calls" (tiered)
        self._recompile_warned = False
        self._lock = threading.Lock()   # held while compiling: never two compiles of this graph at once
        self._ready = False             # tiered: compiled in the background, not yet measured / adopted
        self._queued = False
        self._example = None            # tiered: (arg metas, grad mode, inference mode) of the first call
        self._failure: tuple[str, str] | None = None   # tiered: (exception type, reason) of a failed compile
        self._samples: tuple[list, list] = ([], [])   # tiered: (compiled, eager) seconds of measured calls
        self._retries = 0
        self._decided = False           # tiered: whether to compile was decided (queued, or skipped)
        self.decide_now = False         # tiered: decide at the next call, not the second (Session.compile's warm-up)

    @property
    def variants(self) -> int:
        """How many times inductor compiled this graph (more than 1: recompiled)."""
        return self._variants[0]

    # ------------------------------------------------------------------ where it stands
    def state(self) -> str:
        """How this graph runs now, in a phrase (describe() of the sessions): "eager, one call (not compiled:
        ...)", "eager, one call, compiling in the background", "compiled in the background, measuring against
        eager", "compiled as one graph (...)", "compiled as one graph, but run eagerly (faster ...)",
        "compile failed, eager". `what` names the unit ("one graph" for a region)."""
        if self.eager:
            return "compile failed, eager"
        if self.skipped is not None:
            return f"eager, one call (not compiled: {self.skipped})"
        if self.compiled:
            if self.timing is None:
                return "compiled as one graph"
            c, e = self.timing
            if self.use_eager:
                return (f"compiled as one graph, but run eagerly (faster {self.measured_at}: {e * 1e3:.3f} vs "
                        f"{c * 1e3:.3f} ms a call)")
            return f"compiled as one graph (faster {self.measured_at}: {c * 1e3:.3f} vs {e * 1e3:.3f} ms a call eager)"
        if self._ready:
            return "compiled in the background, measuring against eager"
        if self._queued:
            return "eager, one call, compiling in the background"
        return "eager, one call (whether to compile is decided at its second call)" if self.background \
            else "compiled as one graph"

    @property
    def stage(self) -> str:
        """Where the graph stands, as a key: "failed", "skipped" (the estimate), "eager" (measured faster),
        "compiled", "measuring" (compiled in the background, not yet adopted), "compiling" (queued or under
        way), "undecided" (tiered, before its second call) or "not compiled yet" (wait, before its first)."""
        if self.eager:
            return "failed"
        if self.skipped is not None:
            return "skipped"
        if self.compiled:
            return "eager" if self.use_eager else "compiled"
        if self._ready:
            return "measuring"
        if self._queued:
            return "compiling"
        return "undecided" if self.background else "not compiled yet"

    @property
    def has_compiled(self) -> bool:
        """Whether a compiled version exists (adopted or not): what RegionProcessor.tune can time."""
        return self.compiled or self._ready

    @property
    def settled(self) -> bool:
        """Whether this graph's way of running is final (compiled or eager, by measurement or estimate or
        failure): a CUDA graph captured now would not be outdated by a swap."""
        return self.eager or self.compiled or self.skipped is not None or (not self.background)

    def settle(self, compiled_s: float, eager_s: float, where: str) -> None:
        """Keep the faster of the compiled graph and the eager one, measured `where`."""
        self.timing, self.measured_at = (compiled_s, eager_s), where
        self.compiled, self.use_eager = True, eager_s < compiled_s

    # ------------------------------------------------------------------ calls
    def __call__(self, *xs):
        if self.eager or self.use_eager:
            return self.gm(*xs)
        if self.compiled:
            return self._call_compiled(xs)
        if self.background:
            return self._tiered(xs)
        return self._first_call(xs)

    def _call_compiled(self, xs):
        before = self.variants
        out = self.fn(*xs)
        if self.variants != before and not self._recompile_warned:
            self._recompile_warned = True
            warnings.warn(f"fastpipe: {self.where}: torch.compile recompiled this graph after warm-up "
                          "(inputs changed shape, dtype or device?)", RuntimeWarning, stacklevel=3)
        return out

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
                self._fail(type(e).__name__, " ".join(str(e).split())[:300] or type(e).__name__, e)
                out = self.gm(*xs)
            self.compile_seconds = time.perf_counter() - t
            return out

    def _fail(self, kind: str, reason: str, err: BaseException | None = None) -> None:
        if self.policy == "raise":
            raise CompileError(f"{self.where}: torch.compile failed: {kind}: {reason}") from err
        warnings.warn(f"fastpipe: {self.where}: torch.compile failed ({kind}: {reason}); "
                      f"running this {self.what} eagerly", RuntimeWarning, stacklevel=4)
        self.eager = True

    # ------------------------------------------------------------------ tiered
    def _tiered(self, xs):
        self.calls += 1
        if self._failure is not None:
            kind, reason = self._failure
            self._failure = None
            self._fail(kind, reason)
            return self.gm(*xs)
        if self._ready:
            return self._measured(xs)
        out = self.gm(*xs)
        if self._decided or (self.calls < DECIDED_AT_CALL and not self.decide_now):   # run once: not worth it
            return out
        self._decided = True            # once: the background thread may have finished between two reads above
        if self.device_type == "cpu":
            from fastpipe.runtime.compiling.compile_estimate import not_worth_compiling

            biggest = max((t.numel() * t.element_size() for t in _tensors(out)), default=0)
            self.skipped = not_worth_compiling(self.gm, len(xs) + len(self.constants), biggest)
            if self.skipped is not None:
                self.use_eager = True
                log.info("fastpipe: %s: not compiled: %s", self.where, self.skipped)
                return out
        self._example = (tuple(_arg_meta(x) for x in xs), torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        from fastpipe.runtime.compiling.background_compile import background

        self._queued = background().submit(self)
        if not self._queued:            # the process is exiting: stay eager
            self.skipped = "the process is exiting"
            self.use_eager = True
        return out

    def _measured(self, xs):
        """A call once compiled in the background: on the CPU alternate compiled and eager, timed, until
        MEASURED_CALLS of each; then keep the faster. On a GPU adopt the compiled graph."""
        if self.device_type != "cpu":
            self.compiled = True
            return self._call_compiled(xs)
        from fastpipe.runtime.compiling.background_compile import background

        if background().busy():          # another graph compiling beside: timings would measure that
            return self._call_compiled(xs)
        compiled_s, eager_s = self._samples
        use_compiled = len(compiled_s) <= len(eager_s)
        t = time.perf_counter()
        out = self._call_compiled(xs) if use_compiled else self.gm(*xs)
        (compiled_s if use_compiled else eager_s).append(time.perf_counter() - t)
        if len(compiled_s) >= MEASURED_CALLS and len(eager_s) >= MEASURED_CALLS:
            self.settle(min(compiled_s), min(eager_s), "on real calls")
            log.info("fastpipe: %s: %s", self.where, self.state())
        return out

    def compile_in_background(self) -> None:
        """Compile now, in this thread, on zero-filled stand-ins for the first call's arguments (the
        background compiler's thread, or Session.compile's via finish()). Never twice, never two at once."""
        with self._lock:
            if self._ready or self.compiled or self.eager or self._example is None:
                self._queued = False
                return
            metas, grad, inference = self._example
            args = [_stand_in(m) for m in metas]
            t = time.perf_counter()
            try:
                with torch.inference_mode() if inference else torch.set_grad_enabled(grad):
                    self.fn(*args)
                self._ready = self.variants > 0
            except Exception as e:  # noqa: BLE001 - reported at the next call, by the policy
                self._failure = (type(e).__name__, " ".join(str(e).split())[:300] or type(e).__name__)
            self.compile_seconds = time.perf_counter() - t
            self._queued = False
            if self._ready or self._failure is not None:
                log.info("fastpipe: %s: compiled in the background in %.1f s", self.where, self.compile_seconds)
                return
        # nothing compiled: dynamo ran the function uncompiled while another thread FX-traced (older torch,
        # fastpipe.torch_compat.compiled_calls_beside_fx_tracing): try again later
        self._retries += 1
        if self._retries <= MAX_RETRIES:
            from fastpipe.runtime.compiling.background_compile import background

            time.sleep(0.1)
            self._queued = background().submit(self)
        else:
            self._failure = ("RuntimeError", f"nothing compiled after {MAX_RETRIES} tries (another thread kept "
                                             "FX-tracing)")

    def finish(self) -> None:
        """Tiered: compile now if queued (in this thread), or wait for the background compile under way."""
        if not self.background or self._example is None:
            return
        from fastpipe.runtime.compiling.background_compile import background

        background().take(self)
        self.compile_in_background()
        if self._ready and self.device_type != "cpu":      # on a GPU adopted at once (nothing to measure)
            self.compiled = True


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)


def _arg_meta(x):
    """What a stand-in for argument x needs: its shape, strides, dtype, device and inference-ness."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), tuple(x.stride()), x.dtype, x.device, x.is_inference())
    return ("value", x)


def _stand_in(meta):
    if meta[0] == "value":
        return meta[1]
    _, shape, stride, dtype, device, inference = meta
    with torch.inference_mode(inference):
        return torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()


def compiled_graph(text: str, gm: torch.nn.Module, device: torch.device, where: str, policy: str,
                   background: bool = False) -> CompiledGraph:
    """The compiled graph for `gm` (whose payload is `text`) on `device`: shared with every live caller
    that passed the same text, device, policy and constant objects; made (not yet compiled) otherwise.
    The caller holds it: the cache does not keep it alive."""
    consts = bound_constants(gm)
    key = (payload_key(text), str(device), policy, background, tuple((name, id(obj)) for name, obj in consts))
    with _LOCK:
        cg = _CACHE.get(key)
        if cg is None or len(cg.constants) != len(consts) or any(a is not b for a, (_, b) in zip(cg.constants, consts)):
            cg = CompiledGraph(gm, where, policy, background=background, device=device)
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
