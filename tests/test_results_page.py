"""bench/results_page.py: BENCHMARKS.md is exactly what the committed raw results render; verdicts follow
the rows; every table names its machine, versions and command; bad result files are named, not rendered."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from bench import results_page
from bench.results_tables import Malformed

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "bench" / "measured"


def copy(tmp_path: Path, *names: str) -> Path:
    out = tmp_path / "measured"
    out.mkdir(exist_ok=True)
    for n in names:
        shutil.copy(MEASURED / n, out / n)
    return out


def edit(folder: Path, name: str, change) -> None:
    doc = json.loads((folder / name).read_text())
    change(doc)
    (folder / name).write_text(json.dumps(doc))


def table_rows(page: str, start: str) -> list[list[str]]:
    """The cells of every table row whose first cell starts with ``start``."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in page.splitlines()
            if line.startswith("| " + start)]


def test_committed_page_is_what_the_results_render():
    page = results_page.render(MEASURED)
    assert (ROOT / "BENCHMARKS.md").read_text() == page, "run: python -m bench.results_page"
    assert results_page.main(["--check"]) == 0


def test_page_stays_short():
    assert len((ROOT / "BENCHMARKS.md").read_bytes()) < 15 * 1024


def test_every_table_names_machine_versions_and_command():
    page = results_page.render(MEASURED)
    blocks = re.split(r"(?m)^### ", page)[1:]
    assert blocks
    for block in blocks:
        head = block.splitlines()[0]
        assert re.search(r"\d{4}-\d{2}-\d{2}; Python [\d.]+, torch \S+, triton \S+, fastpipe \S+", head), head
        tables = block.count("| measure | value | baseline (same run) |")
        assert tables >= 1
        assert len(re.findall(r"(?m)^`python (-m )?bench[/.]\S+", block)) == tables
        assert len(re.findall(r"(?m)^`bench/measured/\S+\.json`", block)) == tables


def test_ratio_is_computed_from_the_rows(tmp_path):
    name = "runtime_h100_2026-11-27.json"
    doc = json.loads((MEASURED / name).read_text())
    rows = {r["variant"]: r["median_ms"] for r in doc["cases"][0]["rows"] if r.get("median_ms")}
    want = (rows["fastpipe region compiled + replay, outputs aliased"]
            / rows["unsplit static cache compiled, reduce-overhead"])
    page = results_page.render(copy(tmp_path, name))
    [cells] = table_rows(page, "decode b1: region compiled + replay, outputs aliased")
    assert cells[4] == f"{want:.2f}x" and cells[6] == "yes"


def test_runtime_verdict_follows_the_rows(tmp_path):
    name = "runtime_h100_2026-11-27.json"
    folder = copy(tmp_path, name)

    def slower(doc):                    # every fastpipe row 3x slower: the best one is now 2.2x the unsplit row
        for r in doc["cases"][0]["rows"]:
            if r["variant"].startswith("fastpipe") and r.get("median_ms"):
                r["median_ms"] *= 3

    before = [c for c in table_rows(results_page.render(folder), "decode b1:") if c[5].startswith("<= 1.1x")]
    edit(folder, name, slower)
    after = [c for c in table_rows(results_page.render(folder), "decode b1:") if c[5].startswith("<= 1.1x")]
    assert [c[6] for c in before] == ["yes"] and [c[6] for c in after] == ["**no**"]


def test_real_size_verdict_follows_the_rows(tmp_path):
    name = "real_size_cpu_llama-3.2-1b_2026-11-28.json"
    folder = copy(tmp_path, name)

    def slower(doc):
        for case in doc["cases"]:
            for r in case["rows"]:
                if r["label"].startswith("fastpipe"):
                    r["median_s"] *= 2

    assert [c[6] for c in table_rows(results_page.render(folder), "prefill")][0] == "yes"
    edit(folder, name, slower)
    assert [c[6] for c in table_rows(results_page.render(folder), "prefill")][0] == "**no**"


def test_newer_fused_run_supersedes_the_older_on_one_gpu():
    page = results_page.render(MEASURED)
    assert "fused_h200_2026-11-27.json" in page and "fused_h200_2026-11-26.json" not in page


def test_not_measured_list_follows_the_results(tmp_path):
    name = "real_size_cpu_llama-3.2-1b_2026-11-28.json"
    folder = copy(tmp_path, name)
    assert "Real-size models (1B and up) on a GPU" in results_page.render(folder)
    gpu = "real_size_h100_llama-3.2-1b_2026-11-28.json"
    shutil.copy(folder / name, folder / gpu)
    edit(folder, gpu, lambda d: d["machine"].update(device="NVIDIA H100 80GB HBM3"))
    assert "Real-size models (1B and up) on a GPU" not in results_page.render(folder)


def test_malformed_file_is_named_with_its_field(tmp_path, capsys):
    name = "runtime_h100_2026-11-27.json"
    folder = copy(tmp_path, name)
    edit(folder, name, lambda d: d.pop("args"))
    with pytest.raises(Malformed, match=r"runtime_h100_2026-11-27\.json: args: expected a value"):
        results_page.render(folder)
    edit(folder, name, lambda d: d.update(args={"device": "cuda"}))      # args without the model's size
    with pytest.raises(Malformed, match=r"runtime_h100_2026-11-27\.json: expected a field 'layers'"):
        results_page.render(folder)
    out = tmp_path / "B.md"
    assert results_page.main(["--measured", str(folder), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'layers'" in err and not out.exists()


def test_stray_and_unreadable_files_are_refused(tmp_path):
    folder = tmp_path / "measured"
    folder.mkdir()
    (folder / "notes.json").write_text("{}")
    with pytest.raises(Malformed, match=r"notes\.json: expected a name starting with one of"):
        results_page.render(folder)
    (folder / "notes.json").unlink()
    (folder / "runtime_x.json").write_text("{not json")
    with pytest.raises(Malformed, match=r"runtime_x\.json: expected a JSON document"):
        results_page.render(folder)


def test_check_mode_reports_a_stale_page(tmp_path):
    folder = copy(tmp_path, "serving_h100_2026-11-27.json")
    out = tmp_path / "B.md"
    assert results_page.main(["--measured", str(folder), "--out", str(out), "--check"]) == 1
    assert results_page.main(["--measured", str(folder), "--out", str(out)]) == 0
    assert results_page.main(["--measured", str(folder), "--out", str(out), "--check"]) == 0
    out.write_text(out.read_text() + "edited by hand\n")
    assert results_page.main(["--measured", str(folder), "--out", str(out), "--check"]) == 1


def test_load_on_a_gpu_is_held_against_weights_and_cache(tmp_path):
    name = "scale_cpu_llama-3.1-8b_load_2026-11-28.json"
    folder = copy(tmp_path, name)
    want = json.loads((folder / name).read_text())["verdicts"]["load_held_expected"]

    def on_gpu(factor):
        def change(doc):
            doc["device"] = "cuda:0"
            for r in doc["rows"]:
                if r["label"].startswith("fastpipe"):
                    r["device_allocated"] = int(want * factor)
        return change

    assert not table_rows(results_page.render(folder), "load: device memory")
    edit(folder, name, on_gpu(1.01))
    [cells] = table_rows(results_page.render(folder), "load: device memory")
    assert cells[5] == "within 5%" and cells[6] == "yes"
    edit(folder, name, on_gpu(1.2))
    [cells] = table_rows(results_page.render(folder), "load: device memory")
    assert cells[4] == "1.20x" and cells[6] == "**no**"


def test_model_is_the_results_own_geometry(tmp_path):
    old = "real_size_cpu_llama-3.2-1b_2026-11-28.json"
    folder = copy(tmp_path, old)
    new = "real_size_h100_2026-12-01.json"           # no model in the name: the result's own "geometry" names it
    (folder / old).rename(folder / new)
    edit(folder, new, lambda d: d.update(geometry="llama-3.2-1b"))
    assert "**llama-3.2-1b**, 16 layers" in results_page.render(folder)


def test_serve_load_verdicts_follow_the_rows(tmp_path):
    name = "serve_load_cpu_2026-11-28.json"
    folder = copy(tmp_path, name)

    def slow_http(doc):                  # HTTP at 80 % of the in-process throughput, 20 ms later to first token
        doc["rows"]["http"]["tokens_per_s"] = 0.8 * doc["rows"]["in_process"]["tokens_per_s"]
        doc["rows"]["http"]["ttft_p50_s"] = doc["rows"]["in_process"]["ttft_p50_s"] + 0.020

    edit(folder, name, slow_http)
    rows = table_rows(results_page.render(folder), "throughput") + table_rows(results_page.render(folder),
                                                                               "time to first token, p50 / p99 |")
    assert rows[0][4] == "0.80x" and rows[0][6] == "**no**"
    assert rows[1][4] == "+20.0 ms" and rows[1][6] == "**no**"

    def fast_http(doc):
        doc["rows"]["http"]["tokens_per_s"] = doc["rows"]["in_process"]["tokens_per_s"]
        doc["rows"]["http"]["ttft_p50_s"] = doc["rows"]["in_process"]["ttft_p50_s"] + 0.001

    edit(folder, name, fast_http)
    rows = table_rows(results_page.render(folder), "throughput") + table_rows(results_page.render(folder),
                                                                               "time to first token, p50 / p99 |")
    assert rows[0][6] == "yes" and rows[1][6] == "yes"
