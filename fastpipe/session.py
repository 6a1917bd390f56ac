"""fastpipe.load(...) -> Session; Session.run(inputs) -> outputs.

Loading is one flow, the same for every processor (each is a class in the registry,
fastpipe.runtime.processors; the flow asks it, never its name):

    checked = validate(pipeline, ...)                        # structure, payloads, param-file headers
    cls = processor_class(choose_processor(...))             # registry: "auto" or a name -> its class
    placement = cls.place(pipeline, slot_devices, options)   # devices, slots bound here, fusion policy
    program = bind(lower(checked), checked, binder, ...)     # per-slot steps; devices, constants, callables
    program = fuse.apply(program, decisions, ...)            # the fusion pass
    program = cls.passes(program, placement)                 # the processor's own (regions)
    check_program(program, checked)                          # the checker proves what will run
    processor = cls.prepare(program, Prepared(...))

`session.program` is that bound, checked Program: what the processor runs and what
`fastpipe show --plan` prints. Warm-up (compile, capture) is fastpipe.session_warmup.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch

from fastpipe import session_warmup as warmup
from fastpipe.errors import InputError
from fastpipe.format import Pipeline, read_pipeline
from fastpipe.lower import check_program, lower
from fastpipe.options import LoadOptions, RunOptions
from fastpipe.runtime.binding.bind import Binder, bind, state_written
from fastpipe.runtime.binding.device_map import resolve_device_map
from fastpipe.runtime.binding.index_bounds import index_bounds
from fastpipe.runtime.binding.state import state_pairs
from fastpipe.runtime.passes import fuse as fusion
from fastpipe.runtime.processors.base import Prepared
from fastpipe.runtime.processors.registry import check_options_taken, choose_processor, processor_class, with_fields
from fastpipe.validate import Checked, validate
from fastpipe.weights import WeightStore, default_store


class Session:
    """A loaded pipeline, ready to run. Not thread-safe: use one per thread, or serialise calls.

    `run_options` (fastpipe.options.RunOptions) choose the processor (`processor` is its name, `runner`
    the object): "reference" (one step at a time, the oracle), "region" (every device's steps and the
    comm between them as one graph), "cpu" (a thread per slot), "cuda" (a stream per slot, CUDA-graph
    replay), "dist" (one process per rank under torchrun: run() on every rank returns the outputs on
    rank 0 and {} elsewhere), a registered one, or "auto" (registry.choose_processor); how graphs are
    compiled, and the fusion policy (decisions with reasons in `session.fusion`).
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
        self.index_bounds = index_bounds(pipeline, self.checked.graphs)   # integer inputs used as indices -> range
        self.pipeline = pipeline
        resolved = resolve_device_map(pipeline, device_map)
        self.processor = choose_processor(opts.processor, resolved)
        cls = processor_class(self.processor)
        check_options_taken(opts, cls)
        placement = cls.place(pipeline, resolved, opts)
        self.slot_devices = placement.slot_devices
        self.state = state_pairs(pipeline)       # input -> its updated output (fastpipe.runtime.binding.state)
        # input -> the supertask whose graph writes it in place (fastpipe.validate.written): a run updates the
        # caller's tensor given for it, as the producer's eager model updates its caches
        self.written_inputs = dict(self.checked.written)
        in_place = self.state if opts.state_in_place else {}
        # compile: "background" is tiered, or at warm-up, or off, as the processor says (Processor.background_compile)
        self.compiles = opts.compile == "wait" or (opts.compile == "background" and cls.background_compile != "eager")
        self.background = self.compiles and opts.compile == "background" and cls.background_compile == "tiered"
        self._binder = Binder(pipeline, self.options, self.store, self.slot_devices,
                              compile=self.compiles and cls.compiles_steps, compile_policy=opts.compile_policy,
                              background=self.background, fold_gemms=cls.folds_gemms)
        steps_in_place = in_place if cls.writes_state_in_steps else None
        program = bind(lower(self.checked), self.checked, self._binder, placement.local_slots, in_place=steps_in_place)
        self.fusion = fusion.analyze(self.checked, self.slot_devices, placement.fuse, region=cls.cuts_regions,
                                     off_reason=placement.fuse_off_reason)
        program = fusion.apply(program, self.fusion, self.checked, self._binder)
        program = cls.passes(program, placement)
        check_program(program, self.checked)
        self.program = program
        self.compile_report = None
        self._nothing_to_compile = False
        prepared = Prepared(pipeline, self.checked, self.store, opts, placement, tuple(self.fusion), in_place,
                            self.compiles, self.background, self._binder.compiled, self.index_bounds,
                            state_written(program, steps_in_place) if steps_in_place else frozenset(),
                            written=self.checked.written)
        self._binder.forget_constants()          # the steps hold their constants: the region processor's
        self._processor = cls.prepare(program, prepared)   # merges then free each group's shards

    @property
    def runner(self):
        """The processor object running this session's Program (a fastpipe.runtime.processors.base.Processor)."""
        return self._processor

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.pipeline.input_names

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.pipeline.output_names

    def describe(self) -> str:
        """One line: the processor and how it runs the Program (Processor.describe)."""
        how = self._processor.describe()
        if self.written_inputs:
            how += (", " if how else "") + f"{len(self.written_inputs)} inputs written in place"
        return f"{self.processor} processor" + (f" ({how})" if how else "")

    # ------------------------------------------------------------------ compiling (fastpipe.runtime.compiling.warmup)
    def compiled_graphs(self) -> dict:
        """What this session compiles: supertask id (or region name) -> CompiledGraph."""
        return self._processor.compiled_graphs()

    def compile_settled(self) -> bool:
        """Whether every graph this session compiles has settled (compiled and adopted, or eager by the
        estimate, by measurement or after a failure): nothing is queued, compiling or being measured."""
        return self._processor.compile_settled()

    def compile_state(self) -> str:
        """Where this session's compiles stand, in a phrase: "compile off", or how many graphs are compiled,
        compiling, measured faster eagerly, skipped by the estimate or failed."""
        from fastpipe.runtime.processors.base import compile_state

        return compile_state(self.compiled_graphs()) if self.compiles else "compile off"

    wait_compiled = warmup.wait_compiled
    compile = warmup.compile
    capture = warmup.capture

    # ------------------------------------------------------------------ running
    def run(self, inputs: Mapping[str, torch.Tensor], *, chunks: int = 1,
            trace: str | os.PathLike | None = None) -> dict[str, torch.Tensor]:
        """Run once. `inputs` keyed by pipeline input names; returns outputs keyed by pipeline output names.

        A pipeline input left out is filled through the metadata, as `fastpipe run --inputs` fills it
        (fastpipe.model_io.complete_inputs): from its model input under that input's own name, or from
        another pipeline input holding all of that model input (the producer reads `x` on one slot and
        `x_slot1`, or `d0_x` and `d1_x`, on others: either fills the rest). Inputs a graph writes in
        place (`written_inputs`: the producer's KV caches) end the run holding the update, in the
        caller's tensors.
        chunks=k: inputs carry k times the pipeline's batch along dim 0; they run as k
        micro-batches (fill-drain across stages with the cpu/cuda processors) and the outputs
        are concatenated back along dim 0.
        trace: write a Chrome/Perfetto trace (one lane per slot, fp:<slot>:<supertask> labels).
        With state_in_place (RunOptions), each updated state output is written into the tensor given
        as its input, and that tensor is returned as the output (`session.state` pairs them).
        """
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise InputError(f"chunks: expected an integer >= 1, found {chunks!r}")
        names = self.pipeline.input_names
        if not self._processor.one_process_per_rank and any(n not in inputs for n in names):
            from fastpipe.model_io import complete_inputs      # per-slot inputs from the model input they slice

            inputs = complete_inputs(self.pipeline, inputs, chunks=chunks, views=self.written_inputs)
        in_place = self._processor.prepared.state
        if in_place and chunks != 1:
            raise InputError(f"chunks: expected 1 with state_in_place (state is one batch), found {chunks}")
        # compile at the first run when there is something to compile (dist: every rank warms up together,
        # so the decision must not depend on which slots this rank holds); tiered: in the background
        if self.compile_report is None and not self._nothing_to_compile:
            if self.compiles and not self.background and self._processor.warms_up():
                self.compile()
            else:
                self._nothing_to_compile = True
        outs = self._processor.call(inputs, chunks=chunks, trace=trace)
        if in_place:
            from fastpipe.runtime.binding.state import write_back

            return write_back(inputs, outs, in_place)
        return outs

    def run_model(self, *, check_replicas: bool = False, output_device=None, **model_inputs) -> dict[str, torch.Tensor]:
        """Run with the ORIGINAL model's inputs (SPEC metadata): nested arguments are flattened by
        SPEC naming (`past_key_values_3_1`), each is sliced onto its slots, and each original
        output is assembled from its slices (check_replicas: replicated slices must agree) on
        `output_device` (None: the CPU, whatever device the slots are on).
        Returns a dict keyed by the original output names (e.g. `logits`); {} where outputs live elsewhere."""
        from fastpipe.model_io import assemble_outputs, flatten_args, to_pipeline_inputs

        outs = self.run(to_pipeline_inputs(self.pipeline, flatten_args(model_inputs), views=self.written_inputs))
        if not self._processor.outputs_here():   # dist: outputs live on rank 0
            return {}
        return assemble_outputs(self.pipeline, outs, check_replicas=check_replicas, device=output_device)

    def memory_report(self) -> dict[str, dict]:
        """Per device (its name): the plan's predicted peak ("predicted_peak_bytes": the slots' most
        intermediates alive at once, "activation_bytes", plus their constants, "constant_bytes") and, with
        the cuda processor, "measured_peak_bytes" (torch.cuda.max_memory_allocated since the processor was
        made or `runner.reset_peak_memory()`). With state_in_place, an updated state output written into
        the caller's tensor counts nothing (Processor.written_in_place: every one on the region processor,
        those a step writes by an in-place scatter on the cpu and cuda processors; `describe()` says how
        many). fastpipe.runtime.cuda.stream_issue.format_memory_report prints it."""
        from fastpipe.lower.lower import peak_bytes

        program, written = self.program, self._processor.written_in_place()
        peak = {s: peak_bytes(self.pipeline, program.steps[s], in_place=written) for s in program.slots} if written else None
        return self._processor.memory_report(peak)

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

        if self._processor is not None:          # let go of what outlives it (the dist processor's groups)
            self._processor.close()
        self.program, self._processor, self._binder = None, None, None
        self.checked = dataclasses.replace(self.checked, graphs=None)   # decoded payloads hold their constants
        if collect:
            import gc

            gc.collect()


def load(pipeline: str | os.PathLike | Pipeline, device_map: Mapping[str, str] | None = None, *,
         store: WeightStore | None = None, load_options: LoadOptions | None = None,
         run_options: RunOptions | None = None, **options) -> Session:
    """Load, validate and bind a pipeline (a path to pipeline.json, or a Pipeline).

    `options` are the fields of LoadOptions, RunOptions and the processors' option dataclasses
    (fastpipe.options; ReplayOptions' cuda_graph, alias_outputs, graph_pool; RegionOptions' merge_shards;
    DistOptions' slot_ranks, dist_timeout), by name; or give the dataclasses themselves (`load_options=`,
    `run_options=`), not both (keywords left at their defaults aside). The defaults are the CLI's: `processor="auto"` (dist / region / cuda / cpu,
    see registry.choose_processor) and `compile="background"` (tiered: eager from the first run, each
    graph compiled in the background and swapped in once ready and faster); `compile="wait"` compiles at
    the first run (benchmarks), `compile="off"` never. `processor="reference"` (one step at a time,
    eagerly) is the oracle, an explicit choice. `processor="dist"` inside a torchrun-launched process runs
    this rank's slots (`slot_ranks` overrides which; `dist_timeout` in seconds bounds every collective);
    see docs/distributed.md.
    """
    import dataclasses

    load_fields = {f.name for f in dataclasses.fields(LoadOptions)}
    lo = LoadOptions(**{k: v for k, v in options.items() if k in load_fields})
    ro = with_fields(None, **{k: v for k, v in options.items() if k not in load_fields})
    set_ro = dataclasses.replace(ro, processor_options=tuple(o for o in ro.processor_options if o != type(o)()))
    for given, built, name in ((load_options, lo, "load_options"), (run_options, set_ro, "run_options")):
        if given is not None and built != type(built)():      # keywords at their defaults are not "given"
            raise InputError(f"{name}: expected either {name} or its fields as keywords, found both")
    p = pipeline if isinstance(pipeline, Pipeline) else read_pipeline(Path(pipeline))
    return Session(p, device_map=device_map, load_options=load_options or lo, run_options=run_options or ro,
                   store=store)
