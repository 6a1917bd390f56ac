"""Each comm kind by message size (the plain-torch reference and the cpu processor's rendezvous), n=2."""
import pytest
import torch

from fastpipe import comm

SIZES = [2**10, 2**14, 2**18, 2**20]
CPU = [torch.device("cpu")] * 2


def _xs(numel):
    g = torch.Generator().manual_seed(numel)
    return [torch.randn(numel // 64, 64, generator=g) for _ in range(2)]


KINDS = {
    "all_reduce": lambda xs: comm.all_reduce(xs, "sum", CPU),
    "all_gather": lambda xs: comm.all_gather(xs, 0, CPU),
    "reduce_scatter": lambda xs: comm.reduce_scatter(xs, "sum", 0, CPU),
    "all_to_all": lambda xs: comm.all_to_all(xs, 0, 1, CPU),
    "reduce": lambda xs: [comm.reduce(xs, "sum", 0, CPU)],
    "gather": lambda xs: [comm.gather(xs, 0, 0, CPU)],
    "broadcast": lambda xs: comm.broadcast(xs[0], 0, CPU),
    "send_recv": lambda xs: [comm.send_recv(xs[0], CPU[1])],
}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_comm(benchmark, record, kind, size):
    benchmark.group = f"comm {kind}"
    xs = _xs(size)
    out = benchmark(KINDS[kind], xs)
    assert all(torch.isfinite(o).all() for o in out)
    if kind == "all_reduce":
        torch.testing.assert_close(out[0], xs[0] + xs[1])
    record(variant=f"reference {kind}", size=size, bytes=4 * size)
