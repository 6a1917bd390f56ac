"""The Python API and the reference runtime, against the unsplit modules on fresh random inputs."""
import json

import pytest
import torch
from safetensors.torch import load_file

import fastpipe
from fastpipe.errors import InputError, RunError
from fastpipe.format import read_pipeline
from tests.examples import EXAMPLES, GRAPHS, copy_example, unsplit_module


def _slice(t, placements):
    return t[tuple(slice(a, b) for a, b in placements)]


def model_level_run(name, seed):
    """Fresh original inputs -> pipeline inputs by metadata.tensor_slices -> run -> compare with the module."""
    p = read_pipeline(GRAPHS / name / "pipeline.json")
    g = torch.Generator().manual_seed(seed)
    originals = sorted(p.metadata.tensors_inputs.items(), key=lambda kv: kv[1].idx)
    args = [torch.randn(o.shape, generator=g) + (1.0 if n == "scale" else 0.0) for n, o in originals]
    by_name = dict(zip((n for n, _ in originals), args))
    inputs = {t: _slice(by_name[s.origin], s.placements).contiguous() for t, s in p.metadata.slices_inputs.items()}
    outs = fastpipe.load(GRAPHS / name / "pipeline.json").run(inputs)
    with torch.no_grad():
        expected = unsplit_module(name)(*args)
    return p, outs, expected


@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("seed", [11, 12])
def test_example_equals_unsplit_module(name, seed):
    p, outs, expected = model_level_run(name, seed)
    assert set(outs) == set(p.output_names)
    for t, s in p.metadata.slices_outputs.items():
        torch.testing.assert_close(outs[t], _slice(expected, s.placements), rtol=1e-4, atol=1e-5)


def test_examples_cover_every_comm_kind():
    kinds = set()
    for name in EXAMPLES:
        kinds |= {st.kind for st in read_pipeline(GRAPHS / name / "pipeline.json").supertasks.values()}
    assert {"send", "recv", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "reduce", "broadcast", "gather"} <= kinds
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("name", EXAMPLES)
def test_stored_expected_outputs(name):
    sess = fastpipe.load(GRAPHS / name / "pipeline.json")
    outs = sess.run(load_file(str(GRAPHS / name / "inputs.safetensors")))
    for k, v in load_file(str(GRAPHS / name / "expected.safetensors")).items():
        torch.testing.assert_close(outs[k], v, rtol=1e-4, atol=1e-5)


def test_repeated_runs_with_new_inputs_and_fresh_outputs():
    sess = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json")
    m = unsplit_module("tp_mlp")
    first = None
    for seed in range(3):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(seed))
        y = sess.run({"x": x})["y"]
        with torch.no_grad():
            torch.testing.assert_close(y, m(x), rtol=1e-4, atol=1e-5)
        if first is None:
            first, kept = y, y.clone()
    assert torch.equal(first, kept), "an earlier output was overwritten by a later run"


def test_device_map_override_and_errors():
    sess = fastpipe.load(GRAPHS / "two_stage_skip" / "pipeline.json", device_map={"0": "cpu", "1": "cpu"})
    assert {str(d) for d in sess.slot_devices.values()} == {"cpu"}
    with pytest.raises(InputError, match=r'^device_map\["9"\]: expected a slot of the pipeline \(0, 1\), found "9"$'):
        fastpipe.load(GRAPHS / "two_stage_skip" / "pipeline.json", device_map={"9": "cpu"})
    with pytest.raises(InputError, match=r'^device_map\["0"\]: expected cpu or cuda\[:N\], found "meta"$'):
        fastpipe.load(GRAPHS / "two_stage_skip" / "pipeline.json", device_map={"0": "meta"})
    with pytest.raises(InputError, match=r'expected a torch device'):
        fastpipe.load(GRAPHS / "two_stage_skip" / "pipeline.json", device_map={"0": "floppy:3"})


@pytest.mark.parametrize("inputs, pattern", [
    ({"x": torch.zeros(4, 32)}, r'^inputs\["scale"\]: expected a tensor for this pipeline input, found none$'),
    ({"x": torch.zeros(4, 32), "scale": torch.ones(4, 1), "z": torch.ones(1)}, r'^inputs\["z"\]: expected one of the pipeline inputs \(x, scale\), found an unknown name$'),
    ({"x": torch.zeros(4, 31), "scale": torch.ones(4, 1)}, r'^inputs\["x"\]\.shape: expected \[4, 32\], found \[4, 31\]$'),
    ({"x": torch.zeros(4, 32, dtype=torch.float64), "scale": torch.ones(4, 1)}, r'^inputs\["x"\]\.dtype: expected f32, found f64$'),
    ({"x": [[0.0]], "scale": torch.ones(4, 1)}, r'^inputs\["x"\]: expected a torch.Tensor, found list$'),
    ({"x": torch.zeros(4, 32, device="meta"), "scale": torch.ones(4, 1)}, r'^inputs\["x"\]\.device: expected cpu, found meta$'),
])
def test_inputs_checked_before_running(inputs, pattern):
    sess = fastpipe.load(GRAPHS / "two_stage_skip" / "pipeline.json")
    with pytest.raises(InputError, match=pattern):
        sess.run(inputs)
    out = sess.run({"x": torch.zeros(4, 32), "scale": torch.ones(4, 1)})   # still usable
    assert out["y"].shape == (4, 32)


def test_failing_supertask_names_supertask_and_slot(tmp_path):
    """A graph that fails at run time (index out of range) is reported with its supertask and slot."""
    from tests.docs import write_bad_index_pipeline

    sess = fastpipe.load(write_bad_index_pipeline(tmp_path))
    with pytest.raises(RunError, match=r'^supertasks\["1"\] on slot "0": failed: IndexError: '):
        sess.run({"ids": torch.tensor([0, 1, 7]), "table": torch.zeros(4, 2)})
    assert sess.run({"ids": torch.tensor([0, 1, 3]), "table": torch.ones(4, 2)})["y"].shape == (3, 2)


def test_dfg_refused_unless_a_handler_is_registered(tmp_path):
    from fastpipe.errors import PayloadError

    f = copy_example("two_stage_skip", tmp_path)
    doc = json.loads(f.read_text())
    st = next(s for s in doc["supertasks"].values() if s["kind"] == "FX" and s["device"] == "1")
    st["kind"] = "dfg"
    st["data"] = "opaque-npu-graph"
    f.write_text(json.dumps(doc))
    with pytest.raises(PayloadError, match=r'\.kind: expected a kind fastpipe can run \(fx\), found dfg \(an NPU compiler graph; register a handler'):
        fastpipe.load(f)
    seen = []

    def handler(sid, supertask, text):
        seen.append((sid, text))
        return lambda xs: [torch.softmax(xs[0] @ xs[3].t() + xs[4] + xs[1], dim=-1) * 0 + 1]  # any fn of the inputs

    fastpipe.register_compute_handler("dfg", handler)
    try:
        out = fastpipe.load(f).run({"x": torch.zeros(4, 32), "scale": torch.ones(4, 1)})
        assert seen and seen[0][1] == "opaque-npu-graph"
        assert torch.equal(out["y"], torch.ones(4, 32))
    finally:
        fastpipe.unregister_compute_handler("dfg")
    with pytest.raises(ValueError):
        fastpipe.register_compute_handler("fx", handler)


def test_constants_shared_between_sessions():
    from fastpipe.weights import WeightStore

    store = WeightStore()
    a = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", store=store, processor="reference")
    b = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", store=store, processor="reference")
    ca = {id(r) for ss in a.program.steps.values() for s in ss for r in s.constants.values()}
    cb = {id(r) for ss in b.program.steps.values() for s in ss for r in s.constants.values()}
    assert ca and ca == cb


def test_edf_runs_through_its_handler_with_the_side_file_bytes(tmp_path):
    """furiosa-llm saves an edf blob as <blob-id>.edf (its CompiledGraph's bytes), null in the JSON."""
    from fastpipe.errors import PayloadError

    f = copy_example("two_stage_skip", tmp_path)
    doc = json.loads(f.read_text())
    st = next(s for s in doc["supertasks"].values() if s["kind"] == "FX" and s["device"] == "1")
    st.update(kind="edf", data=None, data_blob="npu1")
    doc.setdefault("blobs", {})["npu1"] = None
    (f.parent / "npu1.edf").write_bytes(b"\x00EDF\xff")
    f.write_text(json.dumps(doc))
    with pytest.raises(PayloadError, match=r'found edf \(an NPU compiler graph; register a handler with '
                                           r'fastpipe\.register_compute_handler\("edf", \.\.\.\)\)$'):
        fastpipe.load(f)
    seen = []

    def handler(sid, supertask, payload):
        seen.append(payload)
        return lambda xs: [torch.full((4, 32), 2.0)]

    fastpipe.register_compute_handler("edf", handler)
    try:
        out = fastpipe.load(f).run({"x": torch.zeros(4, 32), "scale": torch.ones(4, 1)})
        assert seen == [b"\x00EDF\xff"] and torch.equal(out["y"], torch.full((4, 32), 2.0))
    finally:
        fastpipe.unregister_compute_handler("edf")


def test_null_group_collective_is_a_group_of_one(tmp_path):
    """`"group": null` (the producer's `group: str | None`): the supertask alone; all_reduce of one
    participant is its input."""
    from tests.docs import comm_doc

    doc = comm_doc("all_reduce", 1, (2, 3), [(2, 3)], {"reduce_op": 0})
    doc["supertasks"]["c0"]["group"] = None
    f = tmp_path / "p.json"
    f.write_text(json.dumps(doc))
    x = torch.randn(2, 3)
    for processor in ("reference", "cpu"):
        out = fastpipe.load(f, device_map=None, processor=processor, compile=False).run({"x_0": x})
        assert torch.equal(out["y_0"], x)


def test_memory_report_gives_the_plan_per_device():
    """Without the cuda processor the report is the plan: per device, its slots' peak intermediates plus
    their constants, as the Program computed them (measured peaks come with the cuda processor)."""
    from fastpipe.runtime.cuda.stream_issue import format_memory_report

    sess = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json")
    report = sess.memory_report()
    prog = sess.program
    assert set(report) == {"cpu"}
    (r,) = report.values()
    assert set(r["slots"]) == {s for s in prog.slots if prog.steps[s]}
    assert r["activation_bytes"] == sum(prog.peak_bytes.get(s, 0) for s in r["slots"]) > 0
    assert r["constant_bytes"] == sum(prog.constant_bytes.get(s, 0) for s in r["slots"]) > 0
    assert r["predicted_peak_bytes"] == r["activation_bytes"] + r["constant_bytes"]
    assert "measured_peak_bytes" not in r
    (line,) = format_memory_report(report)
    assert line.startswith("cpu (slots ") and "plan " in line and "measured" not in line


@pytest.mark.cuda
def test_with_a_gpu_npu_slots_default_to_it_and_cpu_slots_stay():
    """The default placement on a GPU machine (the tests not marked cuda see a CPU machine's: conftest):
    npu:N slots on cuda:(N mod count), CPU inputs moved there, the outputs left there."""
    g = GRAPHS / "two_stage_skip"
    sess = fastpipe.load(g / "pipeline.json")
    assert set(sess.slot_devices.values()) == {torch.device("cuda", 0)}
    out = sess.run(load_file(str(g / "inputs.safetensors")))
    want = load_file(str(g / "expected.safetensors"))
    assert out["y"].device == torch.device("cuda", 0)
    torch.testing.assert_close(out["y"].cpu(), want["y"], rtol=1e-4, atol=1e-5)
    cpu = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json")
    assert set(cpu.slot_devices.values()) == {torch.device("cpu")}
