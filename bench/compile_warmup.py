"""Compile --tune's candidate kernels in parallel processes before the tuning times them.

bench_fused_kernels.py --tune calls the fused kernel under every candidate config, and each first
call of a config compiles it (Triton: TTIR to cubin, then its launcher stub): most of a second of one
CPU core per kernel, about 120 distinct kernels over the tune stage's grid, while the GPU waits. Device
time is the scarce resource (15 minutes a session), and the GPU machine has 16 cores. So the stage
first makes each config's first call in a pool of spawned worker processes, on the GPU, with the
cases' own operands: Triton writes each compiled kernel (and launcher) to its on-disk cache, keyed by
the source, the target, the options and the arguments' specialization (16-byte alignment, divisibility
by 16), which are the same when the tuning makes the same call in the main process, so that call reads
the cache instead of compiling. The tuned rows' ``first_calls_s`` (the summed first calls of their
candidates) shows what was left to compile.

The warm-up changes no result: a config that fails in a worker is reported and then fails (or is
skipped) in the tuning as before; a worker that cannot start, or a pool past its time, ends the
warm-up with the reason and the tuning compiles what is left itself.

Work is split by unit, (launcher, n, config): a unit's cases go to one worker, one after another, so
a kernel is compiled once (its other cases hit the in-memory cache) and no two workers compile it.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True, order=True)
class Task:
    """One first call: the case (kernel, M, N = K, n) and the candidate config, as a dict (pickled)."""

    kernel: str
    M: int
    NK: int
    n: int
    launcher: str
    config: tuple          # sorted (field, value) pairs of a KernelConfig

    @property
    def unit(self) -> tuple:
        return self.launcher, self.n, self.config

    def text(self) -> str:
        from fastpipe.kernels import KernelConfig

        return f"{self.kernel} M={self.M} N=K={self.NK} n={self.n} {KernelConfig(**dict(self.config)).text()}"


def task(kernel: str, M: int, NK: int, n: int, launcher: str, cfg) -> Task:
    return Task(kernel, M, NK, n, launcher, tuple(sorted(dataclasses.asdict(cfg).items())))


def split(tasks: list[Task], workers: int) -> list[list[Task]]:
    """The tasks in at most ``workers`` chunks: each unit whole in one chunk, units dealt out in turn by
    size (largest first) to the chunk with the fewest tasks; within a chunk the cases run smallest first
    (a unit's first call compiles, at the smallest operands), the same case's configs together."""
    units: dict[tuple, list[Task]] = {}
    for t in dict.fromkeys(tasks):
        units.setdefault(t.unit, []).append(t)
    chunks: list[list[Task]] = [[] for _ in range(max(1, min(workers, len(units))))]
    for unit in sorted(units.values(), key=len, reverse=True):
        min(chunks, key=len).extend(unit)
    for c in chunks:
        c.sort(key=lambda t: (t.M * t.NK, t.kernel, t.M, t.NK, t.n))
    return [c for c in chunks if c]


def warm(tasks: list[Task], workers: int, dim: int, dtype: torch.dtype, device: torch.device,
         timeout_s: float) -> dict:
    """Run every task's first call in ``workers`` spawned processes; returns what the JSON records:
    {"workers", "tasks", "units", "s", "failed": ["<task>: <error>"], "error": why it ended early (absent
    when it did not)}."""
    chunks = split(tasks, workers)
    out = {"workers": len(chunks), "tasks": sum(map(len, chunks)), "units": len({t.unit for t in tasks}),
           "failed": []}
    t0 = time.perf_counter()
    if chunks:
        dtype_name = str(dtype).replace("torch.", "")
        pool = None
        try:
            pool = multiprocessing.get_context("spawn").Pool(len(chunks))   # CUDA cannot be used in a fork
            res = pool.starmap_async(first_calls, [(c, dim, dtype_name, device.type) for c in chunks])
            for failed in res.get(timeout=max(1.0, timeout_s)):
                out["failed"].extend(failed)
            pool.close()
        except multiprocessing.TimeoutError:
            out["error"] = f"not done after {timeout_s:.0f} s: stopped; the tuning compiles what is left"
        except Exception as e:  # noqa: BLE001 - a pool that fails leaves the tuning to compile as before
            out["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
    out["s"] = round(time.perf_counter() - t0, 2)
    return out


def first_calls(tasks: list[Task], dim: int, dtype_name: str, device_type: str) -> list[str]:
    """In a worker: each task's fused call once, on that case's operands (made as the tuning makes them,
    so the arguments' specialization, and Triton's cache key, are the tuning's); the failures, as text."""
    from bench.bench_fused_kernels import make_agm, make_mrs
    from fastpipe.kernels import KernelConfig, all_gather_matmul, matmul_reduce_scatter

    torch.set_num_threads(1)                          # the workers share the cores
    dtype = getattr(torch, dtype_name)
    device = torch.device(device_type)
    failed, made, key = [], None, None
    for t in tasks:
        if (t.kernel, t.M, t.NK, t.n) != key:
            key, made = (t.kernel, t.M, t.NK, t.n), None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            try:
                made = make_mrs(t.M, t.NK, t.n, dtype, device) if t.kernel == "matmul_reduce_scatter" else \
                    make_agm(t.M, t.NK, t.n, dim, dtype, device)
            except Exception as e:  # noqa: BLE001 - out of memory, say: this case's tasks fail, the rest go on
                made = f"making the operands: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
        if isinstance(made, str):
            failed.append(f"{t.text()}: {made}")
            continue
        a, b = made
        fused = matmul_reduce_scatter if t.kernel == "matmul_reduce_scatter" else all_gather_matmul
        try:
            fused(a, b, dim=dim, config=KernelConfig(**dict(t.config)))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - reported; the tuning meets the same error and records it
            failed.append(f"{t.text()}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    return failed
