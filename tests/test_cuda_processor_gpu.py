"""The CUDA processor on a GPU: races between streams, micro-batches overlapping across stages (a
trace proves it), bf16/f16, memory with frees, inference mode, slots on two GPUs. Skipped cleanly
without CUDA; the issuing logic itself is tested on CPU in tests/test_cuda_issue.py."""
import warnings

import pytest
import torch

import fastpipe
from fastpipe.format import read_pipeline
from fastpipe.runtime.processors.cuda import CudaProcessor
from fastpipe.runtime.binding.microbatch import split_chunks
from fastpipe.runtime.cuda.stream_issue import CudaBackend
from tests.examples import GRAPHS
from tests.test_cuda_issue import recording_inference_mode, wrapped, write_chain
from tests.test_processors import fresh_inputs

pytestmark = pytest.mark.cuda

SLEEP = 20_000_000          # torch.cuda._sleep cycles: ~10 ms at 2 GHz


def on_gpu(path, **kw):
    slots = read_pipeline(path).devices
    return fastpipe.load(path, device_map={s: "cuda:0" for s in slots}, processor="cuda", **kw)


def on_cpu(path):
    """The reference: every slot on the CPU (by default `npu` slots would go to the GPU here)."""
    return fastpipe.load(path, device_map={s: "cpu" for s in read_pipeline(path).devices})


def slowed(program, keys):
    """The Program with each compute step in `keys` ((slot, index)) first sleeping on its stream."""
    def wrap(fn, key):
        if key not in keys:
            return fn

        def slow(xs):
            torch.cuda._sleep(SLEEP)           # on the current stream: the step's own
            return fn(xs)
        return slow
    return wrapped(program, wrap)


def compute_keys(program):
    return [(s, i) for s, ss in program.steps.items() for i, st in enumerate(ss) if st.kind == "compute"]


def parts_of(sess, chunks, seed):
    ins = fresh_inputs(sess, seed, scale=chunks)
    return split_chunks(ins, chunks, {n: sess.pipeline.tensors[n].shape[0] for n in sess.input_names})


def assert_equal_reference(ref, parts, outs, tol=1e-5):
    assert len(outs) == len(parts)
    for part, out in zip(parts, outs):
        want = ref.run(part)
        for k in want:
            torch.testing.assert_close(out[k].cpu(), want[k], rtol=tol, atol=tol)


# ---------------------------------------------------------------- (a) races
@pytest.mark.parametrize("name", ["tp_mlp", "two_stage_skip"])
@pytest.mark.parametrize("graph", [False, True])
def test_a_slow_producer_stream_is_waited_for(name, graph):
    """Each compute step in turn sleeps ~10 ms on its stream before writing: whatever reads its
    output on another stream (a comm group, the next stage) must still see the right values."""
    ref = on_cpu(GRAPHS / name / "pipeline.json")
    sess = on_gpu(GRAPHS / name / "pipeline.json", cuda_graph=False)
    for j, key in enumerate(compute_keys(sess.program)):
        proc = CudaProcessor(slowed(sess.program, {key}), cuda_graph=graph, compile_policy="raise")
        for seed in range(3):                              # graph: warm-up, capture, replay
            parts = parts_of(ref, 2, 10 * j + seed)
            assert_equal_reference(ref, parts, proc.run(parts))
            assert_equal_reference(ref, parts[:1], proc.run([parts[0]]))
        if graph:
            assert proc.replays[2].graph is not None and proc.graph is not None


class NoWaitBackend(CudaBackend):
    def wait(self, lane, event):                          # the bug the race test is there to catch
        pass


def test_the_race_test_catches_a_missing_wait(monkeypatch):
    """Negative control: with event waits dropped, the slowed producer's consumer reads too early."""
    import fastpipe.runtime.processors.cuda as cp

    monkeypatch.setattr(cp, "CudaBackend", NoWaitBackend)
    name = "two_stage_skip"
    ref = on_cpu(GRAPHS / name / "pipeline.json")
    sess = on_gpu(GRAPHS / name / "pipeline.json", cuda_graph=False)
    proc = cp.CudaProcessor(slowed(sess.program, {("0", 0)}), cuda_graph=False)
    wrong = 0
    for seed in range(3):
        part = parts_of(ref, 1, 100 + seed)[0]
        got = proc.run([part])[0]["y"].cpu()
        wrong += not torch.allclose(got, ref.run(part)["y"], rtol=1e-5, atol=1e-5)
    assert wrong >= 1


# ---------------------------------------------------------------- (b) micro-batches overlap
@pytest.mark.parametrize("graph", [False, True])
def test_chunks_equal_the_reference(graph):
    path = GRAPHS / "two_stage_skip" / "pipeline.json"
    ref = on_cpu(path)
    sess = on_gpu(path, cuda_graph=graph, compile_policy="raise")
    for seed in range(4):                                  # graph: the 2nd call captures all 4 chunks as one graph
        ins = fresh_inputs(ref, seed, scale=4)
        got = sess.run(ins, chunks=4)
        b = ref.pipeline.tensors["x"].shape[0]
        for c in range(4):
            want = ref.run({k: v[c * b:(c + 1) * b] for k, v in ins.items()})
            torch.testing.assert_close(got["y"][c * b:(c + 1) * b].cpu(), want["y"], rtol=1e-5, atol=1e-5)
    if graph:
        assert sess.runner.replays[4].graph is not None


def test_a_trace_shows_stages_working_on_different_chunks_at_once(tmp_path):
    """Both stages' compute sleeps ~10 ms: stage 1 on chunk 0 overlaps stage 0 on chunk 1 in time,
    and the whole run takes well under the sum of its steps."""
    path = GRAPHS / "two_stage_skip" / "pipeline.json"
    ref = on_cpu(path)
    sess = on_gpu(path, cuda_graph=False)
    proc = CudaProcessor(slowed(sess.program, {("0", 0), ("1", 2)}), cuda_graph=False)
    parts = parts_of(ref, 4, 3)
    proc.run(parts)                              # warm-up
    trace = []
    outs = proc.run(parts, trace=trace)
    assert_equal_reference(ref, parts, outs)
    assert len(trace) == 4 * 6
    span = {(slot, c): (t0, t1) for slot, label, t0, t1, c in trace if label in ("fp:0:1", "fp:1:6")}
    s1c0, s0c1 = span[("1", 0)], span[("0", 1)]
    assert s1c0[0] < s0c1[1] and s0c1[0] < s1c0[1], f"stage 1 chunk 0 {s1c0} vs stage 0 chunk 1 {s0c1}"
    busy = sum(t1 - t0 for t0, t1 in span.values())
    whole = max(t1 for _, t1 in span.values()) - min(t0 for t0, _ in span.values())
    assert whole < 0.8 * busy, (whole, busy)              # serial would be >= busy; fill-drain ~ 5/8 of it


def test_session_trace_of_a_cuda_run_is_not_empty(tmp_path):
    import json

    sess = on_gpu(GRAPHS / "moe_all_to_all" / "pipeline.json")
    ins = fresh_inputs(sess, 6, scale=2)
    with pytest.warns(RuntimeWarning, match=r"a traced run is issued eagerly"):
        sess.run(ins, chunks=2, trace=tmp_path / "t.json")
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    steps = [e for e in ev if e["ph"] == "X"]
    assert len(steps) == 2 * sum(len(v) for v in sess.program.steps.values())
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in steps)


# ---------------------------------------------------------------- (c) bf16 / f16
@pytest.mark.parametrize("dtype,tol", [("bf16", 3e-2), ("f16", 5e-3)])
@pytest.mark.parametrize("graph", [False, True])
def test_narrow_dtypes_match_the_f32_reference(tmp_path, dtype, tol, graph):
    ref = on_cpu(write_chain(tmp_path / "f32"))                           # in f32
    sess = on_gpu(write_chain(tmp_path / dtype, dtype=dtype), cuda_graph=graph, compile_policy="raise")
    tdt = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    for seed in range(3):
        x = torch.randn(24, 16, generator=torch.Generator().manual_seed(seed)).to(tdt)
        got = sess.run({"x": x.cuda()}, chunks=3)["y"]
        assert got.dtype == tdt and got.is_cuda
        want = torch.cat([ref.run({"x": x[c * 8:(c + 1) * 8].float()})["y"] for c in range(3)])
        torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)
        one = sess.run({"x": x[:8].cuda()})["y"]
        torch.testing.assert_close(one.float().cpu(), want[:8], rtol=tol, atol=tol)


# ---------------------------------------------------------------- (d) memory
@pytest.mark.parametrize("graph", [False, True])
def test_frees_keep_the_measured_peak_near_the_plan(tmp_path, graph):
    """A 4-stage chain of 6 elementwise steps each on 4 MiB activations: without frees every
    intermediate (~100 MiB) would be alive at the end; with them the allocator's peak stays within
    a small multiple of the plan's (two activations a slot)."""
    path = write_chain(tmp_path, stages=4, steps=6, batch=1024, d=1024, weights=False)
    sess = on_gpu(path, cuda_graph=graph)
    p = sess.pipeline
    nbytes = {n: t.shape[0] * t.shape[1] * 4 for n, t in p.tensors.items()}
    intermediates = sum(b for n, b in nbytes.items() if n not in p.input_names)
    x = torch.randn(1024, 1024)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    proc = sess.runner
    for _ in range(3):                                     # graph: warm-up, capture, replay
        proc.reset_peak_memory()
        # the device's peak counts every tensor of this process there: what it held before this run
        # (other tests' caches, under pytest-xdist) is not this run's
        held = torch.cuda.memory_allocated()
        out = sess.run({"x": x})["y"]
        torch.cuda.synchronize()
        report = proc.memory_report()["cuda:0"]
        measured, planned = report["measured_peak_bytes"] - held, report["predicted_peak_bytes"]
        assert planned == sum(sess.program.peak_bytes.values()) and report["constant_bytes"] == 0
        assert measured < 0.6 * intermediates, (measured, intermediates)
        assert measured <= 2 * planned + 4 * nbytes["x"], (measured, planned)
        del out
    line = proc.format_memory_report()[0]
    assert line.startswith("cuda:0 (slots 0, 1, 2, 3): measured peak ") and "plan " in line


# ---------------------------------------------------------------- (e) inference mode
@pytest.mark.parametrize("graph", [False, True])
def test_steps_run_in_inference_mode_and_outputs_are_plain_results(graph):
    path = GRAPHS / "tp_mlp" / "pipeline.json"
    ref = on_cpu(path)
    sess = on_gpu(path, cuda_graph=False)
    modes = []
    proc = CudaProcessor(wrapped(sess.program, recording_inference_mode(modes)), cuda_graph=graph)
    for seed in range(3):
        part = parts_of(ref, 1, seed)[0]
        out = proc.run([part])[0]
        assert_equal_reference(ref, [part], [out])
        assert all(t.is_inference() and not t.requires_grad for t in out.values())
    assert modes and all(modes)
    assert not torch.is_inference_mode_enabled()           # the caller's mode is left as it was


# ---------------------------------------------------------------- state written in place
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("graph", [False, True])
def test_state_in_place_writes_the_callers_caches_and_replays_on_them(tmp_path, graph, compile):
    """A static-cache decode step (tp=2, both ranks' slots on cuda:0, a stream each) with
    state_in_place: each step writing a layer's caches scatters into the caller's tensors (index_put_,
    fastpipe.runtime.binding.bind), and the replay is captured on those very tensors (they are the graph's
    buffers: nothing copied in or out). Three steps equal the copying reference on the CPU."""
    from fastpipe.builder.hf.build import build_hf
    from tests.hf_models import make_checkpoint
    from tests.test_state_in_place import START, step_inputs

    make_checkpoint("llama", tmp_path / "ckpt", seed=21)
    path = build_hf(tmp_path / "ckpt", tp=2, batch=2, seq_len=1, max_len=16).save(tmp_path / "out")
    sess = on_gpu(path, cuda_graph=graph, compile=compile, compile_policy="raise", state_in_place=True)
    ref = on_cpu(path)
    p, pairs = sess.pipeline, sess.state
    assert f"{len(pairs)} state tensors updated in place ({len(pairs)} by an in-place write)" in sess.describe()
    kept = {i: t for i, t in step_inputs(p, START, seed=0).items() if i in pairs}     # the reference's (CPU)
    caches = {i: t.cuda() for i, t in kept.items()}                                    # the caller's (GPU)
    if graph:
        sess.compile(step_inputs(p, START, seed=0, caches=caches))   # captured on the caller's caches
        assert all(sess.runner.replay.static_in[i] is t for i, t in caches.items())
    for step in range(3):
        pos = [s_ + step for s_ in START]
        ins = {n: t.cuda() for n, t in step_inputs(p, pos, seed=step + 1, caches=caches).items()}
        out = sess.run(ins)
        want = ref.run(step_inputs(p, pos, seed=step + 1, caches={i: t.clone() for i, t in kept.items()}))
        for i, o in pairs.items():
            assert out[o] is caches[i], f"step {step}: {o} is not the caller's {i}"
        for n, w in want.items():
            torch.testing.assert_close(out[n].cpu(), w, rtol=1e-4, atol=1e-4)
        kept = {i: want[o] for i, o in pairs.items()}
    if graph:
        assert sess.runner.replay.replays == 3 and sess.runner.replay.captures == 1


# ---------------------------------------------------------------- slots on two GPUs
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name", ["two_stage_skip", "tp_mlp"])
def test_slots_on_two_gpus_are_ordered_for_the_caller_on_both(name):
    path = GRAPHS / name / "pipeline.json"
    ref = on_cpu(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # capture is per device: issued eagerly
        sess = fastpipe.load(path, device_map={"0": "cuda:0", "1": "cuda:1"}, processor="cuda", compile="off")
    proc = CudaProcessor(slowed(sess.program, set(compute_keys(sess.program))), cuda_graph=False)
    for seed in range(3):
        parts = parts_of(ref, 2, seed)
        outs = proc.run(parts)
        # read on each output's device right away, on the caller's stream there: no host sync first
        got = [{k: (v * 1).cpu() for k, v in o.items()} for o in outs]
        assert_equal_reference(ref, parts, got)


def test_cli_run_prints_the_measured_peak_next_to_the_plan():
    import subprocess
    import sys

    d = GRAPHS / "tp_mlp"
    r = subprocess.run([sys.executable, "-m", "fastpipe", "run", d / "pipeline.json", "--processor", "cuda",
                        "--device-map", "0=cuda:0,1=cuda:0", "--repeat", "3"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("memory: ")]
    assert len(lines) == 1 and lines[0].startswith("memory: cuda:0 (slots 0, 1): measured peak "), r.stdout
    assert "; plan " in lines[0] and lines[0].rstrip().endswith("x")


def test_a_failed_capture_is_said_and_the_run_goes_on_eagerly():
    """A step that synchronizes (illegal while capturing) makes the capture fail: "warn" warns with the
    reason, runs on streams, and describe() says so; "raise" raises CompileError."""
    from fastpipe.errors import CompileError

    path = GRAPHS / "tp_mlp" / "pipeline.json"
    ref = on_cpu(path)
    sess = on_gpu(path, cuda_graph=False)

    def wrap(fn, key):
        def run(xs):
            torch.cuda.synchronize()
            return fn(xs)
        return run

    program = wrapped(sess.program, wrap)
    proc = CudaProcessor(program, cuda_graph=True, compile_policy="warn")
    assert proc.describe().endswith("replayed as one CUDA graph per chunk count on cuda:0")
    part = parts_of(ref, 1, 0)[0]
    proc.run([part])                                                    # eager warm-up
    with pytest.warns(RuntimeWarning, match="CUDA-graph capture failed"):
        out = proc.run([part])
    assert_equal_reference(ref, [part], out)
    assert "CUDA-graph capture failed (" in proc.describe() and proc.graph is None
    strict = CudaProcessor(program, cuda_graph=True, compile_policy="raise")
    strict.run([part])
    with pytest.raises(CompileError, match="CUDA-graph capture failed"):
        strict.run([part])
