"""`fastpipe tune` and what it is made of: the recorded fused-kernel calls (fastpipe.kernels.calls), their
tuning and the merged table (fastpipe.kernels.autotune), and the command end to end. On CPU the kernels
run under the Triton interpreter with a fake timer (times per config, so the choice is known); on a GPU
the cuda test tunes for real."""
from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch

from fastpipe.cli import main
from fastpipe.kernels import (KernelConfig, all_gather_matmul, autotune, calls, fusion_rule, matmul_reduce_scatter,
                              tuned)
from fastpipe.runtime.tuning import kernel_timing
from tests.examples import GRAPHS
from tests.test_fusion import needs_cpu_kernels

CUDA = torch.cuda.is_available()
SEQ = GRAPHS / "seq_parallel" / "pipeline.json"


def _mrs(M=16, K=32, N=32, n=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(M, K, generator=g, dtype=dtype) for _ in range(n)], \
        [torch.randn(N, K, generator=g, dtype=dtype).t() for _ in range(n)]        # w.t(): column-major


def test_recording_keeps_each_distinct_call_with_its_strides_from_every_thread():
    needs_cpu_kernels()
    a, b = _mrs()
    matmul_reduce_scatter(a, b)                                     # not recording: nothing kept anywhere
    with calls.recording() as made:
        matmul_reduce_scatter(a, b)
        matmul_reduce_scatter(a, b)                                 # the same call: once
        t = threading.Thread(target=lambda: matmul_reduce_scatter(a, b, dim=1, op="avg"))
        t.start()
        t.join()
        all_gather_matmul([x[:8] for x in a], b, dim=0)
    assert [(c.kernel, c.dim, c.op) for c in made] == [("matmul_reduce_scatter", 0, "sum"),
                                                       ("matmul_reduce_scatter", 1, "avg"), ("all_gather_matmul", 0, "")]
    first = made[0]
    assert first.a == (((16, 32), (32, 1)),) * 2 and first.b == (((32, 32), (1, 32)),) * 2
    assert (first.dtype, first.device) == ("float32", "cpu")
    assert first.launch() == ("mm_sum", 16, 32, 32, 2)
    assert made[2].launch() == ("gather_rows", 16, 32, 32, 2)       # the gathered rows: n x 8
    ga, gb = made[2].operands(seed=1)
    assert [(tuple(x.shape), x.stride()) for x in ga] == [((8, 32), (32, 1))] * 2
    assert [(tuple(x.shape), x.stride()) for x in gb] == [((32, 32), (1, 32))] * 2
    assert not calls._recorders


def test_all_gather_dim_1_launches_once_for_outputs_of_different_widths():
    """dim 1 runs on gather_cols, one launch for the n outputs: its shape is the widest output's [M, N], the
    gathered K (the shards' K_i summed) and n, so a call whose outputs differ in width is tuned like any other."""
    call = calls.KernelCall("all_gather_matmul", 1, "", "bfloat16", (((16, 8), (8, 1)), ((16, 24), (24, 1))),
                            (((32, 32), (32, 1)), ((32, 64), (64, 1))), "cpu")
    assert call.launch() == ("gather_cols", 16, 64, 32, 2)
    assert call.rule_shape() == (16, 96, 32, 2)


def _timer(times):
    """A fake timer: each config's time from ``times`` (by its text; 10 ms for the others); the call still runs."""
    def timer(config, fn, device, quick):
        fn()
        return times.get(config.text(), 10.0), "fake"
    return timer


def _recorded_mrs():
    a, b = _mrs()
    with calls.recording() as made:
        matmul_reduce_scatter(a, b)
    return made[0]


def test_tune_picks_the_fastest_config_and_keeps_it_only_beyond_the_gain():
    needs_cpu_kernels()
    call = _recorded_mrs()
    heuristic = KernelConfig(16, 32, 32, group_m=4, num_warps=4, num_stages=1)      # pick_config's, interpreted
    fast = KernelConfig(16, 16, 16, group_m=4, num_stages=1)
    r = autotune.tune(call, _timer({heuristic.text(): 2.0, fast.text(): 1.0}),
                      configs=[fast, dataclasses.replace(fast, block_k=32)])
    assert (r.best, r.heuristic, r.ms, r.heuristic_ms, r.candidates, r.check) == (fast, heuristic, 1.0, 2.0, 3, True)
    assert r.kept() and r.gain() == 2.0 and r.line().endswith("(2.00x, 3 configs, fake): kept")
    assert not r.kept(min_gain=0.6)                                             # 2x is a gain of 50%
    r = autotune.tune(call, _timer({heuristic.text(): 1.0, fast.text(): 1.0}), configs=[fast])
    assert r.best == heuristic and not r.kept() and r.line().endswith("the heuristic's config is the fastest")
    r = autotune.tune(call, _timer({heuristic.text(): 1.0, fast.text(): 0.99}), configs=[fast])
    assert r.best == fast and not r.kept() and r.line().endswith("within 3%: the heuristic stays")


def test_a_config_that_cannot_run_is_skipped_with_its_error():
    needs_cpu_kernels()
    a, b = _mrs()
    with calls.recording() as made:                                # column-major shards: TMA cannot load them
        all_gather_matmul([x[:8].t().contiguous().t() for x in a], b, dim=0)
    tma = KernelConfig(16, 16, 16, tma=True)
    r = autotune.tune(made[0], _timer({}), configs=[tma])
    assert r.candidates == 1 and r.skipped == [
        "16x16x16 w4 s3 tma: ValueError: all_gather_matmul: config.tma: the TMA kernel cannot load these operands: "
        "a[0] is not row-major (strides (1, 8); TMA needs a unit stride along K)"]


def test_outputs_agree_within_two_roundings():
    w = torch.linspace(-3, 3, 64).to(torch.bfloat16)
    eps = torch.finfo(torch.bfloat16).eps
    assert autotune._same_outputs([w], [w.clone()], torch.bfloat16, 64)
    one_ulp = (w.float() * (1 + eps)).to(torch.bfloat16)
    assert autotune._same_outputs([one_ulp], [w], torch.bfloat16, 64)
    assert not autotune._same_outputs([w.float() * (1 + 8 * eps) + 0.5], [w], torch.bfloat16, 64)
    # float32: the order of the additions is all that differs
    needs_cpu_kernels()
    a, b = _mrs(M=64, K=512)
    tiles = [matmul_reduce_scatter(a, b, config=KernelConfig(16, 16, bk, group_m=4, num_stages=1)) for bk in (16, 32)]
    assert autotune._same_outputs(tiles[0], tiles[1], torch.float32, 1024)
    assert not autotune._same_outputs([tiles[0][0] * 1.01], tiles[1][:1], torch.float32, 1024)


def test_replay_ms_on_cpu_times_three_eager_runs():
    ran = []
    ms, timing = kernel_timing.replay_ms(lambda: ran.append(1), torch.device("cpu"), quick=True)
    assert len(ran) == 3 and ms >= 0 and timing == "eager (CPU)"


def test_fusion_point_times_the_fused_kernel_against_the_unfused_path():
    """One recorded call's point for the fusion rule (interpreted kernel, eager CPU timings: only the fields and
    their consistency are checked); the fused call runs under the config given."""
    needs_cpu_kernels()
    call = _recorded_mrs()
    cfg = KernelConfig(16, 16, 16, group_m=4, num_warps=4, num_stages=1)
    ran = []
    p = kernel_timing.fusion_point(call, cfg, "2026-12-01",
                                   stats=lambda fn, device: ran.append(fn()) or kernel_timing.replay_stats(fn, device))
    assert len(ran) == 2 and [len(r) for r in ran] == [2, 2]             # the fused call's outputs, the unfused path's
    torch.testing.assert_close(ran[0], ran[1], rtol=1e-5, atol=1e-5)      # float32: the same sums
    assert {k: p[k] for k in ("device", "kernel", "dim", "dtype", "M", "N", "K_total", "n", "date", "config",
                              "timing")} == {
        "device": "cpu", "kernel": "matmul_reduce_scatter", "dim": 0, "dtype": "float32", "M": 16, "N": 32,
        "K_total": 64, "n": 2, "date": "2026-12-01", "config": cfg.text(), "timing": "eager (CPU)"}
    assert p["fused_wins"] == (p["fused_p80"] < p["unfused_p20"]) and p["revision"] == 1
    assert p["fused_p20"] <= p["fused_ms"] <= p["fused_p80"] and p["unfused_p20"] <= p["unfused_ms"] <= p["unfused_p80"]
    assert p["speedup"] == pytest.approx(p["unfused_ms"] / p["fused_ms"], rel=1e-2, abs=1e-3)   # 3 decimals kept
    fusion_rule.parse_table({"format": 1, "points": [p]}, "p")                # a valid point of the rule's table


def test_with_fusion_points_replaces_the_points_of_the_same_gpu_and_shape():
    def point(M, device="GPU X", wins=True):
        return {"device": device, "kernel": "matmul_reduce_scatter", "dim": 0, "dtype": "bfloat16", "M": M,
                "N": 4096, "K_total": 8192, "n": 2, "speedup": 1.2, "fused_wins": wins, "revision": 1}
    doc = {"format": 1, "entries": [], "fusion": [point(16), point(128), point(16, "GPU Y")]}
    got = autotune.with_fusion_points(doc, [point(16, wins=False), point(1024)])
    assert got["fusion"] == [point(16, wins=False), point(128), point(1024), point(16, "GPU Y")]
    assert autotune.with_fusion_points({"format": 1, "entries": []}, []) == {"format": 1, "entries": []}


def _result(M, ms, heuristic_ms, best=KernelConfig(64, 128, 64), check=True, device="GPU X"):
    call = calls.KernelCall("matmul_reduce_scatter", 0, "sum", "bfloat16", (((M, 4096), (4096, 1)),) * 2,
                            (((4096, 4096), (1, 4096)),) * 2, "cuda:0")
    return autotune.Tuned(call, "mm_sum", M, 4096, 4096, 2, device, best, ms, KernelConfig(128, 128, 64),
                          heuristic_ms, 10, "graph", check)


def test_merged_table_replaces_the_keys_tuned_now():
    old = {"format": 1, "entries": [
        {"launcher": "mm_sum", "device": "GPU X", "dtype": "bfloat16", "M": M, "N": 4096, "K": 4096, "n": 2,
         "config": {"block_m": 16, "block_n": 64, "block_k": 64}} for M in (16, 128, 1024)]}
    doc, kept = autotune.merged_table(old, [_result(16, 1.0, 2.0), _result(128, 1.0, 1.01),
                                            _result(4096, 1.0, 2.0, check=False)])
    assert kept == 1
    by_m = {e["M"]: e for e in doc["entries"]}
    assert sorted(by_m) == [16, 1024]              # 16 re-tuned; 128: the heuristic as good (dropped); 1024 kept
    assert by_m[16]["config"]["block_m"] == 64 and by_m[16]["ms"] == 1.0 and by_m[1024] == old["entries"][2]
    parsed = tuned.parse_table(doc, "t.json")
    assert [m for m, _ in parsed[("mm_sum", "GPU X", "bfloat16", 4096, 4096, 2)]] == [16, 1024]


def _cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _stats(times):
    """A fake replay_stats: the calls it times get (median, p20, p80) from ``times`` in turn; each still runs."""
    times = iter(times)

    def stats(fn, device, quick=False):
        fn()
        return (*next(times), "fake")
    return stats


def test_cli_tunes_the_pipelines_calls_and_merges_into_its_table(capsys, tmp_path, monkeypatch):
    """seq_parallel's two fused groups on CPU (the interpreter), a fake timer under which a 16x16x16 tile wins:
    both calls get an entry; a second run merges (same keys replaced, others kept). Each call's fused kernel
    is then timed against the unfused path (a fake timer again: all_gather_matmul's wins, matmul_reduce_scatter's
    loses), and the points land in the table's "fusion" list."""
    needs_cpu_kernels()
    monkeypatch.delenv("FASTPIPE_TUNED_CONFIGS", raising=False)
    fast = KernelConfig(16, 16, 16, group_m=4, num_warps=4, num_stages=1)
    monkeypatch.setattr(kernel_timing, "time_config", _timer({fast.text(): 1.0}))
    fused_wins, fused_loses = [(1.0, 0.9, 1.1), (2.0, 1.9, 2.1)], [(2.0, 1.9, 2.1), (1.0, 0.9, 1.1)]
    monkeypatch.setattr(kernel_timing, "replay_stats", _stats(fused_wins + fused_loses))
    out = tmp_path / "tuned.json"
    other = {"launcher": "mm_sum", "device": "GPU X", "dtype": "bfloat16", "M": 16, "N": 4096, "K": 4096, "n": 2,
             "config": {"block_m": 16, "block_n": 64, "block_k": 64}}
    other_point = {"device": "GPU X", "kernel": "matmul_reduce_scatter", "dim": 0, "dtype": "bfloat16", "M": 16,
                   "N": 4096, "K_total": 8192, "n": 2, "speedup": 1.2, "fused_wins": True, "revision": 1}
    out.write_text(json.dumps({"format": 1, "entries": [other], "fusion": [other_point]}))
    code, stdout, err = _cli(capsys, "tune", SEQ, "--out", out, "--compile-workers", "2")
    assert code == 0, err
    lines = stdout.splitlines()
    assert lines[0] == "seq_parallel_block: 2 distinct fused-kernel calls (Triton interpreter: timings meaningless)"
    # first calls made in 2 processes first (fastpipe.kernels.compile_pool): the heuristic's and the candidates
    assert lines.pop(1).startswith("compiled 10 first calls (10 kernels) on 2 processes in ")
    # call by call: its tuning, then its fused kernel under the config just kept against the unfused path, in the
    # fusion rule's terms
    assert lines[1].startswith("  all_gather_matmul dim 0 (gather_rows M=16 N=32 K=32 n=2 float32): 16x16x16 w4 s1 "
                               "1.0000 ms vs the heuristic's 16x32x32 w4 s1 10.0000 ms (10.00x, ")
    assert lines[3].startswith("  matmul_reduce_scatter dim 0 (mm_sum M=16 N=32 K=32 n=2 float32): 16x16x16")
    assert all(line.endswith("): kept") for line in lines[1:4:2])
    assert lines[2] == ('  fusion: all_gather_matmul dim 0 M=16 N=64 K_total=32 n=2 float32: fused (16x16x16 w4 s1) '
                        '1.0000 ms (0.9000-1.1000) vs unfused 2.0000 ms (1.9000-2.1000), 2.00x (fake): fuse="auto" '
                        'fuses it')
    assert lines[4].startswith('  fusion: matmul_reduce_scatter dim 0 M=16 N=32 K_total=64 n=2 float32: fused '
                               '(16x16x16 w4 s1) 2.0000 ms (1.9000-2.1000) vs unfused 1.0000 ms (0.9000-1.1000), 0.50x '
                               '(fake): fuse="auto" runs it unfused (the fused kernel is not faster beyond the noise')
    assert lines[5] == (f"wrote {out}: 2 of 2 tuned calls beat the heuristic by more than 3%; 3 entries in all; "
                        f"2 fused-vs-unfused points (1 fused faster)")
    assert lines[6] == f"pick_config reads it where FASTPIPE_TUNED_CONFIGS={out}"
    doc = json.loads(out.read_text())
    assert doc["entries"][0] == other
    assert {(e["launcher"], e["device"], e["M"], e["N"], e["K"], e["n"]) for e in doc["entries"][1:]} == {
        ("gather_rows", "cpu", 16, 32, 32, 2), ("mm_sum", "cpu", 16, 32, 32, 2)}
    tuned.parse_table(doc, str(out))
    points = fusion_rule.parse_tuned_points(doc, str(out))
    assert points.pop(0) == {**other_point, "from": str(out)}                # kept: another GPU's point
    assert [(p["kernel"], p["M"], p["N"], p["K_total"], p["n"], p["fused_wins"], p["speedup"]) for p in points] == [
        ("all_gather_matmul", 16, 64, 32, 2, True, 2.0), ("matmul_reduce_scatter", 16, 32, 64, 2, False, 0.5)]
    assert {(p["device"], p["dtype"], p["revision"], p["config"]) for p in points} == {
        ("cpu", "float32", fusion_rule.KERNEL_REVISIONS[p["kernel"]], fast.text()) for p in points}
    # again, where FASTPIPE_TUNED_CONFIGS names the file and the heuristic now wins: its entries go, `other` stays;
    # the fusion points of the same shapes are replaced (now the unfused path wins both)
    monkeypatch.setenv("FASTPIPE_TUNED_CONFIGS", str(out))
    monkeypatch.setattr(kernel_timing, "time_config", _timer({}))
    monkeypatch.setattr(kernel_timing, "replay_stats", _stats(fused_loses + fused_loses))
    code, stdout, _ = _cli(capsys, "tune", SEQ)
    assert code == 0 and "pick_config reads it" not in stdout and "(16x32x32 w4 s1)" in stdout
    doc = json.loads(out.read_text())
    assert doc["entries"] == [other] and [p["fused_wins"] for p in doc["fusion"]] == [True, False, False]


def test_fuse_auto_follows_the_points_fastpipe_tune_measured(capsys, tmp_path, monkeypatch):
    """The points `fastpipe tune` wrote decide fuse="auto" for the same pipeline (the exact shapes the fusion
    pass asks about: fastpipe.runtime.passes.fuse and KernelCall.rule_shape agree), quoting the file; without the
    table, float32 (never measured by the bench) is not fused."""
    needs_cpu_kernels()
    import fastpipe
    from fastpipe.runtime.passes import fuse

    monkeypatch.delenv("FASTPIPE_TUNED_CONFIGS", raising=False)
    sess = fastpipe.load(SEQ, fuse="off")
    cuda = {s: torch.device("cuda:0") for s in sess.slot_devices}
    assert [d.fused for d in fuse.analyze(sess.checked, cuda, "auto")] == [False, False]
    monkeypatch.setattr(kernel_timing, "time_config", _timer({}))
    monkeypatch.setattr(kernel_timing, "replay_stats", _stats([(1.0, 0.9, 1.1), (2.0, 1.9, 2.1)] * 2))
    out = tmp_path / "tuned.json"
    assert _cli(capsys, "tune", SEQ, "--out", out, "--compile-workers", "0")[0] == 0
    monkeypatch.setenv("FASTPIPE_TUNED_CONFIGS", str(out))
    got = {d.group: d for d in fuse.analyze(sess.checked, cuda, "auto")}
    assert got["ag0"].fused and got["rs0"].fused
    today = json.loads(out.read_text())["fusion"][0]["date"]
    assert got["ag0"].reason.endswith(f"measured at this shape: 2.00x faster than unfused at M=16 N=64 K_total=32 "
                                      f"n=2, float32 dim 0, on cpu {today} by fastpipe tune ({out})")
    assert "M=16 N=32 K_total=64 n=2, float32 dim 0, on cpu" in got["rs0"].reason


def test_cli_refusals_leave_the_table_alone(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("FASTPIPE_TUNED_CONFIGS", raising=False)
    code, _, err = _cli(capsys, "tune", SEQ)
    assert code == 2 and err == ("fastpipe: error: --out: expected the file to write the tuned configs to (or "
                                 "FASTPIPE_TUNED_CONFIGS set), found neither\n")
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"format": 1, "entries": [{"launcher": "mm_sum"}]}))
    code, _, err = _cli(capsys, "tune", SEQ, "--out", bad)
    assert code == 2 and err.startswith(f"fastpipe: error: --out: expected a tuned-config table "
                                        f"(fastpipe.kernels.tuned) to merge into, found {bad}: entries[0]")
    assert err.count("\n") == 1 and json.loads(bad.read_text())["entries"] == [{"launcher": "mm_sum"}]
    code, _, err = _cli(capsys, "tune", SEQ, "--out", tmp_path / "new.json", "--min-gain", "1")
    assert code == 2 and "--min-gain: expected 0 <= gain < 1" in err
    from fastpipe.kernels import mm_reduce_scatter_kernel as k

    monkeypatch.setattr(k, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = _cli(capsys, "tune", SEQ, "--out", tmp_path / "new.json")
    assert code == 2 and err == ("fastpipe: error: fastpipe tune: expected a CUDA GPU (launch configs are measured "
                                 "per GPU model), found none\n")
    assert not (tmp_path / "new.json").exists()


def test_cli_with_nothing_to_fuse_writes_nothing(capsys, tmp_path):
    code, out, _ = _cli(capsys, "tune", GRAPHS / "tp_mlp" / "pipeline.json", "--out", tmp_path / "t.json")
    assert code == 0 and out == ("tp_mlp: nothing to tune: no group fuses (0 candidate groups)\n"
                                 "wrote nothing: no pipeline has a group to fuse\n")
    assert not (tmp_path / "t.json").exists()


def test_cli_tunes_several_pipelines_into_one_table(capsys, tmp_path, monkeypatch):
    """A folder stands for every */pipeline.json in it (a serving set's buckets): each pipeline is recorded in
    turn, a call two of them make is tuned once, and one with nothing to fuse is said and passed over."""
    needs_cpu_kernels()
    import shutil

    from tests.fusion_pipelines import sp_block

    monkeypatch.setattr(kernel_timing, "time_config", _timer({}))
    monkeypatch.setattr(kernel_timing, "replay_stats", _stats([(1.0, 0.9, 1.1)] * 8))
    sets = tmp_path / "set"
    sp_block(sets / "s8", S=8)
    sp_block(sets / "s16", S=16)
    shutil.copytree(sets / "s8", tmp_path / "copy")                     # another file, the same calls
    out = tmp_path / "t.json"
    code, stdout, err = _cli(capsys, "tune", sets, sets / "s8" / "pipeline.json", GRAPHS / "tp_mlp" / "pipeline.json",
                             tmp_path / "copy" / "pipeline.json", "--out", out, "--compile-workers", "0")
    assert code == 0, stdout
    lines = [ln for ln in stdout.splitlines() if not ln.startswith(" ")]
    assert lines[:4] == ["sp_block_f32: 2 distinct fused-kernel calls (Triton interpreter: timings meaningless)",
                         "sp_block_f32: 2 distinct fused-kernel calls (Triton interpreter: timings meaningless)",
                         "tp_mlp: nothing to tune: no group fuses (0 candidate groups)",
                         "sp_block_f32: 2 distinct fused-kernel calls, 2 of them also an earlier pipeline's "
                         "(Triton interpreter: timings meaningless)"]     # s16, s8 (once: named twice), tp_mlp, copy
    assert stdout.count(" the heuristic's config is the fastest") == 4           # 4 distinct calls, each tuned once
    points = json.loads(out.read_text())["fusion"]
    assert sorted((p["kernel"], p["M"]) for p in points) == [("all_gather_matmul", 8), ("all_gather_matmul", 16),
                                                             ("matmul_reduce_scatter", 8),
                                                             ("matmul_reduce_scatter", 16)]
    code, _, err = _cli(capsys, "tune", tmp_path / "copy", "--out", out)
    assert code == 2 and err.startswith("fastpipe: error: serving set: expected */pipeline.json under ")


def test_cli_budget_starts_no_call_past_it_and_names_the_ones_left(capsys, tmp_path, monkeypatch):
    """--budget-s: a fake clock that each fused-vs-unfused timing moves on 100 s; with 150 s the first call is tuned
    and measured (200 s then spent), the second is not started: it is named, the table holds the first call's
    entry and point, and the exit status is 1."""
    needs_cpu_kernels()
    from fastpipe.cli import tune as tune_cli

    clock = [0.0]
    fake = _stats([(1.0, 0.9, 1.1)] * 4)

    def stats(fn, device, quick=False):
        clock[0] += 100.0
        return fake(fn, device, quick)

    monkeypatch.setattr(tune_cli, "_now", lambda: clock[0])
    monkeypatch.setattr(kernel_timing, "time_config", _timer({}))
    monkeypatch.setattr(kernel_timing, "replay_stats", stats)
    out = tmp_path / "t.json"
    code, stdout, _ = _cli(capsys, "tune", SEQ, "--out", out, "--compile-workers", "0", "--budget-s", "150")
    assert code == 1, stdout
    assert stdout.count("the heuristic's config is the fastest") == 1 and stdout.count("  fusion: ") == 1
    assert ("budget: --budget-s 150 s spent after 1 of 2 calls; not tuned or measured: matmul_reduce_scatter dim 0 "
            "(mm_sum M=16 N=32 K=32 n=2 float32)") in stdout
    assert f"wrote {out}: 0 of 1 tuned calls beat the heuristic by more than 3%; 0 entries in all; 1 fused-vs-unfused " \
           f"points (0 fused faster)" in stdout
    assert [p["kernel"] for p in json.loads(out.read_text())["fusion"]] == ["all_gather_matmul"]
    for bad in ("0", "-1"):
        code, _, err = _cli(capsys, "tune", SEQ, "--out", tmp_path / "new.json", "--budget-s", bad)
        assert code == 2 and err == f"fastpipe: error: --budget-s: expected seconds > 0, found {bad}\n"


def test_cli_interrupted_keeps_the_calls_it_finished(capsys, tmp_path, monkeypatch):
    """The table is written after every call: Ctrl-C (or a time limit's SIGINT) during the second call's tuning
    leaves the first call's entry and point in --out, and exits 130."""
    needs_cpu_kernels()
    fast = KernelConfig(16, 16, 16, group_m=4, num_warps=4, num_stages=1)
    timer, fake, measured = _timer({fast.text(): 1.0}), _stats([(1.0, 0.9, 1.1), (2.0, 1.9, 2.1)]), []

    def stats(fn, device, quick=False):
        measured.append(fn)
        return fake(fn, device, quick)

    def interrupted(config, fn, device, quick):
        if measured:                                # the first call tuned and measured: the second call's tuning
            raise KeyboardInterrupt
        return timer(config, fn, device, quick)

    monkeypatch.setattr(kernel_timing, "time_config", interrupted)
    monkeypatch.setattr(kernel_timing, "replay_stats", stats)
    out = tmp_path / "t.json"
    code, stdout, err = _cli(capsys, "tune", SEQ, "--out", out, "--compile-workers", "0")
    assert code == 130 and err == "fastpipe: interrupted\n", stdout
    doc = json.loads(out.read_text())
    assert [(e["launcher"], e["config"]["block_m"]) for e in doc["entries"]] == [("gather_rows", 16)]
    assert [(p["kernel"], p["fused_wins"]) for p in doc["fusion"]] == [("all_gather_matmul", True)]


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_tune_writes_a_table_pick_config_then_follows(capsys, tmp_path, monkeypatch):
    """On the GPU: seq_parallel's slots on cuda:0, every call tuned for real (replayed graphs); what the table
    keeps is what pick_config then returns for that launch."""
    from fastpipe.kernels import pick_config

    out = tmp_path / "tuned.json"
    code, stdout, err = _cli(capsys, "tune", SEQ, "--out", out, "--device-map", "0=cuda:0,1=cuda:0",
                             "--compile-workers", "2")
    assert code == 0, err
    assert "2 distinct fused-kernel calls" in stdout and stdout.count(" configs, graph): ") == 2, stdout
    assert "\ncompiled " in stdout and " on 2 processes in " in stdout and "ENDED EARLY" not in stdout
    doc = json.loads(out.read_text())
    tuned.parse_table(doc, str(out))
    monkeypatch.setenv("FASTPIPE_TUNED_CONFIGS", str(out))
    for e in doc["entries"]:
        got = pick_config(e["M"], e["N"], e["K"], getattr(torch, e["dtype"]), "cuda", launcher=e["launcher"], n=e["n"])
        assert got == KernelConfig(**e["config"])
    # each call's fused kernel against the unfused path, both replayed graphs; fuse="auto" then follows the points
    gpu = fusion_rule.gpu_name("cuda:0")
    points = fusion_rule.parse_tuned_points(doc, str(out))
    assert len(points) == 2 and stdout.count("  fusion: ") == 2 and {p["device"] for p in points} == {gpu}
    assert {p["timing"] for p in points} == {"graph"} and all(p["fused_ms"] > 0 < p["unfused_ms"] for p in points)
    for p in points:
        e = fusion_rule.estimate(p["kernel"], p["M"], p["N"], p["K_total"], p["n"], p["dtype"], p["dim"], gpu)
        assert e.fused == p["fused_wins"] and e.reason.endswith(f"by fastpipe tune ({out})"), e.reason


def test_cli_says_so_when_the_fused_run_called_no_kernel(capsys, tmp_path, monkeypatch):
    needs_cpu_kernels()
    monkeypatch.setattr(calls, "note", lambda *a, **k: None)      # as if the fused steps bypassed the kernels
    code, out, err = _cli(capsys, "tune", SEQ, "--out", tmp_path / "t.json")
    assert code == 1 and out == "" and err == (f"fastpipe: error: fastpipe tune: expected the fused run of {SEQ} to "
                                               f"call the fused kernels, found no call (2 groups fused); wrote "
                                               f"nothing\n")
    assert not (tmp_path / "t.json").exists()
