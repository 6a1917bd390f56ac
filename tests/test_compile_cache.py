"""The compile cache (fastpipe.runtime.compiling.compile.compiled_graph): one compiled graph per payload text,
device, policy and the IDENTITY of the graph's bound constants, held weakly.

The pipelines here have one fx supertask, y = x * c, whose constant c lives in a param file next to
pipeline.json (the payload's constant_saved_info.param_files): two folders with the same
pipeline.json and different c.safetensors have the same payload text and different constants.
Compiling on CPU (inductor) is slow: the graphs are tiny, one or two compiles per test.
"""
from __future__ import annotations

import base64
import gc
import json
import weakref
from pathlib import Path

import torch
from safetensors.torch import save_file

import fastpipe
from fastpipe.builder.assemble import Assembler
from fastpipe.runtime.compiling import compile as comp
from fastpipe.weights import WeightStore

C_A = torch.tensor([1.0, 2.0, 3.0, 4.0])
C_B = torch.tensor([-1.0, 0.5, 10.0, 0.0])
X = torch.arange(8, dtype=torch.float32).reshape(2, 4)


def external_constant_pipeline(folder: Path, c: torch.Tensor) -> Path:
    """y = x * c on one CPU slot, c read from folder/c.safetensors when the pipeline is bound."""
    a = Assembler("external_constant")
    a.slot("0", "cpu:0")
    a.input("x", (2, 4), "f32")
    a.fx("0", lambda x: x * torch.tensor([9.0, 9.0, 9.0, 9.0]), ["x"], ["y"], sid="1")
    a.output(["y"])
    doc = a.to_json()
    g = json.loads(base64.b64decode(doc["supertasks"]["1"]["data"]))
    (attr,) = g["metadata"]["getattr_node_targets"].values()
    info = g["metadata"]["constant_saved_info"]
    info["blob"] = None
    info["param_files"] = {"f": {"path": "c.safetensors", "format": "safetensors"}}
    info["tensor_to_saved_file_id_and_saved_name"] = {attr: ["f", "c"]}
    doc["supertasks"]["1"]["data"] = base64.b64encode(json.dumps(g).encode()).decode()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pipeline.json").write_text(json.dumps(doc))
    save_file({"c": c}, str(folder / "c.safetensors"))
    return folder / "pipeline.json"


def _load(path, store):
    return fastpipe.load(path, processor="cpu", compile=True, compile_policy="raise", store=store)


def test_same_text_other_constants_get_their_own_compiled_graph(tmp_path):
    pa = external_constant_pipeline(tmp_path / "a", C_A)
    pb = external_constant_pipeline(tmp_path / "b", C_B)
    assert pa.read_text() == pb.read_text()               # the same payload text: only the files differ
    store = WeightStore()
    sa, sb = _load(pa, store), _load(pb, store)
    try:
        assert sa._binder.compiled["1"] is not sb._binder.compiled["1"]
        torch.testing.assert_close(sa.run({"x": X})["y"], X * C_A, rtol=0, atol=0)
        torch.testing.assert_close(sb.run({"x": X})["y"], X * C_B, rtol=0, atol=0)
        assert sa.compile_report.graphs == sb.compile_report.graphs == 1
    finally:
        sa.close()
        sb.close()


def test_sessions_over_one_pipeline_and_store_share_one_compiled_graph(tmp_path):
    """Sharing stays (a key on the session or the module would lose it), and stops at other constants."""
    pa = external_constant_pipeline(tmp_path / "a", C_A)
    pb = external_constant_pipeline(tmp_path / "b", C_B)
    store = WeightStore()
    s1, s2, s3 = _load(pa, store), _load(pa, store), _load(pb, store)
    try:
        cg = s1._binder.compiled["1"]
        assert s2._binder.compiled["1"] is cg              # same text, device, policy and store tensor
        assert s3._binder.compiled["1"] is not cg          # same text, another file's tensor
        torch.testing.assert_close(s1.run({"x": X})["y"], X * C_A, rtol=0, atol=0)
        torch.testing.assert_close(s3.run({"x": X})["y"], X * C_B, rtol=0, atol=0)
        torch.testing.assert_close(s2.run({"x": X})["y"], X * C_A, rtol=0, atol=0)
        assert cg.compiled and s2.compile_report.graphs == 1
        s1.close()                                         # the other session still holds (and runs) it
        torch.testing.assert_close(s2.run({"x": X + 1})["y"], (X + 1) * C_A, rtol=0, atol=0)
        assert s2._binder.compiled["1"] is cg
    finally:
        for s in (s1, s2, s3):
            s.close()


def test_closing_every_session_frees_the_compiled_graph_and_its_constants(tmp_path):
    p = external_constant_pipeline(tmp_path / "a", C_A)
    store = WeightStore()
    s1, s2 = _load(p, store), _load(p, store)
    s1.run({"x": X})                                       # compiled: dynamo/inductor hold nothing either
    s2.run({"x": X})
    cg = s1._binder.compiled["1"]
    (const,) = cg.constants
    assert torch.equal(const, C_A)
    w_cg, w_const = weakref.ref(cg), weakref.ref(const)
    live = comp.live_graphs()
    del cg, const
    s1.close()
    assert w_cg() is not None                              # s2 still holds it
    s2.close()
    gc.collect()
    assert w_cg() is None and comp.live_graphs() == live - 1
    # close() also drops the decoded payload graphs (session.checked.graphs), which hold the constant:
    # the session objects may live on
    assert w_const() is None


def test_the_key_is_the_constant_objects_not_their_names():
    """compiled_graph alone (nothing is compiled: a CompiledGraph compiles on its first call)."""
    def module(c: torch.Tensor) -> torch.fx.GraphModule:
        root = torch.nn.Module()
        root.register_buffer("c", c)
        g = torch.fx.Graph()
        x = g.placeholder("x")
        g.output(g.call_function(torch.mul, (x, g.get_attr("c"))))
        return torch.fx.GraphModule(root, g)

    c1, c2 = C_A.clone(), C_A.clone()
    text, dev = "the same payload text", torch.device("cpu")
    a = comp.compiled_graph(text, module(c1), dev, "a", "warn")
    assert comp.compiled_graph(text, module(c1), dev, "b", "warn") is a        # another module, the same tensor
    b = comp.compiled_graph(text, module(c2), dev, "c", "warn")               # an equal tensor, another object
    assert b is not a and b.constants[0] is c2
    assert comp.compiled_graph(text, module(c1), dev, "d", "raise") is not a  # the policy is part of the key
    assert comp.compiled_graph("other text", module(c1), dev, "e", "warn") is not a
    w = weakref.ref(a)
    del a
    gc.collect()
    assert w() is None                                     # the cache does not hold it
    assert comp.compiled_graph(text, module(c1), dev, "f", "warn").constants[0] is c1
