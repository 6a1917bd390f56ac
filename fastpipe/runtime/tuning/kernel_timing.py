"""Timing a kernel call as the runtime runs it: a replayed CUDA graph (``fastpipe tune``, the fused-kernel
bench's --tune). Here, not in fastpipe.kernels, because it captures through fastpipe.runtime.cuda.capture."""
from __future__ import annotations

import statistics
import time

import torch


def replay_ms(fn, device: torch.device, quick: bool) -> tuple[float, str]:
    """fn's median time (ms) as a replayed CUDA graph and how it was timed (``replay_stats``)."""
    med, _, _, timing = replay_stats(fn, device, quick)
    return med, timing


def replay_stats(fn, device: torch.device, quick: bool = False) -> tuple[float, float, float, str]:
    """(median, p20, p80) of fn's time in ms as a replayed CUDA graph (``capture_after_first_run``, then
    ``timed``), or eagerly where the capture fails (the fourth value says why); on CPU, ``timed`` eagerly."""
    if device.type != "cuda":
        return (*timed(fn, device, quick), "eager (CPU)")
    try:
        graph, _ = capture_after_first_run(fn, device)
    except Exception as e:  # noqa: BLE001 - said in the result, never silent
        torch.cuda.synchronize(device)
        return (*timed(fn, device, quick),
                f"eager: capture failed: {type(e).__name__}: {' '.join(str(e).split())}"[:200])
    try:
        return (*timed(graph.replay, device, quick), "graph")
    finally:
        graph.reset()


def timed(fn, device: torch.device, quick: bool = False) -> tuple[float, float, float]:
    """(median, p20, p80) of fn's time in ms, as fn runs: on a GPU triton's do_bench (L2 flushed between runs;
    quick: a short run), on CPU the median (min, max) of 3 runs."""
    if device.type != "cuda":
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts), min(ts), max(ts)
    from triton.testing import do_bench

    warmup, rep = (5, 20) if quick else (25, 100)
    med, p20, p80 = do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return med, p20, p80


def capture_after_first_run(fn, device: torch.device):
    """fn captured as one CUDA graph: (graph, the outputs its replays rewrite). fn runs once first on a side
    stream (Triton compiles, the allocator settles), as CUDA graphs need; the capture is the runtime's own
    (fastpipe.runtime.cuda.capture: a failed one raises, leaving the stream and allocator as they were)."""
    from fastpipe.runtime.cuda.capture import capture

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


def fusion_point(call, config, date: str, stats=None) -> dict:
    """fastpipe.kernels.fusion_rule's point for one recorded fused-kernel call (fastpipe.kernels.calls.KernelCall)
    on its device, for the tuned table's "fusion" list: the fused kernel under ``config`` (None: pick_config's)
    against the runtime's unfused path (fastpipe.runtime.tuning.unfused_path, each member on its own stream), on the
    same fresh operands, each timed by ``stats`` (default ``replay_stats``: replayed CUDA graphs)."""
    from fastpipe.kernels.fusion_rule import KERNEL_REVISIONS, fused_wins, table_device
    from fastpipe.runtime.tuning import unfused_path

    stats = stats or replay_stats
    device = torch.device(call.device)
    a, b = call.operands()
    lanes = unfused_path.lanes_for(device, len(a))
    f = stats(lambda: call.run(a, b, config), device)
    u = stats(lambda: unfused_path.run_unfused(call, a, b, lanes), device)
    M, N, K_total, n = call.rule_shape()
    times = {f"{v}_{q}": round(t, 5) for v, ts in (("fused", f), ("unfused", u)) for q, t in zip(("ms", "p20", "p80"), ts)}
    return {"device": table_device(device), "kernel": call.kernel, "dim": call.dim, "dtype": call.dtype,
            "M": M, "N": N, "K_total": K_total, "n": n, "speedup": round(u[0] / f[0], 3) if f[0] > 0 else 1.0,
            "fused_wins": fused_wins(times), "revision": KERNEL_REVISIONS[call.kernel], "date": date,
            "config": config.text() if config is not None else "pick_config's", **times,
            "timing": f[3] if f[3] == u[3] else f"fused: {f[3]}; unfused: {u[3]}"}
