"""bench/report_runtime.py (decode-step and prefill timings) runs end to end on the CPU, checks every row's
logits against the unsplit model, and states its targets from the rows it measured."""
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_report_runtime_quick_cpu(tmp_path):
    pytest.importorskip("transformers")
    from bench.report_runtime import STATIC_STEP_CPU, STATIC_STREAMS_CPU

    out = tmp_path / "runtime.json"
    r = subprocess.run([sys.executable, "bench/report_runtime.py", "--device", "cpu", "--quick", "--cases", "decode",
                        "--dtype", "bfloat16", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [c["title"] for c in doc["cases"]] == ["decode step, batch 1, 1 token over 16 cached"]
    rows = {row["variant"]: row for row in doc["cases"][0]["rows"]}
    assert set(rows) == {"fastpipe region compiled", "fastpipe region eager", "fastpipe cpu processor eager",
                         "unsplit eager", "unsplit compiled", "unsplit static cache eager",
                         "unsplit static cache compiled", STATIC_STEP_CPU, STATIC_STREAMS_CPU}
    for name, row in rows.items():                 # bf16 rows against the unsplit model in float32
        assert row["error"] == "", (name, row["error"])
        assert row["check"].startswith("ok"), (name, row["check"])
        assert 0 < float(row["check"].split("max err ")[1].split(",")[0]) < 0.1   # bf16 rounding, not exact
        assert row["median_ms"] > 0 and row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
    assert rows["fastpipe region eager"]["compile_s"] is None
    assert rows["fastpipe region compiled"]["compile_s"] > 0 and rows["fastpipe region compiled"]["compile_shared"] is False
    v = doc["cases"][0]["verdicts"]
    base = min((rows["unsplit compiled"], rows["unsplit static cache compiled"]), key=lambda r: r["median_ms"])
    assert v["best_unsplit_compiled"] == base["variant"]                 # either cache's compiled model
    best = min((r for n, r in rows.items() if n.startswith("fastpipe")), key=lambda r: r["median_ms"])
    assert v["best_fastpipe"] == best["variant"]
    assert v["best_vs_unsplit_compiled"] == pytest.approx(best["median_ms"] / base["median_ms"])
    assert doc["failed"] == [] and doc["not_run"] == []
    assert "best fastpipe" in r.stdout and "| fastpipe region compiled |" in r.stdout
    # the engine's decode step on the cpu processor writes every cache in its step (fastpipe.runtime.binding.bind)
    import re

    said = re.search(r"(\d+) state tensors updated in place \((\d+) by an in-place write\)",
                     " ".join(rows[STATIC_STREAMS_CPU]["notes"]))
    assert said and said.group(1) == said.group(2) and int(said.group(1)) > 0, rows[STATIC_STREAMS_CPU]["notes"]
    assert v["static_streams_row"] == STATIC_STREAMS_CPU and v["static_streams_vs_region"] == pytest.approx(
        rows[STATIC_STREAMS_CPU]["median_ms"] / rows[STATIC_STEP_CPU]["median_ms"])
    assert "the engine's decode step on a processor of slots apart" in r.stdout


def test_report_runtime_quick_cpu_prefill_has_the_serving_prefill_and_its_baseline(tmp_path):
    """The prefill case adds the serving set's prefill (the last token's logits) and the unsplit model with
    logits_to_keep=1; both are checked against the last position of the float32 model's logits, and held
    against each other and against the full-logits rows in their own verdicts, not in the 1.1x target's."""
    pytest.importorskip("transformers")
    from bench.report_runtime import SERVING_PREFILL_CPU, UNSPLIT_LAST

    out = tmp_path / "runtime.json"
    r = subprocess.run([sys.executable, "bench/report_runtime.py", "--device", "cpu", "--quick", "--cases", "prefill",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    case = json.loads(out.read_text())["cases"][0]
    rows = {row["variant"]: row for row in case["rows"]}
    assert {SERVING_PREFILL_CPU, UNSPLIT_LAST[0], "fastpipe region compiled"} <= set(rows)
    assert UNSPLIT_LAST[1] not in rows                           # reduce-overhead: on a GPU only
    # the serving set's prefill as the engine runs it: the prompts written into their cache rows in place
    assert "state tensors updated in place" in " ".join(rows[SERVING_PREFILL_CPU]["notes"])
    for name in (SERVING_PREFILL_CPU, UNSPLIT_LAST[0]):
        assert rows[name]["error"] == "" and rows[name]["check"].startswith("ok"), (name, rows[name])
        assert rows[name]["median_ms"] > 0
    v = case["verdicts"]
    assert v["best_fastpipe"] != SERVING_PREFILL_CPU and v["best_unsplit_compiled"] not in UNSPLIT_LAST
    assert v["serving_prefill_vs_unsplit_last"] == pytest.approx(
        rows[SERVING_PREFILL_CPU]["median_ms"] / rows[UNSPLIT_LAST[0]]["median_ms"])
    assert v["serving_prefill_vs"] == v["best_fastpipe"]
    assert "serving prefill / best unsplit compiled with logits_to_keep=1" in r.stdout


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=176, vocab_size=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _past_of(cache):
    """[[key, value] per layer] of a transformers DynamicCache (its layers in >= 4.56, key_cache before)."""
    if hasattr(cache, "layers"):
        return [[layer.keys, layer.values] for layer in cache.layers]
    return [list(kv) for kv in zip(cache.key_cache, cache.value_cache)]


@pytest.mark.parametrize("new", [1, 3])
def test_unsplit_steps_match_the_model_over_the_whole_sequence(new):
    """The runtime report's unsplit rows: a step on a DynamicCache built per call and on a StaticCache filled once
    give the logits of the model run over the whole sequence without a cache; the static step again and again (each
    call rewinds the cache to the past: without, the second call writes past the cache's end)."""
    import torch

    from bench.unsplit_calls import StaticStep, hf_call

    model = _tiny_llama()
    g = torch.Generator().manual_seed(1)
    prompt, ids = torch.randint(0, 256, (2, 6), generator=g), torch.randint(0, 256, (2, new), generator=g)
    with torch.inference_mode():
        whole = model(input_ids=torch.cat([prompt, ids], dim=1), use_cache=False).logits[:, -new:]
        out = model(input_ids=prompt, use_cache=True)
        past = _past_of(getattr(out, "cache", None) or out.past_key_values)
        close = functools.partial(torch.testing.assert_close, atol=1e-5, rtol=1e-5)
        close(hf_call(model, ids, past), whole)
        step = StaticStep(model, ids, past)
        for _ in range(3):
            close(step(model), whole)
        prefill = StaticStep(model, prompt, [])                         # no past: the cache sized at set-up
        for _ in range(2):
            close(prefill(model), model(input_ids=prompt, use_cache=False).logits)


def test_measure_stops_at_the_next_sample_once_told():
    """report_runtime's SIGINT handler is remembered: the sample loop stops at its next sample even where the
    KeyboardInterrupt itself was swallowed below it, keeping the samples taken."""
    from bench.report_region import Row, measure

    calls = []
    rows = [Row("a", fn=lambda: calls.append("a")), Row("b", fn=lambda: calls.append("b"))]
    with pytest.raises(KeyboardInterrupt):
        measure(rows, repeat=100, warmup=0, sample_ms=0.0, stop=lambda: len(rows[0].samples) + len(rows[1].samples) >= 3)
    assert [len(r.samples) for r in rows] == [2, 1]


def _row(variant, ms, check="ok"):
    from bench.report_region import Row

    return Row(variant, samples=[ms, ms, ms], check=check)


def test_verdicts_targets():
    from bench.report_runtime import verdict_lines, verdicts

    rows = [_row("fastpipe cuda, graph replay", 1.0), _row("fastpipe cuda, eager streams", 2.5),
            _row("fastpipe region compiled + replay", 0.9), _row("unsplit compiled", 1.2),
            _row("unsplit compiled, reduce-overhead", 0.85), _row("unsplit eager", 3.0)]
    v = verdicts(rows, batch=1)
    assert v["replay_vs_eager_streams"] == pytest.approx(2.5) and v["replay_target_met"] is False
    assert "replay_vs_compiled_streams" not in v
    rows.append(_row("fastpipe cuda, compiled streams", 1.5))
    assert verdicts(rows, batch=1)["replay_vs_compiled_streams"] == pytest.approx(1.5)
    rows.pop()
    assert v["best_fastpipe"] == "fastpipe region compiled + replay"
    assert v["best_unsplit_compiled"] == "unsplit compiled, reduce-overhead"
    assert v["best_vs_unsplit_compiled"] == pytest.approx(0.9 / 0.85) and v["unsplit_target_met"] is True
    assert "replay_target_met" not in verdicts(rows, batch=8)          # the replay target is set at batch 1
    rows[2] = _row("fastpipe region compiled + replay", 0.5, check="MISMATCH (max err 1)")   # wrong rows never win
    assert verdicts(rows, batch=1)["best_fastpipe"] == "fastpipe cuda, graph replay"
    assert "grouped_copies_gain" not in v
    rows[2] = _row("fastpipe region compiled + replay", 0.9)
    rows.append(_row("fastpipe region compiled + replay, a copy per tensor", 1.08))
    assert verdicts(rows, batch=1)["grouped_copies_gain"] == pytest.approx(1.2)
    assert "the replay's copies grouped (one launch per dtype) vs a copy per tensor: 1.20x faster" in verdict_lines(
        verdicts(rows, batch=1))
    assert "aliased_outputs_gain" not in verdicts(rows, batch=1)
    rows.append(_row("fastpipe region compiled + replay, outputs aliased", 0.75))
    v = verdicts(rows, batch=1)
    assert v["aliased_outputs_gain"] == pytest.approx(1.2) and v["best_fastpipe"].endswith("outputs aliased")
    assert "the replay handing out its output buffers vs cloning them: 1.20x faster" in verdict_lines(v)


def test_serving_prefill_verdicts():
    from bench.report_runtime import SERVING_PREFILL_GPU, UNSPLIT_LAST, verdict_lines, verdicts

    rows = [_row("fastpipe region compiled + replay", 2.0), _row("unsplit compiled", 2.2),
            _row(SERVING_PREFILL_GPU, 1.0), _row(UNSPLIT_LAST[0], 1.6), _row(UNSPLIT_LAST[1], 1.25)]
    v = verdicts(rows, batch=1)
    assert v["best_fastpipe"] == "fastpipe region compiled + replay"         # the serving prefill is not in it
    assert v["best_vs_unsplit_compiled"] == pytest.approx(2.0 / 2.2)        # nor the last-token unsplit rows
    assert v["serving_prefill_gain"] == pytest.approx(2.0) and v["serving_prefill_vs"] == rows[0].variant
    assert v["serving_prefill_vs_unsplit_last"] == pytest.approx(0.8) and v["best_unsplit_last"] == UNSPLIT_LAST[1]
    lines = verdict_lines(v)
    assert any(line.startswith("serving prefill (the last token's logits) vs the best fastpipe") and "2.00x" in line
               for line in lines)
    assert any("logits_to_keep=1" in line and "0.80x" in line for line in lines)
    rows[2] = _row(SERVING_PREFILL_GPU, 1.0, check="MISMATCH (max err 1)")     # a wrong serving prefill: no verdict
    assert "serving_prefill_gain" not in verdicts(rows, batch=1)


def test_tolerance_is_float32_noise_plus_twice_the_unsplit_models_own_error():
    import torch

    from bench.report_runtime import tolerance

    ref = torch.tensor([[-10.0, 4.0]])
    assert tolerance(ref, 0.0) == pytest.approx(1e-3)                   # float32: summation noise only
    assert tolerance(ref, 0.15) == pytest.approx(1e-3 + 0.3)             # bf16: the unsplit bf16 model's error


def test_cases_run_batch_by_batch_and_stop_before_one_that_would_overrun():
    from bench.report_runtime import case_order, over_budget

    assert case_order(["decode", "prefill"], [8, 1]) == [("decode", 1), ("prefill", 1), ("decode", 8), ("prefill", 8)]
    assert not over_budget(300.0, 150.0, 480.0) and over_budget(340.0, 150.0, 480.0)
    assert not over_budget(1e6, 1e6, 0.0)                                # no budget


def test_interrupted_run_keeps_the_rows_it_set_up_and_the_samples_it_took(tmp_path):
    """gpu_check stops a stage with SIGINT at its limit: --json is rewritten after each row's set-up ("partial":
    "set-up"), and an interrupted case is written with each row's samples so far ("partial": "interrupted"), the
    cases after it as not run, exit status 130 -- not nothing, as when the JSON was written per case only. The script
    starts with SIGINT ignored, as a background job without job control does: it installs its own handler."""
    import os
    import signal
    import time

    pytest.importorskip("transformers")
    out = tmp_path / "runtime.json"
    tiny = "--layers 1 --hidden 64 --heads 4 --kv-heads 2 --vocab 256 --batches 1 --past 16 --prefill-len 16".split()
    proc = subprocess.Popen([sys.executable, "bench/report_runtime.py", "--device", "cpu", *tiny, "--warmup", "1",
                             "--repeat", "100000", "--sample-ms", "2", "--json", str(out)], cwd=ROOT,   # --quick's
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,   # sizes, timing for ages
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    seen, deadline = [], time.monotonic() + 300
    rows = 9           # decode on the CPU: 3 CPU variants, the engine's step on 2 processors, 4 unsplit rows
    while proc.poll() is None and time.monotonic() < deadline:     # until every row is set up: timing has begun
        if out.exists():
            cases = json.loads(out.read_text())["cases"]
            if cases and cases[-1].get("partial") == "set-up":
                seen.append(len(cases[-1]["rows"]))
                if seen[-1] == rows:
                    break
        time.sleep(0.01)
    if proc.poll() is not None or not seen or seen[-1] != rows:     # say why: the script's own output, if it ended
        tail = proc.stdout.read()[-3000:] if proc.poll() is not None else "(still running: killed)"
        proc.kill()
        pytest.fail(f"rows set up as seen: {seen}; exit status {proc.poll()}; {tail}")
    assert seen == sorted(seen), seen
    time.sleep(3.0)                                               # some rounds of samples
    proc.send_signal(signal.SIGINT)
    try:
        stdout = proc.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the script went on for 120 s after SIGINT: {proc.communicate()[0][-3000:]}")
    assert proc.returncode == 130, stdout[-3000:]
    doc = json.loads(out.read_text())
    (case,) = doc["cases"]
    assert case["partial"] == "interrupted" and case["title"] == "decode step, batch 1, 1 token over 16 cached"
    assert doc["interrupted"].startswith("decode step, batch 1, 1 token over 16 cached: interrupted after ")
    assert f"with {rows} rows set up and {rows} timed" in doc["interrupted"] and doc["not_run"] == ["prefill batch 1"]
    counts = [r["samples"] for r in case["rows"]]
    assert min(counts) >= 1 and max(counts) - min(counts) <= 1, counts     # interleaved rounds
    assert all(r["check"].startswith("ok") for r in case["rows"])
    assert case["verdicts"]["best_vs_unsplit_compiled"] > 0               # verdicts from the samples it has
    assert "(INTERRUPTED)" in stdout and os.path.exists(out)
