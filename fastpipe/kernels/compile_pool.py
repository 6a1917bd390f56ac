"""Compile the kernels a tuning will call, in parallel processes, before it times them.

A tuning (``fastpipe tune``; ``bench/bench_fused_kernels.py --tune``) calls a fused kernel under every
candidate config, and each first call of a config compiles it (Triton: TTIR to cubin, then its launcher
stub): most of a second of one CPU core per kernel, some 20 to 40 candidates a call shape, about 120
distinct kernels over the bench's tune stage, while the GPU waits. So the tuning first makes each
(call, config)'s first call in a pool of spawned worker processes, on the GPU, with fresh operands of
the call's shapes and strides (``KernelCall.operands``): Triton writes each compiled kernel (and
launcher) to its on-disk cache, keyed by the source, the target, the options and the arguments'
specialization (16-byte alignment, divisibility by 16), which are the same when the tuning makes the
same call in the main process, so that call reads the cache instead of compiling.

    results = warm([Task(call, cfg) for ...], workers=14, timeout_s=300)

The warm-up changes no result: a config that fails in a worker is reported and then fails (or is
skipped) in the tuning as before; a worker that cannot start, or a pool past its time, ends the
warm-up with the reason and the tuning compiles what is left itself. Work is split by unit
(launcher, n, dtype, config): a unit's calls go to one worker, one after another, so a kernel is
compiled once (its other calls hit the in-memory cache) and no two workers compile it.
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import time
from dataclasses import dataclass

import torch

from fastpipe.kernels.calls import KernelCall
from fastpipe.kernels.launch_config import KernelConfig


@dataclass(frozen=True, order=True)
class Task:
    """One first call: a recorded (or described) call and the config, as sorted (field, value) pairs."""

    call: KernelCall
    config: tuple

    @property
    def unit(self) -> tuple:
        launcher, _, _, _, n = self.call.launch()
        return launcher, n, self.call.dtype, self.config

    def size(self) -> int:
        return sum(math.prod(s) for s, _ in self.call.a + self.call.b)

    def text(self) -> str:
        return f"{self.call.text()} {KernelConfig(**dict(self.config)).text()}"


def task(call: KernelCall, cfg: KernelConfig) -> Task:
    return Task(call, tuple(sorted(dataclasses.asdict(cfg).items())))


def default_workers(device: torch.device) -> int:
    """On a GPU, one process per core but two (at most 14); none with a core or two (the tuning then
    compiles each config itself), and none on CPU (the interpreter compiles nothing)."""
    cores = os.cpu_count() or 1
    return min(14, cores - 2) if device.type == "cuda" and cores > 3 else 0


def split(tasks: list[Task], workers: int) -> list[list[Task]]:
    """The tasks in at most ``workers`` chunks: each unit whole in one chunk, units dealt out in turn by
    size (largest first) to the chunk with the fewest tasks; within a chunk the calls run smallest first
    (a unit's first call compiles, at the smallest operands), the same call's configs together."""
    units: dict[tuple, list[Task]] = {}
    for t in dict.fromkeys(tasks):
        units.setdefault(t.unit, []).append(t)
    chunks: list[list[Task]] = [[] for _ in range(max(1, min(workers, len(units))))]
    for unit in sorted(units.values(), key=len, reverse=True):
        min(chunks, key=len).extend(unit)
    for c in chunks:
        c.sort(key=lambda t: (t.size(), t.call))
    return [c for c in chunks if c]


def warm(tasks: list[Task], workers: int, timeout_s: float) -> dict:
    """Run every task's first call in ``workers`` spawned processes; returns what a result file records:
    {"workers", "tasks", "units", "s", "failed": ["<task>: <error>"], "error": why it ended early (absent
    when it did not)}."""
    chunks = split(tasks, workers)
    out = {"workers": len(chunks), "tasks": sum(map(len, chunks)), "units": len({t.unit for t in tasks}),
           "failed": []}
    t0 = time.perf_counter()
    if chunks:
        pool = None
        try:
            pool = multiprocessing.get_context("spawn").Pool(len(chunks))   # CUDA cannot be used in a fork
            res = pool.map_async(first_calls, chunks, chunksize=1)
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


def first_calls(tasks: list[Task]) -> list[str]:
    """In a worker: each task's call once, on fresh operands of its shapes and strides (so the arguments'
    specialization, and Triton's cache key, are the tuning's); the failures, as text."""
    torch.set_num_threads(1)                          # the workers share the cores
    failed, made, current = [], None, None
    for t in tasks:
        if t.call != current:
            current, made = t.call, None
            device = torch.device(t.call.device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            try:
                made = t.call.operands()
            except Exception as e:  # noqa: BLE001 - out of memory, say: this call's tasks fail, the rest go on
                made = f"making the operands: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
        if isinstance(made, str):
            failed.append(f"{t.text()}: {made}")
            continue
        try:
            t.call.run(*made, KernelConfig(**dict(t.config)))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - reported; the tuning meets the same error and records it
            failed.append(f"{t.text()}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    return failed
