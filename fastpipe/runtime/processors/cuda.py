"""The CUDA processor: runs a bound Program with a stream per slot, events for cross-slot waits,
whole-run CUDA-graph replay.

One host thread issues the whole run, every micro-batch, onto the slots' streams
(fastpipe.runtime.cuda.stream_issue: the order, the waits, the frees and the trace are decided there,
the same code the CPU tests drive through its host backend):
  * fork: every slot stream waits for the caller's current stream on every device involved;
    join: the caller's current stream on every device waits for every slot stream;
  * compute step: runs on its slot's stream (several slots may share one GPU and overlap);
  * comm group: runs once on its first member's stream, after every member's previous step
    (events); the plain-torch comm runs there (device copies / reductions; between GPUs of one
    process, peer copies); every other member stream waits for its completion event;
  * chunks=k: the k micro-batches are issued in one pass (fastpipe.lower.simulate over the Program
    unrolled k times), each with its own environment and no join between them, so stage s runs
    micro-batch c+1 while stage s+1 runs micro-batch c (fill-drain);
  * intermediates are dropped as the Program's `frees` say, right after their last step is issued;
    tensors used on another stream than the one that made them are `record_stream`-ed so the
    caching allocator does not reuse them early;
  * no host synchronisation inside a run (a traced run synchronizes once, at its end, to read
    its CUDA events); everything runs under torch.inference_mode.
With cuda_graph=True (slots on one GPU) the whole run, all k micro-batches, is captured and
replayed by fastpipe.runtime.cuda.graph_replay, one graph per number of chunks: Session.compile()
captures at warm-up (`replay.capture(inputs)`: the graph exists before the first real run);
otherwise the first call runs eagerly (compiles, allocator settles) and the second captures the
whole run into one CUDA graph (side streams forked from and joined back to the capture stream).
Later calls copy the inputs into its static buffers and replay it. A capture failure follows the compile policy:
"warn" continues eagerly with a warning naming the reason; "raise" raises CompileError. Outputs
are cloned out of the graph's static buffers unless `alias_outputs=True`.

A run with a trace is issued eagerly, not replayed: its steps are timed by CUDA events recorded
between them on their streams, and a replayed graph has no such points to read (a one-time
RuntimeWarning says so when a graph would otherwise have run).

memory_report(): per device, the allocator's measured peak since construction (or
reset_peak_memory()) next to the plan's predicted peak.
"""
from __future__ import annotations

import functools
import warnings
from typing import Mapping

import torch

from fastpipe.errors import InputError
from fastpipe.lower.program import Program
from fastpipe.runtime.cuda.graph_replay import GraphReplay, ReplayOptions, Turns
from fastpipe.runtime.processors.base import Placement, Prepared, Processor
from fastpipe.runtime.binding.release import weak_method
from fastpipe.runtime.cuda.stream_issue import (
    CudaBackend,
    LaneRunner,
    flatten_chunks,
    format_memory_report,
    planned_memory,
    unflatten_chunks,
)


def check_cuda_devices(slot_devices) -> None:
    """Every slot on a CUDA device, or InputError naming the first that is not."""
    if not torch.cuda.is_available():
        raise InputError("processor: expected CUDA for processor \"cuda\", found none (use processor \"cpu\")")
    bad = [s for s, d in slot_devices.items() if d.type != "cuda"]
    if bad:
        raise InputError(f"device_map[\"{bad[0]}\"]: expected a cuda device for processor \"cuda\", "
                         f"found {slot_devices[bad[0]]}")


class CudaProcessor(Processor):
    name = "cuda"
    options = (ReplayOptions,)
    folds_gemms = True
    writes_state_in_steps = True

    @classmethod
    def place(cls, pipeline, slot_devices: dict, run_options) -> Placement:
        check_cuda_devices(slot_devices)
        return super().place(pipeline, slot_devices, run_options)

    @classmethod
    def prepare(cls, program: Program, prepared: Prepared) -> "CudaProcessor":
        ro = prepared.run_options
        replay = ro.of(ReplayOptions)
        proc = cls(program, cuda_graph=replay.cuda_graph, compile_policy=ro.compile_policy,
                   alias_outputs=replay.alias_outputs, state=prepared.state, written=prepared.written)
        if replay.graph_pool is not None:
            proc.use_pool(replay.graph_pool)               # every chunk count's graph
        return proc.attach(prepared)

    def __init__(self, program: Program, *, cuda_graph: bool = True, compile_policy: str = "warn",
                 alias_outputs: bool = False, state=None, written=None):
        slot_devices = {slot: program.steps[slot][0].device for slot in program.slots if program.steps[slot]}
        check_cuda_devices(slot_devices)
        self.program = program
        self.slot_devices = slot_devices
        self.runner = LaneRunner(program, CudaBackend(), slot_devices)
        self.streams = self.runner.lanes                      # slot -> its torch.cuda.Stream
        self.devices = tuple(self.runner.devices)
        self.written = frozenset(written or ())     # inputs a graph writes in place: copied back after a replay
        self.use_graph = cuda_graph and len(self.devices) == 1
        if cuda_graph and len(self.devices) > 1:
            warnings.warn("fastpipe: CUDA-graph capture is per device; slots span "
                          f"{len(self.devices)} GPUs, so this run is issued eagerly on streams", RuntimeWarning, stacklevel=3)
        self.device = self.devices[0]
        self.compile_policy, self.alias_outputs = compile_policy, alias_outputs
        self.state = dict(state or {})     # state_in_place pairs: one-chunk runs capture on the caller's state tensors
        self.replays: dict[int, GraphReplay] = {}              # chunks -> the replay of a k-chunk run
        self.graph_pool = None                                 # use_pool(): every replay's memory pool
        self.replay_ready = None                               # GraphReplay.ready of every replay (tiered compiles)
        # every replay and every eager run issues onto the same lanes: one at a time (a capture would
        # record another thread's eager work on a lane; the pool's turns once there is a pool)
        self.turns = Turns()
        self._warned_trace = False
        self.reset_peak_memory()

    @property
    def replay(self) -> GraphReplay | None:
        """The replay of one-chunk runs (None without graphs)."""
        return self._replay(1) if self.use_graph else None

    @property
    def graph(self):
        """The captured CUDA graph of one-chunk runs (None before the capture, or without one)."""
        r = self.replays.get(1)
        return None if r is None else r.graph

    def _replay(self, chunks: int) -> GraphReplay:
        r = self.replays.get(chunks)
        if r is None:
            whole_run = functools.partial(weak_method(self._whole_run), chunks=chunks)   # no cycle: see release
            r = self.replays[chunks] = GraphReplay(whole_run, self.device, policy=self.compile_policy,
                                                   alias_outputs=self.alias_outputs, turns=self.turns,
                                                   state=self.state if chunks == 1 else None, written=self.written)
            if self.graph_pool is not None:
                r.use_pool(self.graph_pool)
            r.ready = self.replay_ready
        return r

    def _whole_run(self, flat: dict, *, chunks: int) -> dict:
        """A k-chunk run on flat inputs (what its GraphReplay captures)."""
        return flatten_chunks(self.runner.run(unflatten_chunks(flat, chunks)))

    def use_pool(self, pool) -> None:
        """Capture every graph of this processor (one per chunk count, made and to be made) into
        `pool` (a fastpipe.runtime.cuda.graph_replay.GraphPool: GraphReplay.use_pool); they take turns."""
        self.graph_pool, self.turns = pool, pool.turns
        for r in self.replays.values():
            r.use_pool(pool)

    # ------------------------------------------------------------------ public
    def run(self, parts: list[dict], *, trace: list | None = None) -> list[dict]:
        """`parts`: one dict of named tensors per micro-batch, issued in one pass (fill-drain) or
        replayed as one graph per number of parts. Returns a list with each micro-batch's outputs."""
        parts = list(parts)
        if trace is not None or not self.use_graph:
            if trace is not None and self.use_graph and not self._warned_trace:
                self._warned_trace = True
                warnings.warn("fastpipe: a traced run is issued eagerly on streams, not replayed as a CUDA graph "
                              "(its steps are timed by CUDA events between them, which a replayed graph does not "
                              "have); its times are those of eager issue", RuntimeWarning, stacklevel=3)
            with self.turns.lock:
                return self.runner.run(parts, trace=trace)
        with torch.inference_mode():   # the replay's input copies and output clones too
            return unflatten_chunks(self._replay(len(parts))(flatten_chunks(parts)), len(parts))

    def chunk_order(self, chunks: int) -> list[tuple[str, int, int]]:
        """(slot, step index, chunk) in the order a k-chunk run issues them."""
        return self.runner.chunk_order(chunks)

    def graph_replays(self) -> list:
        return [self.replay] if self.use_graph else []

    def gate_replays(self, ready) -> None:
        self.replay_ready = ready                              # every chunk count's replay, made and to be made
        for r in self.replays.values():
            r.ready = ready

    def describe(self) -> str:
        """How it runs, in a few words (e.g. for Session.describe)."""
        failed = next((r.failure for r in self.replays.values() if r.failure is not None), None)
        how = ("issued eagerly on streams" if not self.use_graph
               else f"CUDA-graph capture failed ({failed}): issued eagerly on streams" if failed is not None
               else f"replayed as one CUDA graph per chunk count on {self.device}")
        more = super().describe()
        return f"{len(self.streams)} streams on {', '.join(map(str, self.devices))}; {how}" + (f", {more}" if more else "")

    # ------------------------------------------------------------------ memory
    def reset_peak_memory(self) -> None:
        """Start measuring peak memory afresh on every device of this processor
        (torch.cuda.reset_peak_memory_stats; it is the device's, shared with whatever else runs there)."""
        for d in self.devices:
            torch.cuda.reset_peak_memory_stats(d)

    def memory_report(self, peak: Mapping[str, int] | None = None) -> dict[str, dict]:
        """Per device (str): {"slots", "measured_peak_bytes" (torch.cuda.max_memory_allocated since the
        construction or reset_peak_memory(): every tensor of this process on that device counts, the
        caller's inputs included; a replay allocates nothing, so a peak taken over replays counts the
        graph's live buffers but not the intermediates inside its pool, which the capture itself
        allocated: torch.cuda.memory_reserved shows those), "predicted_peak_bytes" (the plan: the
        sum of program.peak_bytes, one micro-batch's intermediates, and constant_bytes of the slots
        there; `peak`: per slot, in place of program.peak_bytes, as Session.memory_report gives it), "activation_bytes",
        "constant_bytes"}. format_memory_report(report) prints it."""
        report = planned_memory(self.program, self.slot_devices, peak)
        for d in self.devices:
            report[str(d)]["measured_peak_bytes"] = torch.cuda.max_memory_allocated(d)
        return report

    def format_memory_report(self) -> list[str]:
        return format_memory_report(self.memory_report())
