"""write_pipeline(style="producer" | "producer-2024.1") and Built.save(style=...): what furiosa-llm
writes and its Pipeline.load reads (the producer's loader itself runs in scripts/producer_interop.py;
its results are in docs/format.md). Here: the layout and spellings, the dataflow rules its
validator enforces, and that the rewritten pipeline still means the same thing to fastpipe."""
from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest
import torch
from safetensors.torch import load_file

import fastpipe
from fastpipe.builder.api import build
from fastpipe.errors import FormatError
from fastpipe.format import read_pipeline, write_pipeline
from fastpipe.payload import decode_payload, encode_payload
from fastpipe.payload.torch21 import to_torch21
from tests.examples import EXAMPLES, GRAPHS, copy_example

TOP = ["name", "devices", "tensors", "supertasks", "metadata", "blobs", "param_files", "device_constraints", "version"]


def originals_of(p, inputs: dict) -> dict:
    """The original model's inputs, assembled from the pipeline's inputs by metadata.tensor_slices."""
    out = {}
    for name, s in p.metadata.slices_inputs.items():
        o = p.metadata.tensors_inputs[s.origin]
        full = out.setdefault(s.origin, torch.zeros(o.shape, dtype=inputs[name].dtype))
        full[tuple(slice(a, b) for a, b in s.placements)] = inputs[name]
    return out


def check_layout(doc: dict, folder) -> None:
    assert list(doc) == TOP
    assert doc["version"] == "0.1.0"
    assert all(isinstance(d, str) for d in doc["devices"].values())
    slots_reading = defaultdict(set)
    for sid, st in doc["supertasks"].items():
        assert re.fullmatch(r"0|[1-9][0-9]*", sid), sid
        if st["kind"] in ("input", "output"):
            assert set(st) == {"kind", "inputs", "outputs"}
        elif st["kind"] == "fx":
            assert list(st) == ["kind", "inputs", "outputs", "device", "data", "data_blob"]
            assert (st["data"] is None) != (st["data_blob"] is None)
        else:
            assert list(st) == ["kind", "inputs", "outputs", "device", "group", "device_idx", "metadata"]
            assert isinstance(st["group"], str) and st["group"]
            if "reduce_op" in st["metadata"]:
                op = st["metadata"]["reduce_op"]
                assert op == "RedOpType.SUM" if st["kind"] == "reduce_scatter" else op == 0
        for t in st["inputs"]:
            if "device" in st:
                slots_reading[t].add(st["device"])
    assert all(len(s) == 1 for s in slots_reading.values()), "a tensor read on several slots"
    for t in doc["tensors"].values():
        if "value" in t:
            assert list(t["value"]) == ["param_file", "name", "name_in_graph", "placements"]
            assert t["value"]["param_file"] in doc["param_files"]
    for bid, text in doc["blobs"].items():
        assert text is None and (folder / f"{bid}.fx").is_file()
    io = {st["kind"]: st for st in doc["supertasks"].values() if st["kind"] in ("input", "output")}
    assert set(doc["metadata"]["tensor_slices"]["inputs"]) == set(io["input"]["outputs"])
    assert set(doc["metadata"]["tensor_slices"]["outputs"]) == set(io["output"]["inputs"])


@pytest.mark.parametrize("style", ["producer", "producer-2024.1"])
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_in_producer_style_runs_to_the_same_outputs(name, style, tmp_path):
    src = copy_example(name, tmp_path)
    p = read_pipeline(src)
    out = src.parent / "producer.json"
    write_pipeline(p, out, style=style, rewrite_payload=to_torch21 if style == "producer-2024.1" else None)
    doc = json.loads(out.read_text())
    check_layout(doc, out.parent)
    q = read_pipeline(out)
    inputs_of = {name: s.placements for name, s in q.metadata.slices_inputs.items()}
    assert set(inputs_of) == set(q.input_names), "every pipeline input is described in metadata"
    originals = originals_of(p, load_file(str(src.parent / "inputs.safetensors")))
    want = fastpipe.load(src, device_map=None, processor="reference").run_model(**originals)
    got = fastpipe.load(out, device_map=None, processor="reference").run_model(**originals)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_inputs_and_constants_read_on_several_slots_become_one_per_slot(tmp_path):
    src = copy_example("tp_mlp", tmp_path)
    p = read_pipeline(src)
    shared = [n for n in p.input_names if len({st.device for st in p.supertasks.values() if n in st.inputs}) > 1]
    assert shared, "tp_mlp reads its input on both slots"
    write_pipeline(p, src.parent / "producer.json", style="producer")
    q = read_pipeline(src.parent / "producer.json")
    copies = [n for n in q.input_names if n.startswith(shared[0])]
    assert len(copies) == 2
    assert {q.metadata.slices_inputs[c].origin for c in copies} == {p.metadata.slices_inputs[shared[0]].origin}
    assert {q.metadata.slices_inputs[c].device for c in copies} == {"0", "1"}


def test_a_pipeline_output_another_supertask_reads_is_refused(tmp_path):
    src = copy_example("tp_mlp", tmp_path)
    doc = json.loads(src.read_text())
    reader = next(st for st in doc["supertasks"].values() if st.get("kind") in ("fx", "FX"))
    out_name = next(st for st in doc["supertasks"].values() if st["kind"] == "output")["inputs"][0]
    producer_slot = next(st["device"] for st in doc["supertasks"].values() if out_name in st["outputs"])
    reader = next(st for st in doc["supertasks"].values()
                  if st.get("kind") in ("fx", "FX") and st["device"] == producer_slot and out_name not in st["outputs"])
    reader["inputs"] = reader["inputs"] + [out_name]
    src.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=rf'^tensors\["{out_name}"\]: expected a pipeline output that no supertask reads'):
        write_pipeline(read_pipeline(src), src.parent / "producer.json", style="producer")
    assert not (src.parent / "producer.json").exists()


def test_supertasks_that_exchange_nothing_are_refused(tmp_path):
    """Two slots computing side by side, never communicating: the producer calls them dead."""
    built = build(_Block(), (torch.randn(4, 8),), tp=2)
    with pytest.raises(FormatError, match=r'^supertasks\["\w+"\]: expected a supertask that passes a tensor to or from another'):
        built.save(tmp_path / "out", style="producer")


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_build_save_in_producer_style(tmp_path):
    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    m, x = MLP().eval(), torch.randn(4, 8)
    built = build(m, (x,), tp=2, plan={"fc1": "column", "fc2": "row"})
    path = built.save(tmp_path / "out", style="producer")
    check_layout(json.loads(path.read_text()), path.parent)
    sess = fastpipe.load(path, device_map=None, processor="reference")
    got = sess.run_model(**{next(iter(sess.pipeline.metadata.tensors_inputs)): x})
    (out,) = got.values()
    torch.testing.assert_close(out, m(x).detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="style: expected one of fastpipe, producer, producer-2024.1"):
        built.save(tmp_path / "other", style="furiosa")


def test_cli_build_style_producer(tmp_path, capsys):
    from fastpipe.cli import main

    pytest.importorskip("transformers")
    from tests.hf_models import build_producer_llama

    build_producer_llama(tmp_path)
    doc = json.loads((tmp_path / "out" / "pipeline.json").read_text())
    check_layout(doc, tmp_path / "out")
    assert main(["validate", str(tmp_path / "out" / "pipeline.json")]) == 0


def test_torch21_payloads_mean_the_same(tmp_path):
    """encode -> to_torch21 (what furiosa-llm 2024.1.x reads) -> fastpipe's decoder: same graph,
    including an embedded constant (moved into torch 2.1's `constants`)."""
    scale = torch.linspace(0.5, 1.5, 6)

    def f(x, w):
        y = torch.nn.functional.layer_norm(x @ w.t(), (6,)) * scale
        a, b = torch.split(y, 3, dim=-1)
        return a + b, y.amax(dim=0)

    x, w = torch.randn(4, 5), torch.randn(6, 5)
    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(x, w)
    modern = encode_payload(gm, (x, w))
    old = to_torch21(modern)
    root = json.loads(__import__("base64").b64decode(old))
    assert "metadata" not in root and "custom_obj_values" not in root and root["constants"]
    assert all(set(v) == {"meta"} for v in root["tensor_values"].values())
    g_old, g_new = decode_payload(old, where="old"), decode_payload(modern, where="new")
    for a, b in zip(g_old.gm(x, w), g_new.gm(x, w)):
        torch.testing.assert_close(a, b)
    for a, b in zip(g_new.gm(x, w), f(x, w)):
        torch.testing.assert_close(a, b)
    assert to_torch21(old) == old          # already torch 2.1-spelled: unchanged


def test_unknown_style_is_refused(tmp_path):
    src = copy_example("tp_mlp", tmp_path)
    with pytest.raises(FormatError, match=r"^style: expected one of fastpipe, producer, producer-2024.1, found 'npu'$"):
        write_pipeline(read_pipeline(src), src.parent / "x.json", style="npu")


def test_torch21_style_needs_the_payload_rewriter_handed_in(tmp_path):
    """The format layer imports no payload code: the 2024.1 payload dialect comes from the caller."""
    src = copy_example("tp_mlp", tmp_path)
    with pytest.raises(FormatError, match=r"^rewrite_payload: expected the torch 2.1 payload rewriter for style "
                                          r"'producer-2024.1' \(fastpipe.payload.to_torch21\), found none$"):
        write_pipeline(read_pipeline(src), src.parent / "x.json", style="producer-2024.1")
    assert not (src.parent / "x.json").exists()


def test_side_file_blobs_travel_to_another_folder(tmp_path):
    """seq_parallel keeps its payloads in <blob-id>.fx; written elsewhere, they are copied along."""
    src = GRAPHS / "seq_parallel" / "pipeline.json"
    p = read_pipeline(src)
    dest = tmp_path / "elsewhere"
    dest.mkdir()
    write_pipeline(p, dest / "pipeline.json", style="producer")
    for bid in p.blobs:
        assert (dest / f"{bid}.fx").read_text() == (src.parent / f"{bid}.fx").read_text()


def test_device_constraints_are_written_as_the_producer_writes_them(tmp_path):
    """Its TopologyDeviceConstraint is a field-less dataclass: asdict writes `devices: {}`, and
    its loader reads `{}` but refuses a list of slots."""
    src = copy_example("tp_mlp", tmp_path)
    doc = json.loads(src.read_text())
    doc["device_constraints"] = [{"kind": "ring", "devices": [["0", "1"]]}]
    src.write_text(json.dumps(doc))
    write_pipeline(read_pipeline(src), src.parent / "producer.json", style="producer")
    assert json.loads((src.parent / "producer.json").read_text())["device_constraints"] == [{"kind": "ring", "devices": {}}]
