"""Every comm kind with every reduce op, run as a pipeline through fastpipe.load, against numpy."""
import json

import numpy as np
import pytest
import torch

import fastpipe
from fastpipe.builder.assemble import Assembler

N = 3
OPS = ["sum", "avg", "max", "min"]
PROCESSOR = ["reference"]


@pytest.fixture(autouse=True, params=["reference", "region"])
def processor(request):
    """Every conformance pipeline runs on the reference processor and on the region processor (all
    slots on the CPU: one stitched graph, the comm as plain tensor code, fastpipe.comm.local)."""
    PROCESSOR[0] = request.param
    yield request.param
    PROCESSOR[0] = "reference"


def pipeline(tmp_path, kind, in_shape, metadata, ranks_with_input=None, ranks_with_output=None):
    a = Assembler(f"{kind}_conformance")
    members = []
    for r in range(N):
        a.slot(str(r), f"cpu:{r}")
        ins = []
        if ranks_with_input is None or r in ranks_with_input:
            a.input(f"x_{r}", in_shape, "f32")
            ins = [f"x_{r}"]
        outs = [f"y_{r}"] if ranks_with_output is None or r in ranks_with_output else []
        members.append((str(r), ins, outs))
    src = next(i for _, ins, _ in members for i in ins)
    a.comm(kind, "g", members, like=src, **metadata)
    a.output([o for _, _, outs in members for o in outs])
    # slots that only receive still need something to run: every slot runs its comm supertask
    f = tmp_path / "p.json"
    f.write_text(json.dumps(a.to_json()))
    sess = fastpipe.load(f, processor=PROCESSOR[0])
    assert sess.processor == PROCESSOR[0]
    return sess


def inputs(seed, shape, ranks=range(N)):
    g = torch.Generator().manual_seed(seed)
    return {f"x_{r}": torch.randn(shape, generator=g) for r in ranks}


NP_OPS = {"sum": lambda s: s.sum(0), "avg": lambda s: s.mean(0), "max": lambda s: s.max(0), "min": lambda s: s.min(0)}


@pytest.mark.parametrize("op", OPS)
def test_all_reduce(tmp_path, op):
    sess = pipeline(tmp_path, "all_reduce", (4, 6), {"reduce_op": op})
    x = inputs(1, (4, 6))
    out = sess.run(x)
    want = NP_OPS[op](np.stack([x[f"x_{r}"].double().numpy() for r in range(N)]))
    for r in range(N):
        np.testing.assert_allclose(out[f"y_{r}"].numpy(), want, rtol=1e-6, atol=1e-6)
    # every member's output is its own tensor (inside a region they are one: the caller gets copies)
    assert len({out[f"y_{r}"].data_ptr() for r in range(N)}) == N


@pytest.mark.parametrize("op", OPS)
def test_reduce_scatter(tmp_path, op):
    sess = pipeline(tmp_path, "reduce_scatter", (6, 4), {"reduce_op": op, "dim": 0})
    x = inputs(2, (6, 4))
    out = sess.run(x)
    full = NP_OPS[op](np.stack([x[f"x_{r}"].double().numpy() for r in range(N)]))
    for r in range(N):
        np.testing.assert_allclose(out[f"y_{r}"].numpy(), full[2 * r:2 * r + 2], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", OPS)
def test_reduce(tmp_path, op):
    sess = pipeline(tmp_path, "reduce", (5,), {"reduce_op": op, "dst": "2"}, ranks_with_output={2})
    x = inputs(3, (5,))
    out = sess.run(x)
    assert set(out) == {"y_2"}
    want = NP_OPS[op](np.stack([x[f"x_{r}"].double().numpy() for r in range(N)]))
    np.testing.assert_allclose(out["y_2"].numpy(), want, rtol=1e-6, atol=1e-6)


def test_all_gather(tmp_path):
    sess = pipeline(tmp_path, "all_gather", (2, 3), {"dim": 1})
    x = inputs(4, (2, 3))
    out = sess.run(x)
    want = np.concatenate([x[f"x_{r}"].numpy() for r in range(N)], axis=1)
    for r in range(N):
        np.testing.assert_array_equal(out[f"y_{r}"].numpy(), want)


def test_gather(tmp_path):
    sess = pipeline(tmp_path, "gather", (2, 3), {"dim": 0, "dst": "1"}, ranks_with_output={1})
    x = inputs(5, (2, 3))
    np.testing.assert_array_equal(sess.run(x)["y_1"].numpy(), np.concatenate([x[f"x_{r}"].numpy() for r in range(N)], axis=0))


def test_all_to_all(tmp_path):
    sess = pipeline(tmp_path, "all_to_all", (6, 2), {"src_dim": 0, "dst_dim": 1})
    x = inputs(6, (6, 2))
    out = sess.run(x)
    for i in range(N):
        want = np.concatenate([x[f"x_{j}"].numpy()[2 * i:2 * i + 2] for j in range(N)], axis=1)
        np.testing.assert_array_equal(out[f"y_{i}"].numpy(), want)


def test_broadcast(tmp_path):
    sess = pipeline(tmp_path, "broadcast", (3, 2), {"src": "1"}, ranks_with_input={1})
    x = inputs(7, (3, 2), ranks=[1])
    out = sess.run(x)
    for r in range(N):
        np.testing.assert_array_equal(out[f"y_{r}"].numpy(), x["x_1"].numpy())
        assert out[f"y_{r}"].data_ptr() != x["x_1"].data_ptr()


def test_send_recv(tmp_path):
    a = Assembler("p2p")
    a.slot("0", "cpu:0")
    a.slot("1", "cpu:1")
    a.input("x", (4,), "f32")
    a.send_recv("p", "0", "x", "1", "y")
    a.output(["y"])
    f = tmp_path / "p.json"
    f.write_text(json.dumps(a.to_json()))
    x = torch.randn(4)
    y = fastpipe.load(f, processor=PROCESSOR[0]).run({"x": x})["y"]
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
