"""Weights onto a GPU through pinned staging buffers (fastpipe.weights.upload), on the CPU: the algorithm
runs against a queue that defers every device copy until a mark behind it is waited on (the worst an
asynchronous copy engine may do) and checks, when it finally runs a copy, that the staging bytes it
reads are still the ones it was given: a buffer rewritten too early shows up as a violation and as wrong
bytes. The store's load_many and the Binder's prefetch run the same path with that queue standing in
for CUDA ("meta" as the device); tests/test_weights_gpu.py runs the real one."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from safetensors.torch import save_file

import fastpipe
from fastpipe.errors import InputError
from fastpipe.options import LoadOptions
from fastpipe.weights import ParamRef, WeightStore
from fastpipe.weights import upload as staging

META = torch.device("meta")


class DeferredCopies:
    """A queue whose copies run only when a mark behind them is waited on, in order."""

    def __init__(self, *, fail_staging: bool = False):
        self.pending: list[tuple] = []      # (dst, staging view, its bytes when the copy was queued)
        self.done = 0
        self.violations = 0
        self.staging_sizes: list[int] = []
        self.fail_staging = fail_staging

    def staging(self, nbytes: int) -> torch.Tensor:
        if self.fail_staging:
            raise staging.PinnedStagingUnavailable("RuntimeError: no pinned memory (test)")
        self.staging_sizes.append(nbytes)
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)

    def empty(self, src: torch.Tensor) -> torch.Tensor:
        return torch.full(src.shape, 7, dtype=src.dtype) if src.dtype != torch.bool else torch.ones(src.shape, dtype=torch.bool)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.pending.append((dst, src, src.clone()))

    def mark(self):
        upto = len(self.pending)

        def wait():
            while self.done < upto:
                dst, src, queued = self.pending[self.done]
                self.violations += not torch.equal(src, queued)
                dst.copy_(src)
                self.done += 1
        return wait


def _sources(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in [((3, 5), torch.float32), ((), torch.float64), ((0, 4), torch.float32), ((7,), torch.int8),
                         ((33, 3), torch.bfloat16), ((1,), torch.bool), ((129,), torch.float16), ((2, 2, 2), torch.int64),
                         ((64,), torch.uint8), ((5,), torch.int32)]:
        if dtype == torch.bool:
            out.append(torch.rand(shape, generator=g) > 0.5)
        elif dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g).to(dtype))
        else:
            out.append(torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype))
    return out


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@pytest.mark.parametrize("chunk,buffers", [(1, 2), (64, 1), (64, 2), (100, 2), (128, 3), (1 << 20, 2)])
def test_staged_copy_is_bitwise_and_never_rewrites_a_buffer_in_flight(chunk, buffers):
    srcs = _sources(chunk + buffers)
    q = DeferredCopies()
    outs, staged = staging.staged_copy(iter(srcs), q, chunk_bytes=chunk, buffers=buffers, total_bytes=_nbytes(srcs))
    assert q.violations == 0 and q.done == len(q.pending)          # every copy ran, none read rewritten bytes
    assert staged == _nbytes(srcs)
    assert len(outs) == len(srcs)
    for s, o in zip(srcs, outs):
        assert o.shape == s.shape and o.dtype == s.dtype
        assert torch.equal(o.reshape(-1).view(torch.uint8), s.reshape(-1).view(torch.uint8))
    size = min(chunk, _nbytes(srcs))
    assert q.staging_sizes == [size] * min(buffers, -(-_nbytes(srcs) // size))   # the memory bound


def test_the_deferred_queue_sees_a_buffer_rewritten_too_early():
    """Against the same queue, waiting for nothing (marks that do not wait) rewrites staging bytes that
    queued copies have not read yet: the check above is able to fail."""
    class NoWait(DeferredCopies):
        def mark(self):
            real = super().mark()
            self.finals = real
            return lambda: None

    srcs = _sources(1)
    q = NoWait()
    staging.staged_copy(iter(srcs), q, chunk_bytes=64, buffers=2, total_bytes=_nbytes(srcs))
    q.finals()
    assert q.violations > 0


def test_sources_are_read_one_at_a_time_and_dropped_once_staged():
    alive: list[weakref.ref] = []
    at_request: list[int] = []

    def gen():
        for i in range(6):
            gc.collect()
            at_request.append(sum(r() is not None for r in alive))
            t = torch.full((50,), float(i))
            alive.append(weakref.ref(t))
            yield t
            del t

    q = DeferredCopies()
    outs, _ = staging.staged_copy(gen(), q, chunk_bytes=64, buffers=2)
    assert at_request == [0] * 6                 # the previous source was gone when the next was read
    assert [float(o[0]) for o in outs] == [float(i) for i in range(6)] and q.violations == 0


def test_bad_arguments_and_a_device_without_a_queue():
    with pytest.raises(ValueError, match="chunk_bytes"):
        staging.staged_copy([], DeferredCopies(), chunk_bytes=0)
    with pytest.raises(ValueError, match="CUDA device"):
        staging.upload([torch.ones(2)], torch.device("cpu"))
    outs, staged = staging.staged_copy([], DeferredCopies())
    assert outs == [] and staged == 0


# -- the store and the binder ------------------------------------------------------------
@pytest.fixture
def wfile(tmp_path):
    p = tmp_path / "w.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({"w": torch.randn(16, 24, generator=g), "h": torch.randn(40, generator=g).to(torch.bfloat16)}, str(p))
    return p


def _ref(path, name="w", placements=None):
    return ParamRef(path=path, format="safetensors", name=name, placements=placements)


def _requests(wfile):
    return [(_ref(wfile, placements=[[0, 8], [0, 24]]), (8, 24), torch.float32, "a", False),
            (_ref(wfile, placements=[[8, 16], [0, 24]]), (8, 24), torch.float32, "b", False),
            (_ref(wfile, placements=[[0, 16], [4, 9]]), (16, 5), torch.float32, "c", False),   # copied slice
            (_ref(wfile, placements=[[0, 8], [0, 24]]), (8, 24), torch.float32, "a again", False),
            (_ref(wfile, name="h"), (40,), torch.bfloat16, "h", False)]


@pytest.fixture
def deferred(monkeypatch):
    """The staged path with the deferred queue standing in for CUDA on the meta device."""
    queues = []

    def queue_for(device):
        if device.type != "meta":
            return None
        queues.append(DeferredCopies())
        return queues[-1]

    monkeypatch.setattr(staging, "queue_for", queue_for)
    return queues


def test_load_many_stages_each_slice_once_and_equals_the_file(wfile, deferred):
    store = WeightStore()
    reqs = _requests(wfile)
    out = store.load_many(reqs, META, upload="pinned")
    cpu = [store.load(r, s, d, where=w) for r, s, d, w, _ in reqs]
    assert [o.shape for o in out] == [c.shape for c in cpu]
    assert all(torch.equal(o, c) for o, c in zip(out, cpu))
    assert out[0] is out[3]                                  # one copy per slice and device
    st = store.stats()
    assert st["device_copies"] == 4 and st["device_hits"] == 1
    assert st["staged_bytes"] == sum(c.numel() * c.element_size() for c in cpu[:3] + cpu[4:])
    assert len(deferred) == 1 and deferred[0].violations == 0
    again = store.load_many(reqs[:2], META)                  # already there: nothing staged again
    assert again[0] is out[0] and again[1] is out[1] and store.stats()["staged_bytes"] == st["staged_bytes"]
    assert store.load(*reqs[1][:3], where="b", device=META) is out[1]


def test_load_many_pageable_and_on_the_cpu(wfile, deferred):
    store = WeightStore()
    reqs = _requests(wfile)
    out = store.load_many(reqs, META, upload="pageable")
    assert all(o.device == META for o in out) and not deferred and store.stats()["staged_bytes"] == 0
    cpu = store.load_many(reqs, torch.device("cpu"))
    assert all(c is store.load(r, s, d, where=w) for c, (r, s, d, w, _) in zip(cpu, reqs))


def test_load_many_checks_every_request_before_reading(wfile, deferred):
    store = WeightStore()
    bad = _requests(wfile)[:2] + [(_ref(wfile, name="nope"), (1,), torch.float32, "tensors[\"x\"]", False)]
    with pytest.raises(fastpipe.errors.ParamError, match=r'tensors\["x"\]\.name'):
        store.load_many(bad, META)
    assert store.stats()["bytes_read"] == 0 and not deferred


def test_no_pinned_memory_warns_and_copies_pageable(wfile, monkeypatch):
    monkeypatch.setattr(staging, "queue_for", lambda d: DeferredCopies(fail_staging=True) if d.type == "meta" else None)
    store = WeightStore()
    reqs = _requests(wfile)
    with pytest.warns(RuntimeWarning, match=r"weights copied to meta from pageable memory.*pinned staging buffers "
                                            r"unavailable \(RuntimeError: no pinned memory"):
        out = store.load_many(reqs, META)
    assert [o.shape for o in out] == [torch.Size(s) for _, s, _, _, _ in reqs] and all(o.device == META for o in out)
    assert store.stats()["device_copies"] == 4


def test_binder_prefetch_loads_a_devices_constants_together(deferred):
    from fastpipe.runtime.binding.bind import Binder
    from tests.examples import GRAPHS

    store = WeightStore()
    sess = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", store=store)
    names = [n for n, t in sess.pipeline.tensors.items() if t.is_constant]
    b = Binder(sess.pipeline, sess.options, store, {s: META for s in sess.slot_devices})
    b.prefetch(names + names[:1], META)                    # a name twice: one copy
    assert len(deferred) == 1 and deferred[0].violations == 0
    cpu = Binder(sess.pipeline, sess.options, store, {s: "cpu" for s in sess.slot_devices})
    for n in names:
        assert torch.equal(b.constant(n, META), cpu.constant(n, torch.device("cpu")))
    assert store.stats()["staged_bytes"] > 0
    before = dict(store.stats())
    b.prefetch(names, META)                               # all there: nothing asked of the store
    assert store.stats() == before


def test_bind_prefetches_each_devices_constants(monkeypatch):
    from fastpipe.runtime.binding import bind as bind_mod
    from tests.examples import GRAPHS

    calls = []
    real = bind_mod.Binder.prefetch
    monkeypatch.setattr(bind_mod.Binder, "prefetch", lambda self, names, dev: (calls.append((list(names), dev)),
                                                                                  real(self, names, dev)))
    sess = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", store=WeightStore())
    consts = {n for n, t in sess.pipeline.tensors.items() if t.is_constant}
    assert len(calls) == 1 and calls[0][1] == torch.device("cpu")
    assert consts <= set(calls[0][0])


def test_upload_option_is_checked_and_reaches_the_cli():
    with pytest.raises(InputError, match="upload: expected pinned or pageable, found 'fast'"):
        LoadOptions(upload="fast")
    assert LoadOptions().upload == "pinned"
    from fastpipe.cli.common import load_options
    from fastpipe.cli.main import parser

    args = parser().parse_args(["run", "p.json", "--upload", "pageable"])
    assert load_options(args).upload == "pageable"
    with pytest.raises(InputError, match="--upload"):
        parser().parse_args(["run", "p.json", "--upload", "fast"])
