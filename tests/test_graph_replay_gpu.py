"""CUDA-graph capture for servers, on a GPU (marked `cuda`: skipped cleanly without one).

Replay, not eager, makes the outputs: the Python function the graph was captured from is wrapped
with a counter after the capture, and must not run again while every output still equals the
reference on its own input. Also: Session.compile() captures, so the first run() replays; a serving
set's buckets share one graph pool, largest first, and the later capture adds less pool memory than
the first; a thread captures while another replays; outputs of call N are unchanged by call N+1.
The CPU side of the same logic (with fakes for torch.cuda) is tests/test_graph_replay.py.
"""
import json
import threading

import pytest
import torch

import fastpipe
from fastpipe.serving.buckets import ServingBuckets
from fastpipe.serving.engine import Engine
from tests.examples import GRAPHS, SERVING_SET

pytestmark = pytest.mark.cuda

TP_MLP = GRAPHS / "tp_mlp" / "pipeline.json"
SET = SERVING_SET
TOL = dict(rtol=1e-4, atol=1e-5)


def _gpu(path) -> dict:
    return {s: "cuda:0" for s in fastpipe.load(path).pipeline.devices}


def _count_calls(replay) -> list:
    """Every later Python call of the function `replay` captured appends to the returned list (an eager
    run or a capture calls it; a replay does not)."""
    calls, inner = [], replay.fn

    def counted(inputs):
        calls.append(1)
        return inner(inputs)

    replay.fn = counted
    return calls


def _session(processor, compile=False, **kw):
    return fastpipe.load(TP_MLP, device_map=_gpu(TP_MLP), processor=processor, compile=compile,
                         compile_policy="raise", **kw)


def _x(seed):
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("processor,compile", [("region", False), ("region", True), ("cuda", False)])
def test_after_compile_every_run_is_a_replay_and_its_outputs_stay_valid(processor, compile):
    ref = fastpipe.load(TP_MLP)
    sess = _session(processor, compile)
    sess.compile()
    replay = sess.runner.replay
    assert replay.replaying and replay.replays == 0          # captured at warm-up, before any run
    calls = _count_calls(replay)
    outs = [sess.run({"x": _x(seed).cuda()})["y"] for seed in range(5)]
    assert calls == [] and replay.replays == 5               # the graph made every output
    for seed, out in enumerate(outs):                        # each still its own call's output after the later calls
        torch.testing.assert_close(out.cpu(), ref.run({"x": _x(seed)})["y"], **TOL)
    assert len({o.data_ptr() for o in outs}) == len(outs)


@pytest.mark.parametrize("processor", ["region", "cuda"])
def test_aliased_outputs_are_the_graphs_buffers_valid_until_the_next_run(processor):
    """alias_outputs=True: every replay returns the same output tensor (the graph's buffer, no clone), right when
    read before the next run and overwritten by it."""
    ref = fastpipe.load(TP_MLP)
    sess = _session(processor, alias_outputs=True)
    sess.compile()
    replay = sess.runner.replay
    assert replay.replaying and replay.alias_outputs
    first = sess.run({"x": _x(0).cuda()})["y"]
    torch.testing.assert_close(first.cpu(), ref.run({"x": _x(0)})["y"], **TOL)
    second = sess.run({"x": _x(1).cuda()})["y"]
    assert second.data_ptr() == first.data_ptr() and replay.replays == 2
    torch.testing.assert_close(first.cpu(), ref.run({"x": _x(1)})["y"], **TOL)      # overwritten by run 2


def _pool_bytes(pool_id) -> int:
    """Bytes of the allocator's segments that belong to this CUDA-graph memory pool."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(pool_id))


def _bucket_inputs(sess, seed) -> dict:
    """Random inputs for a serving bucket: token ids, cache positions, the prefill's cache rows ([B], distinct,
    below the caches' R rows) and last-token indices ([B], below S), caches at random."""
    g = torch.Generator().manual_seed(seed)
    tensors = sess.pipeline.tensors
    rows = min(tensors[n].shape[0] for n in sess.input_names if n.startswith("past_key_values"))
    out = {}
    for n in sess.input_names:
        t = tensors[n]
        if n.startswith("input_ids"):
            out[n] = torch.randint(0, 64, t.shape, generator=g)
        elif n.startswith("cache_position"):
            out[n] = torch.randint(0, 16, t.shape, generator=g)
        elif n == "cache_row":
            out[n] = torch.randperm(rows, generator=g)[: t.shape[0]]
        elif n == "logits_index":
            out[n] = torch.randint(0, tensors["input_ids"].shape[1], t.shape, generator=g)
        else:
            assert t.dtype == "f32", (n, t.dtype)                  # an input this helper does not know
            out[n] = torch.randn(t.shape, generator=g)
    return out


def test_buckets_share_one_pool_largest_first_and_replay_in_turn():
    dm = _gpu(SET / "decode_b2" / "pipeline.json")
    bs = ServingBuckets(SET, processor="region", compile=False, compile_policy="raise", device_map=dm)
    big, small = bs.by_size()
    assert big is bs.prefills[(2, 8)] and small is bs.decodes[2]
    pool = bs.graph_pool
    torch.cuda.synchronize()
    grown = []
    for s in (big, small):                                   # what ServingBuckets.warmup does, measured
        before = _pool_bytes(pool.handle())
        s.compile()
        torch.cuda.synchronize()
        grown.append(_pool_bytes(pool.handle()) - before)
    assert big.runner.replay.replaying and small.runner.replay.replaying and pool.graphs == 2
    alone = fastpipe.load(SET / "decode_b2" / "pipeline.json", processor="region", compile=False,
                          compile_policy="raise", state_in_place=True, device_map=dm)
    alone.compile()                                          # the decode step in a pool of its own
    own = _pool_bytes(alone.runner.replay.graph.pool())
    assert grown[0] > 0 and grown[1] < grown[0] and grown[1] < own, (grown, own)

    refs = {id(s): fastpipe.load(s.pipeline) for s in (big, small)}
    calls = [_count_calls(s.runner.replay) for s in (big, small)]
    for step in range(3):                                    # replayed one at a time, in turn
        for s in (big, small):
            cpu = _bucket_inputs(s, step)
            want = refs[id(s)].run({n: t.clone() for n, t in cpu.items()})
            got = s.run({n: t.cuda() for n, t in cpu.items()})
            for n, w in want.items():
                torch.testing.assert_close(got[n].cpu(), w, **TOL)
    assert calls == [[], []]
    assert big.runner.replay.replays == small.runner.replay.replays == 3
    bs.close()


def test_engine_captures_every_bucket_at_warmup_and_requests_only_replay():
    expected = json.loads((SET / "expected.json").read_text())
    dm = _gpu(SET / "decode_b2" / "pipeline.json")
    with Engine(SET, eos_token_id=None, compile=False, compile_policy="raise", device_map=dm) as eng:
        replays = [s.runner.replay for s in eng.buckets.by_size()]
        assert all(r.replaying for r in replays) and eng.buckets.graph_pool.graphs == 2
        assert all(eng.decode.runner.replay.static_in[n] is t for n, t in eng.kv.tensors.items())
        calls = [_count_calls(r) for r in replays]
        reqs = [eng.submit(p, max_new_tokens=n) for p, n in zip(expected["prompts"], expected["max_new_tokens"])]
        assert [r.result(timeout=300) for r in reqs] == expected["tokens"]
        assert calls == [[], []] and all(r.replays > 0 for r in replays)


def test_one_thread_captures_while_another_replays():
    xs = [_x(seed) for seed in range(8)]
    ref = fastpipe.load(TP_MLP)
    wants = [ref.run({"x": x})["y"] for x in xs]
    a = _session("region")
    a.compile()
    b = _session("region")
    errors, replaying, captured = [], threading.Event(), threading.Event()
    done = [0]

    def replay_a():
        try:
            while not captured.is_set() or done[0] < 50:
                i = done[0] % len(xs)
                torch.testing.assert_close(a.run({"x": xs[i].cuda()})["y"].cpu(), wants[i], **TOL)
                done[0] += 1
                replaying.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            replaying.set()

    def capture_b():
        try:
            assert replaying.wait(60)
            b.compile()                                      # warm-up run and capture while `a` replays
            assert b.runner.replay.replaying
            for x, w in zip(xs, wants):
                torch.testing.assert_close(b.run({"x": x.cuda()})["y"].cpu(), w, **TOL)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        finally:
            captured.set()

    threads = [threading.Thread(target=replay_a), threading.Thread(target=capture_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == []
    assert a.runner.replay.replays == done[0] >= 50 and b.runner.replay.replays == len(xs)


def test_two_threads_share_one_session_without_mixing_their_calls():
    ref = fastpipe.load(TP_MLP)
    wants = [ref.run({"x": _x(s)})["y"] for s in range(40)]
    sess = _session("region")
    sess.compile()
    errors = []

    def hammer(seeds):
        try:
            for s in seeds:
                torch.testing.assert_close(sess.run({"x": _x(s).cuda()})["y"].cpu(), wants[s], **TOL)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(range(k, 40, 2),)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == [] and sess.runner.replay.replays == 40


@pytest.mark.parametrize("grouped", [True, False])
def test_grouped_copies_on_a_gpu_give_what_the_function_gives(grouped):
    """A GraphReplay with bf16, int64 and float32 inputs (and a host tensor) and as many outputs: its copies in and out
    grouped per dtype (torch._foreach_copy_ on CUDA) or one per tensor, every replay's outputs equal the function run
    eagerly on the same inputs, and stay so after the next replay."""
    from fastpipe.runtime.cuda.graph_replay import GraphReplay

    dev = torch.device("cuda:0")

    def fn(ins):
        out = {f"{n}_out": (t.to(dev) * 3 if t.dtype != torch.int64 else t.to(dev) + 7) for n, t in ins.items()}
        out["sum"] = sum(t.float().sum() for t in ins.values())
        return out

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        ins = {f"kv{i}": torch.randn(2, 4, 16 + i, generator=g).to(dev, torch.bfloat16) for i in range(6)}
        ins.update(ids=torch.randint(0, 100, (2, 5), generator=g).to(dev), pos=torch.arange(5, device=dev),
                   w=torch.randn(3, 3, generator=g).to(dev), host=torch.randn(4, generator=g))
        return ins

    r = GraphReplay(fn, dev, policy="raise")
    r.grouped_copies = grouped
    assert r.capture(inputs(0))
    calls = _count_calls(r)
    outs = [(ins := inputs(seed), r(ins)) for seed in (1, 2, 3)]
    torch.cuda.synchronize()
    assert calls == [] and r.replays == 3                  # replays made them
    for ins, out in outs:
        want = fn(ins)
        assert set(out) == set(want)
        for n, t in want.items():
            assert out[n].dtype == t.dtype and out[n].device == dev
            torch.testing.assert_close(out[n], t, rtol=1e-2 if n == "sum" else 0, atol=1e-2 if n == "sum" else 0)


@pytest.mark.parametrize("processor,compile", [("region", False), ("region", True), ("cuda", True)])
def test_a_dropped_session_frees_its_device_weights_at_once(processor, compile):
    """Captured and replayed, a session dropped without close() frees its weights on the GPU as it goes, with the
    collector off: no reference cycle holds its processor (the replay holds its run function weakly) or the
    stitched graphs' weights (fastpipe.runtime.binding.release)."""
    import gc
    import weakref

    from fastpipe.runtime.cuda.capture import no_collection
    from fastpipe.weights import WeightStore

    store = WeightStore()
    sess = _session(processor, compile, store=store)
    sess.compile()
    sess.run({"x": _x(0).cuda()})
    assert sess.runner.replay.replaying and store.stats()["live_device_copies"] > 0
    held = [weakref.ref(t) for run in getattr(sess.runner, "runs", ()) if run.gm is not None for t in run.gm.buffers()]
    gc.collect()
    with no_collection():
        del sess
        assert store.stats()["live_device_copies"] == 0 and store.stats()["live_slices"] == 0
        assert [r for r in held if r() is not None] == []
