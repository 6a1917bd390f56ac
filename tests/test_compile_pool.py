"""fastpipe.kernels.compile_pool: a tuning's candidate kernels compiled in parallel processes first. How the
work is split, that the workers make every first call and report failures, that a pool past its time
is stopped, and on a GPU that the main process's same call then reads Triton's cache (compiles nothing)."""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from bench.bench_fused_kernels import case_call, make_agm, make_mrs, warmup_tasks
from fastpipe.kernels import KernelConfig, compile_pool, mm_sum_tma
from tests.examples import ROOT

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
TINY = KernelConfig(16, 16, 16, group_m=4, num_warps=4, num_stages=1)


def _task(kernel="matmul_reduce_scatter", M=16, NK=64, n=2, cfg=TINY, device=DEV):
    return compile_pool.task(case_call(kernel, M, NK, n, 0, torch.bfloat16, device), cfg)


def test_case_call_describes_the_benchs_operands():
    """The bench's cases as fastpipe.kernels.calls describes them: the shapes and strides of make_mrs / make_agm
    (b = w.t(): column-major), so the warm-up's calls specialize as the tuning's."""
    for kernel, make in (("matmul_reduce_scatter", lambda: make_mrs(32, 64, 2, torch.bfloat16, "cpu")),
                         ("all_gather_matmul", lambda: make_agm(32, 64, 2, 0, torch.bfloat16, "cpu"))):
        call = case_call(kernel, 32, 64, 2, 0, torch.bfloat16, torch.device("cpu"))
        a, b = make()
        assert call.a == tuple((tuple(x.shape), x.stride()) for x in a)
        assert call.b == tuple((tuple(x.shape), x.stride()) for x in b) and b[0].stride() == (1, 64)
        assert (call.dtype, call.device, call.dim) == ("bfloat16", "cpu", 0)


def test_split_keeps_each_unit_in_one_chunk_and_balances_them():
    cfgs = [KernelConfig(16 * 2 ** i, 64, 64) for i in range(4)]
    tasks = [_task(M=M, NK=NK, cfg=c) for c in cfgs for M in (1024, 16) for NK in (8192, 64)]
    tasks.append(_task(n=4, cfg=cfgs[0]))                                  # another n: another unit
    chunks = compile_pool.split(tasks + tasks[:3], workers=3)              # repeats are run once
    assert sorted(t for c in chunks for t in c) == sorted(tasks)           # (Task: a dataclass, ordered)
    assert sorted(map(len, chunks)) == [4, 5, 8]                           # units of 4, 4, 4, 4, 1
    for c in chunks:
        assert [t.size() for t in c] == sorted(t.size() for t in c)        # smallest operands first
    owner = {t.unit: i for i, c in enumerate(chunks) for t in c}
    assert all(owner[t.unit] == i for i, c in enumerate(chunks) for t in c)
    assert len(compile_pool.split(tasks, workers=64)) == 5                 # no more chunks than units
    assert compile_pool.split([], workers=4) == []


def test_the_tasks_are_the_tunings_first_calls():
    """warmup_tasks: one task per case and candidate, as tune_case calls them; cases that do not split are left out."""
    from bench.bench_fused_kernels import launcher_shape, tune_candidates

    cases = [("matmul_reduce_scatter", 4096, 2, 1024, 0), ("all_gather_matmul", 4096, 4, 8192, 0),
             ("all_gather_matmul", 4096, 2, 16, 1),
             ("matmul_reduce_scatter", 4096, 3, 1024, 0)]                 # M 1024 does not split by 3
    cpu = torch.device("cpu")
    tasks = warmup_tasks(cases, torch.bfloat16, cpu, smoke=False)
    expect = []
    for kernel, nk, n, M, dim in cases[:3]:
        launcher, lm, ln, _ = launcher_shape(kernel, M, nk, n, dim)
        call = case_call(kernel, M, nk, n, dim, torch.bfloat16, cpu)
        assert call.launch()[:3] == (launcher, lm, ln)
        expect += [(call, c) for c in tune_candidates(lm, ln, torch.bfloat16, False, launcher, n=n)]
    assert [(t.call, KernelConfig(**dict(t.config))) for t in tasks] == expect


def test_default_worker_count(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(compile_pool.os, "cpu_count", lambda: 16)
    assert (compile_pool.default_workers(cuda), compile_pool.default_workers(cpu)) == (14, 0)
    monkeypatch.setattr(compile_pool.os, "cpu_count", lambda: 2)
    assert compile_pool.default_workers(cuda) == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not CUDA, reason="needs CUDA")])])
def test_workers_make_every_first_call_and_report_the_failures(device, monkeypatch):
    """Two workers over real kernel calls (the interpreter's on CPU tensors, compiled ones on a GPU): a config
    the launcher refuses is reported with the task and its error, the rest run, and the workers are gone."""
    if device == "cpu":
        # the workers are spawned: they import triton afresh, so this reaches them on a GPU machine too
        # (where conftest leaves the interpreter off in this process, and hides the GPU from children)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dev = torch.device(device)
    bad = _task(NK=36, cfg=KernelConfig(16, 16, 16, tma=True), device=dev)   # rows of 72 bytes: TMA cannot load them
    good = [_task(device=dev), _task(M=48, device=dev), _task("all_gather_matmul", M=32, device=dev)]
    out = compile_pool.warm(good + [bad], 2, timeout_s=240)
    assert "error" not in out, out
    assert (out["workers"], out["tasks"], out["units"]) == (2, 4, 3)
    why = mm_sum_tma.device_problem(dev) or ("a[0]'s leading stride, 36 elements of 2 bytes, is not a multiple "
                                             "of 16 bytes (TMA's alignment)")          # (the first: before Hopper)
    assert out["failed"] == [f"{bad.text()}: ValueError: matmul_reduce_scatter: config.tma: the TMA kernel cannot "
                             f"load these operands: {why}"]
    assert bad.text() == "matmul_reduce_scatter dim 0 (mm_sum M=16 N=36 K=36 n=2 bfloat16) 16x16x16 w4 s3 tma"
    assert not multiprocessing.active_children()


def test_a_pool_past_its_time_is_stopped():
    tasks = [_task(cfg=KernelConfig(16, 16, 16 * 2 ** i, num_stages=s)) for i in range(3) for s in (1, 2, 3)]
    out = compile_pool.warm(tasks, 2, timeout_s=0)                 # at least 1 s: under the workers' imports
    assert out["error"] == "not done after 0 s: stopped; the tuning compiles what is left"
    assert out["s"] < 60 and not multiprocessing.active_children()


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_the_tunings_call_reads_what_the_warmup_compiled(tmp_path):
    """In a process with its own Triton cache: the warm-up compiles a plain and (on Hopper) a TMA config in a
    worker; the same calls in the main process, on the bench's own operands, then write nothing to the cache
    (they compiled nothing)."""
    code = textwrap.dedent("""
        import json, os, sys, torch
        from bench.bench_fused_kernels import case_call, make_agm, make_mrs
        from fastpipe.kernels import KernelConfig, all_gather_matmul, compile_pool, matmul_reduce_scatter, mm_sum_tma
        dev = torch.device("cuda")
        cfgs = [KernelConfig(64, 128, 64, num_warps=4, num_stages=3)]
        if mm_sum_tma.device_problem(dev) is None:
            cfgs.append(KernelConfig(128, 128, 64, num_warps=8, num_stages=3, tma=True))
        tasks = [compile_pool.task(case_call(k, 256, 1024, 2, 0, torch.bfloat16, dev), c) for c in cfgs
                 for k in ("matmul_reduce_scatter", "all_gather_matmul")]
        warm = compile_pool.warm(tasks, 2, timeout_s=300)
        files = lambda: {os.path.join(d, f) for d, _, fs in os.walk(os.environ["TRITON_CACHE_DIR"]) for f in fs}
        before = files()
        a, b = make_mrs(256, 1024, 2, torch.bfloat16, dev)
        ga, gb = make_agm(256, 1024, 2, 0, torch.bfloat16, dev)
        for c in cfgs:
            matmul_reduce_scatter(a, b, dim=0, config=c)
            all_gather_matmul(ga, gb, dim=0, config=c)
        torch.cuda.synchronize()
        print(json.dumps({"warm": warm, "cached": len(before), "new": sorted(files() - before), "tasks": len(tasks)}))
    """)
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["warm"]["failed"] == [] and "error" not in got["warm"], got["warm"]
    assert got["warm"]["tasks"] == got["tasks"] and got["cached"] > 0
    assert got["new"] == [], f"the main process compiled again: {got['new']}"
