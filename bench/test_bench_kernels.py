"""The fused kernels vs the unfused path (torch.mm per participant, then reduce and split). GPU only:
under the CPU interpreter the timings mean nothing (bench/bench_fused_kernels.py has the full grid)."""
import pytest
import torch

from fastpipe.kernels import matmul_reduce_scatter, matmul_reduce_scatter_reference
from tests.tensor_compare import assert_close


@pytest.mark.cuda
@pytest.mark.parametrize("m", [128, 1024, 8192])
@pytest.mark.parametrize("variant", ["unfused", "fused"])
def test_matmul_reduce_scatter(benchmark, record, variant, m):
    benchmark.group = f"matmul_reduce_scatter M={m}"
    n, k, nn = 4, 4096, 4096
    a = [torch.randn(m, k // n, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    b = [torch.randn(k // n, nn, device="cuda", dtype=torch.bfloat16) for _ in range(n)]

    def unfused():
        return list(torch.stack([x @ y for x, y in zip(a, b)]).sum(0).chunk(n))

    fn = unfused if variant == "unfused" else (lambda: matmul_reduce_scatter(a, b))
    out = benchmark(lambda: (fn(), torch.cuda.synchronize())[0])
    ref = matmul_reduce_scatter_reference(a, b)
    for j, (o, r) in enumerate(zip(out, ref)):
        assert_close(o, r, rtol=2e-2, atol=2e-1, what=f"chunk {j}")
    record(variant=variant, size=m)
