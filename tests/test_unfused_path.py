"""fastpipe.runtime.tuning.unfused_path: the runtime's unfused path for a fusable call (the baseline the bench and
`fastpipe tune` time the fused kernels against) computes what the fused kernel does, checked against plain
float32 torch; and KernelCall.rule_shape names the whole product as fastpipe.kernels.fusion_rule measures it."""
import pytest
import torch

from fastpipe.kernels.calls import KernelCall
from fastpipe.runtime.tuning import unfused_path


def _randn(*shape, g):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(torch.bfloat16)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_matmul_then_reduce_scatter_is_the_chunked_reduction(dim, op):
    g = torch.Generator().manual_seed(0)
    n, M, K, N = 2, 8, 16, 12
    a = [_randn(M, K, g=g) for _ in range(n)]
    b = [_randn(N, K, g=g).t() for _ in range(n)]                 # a weight read as w.t()
    call = KernelCall.of("matmul_reduce_scatter", a, b, dim, op)
    got = unfused_path.run_unfused(call, a, b)
    full = sum(x.float() @ y.float() for x, y in zip(a, b)) / (n if op == "avg" else 1)
    want = torch.chunk(full, n, dim)
    assert [tuple(t.shape) for t in got] == [tuple(w.shape) for w in want] and got[0].dtype == torch.bfloat16
    for t, w in zip(got, want):
        # partials rounded to bf16 by torch.mm, then a float32 fold and one rounding: about 3 roundings
        torch.testing.assert_close(t.float(), w, rtol=3 * 2 ** -8, atol=3 * 2 ** -8 * K ** 0.5)
    assert call.rule_shape() == (M, N, n * K, n)


@pytest.mark.parametrize("dim", [0, 1])
def test_all_gather_then_matmul_is_each_weight_times_the_gathered_input(dim):
    g = torch.Generator().manual_seed(1)
    n, M, K, widths = 2, 8, 16, (6, 10)
    a = [_randn(M // n, K, g=g) if dim == 0 else _randn(M, K // n, g=g) for _ in range(n)]
    b = [_randn(w, K, g=g).t() for w in widths]
    call = KernelCall.of("all_gather_matmul", a, b, dim)
    got = unfused_path.run_unfused(call, a, b)
    full = torch.cat(a, dim).float()
    for t, bj in zip(got, b):
        torch.testing.assert_close(t.float(), full @ bj.float(), rtol=2 ** -7, atol=2 ** -7 * K ** 0.5)
    assert call.rule_shape() == (M, sum(widths), K, n)          # the whole [M, K] @ [K, N]


def test_lanes_fork_and_join_only_the_members_own(monkeypatch):
    """n members on n of the lanes: a lane not forked from the capture stream must not be joined
    (its event would lie outside the capture and invalidate it)."""
    import contextlib

    log = []

    class Lane:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append((self.name, "waits", other.name))

    cur = Lane("capture")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: cur)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    lanes = [Lane(f"lane{i}") for i in range(4)]
    assert unfused_path.on_lanes([lambda: 1, lambda: 2], lanes) == [1, 2]
    assert log == [("lane0", "waits", "capture"), ("lane1", "waits", "capture"),
                   ("capture", "waits", "lane0"), ("capture", "waits", "lane1")]
    ran = []                                     # no lanes (CPU): one after another, here
    assert unfused_path.on_lanes([lambda i=i: ran.append(i) or i for i in range(3)], None) == [0, 1, 2]
    assert ran == [0, 1, 2] and unfused_path.lanes_for("cpu", 2) is None
