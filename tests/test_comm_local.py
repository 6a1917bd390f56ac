"""One-device comm (fastpipe.comm.local) against the comm reference: every kind, every reduce op, every
dtype; bf16/f16 reductions against a float64 computation; aliases instead of copies."""
import pytest
import torch

from fastpipe.comm import local, reference
from fastpipe.runtime.execute import group_fn as reference_group_fn

N = 3
OPS = ["sum", "avg", "max", "min"]


class Group:
    def __init__(self, kind, **params):
        self.kind, self.params = kind, params


def _inputs(dtype, shape=(6, 4), seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return [torch.rand(shape, generator=g) > 0.5 for _ in range(n)]
    if not dtype.is_floating_point:
        return [torch.randint(-50, 50, shape, generator=g).to(dtype) for _ in range(n)]
    return [(torch.randn(shape, generator=g) * 3).to(dtype) for _ in range(n)]


CASES = ([("all_reduce", {"reduce_op": op}) for op in OPS] + [("reduce", {"reduce_op": op, "dst": 1}) for op in OPS]
         + [("reduce_scatter", {"reduce_op": op, "dim": d}) for op in OPS for d in (0, -2)]
         + [("all_gather", {"dim": d}) for d in (0, 1, -1)] + [("gather", {"dim": 1, "dst": 2})]
         + [("all_to_all", {"src_dim": 0, "dst_dim": 1}), ("all_to_all", {"src_dim": -1, "dst_dim": 0})])


# avg of integers is refused by the validator and the reference alike: not a case
DTYPED = [(k, p, d) for k, p in CASES for d in (torch.float32, torch.bfloat16, torch.float16, torch.int32)
          if not (d == torch.int32 and p.get("reduce_op") == "avg")]


@pytest.mark.parametrize("kind, params, dtype", DTYPED,
                         ids=[f"{k}-{'-'.join(map(str, p.values()))}-{str(d)[6:]}" for k, p, d in DTYPED])
def test_equals_the_reference_bit_for_bit(kind, params, dtype):
    xs = _inputs(dtype, shape=(6, 6))
    want = reference_group_fn(Group(kind, **params), [torch.device("cpu")] * N)(xs)
    got = local.group_fn(kind, params, N)(xs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_bool_reductions(op):
    xs = _inputs(torch.bool)
    want = reference.all_reduce(xs, op, ["cpu"] * N)
    for g, w in zip(local.group_fn("all_reduce", {"reduce_op": op}, N)(xs), want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2 ** -8), (torch.float16, 2 ** -11)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_narrow_sums_round_once(dtype, tol, n):
    """Accumulated in f32 and rounded once: within half an ulp of the exact (f64) sum of the inputs."""
    xs = _inputs(dtype, shape=(64, 64), seed=n, n=n)
    exact = sum(x.double() for x in xs)
    got = local.group_fn("all_reduce", {"reduce_op": "sum"}, n)(xs)[0]
    err = ((got.double() - exact).abs() / exact.abs().clamp_min(1e-3)).max().item()
    assert got.dtype == dtype and err <= tol, err
    # a fold in the narrow dtype rounds n - 1 times: this is what the f32 accumulation buys
    naive = xs[0]
    for x in xs[1:]:
        naive = naive + x
    naive_err = ((naive.double() - exact).abs() / exact.abs().clamp_min(1e-3)).max().item()
    assert err <= naive_err


def test_outputs_alias_instead_of_copying():
    xs = _inputs(torch.float32)
    ar = local.group_fn("all_reduce", {"reduce_op": "sum"}, N)(xs)
    assert all(o is ar[0] for o in ar)                       # one tensor for every member
    ag = local.group_fn("all_gather", {"dim": 0}, N)(xs)
    assert all(o is ag[0] for o in ag)
    b = local.group_fn("broadcast", {"src": 0}, N)([xs[0]])
    assert all(o is xs[0] for o in b)                        # the input itself
    assert local.group_fn("p2p", {}, 2)([xs[1]])[0] is xs[1]
    rs = local.group_fn("reduce_scatter", {"reduce_op": "sum", "dim": 0}, N)(xs)
    assert all(o._base is rs[0]._base for o in rs)           # views of one reduction


def test_take_maps_member_writes_to_results():
    c = local.group_fn("reduce_scatter", {"reduce_op": "max", "dim": 1}, 2)
    assert c.kind == "reduce_scatter" and c.take == (0, 1) and not c.single
    c = local.group_fn("all_reduce", {"reduce_op": "sum"}, 4)
    assert c.take == (0, 0, 0, 0) and c.single and c.fn is local.fold
    assert local.group_fn("broadcast", {"src": 0}, 3).fn is None
