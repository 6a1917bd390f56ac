"""Comm kinds as one table (fastpipe.format.comm_kinds): every backend implements every kind in it,
and a new kind is one spec plus one function per backend, registered from outside the library.

The new kind here is `scatter(src, dim)`: the participant on slot `src` gives x; participant i
gets the i-th of n equal chunks of x along `dim`. It runs through validation, the reference,
region (compile off) and cpu processors, and the dist processor on 3 ranks (native: one
torch.distributed.scatter) and on 2 ranks (two members share a rank: the generic path).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastpipe
from fastpipe.builder.assemble import Assembler
from fastpipe.comm.local import LOCAL_KINDS, LocalComm
from fastpipe.comm.reference import REFERENCE_KINDS
from fastpipe.errors import FormatError, ValidationError
from fastpipe.format import comm_kinds, loads_pipeline, model
from fastpipe.format.comm_kinds import COMM_KINDS, CommKindSpec, Param, group_kinds, resized
from fastpipe.format.comm_shapes import comm_output_shape
from fastpipe.runtime.execute import EXECUTE_KINDS, bind_reference
from fastpipe.runtime.processors.dist import DIST_KINDS
from fastpipe.validate.rules import validate_structure

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = (REFERENCE_KINDS, LOCAL_KINDS, EXECUTE_KINDS, DIST_KINDS)


# ---------------------------------------------------------------------------- the table
def test_every_backend_implements_every_kind_and_nothing_else():
    kinds = set(group_kinds())
    assert kinds == {"p2p", "reduce", "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast", "gather"}
    for table in BACKENDS:
        assert set(table) == kinds, table.backend


def test_the_table_is_the_formats_list():
    assert list(COMM_KINDS) == ["send", "recv", "reduce", "all_gather", "all_reduce", "reduce_scatter", "all_to_all",
                                "broadcast", "gather"]                  # SPEC §1, in its order
    assert model.COMM_KINDS is COMM_KINDS
    assert set(model.COMPUTE_KINDS + model.IO_KINDS) <= comm_kinds.RESERVED
    assert {COMM_KINDS[k].group_kind for k in ("send", "recv")} == {"p2p"}


@pytest.mark.parametrize("kind, params, shape", [
    ("all_gather", {"dim": 1}, (6, 9)), ("gather", {"dim": 0, "dst": 0}, (18, 3)),
    ("reduce_scatter", {"reduce_op": "sum", "dim": 0}, (2, 3)), ("all_to_all", {"src_dim": 0, "dst_dim": 1}, (2, 9)),
    ("all_reduce", {"reduce_op": "sum"}, (6, 3)), ("broadcast", {"src": 0}, (6, 3)), ("recv", {}, (6, 3)),
])
def test_each_spec_gives_the_output_shape(kind, params, shape):
    assert comm_output_shape(kind, (6, 3), 3, params) == shape


def test_registration_refuses_what_the_format_cannot_hold():
    with pytest.raises(ValueError, match="already registered"):
        comm_kinds.register_comm_kind(CommKindSpec("all_reduce"))
    with pytest.raises(ValueError, match="not a compute or io kind"):
        comm_kinds.register_comm_kind(CommKindSpec("output"))
    with pytest.raises(ValueError, match="root to name a required slot param"):
        comm_kinds.register_comm_kind(CommKindSpec("x", (Param("dim", "dim"),), outputs="root", root="dim"))
    with pytest.raises(ValueError, match="only send and recv form pairs"):
        comm_kinds.register_comm_kind(CommKindSpec("put", outputs="none", group="p2p", partner="get"))
    with pytest.raises(ValueError, match="a kind of the format"):
        comm_kinds.unregister_comm_kind("gather")
    with pytest.raises(ValueError, match="no spec"):
        LOCAL_KINDS.register("scatter", None)
    with pytest.raises(ValueError, match="built in"):
        DIST_KINDS.unregister("gather")
    assert "x" not in COMM_KINDS and "put" not in COMM_KINDS


# ---------------------------------------------------------------------------- a new kind: scatter
SCATTER = CommKindSpec(
    "scatter", (Param("src", "slot"), Param("dim", "dim", split=True)), inputs="root", root="src",
    shape=lambda s, n, p: resized(s, n, shrink=[p["dim"]]))          # [.., d, ..] -> [.., d/n, ..]


def scatter_reference(xs, params, devices):
    """xs: the src member's input alone; member i's output: its chunk, a fresh copy on devices[i]."""
    chunks = torch.chunk(xs[0], len(devices), dim=params["dim"])
    return [c.to(device=d, memory_format=torch.contiguous_format, copy=True) for c, d in zip(chunks, devices)]


def scatter_chunks(xs, n, dim):
    """The one-device form: the chunks as views (a region graph calls it as fn(xs, n, dim))."""
    return list(torch.chunk(xs[0], n, dim=dim))


def scatter_local(params, n):
    return LocalComm("scatter", scatter_chunks, (n, params["dim"]), False, tuple(range(n)))


def scatter_dist(g, me, x, nccl):
    """One torch.distributed.scatter over the group's sub-group: sub-group rank k gets the chunk of
    the member on it (g.at(k)); the receive buffer has this member's declared output shape."""
    import torch.distributed as dist

    n, src = len(g.members), g.params["src"]
    shape, dtype = g.out_meta[me][0]
    out = torch.empty(shape, dtype=dtype, device=g.device)
    parts = None
    if me == src:
        chunks = torch.chunk(x, n, dim=g.params["dim"])
        parts = [chunks[g.at(k)].contiguous() for k in range(n)]
    dist.scatter(out, parts, src=g.ranks[src], group=g.pg)
    return [out]


@contextlib.contextmanager
def scatter_kind():
    """The scatter kind, registered for the with block: its spec and one implementation per backend."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(comm_kinds.comm_kind(SCATTER))
        stack.enter_context(REFERENCE_KINDS.registered("scatter", scatter_reference))
        stack.enter_context(LOCAL_KINDS.registered("scatter", scatter_local))
        stack.enter_context(EXECUTE_KINDS.registered("scatter", bind_reference("scatter")))
        stack.enter_context(DIST_KINDS.registered("scatter", scatter_dist))
        yield SCATTER


def _assert_gone():
    assert "scatter" not in COMM_KINDS and "scatter" not in group_kinds()
    assert all("scatter" not in table for table in BACKENDS)


@pytest.fixture
def scatter():
    with scatter_kind() as spec:
        yield spec
    _assert_gone()


def scatter_pipeline(folder: Path) -> Path:
    """3 slots; slot 1 computes h = x + 1 [6, 4] and scatters it along dim 0; slot i outputs
    z_i = chunk_i(h) * (i + 1) [2, 4]."""
    a = Assembler("scatter")
    for s in "012":
        a.slot(s, f"cpu:{s}")
    a.input("x", (6, 4), "f32")
    a.fx("1", lambda x: x + 1, ["x"], ["h"])
    a.comm("scatter", "sc", [(s, ["h"] if s == "1" else [], [f"y{s}"]) for s in "012"], src="1", dim=0)
    for i, s in enumerate("012"):
        a.fx(s, lambda y, k=i + 1: y * k, [f"y{s}"], [f"z{s}"])
    a.output([f"z{s}" for s in "012"])
    path = folder / "pipeline.json"
    path.write_text(json.dumps(a.to_json()))
    return path


def expected(x: torch.Tensor) -> dict:
    return {f"z{i}": c * (i + 1) for i, c in enumerate(torch.chunk(x + 1, 3, dim=0))}


@pytest.mark.parametrize("processor, options", [
    ("reference", {}), ("region", {"compile": "off"}), ("cpu", {"compile": "off"}),
])
def test_a_registered_kind_runs_on_every_one_process_processor(tmp_path, scatter, processor, options):
    path = scatter_pipeline(tmp_path)
    sess = fastpipe.load(path, processor=processor, **options)
    assert sess.processor == processor
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    got, want = sess.run({"x": x}), expected(x)
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_a_registered_kind_is_validated_by_its_spec(tmp_path, scatter):
    doc = json.loads(scatter_pipeline(tmp_path).read_text())
    doc["tensors"]["x0"] = {"shape": [6, 4], "dtype": "f32"}          # slot 0 gives an input too
    doc["supertasks"]["in"]["outputs"].append("x0")
    next(st for st in doc["supertasks"].values() if st["kind"] == "scatter" and st["device"] == "0")["inputs"] = ["x0"]
    with pytest.raises(ValidationError, match=r'\.inputs: expected 0 tensors \(only the src participant of scatter '
                                              r'gives an input\), found 1$'):
        validate_structure(loads_pipeline(json.dumps(doc)))
    doc = json.loads(scatter_pipeline(tmp_path).read_text())
    validate_structure(loads_pipeline(json.dumps(doc)))
    for st in doc["supertasks"].values():
        if st["kind"] == "scatter":
            st["metadata"]["dim"] = 1                      # 4 does not divide by 3
    with pytest.raises(ValidationError, match=r'\.metadata\.dim: expected a dim whose size divides by the group size 3, '
                                              r'found dim 1 of size 4$'):
        validate_structure(loads_pipeline(json.dumps(doc)))
    for st in doc["supertasks"].values():
        if st["kind"] == "scatter":
            st["metadata"] = {"src": "1"}
    with pytest.raises(ValidationError, match=r'expected exactly the keys \[dim, src\] for scatter, found missing key "dim"'):
        validate_structure(loads_pipeline(json.dumps(doc)))


def test_an_unregistered_kind_is_not_a_kind(tmp_path):
    with scatter_kind():
        doc = json.loads(scatter_pipeline(tmp_path).read_text())
    _assert_gone()
    with pytest.raises(FormatError, match=r'\.kind: expected one of fx, dfg, edf, send, recv, reduce, all_gather, '
                                          r'all_reduce, reduce_scatter, all_to_all, broadcast, gather, input, output '
                                          r'\(or FX\), found "scatter"'):
        loads_pipeline(json.dumps(doc))


def test_a_registered_kind_on_a_one_rank_gloo_group(scatter, monkeypatch):
    """scatter_dist through the dist processor's dispatch (dist._native), for real, on a one-rank group."""
    import socket

    import torch.distributed as dist

    from fastpipe.runtime.processors import dist as dp
    from fastpipe.runtime.processors import dist_setup

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    cpu = torch.device("cpu")
    plan = dist_setup.RankPlan(0, 1, 0, {"0": 0}, {"0": "cpu"}, {"0": cpu}, "gloo")
    assert dist_setup.init_process_group(plan, timeout_s=60)
    try:
        g = dp._Group("g", "scatter", {"src": 0, "dim": 1}, ("7",), ("0",), (0,), "native", dist.group.WORLD, cpu,
                      (), None, ((((6, 4), torch.float32),),))    # member 0's one output: [6, 4] f32
        x = torch.randn(6, 4)
        (y,) = dp._native(g, 0, x, False)
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    finally:
        dist.destroy_process_group()


DIST_SCRIPT = """
import sys, torch, torch.distributed as dist, fastpipe
from safetensors.torch import save_file
from tests.test_comm_kinds import scatter_kind
path, out, slot_ranks = sys.argv[1:]
with scatter_kind():
    ranks = {k: int(v) for k, v in (kv.split("=") for kv in slot_ranks.split(","))}
    sess = fastpipe.load(path, processor="dist", slot_ranks=ranks)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    outs = sess.run({"x": x})
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in outs.items()}, out)
"""


@pytest.mark.parametrize("nproc, slot_ranks", [
    (3, "0=2,1=0,2=1"),      # native: one torch.distributed.scatter, members on sub-group ranks (2, 0, 1)
    (2, "0=1,1=0,2=1"),      # generic: slots 0 and 2 share rank 1 (each input broadcast, then EXECUTE_KINDS)
])
def test_a_registered_kind_on_the_dist_processor(tmp_path, nproc, slot_ranks):
    from safetensors.torch import load_file

    with scatter_kind():
        path = scatter_pipeline(tmp_path)
    script = tmp_path / "run.py"
    script.write_text(DIST_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                           "--max-restarts", "0", str(script), str(path), str(tmp_path / "out.safetensors"), slot_ranks],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = load_file(tmp_path / "out.safetensors")
    want = expected(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)))
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
