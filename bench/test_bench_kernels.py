"""matmul_reduce_scatter: the fused kernel vs the unfused path the runtime runs (torch.mm per participant,
then fastpipe.comm.reduce_scatter) vs one cuBLAS GEMM of the same work. GPU only: under the CPU
interpreter the timings mean nothing (bench/bench_fused_kernels.py has the full grid and the crossover).

Every row is checked against ONE float32 reference computed from the same bf16 inputs upcast, with
the tolerance its variant's rounding allows (bench_fused_kernels.tolerance): the fused kernel and the
single GEMM round an fp32 accumulation to bf16 once; the unfused path also rounds each participant's
partial product to bf16 before the fp32 sum, which its atol (scaled by sum_i |a_i| @ |b_i|) allows."""
import pytest
import torch

from bench.bench_fused_kernels import check_variant, reference_f32, variants

KERNEL = "matmul_reduce_scatter"


@pytest.mark.cuda
@pytest.mark.parametrize("m", [128, 1024, 8192])
@pytest.mark.parametrize("variant", ["unfused", "fused", "torch.mm"])
def test_matmul_reduce_scatter(benchmark, record, variant, m):
    benchmark.group = f"matmul_reduce_scatter M={m}"
    n, nk, dtype, device = 4, 4096, torch.bfloat16, torch.device("cuda")   # a[i]: [M, 4096], b[i]: [4096, 4096]
    a, b, fns, split, _, _ = variants(KERNEL, m, nk, n, 0, dtype, device)
    fn = fns[variant]
    out = benchmark(lambda: (fn(), torch.cuda.synchronize())[0])
    refs, mags = reference_f32(KERNEL, a, b, 0)
    worst = check_variant(KERNEL, variant, split(out) if variant == "torch.mm" else out, refs, mags, dtype, device)
    assert worst <= 1.0, f"{variant}: worst |out - ref| is {worst:.2f}x the bf16 tolerance"
    record(variant=variant, size=m, worst_err_over_tol=worst)


@pytest.mark.parametrize("variant", ["unfused", "fused", "torch.mm"])
def test_every_variant_passes_the_f32_check_at_a_small_size(variant):
    """The check itself, where it can run anywhere (CPU: the fused kernel under the Triton interpreter)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n, dtype = 4, torch.bfloat16
    a, b, fns, split, _, _ = variants(KERNEL, 32, 64, n, 0, dtype, device)
    out = fns[variant]()
    refs, mags = reference_f32(KERNEL, a, b, 0)
    assert check_variant(KERNEL, variant, split(out) if variant == "torch.mm" else out, refs, mags, dtype, device) <= 1.0


def _row(kernel, M, fused_ms, unfused_ms, n=2, nk=4096, rule=False):
    k_total = n * nk if kernel == "matmul_reduce_scatter" else nk
    return {"kernel": kernel, "M": M, "N=K": nk, "N": nk, "K_total": k_total, "n": n, "dim": 0, "dtype": "bfloat16",
            "fused_ms": fused_ms, "unfused_ms": unfused_ms, "torch.mm_ms": fused_ms * 0.9,
            "fused_p20": 0.98 * fused_ms, "fused_p80": 1.02 * fused_ms,
            "unfused_p20": 0.98 * unfused_ms, "unfused_p80": 1.02 * unfused_ms,
            "speedup": unfused_ms / fused_ms, "rule_says_fused": rule}


def test_crossover_is_the_smallest_m_from_which_fused_always_wins(tmp_path, capsys):
    import json

    from bench.bench_fused_kernels import crossover, main

    rows = [_row(KERNEL, 16, 2.0, 1.0), _row(KERNEL, 128, 1.0, 1.5), _row(KERNEL, 1024, 2.0, 1.0, rule=True),
            _row(KERNEL, 8192, 1.0, 2.0, rule=True),                        # wins at 128, loses at 1024: 8192
            _row(KERNEL, 16, 2.0, 1.0, n=4), _row(KERNEL, 8192, 2.0, 1.0, n=4, rule=True),    # never
            _row("all_gather_matmul", 16, 1.0, 3.0), _row("all_gather_matmul", 128, 1.0, 3.0)]  # always
    by = {(t["kernel"], t["n"]): t for t in crossover(rows, rule=lambda r: r["rule_says_fused"])}
    assert by[(KERNEL, 2)]["min_M"] == 8192 and not by[(KERNEL, 2)]["rule_agrees"]
    assert by[(KERNEL, 4)]["rule_agrees"] is False and by[("all_gather_matmul", 2)]["rule_agrees"] is False
    # a 1% edge is inside the timing noise: not a win
    (tie,) = crossover([_row(KERNEL, 16, 1.0, 1.01)])
    assert tie["min_M"] is None
    assert by[(KERNEL, 4)]["min_M"] is None and by[(KERNEL, 4)]["K_total"] == 4 * 4096
    assert by[("all_gather_matmul", 2)]["min_M"] == 16
    res = tmp_path / "fused.json"
    res.write_text(json.dumps({"machine": {"device": "test"}, "rows": rows}))
    assert main(["--threshold", str(res), "--json", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "matmul_reduce_scatter dim 0 bfloat16 N=4096 K_total=8192 n=2: min_M=8192" in out
    assert json.loads((tmp_path / "t.json").read_text())["crossovers"][0]["kernel"] == "all_gather_matmul"


def test_write_rule_turns_results_into_the_runtime_table(tmp_path, capsys):
    import json

    from bench.bench_fused_kernels import main
    from fastpipe.kernels.fusion_rule import parse_table

    rows = [_row(KERNEL, 16, 1.0, 2.0), _row(KERNEL, 1024, 2.0, 1.0)]
    res = tmp_path / "fused.json"
    res.write_text(json.dumps({"machine": {"device": "GPU X", "date": "d", "cpu": "c"}, "rows": rows}))
    table = tmp_path / "rule.json"
    assert main(["--threshold", str(res), "--write-rule", str(table)]) == 0
    assert "2 measured points (1 where the fused kernel won)" in capsys.readouterr().out
    doc = json.loads(table.read_text())
    assert doc["measured_on"] == [{"device": "GPU X", "date": "d", "torch": None, "triton": None, "python": None}]
    assert doc["sources"] == ["fused.json"]
    assert [(p["M"], p["fused_wins"]) for p in parse_table(doc, "rule.json")] == [(16, True), (1024, False)]
    with pytest.raises(SystemExit):
        main(["--write-rule", str(table)])
