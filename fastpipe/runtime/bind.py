"""Load-time binding: a lowered Program becomes a bound Program, the thing processors run.

    program = bind(lower(checked), checked, binder)     # every slot
    program = bind(lower(checked), checked, binder, local_slots={"0"})   # dist: this rank's slots

Each step gets its slot's device and its constants (read once per process by the weight
store, and copied to a device once per store: sessions over one store share the copy; a GPU's
constants go there together, through pinned staging buffers: Binder.prefetch); each
compute step its callable (the fx graph on the slot's device, compiled when asked; a registered
handler for other kinds); each comm group with a member to bind its plain-torch callable
(fastpipe.runtime.execute.group_fn).
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
from fastpipe.runtime.graph_device import placed_graph
from fastpipe.validate.sources import param_ref, payload_text
from fastpipe.weights import ParamRef, WeightStore, resolve_param_path


class Binder:
    def __init__(self, p: Pipeline, opts: LoadOptions, store: WeightStore, slot_devices: dict[str, torch.device],
                 *, compile: bool = False, compile_policy: str = "warn"):
        self.p, self.opts, self.store, self.slot_devices = p, opts, store, slot_devices
        self.compile, self.compile_policy = compile, compile_policy
        self.compiled: dict[str, object] = {}     # supertask id -> CompiledGraph (when compiling)
        self._const: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._gms: dict[tuple[int, torch.device], torch.nn.Module] = {}

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

    def graph_fn(self, sid: str, g: DecodedGraph | None, device: torch.device):
        """(fn, graph): the step's callable, and the eager fx.GraphModule it runs (None for handler kinds)."""
        st = self.p.supertasks[sid]
        if st.kind != "fx":
            text, _ = payload_text(self.p, sid, self.opts)
            return required_handler(st.kind, sid)(sid, st, text), None
        key = (id(g), device)
        if key not in self._gms:
            if g.external_constants:
                self._bind_external(sid, g)
            gm = placed_graph(g.gm, device)      # constants and device arguments on the slot's device
            gm.eval()
            self._gms[key] = gm
        gm = eager = self._gms[key]
        if self.compile:
            from fastpipe.runtime.compile import compiled_graph

            text, where = payload_text(self.p, sid, self.opts)
            gm = compiled_graph(text, gm, device, f"supertasks[\"{sid}\"] on slot \"{self.p.supertasks[sid].device}\"",
                                self.compile_policy)
            self.compiled[sid] = gm

        def run(xs, gm=gm):
            out = gm(*xs)
            return out if isinstance(out, (tuple, list)) else (out,)

        return run, eager

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


def bind(program: Program, checked, binder: Binder, local_slots=None) -> Program:
    """The Program with devices, constants and callables filled in (only `local_slots`' steps, and the
    groups with a member there, when given)."""
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
    steps = {}
    for slot, ss in program.steps.items():
        if slot not in local:
            steps[slot] = ss
            continue
        out, dev = [], devices[slot]
        for st in ss:
            consts = binder.constants_for(st.reads, dev)
            fn = graph = None
            if st.kind == "compute":
                g = graphs.get(st.supertask)
                fn, graph = binder.graph_fn(st.supertask, g, dev)
            out.append(dataclasses.replace(st, device=dev, constants=consts, fn=fn, graph=graph))
        steps[slot] = tuple(out)
    fns = {}
    for g, members in program.groups.items():
        if any(s in local for s, _ in members):
            fns[g] = group_fn(checked.groups[g], [devices[s] for s, _ in members])
    return dataclasses.replace(program, steps=steps, group_fns=fns)
