"""bench/serve_load.py end to end at the smallest size: both paths serve every request whole, and the result
file holds what the results page reads."""
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("uvicorn")

from bench import serve_load  # noqa: E402


def test_serve_load_runs_both_paths_and_writes_its_result(tmp_path):
    out = tmp_path / "serve_load.json"
    assert serve_load.main(["--quick", "--requests", "6", "--clients", "3", "--rounds", "1", "--solo", "2",
                            "--output-lens", "4-4", "--batches", "1,4", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    for path, n in (("in_process", 6), ("http", 6), ("in_process_solo", 2), ("http_solo", 2), ("in_process_waves", 6),
                    ("http_waves", 6)):
        assert rows[path]["tokens"] == n * 4                       # every request made all its tokens
        assert 0 < rows[path]["ttft_p50_s"] <= rows[path]["ttft_p99_s"]
    assert doc["throughput_kept"] == pytest.approx(rows["http"]["tokens_per_s"] / rows["in_process"]["tokens_per_s"])
    assert doc["machine"]["date"] and doc["model"]["batch"] == 4 and doc["stack"]["uvicorn"]


def test_percentiles_and_summary():
    assert serve_load.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    s = serve_load.summary([{"sent": 0.0, "times": [1.0, 1.5, 2.0]}, {"sent": 1.0, "times": [1.5, 3.5]}], wall=4.0)
    assert s["tokens"] == 5 and s["tokens_per_s"] == 1.25
    assert s["ttft_p50_s"] == 0.75 and s["itl_p50_s"] == 0.5        # TTFT 1.0 and 0.5; gaps 0.5, 0.5, 2.0
