"""bench/report_memory.py runs end to end on the CPU (--quick): the load section times both sides and
gives a ratio, the memory section gives the plan's rows (the measured columns need a GPU), and the
pool section says it needs a GPU instead of printing numbers. Its GPU paths run on a GPU machine:
`python bench/report_memory.py --json out.json`."""
import json

import pytest

from bench.report_memory import main


def _run(tmp_path, sections: str) -> dict:
    out = tmp_path / "rows.json"
    assert main(["--quick", "--device", "cpu", "--sections", sections, "--tmp", str(tmp_path),
                 "--json", str(out)]) == 0
    assert not (tmp_path / "rows.json.tmp").exists()          # written by tmp + os.replace
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["machine"]["fastpipe"]
    assert list(doc["sections"]) == sections.split(",")
    assert doc["rows"] == [r for s in doc["sections"].values() for r in s["rows"]]
    return doc


def test_load_rows_and_pool_needs_a_gpu_on_cpu(tmp_path):
    doc = _run(tmp_path, "load,pool")
    load = doc["sections"]["load"]["rows"]
    assert [r["mode"] for r in load] == ["cold", "warm"]
    for r in load:
        assert "error" not in r, r
        assert r["baseline_s"] > 0 and r["fastpipe_s"] > 0
        assert r["ratio"] == pytest.approx(r["fastpipe_s"] / r["baseline_s"])
        assert r["bytes"] >= 15 * 2**20 and r["every_byte_on_device"] is True
        assert r["fastpipe_bytes_per_s"] == pytest.approx(r["bytes"] / r["fastpipe_s"])
        assert len(r["baseline_times_s"]) == len(r["fastpipe_times_s"]) == 2
        assert "pageable_s" not in r and "one_thread_s" not in r   # the CPU makes no copy: one fastpipe side
    pool = doc["sections"]["pool"]["rows"]
    assert len(pool) == 1 and pool[0]["status"] == "needs a GPU"
    assert not any(k.endswith("_bytes") for k in pool[0])     # no numbers made up


def test_one_intra_op_thread_for_the_call_only():
    import torch

    from bench.report_memory import one_intra_op_thread

    before = torch.get_num_threads()
    seen = []
    assert one_intra_op_thread(lambda: seen.append(torch.get_num_threads()) or "out")() == "out"

    def fails():
        raise ValueError("x")
    with pytest.raises(ValueError):
        one_intra_op_thread(fails)()
    assert seen == [1] and torch.get_num_threads() == before


def test_memory_plan_rows_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    doc = _run(tmp_path, "memory")
    rows = doc["sections"]["memory"]["rows"]
    assert {(r["kind"], r["processor"]) for r in rows} == {
        (s, p) for s in ("decode", "prefill", "serving_prefill") for p in ("cpu", "region")}
    for r in rows:
        assert "error" not in r, r
        assert r["predicted_peak_bytes"] > 0 and r["constant_bytes"] > 0 and r["activation_bytes"] > 0
        assert r["predicted_peak_bytes"] == r["constant_bytes"] + r["activation_bytes"]
        assert r["measured"] is None and "needs a GPU" in r["note"]
    # the serving prefill (one position's logits) plans fewer activations than every position's logits
    from bench.report_memory import last_logits_gain

    gains = last_logits_gain(rows, cuda=False)
    assert [g["processor"] for g in gains] == ["cpu", "region"]
    for g in gains:
        assert 0 < g["plan_activations"] < 1 and 0 < g["plan_peak"] < 1, g
    # ... and runs as the engine runs it, writing its caches into the caller's: the region processor in its
    # graph, the cpu processor in the step that writes them (fastpipe.runtime.binding.bind): neither plans them
    serving = {r["processor"]: r for r in rows if r["kind"] == "serving_prefill"}
    assert all(r["options"]["state_in_place"] for r in serving.values())
    assert serving["region"]["activation_bytes"] == serving["cpu"]["activation_bytes"]


def test_memory_rows_are_written_as_they_come_and_tmp_is_made(tmp_path, monkeypatch):
    """A run cut at its time limit keeps the memory section's finished rows: the JSON is written after each row
    ("partial" until the section ends); --tmp names a folder that need not exist yet."""
    pytest.importorskip("transformers")
    import bench.report_memory as rm

    written = []
    real = rm.write_json
    monkeypatch.setattr(rm, "write_json", lambda path, doc: (written.append(json.loads(json.dumps(doc))),
                                                              real(path, doc)))
    out, tmp = tmp_path / "rows.json", tmp_path / "not" / "yet"
    assert rm.main(["--quick", "--device", "cpu", "--sections", "memory", "--tmp", str(tmp), "--json", str(out)]) == 0
    assert tmp.is_dir() and not list(tmp.iterdir())            # made, and the run's own folder removed after
    partial = [d["sections"]["memory"] for d in written if d["sections"].get("memory", {}).get("partial")]
    assert [len(s["rows"]) for s in partial] == [1, 2, 3, 4, 5, 6]     # 3 shapes x (cpu, region), one write each
    final = json.loads(out.read_text())
    assert "partial" not in final["sections"]["memory"] and final["rows"] == final["sections"]["memory"]["rows"]
    assert partial[-1]["rows"] == final["rows"]
    assert [d["rows"] for d in written if d["sections"].get("memory", {}).get("partial")][1] == final["rows"][:2]
