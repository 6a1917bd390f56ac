"""The producer's side of the interop suite: runs INSIDE a furiosa-llm environment.

Started by scripts/producer_interop.py with the Python of a throwaway venv that
holds the torch, pydantic and transformers versions one furiosa-llm release pins,
and PYTHONPATH holding that release's furiosa-* dependencies (installed with
--no-deps). It never imports fastpipe.

    producer_side.py generate --src SRC --version V --out DIR [--loader-src SRC2]
        build pipelines with the producer's own classes (Pipeline, CompSuperTask,
        CommSuperTask and its single-device comm ops for the metadata), payloads
        with its own serialize_gm, written with its own Pipeline.to_json, saved the
        way its artifact builder saves them; inputs and expected outputs come from
        the unsplit torch module. Each case is then read back with the producer's
        own Pipeline.load and get_gms as a self-check.
    producer_side.py load --src SRC --version V --report OUT.json PIPELINE.json...
        read pipelines written by fastpipe with the producer's Pipeline.load and
        decode (and run) every payload with its get_gms.

SRC is the unzipped furiosa-llm wheel. Its furiosa_llm/__init__.py is not
executed (it imports the serving stack); the package is registered with its real
path so its submodules import as they are.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # furiosa-torch registers an NPU backend

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

NOTES: list[str] = []   # what had to be stood in for or worked around, reported back to the driver


# ----------------------------------------------------------------------------- producer modules
class Producer:
    """The producer's own modules, imported from an unzipped wheel."""

    def __init__(self, src: str, version: str):
        self.version = version
        for name in [m for m in sys.modules if m == "furiosa_llm" or m.startswith("furiosa_llm.")]:
            del sys.modules[name]  # a second release in one process (the loader of another)
        spec = importlib.util.spec_from_file_location(
            "furiosa_llm", os.path.join(src, "furiosa_llm", "__init__.py"),
            submodule_search_locations=[os.path.join(src, "furiosa_llm")])
        sys.modules["furiosa_llm"] = importlib.util.module_from_spec(spec)  # registered, not executed
        self.T = importlib.import_module("furiosa_llm.parallelize.pipeline.types")
        self.comm = importlib.import_module("furiosa_llm.parallelize.model_rewriter.ops.single_device_comm")
        self.ops_types = importlib.import_module("furiosa_llm.parallelize.model_rewriter.ops.types")
        self.mrw = importlib.import_module("furiosa_llm.parallelize.model_rewriter.mppp_config")
        try:
            self.ser = importlib.import_module("furiosa_llm.parallelize.export.graphmodule")
            tensor_mod = importlib.import_module("furiosa_llm.parallelize.export.tensor")
        except ModuleNotFoundError:  # 2024.1.x
            self.ser = importlib.import_module("furiosa_llm.parallelize.pipeline_builder.serialize")
            tensor_mod = self.T
        self.ParamFileInfo = tensor_mod.ParamFileInfo
        self.ParamfileFormat = tensor_mod.ParamfileFormat
        self.include_node_metadata = self._converter_includes_node_metadata(src)
        self._bind_compiled_graph()

    @staticmethod
    def _converter_includes_node_metadata(src: str) -> bool:
        """Whether this release's pipeline converter calls serialize_gm(..., include_node_metadata=True)."""
        for rel in ("parallelize/pipeline/builder/converter.py", "parallelize/pipeline_builder/converter.py"):
            f = Path(src, "furiosa_llm", rel)
            if f.exists():
                return "include_node_metadata=True" in f.read_text()
        return False

    def _bind_compiled_graph(self) -> None:
        """types.py names CompiledGraph only under TYPE_CHECKING, yet Pipeline's annotations
        mention it (2026.x): typing.get_type_hints, and so Pipeline.load, raise NameError on
        every file. Bind the name from the native package that defines it."""
        if "CompiledGraph" not in str(self.T.Pipeline.__annotations__.get("blobs")):
            return
        for mod in ("furiosa.native_common.compiler", "furiosa.native_compiler"):
            try:
                self.T.CompiledGraph = importlib.import_module(mod).CompiledGraph
                NOTES.append(f"bound types.CompiledGraph from {mod} (types.py imports it only under TYPE_CHECKING)")
                return
            except (ImportError, AttributeError):
                continue
        raise RuntimeError("no module provides CompiledGraph")

    # -- construction ---------------------------------------------------------------------------
    def dtype(self, dt: torch.dtype):
        return self.T.Dtype(dt)

    def pipeline_kwargs(self) -> set[str]:
        return {f.name for f in dataclasses.fields(self.T.Pipeline)} | set(
            getattr(self.T.Pipeline.__init__, "__code__").co_varnames)

    def validates_on_construction(self) -> bool:
        return "skip_validation" in self.pipeline_kwargs()


# ----------------------------------------------------------------------------- graphs
def trace(fn, *example) -> torch.fx.GraphModule:
    """An aten-level graph of fn, as the producer's supertask submodules are."""
    return make_fx(fn)(*example)


def serialize(P: Producer, gm: torch.fx.GraphModule) -> str:
    if P.include_node_metadata:
        return P.ser.serialize_gm(gm, include_node_metadata=True)
    return P.ser.serialize_gm(gm)


# ----------------------------------------------------------------------------- a case builder
class Case:
    """One pipeline made of the producer's dataclasses (names as its converter makes them)."""

    def __init__(self, P: Producer, name: str, folder: Path):
        self.P, self.name, self.folder = P, name, folder
        self.devices, self.tensors, self.supertasks = {}, {}, {}
        self.param_files, self.blobs = {}, {}
        self.meta_in, self.meta_out, self.slices_in, self.slices_out = {}, {}, {}, {}
        self.inputs: dict[str, torch.Tensor] = {}
        self.expected: dict[str, torch.Tensor] = {}
        self.blob_of_graph: dict[int, str] = {}
        self.group_ids = 0
        self.has_collectives = False
        self.style: list[str] = []

    @classmethod
    def one_checkpoint(cls, P: Producer, name: str, folder: Path, x: torch.Tensor, y: torch.Tensor,
                       out_name: str = "y") -> "Case":
        """A case whose constants are all in model.safetensors (param file "0"), the original
        model taking x (input 0) and returning `out_name` (output 0)."""
        c = cls(P, name, folder)
        c.param_file("0", "model.safetensors", "safetensors")
        c.original("in", "x", x, 0)
        c.original("out", out_name, y, 0)
        return c

    def _sid(self) -> str:
        return self.P.T.SuperTaskId(str(len(self.supertasks)))

    def slot(self, slot: str, *spellings: str) -> None:
        """The first spelling this release's Device accepts (older ones refuse e.g. `npu:N`)."""
        for i, device in enumerate(spellings):
            try:
                self.devices[self.P.T.DeviceId(slot)] = self.P.T.Device(device)
            except ValueError:
                if i == len(spellings) - 1:
                    raise
                continue
            if i:
                self.style.append(f"device {spellings[0]!r} refused by this release; wrote {device!r}")
            return

    def param_file(self, fid: str, path: str, fmt: str) -> None:
        self.param_files[self.P.T.ParamFileId(fid)] = self.P.ParamFileInfo(path, self.P.ParamfileFormat(fmt))

    def constant(self, name: str, stored: torch.Tensor, fid: str, name_in_file: str, placements) -> None:
        T = self.P.T
        shape = [b - a for a, b in placements]
        value = T.ParamValue(param_file=T.ParamFileId(fid), name=name_in_file, name_in_graph=name,
                             placements=T.Placements([tuple(p) for p in placements]))
        self.tensors[T.NameAfterMakeFx(name)] = T.ParamInfo(shape=shape, dtype=self.P.dtype(stored.dtype), value=value)

    def tensor(self, name: str, shape, dtype: torch.dtype) -> None:
        self.tensors[self.P.T.NameAfterMakeFx(name)] = self.P.T.TensorInfo(shape=list(shape), dtype=self.P.dtype(dtype))

    def original(self, direction: str, name: str, value: torch.Tensor, idx: int) -> None:
        T = self.P.T
        table = self.meta_in if direction == "in" else self.meta_out
        table[T.NameBeforeTransform(name)] = T.MetadataTensor(shape=list(value.shape), dtype=self.P.dtype(value.dtype), idx=idx)

    def piece(self, direction: str, name: str, origin: str, full: torch.Tensor, placements, slot: str) -> torch.Tensor:
        """A pipeline input/output that is origin[placements] on slot (metadata.tensor_slices)."""
        T = self.P.T
        part = full[tuple(slice(a, b) for a, b in placements)].clone()
        self.tensor(name, part.shape, part.dtype)
        table = self.slices_in if direction == "in" else self.slices_out
        table[T.NameAfterMakeFx(name)] = T.MetadataTensorSlice(
            placements=T.Placements([tuple(p) for p in placements]), origin=origin,
            dtype=self.P.dtype(full.dtype), device=T.DeviceId(slot))
        (self.inputs if direction == "in" else self.expected)[name] = part
        return part

    def compute(self, slot: str, inputs, outputs, gm: torch.fx.GraphModule, *, how: str, shared_key=None) -> None:
        """how: "data" (payload inline), "blob" (data_blob + blobs; saved as <id>.fx when the
        release's artifact builder does so)."""
        T = self.P.T
        kind = T.SuperTaskKind.FX
        common = dict(kind=kind, inputs=[T.NameAfterMakeFx(i) for i in inputs],
                      outputs=[T.NameAfterMakeFx(o) for o in outputs], device=T.DeviceId(slot))
        if how == "data":
            st = T.CompSuperTask(data=serialize(self.P, gm), **common)
        else:
            key = shared_key if shared_key is not None else id(gm)
            if key not in self.blob_of_graph:
                bid = T.DataBlobId(str(len(self.blob_of_graph)))
                self.blob_of_graph[key] = bid
                self.blobs[bid] = serialize(self.P, gm)
            st = T.CompSuperTask(data_blob=self.blob_of_graph[key], **common)
        self.supertasks[self._sid()] = st

    def comm(self, members: list[tuple[str, list[str], list[str]]], make_op) -> None:
        """members: (slot, inputs, outputs) per participant in group order; make_op(group,
        device_id, rank) -> the producer's SingleDeviceCommOp for that participant."""
        T, mrw = self.P.T, self.P.mrw
        group = self.P.ops_types.CommGroup(self.group_ids, tuple(mrw.DeviceId(int(s)) for s, _, _ in members))
        self.group_ids += 1
        device_id_map = {mrw.DeviceId(int(s)): T.DeviceId(s) for s in self.devices}
        for rank, (slot, ins, outs) in enumerate(members):
            op = make_op(group, mrw.DeviceId(int(slot)), rank)
            # as the producer's GraphModuleConverter writes a CommSuperTask
            metadata = {k: device_id_map[v] if isinstance(v, mrw.DeviceId) else v for k, v in op.metadata().items()}
            kind = op.kind()
            if kind not in (T.SuperTaskKind.SEND, T.SuperTaskKind.RECV):
                self.has_collectives = True
            self.supertasks[self._sid()] = T.CommSuperTask(
                kind=kind, inputs=[T.NameAfterMakeFx(i) for i in ins], outputs=[T.NameAfterMakeFx(o) for o in outs],
                device=T.DeviceId(slot), group=str(group.id), device_idx=group.index(mrw.DeviceId(int(slot))),
                metadata=metadata)

    def io(self, inputs: list[str], outputs: list[str]) -> None:
        T = self.P.T
        sts = {T.SuperTaskId("input"): T.InOutputSuperTask(kind=T.SuperTaskKind.INPUT, inputs=[], outputs=list(inputs))}
        sts.update(self.supertasks)
        sts[T.SuperTaskId("output")] = T.InOutputSuperTask(kind=T.SuperTaskKind.OUTPUT, inputs=list(outputs), outputs=[])
        # the producer's ids are consecutive integers in creation order: input first, output last
        self.supertasks = {T.SuperTaskId(str(i)): st for i, st in enumerate(sts.values())}

    def pipeline(self):
        T, P = self.P.T, self.P
        md = T.MetaData(tensors=T.MetadataTensors(inputs=self.meta_in, outputs=self.meta_out),
                        tensor_slices=T.MetadataTensorSlices(inputs=self.slices_in, outputs=self.slices_out))
        kwargs = dict(name=self.name, devices=self.devices, tensors=self.tensors, supertasks=self.supertasks,
                      metadata=md, blobs=dict(self.blobs), param_files=self.param_files, device_constraints=[],
                      version=T.SCHEMA_VERSION)
        if P.validates_on_construction() and self.has_collectives:
            # its validate_comm_supertasks refuses every collective but send/recv, its own ones included
            kwargs["skip_validation"] = True
            self.style.append("built with skip_validation=True: the release's validate_comm_supertasks refuses collectives")
        return T.Pipeline(**kwargs)


# ----------------------------------------------------------------------------- saving as the producer does
def blobs_as_side_files(P: Producer) -> bool:
    """Releases whose Pipeline.blobs values are Optional (2026.x) keep payloads in <blob-id>.fx
    beside the pipeline: their loader refuses an inline blob. Older loaders read both (and their
    artifact builders write side files too)."""
    annotation = str(P.T.Pipeline.__annotations__.get("blobs"))
    return "None" in annotation or "Optional" in annotation


def save_case(case: Case, pipeline, side_files: bool) -> None:
    """Pipeline.to_json (dataclasses.asdict, every optional field present as null), with FX blobs
    moved to <blob-id>.fx and null in the JSON when side_files, as ArtifactBuilder saves them."""
    folder = case.folder
    if side_files and pipeline.blobs:
        for bid, text in list(pipeline.blobs.items()):
            (folder / f"{bid}.fx").write_text(text)
            pipeline.blobs[bid] = None
        case.style.append("blobs saved as <blob-id>.fx, null in the JSON (artifact form)")
    (folder / "pipeline.json").write_text(pipeline.to_json() + "\n")
    save_file({k: v.contiguous() for k, v in case.inputs.items()}, str(folder / "inputs.safetensors"))
    save_file({k: v.contiguous() for k, v in case.expected.items()}, str(folder / "expected.safetensors"))


# ----------------------------------------------------------------------------- the cases
def _rows(n: int, parts: int, r: int) -> tuple[int, int]:
    return n // parts * r, n // parts * (r + 1)


def case_tp_mlp_all_reduce(P: Producer, folder: Path) -> Case:
    """Tensor-parallel MLP on 2 slots: column fc1, row fc2, all_reduce(sum), bias added after.
    Payloads inline in `data` (data_blob null); the input is read on both slots, so it is two
    pipeline inputs tied to one original input through metadata; replicated outputs."""
    torch.manual_seed(0)
    B, D, H, n = 4, 16, 32, 2
    fc1, fc2 = torch.nn.Linear(D, H), torch.nn.Linear(H, D)
    x = torch.randn(B, D)
    y = fc2(F.relu(fc1(x))).detach()
    weights = {"fc1.weight": fc1.weight.detach(), "fc1.bias": fc1.bias.detach(),
               "fc2.weight": fc2.weight.detach(), "fc2.bias": fc2.bias.detach()}
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    c = Case.one_checkpoint(P, "tp_mlp_all_reduce", folder, x, y)
    ins, outs = [], []
    for r in range(n):
        s = str(r)
        c.slot(s, f"npu:{r}:0-3")
        lo, hi = _rows(H, n, r)
        c.constant(f"w1_{r}", weights["fc1.weight"], "0", "fc1.weight", [(lo, hi), (0, D)])
        c.constant(f"b1_{r}", weights["fc1.bias"], "0", "fc1.bias", [(lo, hi)])
        c.constant(f"w2_{r}", weights["fc2.weight"], "0", "fc2.weight", [(0, D), (lo, hi)])
        c.constant(f"b2_{r}", weights["fc2.bias"], "0", "fc2.bias", [(0, D)])
        xr = c.piece("in", f"x_{r}", "x", x, [(0, B), (0, D)], s)
        ins.append(f"x_{r}")
        w1, b1, w2 = weights["fc1.weight"][lo:hi], weights["fc1.bias"][lo:hi], weights["fc2.weight"][:, lo:hi]
        gm = trace(lambda x_, w1_, b1_, w2_: torch.mm(F.relu(torch.addmm(b1_, x_, w1_.t())), w2_.t()), xr, w1, b1, w2)
        c.tensor(f"partial_{r}", (B, D), torch.float32)
        c.compute(s, [f"x_{r}", f"w1_{r}", f"b1_{r}", f"w2_{r}"], [f"partial_{r}"], gm, how="data")
        c.tensor(f"summed_{r}", (B, D), torch.float32)
    c.comm([(str(r), [f"partial_{r}"], [f"summed_{r}"]) for r in range(n)],
           lambda g, dev, rank: P.comm.AllReduceSingle(dev, P.mrw.ReduceOp.SUM, g))
    for r in range(n):
        c.piece("out", f"y_{r}", "y", y, [(0, B), (0, D)], str(r))
        gm = trace(lambda s_, b_: s_ + b_, torch.zeros(B, D), weights["fc2.bias"])
        c.compute(str(r), [f"summed_{r}", f"b2_{r}"], [f"y_{r}"], gm, how="data")
        outs.append(f"y_{r}")
    c.io(ins, outs)
    return c


def case_two_stage_send_recv(P: Producer, folder: Path) -> Case:
    """Two pipeline stages (send/recv) in bf16. Stage 1's weights in safetensors, stage 2's in a
    torch.save file; stage 1's graph holds an embedded constant (a get_attr tensor the
    serializer stores in the payload's constant blob). Artifact form: payloads in blobs."""
    torch.manual_seed(1)
    B, D, H = 4, 16, 24
    bf = torch.bfloat16
    fc1, fc2 = torch.nn.Linear(D, H).to(bf), torch.nn.Linear(H, D).to(bf)
    scale = (torch.arange(H, dtype=torch.float32) / H + 0.5).to(bf)
    x = torch.randn(B, D).to(bf)

    def stage1(x_, w_, b_):
        return F.gelu(torch.addmm(b_, x_, w_.t())) * scale  # scale: a constant inside the graph

    def stage2(h_, w_, b_):
        return torch.softmax(torch.addmm(b_, h_, w_.t()), dim=-1)

    w1, b1, w2, b2 = (t.detach() for t in (fc1.weight, fc1.bias, fc2.weight, fc2.bias))
    y = stage2(stage1(x, w1, b1), w2, b2)
    save_file({"fc1.weight": w1.contiguous(), "fc1.bias": b1.contiguous()}, str(folder / "stage1.safetensors"))
    torch.save({"fc2.weight": w2.clone(), "fc2.bias": b2.clone()}, str(folder / "stage2.pt"))
    c = Case(P, "two_stage_send_recv", folder)
    c.param_file("0", "stage1.safetensors", "safetensors")
    c.param_file("1", "stage2.pt", "torch.save")
    c.slot("0", "npu:0:*")
    c.slot("1", "npu:1:*")
    c.original("in", "x", x, 0)
    c.original("out", "y", y, 0)
    c.constant("w1", w1, "0", "fc1.weight", [(0, H), (0, D)])
    c.constant("b1", b1, "0", "fc1.bias", [(0, H)])
    c.constant("w2", w2, "1", "fc2.weight", [(0, D), (0, H)])
    c.constant("b2", b2, "1", "fc2.bias", [(0, D)])
    c.piece("in", "x", "x", x, [(0, B), (0, D)], "0")
    c.tensor("h", (B, H), bf)
    c.compute("0", ["x", "w1", "b1"], ["h"], trace(stage1, x, w1, b1), how="blob")
    c.tensor("h_recv", (B, H), bf)
    c.comm([("0", ["h"], []), ("1", [], ["h_recv"])],
           lambda g, dev, rank: P.comm.Send(g[0], g[1], g) if rank == 0 else
           P.comm.Recv(g[0], g[1], g, torch.device("cpu"), None))
    c.piece("out", "y", "y", y, [(0, B), (0, D)], "1")
    c.compute("1", ["h_recv", "w2", "b2"], ["y"], trace(stage2, torch.zeros(B, H, dtype=bf), w2, b2), how="blob")
    c.io(["x"], ["y"])
    return c


def case_seq_parallel(P: Producer, folder: Path) -> Case:
    """Sequence parallelism on 2 slots: all_gather(dim 0) of the sequence shards, column/row
    linears, reduce_scatter(sum, dim 0) back to shards. One graph shared by both slots
    through data_blob; outputs are shards of the original output."""
    torch.manual_seed(2)
    S, D, H, n = 8, 16, 32, 2
    fc1, fc2 = torch.nn.Linear(D, H, bias=False), torch.nn.Linear(H, D, bias=False)
    x = torch.randn(S, D)
    y = fc2(torch.tanh(fc1(x))).detach()
    w1, w2 = fc1.weight.detach(), fc2.weight.detach()
    save_file({"fc1.weight": w1.contiguous(), "fc2.weight": w2.contiguous()}, str(folder / "model.safetensors"))
    c = Case.one_checkpoint(P, "seq_parallel", folder, x, y)
    ins, outs = [], []
    for r in range(n):
        s = str(r)
        c.slot(s, f"npu:{r}", f"npu:{r}:*")
        lo, hi = _rows(H, n, r)
        c.constant(f"w1_{r}", w1, "0", "fc1.weight", [(lo, hi), (0, D)])
        c.constant(f"w2_{r}", w2, "0", "fc2.weight", [(0, D), (lo, hi)])
        qlo, qhi = _rows(S, n, r)
        c.piece("in", f"x_{r}", "x", x, [(qlo, qhi), (0, D)], s)
        ins.append(f"x_{r}")
        c.tensor(f"xfull_{r}", (S, D), torch.float32)
    c.comm([(str(r), [f"x_{r}"], [f"xfull_{r}"]) for r in range(n)],
           lambda g, dev, rank: P.comm.AllGatherSingle(dev, 0, g))
    gm = trace(lambda x_, a_, b_: torch.mm(torch.tanh(torch.mm(x_, a_.t())), b_.t()),
               torch.zeros(S, D), w1[: H // n], w2[:, : H // n])
    for r in range(n):
        c.tensor(f"partial_{r}", (S, D), torch.float32)
        c.compute(str(r), [f"xfull_{r}", f"w1_{r}", f"w2_{r}"], [f"partial_{r}"], gm, how="blob", shared_key="mlp")
    for r in range(n):
        qlo, qhi = _rows(S, n, r)
        c.piece("out", f"y_{r}", "y", y, [(qlo, qhi), (0, D)], str(r))
        outs.append(f"y_{r}")
    c.comm([(str(r), [f"partial_{r}"], [f"y_{r}"]) for r in range(n)],
           lambda g, dev, rank: P.comm.ReduceScatterSingle(dev, P.mrw.ReduceOp.SUM, 0, g))
    c.io(ins, outs)
    return c


def case_gather_reduce(P: Producer, folder: Path) -> Case:
    """Column-parallel block on 4 slots with one shared graph (data_blob); its shards are
    gathered (dim 1) onto slot 0 and a second, row-parallel block is reduced (sum) onto slot 2."""
    torch.manual_seed(3)
    B, D, H, n = 2, 8, 16, 4
    fc1, fc2 = torch.nn.Linear(D, H), torch.nn.Linear(H, D, bias=False)
    x = torch.randn(B, D)
    h = F.silu(fc1(x)).detach()
    z = fc2(h).detach()
    w1, b1, w2 = fc1.weight.detach(), fc1.bias.detach(), fc2.weight.detach()
    save_file({"fc1.weight": w1.contiguous(), "fc1.bias": b1.contiguous(), "fc2.weight": w2.contiguous()},
              str(folder / "model.safetensors"))
    c = Case.one_checkpoint(P, "gather_reduce", folder, x, h, out_name="h")
    c.original("out", "z", z, 1)
    col = trace(lambda x_, w_, b_: F.silu(torch.addmm(b_, x_, w_.t())), x, w1[: H // n], b1[: H // n])
    row = trace(lambda h_, w_: torch.mm(h_, w_.t()), torch.zeros(B, H // n), w2[:, : H // n])
    for r in range(n):
        s = str(r)
        c.slot(s, f"npu:{r // 2}:{(r % 2) * 4}-{(r % 2) * 4 + 3}")
        lo, hi = _rows(H, n, r)
        c.constant(f"w1_{r}", w1, "0", "fc1.weight", [(lo, hi), (0, D)])
        c.constant(f"b1_{r}", b1, "0", "fc1.bias", [(lo, hi)])
        c.constant(f"w2_{r}", w2, "0", "fc2.weight", [(0, D), (lo, hi)])
        c.piece("in", f"x_{r}", "x", x, [(0, B), (0, D)], s)
        c.tensor(f"hs_{r}", (B, H // n), torch.float32)
        c.compute(s, [f"x_{r}", f"w1_{r}", f"b1_{r}"], [f"hs_{r}"], col, how="blob", shared_key="col")
        c.tensor(f"zp_{r}", (B, D), torch.float32)
        c.compute(s, [f"hs_{r}", f"w2_{r}"], [f"zp_{r}"], row, how="blob", shared_key="row")
    c.piece("out", "h", "h", h, [(0, B), (0, H)], "0")
    c.comm([(str(r), [f"hs_{r}"], ["h"] if r == 0 else []) for r in range(n)],
           lambda g, dev, rank: P.comm.GatherSingle(g[0], 1, dev, g))
    c.piece("out", "z", "z", z, [(0, B), (0, D)], "2")
    c.comm([(str(r), [f"zp_{r}"], ["z"] if r == 2 else []) for r in range(n)],
           lambda g, dev, rank: P.comm.ReduceSingle(P.mrw.ReduceOp.SUM, g[2], dev, g))
    c.io([f"x_{r}" for r in range(n)], ["h", "z"])
    return c


def case_broadcast_all_to_all(P: Producer, folder: Path) -> Case:
    """Slot 0 broadcasts its input to 2 slots, each scales its copy, then all_to_all(src_dim 1,
    dst_dim 0) exchanges halves. Devices spelled cpu:N."""
    torch.manual_seed(4)
    B, D, n = 4, 8, 2
    x = torch.randn(B, D)
    scales = torch.tensor([[1.5], [-2.0]])
    copies = [x * scales[r] for r in range(n)]
    ys = [torch.cat([torch.chunk(copies[j], n, dim=1)[i] for j in range(n)], dim=0) for i in range(n)]
    y = torch.cat(ys, dim=0)
    save_file({"scales": scales.contiguous()}, str(folder / "model.safetensors"))
    c = Case.one_checkpoint(P, "broadcast_all_to_all", folder, x, y)
    for r in range(n):
        c.slot(str(r), f"cpu:{r}")
    c.piece("in", "x", "x", x, [(0, B), (0, D)], "0")
    for r in range(n):
        c.tensor(f"xb_{r}", (B, D), torch.float32)
    c.comm([(str(r), ["x"] if r == 0 else [], [f"xb_{r}"]) for r in range(n)],
           lambda g, dev, rank: P.comm.BroadcastSingle(g[0], None, torch.device("cpu"), dev, g))
    gm = trace(lambda a_, s_: a_ * s_, x, scales[0:1])
    for r in range(n):
        c.constant(f"s_{r}", scales, "0", "scales", [(r, r + 1), (0, 1)])
        c.tensor(f"xs_{r}", (B, D), torch.float32)
        c.compute(str(r), [f"xb_{r}", f"s_{r}"], [f"xs_{r}"], gm, how="blob", shared_key="scale")
    for r in range(n):
        c.piece("out", f"y_{r}", "y", y, [(r * n * B, (r + 1) * n * B), (0, D // n)], str(r))
    c.comm([(str(r), [f"xs_{r}"], [f"y_{r}"]) for r in range(n)],
           lambda g, dev, rank: P.comm.AllToAllSingle(1, 0, dev, g))
    c.io(["x"], [f"y_{r}" for r in range(n)])
    return c


def case_newest_spellings(P: Producer, folder: Path) -> Case:
    """The newest spellings this release writes: dtype f8e4m3fn (2026.1+), else bf16; an
    `rngd:N:K` device (2025.1+) and a comma-joined multi-chip device (2025.3+), each falling back
    to `npu:N:*` where the release refuses it. Two stages over send/recv. (f16: 2025.3+ writes
    `f16`, but no release's Dtype.to_torch_dtype reads it back, so its own get_gms fails on such
    a pipeline; fastpipe's tests cover f16 without the producer.)"""
    torch.manual_seed(5)
    B, D = 4, 8
    for dt in (torch.float8_e4m3fn, torch.bfloat16):
        try:
            if P.dtype(dt).to_torch_dtype() == dt:
                break
        except (AssertionError, KeyError, ValueError, NotImplementedError):
            continue
    x = (torch.randn(B, D) * 2).to(dt)
    w = (torch.rand(D) + 0.5).to(dt)

    def stage1(x_, w_):
        return (x_.float() * w_.float()).to(dt)

    def stage2(h_):
        return (h_.float() + 1.0).to(dt)

    y = stage2(stage1(x, w))
    save_file({"w": w.contiguous()}, str(folder / "model.safetensors"))
    c = Case(P, "newest_spellings", folder)
    c.style.append(f"dtype {P.dtype(dt)}")
    c.param_file("0", "model.safetensors", "safetensors")
    c.slot("0", "rngd:0:4", "npu:0:*")
    c.slot("1", "npu:1,npu:2", "npu:1:*")
    c.original("in", "x", x, 0)
    c.original("out", "y", y, 0)
    c.constant("w", w, "0", "w", [(0, D)])
    c.piece("in", "x", "x", x, [(0, B), (0, D)], "0")
    c.tensor("h", (B, D), dt)
    c.compute("0", ["x", "w"], ["h"], trace(stage1, x, w), how="data")
    c.tensor("h_recv", (B, D), dt)
    c.comm([("0", ["h"], []), ("1", [], ["h_recv"])],
           lambda g, dev, rank: P.comm.Send(g[0], g[1], g) if rank == 0 else
           P.comm.Recv(g[0], g[1], g, torch.device("cpu"), None))
    c.piece("out", "y", "y", y, [(0, B), (0, D)], "1")
    c.compute("1", ["h_recv"], ["y"], trace(stage2, x), how="data")
    c.io(["x"], ["y"])
    return c


CASES = {
    "tp_mlp_all_reduce": case_tp_mlp_all_reduce,
    "two_stage_send_recv": case_two_stage_send_recv,
    "seq_parallel": case_seq_parallel,
    "gather_reduce": case_gather_reduce,
    "broadcast_all_to_all": case_broadcast_all_to_all,
    "newest_spellings": case_newest_spellings,
}


# ----------------------------------------------------------------------------- reading back
def _skip_comm_check(T):
    """The release's own Pipeline.validate_comm_supertasks (2025.1+) refuses every collective
    but send/recv; replaced by a no-op while loading pipelines that have them."""
    original = getattr(T.Pipeline, "validate_comm_supertasks", None)
    if original is not None:
        T.Pipeline.validate_comm_supertasks = lambda self: None
    return original


def _example(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=dtype)
    return torch.randint(0, 8, shape, generator=gen).to(dtype)


def producer_load(P: Producer, path: Path, record: Path | None = None) -> dict:
    """Pipeline.load as the producer's LLM.from_artifacts uses it, then get_gms on every payload;
    each decoded graph runs on the real constants (where its loader reads them) and seeded random
    activations. With `record`, each graph's inputs and outputs are saved there as
    <supertask-id>.safetensors."""
    T = P.T
    doc = json.loads(path.read_text())
    collectives = any(st.get("kind") not in ("input", "output", "fx", "dfg", "edf", "send", "recv")
                      for st in doc.get("supertasks", {}).values())
    notes = []
    original = _skip_comm_check(T) if collectives else None
    if original is not None:
        notes.append("validate_comm_supertasks skipped (it refuses collectives)")
    cwd = os.getcwd()
    try:
        pipeline = T.Pipeline.load(str(path))
        # as LLM.from_artifacts does: null (or "None") blobs are read from <blob-id>.fx
        for bid in list(pipeline.blobs):
            if pipeline.blobs[bid] in (None, "None"):
                pipeline.blobs[bid] = (path.parent / f"{bid}.fx").read_text()
        os.chdir(path.parent)  # its loader opens param files relative to the working directory
        fx_ids = sorted((sid for sid, st in pipeline.supertasks.items() if st.kind == T.SuperTaskKind.FX), key=int)
        if hasattr(pipeline, "get_gms"):
            loads_weights = all(pf.format == P.ParamfileFormat.SAFETENSORS for pf in pipeline.param_files.values())
            gms = pipeline.get_gms(get_input_constants=loads_weights)
            if not loads_weights:
                notes.append("get_gms without constants (its load_partial_param reads safetensors only)")
        else:  # 2024.1.x: no get_gms; its LLM decodes each payload with deserialize_gm
            loads_weights = False
            gms = []
            for sid in fx_ids:
                st = pipeline.supertasks[sid]
                gms.append(P.ser.deserialize_gm(st.data if st.data is not None else pipeline.blobs[st.data_blob]))
            notes.append("decoded with deserialize_gm (this release has no Pipeline.get_gms)")
        ran = 0
        gen = torch.Generator().manual_seed(0)
        for sid, item in zip(fx_ids, gms):
            st = pipeline.supertasks[sid]
            gm, consts = item if loads_weights else (item, (None,) * len(st.inputs))
            args = []
            for name, const in zip(st.inputs, consts):
                info = pipeline.tensors[name]
                args.append(const if const is not None else _example(info.shape, info.dtype.to_torch_dtype(), gen))
            out = gm(*args)
            out = out if isinstance(out, (tuple, list)) else (out,)
            shapes = [list(o.shape) for o in out]
            want = [list(pipeline.tensors[o].shape) for o in st.outputs]
            if shapes != want:
                raise AssertionError(f"supertask {sid}: decoded graph gives shapes {shapes}, the pipeline declares {want}")
            if record is not None:   # for the driver to run fastpipe's decoding of the same payload on them
                tensors = {f"in{i}": a.contiguous() for i, a in enumerate(args)}
                tensors.update({f"out{i}": o.detach().contiguous() for i, o in enumerate(out)})
                save_file({k: v.clone() for k, v in tensors.items()}, str(record / f"{sid}.safetensors"))
            ran += 1
        return {"ok": True, "graphs": len(gms), "ran": ran, "notes": notes}
    except Exception as exc:  # reported, not raised: the driver prints every rejection
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:400],
                "trace": traceback.format_exc(limit=-4), "notes": notes}
    finally:
        os.chdir(cwd)
        if original is not None:
            T.Pipeline.validate_comm_supertasks = original


def standins_imported() -> list[str]:
    """Modules imported from the driver's stand-in folder (what a CPU machine cannot provide)."""
    return sorted(name for name, mod in list(sys.modules.items())
                  if f"{os.sep}standins{os.sep}" in str(getattr(mod, "__file__", "") or ""))


# ----------------------------------------------------------------------------- entry points
def generate(args) -> int:
    P = Producer(args.src, args.version)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"producer": args.version, "torch": torch.__version__, "python": sys.version.split()[0],
                "serialize_gm_include_node_metadata": P.include_node_metadata, "cases": {}}
    side = blobs_as_side_files(P)
    for name, make in CASES.items():           # every case made with this release's code ...
        folder = out / name
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        case = make(P, folder)
        save_case(case, case.pipeline(), side_files=side or name in SIDE_FILE_CASES)
        manifest["cases"][name] = {"style": case.style}
    NOTES.extend(f"imported a stand-in for {name}" for name in standins_imported())
    # ... then read back with its own loader (or, where that is broken, another release's, imported
    # only now: importing it replaces this release's modules)
    checker = P
    if args.loader_src:
        checker = Producer(args.loader_src, args.version)
        NOTES.append(f"self-check read with the loader of {Path(args.loader_src).name}")
    failures = 0
    for name in CASES:
        check = producer_load(checker, out / name / "pipeline.json")
        manifest["cases"][name]["self_check"] = {k: v for k, v in check.items() if k != "trace"}
        if not check["ok"]:
            failures += 1
            print(f"{args.version} {name}: the producer's own loader refused it: {check['error']}\n{check['trace']}",
                  file=sys.stderr)
    manifest["notes"] = sorted(set(NOTES))
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 1 if failures else 0


# Artifact form for these; the others keep blobs inline where the release's loader reads them.
SIDE_FILE_CASES = {"two_stage_send_recv", "gather_reduce"}


def load(args) -> int:
    P = Producer(args.src, args.version)
    results = {}
    for i, p in enumerate(args.pipelines):
        record = Path(args.record) / str(i) if args.record else None
        if record is not None:
            record.mkdir(parents=True, exist_ok=True)
        results[str(p)] = dict(producer_load(P, Path(p), record), record=str(record) if record else None)
    NOTES.extend(f"imported a stand-in for {name}" for name in standins_imported())
    Path(args.report).write_text(json.dumps({"producer": args.version, "torch": torch.__version__,
                                             "notes": sorted(set(NOTES)), "results": results}, indent=1) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--src", required=True)
    g.add_argument("--version", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--loader-src", help="read the cases back with this release's loader instead")
    l_ = sub.add_parser("load")
    l_.add_argument("--src", required=True)
    l_.add_argument("--version", required=True)
    l_.add_argument("--report", required=True)
    l_.add_argument("--record", help="save each decoded graph's inputs and outputs under this folder")
    l_.add_argument("pipelines", nargs="+")
    args = ap.parse_args()
    return generate(args) if args.cmd == "generate" else load(args)


if __name__ == "__main__":
    sys.exit(main())
