"""Whole-run CUDA-graph capture and replay of a function of named tensors, on one GPU.

    replay = GraphReplay(fn, device, policy="warn")   # fn(inputs: dict) -> dict of outputs
    replay.capture(inputs)      # at load / warm-up: capture fn now (after one eager call if fn never
                                # ran); the capture itself runs nothing; the next call replays
    outs = replay(inputs)       # copies the inputs into the static buffers, replays

Without capture(): call 1 runs eagerly (warm-up: compiles, allocator settles), call 2 captures and
replays, later calls replay. With `ready` set (a callable: the session's tiered compiles), the first
call from the second on at which ready() holds captures: calls before run fn as it stands. A server
captures at warm-up instead (Session.compile / Session.capture),
so no request pays for a capture.

Buffers. Pipeline inputs are copied into static buffers the graph reads. `state` (input -> its
updated output, fastpipe.runtime.binding.state): the state tensors given at capture, when dense on the
device, become the graph's own buffers and their outputs are those buffers, not clones; a caller
passing the same tensors every call (an engine's KV cache) copies nothing. Other tensors are copied
in (and the session writes the outputs back into them); the tensors of the capture call then serve
as the graph's scratch. capture(inputs) again with other state tensors captures anew on them.

Inputs a graph writes in place (`written`, fastpipe.validate.written: the producer's paged KV caches)
have buffers of their own, as other inputs: each replay copies the given tensor in and, after the
replay, the buffer back into it, so the caller's tensor holds the update.

Copies. A replay's copies go in one launch per group of tensors that share a device and a dtype
and are contiguous on both sides (torch._foreach_copy_, as inductor's cudagraph trees copy their
inputs), not one launch per tensor: a decode step with its ids and 16 KV tensors in, its logits
and 16 KV tensors out (bf16) makes 3 copy launches a call, not 35 (`grouped_copies=False` on a
replay: one per tensor, what bench/report_runtime.py compares). A pair of another kind (a host
tensor copied in, a dtype converted, a dtype the one-launch path lacks) is copied alone.

Outputs. Each call's outputs are clones of the graph's static outputs, so they stay valid (and
unchanged) after later calls. `alias_outputs=True` hands out the static outputs themselves: valid
only until the next call of this replay, which overwrites them, and, in a shared pool, until the
next call of any replay of that pool (a later graph's temporaries may sit where they are). State
outputs are the state buffers (the caller's own tensors when captured on them), updated in place
by every call.

Memory pools. `pool=` (a GraphPool) puts the graph into a memory pool shared with other replays'
graphs: what one graph frees at the end of its capture (its temporaries), the graphs captured after
it reuse, so capture the largest first (fastpipe.serving.buckets does). Graphs sharing memory must
never run at the same time; the pool makes sure of it: its replays take turns under one lock, and on
the GPU each waits for the previous one's work when called from another stream. Sessions meant to
run in parallel need pools of their own (the default: a private pool per graph).

Threads. A GraphReplay may be called from several threads: copy-in, replay and copy-out of one call
never interleave with another's (a lock per replay, or the pool's, or the `turns=` it is given: the
cuda processor gives all its replays, one per chunk count, its own Turns, which its eager runs take
too, since they all issue onto the same lane streams). Captures are taken one at a time in the
process (one capture lock), with capture_error_mode="thread_local", so other threads may run other
sessions (eager, or replaying) while one captures. The capture itself
(fastpipe.runtime.cuda.capture) leaves the thread's stream and the allocator as they were when it
fails.

A capture failure follows the compile policy: "warn" keeps running `fn` eagerly, with a warning
naming the reason; "raise" raises CompileError. Never silent; a capture at warm-up fails there.
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from fastpipe.errors import CompileError, InputError
from fastpipe.runtime.cuda.capture import capture
from fastpipe.torch_compat import foreach_copy_

_CAPTURE_LOCK = threading.Lock()         # one capture at a time in the process (torch's rule)


class Turns:
    """Calls that must not overlap: a lock for the host, and per device the event of the last call's
    GPU work, which a call from another stream waits for."""

    def __init__(self):
        self.lock = threading.Lock()
        self._last: dict = {}            # str(device) -> (event, stream) of the last call

    def begin(self, device):
        stream = torch.cuda.current_stream(device)
        last = self._last.get(str(device))
        if last is not None and last[1] != stream:
            stream.wait_event(last[0])
        return stream

    def end(self, device, stream) -> None:
        key = str(device)
        last = self._last.get(key)
        ev = last[0] if last is not None else torch.cuda.Event()
        ev.record(stream)
        self._last[key] = (ev, stream)


class GraphPool:
    """One CUDA-graph memory pool for the graphs of several sessions (the buckets of a serving set),
    replayed one at a time: see the module docstring. The torch handle
    (`torch.cuda.graph_pool_handle()`) is made at the first capture, so a GraphPool costs nothing
    where no graph is captured (the CPU). `graphs`: how many graphs were captured into it."""

    def __init__(self):
        self.turns = Turns()
        self._handle = None
        self.graphs = 0

    def handle(self):
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    def __repr__(self) -> str:
        return f"GraphPool(graphs={self.graphs})"


@dataclass(frozen=True)
class ReplayOptions:
    """The whole-run CUDA graph of the processors that replay one (cuda, region): given in
    RunOptions.processor_options, or as fastpipe.load's keywords of the same names."""
    cuda_graph: bool = True
    """On one GPU: capture the whole run as one CUDA graph and replay it (captured by Session.compile at
    warm-up, else at the second run)."""
    alias_outputs: bool = False
    """A replayed run returns the graph's own output buffers, not clones: no copy out, and no memory for
    the copies, but each output is valid only until the next run of this session (in a shared graph_pool:
    of any session in the pool), which overwrites it. For a caller that consumes each run's outputs
    before the next (the serving engine's buckets). State outputs are the state buffers either way."""
    graph_pool: GraphPool | None = None
    """The CUDA graph shares this memory pool with the other sessions' graphs in it (a serving set's
    buckets: capture the largest first). Their replays take turns (one lock), so give sessions meant to
    run in parallel pools of their own. None: a private pool."""

    def __post_init__(self):
        for name in ("cuda_graph", "alias_outputs"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name}: expected true or false, found {getattr(self, name)!r}")
        if self.graph_pool is not None and not isinstance(self.graph_pool, GraphPool):
            raise InputError(f"graph_pool: expected a fastpipe.runtime.cuda.graph_replay.GraphPool or None, found "
                             f"{type(self.graph_pool).__name__}")


class GraphReplay:
    def __init__(self, fn: Callable[[dict], dict], device: torch.device, *, policy: str = "warn",
                 alias_outputs: bool = False, state: Mapping[str, str] | None = None,
                 pool: GraphPool | None = None, turns: Turns | None = None, written=()):
        self.fn, self.device, self.policy, self.alias_outputs = fn, device, policy, alias_outputs
        self.state = dict(state or {})
        self.written = frozenset(written)   # inputs the graph writes in place: copied back after each replay
        self._state_outputs = frozenset(self.state.values())
        self.enabled = True
        # whether fn is final (tiered compiles: every graph compiled or settled on eager): a call captures
        # only then, so that no graph is captured around an eager region about to be swapped out
        self.ready: Callable[[], bool] | None = None
        self.grouped_copies = True      # copies in and out: one launch per (device, dtype) group (copy_grouped)
        self.calls = 0                  # calls, capture() included
        self.replays = 0                # graph replays (the capture's own replay in call 2 included)
        self.captures = 0               # graphs captured (more than 1: recaptured on other state tensors)
        self.failure: str | None = None  # why the capture failed ("warn": running eagerly since)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_in: dict[str, torch.Tensor] = {}
        self.static_out: dict[str, torch.Tensor] = {}
        self.pool: GraphPool | None = None
        self._turns = turns if turns is not None else Turns()     # shared with whatever must not overlap it
        if pool is not None:
            self.use_pool(pool)

    @property
    def replaying(self) -> bool:
        return self.graph is not None

    def use_pool(self, pool: GraphPool) -> None:
        """Capture into `pool` (shared with its other replays, taking turns with them). Before the capture."""
        if not isinstance(pool, GraphPool):
            raise TypeError(f"pool: expected a GraphPool, found {type(pool).__name__}")
        if self.graph is not None and pool is not self.pool:
            raise ValueError("pool: expected it before the capture, found a graph captured already")
        self.pool, self._turns = pool, pool.turns

    # ------------------------------------------------------------------ calls
    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> dict:
        if self.graph is None and not self.enabled:       # capture failed ("warn"): eager, nothing shared
            self.calls += 1
            return self.fn(dict(inputs))
        with self._turns.lock:
            self.calls += 1
            if self.graph is not None:
                return self._replay(inputs)
            if self.enabled and self.calls >= 2 and (self.ready is None or self.ready()):
                if self._try_capture(inputs, stacklevel=4):
                    return self._replay(inputs)
            return self.fn(dict(inputs))

    def capture(self, inputs: Mapping[str, torch.Tensor]) -> bool:
        """Capture fn on `inputs` now (a server's warm-up), so that the next call replays. The capture
        runs nothing; fn must have run eagerly once before (compiles, allocator settles): if it never
        ran, it runs once on `inputs` first (updating their state tensors). The state tensors of
        `inputs` become the graph's buffers; a graph held already is kept when they are its buffers,
        else captured anew. Returns whether a graph is held; a failure follows the policy (a
        RuntimeWarning naming the reason, or CompileError), here."""
        with self._turns.lock:
            if not self.enabled:
                return False
            if self.graph is not None and self.captured_on(inputs):
                return True
            self.calls += 1
            if self.calls == 1:
                self.fn(dict(inputs))
            return self._try_capture(inputs, stacklevel=3)

    def captured_on(self, inputs: Mapping[str, torch.Tensor]) -> bool:
        """Whether the graph's state buffers are the state tensors of `inputs` (nothing to copy in)."""
        return self.graph is not None and all(self.static_in.get(n) is t for n, t in inputs.items() if n in self.state)

    # ------------------------------------------------------------------ inside
    def _try_capture(self, inputs, *, stacklevel: int) -> bool:
        try:
            self._capture(inputs)
            return True
        except CompileError:
            raise
        except Exception as e:  # noqa: BLE001 - reported with its reason, per policy
            self.graph, self.static_in, self.static_out = None, {}, {}
            reason = " ".join(str(e).split())[:300]
            self.failure = f"{type(e).__name__}: {reason}"
            if self.policy == "raise":
                raise CompileError(f"CUDA-graph capture failed: {self.failure}") from e
            warnings.warn(f"fastpipe: CUDA-graph capture failed ({self.failure}); running without a graph",
                          RuntimeWarning, stacklevel=stacklevel)
            self.enabled = False
            return False

    def _capture(self, inputs) -> None:
        self.graph, self.static_in, self.static_out = None, {}, {}     # a recapture lets the old graph go
        with torch.inference_mode(False):       # normal tensors, as warm-up's device copies (inputs.to_device)
            static_in = {n: t if n in self.state and t.device == self.device and t.is_contiguous()
                         else t.to(self.device).clone() for n, t in inputs.items()}
        pool = None if self.pool is None else self.pool.handle()
        with _CAPTURE_LOCK:
            g, static_out = capture(lambda: dict(self.fn(dict(static_in))), self.device, pool)
        self.graph, self.static_in, self.static_out = g, static_in, static_out
        self.captures += 1
        if self.pool is not None:
            self.pool.graphs += 1

    def _replay(self, inputs) -> dict:
        stream = self._turns.begin(self.device)
        pairs = [(buf, t) for n, t in inputs.items() if (buf := self.static_in[n]) is not t]
        if self.grouped_copies:
            copy_grouped([b for b, _ in pairs], [t for _, t in pairs])
        else:
            for buf, t in pairs:
                buf.copy_(t, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        back = [(t, buf) for n, t in inputs.items() if n in self.written and (buf := self.static_in[n]) is not t]
        if back:            # what the graph wrote into its own buffer belongs in the caller's tensor
            copy_grouped([t for t, _ in back], [b for _, b in back])
        out = self._outputs()
        self._turns.end(self.device, stream)
        return out

    def _outputs(self) -> dict:
        out = self.static_out
        if self.alias_outputs:
            return dict(out)
        if not self.grouped_copies:
            return {n: t if n in self._state_outputs else t.clone() for n, t in out.items()}
        fresh = {n: t if n in self._state_outputs else torch.empty_like(t) for n, t in out.items()}
        cloned = [n for n in out if n not in self._state_outputs]
        copy_grouped([fresh[n] for n in cloned], [out[n] for n in cloned])
        return fresh


# dtypes the one-launch CUDA path of torch._foreach_copy_ takes (torch 2.11-2.13): the others (uint16/32/64,
# complex32, float8_e8m0fnu, float4) raise NotImplementedError there once every tensor is dense; they copy alone
FOREACH_COPY_DTYPES = frozenset(getattr(torch, n) for n in (
    "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool", "complex64",
    "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))


def copy_grouped(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i], non_blocking=True) for every i: one torch._foreach_copy_ (torch_compat.foreach_copy_)
    per group of pairs on one device with one dtype of FOREACH_COPY_DTYPES, the same shape and both sides contiguous
    (its one-launch path on CUDA); any other pair (a host tensor to the device, a dtype conversion, a strided view,
    a dtype that path lacks) by its own copy_."""
    groups: dict[tuple, tuple[list, list]] = {}
    for d, s in zip(dst, src):
        if d.device == s.device and d.dtype == s.dtype and d.dtype in FOREACH_COPY_DTYPES and d.shape == s.shape \
                and d.is_contiguous() and s.is_contiguous():
            ds, ss = groups.setdefault((d.device, d.dtype), ([], []))
            ds.append(d)
            ss.append(s)
        else:
            d.copy_(s, non_blocking=True)
    for ds, ss in groups.values():
        if len(ds) == 1:
            ds[0].copy_(ss[0], non_blocking=True)
        else:
            foreach_copy_(ds, ss, non_blocking=True)
