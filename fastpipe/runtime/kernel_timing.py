"""Timing a kernel call as the runtime runs it: a replayed CUDA graph (``fastpipe tune``, the fused-kernel
bench's --tune). Here, not in fastpipe.kernels, because it captures through fastpipe.runtime.cuda_capture."""
from __future__ import annotations

import statistics
import time

import torch


def replay_ms(fn, device: torch.device, quick: bool) -> tuple[float, str]:
    """fn's median time (ms) as a replayed CUDA graph (``capture_after_first_run``; triton's do_bench, L2
    flushed between runs; quick: a short run), or eagerly where the capture fails (the second value says
    why); on CPU, the median of 3 eager runs."""
    if device.type != "cuda":
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts), "eager (CPU)"
    from triton.testing import do_bench

    warmup, rep = (5, 20) if quick else (25, 100)
    try:
        graph, _ = capture_after_first_run(fn, device)
    except Exception as e:  # noqa: BLE001 - said in the result, never silent
        torch.cuda.synchronize(device)
        return (do_bench(fn, warmup=warmup, rep=rep, return_mode="median"),
                f"eager: capture failed: {type(e).__name__}: {' '.join(str(e).split())}"[:200])
    try:
        return do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median"), "graph"
    finally:
        graph.reset()


def capture_after_first_run(fn, device: torch.device):
    """fn captured as one CUDA graph: (graph, the outputs its replays rewrite). fn runs once first on a side
    stream (Triton compiles, the allocator settles), as CUDA graphs need; the capture is the runtime's own
    (fastpipe.runtime.cuda_capture: a failed one raises, leaving the stream and allocator as they were)."""
    from fastpipe.runtime.cuda_capture import capture

    device = torch.device(device)
    if device.index is None:                      # one capture stream per device, keyed by its name
        device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    return capture(fn, device)


def time_config(config, fn, device: torch.device, quick: bool) -> tuple[float, str]:
    """fastpipe.kernels.autotune.tune's timer: fn (the call under ``config``) timed by ``replay_ms``."""
    return replay_ms(fn, device, quick)
