"""fastpipe.kernels.fusion_rule: fuse="auto" fuses where the fused kernel was measured faster than
the runtime's unfused path, and nowhere else. The shipped table is checked against the raw GPU rows
it was written from (bench/measured/), and every measured point's decision against that row's
timings."""
import json
from pathlib import Path

import pytest
import torch

from fastpipe.kernels import fused_is_faster
from fastpipe.kernels import fusion_rule
from fastpipe.kernels.fusion_rule import (
    dump_table, estimate, fused_wins, newest_rows, parse_table, rows_of, table_from_rows)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = json.loads(fusion_rule.PACKAGED.read_text())
RAW = [json.loads((ROOT / "bench" / "measured" / name).read_text()) for name in SHIPPED["sources"]]
ROWS = [r for doc in RAW for r in rows_of(doc)]         # every committed run's rows, oldest run first
NEWEST = newest_rows(ROWS)                               # the rows the shipped points come from
MRS, AGM = "matmul_reduce_scatter", "all_gather_matmul"


def test_the_shipped_table_is_what_the_bench_writes_from_the_committed_rows():
    want = table_from_rows(ROWS, [doc["machine"] for doc in RAW], SHIPPED["sources"])
    assert SHIPPED == want
    assert fusion_rule.PACKAGED.read_text() == dump_table(want)
    assert len(SHIPPED["points"]) == len(NEWEST) == 64 and len(ROWS) == 96    # two H200 runs (32 + 64 rows)
    # the second run measured every shape the first did: its rows replace the first's
    assert {r["date"] for r in NEWEST} == {"2026-11-27"}
    assert [p["date"] for p in SHIPPED["points"]] == ["2026-11-27"] * 64


@pytest.mark.parametrize("i", range(64))
def test_at_every_measured_shape_auto_picks_the_measured_winner(i):
    """At a measured shape the decision is that row's: fused exactly where its p80 beat the unfused p20,
    and the reason names the run it comes from."""
    r = NEWEST[i]
    for gpu in (r["device"], None):                  # on the GPU that measured it, and with no GPU named
        got = fused_is_faster(r["M"], r["N"], r["K_total"], r["n"], torch.bfloat16, kernel=r["kernel"], dim=r["dim"],
                              gpu=gpu)
        assert got == (r["fused_p80"] < r["unfused_p20"])
    e = estimate(r["kernel"], r["M"], r["N"], r["K_total"], r["n"], torch.bfloat16, r["dim"], r["device"])
    assert e.reason.startswith("measured at this shape: ") and e.reason.endswith(f"on NVIDIA H200 {r['date']}")
    assert "not measured" not in e.reason
    assert f"{round(r['speedup'], 3):.2f}x" in e.reason  # the table keeps 3 decimals


def test_the_decision_loses_little_where_the_measurement_was_within_noise():
    """Over the measured grid, following the rule is never more than 3% slower than the better path."""
    for r in NEWEST:
        fused = fused_is_faster(r["M"], r["N"], r["K_total"], r["n"], r["dtype"], kernel=r["kernel"], dim=r["dim"])
        chosen, best = (r["fused_ms"] if fused else r["unfused_ms"]), min(r["fused_ms"], r["unfused_ms"])
        assert chosen <= 1.03 * best, r


def test_off_the_grid_the_nearest_measured_point_decides():
    # decode-sized M takes M = 16's decision: matmul+reduce_scatter won there (1.22x-1.35x) at every shape
    for M in (1, 8, 32):
        assert fused_is_faster(M, 4096, 8192, 2, torch.bfloat16, kernel=MRS)
    # 64 is nearer 128 (log2 distance 1) than 16 (2): at N 8192, n 2 unfused won at 128 (0.89x)
    assert not fused_is_faster(64, 8192, 16384, 2, torch.bfloat16, kernel=MRS)
    # beyond the largest M the edge decides: all_gather+matmul won at M 8192 at N = K = 4096 (1.10x, 1.35x),
    # and lost at N = K = 8192, n 2 (0.97x)
    assert fused_is_faster(65536, 4096, 4096, 4, torch.bfloat16, kernel=AGM)
    assert fused_is_faster(65536, 4096, 4096, 2, torch.bfloat16, kernel=AGM)
    assert not fused_is_faster(65536, 8192, 8192, 2, torch.bfloat16, kernel=AGM)
    # n = 8 was not measured: n = 4's points decide
    assert fused_is_faster(8192, 4096, 32768, 8, torch.bfloat16, kernel=MRS)
    e = estimate(MRS, 24, 4096, 8192, 2, torch.bfloat16)
    assert e.fused and e.reason.startswith("the nearest measured shape: 1.31x faster than unfused at M=16 N=4096")


def test_equally_near_points_fuse_only_if_all_won():
    # N 4096, K_total 32768, n 4 is one log2 step from (N 4096, K_total 16384) and from (N 8192, K_total 32768):
    # at M 128 the first won (1.06x) and the second lost (0.82x)
    e = estimate(MRS, 128, 4096, 32768, 4, torch.bfloat16)
    assert not e.fused and e.reason.startswith("the nearest measured shapes: ")
    assert "1.06x faster" in e.reason and "0.82x, not faster" in e.reason
    # at M 16 both won
    assert estimate(MRS, 16, 4096, 32768, 4, torch.bfloat16).fused


def test_unmeasured_dtypes_stay_unfused_and_say_so():
    f32 = estimate(MRS, 8192, 4096, 8192, 2, torch.float32)
    assert not f32.fused and "not measured for float32, dim 0" in f32.reason
    f16 = estimate(MRS, 8192, 4096, 8192, 2, torch.float16)
    assert f16.fused and "float16 uses the bfloat16 measurement" in f16.reason
    one = estimate(MRS, 8192, 4096, 8192, 1, torch.bfloat16)
    assert not one.fused and "one participant" in one.reason


@pytest.mark.parametrize("args, field", [
    (("mm_rs", 16, 4096, 8192, 2), "kernel"),
    ((MRS, 0, 4096, 8192, 2), "M"),
    ((MRS, 16, 4096.0, 8192, 2), "N"),
    ((MRS, 16, 4096, True, 2), "K_total"),
])
def test_bad_queries_name_the_argument(args, field):
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        estimate(*args, torch.bfloat16)


def test_the_kernel_must_be_named():
    with pytest.raises(TypeError, match="kernel"):
        fused_is_faster(1024, 4096, 8192, 2, torch.bfloat16)


def test_fused_wins_needs_the_win_outside_the_noise():
    row = {"fused_p20": 1.0, "fused_p80": 1.1, "unfused_p20": 1.05, "unfused_p80": 1.2}
    assert not fused_wins(row)                     # overlapping spreads: a tie, the unfused path
    assert fused_wins({**row, "unfused_p20": 1.11})


def test_table_from_rows_drops_failed_rows_and_needs_the_gpu():
    good = dict(ROWS[0])
    bad = {**ROWS[1], "check": "MISMATCH"}
    raised = {"kernel": MRS, "M": 16, "error": "OutOfMemoryError"}
    doc = table_from_rows([good, bad, raised], [], ["x.json"])
    assert len(doc["points"]) == 1 and doc["points"][0]["M"] == good["M"]
    assert doc["points"][0]["device"] == "NVIDIA H200"
    nameless = {k: v for k, v in good.items() if k != "device"}
    with pytest.raises(ValueError, match=r"^rows: .*names no GPU \(device\)"):
        table_from_rows([nameless], [], ["x.json"])


def test_rows_name_their_gpu_and_run():
    """Rows without a device (the bench's before they named their GPU) or a date (the bench's) take their file's
    machine.device and machine.date."""
    doc = {"machine": {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-02"},
           "rows": [{"M": 16}, {"M": 32, "device": "NVIDIA H200"}]}
    assert rows_of(doc) == [{"M": 16, "device": "NVIDIA H100 80GB HBM3", "date": "2026-12-02"},
                            {"M": 32, "device": "NVIDIA H200", "date": "2026-12-02"}]
    assert doc["rows"][0] == {"M": 16}                              # the document is left as it was
    assert rows_of({"machine": {}, "rows": [{"M": 16}]}) == [{"M": 16}]
    assert rows_of([{"M": 16}]) == [{"M": 16}]                      # a bare list has no machine


def test_a_point_names_its_own_run_else_every_run_of_its_gpu(tmp_path, monkeypatch):
    """A shipped point names the date of the run it comes from; one without (tables written before points were
    dated) names every date its GPU was measured."""
    r = next(r for r in NEWEST if r["kernel"] == MRS and r["M"] == 16)
    shape = (MRS, r["M"], r["N"], r["K_total"], r["n"], torch.bfloat16)
    assert estimate(*shape).reason.endswith("on NVIDIA H200 2026-11-27")
    undated = {**SHIPPED, "points": [{k: v for k, v in p.items() if k != "date"} for p in SHIPPED["points"]]}
    path = tmp_path / "fusion_measured.json"
    path.write_text(dump_table(undated))
    monkeypatch.setattr(fusion_rule, "PACKAGED", path)
    fusion_rule._shipped.cache_clear()
    try:
        assert estimate(*shape).reason.endswith("on NVIDIA H200 2026-11-26, 2026-11-27")
    finally:
        fusion_rule._shipped.cache_clear()


def test_each_dim_decides_from_its_own_points():
    """Both dims were measured (2026-11-27): at one shape the row blocks' kernel lost and the column blocks' won."""
    shape = (AGM, 8192, 8192, 8192, 2, torch.bfloat16)
    d0, d1 = estimate(*shape, dim=0), estimate(*shape, dim=1)
    assert not d0.fused and d0.reason.startswith("measured at this shape: 0.97x, not faster") and "dim 0" in d0.reason
    assert d1.fused and d1.reason.startswith("measured at this shape: 1.10x faster") and "dim 1" in d1.reason


def test_a_newer_revision_of_a_kernel_replaces_the_older_measurement():
    """A new run of one kernel merges with the older file: per shape the newer revision's row wins,
    whichever file comes first; at one revision the later row (a rerun) wins; another GPU's row of
    the same shape is kept beside it."""
    old = dict(ROWS[0])                                              # no kernel_revision: revision 1
    new = {**old, "kernel_revision": 2, "speedup": 2.0, "fused_p80": 0.1, "unfused_p20": 1.0}
    other = dict(ROWS[1])
    for rows in ([old, new, other], [new, other, old]):
        kept = newest_rows(rows)
        assert len(kept) == 2 and new in kept and other in kept
        doc = table_from_rows(rows, [], ["old.json", "new.json"])
        p = next(p for p in doc["points"] if p["M"] == old["M"] and p["n"] == old["n"] and p["N"] == old["N"])
        assert (p["revision"], p["speedup"], p["fused_wins"]) == (2, 2.0, True)
    rerun = {**new, "speedup": 0.5}
    assert newest_rows([new, rerun]) == [rerun] and newest_rows([rerun, new]) == [new]
    h100 = {**old, "device": "NVIDIA H100 80GB HBM3"}
    assert newest_rows([old, h100, new]) == [new, h100]


def test_a_point_of_an_older_kernel_revision_still_decides_and_says_it_is_stale(monkeypatch):
    """Every shipped point timed its kernel's current revision; a kernel changed since keeps the measured
    decision, and the reason says the measurement is stale and what changed."""
    assert {(p["kernel"], p["revision"]) for p in SHIPPED["points"]} == set(fusion_rule.KERNEL_REVISIONS.items())
    r = next(r for r in NEWEST if r["kernel"] == MRS and r["M"] == 16)
    args = (MRS, r["M"], r["N"], r["K_total"], r["n"], torch.bfloat16)
    monkeypatch.setitem(fusion_rule.KERNEL_REVISIONS, MRS, 1)
    assert "stale" not in estimate(*args).reason
    monkeypatch.setitem(fusion_rule.KERNEL_REVISIONS, MRS, 3)
    monkeypatch.setitem(fusion_rule.REVISION_CHANGES, (MRS, 3), ((0, 1), "split-K at small M"))
    e = estimate(*args)
    assert e.fused == fused_wins(r)
    assert e.reason.endswith("; stale: measured with revision 1 of the kernel, which is now revision 3 "
                             "(split-K at small M): `scripts/gpu_check.sh fused` measures it again"), e.reason


def test_every_kernel_revision_says_what_changed_and_at_which_dims():
    for kernel, now in fusion_rule.KERNEL_REVISIONS.items():
        assert kernel in fusion_rule.KERNELS
        for rev in range(2, now + 1):
            dims, text = fusion_rule.REVISION_CHANGES[(kernel, rev)]
            assert text and dims and set(dims) <= {0, 1}, (kernel, rev)


def test_a_change_at_one_dim_leaves_the_other_dims_points_current(monkeypatch):
    """all_gather_matmul's revision 2 changed dim 0 (one launch for the n outputs), revision 3 dim 1 (gather_cols):
    a dim-0 point of revision 2 is current, one of revision 1 stale for revision 2's change only; a dim-1 point
    of revision 2 is stale for revision 3's change only."""
    assert fusion_rule.KERNEL_REVISIONS[AGM] == 3
    assert fusion_rule.changes_since(AGM, 0, 2) == []
    assert fusion_rule.changes_since(AGM, 0, 1) == [fusion_rule.REVISION_CHANGES[(AGM, 2)][1]]
    assert fusion_rule.changes_since(AGM, 1, 2) == [fusion_rule.REVISION_CHANGES[(AGM, 3)][1]]
    assert fusion_rule.stale_revisions(AGM, 0, [1, 2, 3]) == [1]
    assert fusion_rule.stale_revisions(AGM, 1, [1, 2, 3]) == [1, 2]
    # a tuned point of revision 2 at dim 0 decides without a stale note; at dim 1 it says what changed
    for dim, stale in ((0, False), (1, True)):
        point = {"device": "GPU X", "kernel": AGM, "dim": dim, "dtype": "bfloat16", "M": 64, "N": 4096,
                 "K_total": 4096, "n": 2, "speedup": 1.5, "fused_wins": True, "revision": 2, "from": "t.json"}
        monkeypatch.setattr(fusion_rule, "_tuned_points", lambda point=point: [point])
        e = estimate(AGM, 64, 4096, 4096, 2, torch.bfloat16, dim, gpu="GPU X")
        assert e.fused and ("stale: measured with revision 2" in e.reason) == stale, e.reason
        assert ("gather_cols" in e.reason) == stale, e.reason


@pytest.mark.parametrize("doc, where", [
    ({"format": 2, "points": []}, "t.json: expected"),
    ({"format": 1, "points": [{"kernel": MRS}]}, "t.json: points\\[0\\]: expected an object with"),
    ({"format": 1, "points": [{**SHIPPED["points"][0], "kernel": "gemm"}]}, "t.json: points\\[0\\].kernel"),
    ({"format": 1, "points": [{**SHIPPED["points"][0], "M": -1}]}, "t.json: points\\[0\\].M: expected an integer >= 1"),
    ({"format": 1, "points": [{**SHIPPED["points"][0], "fused_wins": "yes"}]}, "t.json: points\\[0\\].fused_wins"),
    ({"format": 1, "points": [{**SHIPPED["points"][0], "revision": 0}]}, "t.json: points\\[0\\].revision: expected"),
    ({"format": 1, "points": [{**SHIPPED["points"][0], "device": ""}]}, "t.json: points\\[0\\].device: expected the GPU"),
])
def test_a_bad_table_names_the_field(doc, where):
    with pytest.raises(ValueError, match=f"^{where}"):
        parse_table(doc, "t.json")


def test_the_table_ships_with_the_package():
    """An installed (non-editable) fastpipe must carry the table: pyproject's package data covers it."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch.fnmatch(fusion_rule.PACKAGED.name, g) for g in data["fastpipe.kernels"])
    assert fusion_rule.PACKAGED.parent == ROOT / "fastpipe" / "kernels"


@pytest.fixture
def two_gpu_table(tmp_path, monkeypatch):
    """The shipped table with a second GPU's run: at M 16 (where the H200 run won for every
    matmul_reduce_scatter shape) this "H100" lost, and it measured nothing of all_gather_matmul."""
    h100 = "NVIDIA H100 80GB HBM3"
    theirs = [{**r, "device": h100, "fused_p80": 2.0, "unfused_p20": 1.0, "speedup": 0.5}
              for r in NEWEST if r["kernel"] == MRS and r["M"] == 16]
    doc = table_from_rows(ROWS + theirs, [*(d["machine"] for d in RAW), {"device": h100, "date": "2026-11-27"}],
                          [*SHIPPED["sources"], "h100.json"])
    path = tmp_path / "fusion_measured.json"
    path.write_text(dump_table(doc))
    monkeypatch.setattr(fusion_rule, "PACKAGED", path)
    fusion_rule._shipped.cache_clear()
    yield h100
    fusion_rule._shipped.cache_clear()


def test_each_gpu_follows_its_own_measurements(two_gpu_table):
    h100, shape = two_gpu_table, (MRS, 16, 4096, 8192, 2, torch.bfloat16)
    on_h200 = estimate(*shape, gpu="NVIDIA H200")
    assert on_h200.fused and "on NVIDIA H200 2026-11-27" in on_h200.reason and h100 not in on_h200.reason
    on_h100 = estimate(*shape, gpu=h100)
    assert not on_h100.fused and on_h100.reason.startswith("measured at this shape: 0.50x, not faster")
    assert f"on {h100} 2026-11-27" in on_h100.reason and "not measured" not in on_h100.reason
    # The H100 points alone decide on the H100, even where an H200 point is nearer: M 1024 takes the
    # H100's M 16 (lost), not the H200's M 1024 (won)
    assert fused_is_faster(1024, 4096, 8192, 2, torch.bfloat16, kernel=MRS, gpu="NVIDIA H200")
    assert not fused_is_faster(1024, 4096, 8192, 2, torch.bfloat16, kernel=MRS, gpu=h100)
    # all_gather_matmul was measured on the H200 only: the H100 takes it, and the reason says so
    r = next(r for r in NEWEST if r["kernel"] == AGM and fused_wins(r))
    ag = estimate(AGM, r["M"], r["N"], r["K_total"], r["n"], torch.bfloat16, gpu=h100)
    assert ag.fused and "on NVIDIA H200 2026-11-27" in ag.reason
    assert ag.reason.endswith(f"; this GPU ({h100}) was not measured: another GPU's measurement decides until "
                              "`scripts/gpu_check.sh fused` or `fastpipe tune` measures this one"), ag.reason


def test_an_unmeasured_gpu_fuses_only_where_every_measured_gpu_won(two_gpu_table):
    """Equally near points of two GPUs (here: the same shape) fuse only if both won."""
    h100, shape = two_gpu_table, (MRS, 16, 4096, 8192, 2, torch.bfloat16)
    for gpu in ("NVIDIA A100-SXM4-80GB", None):
        e = estimate(*shape, gpu=gpu)
        assert not e.fused and e.reason.startswith("measured at this shape: ")
        assert f"0.50x, not faster than unfused at M=16 N=4096 K_total=8192 n=2 on {h100} 2026-11-27; " in e.reason
        assert "1.31x faster than unfused at M=16 N=4096 K_total=8192 n=2 on NVIDIA H200 2026-11-27, " in e.reason
        assert ("was not measured" in e.reason) == (gpu is not None)


def _tuned_table(tmp_path, monkeypatch, points):
    """A tuned-config table (fastpipe tune's) with these "fusion" points, named by FASTPIPE_TUNED_CONFIGS."""
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"format": 1, "entries": [], "fusion": points}))
    monkeypatch.setenv("FASTPIPE_TUNED_CONFIGS", str(path))
    return path


def _point(r, **over):
    return {**{f: r[f] for f in ("device", "kernel", "dim", "dtype", "M", "N", "K_total", "n")},
            "speedup": 0.8, "fused_wins": False, "revision": 1, "date": "2026-12-01", **over}


def test_a_point_fastpipe_tune_measured_replaces_the_benchs_at_its_shape(tmp_path, monkeypatch):
    """A pipeline's own measurement (the tuned table's "fusion" list) takes the place of the shipped point
    of the same GPU and shape, and the reason names the file; elsewhere both sets of points decide together."""
    r = next(r for r in NEWEST if r["kernel"] == MRS and r["M"] == 16 and fused_wins(r))
    shape = (MRS, r["M"], r["N"], r["K_total"], r["n"], torch.bfloat16, 0, r["device"])
    assert estimate(*shape).fused
    path = _tuned_table(tmp_path, monkeypatch, [_point(r)])
    e = estimate(*shape)
    assert not e.fused and e.reason == (f"measured at this shape: 0.80x, not faster than unfused at M=16 N={r['N']} "
                                        f"K_total={r['K_total']} n={r['n']}, bfloat16 dim 0, on NVIDIA H200 "
                                        f"2026-12-01 by fastpipe tune ({path})")
    # M 32's nearest point is the tuned one at M 16 (log2 distance 1; the bench's M 128 is 2 away): unfused now
    assert not fused_is_faster(32, r["N"], r["K_total"], r["n"], torch.bfloat16, kernel=MRS, gpu=r["device"])
    # with no GPU named too (every GPU's points, the tuned one in place of the bench's)
    assert not fused_is_faster(16, r["N"], r["K_total"], r["n"], torch.bfloat16, kernel=MRS, gpu=None)
    monkeypatch.delenv("FASTPIPE_TUNED_CONFIGS")
    assert estimate(*shape).fused


def test_float16_and_bfloat16_points_serve_each_other(tmp_path, monkeypatch):
    r = next(r for r in NEWEST if r["kernel"] == MRS and r["M"] == 16 and fused_wins(r))
    _tuned_table(tmp_path, monkeypatch, [_point(r, dtype="float16")])
    for dtype, also in ((torch.bfloat16, " (bfloat16 uses the float16 measurement too)"),
                        (torch.float16, " (float16 uses the bfloat16 measurement too)")):
        e = estimate(MRS, r["M"], r["N"], r["K_total"], r["n"], dtype, 0, r["device"])
        # equally near: the tuned float16 point (lost) and the shipped bfloat16 one (won): fused only if both won
        assert not e.fused and e.reason.startswith("measured at this shape: 0.80x, not faster"), e.reason
        assert f"; {round(r['speedup'], 3):.2f}x faster than unfused at M=16 " in e.reason
        assert " on NVIDIA H200 2026-12-01 by fastpipe tune (" in e.reason and " on NVIDIA H200 2026-11-27" in e.reason
        assert e.reason.endswith(also), e.reason


def test_a_bad_fusion_list_is_reported_once_and_the_shipped_points_decide(tmp_path, monkeypatch):
    import warnings

    r = next(r for r in NEWEST if r["kernel"] == MRS and r["M"] == 16 and fused_wins(r))
    _tuned_table(tmp_path, monkeypatch, [_point(r, fused_wins="no")])
    shape = (MRS, r["M"], r["N"], r["K_total"], r["n"], torch.bfloat16, 0, r["device"])
    with pytest.warns(RuntimeWarning, match=r"^fastpipe: the fusion points of the tuned-config table not used: "
                                            r".*tuned\.json: fusion\[0\]\.fused_wins: expected true or false, found "
                                            r"'no'; fuse='auto' decides from the shipped measurements$"):
        assert estimate(*shape).fused
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert estimate(*shape).fused                      # once per file version
    with pytest.raises(ValueError, match=r"^t\.json: fusion\[0\]\.date: expected the date it was measured"):
        fusion_rule.parse_tuned_points({"format": 1, "entries": [], "fusion": [_point(r, date=20261201)]}, "t.json")
    assert fusion_rule.parse_tuned_points({"format": 1, "entries": []}, "t.json") == []
