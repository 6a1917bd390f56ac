"""fastpipe.load(...) -> Session; Session.run(inputs) -> outputs.

Loading validates everything first (structure, payloads, param-file headers),
then reads the weights (each slice once per process) and binds every step.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch

from fastpipe.format import Pipeline, read_pipeline
from fastpipe.options import LoadOptions
from fastpipe.payload import decode_payload
from fastpipe.runtime.bind import Binder
from fastpipe.runtime.device_map import resolve_device_map
from fastpipe.runtime.inputs import check_inputs
from fastpipe.runtime.reference import ReferenceRunner
from fastpipe.runtime.steps import comm_step, compute_step
from fastpipe.validate import Checked, validate
from fastpipe.validate.order import node_of
from fastpipe.validate.sources import payload_text
from fastpipe.weights import WeightStore, default_store


PROCESSORS = ("reference", "cpu", "cuda", "dist")


class Session:
    """A loaded pipeline, ready to run. Not thread-safe: use one per thread, or serialise calls.

    processor: "reference" (one step at a time, the oracle), "cpu" (a thread per slot,
    fastpipe.runtime.cpu_processor), "cuda" (a stream per slot, CUDA-graph replay) or "dist"
    (one process per rank under torchrun, fastpipe.runtime.dist_processor: run() on every rank
    returns the outputs on rank 0 and {} elsewhere).
    compile: run every fx supertask through torch.compile (inductor); compile failures
    follow `compile_policy` ("warn": that supertask runs eagerly, with a warning; "raise").
    fuse: "auto" fuses matmul->reduce_scatter and all_gather->matmul into Triton kernels on one
    CUDA device above the size threshold; "always" fuses every match; "off". Decisions, with
    reasons, in `session.fusion` (fastpipe.runtime.fuse).
    """

    def __init__(self, pipeline: Pipeline, *, device_map: Mapping[str, str] | None = None,
                 options: LoadOptions | None = None, store: WeightStore | None = None,
                 processor: str = "reference", compile: bool = False, compile_policy: str = "warn",
                 cuda_graph: bool = True, fuse: str = "auto", slot_ranks: Mapping[str, int] | None = None,
                 dist_timeout: float | None = None):
        from fastpipe.errors import InputError

        if fuse not in ("auto", "off", "always"):
            raise InputError(f"fuse: expected auto, off or always, found \"{fuse}\"")
        if processor not in PROCESSORS:
            raise InputError(f"processor: expected one of {', '.join(PROCESSORS)}, found \"{processor}\"")
        if compile_policy not in ("warn", "raise"):
            raise InputError(f"compile_policy: expected warn or raise, found \"{compile_policy}\"")
        self.options = options or LoadOptions()
        self.store = store or default_store()
        self.checked: Checked = validate(pipeline, self.options, self.store)
        self.pipeline = pipeline
        self.slot_devices = resolve_device_map(pipeline, device_map)
        self.processor = processor
        # -- dist processor (fastpipe.runtime.dist_processor): this rank binds and runs only its slots
        self._dist_plan = None
        if processor == "dist":
            from fastpipe.runtime.dist_setup import make_plan

            self._dist_plan = make_plan(pipeline, self.slot_devices, slot_ranks)
            self.slot_devices, fuse = self._dist_plan.slot_devices, "off"   # fused kernels need one device
        elif slot_ranks is not None:
            raise InputError(f"slot_ranks: expected processor=\"dist\", found processor=\"{processor}\"")
        # -- end dist
        self._binder = Binder(pipeline, self.options, self.store, self.slot_devices, compile=compile,
                              compile_policy=compile_policy)
        self.steps = self._build_steps()
        from fastpipe.runtime import fuse as fusion

        self.fusion = fusion.analyze(self, fuse)
        fusion.apply(self, self.fusion)
        self.compile_report = None
        self._runner = ReferenceRunner(self.steps, pipeline.output_names)
        self.program = None
        if processor != "reference":
            from fastpipe.lower import check_program, lower

            self.program = lower(self.checked)
            check_program(self.program, self.checked)
        if processor == "cpu":
            from fastpipe.runtime.cpu_processor import ThreadedRunner

            self._runner = ThreadedRunner(self.program, self._compute_steps(), self._comm_steps(), pipeline.output_names)
        elif processor == "cuda":
            from fastpipe.runtime.cuda_processor import CudaRunner

            self._runner = CudaRunner(self, cuda_graph=cuda_graph)
        elif processor == "dist":
            from fastpipe.runtime.dist_processor import DistRunner

            self._runner = DistRunner(self, self._dist_plan, timeout_s=dist_timeout)
        self._input_devices = {
            n: {self.slot_devices[pipeline.supertasks[c].device] for c in self.checked.flow.consumers.get(n, [])}
            for n in pipeline.input_names
        }

    def _build_steps(self):
        p, b = self.pipeline, self._binder
        graphs = self.checked.graphs or {}
        steps, done_groups = [], set()
        local = set(self._dist_plan.local_slots) if self._dist_plan else None   # dist: this rank's slots only
        by_node = {}
        for sid in p.supertasks:
            by_node.setdefault(node_of(p, sid), sid)
        for node in self.checked.order:
            sid = by_node[node]
            st = p.supertasks[sid]
            if st.kind in ("input", "output"):
                continue
            if st.is_comm:
                if st.group in done_groups:
                    continue
                done_groups.add(st.group)
                group = self.checked.groups[st.group]
                if local is not None and not any(p.supertasks[m].device in local for m in group.members):
                    continue
                consts = {}
                for m in group.members:
                    consts.update(b.constants_for(p.supertasks[m].inputs, self.slot_devices[p.supertasks[m].device]))
                steps.append(comm_step(group, p.supertasks, self.slot_devices, consts))
                continue
            if local is not None and st.device not in local:
                continue
            dev = self.slot_devices[st.device]
            g = graphs.get(sid)
            if g is None and st.kind == "fx":
                text, where = payload_text(p, sid, self.options)
                g = decode_payload(text, where=where)
            fn = b.graph_fn(sid, g, dev)
            steps.append(compute_step(sid, st.device, fn, st.inputs, b.constants_for(st.inputs, dev), dev, st.outputs))
        return steps

    def _compute_steps(self) -> dict:
        return {s.supertasks[0]: s for s in self.steps if not s.label.startswith("fp:group:")}

    def _comm_steps(self) -> dict:
        return {s.label[len("fp:group:"):]: s for s in self.steps if s.label.startswith("fp:group:")}

    def compile(self):
        """Compile every fx supertask now: one warm-up run on seeded inputs, timed apart from runs.

        Returns a CompileReport (distinct graphs, seconds, supertasks left eager by a failed compile).
        """
        import time

        from fastpipe.runtime.compile import CompileReport, warmup_inputs

        t = time.perf_counter()
        self.compile_report = CompileReport(0, 0.0, ())      # mark as started: run() must not recurse
        self.run(warmup_inputs(self.pipeline))
        graphs = {id(cg) for cg in self._binder.compiled.values()}
        eager = tuple(sid for sid, cg in self._binder.compiled.items() if cg.eager)
        self.compile_report = CompileReport(len(graphs), time.perf_counter() - t, eager)
        return self.compile_report

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
        """
        from fastpipe.errors import InputError

        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise InputError(f"chunks: expected an integer >= 1, found {chunks!r}")
        if self.processor == "dist":   # every rank calls run; rank 0 gets the outputs (dist_processor)
            return self._runner.session_run(inputs, chunks=chunks, trace=trace)
        if self.compile_report is None and self._binder.compiled:
            self.compile()
        events: list | None = [] if trace is not None else None
        if chunks == 1:
            check_inputs(self.pipeline, inputs, self._input_devices)
            parts = [inputs]
        else:
            from fastpipe.runtime.cpu_processor import split_chunks

            check_inputs(self.pipeline, {k: v[: self.pipeline.tensors[k].shape[0]] if isinstance(v, torch.Tensor) and v.dim() else v
                                         for k, v in inputs.items()}, self._input_devices)
            parts = split_chunks(inputs, chunks, {n: self.pipeline.tensors[n].shape[0] for n in self.input_names})
        results = self._run_parts(parts, chunks, events)
        if trace is not None:
            from fastpipe.runtime.cpu_processor import write_chrome_trace

            write_chrome_trace(trace, events, tuple(self.pipeline.devices))
        if chunks == 1:
            return results[0]
        return {n: torch.cat([r[n] for r in results], dim=0) for n in self.output_names}

    def run_model(self, *, check_replicas: bool = False, **model_inputs) -> dict[str, torch.Tensor]:
        """Run with the ORIGINAL model's inputs (SPEC metadata): nested arguments are flattened by
        SPEC naming (`past_key_values_3_1`), each is sliced onto its slots, and each original
        output is assembled from its slices (check_replicas: replicated slices must agree).
        Returns a dict keyed by the original output names (e.g. `logits`)."""
        from fastpipe.model_io import assemble_outputs, flatten_args, to_pipeline_inputs

        outs = self.run(to_pipeline_inputs(self.pipeline, flatten_args(model_inputs)))
        if self.processor == "dist" and self._dist_plan.rank != 0:   # dist: outputs live on rank 0
            return {}
        return assemble_outputs(self.pipeline, outs, check_replicas=check_replicas)

    def close(self) -> None:
        """Drop this session's steps and constants (weights nobody else holds are freed)."""
        if self.processor == "dist" and self._runner is not None:   # let go of its process groups
            self._runner.close()
        self.steps, self._runner, self._binder = [], None, None
        import gc

        gc.collect()

    def _run_parts(self, parts, chunks, events):
        if self.processor == "reference":
            import time

            out, t0 = [], time.perf_counter()
            for c, part in enumerate(parts):
                out.append(self._runner.run(part, events=events, chunk=c, t0=t0))
            return out
        return self._runner.run(parts if chunks > 1 else parts[0], chunks=chunks, trace=events)


def load(pipeline: str | os.PathLike | Pipeline, device_map: Mapping[str, str] | None = None, *,
         allow_outside_paths: bool = False, trust_export_archives: bool = False,
         store: WeightStore | None = None, processor: str = "reference", compile: bool = False,
         compile_policy: str = "warn", cuda_graph: bool = True, fuse: str = "auto",
         slot_ranks: Mapping[str, int] | None = None, dist_timeout: float | None = None) -> Session:
    """Load, validate and bind a pipeline (a path to pipeline.json, or a Pipeline).

    Defaults run the reference processor with eager graphs (predictable, fast to load);
    `processor="cpu"` / `"cuda"` and `compile=True` select the fast paths (see Session).
    `processor="dist"` inside a torchrun-launched process runs this rank's slots (`slot_ranks`
    overrides which; `dist_timeout` in seconds bounds every collective); see docs/distributed.md.
    """
    p = pipeline if isinstance(pipeline, Pipeline) else read_pipeline(Path(pipeline))
    opts = LoadOptions(allow_outside_paths=allow_outside_paths, trust_export_archives=trust_export_archives)
    return Session(p, device_map=device_map, options=opts, store=store, processor=processor, compile=compile,
                   compile_policy=compile_policy, cuda_graph=cuda_graph, fuse=fuse, slot_ranks=slot_ranks,
                   dist_timeout=dist_timeout)
