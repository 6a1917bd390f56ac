"""scripts/ingest_gpu_check.py: a gpu_check call's $OUT brought into the repository -- the raw fused rows under
bench/measured/, the shipped rule written again from every committed run (oldest first), tuned configs merged, the
shapes and the report scripts' results copied -- on a made-up H100 call built from the committed H200 run."""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile

from fastpipe.kernels.fusion_rule import rows_of, table_from_rows
from tests.examples import ROOT

H200 = ROOT / "bench" / "measured" / "fused_h200_2026-11-26.json"
SCRIPT = ROOT / "scripts" / "ingest_gpu_check.py"
THEN = "then: python -m bench.results_page (renders BENCHMARKS.md from bench/measured)"


def _repo(tmp_path):
    """The parts of a repository the script writes: bench/measured/ with the H200 run, fastpipe/kernels/ with a
    tuned table holding another GPU's entry."""
    root = tmp_path / "repo"
    (root / "bench" / "measured").mkdir(parents=True)
    (root / "fastpipe" / "kernels").mkdir(parents=True)
    shutil.copyfile(H200, root / "bench" / "measured" / H200.name)
    (root / "fastpipe" / "kernels" / "tuned_configs.json").write_text(json.dumps(
        {"format": 1, "entries": [_entry("NVIDIA H200", 16), _entry("NVIDIA H100 80GB HBM3", 128, block_m=32)]}))
    return root


def _entry(device, M, block_m=64):
    return {"launcher": "mm_sum", "device": device, "dtype": "bfloat16", "M": M, "N": 4096, "K": 4096, "n": 2,
            "config": {"block_m": block_m, "block_n": 128, "block_k": 64, "group_m": 8, "num_warps": 4,
                       "num_stages": 4}, "ms": 0.1, "heuristic_ms": 0.2}


def _out(tmp_path):
    """A call's $OUT as it comes back: summary.txt, fused.json and tuned_configs.json loose, shapes.json and a log in
    logs.tar.gz (as gpu_check packs them past 8 files)."""
    out = tmp_path / "out"
    out.mkdir()
    fused = json.loads(H200.read_text())
    fused["machine"] = {**fused["machine"], "device": "NVIDIA H100 80GB HBM3", "date": "2026-12-01"}
    for r in fused["rows"]:
        r["speedup"] *= 1.5                                    # another GPU's numbers
    (out / "fused.json").write_text(json.dumps(fused))
    (out / "tuned_configs.json").write_text(json.dumps({"format": 1, "entries": [
        _entry("NVIDIA H100 80GB HBM3", 128), _entry("NVIDIA H100 80GB HBM3", 1024)]}))
    (out / "summary.txt").write_text("tests: rc=0 in 250 s of 515 (3110 passed)\nrun finished in 248 s, pytest exit "
                                     "status 0\nall:  3110 passed, 0 failed, 30 skipped\ncuda: 160 passed, 0 failed\n"
                                     "slowest 10:\n")
    shapes = {"machine": {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-01"}, "points": [{"M": 16}], "exit": 0}
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for name, text in (("shapes.json", json.dumps(shapes)), ("tests.log", "ok\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out, fused


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120)


def test_ingest_writes_the_runs_files_and_the_rule_from_every_committed_run(tmp_path):
    root, (out, fused) = _repo(tmp_path), _out(tmp_path)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    dry = _run(out, "--root", root, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before          # wrote nothing
    done = _run(out, "--root", root)
    assert done.returncode == 0, done.stderr
    assert done.stdout == dry.stdout.replace("(dry run) ", "") + THEN + "\n"        # the next step, once written
    assert THEN not in dry.stdout
    measured = root / "bench" / "measured"
    new = measured / "fused_h100_2026-12-01.json"
    assert json.loads(new.read_text()) == fused
    # the rule: exactly what bench_fused_kernels --threshold --write-rule makes from both runs, the H200's first
    raws = [json.loads(H200.read_text()), fused]
    want = table_from_rows([r for d in raws for r in rows_of(d)], [d["machine"] for d in raws], [H200.name, new.name])
    rule = json.loads((root / "fastpipe" / "kernels" / "fusion_measured.json").read_text())
    assert rule == want and {p["device"] for p in rule["points"]} == {"NVIDIA H200", "NVIDIA H100 80GB HBM3"}
    # tuned configs: the H100's entry at M 128 replaced, its M 1024 added, the H200's kept
    tuned = json.loads((root / "fastpipe" / "kernels" / "tuned_configs.json").read_text())
    assert [(e["device"], e["M"], e["config"]["block_m"]) for e in tuned["entries"]] == [
        ("NVIDIA H200", 16, 64), ("NVIDIA H100 80GB HBM3", 128, 64), ("NVIDIA H100 80GB HBM3", 1024, 64)]
    assert json.loads((measured / "shapes_h100_2026-12-01.json").read_text())["points"] == [{"M": 16}]
    lines = done.stdout.splitlines()
    assert lines[:4] == ["summary.txt: tests: rc=0 in 250 s of 515 (3110 passed)",
                         "summary.txt: run finished in 248 s, pytest exit status 0",
                         "summary.txt: all:  3110 passed, 0 failed, 30 skipped",
                         "summary.txt: cuda: 160 passed, 0 failed"]
    assert f"fastpipe/kernels/fusion_measured.json: {len(want['points'])} points from {H200.name}, {new.name}" in lines
    # a second call of the same day: its own file, and the rule from all three
    again = _run(out, "--root", root)
    assert again.returncode == 0 and (measured / "fused_h100_2026-12-01_2.json").exists(), again.stderr
    assert json.loads((root / "fastpipe" / "kernels" / "fusion_measured.json").read_text())["sources"] == [
        H200.name, new.name, "fused_h100_2026-12-01_2.json"]


def test_ingest_refuses_a_folder_without_results_and_a_bad_file(tmp_path):
    root = _repo(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "summary.txt").write_text("all:  1 passed\n")
    r = _run(empty, "--root", root)
    assert r.returncode == 2 and r.stderr.startswith("ingest_gpu_check: ValueError: ") and "found none" in r.stderr
    (empty / "fused.json").write_text(json.dumps({"rows": []}))
    r = _run(empty, "--root", root)
    assert r.returncode == 2 and "fused.json: expected bench_fused_kernels' result" in r.stderr
    assert sorted(p.name for p in (root / "bench" / "measured").iterdir()) == [H200.name]


def _report_docs():
    """What report_runtime/serving/memory write, in brief: the decode-step report cut by its budget after a decode
    case, the serving report with a section whose tokens differ, the memory report with an error row."""
    machine = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-01", "torch": "2.11.0+cu130"}
    runtime = {"machine": machine, "args": {}, "not_run": ["decode batch 8"], "failed": [], "cases": [
        {"title": "decode step, batch 1, 1 token over 128 cached", "step": "decode", "batch": 1, "rows": [],
         "verdicts": {"replay_vs_eager_streams": 4.2, "replay_target_met": True,
                      "best_fastpipe": "fastpipe region compiled + replay",
                      "best_unsplit_compiled": "unsplit compiled, reduce-overhead",
                      "best_vs_unsplit_compiled": 1.3, "unsplit_target_met": False}}]}
    serving = {"machine": machine, "status": "done", "failed_sections": [], "sections": {
        "1": {"title": "greedy decode, batch 1", "rows": [
            {"variant": "transformers generate, static cache, eager", "tokens": "reference"},
            {"variant": "fastpipe engine, batch 1, tp=2 set", "tokens": "DIFFER at token 7"}]}}}
    memory = {"machine": machine, "sections": {"load": {"rows": [{"mode": "cold", "ratio": 0.9}]},
                                               "pool": {"rows": [{"section": "pool", "error": "RuntimeError: boom"}]}}}
    return {"runtime": runtime, "serving": serving, "memory": memory}


def test_ingest_copies_the_runtime_serving_and_memory_reports_and_says_their_verdicts(tmp_path):
    root = _repo(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    docs = _report_docs()
    for stage, doc in docs.items():
        (out / f"{stage}.json").write_text(json.dumps(doc))
    done = _run(out, "--root", root)
    assert done.returncode == 0, done.stderr
    for stage, doc in docs.items():
        assert json.loads((root / "bench" / "measured" / f"{stage}_h100_2026-12-01.json").read_text()) == doc
    lines = done.stdout.splitlines()
    assert "runtime.json: decode step, batch 1, 1 token over 128 cached: graph replay vs eager streams: 4.20x " \
           "faster (target >= 3x at batch 1: met)" in lines
    assert any(ln.startswith("runtime.json: decode step, batch 1") and "1.30x (target <= 1.1x: NOT met)" in ln
               for ln in lines)
    assert "runtime.json: not run (the budget): decode batch 8" in lines
    assert "serving.json: section 1 (greedy decode, batch 1): 2 rows, errors: fastpipe engine, batch 1, tp=2 set: " \
           "tokens DIFFER at token 7" in lines
    assert "memory.json: section load: 1 rows" in lines
    assert "memory.json: section pool: 1 rows, errors: RuntimeError: boom" in lines
    # a run cut off before its end says so; a file that is not its stage's is refused and nothing is written
    del docs["runtime"]["failed"]
    docs["serving"]["status"] = "running"
    for stage in ("runtime", "serving"):
        (out / f"{stage}.json").write_text(json.dumps(docs[stage]))
    dry = _run(out, "--root", root, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "(dry run) runtime.json: the run did not finish (no 'failed' list): the cases above are those it wrote" \
        in dry.stdout.splitlines()
    assert "(dry run) serving.json: the run did not finish (status 'running'): the sections above are those it " \
           "wrote" in dry.stdout.splitlines()
    # a run its stage limit interrupted (SIGINT) inside a case: that case's verdicts from the samples it had
    docs["runtime"]["cases"][0]["partial"] = "interrupted"
    docs["runtime"]["interrupted"] = "decode step, batch 1, 1 token over 128 cached: interrupted after 90 s, ..."
    (out / "runtime.json").write_text(json.dumps(docs["runtime"]))
    lines = _run(out, "--root", root, "--dry-run").stdout.splitlines()
    assert "(dry run) runtime.json: decode step, batch 1, 1 token over 128 cached (interrupted, 0 rows): graph " \
           "replay vs eager streams: 4.20x faster (target >= 3x at batch 1: met)" in lines
    assert "(dry run) runtime.json: INTERRUPTED: decode step, batch 1, 1 token over 128 cached: interrupted after " \
           "90 s, ..." in lines and not any("did not finish" in ln for ln in lines if "runtime.json" in ln)
    (out / "memory.json").write_text(json.dumps({"machine": docs["memory"]["machine"], "rows": []}))
    before = sorted(p.name for p in (root / "bench" / "measured").iterdir())
    bad = _run(out, "--root", root)
    assert bad.returncode == 2 and "memory.json: expected report_memory's sections (an object)" in bad.stderr
    assert sorted(p.name for p in (root / "bench" / "measured").iterdir()) == before


MACHINE = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-01", "torch": "2.11.0+cu130"}


def _real_doc():
    """What bench/report_real_size.py writes, in brief: a decode case (one fastpipe row meets both targets, one
    misses its bandwidth target), a prefill case with a failed row, and a case --budget-s did not start."""
    fp1, fp2 = "fastpipe tp=1, region processor", "fastpipe tp=2, region processor"
    decode = {"case": "decode", "batch": 1, "positions": 256, "copy_bandwidth_gb_s": 3000.0, "rows": [
        {"label": fp1, "median_s": 0.005, "error": None}, {"label": fp2, "median_s": 0.006, "error": None},
        {"label": "gpt-fast style, compiled", "median_s": 0.0055, "error": None}],
        "verdicts": {"logits_ok": True, "rows": {
            fp1: {"vs_faster_baseline": {"ratio": 0.91, "baseline": "gpt-fast style, compiled", "target": 1.05,
                                         "met": True},
                  "bandwidth_fraction": {"value": 0.72, "target": 0.6, "met": True}},
            fp2: {"vs_faster_baseline": {"ratio": 1.09, "baseline": "gpt-fast style, compiled", "target": 1.05,
                                         "met": False},
                  "bandwidth_fraction": {"value": 0.55, "target": 0.6, "met": False}}}}}
    prefill = {"case": "prefill", "batch": 1, "prompt_len": 2048, "matmul_tflop_s": 700.0, "rows": [
        {"label": fp1, "median_s": 0.2, "error": None},
        {"label": fp2, "median_s": None, "error": "OutOfMemoryError: CUDA out of memory"},
        {"label": "transformers static, compiled", "median_s": 0.21, "error": None}],
        "verdicts": {"logits_ok": False, "rows": {
            fp1: {"vs_faster_baseline": {"ratio": 0.95, "baseline": "transformers static, compiled", "target": 1.05,
                                         "met": True},
                  "matmul_fraction": {"value": 0.64, "target": 0.6, "met": True}}}}}
    return {"machine": MACHINE, "checkpoint": "/tmp/fastpipe_real/llama-3.1-8b", "geometry": "llama-3.1-8b",
            "layers": 32, "weight_bytes": 16 * 2**30, "tp": [1, 2], "dtype": "bf16", "cases": [decode, prefill],
            "not_started": ["decode, batch 32"]}


def _scale_doc():
    """What bench/report_scale.py writes, in brief: build met, serve over its time target with a refused layout,
    load on a GPU (time met, device memory held not)."""
    w, grp = 16 * 2**30, 2**30
    build = {"max_s": 22.5, "max_peak": 2**29, "max_over_imports": 2**28, "weight_bytes_copied": 0, "refused": [],
             "met": True}
    serve = {**build, "max_s": 125.0, "refused": ["tp=8 pp=1"], "met": False}
    return {"machine": MACHINE, "checkpoint": "llama-3.1-8b", "max_len": 1024, "device": "cuda:0",
            "rows": [{"section": "build", "tp": 1, "pp": 1, "s": 22.5},
                     {"section": "serve", "tp": 8, "pp": 1, "error": "BuildError: tp: expected a divisor"},
                     {"section": "load", "round": 0, "label": "fastpipe.load tp=2", "s": 3.0}],
            "verdicts": {"weights": w, "largest_group": grp, "build": build, "serve": serve,
                         "load_time_ratio": 1.1, "load_time_met": True, "load_peak_over_imports": 2**30,
                         "load_peak_met": True, "load_held_expected": w + 2**27, "load_held": w + 2**30,
                         "load_held_met": False}}


def _staged(tmp_path, name: str, doc: dict):
    """A repository (_repo) and a gpu_check $OUT folder holding ``doc`` as ``name``."""
    root, out = _repo(tmp_path), tmp_path / "out"
    out.mkdir()
    (out / name).write_text(json.dumps(doc))
    return root, out


def test_ingest_copies_the_real_size_report_and_says_each_cases_verdicts(tmp_path):
    doc = _real_doc()
    root, out = _staged(tmp_path, "real.json", doc)
    dry = _run(out, "--root", root, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert not (root / "bench" / "measured" / "real_size_h100_llama-3.1-8b_2026-12-01.json").exists()
    done = _run(out, "--root", root)
    assert done.returncode == 0, done.stderr
    assert done.stdout == dry.stdout.replace("(dry run) ", "") + THEN + "\n"
    assert json.loads((root / "bench" / "measured" / "real_size_h100_llama-3.1-8b_2026-12-01.json").read_text()) == doc
    lines = done.stdout.splitlines()
    assert lines[0] == "real.json -> bench/measured/real_size_h100_llama-3.1-8b_2026-12-01.json (NVIDIA H100 80GB HBM3 2026-12-01)"
    assert lines[1] == (
        "real.json: decode, batch 1, 256 cache positions: logits ok; fastpipe tp=1, region processor: 0.91x the "
        "faster baseline's time (gpt-fast style, compiled; target <= 1.05x: met), 72% of the device's copy bandwidth "
        "(target >= 60%: met); fastpipe tp=2, region processor: 1.09x the faster baseline's time (gpt-fast style, "
        "compiled; target <= 1.05x: NOT met), 55% of the device's copy bandwidth (target >= 60%: NOT met)")
    assert lines[2] == (
        "real.json: prefill, batch 1, prompt 2048: logits NOT ok; fastpipe tp=1, region processor: 0.95x the faster "
        "baseline's time (transformers static, compiled; target <= 1.05x: met), 64% of the bf16 matmul rate (target "
        ">= 60%: met); FAILED: fastpipe tp=2, region processor: OutOfMemoryError: CUDA out of memory")
    assert lines[3:] == ["real.json: not started (the budget): decode, batch 32", THEN]
    # a second run of the same day gets its own file; a file that is not report_real_size's writes nothing
    assert _run(out, "--root", root).returncode == 0
    assert (root / "bench" / "measured" / "real_size_h100_llama-3.1-8b_2026-12-01_2.json").exists()
    before = sorted(p.name for p in (root / "bench" / "measured").iterdir())
    (out / "real.json").write_text(json.dumps({"machine": MACHINE, "rows": []}))
    bad = _run(out, "--root", root)
    assert bad.returncode == 2 and "real.json: expected report_real_size's cases (a list)" in bad.stderr
    (out / "real.json").write_text(json.dumps({**doc, "machine": {"device": "NVIDIA H100 80GB HBM3"}}))
    bad = _run(out, "--root", root)
    assert bad.returncode == 2 and "real.json: expected bench/report_real_size.py's result (machine.device, " \
        "machine.date)" in bad.stderr
    assert sorted(p.name for p in (root / "bench" / "measured").iterdir()) == before


def test_ingest_copies_the_scale_report_and_says_each_sections_verdicts(tmp_path):
    doc = _scale_doc()
    root, out = _staged(tmp_path, "scale.json", doc)
    done = _run(out, "--root", root)
    assert done.returncode == 0, done.stderr
    assert json.loads((root / "bench" / "measured" / "scale_h100_llama-3.1-8b_2026-12-01.json").read_text()) == doc
    assert done.stdout.splitlines() == [
        "scale.json -> bench/measured/scale_h100_llama-3.1-8b_2026-12-01.json (NVIDIA H100 80GB HBM3 2026-12-01)",
        "scale.json: build: at most 22.5 s, peak RSS at most 0.50 GiB (0.25 GiB over imports), 0.00 GiB of weights "
        "copied (targets < 60 s, < 2 GiB, none copied: met)",
        "scale.json: serve: at most 125.0 s, peak RSS at most 0.50 GiB (0.25 GiB over imports), 0.00 GiB of weights "
        "copied (targets < 60 s, < 2 GiB, none copied: NOT met); refused or failed: tp=8 pp=1: BuildError: tp: "
        "expected a divisor",
        "scale.json: load: 1.10x safetensors' time (target <= 1.2x: met); peak RSS 1.00 GiB over imports (target <= "
        "the weights + the largest merged group, 17.00 GiB: met); device memory held 17.00 GiB (target within 5% of "
        "the weights + the KV cache, 16.12 GiB: NOT met)",
        THEN]
    # a load section that failed outright (no verdicts but the sizes): its error; on the CPU, the RSS after the load
    doc["verdicts"] = {"weights": 2**30, "largest_group": 2**28}
    doc["rows"] = [{"section": "load", "error": "RuntimeError: boom"}]
    (out / "scale.json").write_text(json.dumps(doc))
    dry = _run(out, "--root", root, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[1:] == ["(dry run) scale.json: load: refused or failed: load: RuntimeError: boom"]
    doc["verdicts"] = {**_scale_doc()["verdicts"], "load_rss_after_over_imports": 2**31}
    for key in ("load_held", "load_held_met", "build", "serve"):
        del doc["verdicts"][key]
    doc["rows"] = []
    (out / "scale.json").write_text(json.dumps(doc))
    dry = _run(out, "--root", root, "--dry-run")
    assert dry.stdout.splitlines()[1:] == [
        "(dry run) scale.json: load: 1.10x safetensors' time (target <= 1.2x: met); peak RSS 1.00 GiB over imports "
        "(target <= the weights + the largest merged group, 17.00 GiB: met); RSS after the load 2.00 GiB over imports "
        "(the weights + the KV cache: 16.12 GiB)"]
    # a file that is not report_scale's is refused, and nothing is written
    before = sorted(p.name for p in (root / "bench" / "measured").iterdir())
    (out / "scale.json").write_text(json.dumps({"machine": MACHINE, "rows": []}))
    bad = _run(out, "--root", root)
    assert bad.returncode == 2 and "scale.json: expected report_scale's verdicts (an object)" in bad.stderr
    assert sorted(p.name for p in (root / "bench" / "measured").iterdir()) == before
