"""Where a call's time goes on the device: the kernels a few runs of it launch, from torch.profiler's trace
(CUPTI on a GPU: a replayed CUDA graph's kernels appear one by one). The fused-kernel bench's --profile
puts one beside each variant's time, so a target missed (fused slower than the unfused path, or under 70%
of torch.mm) comes with what ran instead: one fused kernel's own time, or the unfused path's GEMMs and
collective kernels and how much they overlapped on their streams.

    profile(fn, device, runs=5) -> {"runs": 5, "events": "kernel", "busy_us": .., "covered_us": ..,
                                    "launched": .., "kernels": [{"name", "count", "us"}, ...]}

Per run (the trace's totals over ``runs``): ``busy_us`` is the kernels' durations summed, ``covered_us`` the
time at least one of them ran (their intervals' union: below busy_us where streams overlapped), ``launched``
how many ran, and ``kernels`` the ``top`` names by time (count and us per run; names cut to 80 characters).
Set beside the call's measured time, covered_us says how much of it the device was busy; the rest is
launch gaps and waits. On CPU (the tests; the Triton interpreter) the events are the torch ops at the top of
each thread's stack, nested ops counted in their parents: the same arithmetic, of host time.
"""
from __future__ import annotations

import json
import os
import tempfile

import torch

# kineto's trace categories of device work (compared in lower case; "memcpy"/"memset": older kinetos' names)
GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset")


def profile(fn, device, runs: int = 5, top: int = 6) -> dict:
    """fn run ``runs`` times under torch.profiler (after one run outside it), its trace summarized (``summarize``)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device = torch.device(device)
    gpu = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if gpu else (lambda: None)
    fn()
    sync()
    with torch_profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(runs):
            fn()
        sync()
    fd, path = tempfile.mkstemp(suffix=".json", prefix="fastpipe-profile-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    return summarize(events, runs, gpu, top)


def summarize(events: list[dict], runs: int, gpu: bool, top: int = 6) -> dict:
    """A chrome trace's complete events ("ph": "X") of device work (``GPU_EVENTS``), or on CPU its outermost
    torch ops per thread, as per-run totals (module docstring). ValueError where there are none: a profile of
    nothing is not a profile of a call that took no time."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and
             (str(e.get("cat", "")).lower() in GPU_EVENTS if gpu else e.get("cat") == "cpu_op")]
    if not spans:
        seen = sorted({str(e["cat"]) for e in events if "cat" in e})
        raise ValueError(f"kernel_profile: the trace has no {'device work' if gpu else 'torch op'} (its categories: "
                         f"{', '.join(seen) or 'none'})")
    if not gpu:
        spans = _outermost(spans)
    by_name: dict[str, list] = {}
    for e in spans:
        t = by_name.setdefault(str(e.get("name", "?"))[:80], [0, 0.0])
        t[0] += 1
        t[1] += float(e["dur"])
    kernels = sorted(({"name": k, "count": c / runs, "us": us / runs} for k, (c, us) in by_name.items()),
                     key=lambda k: (-k["us"], k["name"]))
    return {"runs": runs, "events": "kernel" if gpu else "cpu_op",
            "busy_us": sum(float(e["dur"]) for e in spans) / runs,
            "covered_us": _union([(float(e["ts"]), float(e["dur"])) for e in spans]) / runs,
            "launched": len(spans) / runs, "kernels": kernels[:top]}


def _outermost(spans: list[dict]) -> list[dict]:
    """The spans no other span of the same thread contains."""
    out = []
    for tid in {(e.get("pid"), e.get("tid")) for e in spans}:
        end = None
        for e in sorted((e for e in spans if (e.get("pid"), e.get("tid")) == tid),
                        key=lambda e: (float(e["ts"]), -float(e["dur"]))):
            if end is None or float(e["ts"]) >= end:
                out.append(e)
                end = float(e["ts"]) + float(e["dur"])
    return out


def _union(spans: list[tuple[float, float]]) -> float:
    """The length of the union of intervals given as (start, duration), measured from the earliest start: a trace's
    timestamps are microseconds since boot, too large for an end less a start to keep a duration's last digits."""
    t0 = min((s for s, _ in spans), default=0.0)
    total, end = 0.0, None
    for s, d in sorted((s - t0, d) for s, d in spans):
        if end is None or s > end:
            total += d
            end = s + d
        elif s + d > end:
            total += s + d - end
            end = s + d
    return total


def line(name: str, p: dict, measured_ms: float | None = None) -> str:
    """One variant's profile in a few words: `fused: 1 kernel/run, 41.2 us busy (_mm_sum_kernel 41.2)`,
    with the measured time's share the device was covered where it is given."""
    if "error" in p:
        return f"{name}: not profiled ({p['error']})"
    names = ", ".join(f"{k['name'][:32]} {k['us']:.1f}" + (f" x{k['count']:g}" if k["count"] != 1 else "")
                      for k in p["kernels"][:3])
    share = (f", {p['covered_us'] / (measured_ms * 1e3):.0%} of its {measured_ms * 1e3:.1f} us"
             if measured_ms else "")
    return (f"{name}: {p['launched']:g} {p['events']}/run, {p['busy_us']:.1f} us busy, {p['covered_us']:.1f} us "
            f"covered{share} ({names})")
