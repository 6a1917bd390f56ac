"""The GPU-run tooling, on CPU: tests/run_log.py (the pytest plugin writing a JSON line per result,
--cuda-first), scripts/results_summary.py (the run's summary), and scripts/gpu_check.sh's stages end
to end, with its SIGINT at the call's limit. Each pytest run here is a subprocess."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.examples import ROOT

_spec = importlib.util.spec_from_file_location("results_summary", ROOT / "scripts" / "results_summary.py")
results_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_summary)

SYNTHETIC = '''
import time
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

@pytest.fixture
def bad_teardown():
    yield
    raise RuntimeError("teardown broke")

def test_pass():
    pass

def test_fail():
    assert 1 + 1 == 3, "arithmetic is off"

@pytest.mark.cuda
def test_gpu_pass():
    pass

@pytest.mark.cuda
def test_gpu_skipped():
    pytest.skip("needs a CUDA GPU (as conftest says)")

def test_setup_error(broken):
    pass

def test_teardown_error(bad_teardown):
    pass

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False

@pytest.mark.parametrize("p", ["cuda", "cpu"])
def test_param_named_cuda(p):
    pass
'''


def _pytest(cwd, *args, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.run_log", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=180, **kw)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def synthetic(tmp_path):
    (tmp_path / "test_synthetic.py").write_text(SYNTHETIC)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: needs a GPU\n")
    return tmp_path


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_a_line_per_result_and_the_summary(synthetic, workers):
    out = synthetic / "r.jsonl"
    proc = _pytest(synthetic, "--results-jsonl", str(out), *workers)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    recs = _lines(out)
    assert recs[0]["event"] == "start" and recs[-1]["event"] == "finished" and recs[-1]["exitstatus"] == 1
    assert {r["n"] for r in recs if r.get("event") == "collected"} == {9}
    res = {(r["nodeid"].split("::")[1], r["when"]): r for r in recs if "nodeid" in r}
    assert {k: r["outcome"] for k, r in res.items()} == {
        ("test_pass", "call"): "passed", ("test_fail", "call"): "failed", ("test_gpu_pass", "call"): "passed",
        ("test_gpu_skipped", "call"): "skipped", ("test_setup_error", "setup"): "error",
        ("test_teardown_error", "call"): "passed", ("test_teardown_error", "teardown"): "error",
        ("test_xfail", "call"): "xfailed", ("test_param_named_cuda[cuda]", "call"): "passed",
        ("test_param_named_cuda[cpu]", "call"): "passed"}
    # the marker, not a keyword: a parameter named "cuda" is no cuda test
    assert sorted(k[0] for k, r in res.items() if r["cuda"]) == ["test_gpu_pass", "test_gpu_skipped"]
    assert res[("test_fail", "call")]["message"] == "AssertionError: arithmetic is off assert (1 + 1) == 3"
    assert res[("test_setup_error", "setup")]["message"] == "RuntimeError: fixture broke"
    assert res[("test_gpu_skipped", "call")]["message"] == "Skipped: needs a CUDA GPU (as conftest says)"
    # failures and errors carry their traceback (the GPU machine's log may have none); the rest do not
    assert "def test_fail" in res[("test_fail", "call")]["longrepr"]
    assert "fixture broke" in res[("test_setup_error", "setup")]["longrepr"]
    assert {k for k, r in res.items() if "longrepr" in r} == {
        ("test_fail", "call"), ("test_setup_error", "setup"), ("test_teardown_error", "teardown")}

    lines, green = results_summary.summarise(str(out), slowest=3)
    text = "\n".join(lines)
    assert not green
    assert lines[0].startswith("run finished in ") and lines[0].endswith("exit status 1")
    assert lines[1] == "all:  5 passed, 1 failed, 2 error, 1 skipped, 1 xfailed"
    assert lines[2] == "cuda: 1 passed, 0 failed, 1 skipped"
    assert "test_synthetic.py::test_fail (call, " in text and "failed: AssertionError: arithmetic is off" in text
    assert "test_synthetic.py::test_teardown_error (teardown, " in text
    assert "  1 x Skipped: needs a CUDA GPU (as conftest says)" in text
    assert lines[-1] == ("rerun: bash scripts/gpu_check.sh tests 'test_synthetic.py::test_fail' "
                         "'test_synthetic.py::test_setup_error' 'test_synthetic.py::test_teardown_error'")
    _, green_gpu = results_summary.summarise(str(out), expect_cuda=True)
    assert not green_gpu


def test_summary_green_only_for_a_whole_gpu_run(tmp_path):
    path = tmp_path / "r.jsonl"

    def write(*recs, torn=False):
        path.write_text("".join(json.dumps(r) + "\n" for r in recs) + ('{"nodeid": "t::x", "outc' if torn else ""))
        return results_summary.summarise(str(path), slowest=0, expect_cuda=True)

    start, done = {"event": "start"}, {"event": "finished", "exitstatus": 0, "duration": 1.0}

    def res(name, outcome, cuda, message=""):
        return {"nodeid": f"t.py::{name}", "outcome": outcome, "cuda": cuda, "duration": 0.1, "when": "call",
                "message": message}
    gpu, cpu = res("g", "passed", True), res("c", "passed", False)
    lines, green = write(start, {"event": "collected", "n": 2}, gpu, cpu, done)
    assert green and lines[1:3] == ["all:  2 passed, 0 failed", "cuda: 1 passed, 0 failed"]
    assert write(start, {"event": "collected", "n": 1}, cpu, done)[1]          # no cuda test asked for: fine
    # cut off: no finished line, a torn last line, tests without a result
    lines, green = write(start, {"event": "collected", "n": 3}, gpu, cpu, torn=True)
    assert not green and lines[0] == "run CUT OFF (no 'finished' line); NO RESULT for 1 of 3 collected tests"
    # finished with status 0 yet tests missing (xdist interrupted)
    lines, green = write(start, {"event": "collected", "n": 3}, gpu, cpu, done)
    assert not green and lines[0].endswith("NO RESULT for 1 of 3 collected tests")
    # cuda tests skipped for want of a GPU: not a GPU run
    skipped = res("g", "skipped", True, "Skipped: needs a CUDA GPU (x)")
    lines, green = write(start, {"event": "collected", "n": 2}, skipped, cpu, done)
    assert not green and lines[-1] == "NOT A GPU RUN: 1 cuda-marked tests skipped for want of a GPU, 0 passed"
    assert results_summary.main([str(tmp_path / "absent.jsonl")]) == 2


def test_cuda_first_orders_files_not_tests():
    node = ["tests/test_cli.py::test_console_script_installed", "tests/test_weights_gpu.py", "tests/test_layering.py"]
    plain = _pytest(ROOT, "--collect-only", "-q", *node)
    first = _pytest(ROOT, "--collect-only", "-q", "--cuda-first", *node)
    assert plain.returncode == first.returncode == 0, plain.stdout + first.stdout
    ids = [line for line in first.stdout.splitlines() if "::" in line]
    before = [line for line in plain.stdout.splitlines() if "::" in line]
    assert sorted(ids) == sorted(before) and len(ids) > 4
    files = [i.split("::")[0] for i in ids]
    assert files[0] == "tests/test_weights_gpu.py" and before[0].startswith("tests/test_cli.py")
    n_gpu = files.count("tests/test_weights_gpu.py")
    assert set(files[:n_gpu]) == {"tests/test_weights_gpu.py"}
    assert ids[n_gpu:] == [i for i in before if not i.startswith("tests/test_weights_gpu.py")]   # the rest as before


def test_cuda_first_under_xdist_loadfile(tmp_path):
    """pytest-xdist (>= 3.6) hands out the files with the most tests first: --cuda-first turns that off."""
    node = ["tests/test_cli.py::test_console_script_installed", "tests/test_layering.py", "tests/test_weights_gpu.py"]
    first = {}
    for flag in ([], ["--cuda-first"]):
        out = tmp_path / f"r{len(flag)}.jsonl"
        proc = _pytest(ROOT, "-q", "-n", "1", "--dist", "loadfile", "--results-jsonl", str(out), *flag, *node)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        first[bool(flag)] = next(r["nodeid"] for r in _lines(out) if "nodeid" in r).split("::")[0]
    assert first[True] == "tests/test_weights_gpu.py"
    assert first[False] != "tests/test_weights_gpu.py"    # xdist 3.8: test_layering.py (29 tests) first


def test_cuda_first_under_xdist_worksteal(tmp_path):
    """What gpu_check's tests stage runs (--dist worksteal): each worker starts on its share of the tests in
    collection order, so with --cuda-first the first worker starts on the cuda files."""
    node = ["tests/test_cli.py::test_console_script_installed", "tests/test_layering.py", "tests/test_weights_gpu.py"]
    out = tmp_path / "r.jsonl"
    proc = _pytest(ROOT, "-q", "-n", "1", "--dist", "worksteal", "--results-jsonl", str(out), "--cuda-first", *node)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = [r["nodeid"].split("::")[0] for r in _lines(out) if "nodeid" in r]
    n_gpu = files.count("tests/test_weights_gpu.py")
    assert n_gpu and set(files[:n_gpu]) == {"tests/test_weights_gpu.py"}, files


def test_sigint_at_the_limit_keeps_the_results(tmp_path):
    """What gpu_check's `timeout -s INT` does at the call's limit: the results so far are on disk."""
    (tmp_path / "test_slow.py").write_text(textwrap.dedent('''
        import time
        def test_quick():
            pass
        def test_slow():
            time.sleep(60)
        def test_never():
            pass
    '''))
    out = tmp_path / "r.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # gpu_check's entry point: Ctrl-C raises also where the suite itself runs with SIGINT ignored
    proc = subprocess.Popen([sys.executable, "-m", "tests.run_log", "-p", "no:cacheprovider",
                             "--results-jsonl", str(out), "-q"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    while '"test_slow.py::test_quick"' not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() - t0 < 60 and proc.poll() is None
        time.sleep(0.1)
    time.sleep(0.5)                                       # inside test_slow's sleep
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    recs = _lines(out)
    assert [r["nodeid"] for r in recs if "nodeid" in r] == ["test_slow.py::test_quick"]
    assert recs[-1]["event"] == "finished" and recs[-1]["exitstatus"] == 2       # pytest: interrupted
    lines, green = results_summary.summarise(str(out), slowest=0)
    assert not green and lines[0].endswith("NO RESULT for 2 of 3 collected tests")


@pytest.mark.parametrize("limit_hit", [False, True], ids=["whole", "cut-at-the-limit"])
def test_gpu_check_tests_stage_on_cpu(tmp_path, limit_hit):
    """gpu_check.sh's `tests` stage, here without a GPU (and without the install): one pytest with
    this plugin, its summary in summary.txt and on stdout; red, since the cuda tests could not run. At the
    call's limit (GPU_CHECK_CALL_S; 30 s at least) pytest is interrupted and what it had is summarised."""
    # no file argument: the suite is pyproject's testpaths (tests/), as in the real stage; bench/ holds
    # test_bench_kernels.py too, which -k would select if it were collected
    args = ["-k", "test_processor_options_refused or test_weights_gpu or test_bench_kernels"]
    env = dict(os.environ, OUT=str(tmp_path), GPU_CHECK_NO_INSTALL="1")
    if limit_hit:
        env["GPU_CHECK_CALL_S"] = "45"                      # 30 s for pytest: test_build_hf takes 2 min on CPU
        args = ["tests/test_build_hf.py", "tests/test_weights_gpu.py"]
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "tests", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("CUDA unavailable on this machine")
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "tests/test_weights_gpu.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    n_cuda = sum("::" in ln for ln in listed.stdout.splitlines())      # every test in it is cuda-marked
    assert n_cuda >= 3, listed.stdout
    assert f"NOT A GPU RUN: {n_cuda} cuda-marked tests skipped for want of a GPU, 0 passed" in summary + proc.stdout
    recs = _lines(tmp_path / "results.jsonl")
    assert recs[0]["event"] == "start" and "--cuda-first" in recs[0]["argv"]
    # the tests spread test by test (worksteal), not file by file: one file's 223 s made a whole GPU run's 256 s
    import xdist
    dist = "worksteal" if tuple(map(int, xdist.__version__.split(".")[:2])) >= (3, 2) else "loadfile"
    argv = recs[0]["argv"]
    assert argv[argv.index("--dist") + 1] == dist, argv
    ran = {r["nodeid"] for r in recs if "nodeid" in r}
    if limit_hit:
        assert "tests: rc=124 in " in summary and "NO RESULT for " in summary
        assert set(ran) >= {"tests/test_weights_gpu.py::test_buckets_hold_one_copy_of_the_weights"}   # cuda first
    else:
        assert "tests: rc=0 in " in summary and f"all:  1 passed, 0 failed, {n_cuda} skipped" in summary
        assert "tests/test_processors.py::test_processor_options_refused" in ran and len(ran) == 1 + n_cuda
        assert not [r for r in ran if r.startswith("bench/")]
    assert (tmp_path / "machine.txt").read_text().count("torch ") == 1


def test_gpu_check_refuses_an_unknown_stage(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "everything"], cwd=ROOT,
                          env=dict(os.environ, OUT=str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout.strip() == ("gpu_check.sh: unknown stage 'everything' (tests, cuda, plain, bench, fused, "
                                   "tune, shapes, runtime, serving, memory, real, scale)")


def _gpu_check(tmp_path, *args, **env):
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], cwd=ROOT,
                          env=dict(os.environ, OUT=str(tmp_path), GPU_CHECK_NO_INSTALL="1", **env),
                          capture_output=True, text=True, timeout=300)


def test_gpu_check_runs_several_stages_in_one_call_and_packs_past_eight_files(tmp_path):
    """tests + fused + tune in one call (on CPU: a test file and the smoke runs): each stage's line, and
    their 10 files brought to 8 by packing the logs."""
    import tarfile

    proc = _gpu_check(tmp_path, "tests", "tests/test_compile_pool.py", "-k", "split", "+", "fused", "--smoke",
                      "+", "tune", "--smoke")
    assert proc.returncode == 1, proc.stdout + proc.stderr                # red: no CUDA here
    summary = (tmp_path / "summary.txt").read_text()
    for stage, wrote in (("tests", "1 passed"), ("fused", f"wrote {tmp_path}/fused.json"),
                         ("tune", f"wrote {tmp_path}/tune.json")):
        assert re.search(rf"^{stage}: rc=0 in \d+ s of \d+ \({re.escape(wrote)}", summary, re.M), summary
    assert "more than 8 files: the logs are in logs.tar.gz (tar -xzf)" in summary
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fused.json", "fusion_measured.json", "logs.tar.gz", "machine.txt", "results.jsonl", "summary.txt",
        "tune.json", "tuned_configs.json"]
    # the fused stage's profiled second run: a line per variant of each row (bench.kernel_profile)
    assert re.search(r"^fused_profile: rc=0 in \d+ s of \d+ ", summary, re.M), summary
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["fused.log", "fused_profile.log", "tests.log", "tune.log"]
        assert b"1 passed" in tar.extractfile("tests.log").read()
        profiled = tar.extractfile("fused_profile.log").read().decode()
    for variant in ("fused", "unfused", "torch.mm"):          # 2 kernels x 2 M (the smoke grid)
        assert len(re.findall(rf"^    {re.escape(variant)}: [\d.]+ cpu_op/run, [\d.]+ us busy, ", profiled,
                              re.M)) == 4, profiled
    assert json.loads((tmp_path / "tune.json").read_text())["args"]["tune"] is True
    # the fused stage measures both dims: the grid at dim 0 (row blocks), then at dim 1 (column blocks)
    fused_rows = json.loads((tmp_path / "fused.json").read_text())["rows"]
    assert [r["dim"] for r in fused_rows] == [0] * 4 + [1] * 4 and not any("error" in r for r in fused_rows)
    assert {r["nodeid"] for r in _lines(tmp_path / "results.jsonl") if "nodeid" in r} == {
        "tests/test_compile_pool.py::test_split_keeps_each_unit_in_one_chunk_and_balances_them"}


def test_gpu_check_shapes_stage_tunes_a_models_shapes_and_checks_the_grid(tmp_path):
    """The shapes stage on CPU (bench/tune_model_shapes.py --smoke: two tiny blocks, the interpreter): fastpipe
    tune's fused-vs-unfused points for both groups of each block, each beside what the shipped grid alone
    decides there (float32 was never measured by the bench: unfused, and the reason says so)."""
    proc = _gpu_check(tmp_path, "shapes", "--smoke", "--compile-workers", "0")
    assert proc.returncode == 1, proc.stdout + proc.stderr                # red: no CUDA here
    summary = (tmp_path / "summary.txt").read_text()
    assert re.search(r"^shapes: rc=0 in \d+ s of \d+ \(the grid's rule agrees with the measurement at \d of 4 "
                     r"shapes\)$", summary, re.M), summary
    doc = json.loads((tmp_path / "shapes.json").read_text())
    assert doc["shape"] == {"D": 16, "H": 32, "n": 2, "dtype": "f32", "ms": [8, 16]} and doc["exit"] == 0
    assert sorted((p["kernel"], p["M"], p["N"], p["K_total"]) for p in doc["points"]) == [
        ("all_gather_matmul", 8, 32, 16), ("all_gather_matmul", 16, 32, 16),
        ("matmul_reduce_scatter", 8, 16, 32), ("matmul_reduce_scatter", 16, 16, 32)]
    for p in doc["points"]:
        assert p["grid_fused"] is False and "was not measured for float32" in p["grid_reason"]
        assert p["agrees"] == (p["fused_wins"] is False) and p["fused_wins"] == (p["fused_p80"] < p["unfused_p20"])
    assert {e["M"] for e in doc["entries"]} <= {8, 16}


def test_shapes_interrupted_reports_the_calls_fastpipe_tune_finished(tmp_path):
    """SIGINT to the whole process group, as gpu_check's stage limit sends it, once fastpipe tune has written its
    table after its first call: the script waits for fastpipe tune to stop, and shapes.json holds the points of
    the calls it finished, with its exit status (130) -- not nothing."""
    table, out = tmp_path / "tuned.json", tmp_path / "shapes.json"
    proc = subprocess.Popen([sys.executable, "bench/tune_model_shapes.py", "--smoke", "--compile-workers", "0",
                             "--table", str(table), "--json", str(out)], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not table.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[0]                 # 4 calls, each seconds in the interpreter
    os.killpg(proc.pid, signal.SIGINT)
    stdout = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, stdout
    assert "tune_model_shapes: interrupted: reporting the calls fastpipe tune finished" in stdout
    doc = json.loads(out.read_text())
    assert doc["exit"] == 130 and 1 <= len(doc["points"]) < 4, stdout
    assert [p["fused_wins"] == (p["fused_p80"] < p["unfused_p20"]) for p in doc["points"]] == [True] * len(
        doc["points"])


def test_gpu_check_starts_no_stage_past_the_calls_budget(tmp_path):
    """A stage after the first starts only with GPU_CHECK_STAGE_MIN_S of the call's time limit left."""
    proc = _gpu_check(tmp_path, "fused", "--smoke", "+", "tune", "--smoke", GPU_CHECK_CALL_S="600",
                      GPU_CHECK_STAGE_MIN_S="600")
    assert proc.returncode == 1
    summary = (tmp_path / "summary.txt").read_text()
    assert re.search(r"^fused: rc=0 in ", summary, re.M)
    assert re.search(r"^tune: not started: \d+ s of the call's 600 s left, under GPU_CHECK_STAGE_MIN_S \(600 s\)$",
                     summary, re.M), summary
    assert (tmp_path / "fused.json").exists() and not (tmp_path / "tune.json").exists()


@pytest.mark.parametrize("stages, message", [
    ("tests+everything", "unknown stage 'everything' (tests, cuda, plain, bench, fused, tune, shapes, runtime, "
                         "serving, memory, real, scale)"),
    ("fused+fused", "stage 'fused' twice in one call: one call runs a stage once (give it all its arguments)"),
    ("tests++fused", "unknown stage '' (tests, cuda, plain, bench, fused, tune, shapes, runtime, serving, "
                     "memory, real, scale)")])
def test_gpu_check_refuses_a_bad_chain_before_any_stage(tmp_path, stages, message):
    proc = _gpu_check(tmp_path, stages)
    assert proc.returncode == 2 and proc.stdout.strip() == f"gpu_check.sh: {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.txt"]


@pytest.mark.parametrize("words, plan", [
    (["tests+serving", "--sections", "1"], ["tests", "serving: --sections 1"]),
    (["tests+fused+runtime"], ["tests", "fused", "runtime"]),
    (["tests", "tests/a.py", "tests/b.py::t[x y]", "+", "runtime", "--batches", "1"],
     ["tests: tests/a.py tests/b.py::t\\[x\\ y\\]", "runtime: --batches 1"]),
    (["fused+tune", "--smoke", "+", "memory", "--sections", "load"], ["fused", "tune: --smoke", "memory: --sections load"])])
def test_gpu_check_gives_each_stage_its_arguments(tmp_path, words, plan):
    """A first word 'a+b' is stages a and b, the arguments after it b's (`tests+serving --sections 1`);
    GPU_CHECK_PLAN=1 prints the stages and runs nothing."""
    proc = _gpu_check(tmp_path, *words, GPU_CHECK_PLAN="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == plan
    assert list(tmp_path.iterdir()) == []


def test_gpu_check_runtime_and_memory_stages_then_ingest(tmp_path):
    """The runtime and memory stages, chained in one call, on CPU (--quick), then scripts/ingest_gpu_check.py on
    their $OUT: runtime.json and memory.json are written, and ingesting them says the runtime cases' verdicts and
    the memory report's sections."""
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    out.mkdir()
    proc = _gpu_check(out, "runtime", "--device", "cpu", "--quick", "--cases", "decode", "+", "memory", "--quick",
                      "--device", "cpu", "--sections", "memory", "--tmp", str(tmp_path / "ckpt"))
    assert proc.returncode == 1, proc.stdout + proc.stderr                # red: no CUDA here
    summary = (out / "summary.txt").read_text()
    assert re.search(r"^runtime: rc=0 in \d+ s of \d+ \(\(total \d+ s\)\)$", summary, re.M), summary
    assert re.search(r"^memory: rc=0 in \d+ s of \d+ ", summary, re.M), summary
    runtime = json.loads((out / "runtime.json").read_text())
    assert runtime["args"]["budget_s"] > 0 and runtime["failed"] == [] and len(runtime["cases"]) == 1
    ingest = subprocess.run([sys.executable, str(ROOT / "scripts" / "ingest_gpu_check.py"), str(out), "--dry-run"],
                            capture_output=True, text=True, timeout=120)
    assert ingest.returncode == 0, ingest.stderr
    date = runtime["machine"]["date"]
    lines = ingest.stdout.splitlines()
    assert f"(dry run) runtime.json -> bench/measured/runtime_cpu_{date}.json (cpu {date})" in lines
    assert any(ln.startswith("(dry run) runtime.json: decode step, batch 1, 1 token over 16 cached: best fastpipe ")
               and "(target <= 1.1x: " in ln for ln in lines), lines
    assert "(dry run) memory.json: section memory: 6 rows" in lines      # 3 shapes x (cpu, region)
