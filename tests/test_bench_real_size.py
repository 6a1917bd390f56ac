"""bench/report_real_size.py and bench/report_scale.py run end to end on a small checkpoint of a real
geometry's family (the numbers are the CPU's at toy size; what is checked is that every row runs,
its logits are checked, and the verdicts are computed from the measures)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from bench import report_real_size, report_scale  # noqa: E402
from bench.real_checkpoint import GEOMETRIES, write_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    g = replace(GEOMETRIES["llama-3.2-1b"], hidden=64, heads=8, kv_heads=2, intermediate=96, layers=2, vocab=256)
    return write_checkpoint(g, tmp_path_factory.mktemp("real_size") / "ckpt")


def test_decode_and_prefill_rows_run_check_their_logits_and_get_verdicts(ckpt, tmp_path):
    out = tmp_path / "r.json"
    rc = report_real_size.main(["--checkpoint", str(ckpt), "--tp", "1,2", "--batches", "2", "--prompt-lens", "8",
                                "--max-len", "16", "--eager", "--repeat", "2", "--sample-ms", "5", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["machine"]["torch"]
    decode, prefill = doc["cases"]
    assert decode["copy_bandwidth_gb_s"] > 0 and prefill["matmul_tflop_s"] > 0
    labels = [r["label"] for r in decode["rows"]]
    assert labels == ["fastpipe tp=1, region processor", "fastpipe tp=2, region processor",
                      "transformers static, eager", "gpt-fast style, eager", report_real_size.GEMM_FLOOR]
    floor = decode["rows"].pop()               # the kernels' floor: timed, no model, no logits
    assert floor["median_s"] > 0 and floor["logits_check"] is None
    for r in decode["rows"]:
        assert r["error"] is None and r["logits_check"] == "ok" and len(r["samples_s"]) == 2
        assert r["bytes_per_step"] > 0 and r["gb_per_s"] == pytest.approx(r["bytes_per_step"] / r["median_s"] / 1e9)
    v = decode["verdicts"]
    assert v["logits_ok"] and set(v["rows"]) == set(labels[:2])
    best = min(r["median_s"] for r in decode["rows"][2:])
    for r in decode["rows"][:2]:
        got = v["rows"][r["label"]]
        assert got["vs_faster_baseline"]["ratio"] == pytest.approx(r["median_s"] / best)
        assert got["vs_faster_baseline"]["met"] == (got["vs_faster_baseline"]["ratio"] <= 1.05)
        assert got["bandwidth_fraction"]["value"] == pytest.approx(r["bandwidth_fraction"])
        assert r["bandwidth_fraction"] == pytest.approx(r["gb_per_s"] / decode["copy_bandwidth_gb_s"])
    assert prefill["prompt_len"] == 8 and prefill["verdicts"]["logits_ok"]
    assert all(r["error"] is None and r["logits_check"] == "ok" and r["tflop_per_s"] > 0 for r in prefill["rows"])


def test_a_row_checked_against_another_process_saved_float32_logits(ckpt, tmp_path):
    """--rows gptfast,f32 saves the bf16 model's logits and its weights computed in float32; the latter
    equal transformers' float32 model (checked here), and a fastpipe run in another call is held to them."""
    saved, first, out = tmp_path / "l.pt", tmp_path / "a.json", tmp_path / "r.json"
    args = ["--checkpoint", str(ckpt), "--batches", "1", "--max-len", "16", "--eager", "--repeat", "1",
            "--sample-ms", "5"]
    assert report_real_size.main(args + ["--rows", "gptfast,f32", "--save-logits", str(saved), "--json", str(first)]) == 0
    bf16, f32, floor = json.loads(first.read_text())["cases"][0]["rows"]
    assert floor["label"] == report_real_size.GEMM_FLOOR
    assert f32["label"] == report_real_size.F32_LABEL and f32["samples_s"] == []      # checked, not timed
    assert f32["max_abs_err"] < 1e-4 < bf16["max_abs_err"]          # float32 itself, unlike the bf16 row
    doc = torch.load(saved)
    assert doc[1]["reference"] == f32["label"] and doc[1]["own_err"] == pytest.approx(
        (doc[1]["rows"][bf16["label"]] - doc[1]["rows"][f32["label"]]).abs().max().item())
    assert report_real_size.main(args + ["--no-f32-check", "--rows", "fastpipe", "--check-against", str(saved),
                                         "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["cases"][0]["rows"]
    assert row["logits_check"] == "ok" and 0 < row["max_abs_err"] <= 2 * doc[1]["own_err"]


def test_build_and_load_measured_in_processes_of_their_own(ckpt, tmp_path):
    out = tmp_path / "s.json"
    report_scale.main(["--checkpoint", str(ckpt), "--tp", "1,2", "--pp", "1,2", "--sections", "build,load", "--load-tp", "2",
                       "--max-len", "16", "--rounds", "1", "--json", str(out)])
    doc = json.loads(out.read_text())
    builds = [r for r in doc["rows"] if r["section"] == "build"]
    assert [(r["tp"], r["pp"]) for r in builds] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for r in builds:
        assert "error" not in r and r["weight_bytes_copied"] == 0 and 0 < r["bytes_written"] < r["peak"]
    loads = [r for r in doc["rows"] if r["section"] == "load"]
    assert [r["label"] for r in loads] == ["safetensors load_file", "fastpipe.load tp=2"]
    assert all("error" not in r and r["s"] > 0 for r in loads)
    v = doc["verdicts"]
    assert v["build"]["weight_bytes_copied"] == 0 and v["load_time_ratio"] == pytest.approx(loads[1]["s"] / loads[0]["s"])


def test_the_float32_row_of_the_same_run_is_the_reference_when_no_other_is_computed(ckpt, tmp_path):
    out = tmp_path / "r.json"
    rc = report_real_size.main(["--checkpoint", str(ckpt), "--tp", "2", "--batches", "1", "--prompt-lens", "8",
                                "--max-len", "16", "--eager", "--repeat", "1", "--sample-ms", "5", "--no-f32-check",
                                "--rows", "fastpipe,transformers,gptfast,f32", "--json", str(out)])
    assert rc == 0
    for case in json.loads(out.read_text())["cases"]:
        rows = {r["label"]: r for r in case["rows"]}
        f32 = rows.pop(report_real_size.F32_LABEL)
        assert f32["max_abs_err"] == 0 and f32["samples_s"] == []       # the reference itself, not timed
        rows.pop(report_real_size.GEMM_FLOOR, None)
        assert len(rows) == 3 and all(r["logits_check"] == "ok" and r["max_abs_err"] > 0 for r in rows.values())
