"""Conformance of fastpipe.comm.reference (the oracle) and reduce-op spellings.

Expected values are computed independently with numpy (float64 for floats):
np.sum/mean/max/min over the stacked inputs, np.array_split for the scatter,
np.concatenate for gathers, and explicit element loops for all_to_all.
Every case draws random inputs from its own seed (derived from its test id).
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpipe.comm import (
    REDUCE_OP_SPELLINGS,
    REDUCE_OPS,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    canonical_reduce_op,
    gather,
    reduce,
    reduce_scatter,
    send_recv,
)

CPU = torch.device("cpu")
META = torch.device("meta")

F32, F16, BF16, I32 = torch.float32, torch.float16, torch.bfloat16, torch.int32
DTYPES = [F32, F16, BF16, I32]
DTYPE_IDS = ["f32", "f16", "bf16", "i32"]
# relative tolerance of a sum/avg against the float64 truth
RTOL = {F32: 1e-6, F16: 1e-3, BF16: 1e-2}
NS = [1, 2, 3, 4]
OPS = ["sum", "avg", "max", "min"]
# (op, dtype) pairs the reference supports; avg on integers is refused
OP_DTYPES = [(op, dt) for op in OPS for dt in DTYPES if not (op == "avg" and dt == I32)]
OP_DTYPE_IDS = [f"{op}-{DTYPE_IDS[DTYPES.index(dt)]}" for op, dt in OP_DTYPES]
# chunked dims must be divisible by every n in NS
SPLIT_SHAPE = (12, 12, 12)
DIMS = [0, 2, -1, -2]  # first, last, negative (= last), negative (middle)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

@pytest.fixture
def seed(request) -> int:
    """A fresh, reproducible seed per test case."""
    return zlib.crc32(request.node.nodeid.encode())


def make_inputs(seed: int, n: int, shape, dtype: torch.dtype) -> list[torch.Tensor]:
    """n random, non-zero inputs on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    xs = []
    for _ in range(n):
        if dtype == torch.bool:
            x = torch.rand(shape, generator=gen) < 0.5
        elif dtype.is_floating_point:
            x = torch.randn(shape, generator=gen, dtype=torch.float64)
            x = torch.where(x == 0, torch.ones_like(x), x).to(dtype)
        else:
            magnitude = torch.randint(1, 1000, shape, generator=gen, dtype=torch.int64)
            sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.int64) * 2 - 1
            x = (magnitude * sign).to(dtype)
        xs.append(x)
    if dtype != torch.bool:
        assert all(bool((x != 0).any()) for x in xs if x.numel())
    return xs


def to_np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bool:
        return t.numpy().copy()
    if t.dtype.is_floating_point:
        return t.to(torch.float64).numpy()
    return t.to(torch.int64).numpy()


def np_reduce(arrays: list[np.ndarray], op: str) -> np.ndarray:
    stack = np.stack(arrays, axis=0)
    return {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}[op](stack, axis=0)


def assert_reduced(actual: torch.Tensor, expected: np.ndarray, op: str, dtype: torch.dtype,
                   inputs: list[np.ndarray]) -> None:
    assert actual.dtype == dtype
    assert tuple(actual.shape) == expected.shape
    got = to_np(actual)
    if dtype.is_floating_point and op in ("sum", "avg"):
        rtol = RTOL[dtype]
        scale = sum(float(np.abs(a).max()) for a in inputs) if inputs[0].size else 1.0
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * scale)
    else:  # max/min of floats and everything on integers is exact
        np.testing.assert_array_equal(got, expected)


def assert_exact(actual: torch.Tensor, expected: np.ndarray, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    assert tuple(actual.shape) == expected.shape
    np.testing.assert_array_equal(to_np(actual), expected)


def norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


# ---------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("op,dtype", OP_DTYPES, ids=OP_DTYPE_IDS)
def test_all_reduce(n, op, dtype, seed):
    xs = make_inputs(seed, n, (3, 5, 4), dtype)
    arrays = [to_np(x) for x in xs]
    expected = np_reduce(arrays, op)
    ys = all_reduce(xs, op, [CPU] * n)
    assert len(ys) == n
    for y in ys:
        assert y.device == CPU
        assert_reduced(y, expected, op, dtype, arrays)


@pytest.mark.parametrize("dst_pos", ["first", "last"])
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("op,dtype", OP_DTYPES, ids=OP_DTYPE_IDS)
def test_reduce(n, op, dtype, dst_pos, seed):
    xs = make_inputs(seed, n, (4, 7), dtype)
    dst = 0 if dst_pos == "first" else n - 1
    arrays = [to_np(x) for x in xs]
    y = reduce(xs, op, dst, [CPU] * n)
    assert isinstance(y, torch.Tensor) and y.device == CPU
    assert_reduced(y, np_reduce(arrays, op), op, dtype, arrays)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("op,dtype", OP_DTYPES, ids=OP_DTYPE_IDS)
def test_reduce_scatter(n, op, dtype, dim, seed):
    xs = make_inputs(seed, n, SPLIT_SHAPE, dtype)
    arrays = [to_np(x) for x in xs]
    expected_chunks = np.array_split(np_reduce(arrays, op), n, axis=dim)
    ys = reduce_scatter(xs, op, dim, [CPU] * n)
    assert len(ys) == n
    for y, expected in zip(ys, expected_chunks):
        assert y.device == CPU
        assert_reduced(y, expected, op, dtype, arrays)


def f32_fold(values) -> np.float32:
    acc = np.float32(values[0])
    for v in values[1:]:
        acc = np.float32(acc + np.float32(v))
    return acc


def test_reduction_folds_in_participant_order():
    # float32 sums that depend on the order: only the left fold 0..n-1 gives 0.5
    values = [1.0, 1e8, -1e8, 0.5]
    expected = f32_fold(values)
    assert expected == np.float32(0.5)
    assert f32_fold(values[::-1]) != expected  # n-1..0
    assert f32_fold([values[0]] + values[:0:-1]) != expected  # 0, then n-1..1
    tree = np.float32(np.float32(values[0] + np.float32(values[1])) + np.float32(values[2] + np.float32(values[3])))
    assert tree != expected  # pairwise tree
    xs = [torch.tensor([v], dtype=F32) for v in values]
    for y in all_reduce(xs, "sum", [CPU] * 4) + [reduce(xs, "sum", 3, [CPU] * 4)]:
        assert y.item() == float(expected)


@pytest.mark.parametrize(
    "dtype,big",
    [(F16, 2048.0), (BF16, 256.0)],
    ids=["f16", "bf16"],
)
def test_narrow_floats_accumulate_in_float32_and_round_once(dtype, big):
    # big + 1 rounds back to big in the narrow dtype (spacing 2), so a fold in
    # the narrow dtype gives big; accumulating in float32 gives big + 2 exactly.
    xs = [torch.tensor([big], dtype=dtype), torch.tensor([1.0], dtype=dtype), torch.tensor([1.0], dtype=dtype)]
    narrow_fold = (xs[0] + xs[1]) + xs[2]
    assert narrow_fold.item() == big
    for fn in (lambda: all_reduce(xs, "sum", [CPU] * 3)[0], lambda: reduce(xs, "sum", 1, [CPU] * 3)):
        y = fn()
        assert y.dtype == dtype and y.item() == big + 2
    avg = all_reduce(xs, "avg", [CPU] * 3)[0]
    assert avg.item() == torch.tensor((big + 2) / 3, dtype=torch.float64).to(dtype).item()


def test_float8_reduction_rounds_once_to_float8():
    dtype = torch.float8_e4m3fn
    xs = make_inputs(7, 3, (64,), torch.float32)
    xs = [x.to(dtype) for x in xs]
    exact = np.sum(np.stack([to_np(x) for x in xs]), axis=0)  # exact: few significand bits
    y = all_reduce(xs, "sum", [CPU] * 3)[0]
    assert y.dtype == dtype
    assert torch.equal(y.view(torch.uint8), torch.from_numpy(exact).to(dtype).view(torch.uint8))


@pytest.mark.parametrize("n", NS)
def test_bool_reductions_are_logical(n, seed):
    xs = make_inputs(seed, n, (5, 6), torch.bool)
    stack = np.stack([to_np(x) for x in xs])
    expected = {"sum": np.any(stack, axis=0), "max": np.any(stack, axis=0), "min": np.all(stack, axis=0)}
    for op, exp in expected.items():
        assert_exact(all_reduce(xs, op, [CPU] * n)[0], exp, torch.bool)


def test_max_min_propagate_nan():
    xs = [torch.tensor([1.0, float("nan")]), torch.tensor([float("nan"), 2.0])]
    for op in ("max", "min", "sum", "avg"):
        y = all_reduce(xs, op, [CPU] * 2)[0]
        assert torch.isnan(y).all(), op


def test_integer_sum_wraps_like_torch():
    xs = [torch.tensor([2**31 - 1], dtype=I32), torch.tensor([1], dtype=I32)]
    assert all_reduce(xs, "sum", [CPU] * 2)[0].item() == -(2**31)


def test_zero_dim_and_empty_tensors():
    xs = [torch.tensor(1.5), torch.tensor(2.0)]
    ys = all_reduce(xs, "sum", [CPU] * 2)
    assert ys[0].shape == () and ys[0].item() == 3.5
    empty = [torch.zeros(0, 4), torch.zeros(0, 4)]
    assert all_gather(empty, 0, [CPU] * 2)[0].shape == (0, 4)
    assert all_reduce(empty, "max", [CPU] * 2)[0].shape == (0, 4)


# ---------------------------------------------------------------------------
# data movement
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_all_gather(n, dtype, dim, seed):
    xs = make_inputs(seed, n, (2, 3, 4), dtype)
    expected = np.concatenate([to_np(x) for x in xs], axis=dim)
    ys = all_gather(xs, dim, [CPU] * n)
    assert len(ys) == n
    for y in ys:
        assert y.device == CPU
        assert_exact(y, expected, dtype)


@pytest.mark.parametrize("dst_pos", ["first", "last"])
@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gather(n, dtype, dim, dst_pos, seed):
    xs = make_inputs(seed, n, (3, 2, 5), dtype)
    dst = 0 if dst_pos == "first" else n - 1
    y = gather(xs, dim, dst, [CPU] * n)
    assert isinstance(y, torch.Tensor) and y.device == CPU
    assert_exact(y, np.concatenate([to_np(x) for x in xs], axis=dim), dtype)


def np_all_to_all(arrays: list[np.ndarray], src_dim: int, dst_dim: int) -> list[np.ndarray]:
    """y_i built element by element: y_i[idx] = x_j[src_idx]."""
    n = len(arrays)
    shape = arrays[0].shape
    ndim = len(shape)
    src_dim, dst_dim = norm(src_dim, ndim), norm(dst_dim, ndim)
    c = shape[src_dim] // n  # chunk size along src_dim
    piece_shape = list(shape)
    piece_shape[src_dim] = c
    out_shape = list(piece_shape)
    out_shape[dst_dim] = piece_shape[dst_dim] * n
    outputs = []
    for i in range(n):
        y = np.empty(out_shape, dtype=arrays[0].dtype)
        for idx in np.ndindex(*out_shape):
            j, within = divmod(idx[dst_dim], piece_shape[dst_dim])  # which sender, where in its piece
            src_idx = list(idx)
            src_idx[dst_dim] = within
            src_idx[src_dim] = src_idx[src_dim] + i * c  # piece i of the sender
            y[idx] = arrays[j][tuple(src_idx)]
        outputs.append(y)
    return outputs


ALL_TO_ALL_DIMS = [(0, 0), (0, 1), (0, -1), (2, 0), (-1, -1), (-3, 1), (2, -2)]


@pytest.mark.parametrize("src_dim,dst_dim", ALL_TO_ALL_DIMS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_all_to_all(n, dtype, src_dim, dst_dim, seed):
    xs = make_inputs(seed, n, (12, 2, 12), dtype)
    expected = np_all_to_all([to_np(x) for x in xs], src_dim, dst_dim)
    ys = all_to_all(xs, src_dim, dst_dim, [CPU] * n)
    assert len(ys) == n
    for y, exp in zip(ys, expected):
        assert y.device == CPU
        assert_exact(y, exp, dtype)


@pytest.mark.parametrize("src_pos", ["first", "last"])
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_broadcast(n, dtype, src_pos, seed):
    (x,) = make_inputs(seed, 1, (4, 3), dtype)
    src = 0 if src_pos == "first" else n - 1
    ys = broadcast(x, src, [CPU] * n)
    assert len(ys) == n
    for y in ys:
        assert y.device == CPU
        assert_exact(y, to_np(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_send_recv(dtype, seed):
    (x,) = make_inputs(seed, 1, (2, 3, 5), dtype)
    y = send_recv(x, CPU)
    assert y.device == CPU
    assert_exact(y, to_np(x), dtype)


# ---------------------------------------------------------------------------
# outputs: fresh memory, requested devices
# ---------------------------------------------------------------------------

def run_kind(kind: str, xs: list[torch.Tensor], devices: list) -> list[torch.Tensor]:
    """Run one comm kind with fixed metadata; always return a list of outputs."""
    n = len(xs)
    if kind == "all_reduce":
        return all_reduce(xs, "sum", devices)
    if kind == "all_gather":
        return all_gather(xs, -1, devices)
    if kind == "reduce_scatter":
        return reduce_scatter(xs, "avg", 0, devices)
    if kind == "all_to_all":
        return all_to_all(xs, 0, 1, devices)
    if kind == "reduce":
        return [reduce(xs, "max", n - 1, devices)]
    if kind == "gather":
        return [gather(xs, 0, 0, devices)]
    if kind == "broadcast":
        return broadcast(xs[0], 0, devices)
    if kind == "send_recv":
        return [send_recv(xs[0], devices[0])]
    raise AssertionError(kind)


KINDS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "reduce", "gather", "broadcast", "send_recv"]


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_outputs_are_fresh_tensors(kind, n, seed):
    xs = make_inputs(seed, n, (6, 6), F32)
    originals = [x.clone() for x in xs]
    ys = run_kind(kind, xs, [CPU] * n)
    input_ptrs = {x.untyped_storage().data_ptr() for x in xs}
    output_ptrs = [y.untyped_storage().data_ptr() for y in ys]
    assert not input_ptrs & set(output_ptrs)
    assert len(set(output_ptrs)) == len(ys)
    before = [y.clone() for y in ys]
    for k, y in enumerate(ys):
        assert y.is_contiguous()
        y.fill_(12345.0)
        for x, orig in zip(xs, originals):
            assert torch.equal(x, orig)
        for m in range(k + 1, len(ys)):
            assert torch.equal(ys[m], before[m])


@pytest.mark.parametrize("meta_at", [0, 1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_outputs_land_on_requested_devices(kind, meta_at, seed):
    # inputs on the CPU; participant `meta_at` on "meta", the others on the CPU
    devices = [META if i == meta_at else CPU for i in range(3)]
    xs = make_inputs(seed, 3, (6, 6), F32)
    ys = run_kind(kind, xs, devices)
    single_receiver = {"reduce": 2, "gather": 0, "send_recv": 0}  # as in run_kind
    if kind in single_receiver:
        assert [y.device for y in ys] == [devices[single_receiver[kind]]]
    else:
        assert [y.device for y in ys] == devices


def test_devices_may_be_strings():
    xs = make_inputs(1, 2, (2, 2), F32)
    ys = all_reduce(xs, "sum", ["cpu", "meta"])
    assert ys[0].device == CPU and ys[1].device == META


# ---------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool])
def test_avg_on_integer_or_bool_is_refused(dtype):
    xs = [torch.ones(4, 4, dtype=dtype), torch.ones(4, 4, dtype=dtype)]
    with pytest.raises(ValueError, match="avg"):
        all_reduce(xs, "avg", [CPU] * 2)
    with pytest.raises(ValueError, match="avg"):
        reduce(xs, "avg", 0, [CPU] * 2)
    with pytest.raises(ValueError, match="avg"):
        reduce_scatter(xs, "avg", 0, [CPU] * 2)


@pytest.mark.parametrize("n,shape,dim", [(3, (4, 6), 0), (2, (3,), 0), (4, (4, 6), -1), (3, (6, 4), 1)])
def test_uneven_reduce_scatter_is_refused(n, shape, dim):
    xs = [torch.ones(shape) for _ in range(n)]
    with pytest.raises(ValueError, match="divisible"):
        reduce_scatter(xs, "sum", dim, [CPU] * n)


@pytest.mark.parametrize("n,shape,src_dim", [(3, (4, 6), 0), (2, (3,), 0), (4, (4, 6), -1)])
def test_uneven_all_to_all_is_refused(n, shape, src_dim):
    xs = [torch.ones(shape) for _ in range(n)]
    with pytest.raises(ValueError, match="divisible"):
        all_to_all(xs, src_dim, 0, [CPU] * n)


def test_bad_arguments_are_refused():
    two = [torch.ones(2, 3), torch.ones(2, 3)]
    cases = [
        lambda: all_reduce([], "sum", []),
        lambda: all_reduce(two, "sum", [CPU]),  # one device for two participants
        lambda: all_reduce([torch.ones(2, 3), torch.ones(3, 2)], "sum", [CPU] * 2),  # shapes differ
        lambda: all_gather([torch.ones(2, 3), torch.ones(2, 3, dtype=F16)], 0, [CPU] * 2),  # dtypes differ
        lambda: all_reduce(two, "prod", [CPU] * 2),
        lambda: all_reduce(two, 2, [CPU] * 2),  # RedOpType.PRODUCT
        lambda: all_gather(two, 2, [CPU] * 2),
        lambda: all_gather(two, -3, [CPU] * 2),
        lambda: all_gather([torch.tensor(1.0)] * 2, 0, [CPU] * 2),  # no dim on a scalar
        lambda: reduce_scatter(two, "sum", 5, [CPU] * 2),
        lambda: all_to_all(two, 0, 2, [CPU] * 2),
        lambda: all_to_all(two, -3, 0, [CPU] * 2),
        lambda: reduce(two, "sum", 2, [CPU] * 2),
        lambda: reduce(two, "sum", -1, [CPU] * 2),
        lambda: gather(two, 0, 2, [CPU] * 2),
        lambda: broadcast(two[0], 2, [CPU] * 2),
        lambda: broadcast(two[0], 0, []),
        lambda: send_recv("not a tensor", CPU),
    ]
    for i, case in enumerate(cases):
        with pytest.raises(ValueError):
            case()
            pytest.fail(f"case {i} was not refused")


def test_reference_accepts_every_reduce_op_spelling():
    xs = make_inputs(3, 2, (3,), F32)
    expected = all_reduce(xs, "max", [CPU] * 2)[0]
    for spelling in ("MAX", "RedOpType.MAX", "ReduceOp.MAX", 4):
        assert torch.equal(all_reduce(xs, spelling, [CPU] * 2)[0], expected)


# ---------------------------------------------------------------------------
# canonical_reduce_op
# ---------------------------------------------------------------------------

def test_reduce_ops_constant():
    assert REDUCE_OPS == ("sum", "avg", "max", "min")


@pytest.mark.parametrize(
    "value,expected",
    [
        ("sum", "sum"), ("SUM", "sum"), ("Sum", "sum"),
        ("avg", "avg"), ("AVG", "avg"),
        ("max", "max"), ("MAX", "max"),
        ("min", "min"), ("Min", "min"),
        ("RedOpType.SUM", "sum"), ("RedOpType.AVG", "avg"), ("RedOpType.MAX", "max"), ("RedOpType.MIN", "min"),
        ("redoptype.sum", "sum"), ("ReduceOp.SUM", "sum"), ("ReduceOp.MIN", "min"),
        (0, "sum"), (1, "avg"), (3, "min"), (4, "max"),
    ],
)
def test_canonical_reduce_op_accepts(value, expected):
    assert canonical_reduce_op(value) == expected


def test_canonical_reduce_op_matches_torch_redoptype():
    # furiosa-llm's RedOpType *is* torch.distributed.ReduceOp.RedOpType; it writes
    # `.value` (an int) for reduce/all_reduce and str() for reduce_scatter.
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not built")
    red_op_type = torch.distributed.ReduceOp.RedOpType
    for name in ("SUM", "AVG", "MAX", "MIN"):
        member = getattr(red_op_type, name)
        assert canonical_reduce_op(int(member.value)) == name.lower()
        assert canonical_reduce_op(str(member)) == name.lower()
    for name in ("PRODUCT", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
        member = getattr(red_op_type, name)
        with pytest.raises(ValueError, match=name):
            canonical_reduce_op(int(member.value))
        with pytest.raises(ValueError):
            canonical_reduce_op(str(member))


@pytest.mark.parametrize(
    "value",
    [2, 5, 8, 9, -1, 100, True, False, "0", "", " sum", "mean", "prod", "product", "RedOpType.PRODUCT",
     "RedOpType.", "sum.RedOpType", None, 0.0, ["sum"]],
)
def test_canonical_reduce_op_refuses(value):
    with pytest.raises(ValueError) as info:
        canonical_reduce_op(value)
    message = str(info.value)
    assert "\n" not in message
    assert REDUCE_OP_SPELLINGS in message
    for spelling in ("'sum'", "'avg'", "'max'", "'min'", "RedOpType.SUM", "0 (sum)"):
        assert spelling in message


# ---------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------

@st.composite
def group_case(draw):
    """n, inputs and two dims of one random small case; the first dim is divisible by n."""
    n = draw(st.integers(1, 4))
    ndim = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim))
    dim_a = draw(st.integers(-ndim, ndim - 1))
    dim_b = draw(st.integers(-ndim, ndim - 1))
    shape[dim_a] *= n
    dtype = draw(st.sampled_from([F32, F16, BF16, I32]))
    seed = draw(st.integers(0, 2**31 - 1))
    return n, make_inputs(seed, n, tuple(shape), dtype), dim_a, dim_b


@settings(max_examples=50, deadline=None)
@given(case=group_case())
def test_all_to_all_then_inverse_is_identity(case):
    n, xs, src_dim, dst_dim = case
    devices = [CPU] * n
    ys = all_to_all(xs, src_dim, dst_dim, devices)
    zs = all_to_all(ys, dst_dim, src_dim, devices)
    for x, z in zip(xs, zs):
        assert torch.equal(x, z)


@settings(max_examples=50, deadline=None)
@given(case=group_case(), op=st.sampled_from(OPS))
def test_reduce_scatter_then_all_gather_is_all_reduce(case, op):
    n, xs, dim, _ = case
    if op == "avg" and not xs[0].dtype.is_floating_point:
        op = "sum"
    devices = [CPU] * n
    gathered = all_gather(reduce_scatter(xs, op, dim, devices), dim, devices)
    for g, r in zip(gathered, all_reduce(xs, op, devices)):
        assert torch.equal(g, r)


# ---------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# ---------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_reduction_bits_do_not_depend_on_the_device(dtype, op, seed):
    cuda = torch.device("cuda")
    xs = make_inputs(seed, 4, (33, 65), dtype)
    on_cpu = all_reduce(xs, op, [CPU] * 4)
    # participant 0 on the GPU: the fold runs there
    mixed = all_reduce([xs[0].to(cuda)] + xs[1:], op, [cuda, CPU, CPU, cuda])
    assert [y.device.type for y in mixed] == ["cuda", "cpu", "cpu", "cuda"]
    for a, b in zip(on_cpu, mixed):
        assert torch.equal(a, b.cpu())
