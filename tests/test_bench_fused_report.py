"""bench/bench_fused_kernels.py's report: the GPU's peak by name, issue 16's per-row targets, and a
smoke run of the whole script under the Triton interpreter (every variant checked)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4), ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
    ("NVIDIA H100 NVL", torch.float16, 835.0), ("NVIDIA H200", torch.bfloat16, 989.4),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0), ("NVIDIA GeForce RTX 4090", torch.bfloat16, None),
    ("NVIDIA H100 80GB HBM3", torch.float32, None)])
def test_peak_by_device_name(name, dtype, peak):
    from bench.bench_fused_kernels import peak_tflops

    assert peak_tflops(name, dtype) == peak


def test_targets_from_m_1024():
    from bench.bench_fused_kernels import targets

    row = {"M": 1024, "speedup": 1.35, "fused_tflops": 600.0, "torch.mm_tflops": 800.0}
    assert targets(row) == {"speedup_met": True, "of_torch_mm": 0.75, "of_torch_mm_met": True}
    assert targets({**row, "speedup": 1.2, "fused_tflops": 500.0}) == {"speedup_met": False, "of_torch_mm": 0.625,
                                                                      "of_torch_mm_met": False}
    assert targets({**row, "M": 128}) == {}


def test_smoke_run_checks_every_variant(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "fused.json"
    r = subprocess.run([sys.executable, "bench/bench_fused_kernels.py", "--smoke", "--kernel", "both", "--check",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["kernel"] for r in rows} == {"matmul_reduce_scatter", "all_gather_matmul"}
    for row in rows:
        assert row["check"] == "ok" and max(row["worst_err_over_tol"].values()) <= 1.0
        assert row["fused_ms"] > 0 and row["peak_tflops"] is None and row["fused_of_peak"] is None
        assert row["targets"] == {}                      # the smoke sizes are below M = 1024
    assert "targets at M >= 1024" in r.stdout and "measured crossover" in r.stdout


def test_tune_candidates_fit_and_follow_m():
    from bench.bench_fused_kernels import launcher_shape, tune_candidates

    for M, N in ((16, 4096), (128, 2048), (8192, 4096), (1024, 32)):
        cands = tune_candidates(M, N, torch.bfloat16, smoke=False)
        assert 8 <= len(cands) <= 36
        for c in cands:
            assert (c.block_m + 0) <= 128 and c.block_n <= max(64, N)
            assert c.num_stages * (c.block_m * c.block_k + c.block_k * c.block_n) * 2 <= 200 * 1024
            assert c.block_m * c.block_n <= 128 * 32 * c.num_warps    # <= 128 accumulators a thread
        p = 16 if M <= 16 else 128 if M >= 128 else M
        assert p in {c.block_m for c in cands}                  # the tile M rounds up to is always tried
    assert launcher_shape("matmul_reduce_scatter", 1024, 4096, 4, 0) == ("mm_sum", 1024, 4096, 4096)
    assert launcher_shape("all_gather_matmul", 1024, 4096, 4, 0) == ("gather_rows", 1024, 1024, 4096)
    assert launcher_shape("all_gather_matmul", 1024, 4096, 4, 1) == ("mm_sum", 1024, 1024, 1024)


def test_tuned_table_keeps_checked_gains_only(tmp_path):
    from bench.bench_fused_kernels import tuned_table
    from fastpipe.kernels.tuned import parse_table

    cfg = {"block_m": 64, "block_n": 128, "block_k": 64, "group_m": 8, "num_warps": 4, "num_stages": 4}
    tuned = lambda M, ms, **kw: {"launcher": "mm_sum", "M": M, "N": 4096, "K": 4096, "n": 2, "config": cfg,  # noqa: E731
                                 "ms": ms, "heuristic_ms": 1.0, "candidates": 20, **kw}
    rows = [{"dtype": "bfloat16", "tuned": tuned(16, 0.8)}, {"dtype": "bfloat16", "tuned": tuned(128, 0.99)},
            {"dtype": "bfloat16", "tuned": tuned(1024, 0.5, check="MISMATCH")}, {"dtype": "bfloat16"}]
    res = tmp_path / "tune.json"
    res.write_text(json.dumps({"machine": {"device": "NVIDIA H100 80GB HBM3"}, "rows": rows}))
    table = tuned_table([res])
    assert [e["M"] for e in table["entries"]] == [16]          # 1% is no gain; a mismatch is never kept
    assert table["entries"][0]["device"] == "NVIDIA H100 80GB HBM3"
    parsed = parse_table(table, "t")
    assert list(parsed) == [("mm_sum", "NVIDIA H100 80GB HBM3", "bfloat16", 4096, 4096, 2)]


def test_smoke_tune_then_table(tmp_path):
    pytest.importorskip("triton")
    out, table = tmp_path / "tune.json", tmp_path / "table.json"
    r = subprocess.run([sys.executable, "bench/bench_fused_kernels.py", "--smoke", "--kernel", "matmul_reduce_scatter",
                        "--check", "--tune", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    for row in rows:
        t = row["tuned"]
        assert t["check"] == "ok" and t["candidates"] == 2 and t["launcher"] == "mm_sum" and t["ms"] > 0
        assert (t["M"], t["N"], t["K"], t["n"]) == (row["M"], 64, 64, 2)
    r = subprocess.run([sys.executable, "bench/bench_fused_kernels.py", "--write-tuned", str(table), str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(table.read_text())["format"] == 1, r.stderr
