"""bench.kernel_profile: a call's kernels from torch.profiler's trace, as per-run totals (the fused-kernel
bench's --profile). The arithmetic on hand-made traces; the profiler itself on CPU ops here, on a replayed CUDA
graph's kernels in the cuda test."""
from __future__ import annotations

import pytest
import torch

from bench import kernel_profile
from bench.kernel_profile import summarize


def _x(name, ts, dur, cat="kernel", tid=7):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_summarize_counts_device_work_per_run_and_the_time_it_covered():
    """Two runs: kernels a and b overlap (two streams) for 5 us, a copy follows; host events, instants and
    metadata are not device work."""
    events = [_x("a", 0, 10), _x("b", 5, 10, tid=8), _x("copy", 20, 2, cat="gpu_memcpy"),
              _x("cudaGraphLaunch", 0, 30, cat="cuda_runtime"), _x("aten::mm", 0, 30, cat="cpu_op"),
              {"ph": "i", "cat": "kernel", "name": "mark", "ts": 1}, {"ph": "M", "name": "process_name"}]
    p = summarize(events, runs=2, gpu=True)
    assert p["runs"] == 2 and p["events"] == "kernel"
    assert p["busy_us"] == (10 + 10 + 2) / 2                  # durations summed, per run
    assert p["covered_us"] == (15 + 2) / 2                    # [0, 15) and [20, 22): the overlap counted once
    assert p["launched"] == 3 / 2
    assert p["kernels"] == [{"name": "a", "count": 0.5, "us": 5.0}, {"name": "b", "count": 0.5, "us": 5.0},
                            {"name": "copy", "count": 0.5, "us": 1.0}]
    assert [k["name"] for k in summarize(events, 2, True, top=1)["kernels"]] == ["a"]
    assert summarize([_x("k", 0, 4), _x("k", 4, 4)], 1, True)["covered_us"] == 8   # touching, not overlapping
    assert summarize([_x("k", 0, 4, cat="Kernel"), _x("c", 5, 1, cat="Memcpy")], 1, True)["launched"] == 2  # older


def test_a_trace_without_device_work_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match=r"^kernel_profile: the trace has no device work \(its categories: "
                                         r"cpu_op, cuda_runtime\)$"):
        summarize([_x("aten::mm", 0, 3, cat="cpu_op"), _x("cudaGraphLaunch", 0, 2, cat="cuda_runtime")], 1, True)


def test_summarize_on_cpu_takes_each_threads_outermost_ops():
    """On CPU the events are torch ops, nested in their callers: only those at the top of a thread's stack count
    (a child inside its parent is not time added), each thread on its own."""
    events = [_x("parent", 0, 10, cat="cpu_op"), _x("child", 2, 3, cat="cpu_op"),
              _x("next", 10, 4, cat="cpu_op"), _x("other thread", 3, 1, cat="cpu_op", tid=9),
              _x("a kernel", 0, 50)]
    p = summarize(events, runs=1, gpu=False)
    assert p["events"] == "cpu_op" and p["launched"] == 3
    assert sorted(k["name"] for k in p["kernels"]) == ["next", "other thread", "parent"]
    assert p["busy_us"] == 15 and p["covered_us"] == 14


def test_profile_on_cpu_sees_every_op_of_each_run():
    a = torch.randn(32, 32)

    def fn():
        return [torch.mm(a, a) for _ in range(3)]

    p = kernel_profile.profile(fn, "cpu", runs=4)
    mm = next(k for k in p["kernels"] if k["name"] == "aten::mm")
    assert p["runs"] == 4 and mm["count"] == 3 and mm["us"] > 0
    assert p["launched"] >= 3 and 0 < p["covered_us"] <= p["busy_us"] * (1 + 1e-9)


def test_line_says_what_ran_and_what_failed():
    p = summarize([_x("_mm_sum_kernel", 0, 40), _x("_mm_sum_kernel", 50, 42)], runs=2, gpu=True)
    assert kernel_profile.line("fused", p, 0.05) == ("fused: 1 kernel/run, 41.0 us busy, 41.0 us covered, 82% of its "
                                                     "50.0 us (_mm_sum_kernel 41.0)")
    assert kernel_profile.line("unfused", {"error": "RuntimeError: CUPTI"}) == "unfused: not profiled (RuntimeError: CUPTI)"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_profile_of_a_replayed_graph_sees_its_kernels():
    """On the GPU: the kernels of a replayed CUDA graph appear in the trace (CUPTI), one GEMM's at least, and the
    unfused members forked onto their own streams inside a graph are covered no longer than they are busy."""
    from fastpipe.runtime.tuning import unfused_path
    from fastpipe.runtime.tuning.kernel_timing import capture_after_first_run

    dev = torch.device("cuda:0")
    a = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    graph, _ = capture_after_first_run(lambda: torch.mm(a, a), dev)
    try:
        p = kernel_profile.profile(graph.replay, dev, runs=5)
    finally:
        graph.reset()
    assert p["events"] == "kernel" and p["launched"] >= 1 and p["busy_us"] > 0, p
    assert 0 < p["covered_us"] <= p["busy_us"] * (1 + 1e-9)
    xs = [torch.randn(256, 512, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    ws = [torch.randn(512, 512, device=dev, dtype=torch.bfloat16).t() for _ in range(2)]
    lanes = unfused_path.lanes_for(dev, 2)
    graph, _ = capture_after_first_run(lambda: unfused_path.matmul_then_reduce_scatter(xs, ws, 0, "sum", lanes), dev)
    try:
        p = kernel_profile.profile(graph.replay, dev, runs=5)
    finally:
        graph.reset()
    assert p["launched"] >= 3 and 0 < p["covered_us"] <= p["busy_us"] * (1 + 1e-9), p     # 2 GEMMs + the fold
