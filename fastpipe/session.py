"""fastpipe.load(...) -> Session; Session.run(inputs) -> outputs.

Loading validates everything first (structure, payloads, param-file headers), then:

    program = lower(checked)                       # per-slot steps, waits, frees (pure data)
    program = bind(program, checked, binder)       # devices, constants, callables
    program = fuse.apply(program, decisions, ...)  # passes rewrite the Program ...
    program = with_regions(program, device_of)     # (region processor) steps cut into one-device regions
    check_program(program, checked)                # ... before the checker proves it
    processor = <Reference|Region|Threaded|Cuda|Dist>Processor(program, ...)

`session.program` is that bound, checked Program: what the processor runs and what
`fastpipe show --plan` prints.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch

from fastpipe.format import Pipeline, read_pipeline
from fastpipe.errors import InputError
from fastpipe.lower import check_program, lower, with_regions
from fastpipe.options import LoadOptions, RunOptions, choose_processor
from fastpipe.runtime.passes import fuse as fusion
from fastpipe.runtime.binding.bind import Binder, bind
from fastpipe.runtime.binding.device_map import resolve_device_map
from fastpipe.runtime.cuda.graph_replay import GraphReplay
from fastpipe.runtime.binding.inputs import check_inputs
from fastpipe.runtime.processors.reference import ReferenceProcessor
from fastpipe.validate import Checked, validate
from fastpipe.weights import WeightStore, default_store


class Session:
    """A loaded pipeline, ready to run. Not thread-safe: use one per thread, or serialise calls.

    `run_options` (fastpipe.options.RunOptions) choose the processor: "reference" (one step at
    a time, the oracle), "region" (every device's steps and the comm between them as one graph,
    compiled with compile=True, fastpipe.runtime.processors.region), "cpu" (a thread per slot,
    fastpipe.runtime.processors.cpu), "cuda" (a
    stream per slot, CUDA-graph replay), "dist" (one process per rank under torchrun,
    fastpipe.runtime.processors.dist: run() on every rank returns the outputs on rank 0 and {}
    elsewhere) or "auto" (choose_processor); whether fx supertasks are compiled, and the fusion
    policy (decisions with reasons in `session.fusion`, fastpipe.runtime.passes.fuse).
    """

    def __init__(self, pipeline: Pipeline, *, device_map: Mapping[str, str] | None = None,
                 load_options: LoadOptions | None = None, run_options: RunOptions | None = None,
                 store: WeightStore | None = None):
        self.options = load_options or LoadOptions()
        self.run_options = opts = run_options or RunOptions()
        if opts.compile != "off":       # before anything reads inductor's cache folder (validation can)
            from fastpipe.runtime.compiling.compile_cache import use_persistent_cache

            use_persistent_cache()
        self.store = store or default_store()
        self.checked: Checked = validate(pipeline, self.options, self.store)
        from fastpipe.runtime.binding.index_bounds import index_bounds

        self.index_bounds = index_bounds(pipeline, self.checked.graphs)   # integer inputs used as indices -> range
        self.pipeline = pipeline
        self.slot_devices = resolve_device_map(pipeline, device_map)
        self.processor = choose_processor(opts.processor, self.slot_devices)
        fuse, local, off_reason = opts.fuse, None, fusion.FUSION_OFF
        self.rank_plan = None                     # dist: which rank runs which slot (dist_setup.RankPlan)
        if self.processor == "dist":
            from fastpipe.runtime.processors.dist_setup import make_plan

            fusion.check_fuse_for_dist(opts.fuse)
            self.rank_plan = make_plan(pipeline, self.slot_devices, opts.slot_ranks)
            self.slot_devices, fuse, off_reason = self.rank_plan.slot_devices, "off", fusion.DIST_OFF
            local = self.rank_plan.local_slots
        elif opts.slot_ranks is not None:
            raise InputError(f"slot_ranks: expected processor=\"dist\", found processor=\"{self.processor}\"")
        if self.processor == "cuda":
            from fastpipe.runtime.processors.cuda import check_cuda_devices

            check_cuda_devices(self.slot_devices)
        region = self.processor == "region"
        from fastpipe.runtime.binding.state import state_pairs

        self.state = state_pairs(pipeline)       # input -> its updated output (fastpipe.runtime.binding.state)
        self._in_place = self.state if opts.state_in_place else {}
        # compile: "background" is tiered (fastpipe.runtime.compiling.compile); the dist processor's ranks compile at
        # warm-up together instead
        # (the reference processor, the oracle, stays eager unless asked for "wait": nothing swapped under it)
        self.compiles = opts.compile == "wait" or (opts.compile == "background" and self.processor != "reference")
        self.background = self.compiles and opts.compile == "background" and self.processor != "dist"
        # the region processor compiles whole regions; its steps stay eager (for locating failures)
        self._binder = Binder(pipeline, self.options, self.store, self.slot_devices,
                              compile=self.compiles and not region, compile_policy=opts.compile_policy,
                              background=self.background, fold_gemms=self.processor in ("cpu", "cuda", "dist"))
        # the cpu and cuda processors' steps write state in place where they can (bind); the region
        # processor rewrites its stitched graphs, the reference runs the graphs as the file has them
        steps_in_place = self._in_place if self.processor in ("cpu", "cuda") else None
        program = bind(lower(self.checked), self.checked, self._binder, local, in_place=steps_in_place)
        self.fusion = fusion.analyze(self.checked, self.slot_devices, fuse, region=region, off_reason=off_reason)
        program = fusion.apply(program, self.fusion, self.checked, self._binder)
        if region:
            program = with_regions(program, {s: str(d) for s, d in self.slot_devices.items()})
        check_program(program, self.checked)
        self.program = program
        self._input_devices = program.input_devices()
        from fastpipe.runtime.binding.bind import state_written

        # state outputs a step writes into its input tensor (cpu, cuda: fastpipe.runtime.binding.bind; region: its own)
        self._steps_write = state_written(program, steps_in_place) if steps_in_place else frozenset()
        self.compile_report = None
        self._nothing_to_compile = False
        self._binder.forget_constants()          # the steps hold their constants: the region processor's
        self._processor = self._make_processor()  # merges then free each group's shards (region_passes)
        if self.background:                      # no CUDA graph around a graph about to be swapped
            if self.processor == "cuda":
                self._processor.replay_ready = self.compile_settled
            for r in self._graph_replays():
                r.ready = self.compile_settled

    def _make_processor(self):
        opts = self.run_options
        if self.processor == "cpu":
            from fastpipe.runtime.processors.cpu import ThreadedProcessor

            return ThreadedProcessor(self.program)
        if self.processor == "cuda":
            from fastpipe.runtime.processors.cuda import CudaProcessor

            proc = CudaProcessor(self.program, cuda_graph=opts.cuda_graph, compile_policy=opts.compile_policy,
                                 alias_outputs=opts.alias_outputs, state=self._in_place)
            if opts.graph_pool is not None:
                proc.use_pool(opts.graph_pool)               # every chunk count's graph
            return proc
        if self.processor == "dist":
            from fastpipe.runtime.processors.dist import DistProcessor

            return DistProcessor(self.program, self.checked, self.rank_plan, timeout_s=opts.dist_timeout)
        if self.processor == "region":
            from fastpipe.runtime.processors.region import RegionProcessor

            return RegionProcessor(self.program, self.checked.groups, compile=self.compiles,
                                   compile_policy=opts.compile_policy, background=self.background,
                                   cuda_graph=opts.cuda_graph,
                                   merge_shards=opts.merge_shards,
                                   opaque_groups={d.group for d in self.fusion if d.fused}, state=self._in_place,
                                   graph_pool=opts.graph_pool, alias_outputs=opts.alias_outputs,
                                   substitute=self.store.substitute)
        return ReferenceProcessor(self.program)

    def _compiled(self) -> dict:
        """What this session compiles: supertask id (or region name) -> CompiledGraph."""
        if self.processor == "region":
            return self._processor.compiled_graphs()
        return self._binder.compiled

    def compile_settled(self) -> bool:
        """Whether every graph this session compiles has settled (compiled and adopted, or eager by the
        estimate, by measurement or after a failure): nothing is queued, compiling or being measured."""
        return all(cg.settled for cg in self._compiled().values())

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Tiered compiles: block until the background compiler has compiled every graph this session has
        queued (not until each is measured: that takes real calls). True when none is left pending."""
        import time

        from fastpipe.runtime.compiling.background_compile import background

        end = None if timeout is None else time.monotonic() + timeout
        for cg in self._compiled().values():
            while cg.stage == "compiling":
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                background().wait_idle(0.05 if left is None else min(0.05, left))
        return True

    def compile_state(self) -> str:
        """Where this session's compiles stand, in a phrase: "off", or how many graphs are compiled,
        compiling, measured faster eagerly, skipped by the estimate or failed."""
        if not self.compiles:
            return "compile off"
        graphs = {id(cg): cg for cg in self._compiled().values()}.values()
        if not graphs:
            return "nothing to compile"
        label = {"skipped": "skipped (cannot pay)", "eager": "eager (measured faster)",
                 "compiling": "compiling in the background", "undecided": "not run yet", "not compiled yet": "not run yet"}
        counts: dict[str, int] = {}
        for cg in graphs:
            key = label.get(cg.stage, cg.stage)
            counts[key] = counts.get(key, 0) + 1
        return ", ".join(f"{n} {k}" for k, n in counts.items())

    def describe(self) -> str:
        """One line: the processor and how it runs the Program (the region processor: regions, compiled
        or eager, replayed or not; the cuda processor: its streams, replayed or not)."""
        how = self._processor.describe() if self.processor in ("region", "cuda") else ""
        if self.processor != "region" and self.compiles and self._compiled():
            how += (", " if how else "") + f"graphs: {self.compile_state()}"
        if self.processor in ("cpu", "cuda") and self._in_place:
            how += (", " if how else "") + (f"{len(self._in_place)} state tensors updated in place "
                                            f"({len(self._steps_write)} by an in-place write)")
        return f"{self.processor} processor" + (f" ({how})" if how else "")

    @property
    def runner(self):
        """The processor object running this session's Program (ReferenceProcessor, RegionProcessor,
        ThreadedProcessor, CudaProcessor or DistProcessor; `processor` is its name)."""
        return self._processor

    def compile(self, inputs: Mapping[str, torch.Tensor] | None = None, *, capture: bool = True):
        """Warm up now, off the request path: compile every fx supertask (region processor: every region)
        in one warm-up run on seeded inputs, timed apart from runs, then capture the run's CUDA graph
        (region and cuda processors on one GPU with cuda_graph=True: capture(inputs)), so that the first
        run() is already a replay. The region processor then keeps, per CPU region, the faster of the
        compiled graph and the stitched graph run eagerly (RegionProcessor.tune; describe() says).
        `inputs`: what to capture on (default: the seeded inputs), never run by compile(): a server
        passes its own state tensors (an engine's KV caches) so they become the graph's buffers.
        capture=False: warm up only (the second run captures, on what it is given).
        With compile="background" it does the same now: the warm-up run decides (the estimate) at once,
        and what it queues compiles in this thread (or is waited for, if the background thread has it).

        Returns a CompileReport (distinct graphs, seconds, supertasks left eager by a failed compile).
        """
        import time

        from fastpipe.runtime.compiling.compile import CompileReport, warmup_inputs

        t = time.perf_counter()
        self.compile_report = CompileReport(0, 0.0, ())      # mark as started: run() must not recurse
        warm = warmup_inputs(self.pipeline)
        graphs = {id(c): c for c in self._compiled().values()}.values()
        if self.background:              # tiered: the warm-up run decides (estimate) and queues at once
            for cg in graphs:
                cg.decide_now = True
        self.run(warm)
        if self.background:              # ... and the compile happens here (or is waited for), not beside
            for cg in graphs:
                cg.finish()
        if self.processor == "region" and self.compiles:   # compiled or eager, whichever is faster
            self._processor.tune(warm)
        if capture:
            self._capture(warm if inputs is None else inputs, given=inputs is not None)
        compiled = self._compiled()
        graphs = {id(cg) for cg in compiled.values()}
        eager = tuple(sid for sid, cg in compiled.items() if cg.eager)
        self.compile_report = CompileReport(len(graphs), time.perf_counter() - t, eager)
        return self.compile_report

    def capture(self, inputs: Mapping[str, torch.Tensor] | None = None) -> bool:
        """Capture the run's CUDA graph now, so that the next run() replays it: compile() when this
        session has not warmed up yet (it captures), else a capture on `inputs` (one run's inputs; their
        state tensors become the graph's buffers), unless the graph held already has those buffers
        (inputs=None: any graph held). The capture runs nothing. Returns whether a graph is held: False
        where the processor replays none (reference, cpu, dist; several GPUs; cuda_graph=False) or after a
        failed capture (compile_policy "warn": a RuntimeWarning with the reason; "raise": CompileError)."""
        if self.compile_report is None:
            self.compile(inputs)
            return any(r.replaying for r in self._graph_replays())
        if inputs is None:
            if any(r.replaying for r in self._graph_replays()):
                return True
            from fastpipe.runtime.compiling.compile import warmup_inputs

            return self._capture(warmup_inputs(self.pipeline))
        return self._capture(inputs, given=True)

    def _graph_replays(self) -> list:
        """The GraphReplays of the processor (the region and cuda processors' `replay`, when they have one)."""
        r = getattr(self._processor, "replay", None)
        return [r] if isinstance(r, GraphReplay) else []

    def _capture(self, inputs, *, given: bool = False) -> bool:
        """The processor captures on `inputs` (checked first when the caller gave them)."""
        replays = self._graph_replays()
        if not replays:
            return False
        if given:
            check_inputs(self.pipeline, inputs, self._input_devices)
            if self._in_place:
                from fastpipe.runtime.binding.state import check_state_inputs

                check_state_inputs(inputs, self._in_place)
        capture = getattr(self._processor, "capture", None)
        if capture is not None:
            return capture(inputs)
        with torch.inference_mode():     # a processor without capture() (cuda): its one-chunk replay takes
            return all([r.capture(inputs) for r in replays])   # run()'s inputs, under inference_mode as its run

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.pipeline.input_names

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.pipeline.output_names

    def run(self, inputs: Mapping[str, torch.Tensor], *, chunks: int = 1,
            trace: str | os.PathLike | None = None) -> dict[str, torch.Tensor]:
        """Run once. `inputs` keyed by pipeline input names; returns outputs keyed by pipeline output names.

        chunks=k: inputs carry k times the pipeline's batch along dim 0; they run as k
        micro-batches (fill-drain across stages with the cpu/cuda processors) and the outputs
        are concatenated back along dim 0.
        trace: write a Chrome/Perfetto trace (one lane per slot, fp:<slot>:<supertask> labels).
        With state_in_place (RunOptions), each updated state output is written into the tensor given
        as its input, and that tensor is returned as the output (`session.state` pairs them).
        """
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise InputError(f"chunks: expected an integer >= 1, found {chunks!r}")
        if self._in_place:
            if chunks != 1:
                raise InputError(f"chunks: expected 1 with state_in_place (state is one batch), found {chunks}")
            from fastpipe.runtime.binding.state import write_back

            return write_back(inputs, self._run_checked(inputs, chunks, trace), self._in_place)
        return self._run_checked(inputs, chunks, trace)

    def _run_checked(self, inputs, chunks, trace):
        # compile at the first run when there is something to compile (dist: every rank warms up together,
        # so the decision must not depend on which slots this rank holds)
        if self.compile_report is None and not self._nothing_to_compile:
            if self.background:
                self._nothing_to_compile = True          # tiered: each graph compiles in the background
            elif self.compiles if self.processor == "dist" else bool(self._compiled()):
                self.compile()
            else:
                self._nothing_to_compile = True
        if self.processor == "dist":   # every rank calls run; rank 0 gets the outputs (dist_processor)
            return self._processor.session_run(inputs, chunks=chunks, trace=trace)
        events: list | None = [] if trace is not None else None
        if chunks == 1:
            check_inputs(self.pipeline, inputs, self._input_devices)
            if self._in_place:
                from fastpipe.runtime.binding.state import check_state_inputs

                check_state_inputs(inputs, self._in_place)
            parts = [inputs]
        else:
            from fastpipe.runtime.binding.microbatch import check_chunked_inputs, split_chunks

            parts = split_chunks(inputs, chunks, check_chunked_inputs(self.pipeline, inputs, chunks, self._input_devices))
        if self.index_bounds:        # indices out of range (CPU inputs): an InputError, not a failed or aborted kernel
            from fastpipe.runtime.binding.index_bounds import check_index_bounds

            check_index_bounds(inputs, self.index_bounds)
        results = self._run_parts(parts, chunks, events)
        if trace is not None:
            from fastpipe.runtime.trace import write_chrome_trace

            lanes = self._processor.trace_lanes() if self.processor == "region" else tuple(self.pipeline.devices)
            write_chrome_trace(trace, events, lanes)
        if chunks == 1:
            return results[0]
        return {n: torch.cat([r[n] for r in results], dim=0) for n in self.output_names}

    def run_model(self, *, check_replicas: bool = False, output_device=None, **model_inputs) -> dict[str, torch.Tensor]:
        """Run with the ORIGINAL model's inputs (SPEC metadata): nested arguments are flattened by
        SPEC naming (`past_key_values_3_1`), each is sliced onto its slots, and each original
        output is assembled from its slices (check_replicas: replicated slices must agree) on
        `output_device` (None: the CPU, whatever device the slots are on).
        Returns a dict keyed by the original output names (e.g. `logits`)."""
        from fastpipe.model_io import assemble_outputs, flatten_args, to_pipeline_inputs

        outs = self.run(to_pipeline_inputs(self.pipeline, flatten_args(model_inputs)))
        if self.processor == "dist" and self.rank_plan.rank != 0:   # dist: outputs live on rank 0
            return {}
        return assemble_outputs(self.pipeline, outs, check_replicas=check_replicas, device=output_device)

    def memory_report(self) -> dict[str, dict]:
        """Per device (its name): the plan's predicted peak ("predicted_peak_bytes": the slots' most
        intermediates alive at once, "activation_bytes", plus their constants, "constant_bytes") and, with
        the cuda processor, "measured_peak_bytes" (torch.cuda.max_memory_allocated since the processor was
        made or `runner.reset_peak_memory()`). With state_in_place, an updated state output written into
        the caller's tensor counts nothing: every one on the region processor, those a step writes by an
        in-place scatter on the cpu and cuda processors (`describe()` says how many; the rest are computed,
        then copied in). fastpipe.runtime.cuda.stream_issue.format_memory_report prints it."""
        from fastpipe.lower.lower import peak_bytes
        from fastpipe.runtime.cuda.stream_issue import planned_memory

        program = self.program
        written = (frozenset(self._in_place.values()) if self.processor == "region" and self._in_place
                   else self._steps_write)
        peak = {s: peak_bytes(self.pipeline, program.steps[s], in_place=written) for s in program.slots} if written else None
        if self.processor == "cuda":
            return self._processor.memory_report(peak)
        return planned_memory(program, {s: self.slot_devices[s] for s in program.slots if program.steps[s]}, peak)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, *, collect: bool = True) -> None:
        """Drop this session's steps, constants and decoded graphs (weights and compiled graphs nobody
        else holds are freed), and collect garbage (collect=False: the caller collects once, after closing
        several). A session dropped without close() frees them as its last reference goes too
        (fastpipe.runtime.binding.release), except what reference cycles of the caller's hold until the next
        collection. `with fastpipe.load(...) as session:` closes it at the end."""
        import dataclasses

        if self.processor == "dist" and self._processor is not None:   # let go of its process groups
            self._processor.close()
        self.program, self._processor, self._binder = None, None, None
        self.checked = dataclasses.replace(self.checked, graphs=None)   # decoded payloads hold their constants
        if collect:
            import gc

            gc.collect()

    def _run_parts(self, parts, chunks, events):
        if self.processor == "reference":
            import time

            out, t0 = [], time.perf_counter()
            for c, part in enumerate(parts):
                out.append(self._processor.run(part, events=events, chunk=c, t0=t0))
            return out
        return self._processor.run(parts if chunks > 1 else parts[0], chunks=chunks, trace=events)


def load(pipeline: str | os.PathLike | Pipeline, device_map: Mapping[str, str] | None = None, *,
         allow_outside_paths: bool = False, trust_export_archives: bool = False, upload: str = "pinned",
         store: WeightStore | None = None, processor: str = "auto", compile: bool | str = "background",
         compile_policy: str = "warn", cuda_graph: bool = True, fuse: str = "auto", merge_shards: bool = True,
         slot_ranks: Mapping[str, int] | None = None, dist_timeout: float | None = None,
         state_in_place: bool = False, alias_outputs: bool = False, graph_pool=None,
         load_options: LoadOptions | None = None,
         run_options: RunOptions | None = None) -> Session:
    """Load, validate and bind a pipeline (a path to pipeline.json, or a Pipeline).

    The keywords are the fields of LoadOptions and RunOptions (fastpipe.options), or give the
    dataclasses themselves (`load_options=`, `run_options=`; then leave their keywords at the
    defaults). The defaults are the CLI's: `processor="auto"` (dist / region / cuda / cpu, see
    choose_processor) and `compile="background"` (tiered: eager from the first run, each graph compiled
    in the background and swapped in once ready and faster); `compile="wait"` compiles at the first
    run (benchmarks), `compile="off"` never. `processor="reference"` (one step at a time, eagerly) is the
    oracle, an explicit choice. `processor="dist"` inside a torchrun-launched process runs this rank's slots
    (`slot_ranks` overrides which; `dist_timeout` in seconds bounds every collective); see
    docs/distributed.md.
    """
    lo = LoadOptions(allow_outside_paths=allow_outside_paths, trust_export_archives=trust_export_archives,
                     upload=upload)
    ro = RunOptions(processor=processor, compile=compile, compile_policy=compile_policy, cuda_graph=cuda_graph,
                    fuse=fuse, merge_shards=merge_shards, slot_ranks=slot_ranks, dist_timeout=dist_timeout,
                    state_in_place=state_in_place, alias_outputs=alias_outputs, graph_pool=graph_pool)
    for given, built, name in ((load_options, lo, "load_options"), (run_options, ro, "run_options")):
        if given is not None and built != type(built)():
            raise InputError(f"{name}: expected either {name} or its fields as keywords, found both")
    p = pipeline if isinstance(pipeline, Pipeline) else read_pipeline(Path(pipeline))
    return Session(p, device_map=device_map, load_options=load_options or lo, run_options=run_options or ro,
                   store=store)
