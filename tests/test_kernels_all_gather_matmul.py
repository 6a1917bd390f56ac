"""fastpipe.kernels.all_gather_matmul (fastpipe/kernels/all_gather_mm_kernel.py): the fused kernel,
its reference and the overlapped variant.

Without CUDA the Triton kernels run under TRITON_INTERPRET=1 (set below, before triton is
imported). Every result is compared with an independent float64 computation,
``torch.cat([x.double() for x in a], dim) @ b[j].double()``; the tolerance rule and its
measured justification are in tests/tensor_compare.py, the comparison every kernel test shares
(``|out - exp| <= rtol * |exp| + atol * (|A| @ |b_j|)``).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fastpipe.kernels import (  # noqa: E402
    KernelConfig,
    all_gather_matmul,
    all_gather_matmul_overlapped,
    all_gather_matmul_reference,
)
from fastpipe.kernels import all_gather_mm_kernel as agm  # noqa: E402
from fastpipe.kernels.mm_reduce_scatter_kernel import interpreting  # noqa: E402
from tests.kernel_launches import Launches  # noqa: E402
from tests.tensor_compare import assert_close, tolerance  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_kernels_run_here():
    assert CUDA or interpreting()


def operands(n, dim, dtype, seed=0, device=DEV, ms=7, M=37, K=45):
    """Shards a (dim 0: [ms, K] each; dim 1: [M, K_i] with K_i = 11 + 5i) and b[j]: [K, 33 + j],
    a transposed weight view (w.t()) for even j."""
    g = torch.Generator().manual_seed(seed)
    if dim in (0, -2):
        a = [torch.randn(ms, K, generator=g).to(dtype).to(device) for _ in range(n)]
        k_total = K
    else:
        a = [torch.randn(M, 11 + 5 * i, generator=g).to(dtype).to(device) for i in range(n)]
        k_total = sum(x.shape[1] for x in a)
    b = [(torch.randn(33 + j, k_total, generator=g).to(dtype).to(device).t() if j % 2 == 0
          else torch.randn(k_total, 33 + j, generator=g).to(dtype).to(device)) for j in range(n)]
    return a, b


def assert_matches(outs, a, b, dim, tol=None):
    full = torch.cat([x.double() for x in a], dim=dim)
    assert len(outs) == len(b)
    rtol, atol = tol or tolerance(a[0].dtype)
    for j, (o, bj) in enumerate(zip(outs, b)):
        e = full.to(o.device) @ bj.double().to(o.device)
        m = full.abs().to(o.device) @ bj.double().abs().to(o.device)
        assert_close(o, e, m, rtol=rtol, atol=atol, dtype=a[0].dtype, what=f"output {j}")
        assert o.is_contiguous(), f"output {j} is not contiguous"


# ---------------------------------------------------------------------------
# the fused kernels
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_matches_float64(dtype, n, dim):
    """dim 0: 7-row shards, so most row tiles span several shards; dim 1: unequal K_i."""
    a, b = operands(n, dim, dtype, seed=10 * n + dim)
    assert_matches(all_gather_matmul(a, b, dim=dim), a, b, dim)


@pytest.mark.parametrize("dim", [-2, -1])
def test_negative_dims(dim):
    a, b = operands(2, dim, torch.float32, seed=3)
    assert_matches(all_gather_matmul(a, b, dim=dim), a, b, dim % 2)


def test_dim0_mixed_shard_layouts_and_tiny_tiles():
    """Shards with different K strides (one a transposed view: no common K stride) and unaligned
    row starts (no alignment hint); 16x16x16 tiles, shards of 20 rows straddle tiles."""
    g = torch.Generator().manual_seed(5)
    a = [torch.randn(20, 37, generator=g).to(DEV),
         torch.randn(37, 20, generator=g).t().to(DEV),               # strides (1, 20)
         torch.randn(20, 41, generator=g)[:, 1:38].to(DEV)]          # odd row stride, offset start
    b = [torch.randn(37, 30, generator=g).to(DEV)] * 3
    cfg = KernelConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1)
    assert_matches(all_gather_matmul(a, b, dim=0, config=cfg), a, b, 0)


@pytest.mark.parametrize("n", [2, 4])
def test_dim0_every_output_in_one_launch(monkeypatch, n):
    """One launch computes all n outputs (grid axis 1 is the output): n launches one after another
    would each fill only 1/n of the GPU at a decode's M, and wait for the one before."""
    launches = Launches(agm._gather_rows_kernel)
    monkeypatch.setattr(agm, "_gather_rows_kernel", launches)
    a, b = operands(n, 0, torch.float32, seed=7)
    outs = all_gather_matmul(a, b, dim=0)
    assert len(launches.grids) == 1 and launches.grids[0][1] == n, launches.grids
    assert_matches(outs, a, b, 0)


def test_dim1_noncontiguous_shards():
    g = torch.Generator().manual_seed(6)
    a = [torch.randn(19, 40, generator=g).t().to(DEV), torch.randn(40, 30, generator=g)[:, ::2].to(DEV)]
    b = [torch.randn(34, 21, generator=g).to(DEV), torch.randn(18, 34, generator=g).t().to(DEV)]  # K = 19 + 15
    assert_matches(all_gather_matmul(a, b, dim=1), a, b, 1)


@pytest.mark.parametrize("n", [2, 4])
def test_dim1_every_output_in_one_launch(monkeypatch, n):
    """dim 1 (gather_cols) computes all n outputs in one launch, as dim 0 does (grid axis 1: the output), not one
    mm_sum launch per output."""
    launches = Launches(agm._gather_cols_kernel)
    monkeypatch.setattr(agm, "_gather_cols_kernel", launches)
    mm_sum = []
    monkeypatch.setattr(agm, "launch_mm_sum", lambda *args, **kw: mm_sum.append(args))
    a, b = operands(n, 1, torch.float32, seed=17)
    outs = all_gather_matmul(a, b, dim=1)
    assert len(launches.grids) == 1 and launches.grids[0][1:] == (n, 1), launches.grids
    assert mm_sum == []
    assert_matches(outs, a, b, 1)


@pytest.mark.parametrize("dim", [0, 1])
def test_outputs_of_different_widths(dim):
    """N_j of 16, 70 and 5 with 16-column tiles: the grid is sized for the widest (5 column tiles); the programs
    past a narrower output's columns write nothing. The outputs are column blocks of one NaN-filled buffer with
    a column between them, which must still be NaN afterwards. dim 0: shards of 9 rows; dim 1: shards of K 24,
    0 and 13 (the empty one adds nothing), one a transposed view."""
    g = torch.Generator().manual_seed(8 + 10 * dim)
    if dim == 0:
        a = [torch.randn(9, 24, generator=g).to(DEV) for _ in range(3)]
    else:
        a = [torch.randn(27, 24, generator=g).to(DEV), torch.randn(27, 0, generator=g).to(DEV),
             torch.randn(13, 27, generator=g).to(DEV).t()]
    k = 24 if dim == 0 else 37
    b = [torch.randn(k, 16, generator=g).to(DEV), torch.randn(70, k, generator=g).to(DEV).t(),
         torch.randn(k, 5, generator=g).to(DEV)]
    buf = torch.full((27, 16 + 70 + 5 + 3), float("nan"), device=DEV)
    outs = [buf[:, 0:16], buf[:, 17:87], buf[:, 88:93]]            # [27, N_j] views, row stride 94
    launch = agm.launch_gather_rows if dim == 0 else agm.launch_gather_cols
    launch(a, b, outs, KernelConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1))
    assert buf[:, [16, 87, 93]].isnan().all(), "a program wrote past its output's columns"
    assert_matches([o.contiguous() for o in outs], a, b, dim)
    # the public function, whose outputs are its own fresh tensors
    assert [tuple(o.shape) for o in all_gather_matmul(a, b, dim=dim)] == [(27, 16), (27, 70), (27, 5)]


@pytest.mark.parametrize("n,split_k", [(1, 2), (2, 3), (3, 2), (4, 16)])
def test_dim1_split_k_matches_float64(n, split_k):
    """dim 1 split-K (gather_cols): program (tile, j, s) sums the s-th run of the tile's K-steps, counted over every
    shard in turn, into W[j, s]; one more launch adds the shares of every output. Shards of K 11 + 5i (no multiple
    of the K step: runs start and end inside a shard's steps), outputs of different widths, and split_k past the
    K-steps (16 > 7 at n 4: some programs get no steps, and write zeros)."""
    a, b = operands(n, 1, torch.float32, seed=n * 10 + split_k)
    cfg = KernelConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1, split_k=split_k)
    outs = all_gather_matmul(a, b, dim=1, config=cfg)
    full = torch.cat([x.double() for x in a], dim=1)
    for o, bj in zip(outs, b):
        assert o.shape == (37, bj.shape[1]) and o.dtype == torch.float32
        torch.testing.assert_close(o.double(), full @ bj.double().to(o.device), rtol=1e-5, atol=1e-4)


def test_dim1_split_k_is_two_launches_and_deterministic(monkeypatch):
    shares, sums = Launches(agm._gather_cols_kernel), Launches(agm._gather_split_k_sum_kernel)
    monkeypatch.setattr(agm, "_gather_cols_kernel", shares)
    monkeypatch.setattr(agm, "_gather_split_k_sum_kernel", sums)
    a, b = operands(3, 1, torch.bfloat16, seed=19)
    cfg = KernelConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1, split_k=3)
    first = all_gather_matmul(a, b, dim=1, config=cfg)
    again = all_gather_matmul(a, b, dim=1, config=cfg)
    assert [g[1:] for g in shares.grids] == [(3, 3)] * 2 and [g[2] for g in sums.grids] == [3] * 2
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    assert_matches(first, a, b, 1)


@pytest.mark.parametrize("n,split_k", [(1, 2), (2, 3), (3, 2), (4, 16)])
def test_dim0_split_k_matches_float64(n, split_k):
    """dim 0 split-K (gather_rows): program (tile, j, s) sums the s-th run of the tile's K-steps into W[j, s], one
    more launch adds the shares of every output. Outputs of different widths (the workspace's planes are as wide
    as the widest), shards whose rows split tiles (M_i = 7), K (75) not a multiple of the K step nor of split_k's
    runs, and split_k past the K-steps (16 > 5: some programs get no steps, and write zeros)."""
    g = torch.Generator().manual_seed(n * 10 + split_k)
    a = [torch.randn(7, 75, generator=g).to(DEV) for _ in range(n)]
    b = [torch.randn(5 + 13 * j, 75, generator=g).t().to(DEV) for j in range(n)]     # w.t(), N_j 5, 18, 31, 44
    cfg = KernelConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1, split_k=split_k)
    outs = all_gather_matmul(a, b, dim=0, config=cfg)
    full = torch.cat([x.double() for x in a])
    for o, bj in zip(outs, b):
        assert o.shape == (7 * n, bj.shape[1]) and o.dtype == torch.float32
        torch.testing.assert_close(o.double(), full @ bj.double(), rtol=1e-5, atol=1e-4)


def test_dim0_split_k_is_two_launches_and_deterministic(monkeypatch):
    """split_k > 1 at dim 0: the shares' launch (grid axis 2 = the share, axis 1 = the output) and ONE launch
    that adds them for every output; the same inputs give the same bits (the shares added in a fixed order)."""
    shares, sums = Launches(agm._gather_rows_kernel), Launches(agm._gather_split_k_sum_kernel)
    monkeypatch.setattr(agm, "_gather_rows_kernel", shares)
    monkeypatch.setattr(agm, "_gather_split_k_sum_kernel", sums)
    a, b = operands(3, 0, torch.bfloat16, seed=4)
    cfg = KernelConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1, split_k=4)
    first = all_gather_matmul(a, b, dim=0, config=cfg)
    again = all_gather_matmul(a, b, dim=0, config=cfg)
    assert [g[1:] for g in shares.grids] == [(3, 4)] * 2 and [g[2] for g in sums.grids] == [3] * 2
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    assert_matches(first, a, b, 0)


def test_outputs_are_fresh():
    a, b = operands(2, 0, torch.float32)
    outs = all_gather_matmul(a, b, dim=0)
    ptrs = {o.data_ptr() for o in outs}
    assert len(ptrs) == 2 and not ptrs & {x.data_ptr() for x in a + b}


# ---------------------------------------------------------------------------
# reference and overlapped variant
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_matches_float64(dtype, dim):
    a, b = operands(4, dim, dtype, seed=11, device="cpu")
    assert_matches(all_gather_matmul_reference(a, b, dim), a, b, dim)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_overlapped_on_one_device_matches_float64(dtype, n, dim):
    a, b = operands(n, dim, dtype, seed=13 + n, device="cpu")
    assert_matches(all_gather_matmul_overlapped(a, b, dim=dim), a, b, dim)


def test_overlapped_ring_order(monkeypatch):
    """Participant j multiplies its own shard first, then (j-1) % n, (j-2) % n, ..."""
    calls = []
    real = agm._mm_into

    def spy(out, x, y):
        calls.append((x.data_ptr(), y.data_ptr()))
        real(out, x, y)

    monkeypatch.setattr(agm, "_mm_into", spy)
    n = 4
    a, b = operands(n, 0, torch.float32, device="cpu")
    all_gather_matmul_overlapped(a, b, dim=0)
    shard = {x.data_ptr(): i for i, x in enumerate(a)}
    order = [[shard[p] for p, bp in calls if bp == b[j].data_ptr()] for j in range(n)]
    assert order == [[(j - s) % n for s in range(n)] for j in range(n)]


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [all_gather_matmul, all_gather_matmul_overlapped, all_gather_matmul_reference])
def test_errors(fn):
    a, b = operands(2, 0, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="len\\(b\\)"):
        fn(a, b[:1])
    with pytest.raises(ValueError, match="like a\\[0\\] \\(shards along dim 0\\)"):
        fn([a[0], a[1][:5]], b)
    with pytest.raises(ValueError, match="b\\[1\\]: expected 45 rows"):
        fn(a, [b[0], b[1][:40]])
    a1, b1 = operands(2, 1, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="rows like a\\[0\\] \\(shards along dim 1\\)"):
        fn([a1[0], a1[1][:30]], b1, dim=1)
    with pytest.raises(ValueError, match="b\\[0\\]: expected 27 rows"):
        fn(a1, [b1[0][:26], b1[1]], dim=1)
    with pytest.raises(ValueError, match="dim"):
        fn(a, b, dim=2)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        fn([x.double() for x in a], [x.double() for x in b])
    with pytest.raises(ValueError, match="1 <= n <= 8"):
        fn([], [])


def test_fused_needs_one_device():
    a, b = operands(2, 0, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="every tensor on"):
        all_gather_matmul(a, [b[0], b[1].to("meta")])


# ---------------------------------------------------------------------------
# GPU scale (skipped without CUDA)
# ---------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("M", [16, 8192])
def test_gpu_scale_bf16(M, n, dim):
    """cat(a) is [M, 4096] (rows or K split n ways), b[j] = w.t(): [4096, 4096 / n], bf16."""
    g = torch.Generator().manual_seed(M + n)
    K, N = 4096, 4096 // n
    if dim == 0:
        a = [torch.randn(M // n, K, generator=g).bfloat16().cuda() for _ in range(n)]
    else:
        a = [torch.randn(M, K // n, generator=g).bfloat16().cuda() for _ in range(n)]
    b = [torch.randn(N, K, generator=g).bfloat16().cuda().t() for _ in range(n)]
    assert_matches(all_gather_matmul(a, b, dim=dim), a, b, dim, tol=(8e-3, 1e-5))


@pytest.mark.cuda
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("n,split_k", [(2, 4), (4, 2), (4, 16)])
def test_gpu_split_k_bf16_and_in_a_captured_graph(n, split_k, dim):
    """split-K at a decode's M on the GPU (M 16, K 4096: the n outputs' 16 x 4096/n tiles alone leave most SMs
    idle), both launchers (dim 0: gather_rows, dim 1: gather_cols), eagerly and replayed from a CUDA graph (the
    shares' workspace then from the graph's pool), the replay bit-equal to the eager run (the shares added in a
    fixed order)."""
    from tests.kernel_launches import replayed

    g = torch.Generator().manual_seed(n * 100 + split_k)
    shape = (16 // n, 4096) if dim == 0 else (16, 4096 // n)
    a = [torch.randn(*shape, generator=g).bfloat16().cuda() for _ in range(n)]
    b = [torch.randn(4096 // n, 4096, generator=g).bfloat16().cuda().t() for _ in range(n)]
    cfg = KernelConfig(16, 64, 64, group_m=8, num_warps=4, num_stages=4, split_k=split_k)
    eager = all_gather_matmul(a, b, dim=dim, config=cfg)
    assert_matches(eager, a, b, dim, tol=(8e-3, 1e-5))
    captured = replayed(lambda: all_gather_matmul(a, b, dim=dim, config=cfg))
    assert all(torch.equal(x, y) for x, y in zip(captured, eager))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dim", [0, 1])
def test_overlapped_across_gpus(dim):
    n = min(torch.cuda.device_count(), 4)
    g = torch.Generator().manual_seed(0)
    M, K, N = 2048, 2048, 1024
    a = [torch.randn(M // n, K, generator=g).bfloat16().to(f"cuda:{i}") if dim == 0 else
         torch.randn(M, K // n, generator=g).bfloat16().to(f"cuda:{i}") for i in range(n)]
    b = [torch.randn(N, K, generator=g).bfloat16().to(f"cuda:{i}").t() for i in range(n)]
    outs = all_gather_matmul_overlapped(a, b, dim=dim)
    assert [o.device for o in outs] == [x.device for x in b]
    torch.cuda.synchronize()
    assert_matches([o.to("cuda:0") for o in outs], [x.to("cuda:0") for x in a], [x.to("cuda:0") for x in b], dim,
                   tol=(8e-3, 1e-5))
