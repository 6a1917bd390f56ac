"""The region processor: every device's steps run as one graph (fastpipe.lower.regions).

    RegionProcessor(program, groups, compile=True, compile_policy="warn", cuda_graph=True)

The Program must carry regions (the region pass). Each one-device region is stitched into one
fx graph (fastpipe.runtime.passes.region_graph) - its slots' compute, and the comm between them as
plain tensor code (fastpipe.comm.local) - and run as one call: eagerly as one generated Python
function, or, with compile=True, through torch.compile(fullgraph=True) (fastpipe.runtime.compiling.compile:
once per process per distinct region and constants; a failure or a graph break warns and runs
the region eagerly, or raises, by the policy; a recompile after warm-up is warned about). A comm
group whose members span devices is a region of its own, run by the comm reference. When every
region is on one GPU, the whole run is captured as one CUDA graph and replayed
(fastpipe.runtime.cuda.graph_replay): capture(inputs) captures it now (Session.compile does, at
warm-up), else the second run captures it; `graph_pool` shares its memory pool with other sessions'
graphs replayed one at a time (a serving set's buckets).

Micro-batches (chunks) run one after another: on one device there is nothing to overlap.
A failure inside a region is located by re-running that region's steps one at a time, eagerly,
on the same inputs; the RunError names the supertask and slot and says it was found that way.
With a trace, each region is one event on its own lane (the lane's name gives its compile time,
measured apart at warm-up); an eager run with a trace runs the steps one at a time so each
supertask gets its own event.
"""
from __future__ import annotations

import hashlib
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from fastpipe.comm import local
from fastpipe.errors import FastpipeError, InputError, RunError
from fastpipe.lower.program import Program
from fastpipe.lower.regions import Region, by_unit
from fastpipe.runtime.execute import call, group_where, labelled, run_compute, run_group, step_args
from fastpipe.runtime.binding.inputs import dense, to_device
from fastpipe.runtime.binding.release import release_with, weak_method
from fastpipe.runtime.cuda.graph_replay import ReplayOptions
from fastpipe.runtime.processors.base import Placement, Prepared, Processor

_COMPILED: "weakref.WeakValueDictionary[tuple, object]" = weakref.WeakValueDictionary()


def _compiled_region(gm: torch.fx.GraphModule, device: str, where: str, policy: str, background: bool):
    """One CompiledGraph per distinct region code, constants, device, compile policy and way of compiling
    (tiered in the background, or at warm-up) in this process (shared while some session holds it;
    dropped with the last one)."""
    from fastpipe.runtime.compiling.compile import CompiledGraph

    consts = tuple(id(t) for t in (*gm.parameters(), *gm.buffers()))
    key = (hashlib.sha256(gm.code.encode()).hexdigest(), consts, device, policy, background)
    cg = _COMPILED.get(key)
    if cg is None:
        cg = CompiledGraph(gm, where, policy, what="region", background=background, device=device)
        _COMPILED[key] = cg
    return cg


def _per_call(fn, budget_s: float = 0.01) -> float:
    """Seconds per call of fn: the best of 3 batches, each about budget_s / 3 long."""
    t = time.perf_counter()
    fn()
    n = max(1, int(budget_s / 3 / max(time.perf_counter() - t, 1e-7)))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best


class _RegionRun:
    """One region and how it runs."""

    def __init__(self, region: Region, fn: Callable | None, device=None, gm=None, compiled=None):
        self.region, self.fn, self.gm, self.compiled = region, fn, gm, compiled
        self.device = device            # the torch.device its steps are bound to (None: across devices)


@dataclass(frozen=True)
class RegionOptions:
    """The region processor's own options (RunOptions.processor_options, or fastpipe.load's keywords)."""
    merge_shards: bool = True
    """Matmuls the split cut into shards run as one GEMM again on one device (fastpipe.runtime.passes.region_passes)."""

    def __post_init__(self):
        if not isinstance(self.merge_shards, bool):
            raise InputError(f"merge_shards: expected true or false, found {self.merge_shards!r}")


class RegionProcessor(Processor):
    name = "region"
    options = (ReplayOptions, RegionOptions)
    cuts_regions = True
    compiles_steps = False              # it compiles whole regions; its steps stay eager (for locating failures)

    @classmethod
    def passes(cls, program: Program, placement: Placement) -> Program:
        """Steps cut into one-device regions (fastpipe.lower.regions), stitched at prepare."""
        from fastpipe.lower import with_regions

        return with_regions(program, {s: str(d) for s, d in placement.slot_devices.items()})

    @classmethod
    def prepare(cls, program: Program, prepared: Prepared) -> "RegionProcessor":
        ro = prepared.run_options
        replay = ro.of(ReplayOptions)
        return cls(program, prepared.checked.groups, compile=prepared.compiles, compile_policy=ro.compile_policy,
                   background=prepared.background, cuda_graph=replay.cuda_graph,
                   merge_shards=ro.of(RegionOptions).merge_shards,
                   opaque_groups={d.group for d in prepared.fusion if d.fused}, state=prepared.state,
                   graph_pool=replay.graph_pool, alias_outputs=replay.alias_outputs,
                   substitute=prepared.store.substitute, written=prepared.written).attach(prepared)

    def __init__(self, program: Program, groups: Mapping, *, compile: bool = False, compile_policy: str = "warn",
                 background: bool = False, cuda_graph: bool = True, merge_shards: bool = True, opaque_groups=(),
                 state: Mapping[str, str] | None = None, graph_pool=None, alias_outputs: bool = False,
                 substitute: Callable[[list], None] | None = None, written: Mapping[str, str] | None = None):
        """`groups`: the checked comm groups (kind, params); `background`: with compile, each region runs
        eagerly until the background compiler has compiled it (fastpipe.runtime.compiling.compile.CompiledGraph,
        tiered), else it compiles at its first call (Session.compile's warm-up); `opaque_groups`: groups whose bound
        callable must run as is (fused kernels) instead of their one-device function; `state`: input ->
        its updated output, written into the input's tensor in the graph (fastpipe.runtime.binding.state);
        `graph_pool`: a fastpipe.runtime.cuda.graph_replay.GraphPool for the CUDA graph (None: its own);
        `alias_outputs`: a replayed run returns the graph's output buffers, not clones (GraphReplay);
        `written`: inputs a graph writes in place (fastpipe.validate.written), written back from the CUDA
        graph's buffers after each replay; `substitute`: told [(shard, view of its merged weight)] as each
        merged group is made (a WeightStore's substitute: later sessions loading the shards get the views),
        before the shards go.
        The Program's steps must be the only other holders of their constants (the Session drops
        its Binder's first), so that each group's shards are freed as soon as it is merged."""
        from fastpipe.runtime.binding.gemm_layout import fold_batched_linears
        from fastpipe.runtime.passes.region_graph import stitch
        from fastpipe.runtime.passes.region_passes import PassReport, optimize

        if not program.regions:
            raise ValueError("the region processor needs a Program with regions (fastpipe.lower.with_regions)")
        self.program, self.compile = program, compile
        self.outputs = tuple(program.outputs)
        self.group_fns: dict[str, Callable] = {}
        for r in program.regions:
            for unit in by_unit(program, r.steps):
                st = program.steps[unit[0][0]][unit[0][1]]
                if st.kind == "comm" and r.device is not None:
                    g = groups[st.group]
                    self.group_fns[st.group] = (program.group_fns[st.group] if st.group in opaque_groups
                                                else local.group_fn(g.kind, g.params, len(unit)))
        self.runs: list[_RegionRun] = []
        self.passes = PassReport()
        self.rebound = 0                # shard constants replaced by views of a merged weight
        self.released = 0               # bytes of the shards' file pages given back (fastpipe.weights.page_release)
        self._substitute = substitute
        self.state = dict(state or {})
        self._state_outputs = frozenset(self.state.values())
        self.in_place = 0               # state updates written by an in-place op (the rest: a copy_ at the end)
        self.folded = 0                 # batched linears folded into one mm (fastpipe.runtime.binding.gemm_layout)
        for r in program.regions:
            if r.device is None:
                self.runs.append(_RegionRun(r, None))
                continue
            gm = stitch(program, r, self.group_fns)
            rep = optimize(gm, merge=merge_shards, on_merge=self._rebinder(r))
            self.folded += fold_batched_linears(gm)      # after the merges, which read the bmm form too
            self.in_place += self._state_in_place(r, gm)
            self.passes.cse += rep.cse
            self.passes.merged += rep.merged
            cg = None
            if compile:
                cg = _compiled_region(gm, r.device, f"region \"{r.name}\" on {r.device} ({self.describe_region(r)})",
                                      compile_policy, background)
            slot, i = r.steps[0]
            self.runs.append(_RegionRun(r, cg if cg is not None else gm, program.steps[slot][i].device, gm, cg))
        release_with(self, [run.gm for run in self.runs])   # the stitched graphs' weights go with this processor
        devices = {run.device for run in self.runs}
        self.replay = None
        dev = next(iter(devices))
        if cuda_graph and len(devices) == 1 and dev is not None and dev.type == "cuda":
            from fastpipe.runtime.cuda.graph_replay import GraphReplay

            self.replay = GraphReplay(weak_method(self._run_env), dev, policy=compile_policy, state=self.state,
                                      pool=graph_pool, alias_outputs=alias_outputs, written=written)

    def _state_in_place(self, r: Region, gm) -> int:
        """Make the region write its state outputs into their input tensors (fastpipe.runtime.passes.region_state)."""
        from fastpipe.runtime.passes.region_state import write_in_place

        pairs = [(r.reads.index(i), r.writes.index(o)) for i, o in self.state.items()
                 if i in r.reads and o in r.writes]
        return len(write_in_place(gm, pairs)) if pairs else 0

    def _rebinder(self, r: Region) -> Callable[[list], None]:
        """on_merge for region r's passes: the shard constants of each merged group become views of
        its merged weight in the region's steps (their eager form, for locating failures) and in the
        substitute's store, so that no reference to a shard is left and its memory goes before the
        next group is concatenated. Later sessions loading the same shards get the views, and with
        them the same merged weight (remember_concat)."""
        from fastpipe.runtime.passes.region_passes import remember_concat
        from fastpipe.weights.page_release import release

        holders: dict[int, list] = {}           # id(constant) -> [(a step's constants, name)]
        for slot, i in r.steps:
            consts = self.program.steps[slot][i].constants
            for name, t in consts.items():
                holders.setdefault(id(t), []).append((consts, name))
        done: dict[int, tuple] = {}             # id(shard) -> (weakref to it, its view): ids of dead shards recur

        def rebind(pieces) -> None:
            pairs, groups = [], {}
            for w, merged, dim, off in pieces:
                seen = done.get(id(w))
                if seen is not None and seen[0]() is w:     # a shard in two groups keeps its first view
                    v = seen[1]
                else:
                    v = merged.narrow(dim, off, w.shape[dim])
                    done[id(w)] = (weakref.ref(w), v)
                    pairs.append((w, v))
                    for consts, name in holders.pop(id(w), ()):
                        consts[name] = v
                groups.setdefault((id(merged), dim), (merged, dim, []))[2].append(v)
            for merged, dim, views in groups.values():
                remember_concat(views, dim, merged)
            self.rebound += len(pairs)
            if self._substitute is not None:
                self._substitute(pairs)
            # the shards' file pages (views of a checkpoint's mmap) are not read again: out of the RSS
            self.released += release([w for w, merged, _, _ in pieces
                                      if w.untyped_storage().data_ptr() != merged.untyped_storage().data_ptr()])

        return rebind

    # ------------------------------------------------------------------ describing
    def describe_region(self, r: Region) -> str:
        slots = sorted({s for s, _ in r.steps}, key=self.program.slots.index)
        return f"{len(r.steps)} steps of slots {', '.join(slots)}"

    def describe(self) -> str:
        """One line: how many regions on which devices, compiled or eager (and, tiered, where each compile
        stands), replayed or not."""
        by_dev: dict[str, int] = {}
        for r in self.program.regions:
            key = r.device or "cross-device comm"
            by_dev[key] = by_dev.get(key, 0) + 1
        parts = [f"{k} region{'s' if k != 1 else ''} on {d}" for d, k in by_dev.items()]
        phrases = [run.compiled.state() if run.compiled is not None else "eager, one call"
                   for run in self.runs if run.fn is not None]
        if not self.compile or len(set(phrases)) <= 1:
            how = (phrases[0] if phrases else "eager") + ("" if len(phrases) <= 1 else " each")
        else:
            how = "; ".join(f"{run.region.name}: {ph}" for run, ph in zip([r for r in self.runs if r.fn is not None],
                                                                          phrases))
        if self.passes.merged:
            how += f", {self.passes.merged} shard matmuls merged"
        if self.folded:
            how += f", {self.folded} batched linears folded into mm"
        if self.state:
            how += f", {len(self.state)} state tensors updated in place ({self.in_place} by an in-place write)"
        if self.replay is not None:
            if self.replay.failure is not None:
                how += f", CUDA-graph capture failed ({self.replay.failure}): run without a graph"
            elif self.replay.replaying or self.compile is False or all(r.compiled is None or r.compiled.settled
                                                                       for r in self.runs):
                how += ", replayed as one CUDA graph"
            else:
                how += ", replayed as one CUDA graph once compiled"
        return f"{', '.join(parts)}; {how}"

    def tune(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """After the warm-up compile: time each compiled CPU region against its stitched graph run
        eagerly, on these inputs, and keep the faster (CompiledGraph.settle). For a region of a few small
        ops the compiled call's fixed cost (guards, wrappers: tens of microseconds) can exceed what it
        saves; the choice and both times are in describe(). CUDA regions keep the compiled graph (replay
        hides the per-call cost). Tiered regions compiled by Session.compile (finish()) are settled here too."""
        if not self.compile:
            return
        env = dict(inputs)
        with torch.inference_mode():
            for run in self.runs:
                r = run.region
                if run.fn is None:
                    self._run_crossing(r, env)
                else:
                    args = self._args(run, env)
                    cg = run.compiled
                    if cg is not None and cg.has_compiled and not cg.eager and run.device.type == "cpu":
                        t_compiled, t_eager = _per_call(lambda: cg.fn(*args)), _per_call(lambda: run.gm(*args))
                        cg.settle(t_compiled, t_eager, "at warm-up")
                    env.update(zip(r.writes, run.fn(*args)))
                for n in r.frees:
                    env.pop(n, None)

    def graph_replays(self) -> list:
        return [self.replay] if self.replay is not None else []

    def written_in_place(self) -> frozenset:
        return self._state_outputs          # every state output, written inside the region graphs

    def compiled_graphs(self) -> dict[str, object]:
        """Region name -> its CompiledGraph (compile=True)."""
        return {run.region.name: run.compiled for run in self.runs if run.compiled is not None}

    def trace_lanes(self) -> dict[str, str]:
        out = {}
        for run in self.runs:
            r = run.region
            what = "cross-device comm" if r.device is None else f"on {r.device}"
            cg = run.compiled
            if cg is not None:
                when = "in the background" if cg.background else "at warm-up"
                what += (f", compiled in {cg.compile_seconds:.2f} s {when}" if cg.compiled else f", {cg.state()}")
                if cg.use_eager and cg.compiled:
                    what += ", run eagerly (faster)"
            out[r.name] = f"region {r.name} {what}"
        return out

    # ------------------------------------------------------------------ running
    def run(self, parts: list[dict], *, trace: list | None = None) -> list[dict]:
        """`parts`: one dict of named tensors per micro-batch, run one after another."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            if trace is None and self.replay is not None:
                return [self.replay(part) for part in parts]
            return [self._run_env(dict(part), trace=trace, chunk=c, t0=t0) for c, part in enumerate(parts)]

    def _run_env(self, env: dict, *, trace: list | None = None, chunk: int = 0, t0: float = 0.0) -> dict:
        given = [t for t in env.values() if isinstance(t, torch.Tensor)]
        for run in self.runs:
            r = run.region
            start = time.perf_counter()
            cg = run.compiled
            # a traced run of a region never compiled (compile off, skipped by the estimate, or not yet) goes step
            # by step, so that each supertask has its own event; a compiled one (run compiled, or eagerly where
            # measured faster, or after a failed compile) is one event, as it runs
            as_steps = trace is not None and run.fn is not None and (cg is None or not (cg.compiled or cg.eager))
            if run.fn is None:
                self._run_crossing(r, env)
            elif as_steps:
                self._run_steps(r, env, trace=trace, chunk=chunk, t0=t0)
            else:
                self._run_graph(run, env)
            if trace is not None and not as_steps:
                trace.append((r.name, r.label, start - t0, time.perf_counter() - t0, chunk))
            for n in r.frees:
                env.pop(n, None)
        return self._fresh(env, given)

    def _fresh(self, env: dict, given: list) -> dict:
        """The outputs, dense, none of them the caller's input or another output: inside a region an
        all_reduce's members share one tensor and a broadcast is its input, but what the caller gets
        is theirs to keep and write (as from the reference processor)."""
        seen = {t.data_ptr() for t in given if t.numel()}
        out = {}
        for n in self.outputs:
            if n in self._state_outputs:                         # the input's own tensor, updated (run() writes it back if not)
                out[n] = env[n]
                continue
            t = env[n].contiguous()                # a merged GEMM's column slice is not (the reference's are)
            if t.numel() and t.data_ptr() in seen:
                t = t.clone()
            seen.add(t.data_ptr())
            out[n] = t
        return out

    def _run_crossing(self, r: Region, env: dict) -> None:
        """A region of one comm group whose members span devices: the comm reference."""
        slot, i = r.steps[0]
        run_group(self.program, self.program.steps[slot][i].group, env)

    @staticmethod
    def _args(run: _RegionRun, env: dict) -> list:
        """The region's reads on its device and dense, canonical strides on size-1 dims too: a compiled
        region is specialised to its inputs' strides, and callers hand in views (run_model's slices)."""
        dev = run.device
        return [dense(to_device(a, dev)) for a in (env[n] for n in run.region.reads)]

    def _run_graph(self, run: _RegionRun, env: dict) -> None:
        r = run.region
        args = self._args(run, env)
        try:
            outs = labelled(r.label, run.fn, *args)
        except FastpipeError:
            raise
        except Exception as e:  # noqa: BLE001 - located by re-running the region step by step
            if run.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise   # inside a CUDA-graph capture: re-running would issue into the failed capture
            self._locate(run, env, e)
        env.update(zip(r.writes, outs))

    def _locate(self, run: _RegionRun, env: dict, err: Exception):
        r = run.region
        try:
            self._run_steps(r, dict(env))
        except RunError as e:
            raise RunError(f"{e} (found by re-running region \"{r.name}\" step by step, eagerly, after it failed "
                           "as one graph)") from err
        msg = " ".join(str(err).split()) or type(err).__name__
        raise RunError(f"region \"{r.name}\" on {r.device}: failed as one graph: {type(err).__name__}: {msg} "
                       f"(its steps run one at a time, eagerly, succeed)") from err

    def _run_steps(self, r: Region, env: dict, *, trace: list | None = None, chunk: int = 0, t0: float = 0.0) -> None:
        """The region's steps one at a time, eagerly (errors name the supertask and slot)."""
        program = self.program
        for unit in by_unit(program, r.steps):
            st = program.steps[unit[0][0]][unit[0][1]]
            start = time.perf_counter()
            if st.kind == "compute":
                run_compute(st, env)
                label = st.label
            else:
                members = [program.steps[s][i] for s, i in unit]
                writes = [n for m in members for n in m.writes]
                label = f"fp:group:{st.group}"
                outs = call(self.group_fns[st.group], [a for m in members for a in step_args(m, env)], len(writes),
                            lambda g=st.group: group_where(program, g), label)
                env.update(zip(writes, outs))
            if trace is not None:
                trace.append((r.name, label, start - t0, time.perf_counter() - t0, chunk))
