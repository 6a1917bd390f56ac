"""fastpipe.kernels.matmul_reduce_scatter (fastpipe/kernels/mm_reduce_scatter_kernel.py): the fused
kernel, its reference and the overlapped variant.

Without CUDA the Triton kernel runs under TRITON_INTERPRET=1 (set below, before triton is
imported), on small irregular shapes. Every result is compared with an independent float64
computation: ``sum_i a[i].double() @ b[i].double()``, chunked by hand with torch.chunk.

Tolerances: ``|out - exp| <= rtol * |exp| + atol * mag`` where ``mag = sum_i |a[i]| @ |b[i]|``
(float64) is the scale of float32 accumulation error; the per-dtype values and their measured
justification are in tests/tensor_compare.py, the comparison every kernel test shares.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fastpipe.kernels import (  # noqa: E402
    KernelConfig,
    KernelUnavailable,
    matmul_reduce_scatter,
    matmul_reduce_scatter_overlapped,
    matmul_reduce_scatter_reference,
    pick_config,
)
from fastpipe.kernels import mm_reduce_scatter_kernel as mrs  # noqa: E402
from fastpipe.kernels.mm_reduce_scatter_kernel import interpreting, launch_mm_sum  # noqa: E402
from tests.kernel_launches import Launches, replayed  # noqa: E402
from tests.tensor_compare import assert_close, tolerance  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_kernels_run_here():
    """Without CUDA the kernels must have been defined under the interpreter (TRITON_INTERPRET=1
    set before fastpipe.kernels was first imported -- e.g. by conftest or this file)."""
    assert CUDA or interpreting()


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def operands(n, M, N, ks, dtype, seed=0, device=DEV):
    """a[i]: [M, K_i] contiguous; b[i]: [K_i, N], a transposed weight view (w.t()) for even i."""
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(M, k, generator=g).to(dtype).to(device) for k in ks]
    b = [(torch.randn(N, k, generator=g).to(dtype).to(device).t() if i % 2 == 0
          else torch.randn(k, N, generator=g).to(dtype).to(device)) for i, k in enumerate(ks)]
    return a, b


def expected(a, b, dim, op="sum"):
    """Independent float64 oracle: (chunks of the exact result, chunks of sum |a||b|)."""
    n = len(a)
    full = sum(x.double() @ y.double() for x, y in zip(a, b))
    mag = sum(x.double().abs() @ y.double().abs() for x, y in zip(a, b))
    if op == "avg":
        full, mag = full / n, mag / n
    return torch.chunk(full, n, dim), torch.chunk(mag, n, dim)


def assert_matches(outs, a, b, dim, op="sum", tol=None):
    exps, mags = expected(a, b, dim, op)
    assert len(outs) == len(exps)
    rtol, atol = tol or tolerance(a[0].dtype)
    for j, (o, e, m) in enumerate(zip(outs, exps, mags)):
        assert_close(o, e, m, rtol=rtol, atol=atol, dtype=a[0].dtype, what=f"chunk {j}")
        assert o.is_contiguous(), f"chunk {j} is not contiguous"


def shape_for(n, dim):
    """Irregular M, N (split dim divisible by n) and per-participant K_i spanning several K steps."""
    ks = [45 + 7 * i for i in range(n)]
    if dim in (0, -2):
        return 19 * n, 45, ks
    return 37, 9 * n, ks


# ---------------------------------------------------------------------------
# the fused kernel
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_matches_float64(dtype, n, dim):
    M, N, ks = shape_for(n, dim)
    a, b = operands(n, M, N, ks, dtype, seed=n * 10 + dim)
    assert_matches(matmul_reduce_scatter(a, b, dim=dim), a, b, dim)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_avg(dtype, dim):
    M, N, ks = shape_for(3, dim)
    a, b = operands(3, M, N, ks, dtype, seed=7)
    assert_matches(matmul_reduce_scatter(a, b, dim=dim, op="avg"), a, b, dim, "avg")


@pytest.mark.parametrize("dim", [-2, -1])
def test_negative_dims(dim):
    M, N, ks = shape_for(2, dim)
    a, b = operands(2, M, N, ks, torch.float32, seed=3)
    assert_matches(matmul_reduce_scatter(a, b, dim=dim), a, b, dim % 2)


def test_op_spellings_from_torch_enums():
    M, N, ks = shape_for(2, 0)
    a, b = operands(2, M, N, ks, torch.float32, seed=4)
    assert_matches(matmul_reduce_scatter(a, b, 0, op="RedOpType.SUM"), a, b, 0)
    assert_matches(matmul_reduce_scatter(a, b, 0, op=1), a, b, 0, "avg")  # torch's RedOpType.AVG


def test_noncontiguous_activations_and_tiny_tiles():
    """a as column slices and a transposed view; 16x16x16 tiles so every dim spans many tiles."""
    g = torch.Generator().manual_seed(5)
    a = [torch.randn(40, 70, generator=g)[:, 3:53:2].to(DEV),        # [40, 25], strides (70, 2)
         torch.randn(31, 40, generator=g).t().to(DEV)]              # [40, 31], strides (1, 40)
    b = [torch.randn(33, 25, generator=g).t().to(DEV), torch.randn(31, 33, generator=g).to(DEV)]
    cfg = KernelConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1)
    assert_matches(matmul_reduce_scatter(a, b, dim=0, config=cfg), a, b, 0)
    b = [x[:, :32] for x in b]  # N = 32, divisible by 2
    assert_matches(matmul_reduce_scatter(a, b, dim=1, config=cfg), a, b, 1)


@pytest.mark.parametrize("split_k", [2, 3, 16])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("n", [1, 3])
def test_split_k_matches_float64(n, dim, split_k):
    """split-K: each program sums a run of the tile's K-steps over all participants (K_i of 45, 52,
    59: runs that cross participants and end inside one), the shares added by a second launch.
    16 splits of 3 to 12 steps leave some programs no steps (their share is zero)."""
    M, N, ks = shape_for(n, dim)
    a, b = operands(n, M, N, ks, torch.float32, seed=n * 10 + dim + split_k)
    cfg = KernelConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1, split_k=split_k)
    assert_matches(matmul_reduce_scatter(a, b, dim=dim, config=cfg), a, b, dim)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_split_k_avg_in_16_bit(dtype):
    """The shares stay float32; the sum is scaled (avg) and rounded to the dtype once."""
    M, N, ks = shape_for(2, 1)
    a, b = operands(2, M, N, ks, dtype, seed=11)
    cfg = KernelConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1, split_k=4)
    assert_matches(matmul_reduce_scatter(a, b, dim=1, op="avg", config=cfg), a, b, 1, "avg")


def test_split_k_is_one_more_launch_and_deterministic(monkeypatch):
    """split_k > 1: the shares' launch (grid axis 1 = the share) and one launch that adds them; the same
    inputs give bitwise the same outputs (the shares are added in a fixed order, no atomics)."""
    M, N, ks = shape_for(2, 0)
    a, b = operands(2, M, N, ks, torch.float32, seed=12)
    monkeypatch.setattr(mrs, "interpreting", lambda was=interpreting(): was)   # it looks at _mm_sum_kernel's type
    shares, sums = Launches(mrs._mm_sum_kernel), Launches(mrs._split_k_sum_kernel)
    monkeypatch.setattr(mrs, "_mm_sum_kernel", shares)
    monkeypatch.setattr(mrs, "_split_k_sum_kernel", sums)
    cfg = KernelConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1, split_k=4)
    first = matmul_reduce_scatter(a, b, dim=0, config=cfg)
    tiles = -(-M // 16) * -(-N // 16)
    assert shares.grids == [(tiles, 4)] and sums.grids == [(-(-M // 16), -(-N // 16))]
    again = matmul_reduce_scatter(a, b, dim=0, config=cfg)
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    matmul_reduce_scatter(a, b, dim=0, config=KernelConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1))
    assert shares.grids[-1] == (tiles, 1) and len(sums.grids) == 2                # no split: one launch


def test_outputs_are_fresh_chunks():
    a, b = operands(4, 8, 12, [16] * 4, torch.float32)
    outs = matmul_reduce_scatter(a, b, dim=0)
    assert [tuple(o.shape) for o in outs] == [(2, 12)] * 4
    ptrs = {o.data_ptr() for o in outs}
    assert len(ptrs) == 4 and not ptrs & {x.data_ptr() for x in a + b}
    outs[0].fill_(0)  # the chunks do not overlap
    exps, _ = expected(a, b, 0)
    for j, (o, e) in enumerate(zip(outs[1:], exps[1:]), 1):
        assert_close(o, e, rtol=1e-5, atol=1e-5, what=f"chunk {j}")


def test_zero_sized_output():
    a, b = operands(2, 0, 6, [5, 5], torch.float32)
    outs = matmul_reduce_scatter(a, b, dim=0)
    assert [tuple(o.shape) for o in outs] == [(0, 6), (0, 6)]


def test_launch_mm_sum_float32_output_into_a_row_block():
    """The CUDA path of the overlapped variants: one participant, float32 (or narrower) output
    written into a strided view."""
    a, b = operands(1, 21, 35, [40], torch.bfloat16, seed=9)
    out = torch.full((30, 35), float("nan"), dtype=torch.float32, device=DEV)
    launch_mm_sum(a, b, out[5:26])
    assert torch.isnan(out[:5]).all() and torch.isnan(out[26:]).all()
    exps, mags = expected(a, b, 0)
    # no output rounding: float32 accumulation only
    assert_close(out[5:26], exps[0], mags[0], rtol=0.0, atol=2e-6, dtype=torch.float32, what="out[5:26]")


# ---------------------------------------------------------------------------
# reference and overlapped variant
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_matches_float64(dtype, dim):
    M, N, ks = shape_for(4, dim)
    a, b = operands(4, M, N, ks, dtype, seed=11, device="cpu")
    assert_matches(matmul_reduce_scatter_reference(a, b, dim), a, b, dim)
    assert_matches(matmul_reduce_scatter_reference(a, b, dim, "avg"), a, b, dim, "avg")


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_overlapped_on_one_device_matches_float64(dtype, n, dim):
    M, N, ks = shape_for(n, dim)
    a, b = operands(n, M, N, ks, dtype, seed=13 + n, device="cpu")
    assert_matches(matmul_reduce_scatter_overlapped(a, b, dim=dim), a, b, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_overlapped_avg_and_transfer_dtype(dtype):
    M, N, ks = shape_for(3, 1)
    a, b = operands(3, M, N, ks, dtype, seed=17, device="cpu")
    assert_matches(matmul_reduce_scatter_overlapped(a, b, dim=1, op="avg"), a, b, 1, "avg")
    # partials travelling in the input dtype: one extra rounding per partial, i.e. up to half an
    # ulp of each partial: bounded by 2^-9 * sum_i |a_i||b_i| = 2^-9 * mag for bf16 (allow 2x)
    rtol, atol = tolerance(dtype)
    outs = matmul_reduce_scatter_overlapped(a, b, dim=1, transfer_dtype=dtype)
    assert_matches(outs, a, b, 1, tol=(rtol, atol if dtype == torch.float32 else 2 * 2**-9))


def test_overlapped_ring_order():
    """Participant i produces chunk (i+1) % n first and its own chunk last."""
    calls = []
    real = mrs.mm_f32

    def spy(x, y):
        calls.append((x.data_ptr(), y.data_ptr()))
        return real(x, y)

    n, cm = 3, 2  # chunk j of participant i's partial reads rows j*cm.. of a[i]
    a, b = operands(n, n * cm, 5, [4] * n, torch.float32, device="cpu")
    mrs.mm_f32 = spy
    try:
        matmul_reduce_scatter_overlapped(a, b, dim=0)
    finally:
        mrs.mm_f32 = real
    row_bytes = a[0].stride(0) * a[0].element_size()
    order = [[(ptr - a[i].data_ptr()) // (cm * row_bytes) for ptr, bp in calls if bp == b[i].data_ptr()]
             for i in range(n)]
    assert order == [[(i + s) % n for s in range(1, n + 1)] for i in range(n)]


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------

def _ok(n=2):
    return operands(n, 4, 6, [5] * n, torch.float32, device="cpu")


@pytest.mark.parametrize("fn", [matmul_reduce_scatter, matmul_reduce_scatter_overlapped,
                                matmul_reduce_scatter_reference])
def test_errors(fn):
    a, b = _ok()
    with pytest.raises(ValueError, match="len\\(b\\)"):
        fn(a, b[:1])
    with pytest.raises(ValueError, match="K_1"):
        fn(a, [b[0], b[1][:4]])
    with pytest.raises(ValueError, match="rows like a\\[0\\]"):
        fn([a[0], a[1][:2]], b)
    with pytest.raises(ValueError, match="columns like b\\[0\\]"):
        fn(a, [b[0], b[1][:, :3]])
    a3, b3 = _ok(3)  # M = 4, N = 6
    with pytest.raises(ValueError, match="dimension 0 \\(4\\) to be divisible by the group size 3"):
        fn(a3, b3, dim=0)
    a4, b4 = _ok(4)
    with pytest.raises(ValueError, match="dimension 1 \\(6\\) to be divisible by the group size 4"):
        fn(a4, b4, dim=1)
    with pytest.raises(ValueError, match="cannot be fused"):
        fn(a, b, op="max")
    with pytest.raises(ValueError, match="cannot be fused"):
        fn(a, b, op="min")
    with pytest.raises(ValueError, match="expected a reduce op"):
        fn(a, b, op="prod")
    with pytest.raises(ValueError, match="dim"):
        fn(a, b, dim=2)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        fn([x.double() for x in a], [x.double() for x in b])
    with pytest.raises(ValueError, match="dtype torch.float32 like a\\[0\\]"):
        fn(a, [b[0], b[1].half()])
    with pytest.raises(ValueError, match="1 <= n <= 8"):
        fn([], [])
    a9, b9 = _ok(9)
    with pytest.raises(ValueError, match="1 <= n <= 8"):
        fn(a9, b9)
    with pytest.raises(ValueError, match="list of tensors"):
        fn(a[0], b[0])
    with pytest.raises(ValueError, match="2-D"):
        fn([a[0][None]], [b[0]])


def test_fused_needs_one_device():
    a, b = _ok()
    with pytest.raises(ValueError, match="every tensor on"):
        matmul_reduce_scatter(a, [b[0], b[1].to("meta")])
    with pytest.raises(ValueError, match="a\\[1\\] and b\\[1\\] on one device"):
        matmul_reduce_scatter_overlapped(a, [b[0], b[1].to("meta")])


@pytest.mark.skipif(CUDA, reason="CPU tensors without the interpreter: only meaningful without CUDA")
def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setattr(mrs, "interpreting", lambda: False)
    a, b = _ok()
    with pytest.raises(KernelUnavailable, match="TRITON_INTERPRET=1"):
        matmul_reduce_scatter(a, b)


# ---------------------------------------------------------------------------
# launch heuristics
# ---------------------------------------------------------------------------

def test_interpreter_config_is_small():
    for M, N, K in ((5, 7, 9), (37, 45, 29), (8192, 4096, 4096)):
        cfg = pick_config(M, N, K, torch.bfloat16, "cpu")
        assert cfg.block_m in (16, 32) and cfg.block_n in (16, 32) and cfg.block_k in (16, 32)


def test_hopper_config_heuristic(monkeypatch):
    """The documented GPU rule, evaluated here with an H100's 132 SMs."""
    monkeypatch.setattr(mrs, "interpreting", lambda: False)
    monkeypatch.setattr(mrs, "_num_sms", lambda device: 132)
    big = pick_config(8192, 4096, 4096, torch.bfloat16, "cuda")
    assert (big.block_m, big.block_n, big.block_k, big.num_warps, big.num_stages) == (128, 256, 64, 8, 3)
    for M, bm in ((1, 16), (16, 16), (17, 32), (128, 128), (1024, 128)):
        cfg = pick_config(M, 4096, 4096, torch.float16, "cuda")
        assert cfg.block_m == bm
        tiles = -(-M // cfg.block_m) * -(-4096 // cfg.block_n)
        assert tiles >= 132 or cfg.block_n == 32, (M, cfg)
        smem = (cfg.block_m + cfg.block_n) * cfg.block_k * 2 * cfg.num_stages
        assert smem <= 227 * 1024, (M, cfg)  # fits an H100's shared memory per block
    f32 = pick_config(8192, 4096, 4096, torch.float32, "cuda")
    assert (f32.block_m, f32.block_n, f32.block_k) == (128, 128, 32)
    # fp32 decode sizes: 64-row tiles, 3 stages but for gather_cols (its 64x128 tile spills with 3)
    stages = {launcher: pick_config(16, 4096, 4096, torch.float32, "cuda", launcher=launcher, n=2).num_stages
              for launcher in ("mm_sum", "gather_rows", "gather_cols")}
    assert stages == {"mm_sum": 3, "gather_rows": 3, "gather_cols": 2}
    assert pick_config(1024, 4096, 4096, torch.float32, "cuda", launcher="gather_cols", n=2).num_stages == 3


def test_gather_rows_config_counts_every_output(monkeypatch):
    """all_gather_matmul (dim 0) computes its n outputs in one launch: the heuristic fills the SMs
    with the n outputs' tiles together, so at M 1024 and N_j 1024 (N = K 4096, n 4) it keeps
    128-column tiles where one output alone would be cut to 32 (4x the launches' A reads)."""
    monkeypatch.setattr(mrs, "interpreting", lambda: False)
    monkeypatch.setattr(mrs, "_num_sms", lambda device: 132)
    one = pick_config(1024, 1024, 4096, torch.bfloat16, "cuda", launcher="mm_sum", n=4)
    grouped = pick_config(1024, 1024, 4096, torch.bfloat16, "cuda", launcher="gather_rows", n=4)
    assert (one.block_m, one.block_n) == (128, 32)
    assert (grouped.block_m, grouped.block_n) == (128, 128)
    assert 4 * (1024 // 128) * (1024 // grouped.block_n) >= 132
    # n 1: one output, the same rule as mm_sum
    assert pick_config(1024, 1024, 4096, torch.bfloat16, "cuda", launcher="gather_rows", n=1) == one


def test_kernel_config_validation():
    with pytest.raises(ValueError, match="power of two >= 16"):
        KernelConfig(8, 32, 32)
    with pytest.raises(ValueError, match="power of two >= 16"):
        KernelConfig(32, 48, 32)
    for bad in (0, 17, 2.0, True):
        with pytest.raises(ValueError, match=f"^KernelConfig.split_k: expected an integer from 1 to 16, found {bad!r}"):
            KernelConfig(32, 32, 32, split_k=bad)


def test_interpreter_compat_fixes_only_a_broken_interpreter(monkeypatch):
    """Triton <= 3.6's interpreter converts its 1-element scalars with int(array), which numpy >= 2.4
    refuses: _triton_compat installs Triton 3.8's fix there (restored with the interpreter's own
    patches), and leaves a fixed interpreter, or a numpy that still converts, alone."""
    import numpy as np

    interpreter = pytest.importorskip("triton.runtime.interpreter")
    from fastpipe.kernels import _triton_compat

    class Scope:
        def __init__(self):
            self.changes = []

        def set_attr(self, obj, name, value):
            self.changes.append((obj, name, getattr(obj, name, None)))
            setattr(obj, name, value)

    def broken(tensor, scope):
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    class Handle:
        def __init__(self, data):
            self.data = data

    class T:
        def __init__(self, v):
            self.handle = Handle(np.array([v], dtype=np.int32))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", broken)
    monkeypatch.setattr(_triton_compat, "_numpy_refuses_1d_int", lambda: False)
    assert not _triton_compat.apply() and interpreter._patch_lang_tensor is broken   # numpy still converts
    monkeypatch.setattr(_triton_compat, "_numpy_refuses_1d_int", lambda: True)
    assert _triton_compat.apply()
    assert not _triton_compat.apply()                                                  # once
    scope = Scope()
    interpreter._patch_lang_tensor(T, scope)
    assert range(0, T(3)) == range(3)                       # __index__ of a 1-element array
    assert [name for _, name, _ in scope.changes] == ["__index__", "__index__"]       # restorable
    del T.__index__

    def fixed(tensor, scope):
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", fixed)
    assert not _triton_compat.apply() and interpreter._patch_lang_tensor is fixed     # Triton >= 3.8


# ---------------------------------------------------------------------------
# GPU scale (skipped without CUDA)
# ---------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("M", [16, 8192])
def test_gpu_scale_bf16(M, n, dim):
    """Real sizes: a[i]: [M, 4096], b[i] = w.t() or w: [4096, 4096], bf16. A GPU rounds fp32 -> bf16
    to nearest (half an ulp, 2^-8 relative): rtol 8e-3."""
    N, K = 4096, 4096
    a, b = operands(n, M, N, [K] * n, torch.bfloat16, seed=M + n, device="cuda")
    assert_matches(matmul_reduce_scatter(a, b, dim=dim), a, b, dim, tol=(8e-3, 1e-5))


@pytest.mark.cuda
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("split_k", [4, 16])
def test_gpu_split_k_bf16_and_in_a_captured_graph(split_k, dim):
    """split-K at a decode's M on the GPU, eagerly and replayed from a CUDA graph (the runtime's way:
    the shares' workspace then comes from the graph's pool)."""
    a, b = operands(2, 128, 4096, [4096, 4096], torch.bfloat16, seed=split_k + dim, device="cuda")
    cfg = KernelConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3, split_k=split_k)
    eager = matmul_reduce_scatter(a, b, dim=dim, config=cfg)
    assert_matches(eager, a, b, dim, tol=(8e-3, 1e-5))
    captured = replayed(lambda: matmul_reduce_scatter(a, b, dim=dim, config=cfg))
    assert all(torch.equal(x, y) for x, y in zip(captured, eager))   # the shares are added in a fixed order


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gpu_scale_other_dtypes(dtype):
    a, b = operands(2, 2048, 4096, [2048, 2048], dtype, seed=1, device="cuda")
    rtol = 1e-5 if dtype == torch.float32 else 1e-3
    assert_matches(matmul_reduce_scatter(a, b, dim=0), a, b, 0, tol=(rtol, 1e-5))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dim", [0, 1])
def test_overlapped_across_gpus(dim):
    n = min(torch.cuda.device_count(), 4)
    M, N, K = 2048, 4096, 1024
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(M, K, generator=g).bfloat16().to(f"cuda:{i}") for i in range(n)]
    b = [torch.randn(N, K, generator=g).bfloat16().to(f"cuda:{i}").t() for i in range(n)]
    outs = matmul_reduce_scatter_overlapped(a, b, dim=dim)
    assert [o.device for o in outs] == [x.device for x in a]
    torch.cuda.synchronize()
    assert_matches([o.to("cuda:0") for o in outs], [x.to("cuda:0") for x in a], [x.to("cuda:0") for x in b], dim,
                   tol=(8e-3, 1e-5))


# ---------------------------------------------------------------------------
# compiled for Hopper without a GPU
# ---------------------------------------------------------------------------

_COMPILE_FOR_SM90 = r'''
import sys
import torch
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class FakeDriver:  # enough of a driver for JITFunction.warmup: compile, never launch
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def get_device_interface(self): return torch.cuda
        def is_active(self): return True

    driver.set_active(FakeDriver())
except Exception as e:  # noqa: BLE001
    print(f"SKIP: this triton cannot compile without a GPU here: {type(e).__name__}: {e}")
    sys.exit(0)
from fastpipe.kernels.mm_reduce_scatter_kernel import _mm_sum_kernel
from fastpipe.kernels.all_gather_mm_kernel import _gather_rows_kernel

bf = torch.bfloat16
a = [torch.empty(4096, 1024, dtype=bf) for _ in range(2)]
b = [torch.empty(2048, 1024, dtype=bf).t() for _ in range(2)]  # w.t(): [K, N], strides (1, K)
out = torch.empty(2, 4096, 1024, dtype=bf)
blocks = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
k1 = _mm_sum_kernel.warmup(
    tuple(a), tuple(b), (1024, 1024), (1024, 1024), (1, 1), (1, 1), (1024, 1024), out, out, 4096, 2048, 1024, 1,
    1024, 4096 * 1024, 0.5, NPART=2, SPLIT_COLS=True, APPLY_SCALE=True, SPLIT_K=1, INPUT_PRECISION="ieee",
    DOT_F32=False, grid=(1,), **blocks)
ws = torch.empty(4 * 4096 * 2048, dtype=torch.float32)
k3 = _mm_sum_kernel.warmup(   # split-K 4: each program a quarter of the K-steps, float32 shares into ws
    tuple(a), tuple(b), (1024, 1024), (1024, 1024), (1, 1), (1, 1), (1024, 1024), out, ws, 4096, 2048, 1024, 1,
    1024, 4096 * 1024, 0.5, NPART=2, SPLIT_COLS=True, APPLY_SCALE=True, SPLIT_K=4, INPUT_PRECISION="ieee",
    DOT_F32=False, grid=(1, 4), **dict(blocks, BLOCK_N=128))
shards = [torch.empty(1000, 1024, dtype=bf) for _ in range(2)]
c = [torch.empty(2000, 2048, dtype=bf) for _ in range(2)]
k2 = _gather_rows_kernel.warmup(
    tuple(shards), (1024, 1024), (1, 1), tuple(b), (1, 1), (1024, 1024), tuple(c), (2048, 2048), (1, 1),
    (2048, 2048), c[0], 1000, 1024, 2048, NPART=2, SPLIT_K=1, SAME_SAK=True, SAME_OUT=True, ROW_ALIGN=16,
    INPUT_PRECISION="ieee", DOT_F32=False, grid=(1, 2, 1), **blocks)
ws2 = torch.empty(2 * 4 * 2000 * 2048, dtype=torch.float32)
k4 = _gather_rows_kernel.warmup(   # split-K 4: each (tile, output) program a quarter of the K-steps, into ws2
    tuple(shards), (1024, 1024), (1, 1), tuple(b), (1, 1), (1024, 1024), tuple(c), (2048, 2048), (1, 1),
    (2048, 2048), ws2, 1000, 1024, 2048, NPART=2, SPLIT_K=4, SAME_SAK=True, SAME_OUT=True, ROW_ALIGN=16,
    INPUT_PRECISION="ieee", DOT_F32=False, grid=(1, 2, 4), **dict(blocks, BLOCK_N=128))
for name, k in (("mm_sum", k1), ("gather_rows", k2), ("mm_sum_split_k", k3), ("gather_rows_split_k", k4)):
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    print(name, "wgmma" in ptx, ttgir.count("async_copy_global_to_local"), ttgir.count("tt.load "))
'''


@pytest.mark.slow
def test_kernels_compile_for_hopper_with_wgmma_and_pipelined_loads(tmp_path):
    """Compile (never launch) both kernels for sm_90 with Triton's own toolchain: the compiled
    path -- tuple arguments, the per-row shard select with its alignment hint -- is checked
    here, not only the interpreter. Both must use wgmma and load every operand tile with
    cp.async (no synchronous tt.load left: the pipeliner took every load)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    if run.stdout.startswith("SKIP:"):
        pytest.skip(run.stdout.strip())
    rows = [line.split() for line in run.stdout.strip().splitlines()]
    assert [r[0] for r in rows] == ["mm_sum", "gather_rows", "mm_sum_split_k", "gather_rows_split_k"], run.stdout
    for name, wgmma, async_copies, sync_loads in rows:
        assert wgmma == "True", f"{name}: no wgmma in the PTX"
        assert int(async_copies) >= 2 and int(sync_loads) == 0, f"{name}: loads not pipelined: {run.stdout}"
