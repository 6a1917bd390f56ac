"""fastpipe's CUDA-graph capture lifecycle (fastpipe.runtime.cuda.graph_replay), on the CPU.

These tests check fastpipe's own logic, not CUDA: the torch.cuda pieces GraphReplay and
fastpipe.runtime.cuda.capture use (CUDAGraph and its capture_begin/capture_end, stream, synchronize,
empty_cache, graph_pool_handle, Stream, current_stream, Event, device) are replaced by small fakes. A fake capture records the "kernels" a function hands to `launch` instead
of running them, and a fake replay runs them again on the tensors the capture saw, as a CUDA graph
does; what the GPU does is tested by tests/test_graph_replay_gpu.py (marked `cuda`).
"""
import contextlib
import gc
import threading
import types
import time

import pytest
import torch

import fastpipe
from fastpipe.errors import CompileError, InputError
from fastpipe.options import RunOptions
from fastpipe.runtime.processors.registry import with_fields
from fastpipe.runtime.cuda import capture as cuda_capture
from fastpipe.runtime.cuda.graph_replay import GraphPool, GraphReplay, ReplayOptions
from tests.examples import GRAPHS

CPU = torch.device("cpu")


class FakeCuda:
    """The fakes' shared state: what each capture was given, and how many replays overlap."""

    def __init__(self):
        self.capturing = None            # (graph, thread id) of the capture under way
        self.captures: list[dict] = []   # each capture_begin: graph, pool, the current stream, mode
        self.fail_end = 0                # the next this many capture_end calls raise (an invalidated capture)
        self.ends = 0                    # capture_end calls
        self.primed: list = []           # threads prime_blas ran in
        self.routing_ended: list = []    # end_pool_routing calls: (device index, pool)
        self.handles: list = []
        self.delay = 0.0                 # seconds each replay takes
        self.barrier: threading.Barrier | None = None
        self.active = self.max_active = 0
        self.guard = threading.Lock()
        self.waits = 0                   # stream.wait_event calls

    def launch(self, kernel):
        """A kernel: recorded into the graph when this thread is capturing, else run now."""
        if self.capturing is not None and self.capturing[1] == threading.get_ident():
            self.capturing[0].kernels.append(kernel)
        else:
            kernel()


class FakeGraph:
    def __init__(self, fake):
        self.fake, self.kernels, self.replays = fake, [], 0

    def capture_begin(self, pool=None, capture_error_mode="global"):
        f = self.fake
        assert f.capturing is None, "two captures at once"
        f.captures.append({"graph": self, "pool": pool, "stream": torch.cuda.current_stream(),
                           "mode": capture_error_mode})
        f.capturing = (self, threading.get_ident())

    def capture_end(self):
        f = self.fake
        assert f.capturing is not None and f.capturing[0] is self and torch.cuda.current_stream() is \
            f.captures[-1]["stream"], "capture_end on another stream than capture_begin's"
        f.capturing = None
        f.ends += 1
        if f.fail_end:
            f.fail_end -= 1
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    def replay(self):
        f = self.fake
        with f.guard:
            f.active += 1
            f.max_active = max(f.max_active, f.active)
        try:
            if f.barrier is not None:
                f.barrier.wait()
            time.sleep(f.delay)
            for k in self.kernels:
                k()
            self.replays += 1
        finally:
            with f.guard:
                f.active -= 1


class FakeStream:
    def __init__(self, fake, device=None, priority=0):
        self.fake, self.priority = fake, priority

    def wait_event(self, event):
        self.fake.waits += 1


class FakeEvent:
    def record(self, stream):
        self.stream = stream


@pytest.fixture
def fake(monkeypatch):
    f = FakeCuda()
    default = FakeStream(f)
    local = threading.local()

    @contextlib.contextmanager
    def stream(s):
        before = getattr(local, "stream", default)
        local.stream = s
        try:
            yield
        finally:
            local.stream = before

    def handle():
        f.handles.append(("pool", len(f.handles)))
        return f.handles[-1]

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: FakeGraph(f))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", handle)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, priority=0: FakeStream(f, device, priority))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: getattr(local, "stream", default))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cuda_capture, "_CAPTURE_STREAMS", {})
    monkeypatch.setattr(cuda_capture, "prime_blas", lambda device, stream: f.primed.append(threading.get_ident()))
    monkeypatch.setattr(cuda_capture, "end_pool_routing", lambda index, pool: f.routing_ended.append((index, pool)))
    f.use_stream = lambda: setattr(local, "stream", FakeStream(f))     # this thread on a stream of its own
    return f


def doubling(fake, calls):
    """fn(x) -> y = 2x, its one kernel handed to `launch`."""
    def fn(ins):
        calls.append(threading.get_ident())
        x = ins["x"]
        y = torch.empty_like(x)
        fake.launch(lambda: torch.mul(x, 2, out=y))
        return {"y": y}
    return fn


def accumulating(fake, calls):
    """fn(x, c) -> c += x in place (state c -> c_new), y = c."""
    def fn(ins):
        calls.append(1)
        x, c = ins["x"], ins["c"]
        y = torch.empty_like(x)

        def kernel():
            c.add_(x)
            y.copy_(c)
        fake.launch(kernel)
        return {"y": y, "c_new": c}
    return fn


def test_capture_at_warm_up_makes_every_call_a_replay(fake):
    calls = []
    r = GraphReplay(doubling(fake, calls), CPU)
    assert r.capture({"x": torch.ones(4)}) and r.replaying
    assert len(calls) == 2                         # an eager warm-up call (fn never ran), then the capture
    assert r.graph.replays == 0                    # capturing runs nothing
    for i in range(5):
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        assert torch.equal(r({"x": x})["y"], 2 * x)
    assert len(calls) == 2 and r.replays == r.graph.replays == 5     # never fn again: only replays
    assert len(fake.captures) == r.captures == 1
    assert fake.captures[0]["mode"] == "thread_local" and fake.captures[0]["pool"] == fake.handles[0]  # named
    assert fake.captures[0]["stream"].priority == -1 and fake.primed == [threading.get_ident()]
    assert r.capture({"x": torch.ones(4)}) and r.captures == 1      # held: nothing to capture again


def test_without_capture_the_second_call_captures(fake):
    """The lazy path (no warm-up): call 1 eager, call 2 captures and replays, later calls replay."""
    calls = []
    r = GraphReplay(doubling(fake, calls), CPU)
    xs = [torch.full((3,), float(i)) for i in range(4)]
    outs = [r({"x": x})["y"] for x in xs]
    assert [torch.equal(o, 2 * x) for o, x in zip(outs, xs)] == [True] * 4
    assert len(calls) == 2 and r.captures == 1 and r.replays == 3


def test_capture_after_warm_up_runs_nothing_and_takes_the_callers_state(fake):
    calls = []
    r = GraphReplay(accumulating(fake, calls), CPU, state={"c": "c_new"})
    r({"x": torch.ones(2), "c": torch.zeros(2)})                    # the eager warm-up (on other tensors)
    cache = torch.zeros(2)
    assert r.capture({"x": torch.ones(2), "c": cache})
    assert len(calls) == 2 and torch.equal(cache, torch.zeros(2))   # captured, not run: the cache is untouched
    assert r.static_in["c"] is cache and r.captured_on({"x": torch.ones(2), "c": cache})
    out = r({"x": torch.full((2,), 3.0), "c": cache})
    assert out["c_new"] is cache and torch.equal(cache, torch.full((2,), 3.0))   # updated once, in place
    assert torch.equal(out["y"], cache) and out["y"] is not cache
    other = torch.zeros(2)                                          # other state tensors: captured anew on them
    assert r.capture({"x": torch.ones(2), "c": other}) and r.captures == 2 and r.static_in["c"] is other
    assert r.capture({"x": torch.ones(2), "c": other}) and r.captures == 2
    assert len(calls) == 3


def test_outputs_stay_valid_after_the_next_call_unless_aliased(fake):
    r = GraphReplay(doubling(fake, []), CPU)
    r.capture({"x": torch.zeros(3)})
    x1, x2 = torch.full((3,), 1.0), torch.full((3,), 5.0)
    o1 = r({"x": x1})["y"]
    o2 = r({"x": x2})["y"]
    assert torch.equal(o1, 2 * x1) and torch.equal(o2, 2 * x2)
    a = GraphReplay(doubling(fake, []), CPU, alias_outputs=True)
    a.capture({"x": torch.zeros(3)})
    o1 = a({"x": x1})["y"]
    assert o1 is a.static_out["y"] and torch.equal(o1, 2 * x1)
    a({"x": x2})
    assert torch.equal(o1, 2 * x2)                  # alias_outputs: valid only until the next call


def test_one_pool_handle_reaches_every_capture_of_the_pool(fake):
    pool = GraphPool()
    assert fake.handles == []                       # made at the first capture, not before
    a = GraphReplay(doubling(fake, []), CPU, pool=pool)
    b = GraphReplay(doubling(fake, []), CPU)
    b.use_pool(pool)
    solo = GraphReplay(doubling(fake, []), CPU)
    for r in (a, b, solo):
        r.capture({"x": torch.zeros(2)})
    assert len(fake.handles) == 2 and pool.graphs == 2              # the pool's, and solo's private one
    assert [c["pool"] for c in fake.captures] == [fake.handles[0], fake.handles[0], fake.handles[1]]
    assert {id(c["stream"]) for c in fake.captures} == {id(fake.captures[0]["stream"])}   # one capture stream
    assert {c["mode"] for c in fake.captures} == {"thread_local"}
    with pytest.raises(ValueError, match="before the capture"):
        solo.use_pool(pool)


def _hammer(r, seeds, results):
    for s in seeds:
        x = torch.full((8,), float(s))
        results.append(torch.equal(r({"x": x})["y"], 2 * x))


def test_two_threads_on_one_replay_take_turns(fake):
    """Copy-in, replay and copy-out of one call never interleave with another thread's: each thread
    gets its own inputs doubled, and no two replays overlap."""
    r = GraphReplay(doubling(fake, []), CPU)
    r.capture({"x": torch.zeros(8)})
    fake.delay = 0.002
    results = []
    threads = [threading.Thread(target=_hammer, args=(r, range(k, 200, 2), results)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 200 and all(results) and fake.max_active == 1


def test_a_pool_serialises_its_replays_and_other_pools_run_alongside(fake):
    pool = GraphPool()
    shared = [GraphReplay(doubling(fake, []), CPU, pool=pool) for _ in range(2)]
    apart = [GraphReplay(doubling(fake, []), CPU) for _ in range(2)]
    for r in shared + apart:
        r.capture({"x": torch.zeros(8)})
    fake.delay, results = 0.002, []
    threads = [threading.Thread(target=_hammer, args=(r, range(20), results)) for r in shared]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake.max_active == 1 and all(results)
    fake.barrier = threading.Barrier(2, timeout=10)         # both replays must be inside at once to pass
    threads = [threading.Thread(target=_hammer, args=(r, range(1), results)) for r in apart]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake.max_active == 2 and len(results) == 42 and all(results)


def test_a_call_from_another_stream_waits_for_the_last_ones_work(fake):
    r = GraphReplay(doubling(fake, []), CPU)
    r.capture({"x": torch.zeros(2)})
    r({"x": torch.ones(2)})
    r({"x": torch.ones(2)})
    assert fake.waits == 0                                   # one stream: ordered already
    t = threading.Thread(target=lambda: (fake.use_stream(), r({"x": torch.ones(2)})))
    t.start()
    t.join()
    assert fake.waits == 1


def test_another_thread_replays_while_one_captures(fake):
    """A capture holds the process's capture lock, not the replays' locks: another replay goes on."""
    ready = GraphReplay(doubling(fake, []), CPU)
    ready.capture({"x": torch.zeros(2)})
    inside, done = threading.Event(), threading.Event()

    def slow(ins):
        if fake.capturing is not None:
            inside.set()
            assert done.wait(10), "the other thread's replays did not go on during the capture"
        return doubling(fake, [])(ins)

    late = GraphReplay(slow, CPU)
    late({"x": torch.zeros(2)})
    t = threading.Thread(target=late.capture, args=({"x": torch.zeros(2)},))
    t.start()
    assert inside.wait(10)
    for i in range(3):
        x = torch.full((2,), float(i))
        assert torch.equal(ready({"x": x})["y"], 2 * x)     # replayed and eager work of other threads is not captured
    done.set()
    t.join()
    assert late.replaying and len(late.graph.kernels) == 1 and len(ready.graph.kernels) == 1


def test_a_capture_failure_is_reported_at_capture(fake):
    def breaks(ins):
        if fake.capturing is not None:
            raise RuntimeError("operation not permitted when stream is capturing")
        return {"y": ins["x"] * 2}

    r = GraphReplay(breaks, CPU)
    with pytest.warns(RuntimeWarning, match=r"CUDA-graph capture failed \(RuntimeError: operation not permitted"):
        assert r.capture({"x": torch.ones(2)}) is False
    assert not r.replaying and r.failure.startswith("RuntimeError")
    assert torch.equal(r({"x": torch.ones(2)})["y"], torch.full((2,), 2.0))      # eager from then on
    assert r.capture({"x": torch.ones(2)}) is False and len(fake.captures) == 1
    strict = GraphReplay(breaks, CPU, policy="raise")
    with pytest.raises(CompileError, match="^CUDA-graph capture failed: RuntimeError: operation not permitted"):
        strict.capture({"x": torch.ones(2)})
    assert fake.ends == 2 and fake.routing_ended == []       # each capture ended normally: nothing to undo
    assert torch.cuda.current_stream() is not fake.captures[0]["stream"]   # off the capture stream again


@pytest.mark.parametrize("body_fails", [False, True], ids=["end-fails", "body-and-end-fail"])
@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_an_invalidated_capture_leaves_the_stream_and_the_allocator_as_they_were(fake, body_fails, policy):
    """capture_end raising (an invalidated capture): the thread is back on its own stream (torch.cuda.graph's
    __exit__ would leave it on the capture stream), the allocator's routing into the capture's pool is ended
    (torch <= 2.11 leaves it), and the failure is reported per policy, with the body's error when it had one."""
    def fn(ins):
        if fake.capturing is not None and body_fails:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (cudaStreamSynchronize)")
        return {"y": ins["x"] * 2}

    own = torch.cuda.current_stream()
    fake.fail_end = 1
    r = GraphReplay(fn, CPU, policy=policy)
    want = "cudaStreamSynchronize" if body_fails else "operation not permitted when stream is capturing"
    if policy == "raise":
        with pytest.raises(CompileError, match=want):
            r.capture({"x": torch.ones(2)})
    else:
        with pytest.warns(RuntimeWarning, match=want):
            assert r.capture({"x": torch.ones(2)}) is False
        assert torch.equal(r({"x": torch.ones(2)})["y"], torch.full((2,), 2.0))     # eager from then on
    assert torch.cuda.current_stream() is own and fake.capturing is None
    assert fake.routing_ended == [(0, fake.captures[0]["pool"])] and fake.captures[0]["pool"] == fake.handles[0]
    assert not r.replaying


@pytest.mark.parametrize("body_fails", [False, True], ids=["captured", "body-fails"])
@pytest.mark.parametrize("collector_on", [True, False], ids=["gc-on", "gc-off"])
def test_no_garbage_collection_inside_a_capture(fake, body_fails, collector_on):
    """A collection inside a capture could destroy an unreachable old CUDAGraph there, and its
    cudaGraphExecDestroy invalidates the capture: the collector is off while the body runs and back as
    the caller had it after, the capture failed or not; cyclic garbage made before goes after."""
    freed_while_capturing = []

    class Old:                                      # an old graph in a reference cycle
        def __init__(self):
            self.me = self

        def __del__(self):
            freed_while_capturing.append(fake.capturing is not None)

    seen = []

    def fn(ins):
        if fake.capturing is not None:
            seen.append(gc.isenabled())
            Old()                                   # unreachable from here on
            before = gc.get_count()[0]
            junk = [[i] for i in range(5 * gc.get_threshold()[0])]   # allocations that would trigger one
            assert gc.get_count()[0] > before and junk
            if body_fails:
                raise RuntimeError("body failed")
        return {"y": ins["x"] * 2}

    was = gc.isenabled()
    try:
        gc.enable() if collector_on else gc.disable()
        r = GraphReplay(fn, CPU, policy="warn")
        if body_fails:
            with pytest.warns(RuntimeWarning, match="body failed"):
                assert r.capture({"x": torch.ones(2)}) is False
        else:
            assert r.capture({"x": torch.ones(2)}) is True
        assert seen == [False] and gc.isenabled() is collector_on
        assert True not in freed_while_capturing
    finally:
        gc.enable() if was else gc.disable()
    gc.collect()
    assert freed_while_capturing == [False]


def test_graph_pool_option_is_checked():
    with pytest.raises(InputError, match="^graph_pool: expected a fastpipe.runtime.cuda.graph_replay.GraphPool or None, "
                                         "found str$"):
        ReplayOptions(graph_pool="shared")
    pool = GraphPool()
    assert with_fields(None, graph_pool=pool).of(ReplayOptions).graph_pool is pool


def test_session_compile_captures_so_the_first_run_replays(fake):
    """Plumbing only: Session.compile reaches the processor's GraphReplay and captures it at warm-up.
    A CPU region processor has no replay, so one with the fakes is put in; the fake capture of the real
    region function records no kernels, so the values are not checked here (the GPU test does)."""
    sess = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="region", graph_pool=GraphPool(), compile="off")
    assert sess.runner.replay is None and sess.capture() is False
    calls = []
    inner = sess.runner._run_env
    sess.runner.replay = r = GraphReplay(lambda ins: (calls.append(1), inner(ins))[1], CPU,
                                         pool=sess.run_options.of(ReplayOptions).graph_pool)
    sess.compile()
    assert r.replaying and len(calls) == 2 and r.replays == 0    # warm-up run, then the capture
    sess.run({"x": torch.randn(8, 64)})
    assert len(calls) == 2 and r.replays == 1                   # the first run replays
    assert sess.capture() and r.captures == 1
    assert "replayed as one CUDA graph" in sess.describe()


def test_a_dropped_session_with_a_captured_replay_frees_its_weights_at_once(fake):
    """The replay holds its processor's run function weakly (fastpipe.runtime.binding.release.weak_method), as the region
    and cuda processors make it: captured and replayed, nothing in it leads back to the processor, so dropping the
    session frees the weights with the collector off (a bound method here would keep them until a collection)."""
    from fastpipe.runtime.binding.release import weak_method
    from fastpipe.weights import WeightStore

    store = WeightStore()
    sess = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="region", store=store, graph_pool=GraphPool(), compile="off")
    sess.runner.replay = r = GraphReplay(weak_method(sess.runner._run_env), CPU, pool=sess.run_options.of(ReplayOptions).graph_pool)
    sess.compile()
    sess.run({"x": torch.randn(8, 64)})
    assert r.replays == 1
    gc.collect()
    with cuda_capture.no_collection():
        assert store.stats()["live_slices"] > 0
        del sess
        assert store.stats()["live_slices"] == 0


SET = GRAPHS.parent / "tests" / "data" / "serving" / "llama_tp2"


def test_buckets_warm_up_largest_first_in_one_pool_on_the_engines_caches(monkeypatch):
    """Order and plumbing only (a CPU has no graph to capture, so every bucket is made to look as if it
    had one): the buckets share one GraphPool, warm up largest first (batch x length of input_ids), and
    the engine's decode and prefill buckets are captured on the engine's own caches."""
    from fastpipe.serving.buckets import ServingBuckets
    from fastpipe.serving.engine import Engine
    from fastpipe.session import Session

    from fastpipe.runtime.processors.region import RegionProcessor

    seen = []
    monkeypatch.setattr(RegionProcessor, "graph_replays", lambda self: [types.SimpleNamespace()])   # a "replay"
    monkeypatch.setattr(Session, "compile", lambda self, inputs=None, capture=True: seen.append((self, inputs, capture)))
    with Engine(SET, eos_token_id=None, compile=False) as eng:
        bs = eng.buckets
        assert [s for s, *_ in seen] == bs.by_size() == [bs.prefills[(2, 8)], bs.decodes[2]]
        prefill_caches = eng.kv.inputs_of(bs.prefills[(2, 8)])      # [R, Hkv_slot, M, D] under its own names
        assert seen[0][2] and prefill_caches and all(seen[0][1][n] is t for n, t in prefill_caches.items())
        assert seen[0][1]["cache_row"].tolist() == [0, 0]          # pad rows only, into row 0 (nobody's yet)
        assert seen[1][2] and all(seen[1][1][n] is t for n, t in eng.kv.tensors.items())
        assert isinstance(bs.graph_pool, GraphPool)
        assert all(s.run_options.of(ReplayOptions).graph_pool is bs.graph_pool for s in bs.sessions())
        assert all(s.run_options.of(ReplayOptions).alias_outputs for s in bs.sessions())    # replays hand out their buffers
        seen.clear()
        eng.buckets.decodes[2].compile_report = bs.prefills[(2, 8)].compile_report = None
        eng.buckets.warmup()             # no caches given: no bucket with state is captured on seeded ones
        assert seen == []                # (and compile=False: nothing to compile either)
    mine = GraphPool()
    for kw in ({"graph_pool": mine}, {"run_options": with_fields(None, processor="region", graph_pool=mine)}):
        bs = ServingBuckets(SET, **kw)
        assert bs.graph_pool is mine and all(s.run_options.of(ReplayOptions).graph_pool is mine for s in bs.sessions())
        bs.close()
    bs = ServingBuckets(SET, run_options=RunOptions(processor="region"))
    assert isinstance(bs.graph_pool, GraphPool) and all(s.run_options.of(ReplayOptions).graph_pool is bs.graph_pool for s in bs.sessions())
    assert all(s.run_options.of(ReplayOptions).alias_outputs for s in bs.sessions())
    bs.close()


def test_a_capture_failing_at_compile_warns_there_and_describe_says_so(fake):
    """Never silent: a warm-up capture failure is reported by compile() (policy "warn"), describe() names
    it, and runs go on eagerly with the reference's outputs."""
    path = GRAPHS / "tp_mlp" / "pipeline.json"
    sess = fastpipe.load(path, processor="region", compile="off")
    inner = sess.runner._run_env

    def breaks(ins):
        if fake.capturing is not None:
            raise RuntimeError("operation not permitted when stream is capturing")
        return inner(ins)

    sess.runner.replay = GraphReplay(breaks, CPU)
    with pytest.warns(RuntimeWarning, match=r"CUDA-graph capture failed \(RuntimeError: operation not permitted"):
        sess.compile()
    assert "CUDA-graph capture failed (RuntimeError: operation not permitted" in sess.describe()
    x = torch.randn(8, 64)
    torch.testing.assert_close(sess.run({"x": x})["y"], fastpipe.load(path, processor="reference").run({"x": x})["y"])


def test_end_pool_routing_ends_it_once_and_tolerates_a_torch_that_did(monkeypatch):
    """torch_compat.end_pool_routing: the allocator call with (device index, pool); a refusal (torch ended
    the routing itself, or no CUDA here) is not an error."""
    from fastpipe import torch_compat

    calls = []
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda index, pool: calls.append((index, pool)),
                        raising=False)
    assert torch_compat.end_pool_routing(1, (0, 7)) is True and calls == [(1, (0, 7))]

    def refuses(index, pool):
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", refuses)
    assert torch_compat.end_pool_routing(1, (0, 7)) is False
    monkeypatch.delattr(torch._C, "_cuda_endAllocateToPool")
    assert torch_compat.end_pool_routing(1, (0, 7)) is False


def test_static_buffers_are_normal_tensors_when_captured_under_inference_mode(fake):
    """As fastpipe.runtime.binding.inputs.to_device's copies: the graph's input buffers are normal tensors, so a
    compiled fn sees at capture the kind of tensor it saw at warm-up (and the caller's state tensors)."""
    r = GraphReplay(accumulating(fake, []), CPU, state={"c": "c_new"})
    caches = torch.zeros(2)
    with torch.inference_mode():
        assert r.capture({"x": torch.ones(2), "c": caches})
    assert not r.static_in["x"].is_inference() and r.static_in["c"] is caches


def many(fake, calls):
    """fn of 4 float32, 2 int64 and 1 float64 inputs: out_<name> = in_<name> + 1 (kernels handed to `launch`),
    and a non-contiguous output (a transposed view of a buffer)."""
    def fn(ins):
        calls.append(1)
        outs = {f"out_{n}": torch.empty_like(t) for n, t in ins.items()}
        base = torch.empty(3, 2)
        outs["out_t"] = base.t()

        def kernel():
            for n, t in ins.items():
                outs[f"out_{n}"].copy_(t + 1)
            base.copy_(ins["f0"][:6].reshape(3, 2))
        fake.launch(kernel)
        return outs
    return fn


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    ins = {f"f{i}": torch.randn(8 + i, generator=g) for i in range(4)}
    ins.update(i0=torch.randint(0, 9, (5,), generator=g), i1=torch.randint(0, 9, (2, 3), generator=g),
               d0=torch.randn(4, dtype=torch.float64, generator=g))
    return ins


@pytest.fixture
def foreach_launches(monkeypatch) -> list:
    """Each torch._foreach_copy_ call from here on, as [its dtypes..., how many pairs]."""
    real, launches = torch._foreach_copy_, []

    def spy(dst, src, non_blocking=False):
        launches.append(sorted({str(t.dtype) for t in dst}) + [len(dst)])
        return real(dst, src, non_blocking=non_blocking)
    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    return launches


@pytest.mark.parametrize("grouped", [True, False])
def test_replay_copies_in_and_out_one_launch_per_dtype_group(fake, foreach_launches, grouped):
    """A replay copies its inputs in and its outputs out with one torch._foreach_copy_ per (device, dtype) group of
    contiguous tensors (a single tensor, or a strided one, by its own copy_), not a copy per tensor; the results are
    what fn gives, and the outputs are fresh tensors every call. grouped_copies=False: a copy per tensor."""
    calls = []
    r = GraphReplay(many(fake, calls), CPU)
    r.grouped_copies = grouped
    assert r.capture(_inputs(0))
    foreach_launches.clear()
    seen = []
    for seed in (1, 2):
        ins = _inputs(seed)
        out = r(ins)
        seen.append(out)
        for n, t in ins.items():
            assert torch.equal(out[f"out_{n}"], t + 1), n
            assert out[f"out_{n}"] is not r.static_out[f"out_{n}"]
        assert torch.equal(out["out_t"], ins["f0"][:6].reshape(3, 2).t()) and out["out_t"].stride() == (1, 2)
    assert torch.equal(seen[0]["out_f0"], _inputs(1)["f0"] + 1)     # call 2 left call 1's outputs as they were
    if grouped:   # per call: in, float32 (4) and int64 (2); out, float32 (4) and int64 (2); float64 alone
        assert foreach_launches == [["torch.float32", 4], ["torch.int64", 2]] * 4
    else:
        assert foreach_launches == []
    assert len(calls) == 2 and r.replays == 2


def test_grouped_copies_leave_dtypes_the_one_launch_path_lacks_to_their_own_copy(foreach_launches):
    """uint32 (and the other dtypes CUDA's one-launch foreach copy lacks: it raises NotImplementedError there) is
    copied pair by pair; float32 beside it still goes as one group."""
    from fastpipe.runtime.cuda.graph_replay import FOREACH_COPY_DTYPES, copy_grouped

    src = [torch.arange(4).to(torch.uint32), (torch.arange(3) + 7).to(torch.uint32), torch.randn(5), torch.randn(2)]
    dst = [torch.empty_like(t) for t in src]
    copy_grouped(dst, src)
    assert foreach_launches == [["torch.float32", 2]]
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
    assert torch.uint32 not in FOREACH_COPY_DTYPES and torch.bfloat16 in FOREACH_COPY_DTYPES
