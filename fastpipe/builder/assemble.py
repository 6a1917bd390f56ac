"""Assemble a pipeline.json from plain torch functions (used by graphs/make_examples.py and tests).

    a = Assembler("tp_mlp", version="0.1.0")
    a.slot("0", {"kind": "cpu", "idx": 0})
    a.input("x", (4, 8), "f32")
    a.constant("w1_0", shape=(16, 8), dtype="f32", path="weights.safetensors", name="w1", placements=[[0, 16], [0, 8]])
    a.fx("1", "0", lambda x, w: x @ w.t(), ["x", "w1_0"], ["h_0"])    # traced with make_fx on fake tensors
    a.comm("all_reduce", "g0", [("3", "0", ["p_0"], ["y_0"]), ("4", "1", ["p_1"], ["y_1"])], reduce_op="sum")
    a.output(["y_0"])
    doc = a.to_json()        # plain JSON data; fastpipe.format.parse_pipeline(doc) reads it

Each fx function is traced to an aten graph on fake tensors of the declared
input shapes; the traced outputs declare the output tensors.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fastpipe import dtypes
from fastpipe.format.comm_shapes import comm_output_shape
from fastpipe.payload import encode_payload
from fastpipe.torch_compat import FakeTensorMode, fx_tracing_lock


class Assembler:
    def __init__(self, name: str, *, version: str | None = None):
        self.doc: dict[str, Any] = {"name": name, "devices": {}, "tensors": {}, "supertasks": {},
                                    "metadata": {"tensors": {"inputs": {}, "outputs": {}},
                                                 "tensor_slices": {"inputs": {}, "outputs": {}}}}
        if version is not None:
            self.doc["version"] = version
        self._next = 0
        self.doc["supertasks"]["in"] = {"kind": "input", "inputs": [], "outputs": []}

    def _id(self) -> str:
        self._next += 1
        return str(self._next)

    def slot(self, slot: str, device: Any) -> None:
        self.doc["devices"][slot] = device

    def input(self, name: str, shape: Sequence[int], dtype: str) -> None:
        self.doc["tensors"][name] = {"shape": list(shape), "dtype": dtype}
        self.doc["supertasks"]["in"]["outputs"].append(name)

    def constant(self, name: str, *, shape, dtype: str, name_in_file: str, placements=None, path: str | None = None,
                 format: str = "safetensors", param_file: str | None = None) -> None:
        value: dict[str, Any] = {"name": name_in_file}
        if param_file is not None:
            value["param_file"] = param_file
        else:
            value.update(path=path, format=format)
        if placements is not None:
            value["placements"] = [list(p) for p in placements]
        self.doc["tensors"][name] = {"shape": list(shape), "dtype": dtype, "value": value}

    def param_file(self, fid: str, path: str, format: str = "safetensors") -> None:
        self.doc.setdefault("param_files", {})[fid] = {"path": path, "format": format}

    def _fake_inputs(self, mode: FakeTensorMode, names: Sequence[str]):
        with mode:
            return [torch.empty(self.doc["tensors"][n]["shape"], dtype=dtypes.to_torch(self.doc["tensors"][n]["dtype"]))
                    for n in names]

    def fx(self, slot: str, fn: Callable, inputs: Sequence[str], outputs: Sequence[str], *, sid: str | None = None,
           blob: str | None = None, kind: str = "fx") -> str:
        """Trace ``fn(*inputs) -> tensor | tuple`` and add it as a compute supertask on ``slot``.

        With ``blob``, the payload goes into ``blobs[blob]`` (shared by identical graphs) and the
        supertask refers to it with ``data_blob``.
        """
        mode = FakeTensorMode(allow_non_fake_inputs=False)
        fakes = self._fake_inputs(mode, inputs)

        def flat(*xs):
            out = fn(*xs)
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)

        with fx_tracing_lock():          # FX's tracing state is global: never beside a background compile
            gm = make_fx(flat, tracing_mode="fake")(*fakes)
        return self.graph(slot, gm, inputs, outputs, sid=sid, blob=blob, kind=kind, _fakes=(mode, fakes))

    def graph(self, slot: str, gm: torch.fx.GraphModule, inputs: Sequence[str], outputs: Sequence[str], *,
              sid: str | None = None, blob: str | None = None, kind: str = "fx", _fakes=None) -> str:
        """Add a ready aten-level GraphModule (returning a tuple) as a compute supertask on ``slot``:
        for graphs make_fx would rewrite (a registered foreign op, which tracing decomposes)."""
        if _fakes is None:
            mode = FakeTensorMode(allow_non_fake_inputs=False)
            fakes = self._fake_inputs(mode, inputs)
        else:
            mode, fakes = _fakes
        with mode:
            results = gm(*fakes)
        if len(results) != len(outputs):
            raise ValueError(f"fx supertask on slot {slot}: function returned {len(results)} tensors for {len(outputs)} outputs")
        for name, r in zip(outputs, results):
            self.doc["tensors"][name] = {"shape": list(r.shape), "dtype": dtypes.to_name(r.dtype)}
        data = encode_payload(gm, fakes)
        sid = sid or self._id()
        st: dict[str, Any] = {"kind": kind, "inputs": list(inputs), "outputs": list(outputs), "device": slot}
        if blob is None:
            st["data"] = data
        else:
            blobs = self.doc.setdefault("blobs", {})
            if blobs.get(blob, data) != data:
                raise ValueError(f"blob {blob!r} already holds a different graph")
            blobs[blob] = data
            st["data_blob"] = blob
        self.doc["supertasks"][sid] = st
        return sid

    def comm(self, kind: str, group: str, members: Sequence[tuple[str, Sequence[str], Sequence[str]]],
             *, out_shape: Sequence[int] | None = None, like: str | None = None, first_rank: int = 0,
             **metadata) -> list[str]:
        """Add one comm supertask per member ``(slot, inputs, outputs)`` in device_idx order.

        Output tensors are declared from the kind's semantics applied to the first input
        (or to tensor ``like``), or given by ``out_shape``.
        """
        ids = []
        src_name = like or next(i for _, ins, _ in members for i in ins)
        src_tensor = self.doc["tensors"][src_name]
        n = len(members)
        for rank, (slot, ins, outs) in enumerate(members):
            shape = list(out_shape) if out_shape is not None else list(comm_output_shape(kind, src_tensor["shape"], n, metadata))
            for o in outs:
                self.doc["tensors"][o] = {"shape": shape, "dtype": src_tensor["dtype"]}
            sid = self._id()
            self.doc["supertasks"][sid] = {"kind": kind, "inputs": list(ins), "outputs": list(outs), "device": slot,
                                           "group": group, "device_idx": first_rank + rank, "metadata": dict(metadata)}
            ids.append(sid)
        return ids

    def send_recv(self, group: str, src_slot: str, x: str, dst_slot: str, y: str) -> None:
        """A send on ``src_slot`` (device_idx 0) paired with a recv on ``dst_slot`` (device_idx 1)."""
        self.comm("send", group, [(src_slot, [x], [])])
        self.comm("recv", group, [(dst_slot, [], [y])], like=x, first_rank=1)

    def output(self, names: Sequence[str]) -> None:
        self.doc["supertasks"]["out"] = {"kind": "output", "inputs": list(names), "outputs": []}

    def original_input(self, name: str, shape, dtype: str, idx: int) -> None:
        self.doc["metadata"]["tensors"]["inputs"][name] = {"shape": list(shape), "dtype": dtype, "idx": idx}

    def original_output(self, name: str, shape, dtype: str, idx: int) -> None:
        self.doc["metadata"]["tensors"]["outputs"][name] = {"shape": list(shape), "dtype": dtype, "idx": idx}

    def slice_of(self, side: str, tensor: str, origin: str, placements, slot: str) -> None:
        self.doc["metadata"]["tensor_slices"][side][tensor] = {
            "placements": [list(p) for p in placements], "origin": origin,
            "dtype": self.doc["tensors"][tensor]["dtype"], "device": slot}

    def to_json(self) -> dict[str, Any]:
        doc = dict(self.doc)
        sts = doc["supertasks"]
        doc["supertasks"] = {"in": sts["in"], **{k: v for k, v in sts.items() if k not in ("in", "out")}, "out": sts["out"]}
        return doc

