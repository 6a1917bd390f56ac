"""bench/bench_fused_kernels.py's report: the GPU's peak by name, the per-row targets, and a
smoke run of the whole script under the Triton interpreter (every variant checked)."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastpipe.kernels import KernelConfig, pick_config

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


def test_smoke_run_with_profile_puts_each_variants_ops_in_its_row(tmp_path):
    """--profile: every row's "profile" has each variant's per-run totals (on CPU: the torch ops the variant ran,
    torch.mm's one aten::mm among them), and a line per variant follows the row's."""
    pytest.importorskip("triton")
    out = tmp_path / "fused.json"
    r = subprocess.run([sys.executable, "bench/bench_fused_kernels.py", "--smoke", "--kernel", "matmul_reduce_scatter",
                        "--profile", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    for row in rows:
        assert sorted(row["profile"]) == ["fused", "torch.mm", "unfused"]
        for p in row["profile"].values():
            assert p["runs"] == 5 and p["events"] == "cpu_op" and 0 < p["covered_us"] <= p["busy_us"] * (1 + 1e-9)
        assert {"name": "aten::mm", "count": 1.0} == {k: row["profile"]["torch.mm"]["kernels"][0][k]
                                                      for k in ("name", "count")}
    assert r.stdout.count("    torch.mm: 1 cpu_op/run, ") == 2 and r.stdout.count("    unfused: ") == 2


def test_a_variant_the_profiler_fails_on_gets_its_error_and_the_others_stand(monkeypatch):
    import bench.bench_fused_kernels as bfk

    def boom():
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    got = bfk.profile_variants({"fused": boom, "torch.mm": lambda: torch.ones(2) @ torch.ones(2)}, torch.device("cpu"))
    assert got["fused"] == {"error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}
    assert got["torch.mm"]["launched"] >= 1


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
    # split-K where a config's tiles fill at most half of the 132 SMs, to about 132 programs; for gather_rows
    # (all_gather_matmul dim 0) the tiles of its n outputs together, one launch
    for M, N in ((16, 4096), (128, 4096), (128, 8192), (8192, 4096), (16, 1024)):
        for launcher, outputs in (("mm_sum", 1), ("gather_rows", 1), ("gather_rows", 4)):
            cands = tune_candidates(M, N, torch.bfloat16, smoke=False, launcher=launcher, n=outputs)
            assert len(cands) <= 36
            for c in cands:
                tiles = outputs * -(-M // c.block_m) * -(-N // c.block_n)
                if c.split_k > 1:
                    assert c.block_k == 64 and 2 * tiles <= 132, (M, N, c)        # nearest 132, 16 at most:
                    assert 66 <= tiles * c.split_k <= 264 or c.split_k == 16, (M, N, c)
                elif c.block_k == 64 and 2 * tiles <= 132:
                    assert any(x.split_k > 1 and (x.block_m, x.block_n, x.num_warps) == (c.block_m, c.block_n,
                                                                                        c.num_warps) for x in cands)
            assert any(c.split_k > 1 for c in cands) == (M < 1024 and (M, N, outputs) != (128, 8192, 4))
        mm = tune_candidates(M, N, torch.bfloat16, smoke=False, launcher="mm_sum")
        assert mm == tune_candidates(M, N, torch.bfloat16, smoke=False, launcher="gather_rows")   # n 1: one output
        four = tune_candidates(M, N, torch.bfloat16, smoke=False, launcher="gather_rows", n=4)
        assert [c for c in four if c.split_k == 1] == [c for c in mm if c.split_k == 1]
    # TMA (on Hopper): the 8-warp 3-stage tiles of >= 64 rows again, persistent with TMA loads
    for M, N in ((16, 4096), (128, 4096), (1024, 4096), (8192, 8192)):
        mm = tune_candidates(M, N, torch.bfloat16, smoke=False, launcher="mm_sum")
        with_tma = tune_candidates(M, N, torch.bfloat16, smoke=False, launcher="mm_sum", tma=True)
        tma = [c for c in with_tma if c.tma]
        assert with_tma[:len(mm)] == mm and with_tma[len(mm):] == tma
        assert tma == [dataclasses.replace(c, tma=True) for c in mm
                       if c.split_k == 1 and c.block_m >= 64 and (c.num_warps, c.num_stages) == (8, 3)]
        assert bool(tma) == (M >= 64) and len(with_tma) <= 48
        rows = tune_candidates(M, N, torch.bfloat16, smoke=False, launcher="gather_rows")
        rows_tma = tune_candidates(M, N, torch.bfloat16, smoke=False, launcher="gather_rows", tma=True)
        assert rows_tma == rows + [dataclasses.replace(c, tma=True) for c in rows
                                   if c.split_k == 1 and c.block_m >= 64 and (c.num_warps, c.num_stages) == (8, 3)]
    assert launcher_shape("matmul_reduce_scatter", 1024, 4096, 4, 0) == ("mm_sum", 1024, 4096, 4096)
    assert launcher_shape("all_gather_matmul", 1024, 4096, 4, 0) == ("gather_rows", 1024, 1024, 4096)
    assert launcher_shape("all_gather_matmul", 1024, 4096, 4, 1) == ("gather_cols", 1024, 1024, 4096)


def test_tuned_table_keeps_checked_gains_only(tmp_path):
    from bench.bench_fused_kernels import tuned_table
    from fastpipe.kernels.tuned import parse_table

    cfg = {"block_m": 64, "block_n": 128, "block_k": 64, "group_m": 8, "num_warps": 4, "num_stages": 4}
    tuned = lambda M, ms, **kw: {"launcher": "mm_sum", "M": M, "N": 4096, "K": 4096, "n": 2, "config": cfg,  # noqa: E731
                                 "ms": ms, "heuristic_ms": 1.0, "candidates": 20, **kw}
    failed_capture = "eager: capture of unfused failed: RuntimeError: x"
    rows = [{"dtype": "bfloat16", "tuned": tuned(16, 0.8)}, {"dtype": "bfloat16", "tuned": tuned(128, 0.99)},
            {"dtype": "bfloat16", "tuned": tuned(1024, 0.5, check="MISMATCH")}, {"dtype": "bfloat16"},
            {"dtype": "bfloat16", "tuned": {"error": "OutOfMemoryError: x"}},
            {"dtype": "bfloat16", "timing": failed_capture, "tuned": tuned(32, 0.5, timing="eager")},   # both eager
            {"dtype": "bfloat16", "timing": "graph", "tuned": tuned(64, 0.5, timing="eager")}]         # apples/oranges
    res = tmp_path / "tune.json"
    res.write_text(json.dumps({"machine": {"device": "NVIDIA H100 80GB HBM3"}, "rows": rows}))
    table = tuned_table([res])
    assert [e["M"] for e in table["entries"]] == [16, 32]      # 1% is no gain; a mismatch is never kept
    assert table["entries"][0]["device"] == "NVIDIA H100 80GB HBM3"
    parsed = parse_table(table, "t")
    assert list(parsed) == [("mm_sum", "NVIDIA H100 80GB HBM3", "bfloat16", 4096, 4096, 2)]


def test_smoke_tune_then_table(tmp_path):
    pytest.importorskip("triton")
    out, table = tmp_path / "tune.json", tmp_path / "table.json"
    r = subprocess.run([sys.executable, "bench/bench_fused_kernels.py", "--smoke", "--kernel", "both",
                        "--check", "--tune", "--compile-workers", "2", "--json", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    # the first calls made first in 2 processes (fastpipe.kernels.compile_pool): 2 M x (4 mm_sum + 4 gather_rows) configs
    warm = doc["compile_warmup"]
    assert (warm["workers"], warm["tasks"], warm["units"], warm["failed"]) == (2, 16, 8, []) and "error" not in warm
    assert "compile warm-up: 16 first calls (8 kernels' configs) on 2 processes in " in r.stdout
    assert {row["kernel"] for row in rows} == {"matmul_reduce_scatter", "all_gather_matmul"}
    for row in rows:
        t = row["tuned"]
        mm_sum = row["kernel"] == "matmul_reduce_scatter"
        # every candidate ran (the interpreter runs TMA descriptors): 2 plain, 1 split-K and 1 TMA
        assert t["check"] == "ok" and t["candidates"] == 4 and t["ms"] > 0 and t["first_calls_s"] > 0
        assert t["launcher"] == ("mm_sum" if mm_sum else "gather_rows") and "tune_skipped" not in row
        # the row says which config the fused kernel ran, and that the heuristic (not a tuned table) picked it
        N = 64 if mm_sum else 32                                    # all_gather_matmul: N / n per output
        assert row["fused_config"] == pick_config(row["M"], N, 64, torch.bfloat16, "cpu").text()
        assert row["fused_config_from"] == "heuristic"
        assert (t["M"], t["N"], t["K"], t["n"]) == (row["M"], N, 64, 2)
    r = subprocess.run([sys.executable, "bench/bench_fused_kernels.py", "--write-tuned", str(table), str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(table.read_text())["format"] == 1, r.stderr


def test_rows_say_when_a_tuned_config_timed_the_fused_kernel(tmp_path, monkeypatch):
    import bench.bench_fused_kernels as bfk

    best = KernelConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True)
    entry = {"launcher": "mm_sum", "device": "GPU X", "dtype": "bfloat16", "M": 1024, "N": 4096, "K": 4096, "n": 2,
             "config": dataclasses.asdict(best)}
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"format": 1, "entries": [entry]}))
    monkeypatch.setenv("FASTPIPE_TUNED_CONFIGS", str(path))
    monkeypatch.setattr(bfk, "gpu_name", lambda device: "GPU X")
    picked = []
    monkeypatch.setattr(bfk, "pick_config", lambda *a, **k: picked.append((a, k)) or best)
    cuda = torch.device("cuda")
    assert bfk.fused_config("matmul_reduce_scatter", 1024, 4096, 2, 0, torch.bfloat16, cuda) == \
        ("128x256x64 w8 s3 tma", "tuned")
    assert picked[-1] == ((1024, 4096, 4096, torch.bfloat16, cuda), {"launcher": "mm_sum", "n": 2})
    monkeypatch.setattr(bfk, "pick_config", lambda *a, **k: KernelConfig(128, 128, 64))
    assert bfk.fused_config("matmul_reduce_scatter", 1024, 4096, 2, 0, torch.bfloat16, cuda)[1] == "heuristic"
    # all_gather_matmul dim 0: the gather_rows launcher, which has no entry here
    monkeypatch.setattr(bfk, "pick_config", lambda *a, **k: best)
    assert bfk.fused_config("all_gather_matmul", 1024, 4096, 2, 0, torch.bfloat16, cuda)[1] == "heuristic"


def test_tolerances_allow_cublas_reduced_precision_split_k():
    from bench.bench_fused_kernels import ACC, tolerance

    u, cuda = 2.0 ** -8, torch.device("cuda")
    assert tolerance("fused", "matmul_reduce_scatter", torch.bfloat16, cuda) == (2 * u, ACC)
    assert tolerance("torch.mm", "all_gather_matmul", torch.bfloat16, cuda) == (2 * u, ACC + 2 * u)
    assert tolerance("unfused", "all_gather_matmul", torch.bfloat16, cuda) == (2 * u, ACC + 2 * u)
    assert tolerance("unfused", "matmul_reduce_scatter", torch.bfloat16, cuda) == (2 * u, ACC + 4 * u)
    assert tolerance("torch.mm", "matmul_reduce_scatter", torch.float32, cuda) == (2 * 2.0 ** -24, ACC)


def _smoke_with_failing_case(tmp_path, *extra):
    """The smoke run with its M = 48 cases raising MemoryError (as an out-of-memory case would)."""
    out = tmp_path / "fused.json"
    code = ("import sys; sys.argv = ['bench_fused_kernels.py'] + sys.argv[1:]\n"
            "import bench.bench_fused_kernels as b\n"
            "real = b.run_case\n"
            "def run_case(kernel, M, *a, **k):\n"
            "    if M == 48:\n"
            "        raise MemoryError('out of memory (simulated)')\n"
            "    return real(kernel, M, *a, **k)\n"
            "b.run_case = run_case\n"
            "sys.exit(b.main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", code, "--smoke", "--kernel", "both", "--check", "--json", str(out), *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    return r, out


def test_a_failing_case_is_a_row_the_run_goes_on_and_exits_1(tmp_path):
    pytest.importorskip("triton")
    r, out = _smoke_with_failing_case(tmp_path)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(x["kernel"], x["M"]) for x in rows] == [("matmul_reduce_scatter", 16), ("matmul_reduce_scatter", 48),
                                                     ("all_gather_matmul", 16), ("all_gather_matmul", 48)]
    failed = [x for x in rows if "error" in x]
    assert [x["M"] for x in failed] == [48, 48] and all("MemoryError" in x["error"] for x in failed)
    assert all(x["check"] == "ok" and x["timing"] == "eager" for x in rows if "error" not in x)
    assert "FAILED: 2 cases raised" in r.stderr and doc["not_run"] == []
    assert not out.with_name(out.name + ".tmp").exists()


def test_budget_stops_starting_cases_and_lists_them(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "fused.json"
    r = subprocess.run([sys.executable, "bench/bench_fused_kernels.py", "--smoke", "--json", str(out), "--budget-s", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["rows"] == [] and [c["M"] for c in doc["not_run"]] == [16, 48]
    assert "budget: 0 s spent; 2 cases not run" in r.stdout


def test_cases_go_shape_by_shape():
    from bench.bench_fused_kernels import case_order

    cases = case_order(("mrs", "agm"), (4096, 8192), (2, 4), (16, 1024))
    assert len(cases) == 16 and len(set(cases)) == 16 and {c[4] for c in cases} == {0}
    assert cases[:4] == [("mrs", 4096, 2, 16, 0), ("mrs", 4096, 2, 1024, 0), ("agm", 4096, 2, 16, 0),
                         ("agm", 4096, 2, 1024, 0)]
    assert [(nk, n) for _, nk, n, _, _ in cases[::4]] == [(4096, 2), (4096, 4), (8192, 2), (8192, 4)]
    # --dim 0,1: the whole grid at dim 0 first (a cut run keeps it whole), then at dim 1
    both = case_order(("mrs", "agm"), (4096, 8192), (2, 4), (16, 1024), (0, 1))
    assert both[:16] == cases and [c[:4] for c in both[16:]] == [c[:4] for c in cases] and {c[4] for c in both[16:]} == {1}


def test_dim_argument():
    from bench.bench_fused_kernels import parse_dims

    assert [parse_dims(x) for x in ("0", "1", "0,1", "1, 0")] == [(0,), (1,), (0, 1), (1, 0)]
    assert [parse_dims(x) for x in ("2", "0,0", "", "0,", "a")] == [None] * 5


def test_crossover_skips_failed_rows():
    from bench.bench_fused_kernels import crossover

    row = lambda M, fused, unfused: {"kernel": "matmul_reduce_scatter", "dim": 0, "dtype": "bfloat16", "N": 4096,  # noqa: E731
                                     "K_total": 8192, "n": 2, "M": M, "fused_ms": fused, "unfused_ms": unfused,
                                     "fused_p20": fused, "fused_p80": fused, "unfused_p20": unfused,
                                     "unfused_p80": unfused, "speedup": unfused / fused, "torch.mm_ms": fused}
    rows = [row(16, 2.0, 1.0), row(1024, 1.0, 2.0), {"kernel": "matmul_reduce_scatter", "M": 8192, "error": "x"}]
    (c,) = crossover(rows, rule=lambda r: r["M"] >= 1024)
    assert c["min_M"] == 1024 and set(c["speedup_by_M"]) == {16, 1024} and c["rule_agrees"]


@pytest.mark.cuda
def test_on_gpu_every_variant_is_timed_and_checked_as_a_graph_replay(tmp_path):
    """The unfused members' matmuls on their own streams inside the captured graph; every variant's
    replayed outputs checked against float32."""
    out = tmp_path / "fused.json"
    r = subprocess.run([sys.executable, "bench/bench_fused_kernels.py", "--kernel", "both", "--check", "--ms", "128",
                        "--nk", "512", "--ns", "2,4", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4
    for row in rows:
        assert row["timing"] == "graph" and row["check"] == "ok", row
        assert row["fused_ms"] > 0 and row["unfused_ms"] > 0 and row["torch.mm_ms"] > 0


def test_a_failing_tuning_keeps_its_rows_timings(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "tune.json"
    code = ("import sys; sys.argv = ['bench_fused_kernels.py'] + sys.argv[1:]\n"
            "import bench.bench_fused_kernels as b\n"
            "def tune_case(*a, **k):\n"
            "    raise MemoryError('out of memory (simulated)')\n"
            "b.tune_case = tune_case\n"
            "sys.exit(b.main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", code, "--smoke", "--tune", "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    for row in rows:
        assert "error" not in row and row["fused_ms"] > 0 and "MemoryError" in row["tuned"]["error"]
    assert "tuning: MemoryError" in r.stderr


def test_threshold_merges_the_runs_of_two_gpus(tmp_path, capsys):
    """--threshold over the committed H200 run and an H100 run (rows without "device", as older files
    have: their machine names the GPU) writes a table with both GPUs' points, and the crossovers
    are printed per GPU."""
    from bench.bench_fused_kernels import main
    from fastpipe.kernels.fusion_rule import parse_table

    h200 = ROOT / "bench" / "measured" / "fused_h200_2026-11-26.json"
    doc = json.loads(h200.read_text())
    h100_rows = [{k: v for k, v in r.items() if k != "device"} for r in doc["rows"] if r["M"] == 16]
    h100 = tmp_path / "fused_h100.json"
    h100.write_text(json.dumps({"machine": {**doc["machine"], "device": "NVIDIA H100 80GB HBM3", "date": "2026-11-27"},
                                "rows": h100_rows}))
    table = tmp_path / "rule.json"
    assert main(["--threshold", str(h200), str(h100), "--write-rule", str(table)]) == 0
    points = parse_table(json.loads(table.read_text()), "rule.json")
    by_gpu = {g: [p for p in points if p["device"] == g] for g in ("NVIDIA H200", "NVIDIA H100 80GB HBM3")}
    assert len(by_gpu["NVIDIA H200"]) == len(doc["rows"]) and len(by_gpu["NVIDIA H100 80GB HBM3"]) == len(h100_rows)
    assert len(points) == len(doc["rows"]) + len(h100_rows)
    out = capsys.readouterr().out
    assert "  NVIDIA H100 80GB HBM3: matmul_reduce_scatter dim 0 bfloat16 N=4096 K_total=8192 n=2: min_M=16" in out
    assert "  NVIDIA H200: matmul_reduce_scatter dim 0 bfloat16 N=4096 K_total=8192 n=2: min_M=1024" in out
