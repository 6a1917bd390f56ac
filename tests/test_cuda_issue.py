"""The CUDA processor's issuing (fastpipe.runtime.cuda.stream_issue), on CPU through its host backend:
frees, the one-pass k-chunk schedule, per-chunk environments, inference mode, fork/join on every
device, traces, the memory report's plan; and the CudaProcessor's glue (one graph for a k-chunk
run, traced runs eager) with CUDA stubbed out. The GPU half is tests/test_cuda_processor_gpu.py."""
import dataclasses
import json
import warnings
import weakref
from typing import ClassVar

import pytest
import torch

import fastpipe
from fastpipe.errors import RunError
from fastpipe.runtime.cuda.graph_replay import GraphPool
from fastpipe.runtime.binding.microbatch import split_chunks
from fastpipe.runtime.cuda.stream_issue import (
    HostBackend,
    LaneRunner,
    chunk_order,
    flatten_chunks,
    format_memory_report,
    planned_memory,
    unflatten_chunks,
)
from tests.examples import EXAMPLES, GRAPHS
from tests.test_processors import fresh_inputs


def load_ref(name):
    return fastpipe.load(GRAPHS / name / "pipeline.json", processor="reference")


def write_chain(folder, *, stages=3, steps=2, batch=8, d=16, dtype="f32", weights=True, seed=0):
    """A pipeline-parallel chain (a pipeline in any dtype): stage s (slot s, npu:s) runs `steps` fx
    steps h = tanh(h @ w) (weights=False: h = tanh(h) * 1.5 + 0.1, no constants), then sends h to
    stage s+1; x comes in on stage 0, y goes out of the last. The weights (seeded, in the
    pipeline's dtype) are the same for every dtype up to rounding: a f32 twin is the oracle."""
    import json

    from safetensors.torch import save_file

    from fastpipe import dtypes
    from fastpipe.builder.assemble import Assembler

    folder.mkdir(parents=True, exist_ok=True)
    a = Assembler(f"chain_{dtype}")
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for s in range(stages):
        a.slot(str(s), {"kind": "npu", "idx": s})
    a.input("x", (batch, d), dtype)
    h = "x"
    for s in range(stages):
        if s:
            a.send_recv(f"p2p_{s}", str(s - 1), h, str(s), f"r{s}")
            h = f"r{s}"
        for k in range(steps):
            out = f"h{s}_{k}" if (s, k) != (stages - 1, steps - 1) else "y"
            if weights:
                w = f"w{s}_{k}"
                tensors[w] = (torch.randn(d, d, generator=g) / d ** 0.5).to(dtypes.to_torch(dtype))
                a.constant(w, shape=(d, d), dtype=dtype, path="weights.safetensors", name_in_file=w)
                a.fx(str(s), lambda x, w: torch.tanh(x @ w), [h, w], [out])
            else:
                a.fx(str(s), lambda x: torch.tanh(x) * 1.5 + 0.1, [h], [out])
            h = out
    a.output(["y"])
    if tensors:
        save_file(tensors, str(folder / "weights.safetensors"))
    (folder / "pipeline.json").write_text(json.dumps(a.to_json()))
    return folder / "pipeline.json"


def chunked(sess, chunks, seed=0):
    ins = fresh_inputs(sess, seed, scale=chunks)
    return split_chunks(ins, chunks, {n: sess.pipeline.tensors[n].shape[0] for n in sess.input_names})


def one_device(program):
    return {s: "dev" for s in program.slots}


def wrapped(program, wrap):
    """The Program with every compute step's fn and every group fn replaced by wrap(fn, key), key
    (slot, index) of the step (of a group: its first member)."""
    steps = {s: tuple(dataclasses.replace(st, fn=wrap(st.fn, (s, i))) if st.kind == "compute" else st
                      for i, st in enumerate(ss)) for s, ss in program.steps.items()}
    fns = {g: wrap(fn, program.groups[g][0]) for g, fn in program.group_fns.items()}
    return dataclasses.replace(program, steps=steps, group_fns=fns)


def runs(log):
    return [i for i, e in enumerate(log) if e[0] == "run"]


# ---------------------------------------------------------------- results
@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("chunks", [1, 3])
def test_lane_runner_equals_reference(name, chunks):
    ref = load_ref(name)
    runner = LaneRunner(ref.program, HostBackend(), one_device(ref.program))
    parts = chunked(ref, chunks, seed=chunks)
    outs = runner.run(parts)
    assert len(outs) == chunks
    for part, out in zip(parts, outs):             # each chunk's own environment: its own outputs
        want = ref.run(part)
        assert set(out) == set(want)
        for k in want:
            torch.testing.assert_close(out[k], want[k], rtol=0, atol=0)


# ---------------------------------------------------------------- frees
@pytest.mark.parametrize("name", EXAMPLES + ["chain"])
def test_intermediates_are_dropped_right_after_their_last_step_is_issued(name, tmp_path):
    """At each op, exactly the intermediates the Program says are alive (written, not yet freed, in
    that op's chunk) are alive; the rest are dead (weakrefs), long before the run ends."""
    ref = load_ref(name) if name != "chain" else fastpipe.load(write_chain(tmp_path, stages=4, steps=3), processor="reference")
    chunks = 2
    refs: dict[tuple[int, str], weakref.ref] = {}
    seen = []                                      # per op: the (chunk, name) alive when it started
    position = [0]
    holder = {}

    def wrap(fn, key):
        def run(xs):
            sched = holder["runner"].schedule(chunks)
            op, c = sched[position[0]]
            position[0] += 1
            seen.append({k for k, r in refs.items() if r() is not None})
            outs = fn(xs)
            for n, t in zip(op.writes, outs):
                refs[(c, n)] = weakref.ref(t)
            return outs
        return run

    program = wrapped(ref.program, wrap)
    runner = holder["runner"] = LaneRunner(program, HostBackend(), one_device(program))
    outs = runner.run(chunked(ref, chunks))
    sched = runner.schedule(chunks)
    outputs = set(program.outputs)
    alive: set = set()
    for (op, c), got in zip(sched, seen):
        assert got == alive, f"before {op.label} chunk {c}"
        alive |= {(c, n) for n in op.writes}
        alive -= {(c, n) for n in op.frees}
    freed_somewhere = {n for ss in program.steps.values() for st in ss for n in st.frees}
    assert freed_somewhere                                         # the example frees something
    assert {n for _, n in alive} <= outputs                       # only outputs outlive the run
    assert [set(o) for o in outs] == [outputs] * chunks


def test_pipeline_outputs_are_never_freed():
    ref = load_ref("two_stage_skip")
    program = ref.program
    last = program.steps["1"][-1]                                  # writes y, the output
    bad = dataclasses.replace(last, frees=last.frees + ("y",))
    program = dataclasses.replace(program, steps={**program.steps, "1": program.steps["1"][:-1] + (bad,)})
    part = chunked(ref, 1)[0]
    out = LaneRunner(program, HostBackend(), one_device(program)).run([part])[0]
    torch.testing.assert_close(out["y"], ref.run(part)["y"], rtol=0, atol=0)


@pytest.mark.parametrize("dtype,tol", [("bf16", 3e-2), ("f16", 5e-3)])
def test_chain_in_a_narrow_dtype_is_close_to_its_f32_twin(tmp_path, dtype, tol):
    """The GPU test's bf16/f16 pipelines, checked here on CPU: the narrow chain through the lane
    runner, in chunks, against the reference on the f32 twin (same weights, up to rounding)."""
    narrow = fastpipe.load(write_chain(tmp_path / dtype, dtype=dtype), processor="reference")
    ref = fastpipe.load(write_chain(tmp_path / "f32"), processor="reference")
    runner = LaneRunner(narrow.program, HostBackend(), one_device(narrow.program))
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)).to(narrow.program.steps["0"][0].constants["w0_0"].dtype)
    outs = runner.run([{"x": x[:8]}, {"x": x[8:]}])
    assert outs[0]["y"].dtype == x.dtype
    got = torch.cat([o["y"] for o in outs]).float()
    want = torch.cat([ref.run({"x": x[:8].float()})["y"], ref.run({"x": x[8:].float()})["y"]])
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert not torch.equal(got, want)                                # it did run in the narrow dtype


# ---------------------------------------------------------------- the k-chunk schedule
@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_chunk_order_keeps_every_dependency(name, chunks):
    program = load_ref(name).program
    order = chunk_order(program, chunks)
    pos = {k: p for p, k in enumerate(order)}
    assert len(pos) == len(order) == chunks * sum(len(ss) for ss in program.steps.values())
    for s, ss in program.steps.items():
        for c in range(chunks):
            for i, st in enumerate(ss):
                if i:
                    assert pos[(s, i - 1, c)] < pos[(s, i, c)]
                if c:
                    assert pos[(s, len(ss) - 1, c - 1)] < pos[(s, 0, c)]          # a slot's chunks in order
                for ws, wi in st.waits:
                    assert pos[(ws, wi, c)] < pos[(s, i, c)]                     # waits within the chunk
    for members in program.groups.values():
        for c in range(chunks):                                   # a group's members complete together
            ps = sorted(pos[(s, i, c)] for s, i in members)
            assert ps == list(range(ps[0], ps[0] + len(ps)))


def test_pipeline_stages_overlap_chunks_in_issue_order():
    """two_stage_skip (stage 0 -> sends -> stage 1): stage 0's chunk 1 is issued before stage 1's
    chunk 0 compute, and no lane waits on another chunk's event."""
    ref = load_ref("two_stage_skip")
    b = HostBackend()
    runner = LaneRunner(ref.program, b, one_device(ref.program))
    runner.run(chunked(ref, 3))
    order = runner.chunk_order(3)
    assert order.index(("0", 0, 1)) < order.index(("1", 2, 0))
    issued = [(op.lane, op.keys[0], c) for op, c in runner.schedule(3)]
    ran = [e[1] for e in b.log if e[0] == "run"]
    assert ran == [f"lane:{lane}" for lane, _, _ in issued]
    assert issued.index(("0", ("0", 0), 1)) < issued.index(("1", ("1", 2), 0))


def _wait_owners(b: HostBackend, runner: LaneRunner, chunks: int):
    """Each wait in the log: (the op it gates or the group it completes, that op's chunk, the event's key)."""
    sched = runner.schedule(chunks)
    key_of = {}
    p = 0                                                      # ops issued so far
    last_record = None
    out = []
    for e in b.log:
        if e[0] == "record":
            key_of[e[3]] = e[2]
            last_record = e[3]
        elif e[0] == "run":
            p += 1
        elif e[0] == "wait":
            lane, token = e[1], e[2]
            slot = lane[len("lane:"):]
            prev = sched[p - 1][0] if p else None
            if token == last_record and slot != prev.lane and slot in {s for s, _ in prev.keys}:
                op, c = sched[p - 1]               # a member lane waits for its group to complete
                out.append((op, c, key_of[token], "member"))
            else:
                op, c = sched[p]                  # waits issued before the op's run
                assert lane == f"lane:{op.lane}"
                out.append((op, c, key_of[token], "before"))
    return out


@pytest.mark.parametrize("name", EXAMPLES)
def test_whole_schedule_in_one_pass_fork_and_join_only_at_the_ends(name):
    ref = load_ref(name)
    b = HostBackend()
    runner = LaneRunner(ref.program, b, one_device(ref.program))
    chunks = 3
    runner.run(chunked(ref, chunks))
    log = b.log
    r = runs(log)
    assert len(r) == len(runner.schedule(chunks))
    forks = [i for i, e in enumerate(log) if e[0] == "fork"]
    joins = [i for i, e in enumerate(log) if e[0] == "join"]
    assert len(forks) == len(joins) == len(runner.lanes)          # once per lane, one device
    assert max(forks) < r[0] and min(joins) > r[-1]                # nothing joins between chunks
    # every wait is within its chunk, for a step the Program says the op must follow
    done_by = {}
    for op, _ in runner.schedule(chunks):
        for k in op.keys:
            done_by[k] = op
    for op, c, (ks, ki, kc), why in _wait_owners(b, runner, chunks):
        assert kc == c, f"{op.label} chunk {c} waits for chunk {kc}"
        if why == "before":
            assert any(done_by[w] is done_by[(ks, ki)] for w in op.waits)


def test_no_wait_beyond_the_programs():
    """A slot's chunk c+1 steps wait for nothing of another slot's chunk c: on two_stage_skip every
    wait is the Program's (the p2p groups), counted exactly."""
    ref = load_ref("two_stage_skip")
    b = HostBackend()
    runner = LaneRunner(ref.program, b, one_device(ref.program))
    runner.run(chunked(ref, 4))
    waits = _wait_owners(b, runner, 4)
    # per chunk: stage 1's lane waits for each of the two p2p groups (run on stage 0's lane); stage 0 waits for nothing
    assert sorted((op.label, c) for op, c, _, _ in waits) == sorted(
        (g, c) for c in range(4) for g in ("fp:group:p2p_skip", "fp:group:p2p_h2"))
    assert all(why == "member" for *_, why in waits)


def recording_inference_mode(modes: list):
    """A wrap for wrapped(): each call appends whether inference mode was on, then runs the step."""
    def wrap(fn, key):
        def run(xs):
            modes.append(torch.is_inference_mode_enabled())
            return fn(xs)
        return run
    return wrap


def test_every_step_runs_under_inference_mode():
    ref = load_ref("tp_mlp")
    modes = []
    program = wrapped(ref.program, recording_inference_mode(modes))
    outs = LaneRunner(program, HostBackend(), one_device(program)).run(chunked(ref, 2))
    assert len(modes) == 2 * (sum(1 for ss in program.steps.values() for st in ss if st.kind == "compute")
                              + len(program.groups))
    assert all(modes)
    assert all(t.is_inference() for out in outs for t in out.values())


def test_two_devices_fork_from_and_join_to_every_callers_stream():
    ref = load_ref("tp_mlp")                                     # x is read on both slots
    b = HostBackend()
    runner = LaneRunner(ref.program, b, {"0": "d0", "1": "d1"})
    parts = chunked(ref, 2)
    outs = runner.run(parts)
    forks = {(e[1], e[2]) for e in b.log if e[0] == "fork"}
    joins = {(e[1], e[2]) for e in b.log if e[0] == "join"}
    lanes = {"lane:0", "lane:1"}
    callers = {"caller:d0", "caller:d1"}
    assert forks == {(lane, c) for lane in lanes for c in callers}
    assert joins == {(c, lane) for c in callers for lane in lanes}
    r = runs(b.log)
    assert all(i < r[0] for i, e in enumerate(b.log) if e[0] in ("fork", "place"))
    assert all(i > r[-1] for i, e in enumerate(b.log) if e[0] in ("join", "hand_out"))
    assert len([e for e in b.log if e[0] == "hand_out"]) == 2          # y, made on a lane, per chunk
    assert sorted(e[1] for e in b.log if e[0] == "place") == ["d0", "d0", "d1", "d1"]   # x, on each device, per chunk
    for part, out in zip(parts, outs):
        torch.testing.assert_close(out["y"], ref.run(part)["y"], rtol=0, atol=0)


def test_tensors_crossing_lanes_are_handed_to_the_backend():
    """A tensor made on one lane and read on another is `use`d there (record_stream on CUDA): on
    two_stage_skip the p2p groups run on stage 0's lane and stage 1 reads what they made."""
    ref = load_ref("two_stage_skip")
    b = HostBackend()
    LaneRunner(ref.program, b, one_device(ref.program)).run(chunked(ref, 2))
    uses = [e for e in b.log if e[0] == "use"]
    assert uses == [("use", "lane:1")] * 4                      # h1_r and h2_r, per chunk


def test_cuda_backend_keeps_a_peer_read_tensor_for_the_stream_that_copies_it(monkeypatch):
    """CudaBackend.use: on the lane's device, record_stream(lane); a tensor on another GPU is read by a
    peer copy on that GPU's current stream, so its memory waits for that stream (not the lane)."""
    from types import SimpleNamespace as NS

    from fastpipe.runtime.cuda.stream_issue import CudaBackend

    current = {torch.device("cuda", 0): "stream-cuda:0-current"}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[device])
    recorded = []

    def tensor(dev):
        return NS(device=torch.device(dev), record_stream=recorded.append)
    lane = NS(device=torch.device("cuda", 1))
    CudaBackend().use(tensor("cuda:1"), lane)
    CudaBackend().use(tensor("cuda:0"), lane)
    assert recorded == [lane, "stream-cuda:0-current"]


def test_a_failing_step_is_named_and_the_lanes_still_join():
    ref = load_ref("two_stage_skip")

    def wrap(fn, key):
        if key != ("1", 2):
            return fn

        def boom(xs):
            raise ValueError("simulated")
        return boom

    program = wrapped(ref.program, wrap)
    b = HostBackend()
    with pytest.raises(RunError, match=r'supertasks\["6"\] on slot "1": failed: ValueError: simulated'):
        LaneRunner(program, b, one_device(program)).run(chunked(ref, 1))
    assert [e[0] for e in b.log[-2:]] == ["join", "join"]


# ---------------------------------------------------------------- traces
def test_trace_has_every_step_of_every_chunk_with_its_lane():
    ref = load_ref("moe_all_to_all")
    runner = LaneRunner(ref.program, HostBackend(), one_device(ref.program))
    trace = []
    runner.run(chunked(ref, 2), trace=trace)
    steps = {(st.slot, st.label) for ss in ref.program.steps.values() for st in ss}
    assert sorted((s, lbl, c) for s, lbl, _, _, c in trace) == sorted((s, lbl, c) for s, lbl in steps for c in (0, 1))
    assert all(0 <= t0 <= t1 for _, _, t0, t1, _ in trace)
    # a group's members share its time
    for members in ref.program.groups.values():
        for c in (0, 1):
            labels = {ref.program.steps[s][i].label for s, i in members}
            assert len({(t0, t1) for s, lbl, t0, t1, cc in trace if lbl in labels and cc == c}) == 1


# ---------------------------------------------------------------- flat chunk dicts and memory
def test_flatten_chunks_round_trips():
    parts = [{"x": 1, "y": 2}, {"x": 3, "y": 4}, {"x": 5, "y": 6}]
    flat = flatten_chunks(parts)
    assert flat == {"0\x00x": 1, "0\x00y": 2, "1\x00x": 3, "1\x00y": 4, "2\x00x": 5, "2\x00y": 6}
    assert unflatten_chunks(flat, 3) == parts
    assert flatten_chunks(parts[:1]) == parts[0] and unflatten_chunks(parts[0], 1) == parts[:1]


def test_planned_memory_and_its_report():
    program = load_ref("tp_mlp").program
    assert program.peak_bytes == {"0": 4096, "1": 4096}
    const = program.constant_bytes
    one = planned_memory(program, {"0": "cuda:0", "1": "cuda:0"})
    assert one == {"cuda:0": {"slots": ("0", "1"), "activation_bytes": 8192, "constant_bytes": const["0"] + const["1"],
                              "predicted_peak_bytes": 8192 + const["0"] + const["1"]}}
    two = planned_memory(program, {"0": "cuda:0", "1": "cuda:1"})
    assert two["cuda:1"] == {"slots": ("1",), "activation_bytes": 4096, "constant_bytes": const["1"],
                             "predicted_peak_bytes": 4096 + const["1"]}
    assert format_memory_report(two) == ["cuda:0 (slot 0): plan 69.5KiB (intermediates 4.0KiB + constants 65.5KiB)",
                                         "cuda:1 (slot 1): plan 69.0KiB (intermediates 4.0KiB + constants 65.0KiB)"]
    one["cuda:0"]["measured_peak_bytes"] = 2 * one["cuda:0"]["predicted_peak_bytes"]
    assert format_memory_report(one) == [("cuda:0 (slots 0, 1): measured peak 277.0KiB; plan 138.5KiB "
                                          "(intermediates 8.0KiB + constants 130.5KiB); 2.00x")]


# ---------------------------------------------------------------- the CudaProcessor's glue, CUDA stubbed out
class FakeReplay:
    made: ClassVar[list] = []

    def __init__(self, fn, device, *, policy="warn", alias_outputs=False, state=None, turns=None, written=()):
        self.fn, self.device, self.calls, self.graph, self.pool, self.turns = fn, device, [], None, None, turns
        FakeReplay.made.append(self)

    def use_pool(self, pool):
        self.pool, self.turns = pool, pool.turns

    def __call__(self, inputs):
        self.calls.append(sorted(inputs))
        return self.fn(dict(inputs))


@pytest.fixture
def stubbed_cuda(monkeypatch):
    from fastpipe.runtime.processors import cuda as cp

    backends = []

    def backend():
        b = HostBackend()
        backends.append(b)
        return b

    FakeReplay.made = []
    monkeypatch.setattr(cp, "check_cuda_devices", lambda devs: None)
    monkeypatch.setattr(cp, "CudaBackend", backend)
    monkeypatch.setattr(cp, "GraphReplay", FakeReplay)
    monkeypatch.setattr(cp.torch.cuda, "reset_peak_memory_stats", lambda d: None)
    monkeypatch.setattr(cp.torch.cuda, "max_memory_allocated", lambda d: 12345)
    return cp, backends


def test_a_k_chunk_run_is_one_replayed_function_and_a_traced_run_is_eager(stubbed_cuda):
    cp, backends = stubbed_cuda
    ref = load_ref("two_stage_skip")
    proc = cp.CudaProcessor(ref.program)
    log = backends[0].log
    parts = chunked(ref, 3)
    outs = proc.run(parts)
    assert len(FakeReplay.made) == 1 and FakeReplay.made[0].calls == [sorted(f"{c}\x00{n}" for c in range(3)
                                                                           for n in ("x", "scale"))]
    assert len([e for e in log if e[0] == "fork"]) == 2            # the 3 chunks: one issue, one fork/join
    for part, out in zip(parts, outs):
        torch.testing.assert_close(out["y"], ref.run(part)["y"], rtol=0, atol=0)
    proc.run([parts[0]])                                             # one chunk: a replay of its own, plain names
    assert len(FakeReplay.made) == 2 and FakeReplay.made[1].calls == [["scale", "x"]]
    trace = []
    with pytest.warns(RuntimeWarning, match=r"a traced run is issued eagerly on streams, not replayed"):
        proc.run(parts, trace=trace)
    assert len(trace) == 3 * 6 and len(FakeReplay.made[0].calls) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        proc.run(parts, trace=[])                        # warned once
    assert proc.memory_report()["cpu"]["measured_peak_bytes"] == 12345
    assert {id(r.turns) for r in FakeReplay.made} == {id(proc.turns)}   # one processor, one turn at a time
    pool = GraphPool()
    proc.use_pool(pool)                                            # every chunk count's graph, made and to be made
    proc.run(parts[:2])
    assert [r.pool for r in FakeReplay.made] == [pool] * 3
    assert proc.turns is pool.turns and all(r.turns is pool.turns for r in FakeReplay.made)


def test_eager_runs_take_the_processors_turn(stubbed_cuda):
    """A traced (eager) run issues onto the lanes every replay of the processor uses: it holds the
    processor's lock (the pool's, with a pool), so no other thread captures or replays meanwhile."""
    cp, _ = stubbed_cuda
    ref = load_ref("two_stage_skip")
    proc = cp.CudaProcessor(ref.program)
    held = []
    inner = proc.runner.run
    proc.runner.run = lambda parts, trace=None: held.append(proc.turns.lock.locked()) or inner(parts, trace=trace)
    with pytest.warns(RuntimeWarning, match="a traced run is issued eagerly"):
        proc.run([chunked(ref, 1)[0]], trace=[])
    eager = cp.CudaProcessor(ref.program, cuda_graph=False)
    eager.runner.run = lambda parts, trace=None: held.append(eager.turns.lock.locked()) or [{}]
    eager.run([chunked(ref, 1)[0]])
    assert held == [True, True] and not proc.turns.lock.locked()


def test_the_processor_issues_eagerly_without_graphs(stubbed_cuda):
    cp, _ = stubbed_cuda
    ref = load_ref("tp_mlp")
    proc = cp.CudaProcessor(ref.program, cuda_graph=False)
    part = chunked(ref, 1)[0]
    out = proc.run([part])[0]
    assert FakeReplay.made == [] and out["y"].is_inference()
    torch.testing.assert_close(out["y"], ref.run(part)["y"], rtol=0, atol=0)


def test_trace_file_from_the_runner_has_a_lane_per_slot(tmp_path):
    from fastpipe.runtime.trace import write_chrome_trace

    ref = load_ref("two_stage_skip")
    trace = []
    LaneRunner(ref.program, HostBackend(), one_device(ref.program)).run(chunked(ref, 2), trace=trace)
    write_chrome_trace(tmp_path / "t.json", trace, tuple(ref.pipeline.devices))
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert len([e for e in ev if e["ph"] == "X"]) == 2 * 6
