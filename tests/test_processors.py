"""The fast runtime on CPU: the threaded processor, torch.compile, micro-batching, traces, failures.
Tests marked `cuda` run the CUDA processor and are skipped cleanly without a GPU."""
import json
import threading
import warnings

import pytest
import torch
from safetensors.torch import load_file

import fastpipe
from fastpipe.errors import CompileError, InputError, RunError
from fastpipe.format import read_pipeline
from tests.docs import write_bad_index_pipeline
from tests.examples import EXAMPLES, GRAPHS


def fresh_inputs(sess, seed, scale=1):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in sess.input_names:
        t = sess.pipeline.tensors[n]
        shape = (t.shape[0] * scale, *t.shape[1:]) if t.shape else t.shape
        out[n] = torch.randn(shape, generator=g) if t.dtype.startswith("f") else torch.zeros(shape, dtype=torch.int64)
    return out


@pytest.mark.parametrize("name", EXAMPLES)
def test_cpu_processor_equals_reference(name):
    ref = fastpipe.load(GRAPHS / name / "pipeline.json", processor="reference")
    cpu = fastpipe.load(GRAPHS / name / "pipeline.json", processor="cpu", compile="off")
    assert cpu.program is not None and set(cpu.program.slots) == set(ref.pipeline.devices)
    for seed in (1, 2):
        ins = fresh_inputs(ref, seed)
        a, b = ref.run(ins), cpu.run(ins)
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)


def test_compile_path_equals_reference_and_is_shared():
    from fastpipe.runtime.compiling.compile import clear_cache

    clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)      # no compile failure, no recompile
        sess = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", compile=True, processor="cpu")
        report = sess.compile()
        assert report.graphs == 4 and report.eager == () and report.seconds > 0
        # the two tensor-parallel replicas of the column/row graph (one blob) share one compiled graph
        fx = [sid for sid, st in sess.pipeline.supertasks.items() if st.kind == "fx"]
        assert len(fx) == 5 and len({id(sess._binder.compiled[s]) for s in fx}) == 4
        ref = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="reference")
        for seed in (3, 4):
            ins = fresh_inputs(ref, seed)
            torch.testing.assert_close(sess.run(ins)["y"], ref.run(ins)["y"], rtol=1e-4, atol=1e-5)


def test_compile_failure_warns_or_raises(monkeypatch):
    from fastpipe.runtime.compiling import compile as comp

    comp.clear_cache()

    def broken(gm, **kw):
        def fn(*xs):
            raise RuntimeError("simulated inductor failure")
        return fn

    monkeypatch.setattr(comp.torch, "compile", broken)
    sess = fastpipe.load(GRAPHS / "two_stage_skip" / "pipeline.json", compile=True, processor="reference")
    with pytest.warns(RuntimeWarning, match=r'supertasks\["\d+"\] on slot "\d": torch.compile failed \(RuntimeError: simulated inductor failure\); running this supertask eagerly'):
        rep = sess.compile()
    assert len(rep.eager) == 2
    ins = load_file(str(GRAPHS / "two_stage_skip" / "inputs.safetensors"))
    torch.testing.assert_close(sess.run(ins)["y"], load_file(str(GRAPHS / "two_stage_skip" / "expected.safetensors"))["y"])
    comp.clear_cache()
    sess = fastpipe.load(GRAPHS / "two_stage_skip" / "pipeline.json", compile=True, compile_policy="raise", processor="reference")
    with pytest.raises(CompileError, match=r"torch.compile failed: RuntimeError: simulated inductor failure"):
        sess.compile()
    comp.clear_cache()


def test_recompile_is_warned():
    from fastpipe.runtime.compiling.compile import CompiledGraph

    gm = torch.fx.symbolic_trace(lambda x: x * 2 + 1)
    cg = CompiledGraph(gm, "supertasks[\"9\"] on slot \"0\"", "warn")
    cg(torch.randn(3))
    with pytest.warns(RuntimeWarning, match=r"recompiled this graph after warm-up"):
        cg(torch.randn(5, 2))


@pytest.mark.parametrize("processor", ["reference", "cpu"])
@pytest.mark.parametrize("name", ["two_stage_skip", "tp_mlp"])
def test_chunks_equal_unchunked(processor, name):
    sess = fastpipe.load(GRAPHS / name / "pipeline.json", processor=processor)
    ins = fresh_inputs(sess, 5, scale=3)
    out = sess.run(ins, chunks=3)
    for c in range(3):
        part = {k: v[c * sess.pipeline.tensors[k].shape[0]:(c + 1) * sess.pipeline.tensors[k].shape[0]] for k, v in ins.items()}
        want = sess.run(part)
        for k in want:
            b = want[k].shape[0]
            torch.testing.assert_close(out[k][c * b:(c + 1) * b], want[k], rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match=r'\.shape\[0\]: expected 24 \(chunks=3 x the pipeline\'s batch 8\), found 16|\.shape\[0\]: expected 12 \(chunks=3 x the pipeline\'s batch 4\), found 8'):
        sess.run(fresh_inputs(sess, 5, scale=2), chunks=3)
    with pytest.raises(InputError, match=r"chunks: expected an integer >= 1, found 0"):
        sess.run(ins, chunks=0)


def test_trace_has_a_lane_per_slot(tmp_path):
    sess = fastpipe.load(GRAPHS / "moe_all_to_all" / "pipeline.json", processor="cpu", compile="off")
    ins = fresh_inputs(sess, 6, scale=2)
    sess.run(ins, chunks=2, trace=tmp_path / "t.json")
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    lanes = {e["args"]["name"]: e["tid"] for e in ev if e["name"] == "thread_name"}
    assert lanes == {f"slot {s}": i for i, s in enumerate(sess.pipeline.devices)}
    steps = [e for e in ev if e["ph"] == "X"]
    expected = sum(len(v) for v in sess.program.steps.values()) * 2
    assert len(steps) == expected
    for e in steps:
        _, slot, sid = e["name"].split(":")
        assert lanes[f"slot {slot}"] == e["tid"] and sid in sess.pipeline.supertasks
        assert e["dur"] >= 0 and e["args"]["chunk"] in (0, 1)


def test_failure_on_one_slot_stops_every_slot(tmp_path):
    before = threading.active_count()
    sess = fastpipe.load(write_bad_index_pipeline(tmp_path), processor="cpu", compile="off")
    with pytest.raises(RunError, match=r'^supertasks\["1"\] on slot "0": failed: IndexError'):
        sess.run({"ids": torch.tensor([0, 1, 9]), "table": torch.zeros(4, 2)})
    assert threading.active_count() == before           # no thread left behind
    assert sess.run({"ids": torch.tensor([0, 1, 3]), "table": torch.ones(4, 2)})["y"].shape == (3, 2)


def test_processor_options_refused():
    with pytest.raises(InputError, match=r'processor: expected one of auto, reference, region, cpu, cuda, dist, found "gpu"'):
        fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match=r'expected CUDA for processor "cuda"'):
            fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="cuda", compile="off")


def test_cli_plan_chunks_trace_no_compile(tmp_path, capsys):
    from fastpipe.cli import main

    assert main(["show", "--plan", str(GRAPHS / "seq_parallel" / "pipeline.json")]) == 0
    out = capsys.readouterr().out
    assert "all_gather:ag0" in out and "reduce_scatter:rs0" in out and "plan: checked" in out and "peak" in out
    assert main(["run", str(GRAPHS / "tp_mlp" / "pipeline.json"), "--no-compile", "--chunks", "2", "--trace",
                 str(tmp_path / "t.json"), "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    # the README's main job: every slot on the CPU, so auto runs the region processor and says so
    assert "tp_mlp: region processor (1 region on cpu; eager, one call" in out and "wrote trace" in out
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


# ---------------------------------------------------------------- CUDA (skipped without a GPU)
@pytest.mark.cuda
@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("graph", [False, True])
def test_cuda_processor_equals_reference(name, graph):
    slots = read_pipeline(GRAPHS / name / "pipeline.json").devices
    dm = {s: "cuda:0" for s in slots}
    # the reference on the CPU: with a GPU, the default would put npu slots (two_stage_skip's) there
    ref = fastpipe.load(GRAPHS / name / "pipeline.json", device_map={s: "cpu" for s in slots}, processor="reference")
    sess = fastpipe.load(GRAPHS / name / "pipeline.json", device_map=dm, processor="cuda", cuda_graph=graph,
                         compile=True, compile_policy="raise")
    sess.compile()
    for seed in range(4):                       # the 2nd call captures, later ones replay
        ins = fresh_inputs(ref, seed)
        want = ref.run(ins)
        got = sess.run({k: v.cuda() for k, v in ins.items()})
        for k in want:
            torch.testing.assert_close(got[k].cpu(), want[k], rtol=1e-4, atol=1e-5)
    if graph:
        assert sess.runner.graph is not None


@pytest.mark.cuda
def test_cuda_replays_do_not_alias_outputs():
    """Replay, not eager, made the outputs: after the capture at compile() the captured function never
    runs again, yet each output equals the reference on its own input, still after the later calls."""
    name = "tp_mlp"
    dm = {s: "cuda:0" for s in ("0", "1")}
    ref = fastpipe.load(GRAPHS / name / "pipeline.json", processor="reference")
    sess = fastpipe.load(GRAPHS / name / "pipeline.json", device_map=dm, processor="cuda", compile_policy="raise")
    sess.compile()
    replay = sess.runner.replay
    assert replay.replaying
    calls, captured = [], replay.fn
    replay.fn = lambda inputs: (calls.append(1), captured(inputs))[1]
    xs = [torch.randn(8, 64) for _ in range(4)]
    outs = [sess.run({"x": x.cuda()})["y"] for x in xs]
    sess.run({"x": torch.randn(8, 64, device="cuda")})
    assert calls == [] and replay.replays == 5
    for o, x in zip(outs, xs):
        torch.testing.assert_close(o.cpu(), ref.run({"x": x})["y"], rtol=1e-4, atol=1e-5)
