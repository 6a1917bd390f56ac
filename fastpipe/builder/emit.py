"""Traced, split rank graphs -> a pipeline.json document.

Slots are (stage, rank) -> str(stage * tp + rank). Every segment becomes an fx
supertask; every comm point a comm supertask in group `tp{stage}_{k}` (the k-th
comm point, the same on every rank of the stage); a value used by a later
stage is sent straight from its producer to each consumer stage (skip
connections included). Parameters become constants: slices (placements) of the
original checkpoint tensors. Identical graphs are stored once in `blobs`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from fastpipe import dtypes
from fastpipe.builder.graph_split import split_graph
from fastpipe.builder.markers import PIPE_SPLIT
from fastpipe.builder.sources import Source
from fastpipe.errors import BuildError
from fastpipe.payload import encode_payload
from fastpipe.torch_compat import make_graph_module


@dataclass(frozen=True)
class IOSpec:
    """A flat input/output of the traced function: its original name and what slice of it this rank sees."""
    name: str
    placements: tuple[tuple[int, int], ...] | None = None   # None: the whole original tensor
    idx: int = 0
    shape: tuple[int, ...] = ()        # the original (unsplit) shape
    dtype: str = "f32"


@dataclass
class RankGraph:
    gm: fx.GraphModule
    params: list[Source]              # one per leading placeholder
    inputs: list[IOSpec]              # one per remaining placeholder
    outputs: list[IOSpec]             # one per graph output


@dataclass(frozen=True)
class StoredParam:
    path: str                          # file, relative to the pipeline's folder
    name: str                          # tensor name inside the file
    format: str = "safetensors"


def comm_metadata(comm) -> dict:
    """A dimops Comm's parameters in the format's metadata keys (`op` is written `reduce_op`)."""
    return {("reduce_op" if k == "op" else k): v for k, v in comm.params.items()}


def _meta(n: fx.Node):
    return n.meta["val"]


def _tensor_entry(val) -> dict:
    return {"shape": list(val.shape), "dtype": dtypes.to_name(val.dtype)}


class Emitter:
    def __init__(self, name: str, tp: int, pp: int, stored: Callable[[str], StoredParam], device_kind: str = "cpu"):
        self.tp, self.pp, self.stored = tp, pp, stored
        self.doc: dict[str, Any] = {"version": "0.1.0", "name": name, "devices": {}, "tensors": {},
                                    "supertasks": {"in": {"kind": "input", "inputs": [], "outputs": []}},
                                    "metadata": {"tensors": {"inputs": {}, "outputs": {}},
                                                 "tensor_slices": {"inputs": {}, "outputs": {}}}}
        self.device_kind = device_kind
        self._ids = 0
        self._payloads: dict[str, list[str]] = {}     # payload text -> supertask ids
        self._const_names: dict[tuple[str, tuple], str] = {}
        self._pipeline_outputs: list[str] = []
        self._comm_groups: dict[str, list] = {}

    # ------------------------------------------------------------------ helpers
    def slot(self, stage: int, rank: int) -> str:
        s = str(stage * self.tp + rank)
        self.doc["devices"].setdefault(s, {"kind": self.device_kind, "idx": stage * self.tp + rank})
        return s

    def _sid(self) -> str:
        self._ids += 1
        return str(self._ids)

    def constant(self, src: Source, val) -> str:
        key = (src.param, src.placements)
        if key not in self._const_names:
            whole = all(a == 0 for a, _ in src.placements) and not any(
                k[0] == src.param and k[1] != src.placements for k in self._const_names)
            name = src.param if whole else f"{src.param}.{sum(1 for k in self._const_names if k[0] == src.param)}"
            if name in self.doc["tensors"]:
                name = f"{src.param}.{len(self._const_names)}"
            st = self.stored(src.param)
            self.doc["tensors"][name] = {"shape": list(val.shape), "dtype": dtypes.to_name(val.dtype), "value": {
                "path": st.path, "format": st.format, "name": st.name, "placements": [list(p) for p in src.placements]}}
            self._const_names[key] = name
        return self._const_names[key]

    def pipeline_input(self, spec: IOSpec, rank: int, slot: str, val) -> str:
        name = spec.name if spec.placements is None else f"{spec.name}_rank{rank}"
        if name not in self.doc["tensors"]:
            self.doc["tensors"][name] = _tensor_entry(val)
            self.doc["supertasks"]["in"]["outputs"].append(name)
            self.doc["metadata"]["tensors"]["inputs"][spec.name] = {"shape": list(spec.shape), "dtype": spec.dtype, "idx": spec.idx}
            pl = spec.placements or tuple((0, s) for s in spec.shape)
            self.doc["metadata"]["tensor_slices"]["inputs"][name] = {
                "placements": [list(p) for p in pl], "origin": spec.name, "dtype": spec.dtype, "device": slot}
        return name

    # ------------------------------------------------------------------ one rank
    def add_rank(self, rank: int, rg: RankGraph, transmit: frozenset = frozenset()) -> None:
        """Add one tensor-parallel rank's graph. Parameters named in `transmit` that several stages use
        are loaded on the first of them and sent on (SPEC §4 TRANSMIT); others are REPLICATEd."""
        gm = rg.gm
        seg = split_graph(gm, len(rg.params))
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        nparams = len(rg.params)
        param_of = {n: rg.params[i] for i, n in enumerate(placeholders[:nparams])}
        input_of = {n: rg.inputs[i] for i, n in enumerate(placeholders[nparams:])}
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        outs = list(out_node.args[0]) if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]

        def resolve(n: fx.Node) -> fx.Node:
            while n.op == "call_function" and n.target is PIPE_SPLIT:
                n = n.args[0]
            return n

        names: dict[tuple[fx.Node, str], str] = {}   # (value node, slot) -> tensor name on that slot
        producer_slot: dict[fx.Node, str] = {}
        seg_of: dict[fx.Node, tuple[int, int]] = {}
        for key, ns in seg.groups.items():
            for n in ns:
                seg_of[n] = key
        for n in seg.comms:
            producer_slot[n] = self.slot(seg.stage[n], rank)
        for n, key in seg_of.items():
            producer_slot[n] = self.slot(key[0], rank)

        first_stage: dict[fx.Node, int] = {}
        for (st, _), ns in seg.groups.items():
            for m in ns:
                for i in m.all_input_nodes:
                    first_stage[resolve(i)] = min(first_stage.get(resolve(i), st), st)

        def value_on(n: fx.Node, slot: str, stage: int) -> str:
            """The tensor name holding node n's value on `slot` (sending it across stages if needed)."""
            n = resolve(n)
            if n in param_of:
                const = self.constant(param_of[n], _meta(n))
                home = first_stage.get(n, stage)
                if param_of[n].param not in transmit or home == stage:
                    return const
                if (n, slot) not in names:
                    names[(n, slot)] = self._send(const, self.slot(home, rank), slot, _meta(n), f"pp_{const}")
                return names[(n, slot)]
            if n in input_of:
                return self.pipeline_input(input_of[n], rank, slot, _meta(n))
            if (n, slot) in names:
                return names[(n, slot)]
            src = producer_slot[n]
            own = f"{n.name}@{src}"
            names[(n, src)] = own
            if n not in tensors_declared:
                self.doc["tensors"][own] = _tensor_entry(_meta(n))
                tensors_declared.add(n)
            if src == slot:
                return own
            names[(n, slot)] = self._send(own, src, slot, _meta(n), f"pp_{n.name}")
            return names[(n, slot)]

        tensors_declared: set = set()
        pending_outputs: dict[str, list] = {}   # supertask id -> list of (node) outputs to fill in once names exist
        # compute supertasks, in (stage, level) order
        for (stage, level), ns in sorted(seg.groups.items()):
            slot = self.slot(stage, rank)
            members = set(ns)
            needed_free = self._free_closure(ns, seg.free)
            ext: list[fx.Node] = []
            for n in ns:
                for i in n.all_input_nodes:
                    r = resolve(i)
                    if r not in members and r not in needed_free and r not in ext:
                        ext.append(r)
            used_outside = [n for n in ns if any(u not in members for u in n.users) or n in outs]
            g = fx.Graph()
            env: dict[fx.Node, fx.Node] = {}
            for e in ext:
                p = g.placeholder(e.name)
                p.meta = dict(e.meta)
                env[e] = p
            for n in [x for x in gm.graph.nodes if x in needed_free or x in members]:
                new = g.node_copy(n, lambda a: env[resolve(a)])
                new.meta = dict(n.meta)
                env[n] = new
            g.output(tuple(env[n] for n in used_outside))
            root = torch.nn.Module()
            for n in needed_free:
                if n.op == "get_attr":
                    root.register_buffer(n.target, getattr(gm, n.target), persistent=False)
            sub = make_graph_module(root, g, "GraphModule")    # encoded, never called: no code generated
            sid = self._sid()
            inputs = [value_on(e, slot, stage) for e in ext]
            self.doc["supertasks"][sid] = {"kind": "fx", "inputs": inputs, "outputs": [], "device": slot}
            pending_outputs[sid] = used_outside
            for n in used_outside:
                names[(n, slot)] = f"{n.name}@{slot}"
                if n not in tensors_declared:
                    self.doc["tensors"][f"{n.name}@{slot}"] = _tensor_entry(_meta(n))
                    tensors_declared.add(n)
            self.doc["supertasks"][sid]["outputs"] = [f"{n.name}@{slot}" for n in used_outside]
            self._payloads.setdefault(encode_payload(sub), []).append(sid)
        # comm supertasks
        for k, c in enumerate(seg.comms):
            slot = producer_slot[c]
            comm = c.args[1]
            x = value_on(c.args[0], slot, seg.stage[c])
            y = f"{c.name}@{slot}"
            names[(c, slot)] = y
            self.doc["tensors"][y] = _tensor_entry(_meta(c))
            tensors_declared.add(c)
            sid = self._sid()
            self.doc["supertasks"][sid] = {"kind": comm.kind, "inputs": [x], "outputs": [y], "device": slot,
                                           "group": f"tp{seg.stage[c]}_{k}", "device_idx": rank,
                                           "metadata": comm_metadata(comm)}
        # pipeline outputs
        for spec, n in zip(rg.outputs, outs):
            n = resolve(n)
            slot = producer_slot[n]
            base = spec.name
            if base in self.doc["metadata"]["tensors"]["inputs"]:
                base = f"{base}_new"          # an updated input (a KV cache): outputs get their own tensor names
            name = base if spec.placements is None and rank == 0 else f"{base}_rank{rank}"
            src_name = names[(n, slot)]
            # rename the produced tensor to the output name
            self._rename(src_name, name)
            names[(n, slot)] = name
            self._pipeline_outputs.append(name)
            self.doc["metadata"]["tensors"]["outputs"][spec.name] = {"shape": list(spec.shape), "dtype": spec.dtype, "idx": spec.idx}
            pl = spec.placements or tuple((0, s) for s in spec.shape)
            self.doc["metadata"]["tensor_slices"]["outputs"][name] = {
                "placements": [list(p) for p in pl], "origin": spec.name, "dtype": spec.dtype, "device": slot}

    def _send(self, tensor: str, src: str, dst: str, val, group: str) -> str:
        """A send on `src` paired with a recv on `dst`; returns the received tensor's name."""
        recv = f"{tensor}@{dst}" if "@" not in tensor else f"{tensor.rsplit('@', 1)[0]}@{dst}"
        self.doc["tensors"][recv] = _tensor_entry(val)
        group = f"{group}_{src}_to_{dst}"
        self.doc["supertasks"][self._sid()] = {"kind": "send", "inputs": [tensor], "outputs": [], "device": src,
                                               "group": group, "device_idx": 0, "metadata": {}}
        self.doc["supertasks"][self._sid()] = {"kind": "recv", "inputs": [], "outputs": [recv], "device": dst,
                                               "group": group, "device_idx": 1, "metadata": {}}
        return recv

    @staticmethod
    def _free_closure(ns, free) -> set:
        out, stack = set(), [i for n in ns for i in n.all_input_nodes if i in free]
        while stack:
            f = stack.pop()
            if f not in out:
                out.add(f)
                stack.extend(i for i in f.all_input_nodes if i in free)
        return out

    def _rename(self, old: str, new: str) -> None:
        if old == new:
            return
        if new in self.doc["tensors"]:
            raise BuildError(f"output name {new!r} is used twice")
        self.doc["tensors"][new] = self.doc["tensors"].pop(old)
        for st in self.doc["supertasks"].values():
            st["inputs"] = [new if t == old else t for t in st["inputs"]]
            st["outputs"] = [new if t == old else t for t in st["outputs"]]

    # ------------------------------------------------------------------ finish
    def finish(self) -> dict:
        blobs = {}
        for i, (text, sids) in enumerate(self._payloads.items()):
            if len(sids) > 1:
                bid = "g" + hashlib.sha256(text.encode()).hexdigest()[:12]
                blobs[bid] = text
                for sid in sids:
                    self.doc["supertasks"][sid]["data_blob"] = bid
            else:
                self.doc["supertasks"][sids[0]]["data"] = text
        if blobs:
            self.doc["blobs"] = blobs
        self.doc["supertasks"]["out"] = {"kind": "output", "inputs": list(self._pipeline_outputs), "outputs": []}
        return self.doc
