"""What every processor is: the class the session's flow asks at each step, and the defaults.

    cls = processor_class(name)                          # fastpipe.runtime.processors.registry
    placement = cls.place(pipeline, slot_devices, run_options)     # before binding: devices, slots, fusion
    program = cls.passes(bind(...), placement)           # its own passes over the bound Program
    processor = cls.prepare(program, prepared)           # after the checker: ready to run
    outputs = processor.call(inputs, chunks=1, trace=None)          # Session.run
    outputs = processor.run(parts, trace=events)         # one dict of tensors per micro-batch -> one per part

A processor declares, as class attributes, what the flow does for it (whether the binder compiles each
step, folds batched GEMMs, writes state in place; whether regions are cut; how compile="background"
applies) and the option dataclasses it reads (`options`: their instances come in
RunOptions.processor_options). Everything else it needs it takes from `Prepared`. The defaults here are
the plain ones: no CUDA graph, nothing to tune, the plan's memory, one trace lane per slot.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch


@dataclass
class Placement:
    """What a processor decides before binding: where each slot runs, which slots this process binds,
    and the fusion policy in force (with the reason when the processor turns it off)."""
    slot_devices: dict                    # slot -> torch.device
    fuse: str                             # RunOptions.fuse, or "off"
    fuse_off_reason: str
    local_slots: tuple | None = None      # the slots bound in this process (None: every slot)
    detail: Any = None                    # the processor's own plan (the dist processor's RankPlan)


@dataclass
class Prepared:
    """What the flow made, handed to Processor.prepare."""
    pipeline: Any                          # fastpipe.format.Pipeline
    checked: Any                           # fastpipe.validate.Checked
    store: Any                             # the WeightStore
    run_options: Any                       # fastpipe.options.RunOptions
    placement: Placement
    fusion: tuple                          # fastpipe.runtime.passes.fuse decisions
    state: Mapping[str, str]               # state_in_place pairs: input -> its updated output ({} when off)
    compiles: bool                         # graphs go through torch.compile
    background: bool                       # ... tiered, in the background
    step_graphs: Mapping = field(default_factory=dict)   # supertask id -> CompiledGraph (the binder's)
    index_bounds: Mapping = field(default_factory=dict)  # integer inputs used as indices -> their range
    steps_write: frozenset = frozenset()   # state outputs a bound step writes into its input tensor
    written: Mapping[str, str] = field(default_factory=dict)   # inputs a graph writes in place -> its supertask


class Processor:
    """The base of every processor. Subclasses implement run() and, where they have them, override the
    rest; the flow reads the class attributes below (never the processor's name)."""

    name: ClassVar[str] = ""
    options: ClassVar[tuple[type, ...]] = ()
    """The option dataclasses this processor reads (instances given in RunOptions.processor_options)."""
    cuts_regions: ClassVar[bool] = False
    """Steps are cut into one-device regions and each is stitched into one graph (fusion sees regions)."""
    compiles_steps: ClassVar[bool] = True
    """The binder compiles each fx step (False: the processor compiles graphs of its own)."""
    folds_gemms: ClassVar[bool] = False
    """The binder folds batched linears into one mm in each compiled step (fastpipe.runtime.binding.gemm_layout)."""
    writes_state_in_steps: ClassVar[bool] = False
    """With state_in_place, the bound steps write state into the input tensors where they can."""
    background_compile: ClassVar[str] = "tiered"
    """What compile="background" means here: "tiered" (eager first, compiled in the background and
    swapped in), "warm-up" (compiled at the first run, every process together), "eager" (not at all:
    the oracle; compile="wait" still compiles)."""

    one_process_per_rank: ClassVar[bool] = False
    """Runs as one process per rank, launched by torchrun (`fastpipe run --nproc N` launches it)."""

    prepared: Prepared | None = None

    # ------------------------------------------------------------------ the flow
    @classmethod
    def place(cls, pipeline, slot_devices: dict, run_options) -> Placement:
        """Before binding: where the slots run and what is fused (default: as resolved and as asked)."""
        from fastpipe.runtime.passes import fuse

        return Placement(dict(slot_devices), run_options.fuse, fuse.FUSION_OFF)

    @classmethod
    def passes(cls, program, placement: Placement):
        """Rewrite the bound Program before the checker proves it (default: as it is)."""
        return program

    @classmethod
    def prepare(cls, program, prepared: Prepared) -> "Processor":
        """The processor for a bound, checked Program (default: cls(program))."""
        return cls(program).attach(prepared)

    def attach(self, prepared: Prepared) -> "Processor":
        """Keep what the flow made; with tiered compiles, no CUDA graph is captured around a graph about
        to be swapped (gate_replays). Returns self."""
        self.prepared = prepared
        self._reader_devices = self.program.input_devices()     # input -> the device its readers take it on
        if prepared.background:
            from fastpipe.runtime.binding.release import weak_method

            self.gate_replays(weak_method(self.compile_settled))
        return self

    # ------------------------------------------------------------------ running
    def run(self, parts: list[dict], *, trace: list | None = None) -> list[dict]:
        """Run once per part (micro-batch: one dict of named tensors each); one dict of outputs per part.
        `trace`: a list to append (lane, label, start s, end s, chunk) events to."""
        raise NotImplementedError

    def call(self, inputs: Mapping[str, torch.Tensor], *, chunks: int = 1, trace=None) -> dict:
        """Session.run: check the inputs, split them into `chunks` micro-batches, run, write the trace
        (a path), and join the outputs back along dim 0."""
        p = self.prepared
        pipeline, devices = p.pipeline, self._reader_devices
        events: list | None = [] if trace is not None else None
        if chunks == 1:
            from fastpipe.runtime.binding.inputs import check_inputs

            check_inputs(pipeline, inputs, devices)
            if p.state or p.written:
                from fastpipe.runtime.binding.state import check_state_inputs

                check_state_inputs(inputs, {**p.state, **p.written})
            parts = [inputs]
        else:
            from fastpipe.runtime.binding.microbatch import check_chunked_inputs, split_chunks

            parts = split_chunks(inputs, chunks, check_chunked_inputs(pipeline, inputs, chunks, devices))
        if p.index_bounds:        # indices out of range (CPU inputs): an InputError, not a failed or aborted kernel
            from fastpipe.runtime.binding.index_bounds import check_index_bounds

            check_index_bounds(inputs, p.index_bounds)
        back = ()
        if p.written:           # the caller's tensors, or copies where the graphs read them, written back below
            from fastpipe.runtime.binding.state import working_inputs

            parts[0], back = working_inputs(inputs, p.written, devices, chunks)
        results = self.run(parts, trace=events)
        for given, work in back:
            given.copy_(work)
        if trace is not None:
            from fastpipe.runtime.trace import write_chrome_trace

            write_chrome_trace(trace, events, self.trace_lanes())
        if chunks == 1:
            return results[0]
        return {n: torch.cat([r[n] for r in results], dim=0) for n in pipeline.output_names}

    def outputs_here(self) -> bool:
        """Whether call() returns the outputs in this process (the dist processor: rank 0 only)."""
        return True

    # ------------------------------------------------------------------ compiling
    def compiled_graphs(self) -> dict:
        """What this processor compiles: supertask id (or region name) -> CompiledGraph."""
        return dict(self.prepared.step_graphs) if self.prepared is not None else {}

    def compile_settled(self) -> bool:
        """Every graph compiled here settled (compiled and adopted, or eager by estimate, measurement or failure)."""
        return all(cg.settled for cg in self.compiled_graphs().values())

    def warms_up(self) -> bool:
        """Whether the first run compiles first (Session.compile) when compile is on and not tiered."""
        return self.background_compile == "warm-up" or bool(self.compiled_graphs())

    def tune(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """After the warm-up compile, choose between compiled and eager per graph where that pays (default: nothing)."""

    # ------------------------------------------------------------------ CUDA graphs
    def graph_replays(self) -> list:
        """The whole-run CUDA-graph replays this processor holds (fastpipe.runtime.cuda.graph_replay.GraphReplay)."""
        return []

    def gate_replays(self, ready) -> None:
        """Capture only once ready() (every compile settled)."""
        for r in self.graph_replays():
            r.ready = ready

    def capture(self, inputs: Mapping[str, torch.Tensor]) -> bool:
        """Capture the whole run's CUDA graph now, on one run's inputs; whether a graph is held."""
        replays = self.graph_replays()
        if not replays:
            return False
        with torch.inference_mode():
            return all([r.capture(inputs) for r in replays])

    # ------------------------------------------------------------------ reporting
    def written_in_place(self) -> frozenset:
        """State outputs written into the caller's tensors without a copy (they count no memory)."""
        return self.prepared.steps_write if self.prepared is not None else frozenset()

    def describe(self) -> str:
        """How it runs, in a few words (Session.describe puts "<name> processor (...)" around it)."""
        p, parts = self.prepared, []
        if p is not None and p.compiles and self.compiled_graphs():
            parts.append(f"graphs: {compile_state(self.compiled_graphs())}")
        if p is not None and p.state and self.writes_state_in_steps:
            parts.append(f"{len(p.state)} state tensors updated in place ({len(p.steps_write)} by an in-place write)")
        return ", ".join(parts)

    def memory_report(self, peak: Mapping[str, int] | None = None) -> dict[str, dict]:
        """Per device: the plan's predicted peak (fastpipe.runtime.cuda.stream_issue.planned_memory);
        `peak`: per slot, the intermediates alive at once, in place of program.peak_bytes."""
        from fastpipe.runtime.cuda.stream_issue import planned_memory

        devices = self.prepared.placement.slot_devices
        return planned_memory(self.program, {s: devices[s] for s in self.program.slots if self.program.steps[s]}, peak)

    def trace_lanes(self):
        """The trace's lanes: one per slot (or a dict lane -> its title)."""
        return tuple(self.prepared.pipeline.devices)

    def close(self) -> None:
        """Let go of what outlives a session by itself (process groups); default: nothing."""


def compile_state(compiled: Mapping) -> str:
    """Where compiles stand, in a phrase: how many graphs are compiled, compiling, measured faster
    eagerly, skipped by the estimate or failed."""
    graphs = {id(cg): cg for cg in compiled.values()}.values()
    if not graphs:
        return "nothing to compile"
    label = {"skipped": "skipped (cannot pay)", "eager": "eager (measured faster)",
             "compiling": "compiling in the background", "undecided": "not run yet", "not compiled yet": "not run yet"}
    counts: dict[str, int] = {}
    for cg in graphs:
        key = label.get(cg.stage, cg.stage)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in counts.items())

