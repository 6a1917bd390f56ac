"""Every comm kind of the dist processor's native path (dist_processor._native), run for real on a
world-size-1 process group in THIS process, against the plain-torch reference (fastpipe.comm).

The group is made by fastpipe's own setup (dist_setup.init_process_group on a one-rank plan; env://
on a free localhost port): NCCL on cuda:0 (marked cuda: needs a GPU), and gloo on the CPU (runs
everywhere; it checks the same code path and the dtype each reduction puts on the wire).
A one-rank pipeline never reaches this path (a group whose members all live on one rank runs the
reference, "local" mode; tests/test_distributed.py::test_world_size_1_nccl), hence _native on a
hand-made group. Each call is checked to have gone through the backend: a spy records the
torch.distributed call and its tensors' dtype, and on NCCL the profiler must show
ProcessGroupNCCL's work ("nccl:<collective>") or an NCCL kernel. send/recv cannot run with one
rank (a rank does not send to itself); the 2- and 4-rank launches in tests/test_distributed.py
cover it (gloo).
"""
from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from fastpipe import comm
from fastpipe.runtime.processors import dist as dp
from fastpipe.runtime.processors import dist_setup

# kind, params, reference (xs, devices -> this member's outputs)
KINDS = [
    ("all_reduce", {"reduce_op": "sum"}, lambda xs, d: comm.all_reduce(xs, "sum", d)),
    ("all_reduce", {"reduce_op": "avg"}, lambda xs, d: comm.all_reduce(xs, "avg", d)),
    ("all_reduce", {"reduce_op": "max"}, lambda xs, d: comm.all_reduce(xs, "max", d)),
    ("reduce", {"reduce_op": "sum", "dst": 0}, lambda xs, d: [comm.reduce(xs, "sum", 0, d)]),
    ("reduce_scatter", {"reduce_op": "sum", "dim": 0}, lambda xs, d: comm.reduce_scatter(xs, "sum", 0, d)),
    ("reduce_scatter", {"reduce_op": "min", "dim": 1}, lambda xs, d: comm.reduce_scatter(xs, "min", 1, d)),
    ("all_gather", {"dim": 0}, lambda xs, d: comm.all_gather(xs, 0, d)),
    ("all_gather", {"dim": -1}, lambda xs, d: comm.all_gather(xs, -1, d)),
    ("all_to_all", {"src_dim": 0, "dst_dim": 1}, lambda xs, d: comm.all_to_all(xs, 0, 1, d)),
    ("gather", {"dim": 0, "dst": 0}, lambda xs, d: [comm.gather(xs, 0, 0, d)]),
    ("broadcast", {"src": 0}, lambda xs, d: comm.broadcast(xs[0], 0, d)),
]
# the torch.distributed function(s) each kind may call (torch < 2.13: the *_tensor names)
CALLS = {"all_reduce": {"all_reduce"}, "reduce": {"reduce"},
         "reduce_scatter": {"reduce_scatter_single", "reduce_scatter_tensor"},
         "all_gather": {"all_gather_single", "all_gather_into_tensor"}, "all_to_all": {"all_to_all_single"},
         "gather": {"gather"}, "broadcast": {"broadcast"}}
REDUCING = {"all_reduce", "reduce", "reduce_scatter"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(params=["gloo", pytest.param("nccl", marks=pytest.mark.cuda)])
def world1(request, monkeypatch):
    """A one-rank default group made by dist_setup.init_process_group; destroyed afterwards."""
    backend = request.param
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    cuda = backend == "nccl"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    plan = dist_setup.RankPlan(0, 1, 0, {"0": 0}, {"0": dev.type}, {"0": dev}, backend)
    assert dist_setup.rank_cuda_device(plan) == (dev if cuda else None)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    assert dist_setup.init_process_group(plan, timeout_s=60)
    try:
        assert dist.get_backend() == backend and dist.get_world_size() == 1
        yield backend, dev
    finally:
        dist.destroy_process_group()


@pytest.fixture
def spy(monkeypatch):
    """Every torch.distributed collective _native makes: (function name, dtypes of its tensors)."""
    seen: list[tuple[str, tuple]] = []
    for name in ("all_reduce", "reduce", "reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single",
                 "all_gather_into_tensor", "all_to_all_single", "gather", "broadcast"):
        real = getattr(dist, name, None)
        if real is None:
            continue

        def wrapped(*a, _real=real, _name=name, **kw):
            flat = [t for x in (*a, *kw.values()) for t in (x if isinstance(x, (list, tuple)) else [x])]
            seen.append((_name, tuple(t.dtype for t in flat if isinstance(t, torch.Tensor))))
            return _real(*a, **kw)
        monkeypatch.setattr(dist, name, wrapped)
    return seen


def _group(kind, params, dev) -> dp._Group:
    return dp._Group("g", kind, dict(params), ("7",), ("0",), (0,), "native", dist.group.WORLD, dev, (), None,
                     (((6, 4), torch.float32),))


def _input(dtype, dev):
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 4, generator=g).to(dtype).to(dev)


@pytest.mark.parametrize("kind, params, ref", KINDS, ids=[f"{k}-{'-'.join(map(str, p.values()))}" for k, p, _ in KINDS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_every_kind_on_one_rank(world1, spy, kind, params, ref, dtype):
    backend, dev = world1
    nccl = backend == "nccl"
    x = _input(dtype, dev)
    before = x.clone()
    prof = None
    if nccl:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            got = dp._native(_group(kind, params, dev), 0, x, nccl)
            torch.cuda.synchronize()
    else:
        got = dp._native(_group(kind, params, dev), 0, x, nccl)
    want = ref([x], [dev])
    assert len(got) == len(want) == 1
    assert got[0].device == dev and got[0].dtype == dtype and got[0].shape == want[0].shape
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert torch.equal(x, before)                      # the input is never reduced in place
    # the collective really ran, through the backend, in the dtype the wire decision gives
    assert spy and {n for n, _ in spy} <= CALLS[kind], spy
    wire = dp.reduce_dtype(dtype, nccl) if kind in REDUCING else dtype
    assert all(d == wire for _, ds in spy for d in ds), (wire, spy)
    if nccl:
        assert wire == dtype                               # NCCL reduces bf16 as bf16: no f32 upcast
        # ProcessGroupNCCL's work ("nccl:<collective>"), or NCCL's kernels
        names = {e.name for e in prof.events()}
        assert any("nccl" in n.lower() for n in names), sorted(names)


def test_bf16_on_gloo_is_reduced_in_f32(world1, spy):
    """The wire decision on gloo: narrow floats in f32, rounded once as the reference does."""
    backend, dev = world1
    if backend != "gloo":
        pytest.skip("gloo only")
    x = _input(torch.bfloat16, dev)
    dp._native(_group("all_reduce", {"reduce_op": "sum"}, dev), 0, x, False)
    assert spy == [("all_reduce", (torch.float32,))]
