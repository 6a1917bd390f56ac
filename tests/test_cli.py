"""The command line: end to end in a subprocess on every example, exit codes, one-line errors, atomic files."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastpipe.cli import main
from tests.examples import EXAMPLES, GRAPHS, ROOT, copy_example


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "fastpipe", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.parametrize("name", EXAMPLES)
def test_run_check_every_example_in_a_subprocess(name, tmp_path):
    d = GRAPHS / name
    out = tmp_path / "out.safetensors"
    r = run_cli("run", d / "pipeline.json", "--inputs", d / "inputs.safetensors", "--outputs", out,
                "--check", d / "expected.safetensors")
    assert r.returncode == 0, r.stderr
    assert "check: " in r.stdout and "outputs match" in r.stdout
    expected = load_file(str(d / "expected.safetensors"))
    got = load_file(str(out))
    assert set(got) == set(expected)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-4, atol=1e-5)


def test_invalid_pipeline_exit_2_one_line_no_traceback(tmp_path):
    f = copy_example("tp_mlp", tmp_path)
    doc = json.loads(f.read_text())
    for st in doc["supertasks"].values():
        if st["kind"] == "all_reduce":
            st["metadata"]["reduce_op"] = "prod"
    f.write_text(json.dumps(doc))
    r = run_cli("validate", f)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith('fastpipe: error: supertasks["') and ".metadata.reduce_op: expected one of sum, avg, max, min" in r.stderr
    r = run_cli("--verbose", "validate", f)
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_run_with_inputs_validates_before_reading_input_names(capsys, tmp_path):
    """--inputs on a pipeline without an input supertask: the validation error, not an internal one
    from completing the inputs through names the pipeline cannot give yet."""
    f = copy_example("tp_mlp", tmp_path)
    doc = json.loads(f.read_text())
    doc["supertasks"] = {k: st for k, st in doc["supertasks"].items() if st["kind"] != "input"}
    f.write_text(json.dumps(doc))
    code, out, err = cli(capsys, "run", f, "--inputs", GRAPHS / "tp_mlp" / "inputs.safetensors", "--processor",
                         "reference", "--no-compile", "--warmup", "0", "--repeat", "1")
    assert code == 2 and err == "fastpipe: error: supertasks: expected exactly one input supertask, found 0\n"


def test_console_script_installed():
    import shutil

    exe = shutil.which("fastpipe")
    assert exe, "the fastpipe console script is not on PATH (pip install -e .)"
    r = subprocess.run([exe, "validate", GRAPHS / "two_stage_skip" / "pipeline.json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "valid" in r.stdout


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_validate_and_show(capsys, tmp_path):
    code, out, _ = cli(capsys, "validate", GRAPHS / "moe_all_to_all" / "pipeline.json")
    assert code == 0 and "valid (4 slots" in out
    code, out, _ = cli(capsys, "show", GRAPHS / "tp_mlp" / "pipeline.json")
    assert code == 0
    assert "slots: 2" in out and "supertasks by kind: all_reduce 2, fx 5, reduce 2" in out
    assert "constants   65.5 KiB" in out   # slot 0 holds the two row-parallel biases on top of its shards
    dot = tmp_path / "dag.dot"
    code, out, _ = cli(capsys, "show", "--dot", dot, GRAPHS / "moe_all_to_all" / "pipeline.json")
    text = dot.read_text()
    assert code == 0 and text.startswith("digraph") and text.count("subgraph \"cluster_slot_") == 4
    assert "style=dashed" in text   # comm group members are joined


def test_run_random_inputs_prints_latency(capsys):
    code, out, _ = cli(capsys, "run", GRAPHS / "seq_parallel" / "pipeline.json", "--repeat", "3", "--seed", "5")
    assert code == 0 and "3 runs: median" in out and " ms" in out


def test_run_prints_each_fusion_decision_and_takes_the_policy(capsys):
    """`run` says what the fusion policy did with every candidate group; --fuse picks the policy."""
    p = GRAPHS / "seq_parallel" / "pipeline.json"
    code, out, _ = cli(capsys, "run", p, "--repeat", "1", "--no-compile")
    assert code == 0
    fusion = [line for line in out.splitlines() if line.startswith("fusion: ")]
    assert len(fusion) == 2 and all("not fused: the region processor compiles" in line for line in fusion), out
    code, out, _ = cli(capsys, "run", p, "--repeat", "1", "--no-compile", "--fuse", "off", "--processor", "cpu")
    assert code == 0
    assert ('fusion: group "rs0" (matmul->reduce_scatter, supertasks 5, 6): not fused: fusion is off') in out
    code, _, err = cli(capsys, "run", p, "--fuse", "yes")
    assert code == 2 and err.startswith("fastpipe: error: run: argument --fuse: invalid choice: 'yes'")
    assert err.count("\n") == 2 and err.splitlines()[1].startswith("usage: fastpipe run [-h]")   # + the usage line


def test_run_fuse_always_runs_the_kernels_or_is_refused(capsys, monkeypatch):
    """--fuse always: the fused kernels run (on CPU tensors: the interpreter) and match the expected
    outputs; where they cannot run, loading refuses, one line naming the group, exit 2."""
    from fastpipe.kernels import mm_reduce_scatter_kernel as k
    from fastpipe.runtime.passes import fuse

    g = GRAPHS / "seq_parallel"
    args = ("run", g / "pipeline.json", "--inputs", g / "inputs.safetensors", "--check", g / "expected.safetensors",
            "--repeat", "1", "--warmup", "0", "--no-compile", "--processor", "cpu", "--fuse", "always")
    monkeypatch.setattr(fuse, "_cannot_launch", k.launch_problem)   # the real check (conftest eases it on GPUs)
    if k.launch_problem("cpu") is None:                              # the interpreter (a machine without CUDA)
        code, out, err = cli(capsys, *args)
        assert code == 0, err
        assert 'fusion: group "rs0" (matmul->reduce_scatter, supertasks 5, 6): fused' in out
        assert 'fusion: group "ag0" (all_gather->matmul, supertasks 1, 2): fused' in out
    monkeypatch.setattr(k, "interpreting", lambda: False)
    code, out, err = cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith('fastpipe: error: fuse: "always" cannot fuse group ') and err.count("\n") == 1, err


def test_show_plan_takes_the_fusion_policy(capsys):
    code, out, _ = cli(capsys, "show", "--plan", "--fuse", "off", GRAPHS / "seq_parallel" / "pipeline.json")
    assert code == 0 and 'fusion: group "ag0" (all_gather->matmul, supertasks 1, 2): not fused: fusion is off' in out


def test_check_mismatch_exit_1(capsys, tmp_path):
    exp = load_file(str(GRAPHS / "tp_mlp" / "expected.safetensors"))
    exp["y"][0, 0] += 1.0
    save_file(exp, str(tmp_path / "bad.safetensors"))
    code, out, err = cli(capsys, "run", GRAPHS / "tp_mlp" / "pipeline.json", "--inputs", GRAPHS / "tp_mlp" / "inputs.safetensors",
                         "--check", tmp_path / "bad.safetensors")
    assert code == 1
    assert "y: max abs 1" in out and "MISMATCH" in out
    assert err == f"fastpipe: error: --check: expected outputs to match {tmp_path / 'bad.safetensors'}, found 1 mismatching (y)\n"


@pytest.mark.parametrize("args, pattern", [
    (["run", "{p}", "--inputs", "{tmp}/missing.safetensors"], r'^fastpipe: error: --inputs: expected a safetensors file, found no file'),
    (["run", "{p}", "--inputs", "{p}"], r'^fastpipe: error: --inputs: expected a safetensors file, found ".*" unreadable'),
    (["run", "{p}", "--device-map", "0:cpu"], r'^fastpipe: error: --device-map\[0\]: expected SLOT=DEVICE'),
    (["run", "{p}", "--device-map", "5=cpu"], r'^fastpipe: error: device_map\["5"\]: expected a slot of the pipeline'),
    (["run", "{p}", "--repeat", "0"], r'^fastpipe: error: --repeat/--warmup: expected --repeat >= 1'),
    (["run", "{p}", "--outputs", "{tmp}/no/such/dir/out.safetensors"], r'^fastpipe: error: --outputs: expected a file in an existing folder'),
    (["validate", "{tmp}/nope.json"], r'^fastpipe: error: .*nope\.json: cannot read pipeline file'),
])
def test_invalid_options_exit_2(capsys, tmp_path, args, pattern):
    """One line each (argparse's own errors add a usage line: tests/test_cli_first_hour.py)."""
    p = GRAPHS / "tp_mlp" / "pipeline.json"
    code, _, err = cli(capsys, *[a.format(p=p, tmp=tmp_path) for a in args])
    assert code == 2, err
    assert err.count("\n") == 1 and __import__("re").search(pattern, err), err
    assert not list(tmp_path.iterdir())


def test_wrong_inputs_exit_2(capsys, tmp_path):
    save_file({"x": torch.zeros(8, 63)}, str(tmp_path / "in.safetensors"))
    code, _, err = cli(capsys, "run", GRAPHS / "tp_mlp" / "pipeline.json", "--inputs", tmp_path / "in.safetensors",
                       "--outputs", tmp_path / "out.safetensors")
    assert code == 2 and err == 'fastpipe: error: inputs["x"].shape: expected [8, 64], found [8, 63]\n'
    assert not (tmp_path / "out.safetensors").exists()


def test_failed_run_exit_1_and_no_output_file(capsys, tmp_path):
    from tests.docs import write_bad_index_pipeline

    write_bad_index_pipeline(tmp_path, n_ids=2)
    save_file({"ids": torch.tensor([0, 9]), "table": torch.zeros(4, 2)}, str(tmp_path / "in.safetensors"))
    out = tmp_path / "out.safetensors"
    code, _, err = cli(capsys, "run", tmp_path / "p.json", "--inputs", tmp_path / "in.safetensors", "--outputs", out,
                       "--no-compile")
    assert code == 1 and err.startswith('fastpipe: error: supertasks["1"] on slot "0": failed: IndexError')
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors", "p.json"]   # nothing half-written


def test_python_dash_m_help():
    r = run_cli("--help")
    assert r.returncode == 0 and "validate" in r.stdout and "run" in r.stdout
