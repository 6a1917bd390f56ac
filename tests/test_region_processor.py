"""The region processor: every slot on one device runs as one stitched graph, compiled once.
Equality with the reference on every example, with and without chunks; compile once per process,
failures and graph breaks reported by the policy; errors located by supertask and slot; traces;
auto choosing it; regions that span devices. CUDA tests are marked `cuda`."""
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

import fastpipe
from fastpipe.errors import CompileError, RunError
from fastpipe.lower import lower, simulate, with_regions
from fastpipe.runtime.processors.registry import choose_processor
from tests.docs import write_bad_index_pipeline
from tests.examples import EXAMPLES, GRAPHS, copy_example
from tests.test_processors import fresh_inputs


def _equal(a, b, tol=0.0):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=tol, atol=tol)


@pytest.mark.parametrize("name", EXAMPLES)
def test_eager_region_equals_reference(name):
    path = GRAPHS / name / "pipeline.json"
    ref = fastpipe.load(path, processor="reference")
    kept = fastpipe.load(path, processor="region", merge_shards=False, compile="off")
    merged = fastpipe.load(path, processor="region", compile="off")
    assert [r.device for r in kept.program.regions] == ["cpu"]          # every slot on the CPU: one region
    assert kept.describe().startswith("region processor (1 region on cpu; eager, one call")
    for seed in (1, 2):
        ins = fresh_inputs(ref, seed)
        want = ref.run(ins)
        _equal(want, kept.run(ins))                  # the same ops, the same comm numerics: bit for bit
        _equal(want, merged.run(ins), tol=1e-5)      # merged GEMMs round differently, within f32 tolerance


@pytest.mark.parametrize("name", EXAMPLES)
def test_compiled_region_equals_reference_with_and_without_chunks(name):
    path = GRAPHS / name / "pipeline.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)          # no compile failure, no graph break, no recompile
        sess = fastpipe.load(path, processor="auto", compile=True)
        assert sess.processor == "region"
        rep = sess.compile()
        assert rep.graphs == 1 and rep.eager == () and rep.seconds > 0
        assert "compiled as one graph" in sess.describe()
        ins = load_file(str(GRAPHS / name / "inputs.safetensors"))
        want = load_file(str(GRAPHS / name / "expected.safetensors"))
        _equal(want, sess.run(ins), tol=1e-4)
        ref = fastpipe.load(path, processor="reference")
        two = {k: torch.cat([v, v * 0.5]) for k, v in ins.items()}
        got = sess.run(two, chunks=2)
        for c, part in enumerate((ins, {k: v * 0.5 for k, v in ins.items()})):
            w = ref.run(part)
            for k in w:
                b = w[k].shape[0]
                torch.testing.assert_close(got[k][c * b:(c + 1) * b], w[k], rtol=1e-4, atol=1e-5)


def test_inputs_with_odd_strides_on_size_one_dims_do_not_recompile(tmp_path):
    """A slice of a bigger tensor (run_model's slices of a KV cache) keeps the parent's stride on its
    size-1 batch dim, which .contiguous() leaves alone; the compiled region must not see it."""
    from fastpipe.builder.assemble import Assembler
    from fastpipe.runtime.binding.inputs import dense

    a = Assembler("one_row")
    a.slot("0", "cpu:0")
    a.slot("1", "cpu:1")
    a.input("k", (1, 4, 6), "f32")
    a.fx("0", lambda k: k * 2, ["k"], ["h"])
    a.send_recv("p", "0", "h", "1", "h1")
    a.fx("1", lambda h: h.sum(-1), ["h1"], ["y"])
    a.output(["y"])
    f = tmp_path / "p.json"
    f.write_text(json.dumps(a.to_json()))
    sess = fastpipe.load(f, processor="region", compile=True)
    sess.compile()
    k = torch.randn(1, 8, 6)[:, :4]
    assert k.is_contiguous() and k.stride()[0] == 48 and dense(k).stride() == (24, 6, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        torch.testing.assert_close(sess.run({"k": k})["y"], (k * 2).sum(-1))


@pytest.mark.parametrize("eager_faster", [False, True])
def test_warm_up_keeps_the_faster_of_compiled_and_eager(monkeypatch, eager_faster):
    """For a region of a few tiny ops, a compiled call's fixed cost can exceed its gain: Session.compile
    times both on the warm-up inputs, keeps the faster and says which."""
    from fastpipe.runtime.processors import region as rp

    compiled_s, eager_s = (2.0, 1.0) if eager_faster else (1.0, 2.0)      # seconds a call, as measured
    timings = iter([compiled_s, eager_s])                                  # tune() times compiled, then eager
    monkeypatch.setattr(rp, "_per_call", lambda fn: next(timings))
    sess = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="region", compile=True)
    sess.compile()
    (run,) = sess.runner.runs
    cg = run.compiled
    assert cg.timing == (compiled_s, eager_s) and cg.measured_at == "at warm-up"
    if eager_faster:
        assert cg.use_eager
        assert "compiled as one graph, but run eagerly (faster at warm-up: 1000.000 vs 2000.000 ms a call)" in sess.describe()
    else:
        assert not cg.use_eager and "run eagerly" not in sess.describe()
        assert "compiled as one graph (faster at warm-up: 1000.000 vs 2000.000 ms a call eager)" in sess.describe()
    ins = fresh_inputs(sess, 9)
    _equal(fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="reference").run(ins), sess.run(ins), tol=1e-5)


def test_compiled_once_per_process_per_distinct_region():
    a = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="region", compile=True)
    b = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="region", compile=True)
    c = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="region", compile=True, merge_shards=False)
    ga, gb, gc = (s.runner.compiled_graphs()["r0"] for s in (a, b, c))
    assert ga is gb                      # same code, same (shared) constants, same device: compiled once
    assert gc is not ga                  # a different graph is a different compile
    a.compile()
    t = ga.compile_seconds
    b.compile()
    assert ga.compile_seconds == t       # the second session found it compiled
    import weakref

    ref = weakref.ref(ga)
    del ga, gb
    a.close()
    b.close()
    import gc as _gc

    _gc.collect()
    assert ref() is None                 # the last session's close lets the compiled region (and its weights) go


def test_compile_failure_warns_or_raises(monkeypatch):
    from fastpipe.runtime.compiling import compile as comp

    def broken(fn, **kw):
        def run(*xs):
            raise RuntimeError("simulated inductor failure")
        return run

    monkeypatch.setattr(comp.torch, "compile", broken)
    path = GRAPHS / "two_stage_skip" / "pipeline.json"
    sess = fastpipe.load(path, processor="region", compile=True)
    with pytest.warns(RuntimeWarning, match=r'region "r0" on cpu \(6 steps of slots 0, 1\): torch.compile failed '
                                            r'\(RuntimeError: simulated inductor failure\); running this region eagerly'):
        rep = sess.compile()
    assert rep.eager == ("r0",)
    ins = load_file(str(GRAPHS / "two_stage_skip" / "inputs.safetensors"))
    _equal(load_file(str(GRAPHS / "two_stage_skip" / "expected.safetensors")), sess.run(ins), tol=1e-5)
    sess = fastpipe.load(path, processor="region", compile=True, compile_policy="raise", merge_shards=False)
    with pytest.raises(CompileError, match=r'region "r0" on cpu .*torch.compile failed: RuntimeError: simulated'):
        sess.compile()


def test_graph_break_is_reported_not_silent(tmp_path):
    """A step dynamo cannot trace into one graph (a registered compute kind that branches on a value
    it reads back from a tensor) breaks fullgraph."""
    f = copy_example("two_stage_skip", tmp_path)
    doc = json.loads(f.read_text())
    st = next(s for s in doc["supertasks"].values() if s["kind"] == "FX" and s["device"] == "1")
    st["kind"], st["data"] = "dfg", "opaque"
    f.write_text(json.dumps(doc))

    def handler(sid, supertask, text):
        def fn(xs):
            if float(xs[0].abs().sum()) >= 0:           # data-dependent Python control flow
                return [torch.ones(4, 32)]
            return [torch.zeros(4, 32)]
        return fn

    fastpipe.register_compute_handler("dfg", handler)
    try:
        sess = fastpipe.load(f, processor="region", compile=True)
        with pytest.warns(RuntimeWarning, match=r'region "r0" .*torch.compile failed .*running this region eagerly'):
            sess.compile()
        out = sess.run({"x": torch.zeros(4, 32), "scale": torch.ones(4, 1)})
        assert torch.equal(out["y"], torch.ones(4, 32))
        with pytest.raises(CompileError, match=r'region "r0"'):
            fastpipe.load(f, processor="region", compile=True, compile_policy="raise", merge_shards=False).compile()
    finally:
        fastpipe.unregister_compute_handler("dfg")


@pytest.mark.parametrize("compile", [False, True])
def test_failure_inside_a_region_names_the_supertask_and_slot(tmp_path, compile):
    sess = fastpipe.load(write_bad_index_pipeline(tmp_path), processor="region", compile=compile)
    good = {"ids": torch.tensor([0, 1, 3]), "table": torch.ones(4, 2)}
    if compile:
        sess.compile()
    with pytest.raises(RunError, match=r'^supertasks\["1"\] on slot "0": failed: IndexError: .*\(found by re-running '
                                       r'region "r0" step by step, eagerly, after it failed as one graph\)$'):
        sess.run({"ids": torch.tensor([0, 1, 9]), "table": torch.zeros(4, 2)})
    assert torch.equal(sess.run(good)["y"], torch.ones(3, 2))


def test_a_region_failing_inside_a_capture_is_not_re_run_there(tmp_path, monkeypatch):
    """Inside a CUDA-graph capture a failed region raises as it is (the capture reports it): re-running
    its steps would issue them into the failed capture, and the located error would blame them."""
    from types import SimpleNamespace as NS

    from fastpipe.runtime.processors.region import RegionProcessor

    def broken(*args):
        raise RuntimeError("operation not permitted when stream is capturing")
    run = NS(device=torch.device("cuda", 0), fn=broken, region=NS(reads=(), writes=("y",), label="r0", name="r0"))
    proc = RegionProcessor.__new__(RegionProcessor)
    located = []

    def locate(*args):
        located.append(args)
        raise RunError("located")
    monkeypatch.setattr(proc, "_locate", locate, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="^operation not permitted when stream is capturing$"):
        proc._run_graph(run, {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(RunError, match="^located$"):
        proc._run_graph(run, {})
    assert len(located) == 1                                 # outside a capture: located step by step


def test_trace_compiled_one_lane_per_region_with_compile_time_apart(tmp_path):
    sess = fastpipe.load(GRAPHS / "moe_all_to_all" / "pipeline.json", processor="region", compile=True)
    sess.compile()
    sess.run(fresh_inputs(sess, 6, scale=2), chunks=2, trace=tmp_path / "t.json")
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    lanes = {e["args"]["name"]: e["tid"] for e in ev if e["name"] == "thread_name"}
    (title,) = lanes               # (", run eagerly (faster)" follows if warm-up found eager faster)
    assert title.startswith(f"region r0 on cpu, compiled in {sess.runner.compiled_graphs()['r0'].compile_seconds:.2f} s at warm-up")
    runs = [e for e in ev if e["ph"] == "X"]
    assert [e["name"] for e in runs] == ["fp:region:r0"] * 2 and [e["args"]["chunk"] for e in runs] == [0, 1]


def test_trace_eager_labels_every_supertask(tmp_path):
    sess = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="region", compile="off")
    out = sess.run(fresh_inputs(sess, 3), trace=tmp_path / "t.json")
    _equal(fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="reference").run(fresh_inputs(sess, 3)), out, tol=1e-5)
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = [e["name"] for e in ev if e["ph"] == "X"]
    computes = {st.supertask for ss in sess.program.steps.values() for st in ss if st.kind == "compute"}
    assert {n.split(":")[2] for n in names if not n.startswith("fp:group:")} == computes
    assert {n for n in names if n.startswith("fp:group:")} == {f"fp:group:{g}" for g in sess.program.groups}
    assert {e["tid"] for e in ev if e["ph"] == "X"} == {0}                # all on the region's lane


def test_auto_chooses_region_only_when_every_slot_shares_one_device():
    cpu, g0, g1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert choose_processor("auto", {"0": cpu, "1": cpu}, environ={}) == "region"
    assert choose_processor("auto", {"0": g0, "1": g0}, environ={}) == "region"
    assert choose_processor("auto", {"0": g0, "1": g1}, environ={}) == "cuda"
    assert choose_processor("auto", {"0": cpu, "1": g0}, environ={}) == "cpu"
    assert choose_processor("auto", {"0": cpu}, environ={"WORLD_SIZE": "2"}) == "dist"
    assert choose_processor("cpu", {"0": cpu, "1": cpu}, environ={}) == "cpu"     # by name, still there


def test_regions_across_devices_run_their_cross_device_groups_by_the_reference():
    """Two 'devices' (both really the CPU): the pass cuts a region per run of one device's steps, and a
    group whose members span both is a region of its own, run by the comm reference."""
    from fastpipe.runtime.processors.region import RegionProcessor

    ref = fastpipe.load(GRAPHS / "two_stage_skip" / "pipeline.json", processor="reference")
    program = with_regions(ref.program, {"0": "A", "1": "B"})
    # stage 0's steps, then every send/recv between the stages, then stage 1's steps
    assert [r.device for r in program.regions] == ["A"] + [None] * len(ref.program.groups) + ["B"]
    proc = RegionProcessor(program, ref.checked.groups)
    ins = fresh_inputs(ref, 4)
    _equal(ref.run(ins), proc.run([ins])[0], tol=1e-6)
    tp = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="reference")
    program = with_regions(tp.program, {"0": "A", "1": "B"})
    devices = [r.device for r in program.regions]
    assert devices.count(None) == len(tp.program.groups)          # every group crosses
    ins = fresh_inputs(tp, 5)
    _equal(tp.run(ins), RegionProcessor(program, tp.checked.groups).run([ins])[0], tol=1e-6)
    assert len(simulate(program)) == sum(len(s) for s in program.steps.values())


def test_opaque_groups_run_their_bound_callable():
    """Groups the fusion pass replaced (fused kernels) stay opaque calls inside the region graph."""
    from fastpipe.runtime.processors.region import RegionProcessor

    ref = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="reference")
    program = with_regions(ref.program, {"0": "cpu", "1": "cpu"})
    calls = []
    fns = dict(program.group_fns)
    for g, fn in list(fns.items()):
        fns[g] = lambda xs, fn=fn, g=g: (calls.append(g), fn(xs))[1]
    import dataclasses

    program = dataclasses.replace(program, group_fns=fns)
    proc = RegionProcessor(program, ref.checked.groups, opaque_groups=set(fns), merge_shards=False)
    ins = fresh_inputs(ref, 7)
    _equal(ref.run(ins), proc.run([ins])[0])
    assert sorted(calls) == sorted(fns)


def test_region_pass_needs_no_device_and_orders_every_step():
    ref = fastpipe.load(GRAPHS / "moe_all_to_all" / "pipeline.json", processor="reference")
    program = with_regions(lower(ref.checked), {s: "cpu" for s in ref.pipeline.devices})
    (r,) = program.regions
    assert sorted(r.steps) == sorted((s, i) for s in program.slots for i in range(len(program.steps[s])))
    assert set(r.reads) == set(ref.pipeline.input_names) and set(r.writes) == set(ref.pipeline.output_names)


# ---------------------------------------------------------------- CUDA (skipped without a GPU)
@pytest.mark.cuda
@pytest.mark.parametrize("name", EXAMPLES)
def test_cuda_region_replays_and_equals_reference(name):
    path = GRAPHS / name / "pipeline.json"
    dm = {s: "cuda:0" for s in fastpipe.load(path, processor="reference").pipeline.devices}
    sess = fastpipe.load(path, device_map=dm, processor="auto", compile=True)
    assert sess.processor == "region" and sess.runner.replay is not None
    sess.compile()
    ins = load_file(str(GRAPHS / name / "inputs.safetensors"))
    want = load_file(str(GRAPHS / name / "expected.safetensors"))
    for _ in range(3):
        out = sess.run({k: v.cuda() for k, v in ins.items()})
        for k in want:
            torch.testing.assert_close(out[k].cpu(), want[k], rtol=1e-4, atol=1e-5)
    assert sess.runner.replay.replaying                 # the last runs replayed the captured graph
