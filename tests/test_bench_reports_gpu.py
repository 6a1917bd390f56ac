"""The GPU paths of the runtime, serving and memory report scripts, at --quick sizes, on a GPU (marked `cuda`).

Their CPU paths run in CI (tests/test_bench_report_runtime.py, _serving.py, _memory.py); what only a GPU runs --
the cuda processor's streams and replay, the engine's captured decode step, measured peak memory, graph pools --
runs here, in scripts/gpu_check.sh's `tests` stage, so a broken GPU path shows up there (with its traceback)
before a stage spends its minutes on the full-size run. Each script checks its own numerics (logits against float32,
tokens against transformers); these tests check that every row ran, replayed where it should, and passed.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda
ROOT = Path(__file__).resolve().parents[1]


def _script(name: str, tmp_path, *args) -> tuple[dict, str]:
    out = tmp_path / f"{name}.json"
    r = subprocess.run([sys.executable, f"bench/report_{name}.py", *args, "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return json.loads(out.read_text()), r.stdout


def test_runtime_table_on_a_gpu(tmp_path):
    """The runtime report, decode at batch 1: every fastpipe variant and the unsplit model ran and matched float32;
    the replay rows replayed; the targets' ratios were computed (not met or missed: that is the full-size run's)."""
    pytest.importorskip("transformers")
    doc, _ = _script("runtime", tmp_path, "--device", "cuda", "--quick", "--cases", "decode")
    (case,) = doc["cases"]
    rows = {r["variant"]: r for r in case["rows"]}
    from bench.report_runtime import CUDA_VARIANTS, STATIC_STEP_GPU, STATIC_STREAMS_GPU, UNSPLIT_COMPILED

    assert set(rows) == {v for v, _ in CUDA_VARIANTS} | {"unsplit eager", "unsplit static cache eager",
                                                         *UNSPLIT_COMPILED, STATIC_STEP_GPU, STATIC_STREAMS_GPU}
    for name, row in rows.items():          # the unsplit compiled rows are torch's: one working is enough (below)
        if name.startswith("fastpipe") or name.endswith(" eager"):
            assert row["error"] == "" and row["check"].startswith("ok"), (name, row)
            assert row["median_ms"] > 0, name
    for name in ("fastpipe region compiled + replay", "fastpipe region compiled + replay, a copy per tensor",
                 "fastpipe region compiled + replay, outputs aliased", STATIC_STEP_GPU, STATIC_STREAMS_GPU):
        assert any("replayed as one CUDA graph" in n for n in rows[name]["notes"]), rows[name]["notes"]
    v = case["verdicts"]
    assert {"replay_vs_eager_streams", "replay_target_met", "replay_vs_compiled_streams", "grouped_copies_gain",
            "aliased_outputs_gain", "static_streams_vs_region", "best_vs_unsplit_compiled"} <= set(v), v
    assert "state tensors updated in place" in " ".join(rows[STATIC_STREAMS_GPU]["notes"])
    assert doc["failed"] == [] and "interrupted" not in doc


def test_serving_table_on_a_gpu(tmp_path):
    """The serving report, eager (--no-compile): the engine with its decode step captured and replayed, and without,
    against transformers' generate; continuous batching; memory per token; buckets' weights."""
    pytest.importorskip("transformers")
    doc, _ = _script("serving", tmp_path, "--device", "cuda", "--quick", "--no-compile")
    assert doc["status"] == "done" and doc["failed_sections"] == [], doc["failed_sections"]
    assert doc["device"].startswith("cuda") and sorted(doc["sections"]) == ["1", "2", "3", "4"]
    rows = [r for s in doc["sections"].values() for r in s["rows"]]
    assert not [r for r in rows if r.get("error")]
    engines = [r for r in rows if r.get("kind") == "engine"]
    assert engines and all(r["how"]["device"].startswith("cuda") for r in engines)
    replayed = [r for r in doc["sections"]["1"]["rows"] if r.get("cuda_graph") is True]
    assert replayed and all("replayed as one CUDA graph" in r["how"]["decode"] for r in replayed), replayed
    assert doc["sections"]["3"]["cuda_allocated_bytes"], "memory per token on the GPU"


def test_memory_table_on_a_gpu(tmp_path):
    """The load and memory report, tiny (--quick, eager regions): loads onto the GPU timed against safetensors; the
    measured peak of each processor's run beside the plan's; 3 buckets' graphs in one pool against one."""
    pytest.importorskip("transformers")
    doc, _ = _script("memory", tmp_path, "--device", "cuda", "--quick", "--compile", "off", "--tmp", str(tmp_path))
    assert list(doc["sections"]) == ["load", "memory", "pool"] and doc["device"].startswith("cuda")
    assert not [r for r in doc["rows"] if "error" in r], [r for r in doc["rows"] if "error" in r]
    load = doc["sections"]["load"]["rows"]
    assert all(r["every_byte_on_device"] and r["ratio"] > 0 for r in load)
    assert all(r["pinned_vs_pageable"] == pytest.approx(r["fastpipe_s"] / r["pageable_s"]) for r in load)
    assert all(len(r["pageable_times_s"]) == len(r["fastpipe_times_s"]) for r in load)
    assert all(r["one_thread_vs_pinned"] == pytest.approx(r["one_thread_s"] / r["fastpipe_s"]) for r in load)
    memory = doc["sections"]["memory"]["rows"]
    assert len(memory) == 9 and all(r["measured"] is True and r["peak_allocated_bytes"] > 0 for r in memory)
    from bench.report_memory import last_logits_gain   # 3 shapes x 3 processors; the serving prefill's ratios

    gains = last_logits_gain(memory, cuda=True)
    assert len(gains) == 3 and all(0 < g["plan_activations"] < 1 and "run_own" in g for g in gains), gains
    assert all(r["load_peak_bytes"] >= r["constants_measured_bytes"] > 0 for r in memory), memory
    assert all(r["replayed"] for r in memory if "cuda_graph=True" in r["processor"]), memory
    pool = doc["sections"]["pool"]["rows"]
    assert len(pool) == 3 and all(r["every_run_replayed"] for r in pool), pool
