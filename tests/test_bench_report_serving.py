"""bench/report_serving.py (the serving benchmark) runs end to end on the CPU in its smoke form (--quick
--no-compile --device cpu): every section is in its JSON, every engine row made transformers' greedy tokens
and measured a rate; --sections runs only the sections named."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *extra):
    out = tmp_path / "serving.json"
    r = subprocess.run([sys.executable, "bench/report_serving.py", "--quick", "--no-compile", "--device", "cpu",
                        "--json", str(out), *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text()), r.stdout


def test_report_serving_quick_cpu(tmp_path):
    pytest.importorskip("transformers")
    doc, stdout = _run(tmp_path)
    assert doc["status"] == "done" and doc["failed_sections"] == []
    assert doc["device"] == "cpu" and doc["dtype"] == "float32"
    assert doc["machine"]["torch"] and doc["machine"]["device"]
    assert sorted(doc["sections"]) == ["1", "2", "3", "4"]
    assert not any(sec.get("partial") for sec in doc["sections"].values())     # every section finished
    engine_rows = [r for s in doc["sections"].values() for r in s["rows"] if r["kind"] == "engine"]
    assert len(engine_rows) == 2 + 2 + 1          # section 1: tp=2 and tp=1 eager; 2: solo and batched; 3
    for row in engine_rows:
        assert not row.get("error"), row
        assert row["tokens"] == "identical", row
        assert row["tokens_per_s"] > 0
        assert row["how"]["device"] == "cpu" and row["how"]["decode"].startswith("region processor")
    s1 = {r["variant"]: r for r in doc["sections"]["1"]["rows"]}
    assert not any("compile" in v for v in s1 if v.startswith("transformers"))       # --no-compile
    assert s1["transformers generate, static cache, eager"]["tokens"] == "reference"
    assert all(r["ratio"] > 0 for r in s1.values())
    s3 = doc["sections"]["3"]
    assert len(s3["rss_bytes"]) == doc["args"]["rss_tokens"] and s3["cuda_allocated_bytes"] is None
    w = {r["variant"]: r for r in doc["sections"]["4"]["rows"]}
    assert w["ModelSet, 3 buckets"]["ratio"] <= 1.1
    assert "| fastpipe engine, batch 1, tp=2 set, eager " in stdout and "\n4. 3 exact-size buckets" in stdout


def test_report_serving_sections(tmp_path):
    pytest.importorskip("transformers")
    doc, _ = _run(tmp_path, "--sections", "4")
    assert list(doc["sections"]) == ["4"] and doc["status"] == "done"


def test_report_keeps_a_sections_rows_as_they_come(tmp_path):
    from bench.report_serving import Report

    path = tmp_path / "serving.json"
    report = Report(str(path), {"status": "running"})
    rows = [{"variant": "transformers generate, static cache, eager", "seconds": 1.0}]
    report.partial("1", rows)
    rows.append({"variant": "fastpipe engine", "error": "RuntimeError: x"})
    report.partial("1", rows)
    doc = json.loads(path.read_text())
    assert doc["sections"]["1"]["partial"] is True and [r["variant"] for r in doc["sections"]["1"]["rows"]] == \
        ["transformers generate, static cache, eager", "fastpipe engine"]
    report.add("1", {"title": "greedy decode", "rows": rows})
    assert "partial" not in json.loads(path.read_text())["sections"]["1"]
    assert not path.with_name(path.name + ".tmp").exists()
