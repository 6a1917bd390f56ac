"""Weights on a GPU are held once per store (marked `cuda`: skipped cleanly without one): sessions
over one WeightStore share each constant's copy on the device, the region processor's merged weights
included, and a serving set's buckets hold the weights of one. The CPU side (the "meta" device standing
in for a GPU) is in tests/test_weights.py."""
import gc

import pytest
import torch

import fastpipe
from fastpipe.weights import WeightStore
from tests.examples import GRAPHS, linked_serving_set

pytestmark = pytest.mark.cuda



def _constants(sess) -> dict[str, int]:
    return {f"{s}:{i}:{n}": t.data_ptr() for s, steps in sess.program.steps.items() for i, st in enumerate(steps)
            for n, t in st.constants.items()}


@pytest.mark.parametrize("processor", ["cuda", "region"])
def test_sessions_share_device_constants(processor):
    path = GRAPHS / "tp_mlp" / "pipeline.json"
    store = WeightStore()
    dm = {s: "cuda:0" for s in fastpipe.load(path).pipeline.devices}
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    a = fastpipe.load(path, device_map=dm, store=store, processor=processor)
    grow_a = torch.cuda.memory_allocated() - base
    b = fastpipe.load(path, device_map=dm, store=store, processor=processor)
    grow_b = torch.cuda.memory_allocated() - base - grow_a
    assert grow_a > 0 and grow_b <= 0.1 * grow_a                    # no second copy of the weights
    ca, cb = _constants(a), _constants(b)
    assert ca and ca == cb and all(ptr != 0 for ptr in ca.values())
    assert store.stats()["device_hits"] > 0
    x = {n: torch.randn(a.pipeline.tensors[n].shape, device="cuda:0") for n in a.input_names}
    for k, v in a.run(x).items():
        torch.testing.assert_close(b.run(x)[k], v)


def test_buckets_hold_one_copy_of_the_weights(tmp_path):
    """A serving set's prefill and decode pipelines (one checkpoint, hard-linked into each bucket as
    the builder lays it out) loaded over one store: the second adds no weights on the GPU (each used
    to copy every constant there)."""
    decode, prefill = sorted(linked_serving_set(tmp_path).glob("*/pipeline.json"))
    dm = {"0": "cuda:0", "1": "cuda:0"}
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    store = WeightStore()
    a = fastpipe.load(decode, device_map=dm, store=store, processor="region", compile="off")
    w1 = torch.cuda.memory_allocated() - base
    b = fastpipe.load(prefill, device_map=dm, store=store, processor="region", compile="off")
    assert w1 > 0 and torch.cuda.memory_allocated() - base - w1 < 0.1 * w1
    a.close()
    b.close()


@pytest.mark.parametrize("processor", ["cuda", "region"])
def test_pinned_upload_equals_the_file_and_the_pageable_path(processor):
    """The default upload (pinned staging buffers) puts every constant there bit for bit and runs as the
    pageable path does; the store counts the staged bytes."""
    path = GRAPHS / "tp_mlp" / "pipeline.json"
    dm = {s: "cuda:0" for s in fastpipe.load(path).pipeline.devices}
    pinned, pageable = WeightStore(), WeightStore()
    a = fastpipe.load(path, device_map=dm, store=pinned, processor=processor, fuse="off")   # steps keep their names
    b = fastpipe.load(path, device_map=dm, store=pageable, processor=processor, fuse="off", upload="pageable")
    cpu = fastpipe.load(path, store=WeightStore())
    host = {n: t for steps in cpu.program.steps.values() for st in steps for n, t in st.constants.items()}
    distinct = {id(t): t for t in host.values()}.values()           # one slice named twice is staged once
    assert pinned.stats()["staged_bytes"] == sum(t.nbytes for t in distinct) > 0
    assert pageable.stats()["staged_bytes"] == 0
    if processor == "cuda":              # the region processor merges shards: compare its outputs only
        got = {n: t for steps in a.program.steps.values() for st in steps for n, t in st.constants.items()}
        assert got.keys() == host.keys()
        for n, t in got.items():
            assert t.device.type == "cuda" and torch.equal(t.cpu(), host[n]), n
    x = {n: torch.randn(a.pipeline.tensors[n].shape, device="cuda:0") for n in a.input_names}
    for k, v in b.run(x).items():
        assert torch.equal(a.run(x)[k], v), k
    a.close()
    b.close()


def test_staged_copy_waits_for_each_buffer_behind_a_slow_stream():
    """Small buffers and a stream held up by sleep kernels, one ahead of the copies and one before each copy:
    the copies lag behind the host at every reuse of a buffer, which it must wait for before rewriting it; a
    buffer rewritten early would show as wrong bytes."""
    from fastpipe.weights import upload as staging

    class SlowCopies(staging.CudaCopies):
        def copy(self, dst, src):
            torch.cuda._sleep(200_000)     # ~0.1 ms on the stream before each copy
            super().copy(dst, src)

    g = torch.Generator().manual_seed(3)
    srcs = [torch.randn(n, generator=g).to(dt) for n, dt in
            [(70_001, torch.float32), (3, torch.bfloat16), (250_000, torch.float16), (0, torch.float32),
             (1 << 20, torch.float32), (17, torch.int64)]]
    dev = torch.device("cuda:0")
    torch.cuda._sleep(50_000_000)          # ~25 ms of nothing on the current stream, ahead of the copies
    outs, staged = staging.upload(iter(srcs), dev, queue=SlowCopies(dev), chunk_bytes=64 << 10, buffers=2,
                                  total_bytes=sum(t.nbytes for t in srcs))
    assert staged == sum(t.nbytes for t in srcs)
    for s, o in zip(srcs, outs):
        assert o.device.type == "cuda" and torch.equal(o.cpu(), s)


def test_region_session_holds_its_weights_once():
    """The region processor merges shard matmuls into one weight each. The shards used to stay on the GPU
    beside their merged weights for the session's life (twice its weights); now it holds each weight once,
    and the load's peak is its weights plus at most one merged group (each group's shards go as it is merged)."""
    path = GRAPHS / "tp_mlp" / "pipeline.json"
    dm = {s: "cuda:0" for s in fastpipe.load(path).pipeline.devices}
    host = fastpipe.load(path, store=WeightStore())
    weights = sum(t.nbytes for t in {id(t): t for steps in host.program.steps.values() for st in steps
                                     for t in st.constants.values()}.values())
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    s = fastpipe.load(path, device_map=dm, store=WeightStore(), processor="region", fuse="off", compile="off")
    held, peak = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    groups = sorted(b.nbytes for n, b in s.runner.runs[0].gm.named_buffers() if n.startswith("merged_"))
    assert s.runner.passes.merged >= 3 and sum(groups) >= 0.9 * weights     # nearly every weight was merged
    slack = 64 << 10                                                          # the allocator's 512-byte rounding
    assert weights <= held <= weights + slack, (held, weights)
    assert peak <= weights + groups[-1] + groups[-2] + slack, (peak, weights, groups)   # a weight + its bias
    x = {n: torch.randn(s.pipeline.tensors[n].shape) for n in s.input_names}
    want = host.run(x)
    for k, v in s.run({n: t.to("cuda:0") for n, t in x.items()}).items():
        torch.testing.assert_close(v.cpu(), want[k], rtol=1e-4, atol=1e-4)
    s.close()
