"""Load-time binding: a lowered Program becomes a bound Program, the thing processors run.

    program = bind(lower(checked), checked, binder)     # every slot
    program = bind(lower(checked), checked, binder, local_slots={"0"})   # dist: this rank's slots
    program = bind(lower(checked), checked, binder, in_place=pairs)     # state written in place (cpu, cuda)

Each step gets its slot's device and its constants (read once per process by the weight
store, and copied to a device once per store: sessions over one store share the copy; a GPU's
constants go there together, through pinned staging buffers: Binder.prefetch); each
compute step its callable (the fx graph on the slot's device, compiled when asked; a registered
handler for other kinds); each comm group with a member to bind its plain-torch callable
(fastpipe.runtime.execute.group_fn).

State in place (`in_place`: state input -> its updated output, fastpipe.runtime.binding.state, given by the
cpu and cuda processors with state_in_place): a compute step that is the only reader of a state
input and writes its update gets a copy of its graph where the update is an in-place scatter into
that input (fastpipe.runtime.passes.region_state, copy_rest=False), so a decode step writes the new
positions into the caller's cache instead of making a new one for the session to copy in.
`state_written(program, in_place)` names the outputs so written (fused steps included: their
graphs get the same rewrite, fastpipe.runtime.passes.fuse); the others are copied in as before. The
reference processor keeps every graph as the file says (it is the oracle); the region processor
rewrites its stitched graphs itself.

GEMM layout (`fold_gemms`, the cpu, cuda and dist processors): a step's batched linears run as the
one mm that F.linear reaches (fastpipe.runtime.binding.gemm_layout), on a copy of the decoded graph.
"""
from __future__ import annotations

from pathlib import Path

import torch

from fastpipe import dtypes
from fastpipe.compute_handlers import required_handler
from fastpipe.errors import PayloadError
from fastpipe.format.model import Pipeline
from fastpipe.lower.program import Program
from fastpipe.options import LoadOptions
from fastpipe.payload import DecodedGraph, bind_external
from fastpipe.runtime.execute import group_fn
from fastpipe.runtime.binding.graph_device import placed_graph
from fastpipe.validate.sources import param_ref, payload_text
from fastpipe.weights import ParamRef, WeightStore, resolve_param_path


class Binder:
    def __init__(self, p: Pipeline, opts: LoadOptions, store: WeightStore, slot_devices: dict[str, torch.device],
                 *, compile: bool = False, compile_policy: str = "warn", background: bool = False,
                 fold_gemms: bool = False):
        self.p, self.opts, self.store, self.slot_devices = p, opts, store, slot_devices
        self.compile, self.compile_policy = compile, compile_policy
        self.background = background      # tiered compiles (fastpipe.runtime.compiling.compile.CompiledGraph)
        self.fold_gemms = fold_gemms      # batched linears folded into mm (fastpipe.runtime.binding.gemm_layout)
        self.compiled: dict[str, object] = {}     # supertask id -> CompiledGraph (when compiling)
        self._const: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._gms: dict[tuple[int, torch.device], torch.nn.Module] = {}
        self._in_place_gms: dict[tuple, tuple] = {}      # (id, device, pairs) -> (graph, the pairs written in place)
        self.in_place_of: dict[str, tuple] = {}         # supertask id -> ((state input, its update), ...) asked

    def constants_for(self, names, device: torch.device) -> dict[str, torch.Tensor]:
        return {n: self.constant(n, device) for n in names if self.p.tensors[n].is_constant}

    def _request(self, name: str) -> tuple:
        """The WeightStore request for constant `name`: (ref, shape, dtype, where, trust_export)."""
        t = self.p.tensors[name]
        ref, where = param_ref(self.p, name, self.opts)
        return ref, t.shape, dtypes.to_torch(t.dtype), where, self.opts.trust_export_archives

    def constant(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, device)
        if key not in self._const:
            ref, shape, dtype, where, trust = self._request(name)
            # on a GPU the store's copy there: sessions over one store share it (and their compiled graphs)
            self._const[key] = self.store.load(ref, shape, dtype, where=where, trust_export=trust, device=device)
        return self._const[key]

    def prefetch(self, names, device: torch.device) -> None:
        """Load the constants among `names` for `device` together (on a GPU: one staged upload of all the
        weights not there yet, WeightStore.load_many); later constant() calls find them."""
        todo = [n for n in dict.fromkeys(names) if self.p.tensors[n].is_constant and (n, device) not in self._const]
        if not todo or torch.device(device).type == "cpu":     # the CPU's slices are mmap views: nothing to copy
            return
        requests = [self._request(n) for n in todo]
        for n, c in zip(todo, self.store.load_many(requests, device, upload=self.opts.upload)):
            self._const[(n, device)] = c

    def forget_constants(self) -> None:
        """Drop the load-time cache (the bound steps hold what they use; passes may have replaced some)."""
        self._const.clear()

    def graph_fn(self, sid: str, g: DecodedGraph | None, device: torch.device,
                 in_place: tuple[tuple[int, int], ...] = ()):
        """(fn, graph): the step's callable, and the eager fx.GraphModule it runs (None for handler kinds);
        `in_place`: (read index, write index) of each state input and its update that the step may write
        into the input (the module docstring)."""
        st = self.p.supertasks[sid]
        if st.kind != "fx":
            text, _ = payload_text(self.p, sid, self.opts)
            return required_handler(st.kind, sid)(sid, st, text), None
        key = (id(g), device)
        if key not in self._gms:
            if g.external_constants:
                self._bind_external(sid, g)
            gm = placed_graph(g.gm, device)      # constants and device arguments on the slot's device
            if self.fold_gemms:
                from fastpipe.runtime.binding.gemm_layout import folded_copy

                gm = folded_copy(gm)
            gm.eval()
            self._gms[key] = gm
        gm, written = self._in_place_graph(key, self._gms[key], in_place) if in_place else (self._gms[key], ())
        eager = gm
        if self.compile:
            from fastpipe.runtime.compiling.compile import compiled_graph

            text, where = payload_text(self.p, sid, self.opts)
            if written:                          # another graph than the payload's: its own compiled graph
                text += f"\n# fastpipe: state written in place, (input, output) indices {list(written)}"
            gm = compiled_graph(text, gm, device, f"supertasks[\"{sid}\"] on slot \"{self.p.supertasks[sid].device}\"",
                                self.compile_policy, self.background)
            self.compiled[sid] = gm

        def run(xs, gm=gm):
            out = gm(*xs)
            return out if isinstance(out, (tuple, list)) else (out,)

        return run, eager

    def _in_place_graph(self, key: tuple, gm, pairs: tuple) -> tuple:
        """(graph, pairs written in place): a copy of the placed graph `gm` whose state updates among
        `pairs` are in-place scatters into their inputs (the same constants), or `gm` itself where none is."""
        import copy

        from fastpipe.runtime.passes.region_state import write_in_place

        k = key + (pairs,)
        if k not in self._in_place_gms:
            cand = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))    # shares gm's constants
            cand.eval()
            done = tuple(write_in_place(cand, list(pairs), copy_rest=False))
            self._in_place_gms[k] = (cand, done) if done else (gm, ())
        return self._in_place_gms[k]

    def _bind_external(self, sid: str, g: DecodedGraph) -> None:
        _, where = payload_text(self.p, sid, self.opts)
        tensors = {}
        for attr, (raw, fmt, saved) in g.external_constants.items():
            w = f"{where}: metadata.constant_saved_info[\"{attr}\"]"
            path = resolve_param_path(self.p.source_dir or Path.cwd(), raw, where=w, allow_outside=self.opts.allow_outside_paths)
            fake = getattr(g.gm, attr, None)
            if fake is None:
                raise PayloadError(f"{w}: expected a constant the graph uses, found \"{attr}\"")
            tensors[attr] = self.store.load(ParamRef(path, fmt, saved, None), tuple(fake.shape), fake.dtype, where=w,
                                            trust_export=self.opts.trust_export_archives)
        bind_external(g, tensors)


def bind(program: Program, checked, binder: Binder, local_slots=None, in_place=None) -> Program:
    """The Program with devices, constants and callables filled in (only `local_slots`' steps, and the
    groups with a member there, when given; state updates among `in_place` written into their inputs
    where a step can: the module docstring)."""
    import dataclasses

    graphs = checked.graphs
    devices = binder.slot_devices
    local = set(program.slots if local_slots is None else local_slots)
    wanted: dict = {}                       # device -> the constants its local steps read, in step order
    for slot in program.slots:
        if slot in local:
            wanted.setdefault(devices[slot], []).extend(n for st in program.steps[slot] for n in st.reads)
    for dev, names in wanted.items():
        binder.prefetch(names, dev)
    writers = state_writers(program, in_place or {})
    steps = {}
    for slot, ss in program.steps.items():
        if slot not in local:
            steps[slot] = ss
            continue
        out, dev = [], devices[slot]
        for i, st in enumerate(ss):
            consts = binder.constants_for(st.reads, dev)
            fn = graph = None
            if st.kind == "compute":
                g = graphs.get(st.supertask)
                pairs = writers.get((slot, i), ())
                if pairs:
                    binder.in_place_of[st.supertask] = tuple((st.reads[r], st.writes[w]) for r, w in pairs)
                fn, graph = binder.graph_fn(st.supertask, g, dev, pairs)
            out.append(dataclasses.replace(st, device=dev, constants=consts, fn=fn, graph=graph))
        steps[slot] = tuple(out)
    fns = {}
    for g, members in program.groups.items():
        if any(s in local for s, _ in members):
            fns[g] = group_fn(checked.groups[g], [devices[s] for s, _ in members])
    return dataclasses.replace(program, steps=steps, group_fns=fns)


def state_writers(program: Program, pairs) -> dict[tuple[str, int], tuple[tuple[int, int], ...]]:
    """(slot, step index) -> ((read index, write index), ...): the state inputs among `pairs` (input ->
    its updated output) that one compute step alone reads, once, and whose update it writes."""
    readers: dict[str, list] = {}
    for slot, ss in program.steps.items():
        for i, st in enumerate(ss):
            for n in st.reads:
                readers.setdefault(n, []).append((slot, i))
    out: dict = {}
    for inp, o in pairs.items():
        if len(readers.get(inp, ())) != 1:
            continue
        slot, i = readers[inp][0]
        st = program.steps[slot][i]
        if st.kind == "compute" and o in st.writes:
            out.setdefault((slot, i), []).append((st.reads.index(inp), st.writes.index(o)))
    return {k: tuple(v) for k, v in out.items()}


def state_written(program: Program, pairs) -> frozenset[str]:
    """The state outputs among `pairs` (input -> its updated output) that a step of the bound `program`
    writes into its input tensor (its graph's output is an in-place scatter into that input)."""
    from fastpipe.runtime.passes.region_state import writes_in_place

    out = set()
    for ss in program.steps.values():
        for st in ss:
            if st.graph is None:
                continue
            for inp, o in pairs.items():
                if inp in st.reads and o in st.writes and writes_in_place(st.graph, st.reads.index(inp), st.writes.index(o)):
                    out.add(o)
    return frozenset(out)
