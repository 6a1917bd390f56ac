"""The persistent TMA kernels, KernelConfig(tma=True): the mm_sum launcher's (fastpipe/kernels/mm_sum_tma.py:
matmul_reduce_scatter, all_gather_matmul dim 1) and gather_rows' (gather_rows_tma.py: all_gather_matmul dim 0).

Without CUDA it runs under TRITON_INTERPRET=1, whose tensor descriptors copy boxes as the GPU's TMA
does (zeros past an operand's edge). Results are compared with the float64 oracle of
test_kernels_matmul_reduce_scatter and with the plain kernel (same tiles, same K order: bitwise equal
under the interpreter). ``_num_sms`` is patched to a few programs, so each persistent program takes
several tiles.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402

from fastpipe.kernels import KernelConfig, all_gather_matmul, matmul_reduce_scatter  # noqa: E402
from fastpipe.kernels import mm_reduce_scatter_kernel as mrs  # noqa: E402
from fastpipe.kernels import all_gather_mm_kernel as agm  # noqa: E402
from fastpipe.kernels import gather_rows_tma, mm_sum_tma, tuned  # noqa: E402
from fastpipe.kernels.mm_reduce_scatter_kernel import interpreting  # noqa: E402
from tests.kernel_launches import Launches, replayed  # noqa: E402
from tests.test_kernels_all_gather_matmul import assert_matches as assert_gathered  # noqa: E402
from tests.test_kernels_matmul_reduce_scatter import assert_matches  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TMA = KernelConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1, tma=True)
PLAIN = dataclasses.replace(TMA, tma=False)

# the kernel's arithmetic under the interpreter; on a GPU machine test_gpu_tma_* runs it compiled
interpreter_only = pytest.mark.skipif(CUDA, reason="the interpreter runs CPU tensors only without CUDA; "
                                                   "test_gpu_tma_bf16_and_in_a_captured_graph runs it on the GPU")


def operands(M, N, ks, dtype, *, b_cols: bool, seed=0):
    """a[i]: [M, K_i] row-major; b[i]: [K_i, N], w.t() of a [N, K_i] weight (b_cols) or row-major.
    Sizes keep every leading stride a multiple of 16 bytes (TMA's alignment)."""
    return random_pairs([(M, k) for k in ks], [(k, N) for k in ks], dtype, b_cols=b_cols, seed=seed)


def random_pairs(a_shapes, b_shapes, dtype, *, b_cols: bool, seed=0):
    """a: standard normal tensors of a_shapes; b: of b_shapes ([K, N] each), w.t() of an [N, K] weight
    (b_cols) or row-major."""
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(*shape, generator=g).to(dtype) for shape in a_shapes]
    if b_cols:
        b = [torch.randn(n, k, generator=g).to(dtype).t() for k, n in b_shapes]
    else:
        b = [torch.randn(k, n, generator=g).to(dtype) for k, n in b_shapes]
    return a, b


@pytest.fixture
def few_programs(monkeypatch):
    """Three persistent programs, whatever the device: each takes many of the test's tiles."""
    launches = Launches(mm_sum_tma._mm_sum_tma_kernel)
    monkeypatch.setattr(mrs, "_num_sms", lambda device: 3)
    monkeypatch.setattr(mm_sum_tma, "_mm_sum_tma_kernel", launches)
    return launches


@interpreter_only
@pytest.mark.parametrize("b_cols", [True, False], ids=["b_cols", "b_rows"])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_tma_matches_float64_and_the_plain_kernel(few_programs, dtype, n, dim, b_cols):
    """Irregular M and N (the last tiles run past the edge: TMA's zero padding, the store's mask), K_i
    of 24, 40, 56 (K tails inside a block), one persistent program per 3 tiles and more."""
    ks = [24, 40, 56][:n]
    M, N = (48, 40) if dim == 0 else (40, 48)
    a, b = operands(M, N, ks, dtype, b_cols=b_cols, seed=n * 10 + dim)
    got = matmul_reduce_scatter(a, b, dim=dim, config=TMA)
    assert few_programs.grids == [(3,)]                                # persistent: 3 programs for 9 tiles
    assert_matches(got, a, b, dim)
    plain = matmul_reduce_scatter(a, b, dim=dim, config=PLAIN)
    assert all(torch.equal(x, y) for x, y in zip(got, plain))         # same tiles, same K order


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_tma_avg_and_more_programs_than_tiles(monkeypatch, dtype):
    """avg scales the float32 sum before the one rounding; with more SMs than tiles the grid is the tiles."""
    launches = Launches(mm_sum_tma._mm_sum_tma_kernel)
    monkeypatch.setattr(mm_sum_tma, "_mm_sum_tma_kernel", launches)
    a, b = operands(32, 32, [32, 48], dtype, b_cols=True, seed=3)
    assert_matches(matmul_reduce_scatter(a, b, dim=0, op="avg", config=TMA), a, b, 0, "avg")
    assert launches.grids == [(4,)]                                    # 2 x 2 tiles, 132 "SMs"


@interpreter_only
def test_all_gather_matmul_dim_1_runs_the_tma_kernel(few_programs):
    """dim 1 is a sum over K-slices: the mm_sum launcher, b[j]'s row slices as the participants' b."""
    g = torch.Generator().manual_seed(4)
    a = [torch.randn(40, 16, generator=g) for _ in range(3)]            # [M, K_i], K = 48
    b = [torch.randn(32, 48, generator=g).t() for _ in range(3)]       # [K, N_j]: w.t(); row slices stay aligned
    outs = all_gather_matmul(a, b, dim=1, config=TMA)
    assert few_programs.grids == [(3,)] * 3                            # one launch per output
    assert_gathered(outs, a, b, 1)


@interpreter_only
def test_zero_k_participants_are_left_out(few_programs):
    """A participant with K_i = 0 adds nothing; TMA has no empty boxes, so it is not passed."""
    a, b = operands(48, 32, [32, 0, 16], torch.float32, b_cols=False, seed=5)
    assert_matches(matmul_reduce_scatter(a, b, dim=0, config=TMA), a, b, 0)
    assert few_programs.grids == [(3,)]
    a, b = operands(32, 32, [0, 0], torch.float32, b_cols=False)
    outs = matmul_reduce_scatter(a, b, dim=0, config=TMA)                # nothing to load: the plain kernel's zeros
    assert all(torch.equal(o, torch.zeros_like(o)) for o in outs) and len(few_programs.grids) == 1


def gathered_operands(n, ms, K, ns, dtype, *, b_cols: bool, seed=0):
    """dim 0 shards a[i]: [ms, K] and weights b[j]: [K, N_j] (w.t() with b_cols), TMA-aligned."""
    return random_pairs([(ms, K)] * n, [(K, nj) for nj in ns], dtype, b_cols=b_cols, seed=seed)


@pytest.fixture
def gather_launches(monkeypatch):
    """The gather_rows TMA kernel's launches, with 8 SMs: n x n blocks of programs, several tiles each."""
    launches = Launches(gather_rows_tma._gather_rows_tma_kernel)
    monkeypatch.setattr(mrs, "_num_sms", lambda device: 8)
    monkeypatch.setattr(agm, "_num_sms", lambda device: 8)
    monkeypatch.setattr(gather_rows_tma, "_gather_rows_tma_kernel", launches)
    return launches


@interpreter_only
@pytest.mark.parametrize("b_cols", [True, False], ids=["b_cols", "b_rows"])
@pytest.mark.parametrize("ms", [32, 19], ids=["whole_tiles", "partial_tiles"])
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gather_rows_tma_matches_float64(gather_launches, dtype, n, ms, b_cols):
    """dim 0: block (s, j) computes shard s's rows of output j; 19-row shards end inside a 16-row tile
    (TMA reads zeros past the shard, the store stops at its rows); outputs 48, 32 and 64 wide."""
    ns = [48, 32, 64][:n]
    a, b = gathered_operands(n, ms, 40, ns, dtype, b_cols=b_cols, seed=n + ms)
    got = all_gather_matmul(a, b, dim=0, config=TMA)
    blocks, tiles = n * n, -(-ms // 16) * (max(ns) // 16)               # a block's tiles (of the widest output)
    assert gather_launches.grids == [(blocks * max(1, min(tiles, 8 // blocks)),)]
    assert_gathered(got, a, b, 0)
    if ms % 16 == 0:                                                   # the plain kernel's tiles, the same K order
        plain = all_gather_matmul(a, b, dim=0, config=PLAIN)
        assert all(torch.equal(x, y) for x, y in zip(got, plain))


@interpreter_only
def test_gather_rows_tma_scratch_allocator_is_set_for_the_launch_only(monkeypatch):
    """Triton's launcher asks the context's allocator (triton.runtime._allocation._allocator) for the
    descriptors' scratch: during the launch it gives int8 buffers on the outputs' device; the caller's
    context keeps its own allocator."""
    from triton.runtime import _allocation

    seen, real = [], gather_rows_tma._gather_rows_tma_kernel

    class Recording:                                  # asks for scratch as Triton's launcher does, then launches
        def __getitem__(self, grid):
            def launch(*args, **meta):
                seen.append(_allocation._allocator.get()(grid[0] * 128, 128, None))
                return real[grid](*args, **meta)
            return launch

    monkeypatch.setattr(gather_rows_tma, "_gather_rows_tma_kernel", Recording())
    before = _allocation._allocator.get()
    a, b = gathered_operands(2, 16, 32, [32, 32], torch.float32, b_cols=True)
    assert_gathered(all_gather_matmul(a, b, dim=0, config=TMA), a, b, 0)
    [buf] = seen
    assert buf.dtype == torch.int8 and buf.device == a[0].device and buf.numel() % 128 == 0 and buf.numel() > 0
    assert _allocation._allocator.get() is before


@interpreter_only
def test_gather_rows_tma_refusals_and_zero_k(gather_launches):
    a, b = gathered_operands(2, 16, 32, [32, 32], torch.float32, b_cols=True)
    b = [b[0], b[1].contiguous()]                                       # one column-major, one row-major
    with pytest.raises(ValueError, match=r"^all_gather_matmul: config.tma: the TMA kernel cannot load these operands: "
                                         r"the b\[i\] are neither all row-major nor all column-major"):
        all_gather_matmul(a, b, dim=0, config=TMA)
    a, b = gathered_operands(2, 16, 0, [32, 32], torch.float32, b_cols=False)
    outs = all_gather_matmul(a, b, dim=0, config=TMA)                   # K = 0: nothing to load, the plain kernel
    assert all(torch.equal(o, torch.zeros_like(o)) for o in outs) and gather_launches.grids == []


def test_tma_problem_names_the_operand():
    a, b = operands(32, 32, [32, 32], torch.bfloat16, b_cols=True)
    cpu = torch.device("cpu")
    assert mm_sum_tma.tma_problem(a, b, cpu) is None
    assert mm_sum_tma.tma_problem(a, b[:1] + [b[1].contiguous()], cpu).startswith(
        "the b[i] are neither all row-major nor all column-major")
    assert "a[1] is not row-major" in mm_sum_tma.tma_problem([a[0], a[1].t().contiguous().t()], b, cpu)
    big = torch.randn(33, 40).to(torch.bfloat16)
    assert "a[0]'s data pointer is not a multiple of 16 bytes" in mm_sum_tma.tma_problem([big[:, 1:33]], b[:1], cpu)
    assert ("a[0]'s leading stride, 36 elements of 2 bytes, is not a multiple of 16 bytes"
            in mm_sum_tma.tma_problem([torch.randn(32, 36).to(torch.bfloat16)[:, :32]], b[:1], cpu))
    rows = [torch.randn(32, 20).to(torch.bfloat16)]                     # row-major b, 40-byte rows
    assert "b[0]'s leading stride, 20 elements" in mm_sum_tma.tma_problem(a[:1], rows, cpu)


def test_tma_needs_hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    why = mm_sum_tma.device_problem(torch.device("cuda", 0))
    assert why == "TMA needs compute capability 9.0 or newer (Hopper), and NVIDIA A100-SXM4-80GB is 8.0"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert mm_sum_tma.device_problem(torch.device("cuda", 0)) is None


def test_an_explicit_tma_config_that_cannot_load_is_refused():
    a = [torch.randn(32, 34, device=DEV)[:, :30]]                      # 136-byte rows
    b = [torch.randn(30, 32, device=DEV)]
    with pytest.raises(ValueError, match=r"^matmul_reduce_scatter: config.tma: the TMA kernel cannot load these "
                                         r"operands: a\[0\]'s leading stride, 34 elements of 4 bytes"):
        matmul_reduce_scatter(a, b, config=TMA)


@interpreter_only
def test_a_tuned_tma_config_that_cannot_load_warns_once_and_runs_pointer_loads(monkeypatch):
    """From the tuned table (no config passed): the same tiles with the plain kernel, and a warning that
    says so, once per reason."""
    monkeypatch.setattr(mrs, "pick_config", lambda *args, **kw: TMA)
    monkeypatch.setattr(mrs, "_warned_tma", set())
    plain = Launches(mrs._mm_sum_kernel)
    monkeypatch.setattr(mrs, "interpreting", lambda was=interpreting(): was)
    monkeypatch.setattr(mrs, "_mm_sum_kernel", plain)
    g = torch.Generator().manual_seed(6)
    a = [torch.randn(32, 34, generator=g)[:, :30]]
    b = [torch.randn(30, 32, generator=g)]
    with pytest.warns(RuntimeWarning, match=r"matmul_reduce_scatter: the tuned launch config 16x16x16 w4 s1 tma "
                                            r"uses TMA, but a\[0\]'s leading stride.*its tiles run with pointer "
                                            r"loads instead"):
        outs = matmul_reduce_scatter(a, b)
    assert_matches(outs, a, b, 0)
    assert len(plain.grids) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        matmul_reduce_scatter(a, b)                                    # the same reason: said once
    assert len(plain.grids) == 2


def test_kernel_config_tma_validation():
    assert TMA.text() == "16x16x16 w4 s1 tma" and PLAIN.text() == "16x16x16 w4 s1"
    with pytest.raises(ValueError, match=r"KernelConfig.tma: expected true or false, found 1"):
        KernelConfig(16, 16, 16, tma=1)
    with pytest.raises(ValueError, match=r"KernelConfig.tma: expected split_k 1 with tma .* found split_k 2"):
        KernelConfig(16, 16, 16, split_k=2, tma=True)
    with pytest.raises(ValueError, match=r"KernelConfig.tma: expected blocks of at most 256 .* found 512x64x64"):
        KernelConfig(512, 64, 64, tma=True)


def test_tuned_table_takes_tma(tmp_path, monkeypatch):
    entry = {"launcher": "mm_sum", "device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16", "M": 1024, "N": 4096,
             "K": 4096, "n": 2, "config": dataclasses.asdict(KernelConfig(128, 256, 64, 8, 8, 3, tma=True))}
    table = tuned.parse_table({"format": 1, "entries": [entry]}, "t.json")
    [(m, cfg)] = table[("mm_sum", "NVIDIA H100 80GB HBM3", "bfloat16", 4096, 4096, 2)]
    assert m == 1024 and cfg.tma
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"format": 1, "entries": [entry]}))
    monkeypatch.setenv("FASTPIPE_TUNED_CONFIGS", str(path))
    assert tuned.lookup("mm_sum", 8192, 4096, 4096, 2, torch.bfloat16, "NVIDIA H100 80GB HBM3").tma  # above: kept
    rows = dict(entry, launcher="gather_rows")
    assert tuned.parse_table({"format": 1, "entries": [rows]}, "t.json")[
        ("gather_rows", "NVIDIA H100 80GB HBM3", "bfloat16", 4096, 4096, 2)][0][1].tma
    bad = dict(entry, config=dict(entry["config"], tma="yes"))
    with pytest.raises(ValueError, match=r"^t.json: entries\[0\].config: expected KernelConfig fields.*tma"):
        tuned.parse_table({"format": 1, "entries": [bad]}, "t.json")


# ---------------------------------------------------------------------------
# on the GPU
# ---------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("M", [128, 1000])
def test_gpu_tma_bf16_and_in_a_captured_graph(M, dim):
    """The TMA kernel on a Hopper GPU, bf16, N = K 4096 (M 1000: a partial last row tile), against float64,
    the plain kernel's tiles, and replayed from a captured CUDA graph (descriptors are kernel arguments,
    captured by value)."""
    if mm_sum_tma.device_problem(torch.device("cuda")) is not None:
        pytest.skip(mm_sum_tma.device_problem(torch.device("cuda")))
    from tests.test_kernels_matmul_reduce_scatter import operands as mrs_operands
    a, b = mrs_operands(2, M, 4096, [2048, 2048], torch.bfloat16, seed=M + dim, device="cuda")
    b = [x if x.stride(0) == 1 else x.t().contiguous().t() for x in b]   # every b[i] the same layout (w.t())
    cfg = KernelConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3, tma=True)
    eager = matmul_reduce_scatter(a, b, dim=dim, config=cfg)
    assert_matches(eager, a, b, dim, tol=(8e-3, 1e-5))
    captured = replayed(lambda: matmul_reduce_scatter(a, b, dim=dim, config=cfg))
    assert all(torch.equal(x, y) for x, y in zip(captured, eager))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("M, n", [(1000, 2), (1024, 4)])
def test_gpu_gather_rows_tma_bf16_and_in_a_captured_graph(M, n):
    """all_gather_matmul dim 0 on the TMA kernel, bf16, K 4096, outputs 4096 / n wide (M 1000: 500-row shards end
    inside a tile): against float64, and replayed from a captured CUDA graph, whose capture allocates the
    descriptors' scratch from the graph's pool."""
    if mm_sum_tma.device_problem(torch.device("cuda")) is not None:
        pytest.skip(mm_sum_tma.device_problem(torch.device("cuda")))
    a, b = gathered_operands(n, M // n, 4096, [4096 // n] * n, torch.bfloat16, b_cols=True, seed=M + n)
    a, b = [x.cuda() for x in a], [x.cuda() for x in b]
    cfg = KernelConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3, tma=True)
    eager = all_gather_matmul(a, b, dim=0, config=cfg)
    assert_gathered(eager, a, b, 0, tol=(8e-3, 1e-5))
    captured = replayed(lambda: all_gather_matmul(a, b, dim=0, config=cfg))
    assert all(torch.equal(x, y) for x, y in zip(captured, eager))
