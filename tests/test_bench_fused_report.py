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
