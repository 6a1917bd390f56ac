"""What a new user meets first on a fresh clone: the Graphviz drawing's labels, argparse's errors (the
subcommand named once, a suggestion, its usage line), --version, the commands that need transformers
without it, and a run without triton (a CPU-only install), with the packaging that allows it."""
import os
import re
import subprocess
import sys
from importlib import metadata

import pytest
import torch

from fastpipe.cli import main
from tests.examples import GRAPHS, ROOT

TP_MLP = GRAPHS / "tp_mlp"


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def python_c(code: str, *, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)


def assert_usage_error(code, err, first_line, usage_prefix):
    """argparse's errors: exit 2, the error line (no doubled prefix), then the (sub)command's usage line."""
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 2 and err.endswith("\n") and "Traceback" not in err, err
    assert lines[0] == first_line, err
    assert lines[1].startswith(usage_prefix), err


# ---------------------------------------------------------------- show --dot
def test_dot_labels_break_the_line_once(capsys, tmp_path):
    dot = tmp_path / "dag.dot"
    code, _, _ = cli(capsys, "show", "--dot", dot, TP_MLP / "pipeline.json")
    assert code == 0
    text = dot.read_text()
    labels = dict(re.findall(r'^\s*"st_([^"]+)" \[label="((?:[^"\\]|\\.)*)", shape=(?:box|ellipse)\]', text, re.M))
    assert labels and "\\\\" not in text, text           # no doubled backslash anywhere
    for sid, label in labels.items():
        # the DOT text holds one escape, backslash + n, between the id and the kind: Graphviz draws two lines
        assert label.count("\\n") == 1 and label.startswith(f"{sid}\\n"), label
        kind = label.split("\\n", 1)[1].split(" [")[0]
        assert kind in ("fx", "all_reduce", "reduce"), label
    assert sum(label.endswith("\\nfx") for label in labels.values()) == 5


# ---------------------------------------------------------------- argparse's errors
def test_unknown_flag_names_the_subcommand_once_and_shows_its_usage(capsys):
    p = TP_MLP / "pipeline.json"
    code, out, err = cli(capsys, "run", p, "--bogus")
    assert out == ""
    assert_usage_error(code, err, "fastpipe: error: run: unrecognized arguments: --bogus", "usage: fastpipe run [-h]")
    assert "fastpipe: error: fastpipe" not in err and "pipeline" in err.splitlines()[1]
    # a near miss gets the closest option of the subcommand (argparse itself reports it from the top parser)
    code, _, err = cli(capsys, "run", p, "--chek", "expected.safetensors")
    assert_usage_error(code, err, "fastpipe: error: run: unrecognized arguments: --chek expected.safetensors "
                                  "(did you mean --check?)", "usage: fastpipe run [-h]")
    code, _, err = cli(capsys, "show", p, "--repeats=3", "--plann")
    assert_usage_error(code, err, "fastpipe: error: show: unrecognized arguments: --repeats=3 --plann "
                                  "(--plann: did you mean --plan?)", "usage: fastpipe show [-h]")
    code, _, err = cli(capsys, "run", p, "--repeats=3")
    assert_usage_error(code, err, "fastpipe: error: run: unrecognized arguments: --repeats=3 (did you mean --repeat?)",
                       "usage: fastpipe run [-h]")


def test_invalid_choices_and_missing_arguments_suggest_and_show_the_usage(capsys):
    p = TP_MLP / "pipeline.json"
    code, _, err = cli(capsys, "run", p, "--processor", "regon")
    assert_usage_error(code, err, "fastpipe: error: run: argument --processor: invalid choice: 'regon' (choose from "
                                  "'auto', 'reference', 'region', 'cpu', 'cuda', 'dist') (did you mean 'region'?)",
                       "usage: fastpipe run [-h]")
    code, _, err = cli(capsys, "runn", p)
    assert code == 2 and err.startswith("fastpipe: error: argument command: invalid choice: 'runn'"), err
    assert err.splitlines()[0].endswith("(did you mean 'run'?)") and err.count("\n") == 2, err
    assert err.splitlines()[1].startswith("usage: fastpipe [-h] ")
    code, _, err = cli(capsys, "frobnicate", p)
    assert code == 2 and "did you mean" not in err and err.splitlines()[1].startswith("usage: fastpipe [-h]"), err
    code, _, err = cli(capsys, "generate", "folder")
    assert_usage_error(code, err, "fastpipe: error: generate: one of the arguments --prompt --prompt-ids is required",
                       "usage: fastpipe generate [-h] [options] (--prompt TEXT | --prompt-ids IDS) FOLDER")
    code, _, err = cli(capsys, "build", "model")
    assert_usage_error(code, err, "fastpipe: error: build: the following arguments are required: -o/--output",
                       "usage: fastpipe build [-h] [options] -o OUTPUT model")


def test_unknown_flag_in_a_subprocess_exits_2_without_traceback():
    r = subprocess.run([sys.executable, "-m", "fastpipe", "run", str(TP_MLP / "pipeline.json"), "--bogus"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.splitlines() == ["fastpipe: error: run: unrecognized arguments: --bogus",
                                     "usage: fastpipe run [-h] [options] pipeline"]


# ---------------------------------------------------------------- --version
def test_version_names_fastpipe_and_torch(capsys):
    want = f"fastpipe {metadata.version('fastpipe')} (torch {torch.__version__})"
    with pytest.raises(SystemExit) as e:           # as argparse's --help: exit 0
        main(["--version"])
    assert e.value.code in (0, None) and capsys.readouterr().out == want + "\n"
    r = subprocess.run([sys.executable, "-m", "fastpipe", "--version"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert r.returncode == 0 and r.stdout == want + "\n" and r.stderr == "", r.stderr
    assert re.fullmatch(r"fastpipe \d+\.\d+\S* \(torch \d+\.\d+\S*\)", want)


# ---------------------------------------------------------------- without transformers
NO_HF = "fastpipe: error: build: needs transformers (pip install 'fastpipe[hf]'), not installed\n"


@pytest.fixture
def no_transformers(monkeypatch):
    """`import transformers` fails as on an install without the [hf] extra (None in sys.modules)."""
    monkeypatch.setitem(sys.modules, "transformers", None)


def test_build_without_transformers_is_one_line(capsys, tmp_path, no_transformers):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    for extra in ([], ["--serve", "--max-len", "16"]):
        code, out, err = cli(capsys, "build", model, "-o", tmp_path / "out", *extra)
        assert (code, out, err) == (2, "", NO_HF)
        assert not (tmp_path / "out").exists()


def test_generate_prompt_without_transformers_is_one_line(capsys, tmp_path, no_transformers):
    folder = tmp_path / "set"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    code, out, err = cli(capsys, "generate", folder, "--prompt", "Once upon a time")
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("fastpipe: error: generate: needs transformers (pip install 'fastpipe[hf]') to read the "
                          f"tokenizer in \"{folder}\", not installed; "), err
    assert "--prompt-ids" in err


def test_build_without_transformers_in_a_subprocess(tmp_path):
    """The console path as a user meets it: a finder that says transformers is not installed."""
    model = ROOT / "tests" / "data" / "serving" / "llama_tp2"       # a folder with a config.json
    assert (model / "config.json").is_file()
    out = tmp_path / "out"
    r = python_c(
        "import sys\n"
        "class NoHF:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'transformers':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoHF())\n"
        "from fastpipe.cli import main\n"
        f"sys.exit(main(['build', {str(model)!r}, '-o', {str(out)!r}]))\n")
    assert r.returncode == 2 and r.stderr == NO_HF and r.stdout == "", r.stderr
    assert not out.exists()


# ---------------------------------------------------------------- without triton
def test_pyproject_keeps_triton_out_of_the_base_install():
    tomllib = pytest.importorskip("tomllib")          # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    triton = "triton>=3.0; platform_system == 'Linux'"
    assert not [d for d in project["dependencies"] if d.startswith("triton")]
    extras = project["optional-dependencies"]
    assert triton in extras["gpu"] and triton in extras["test"]
    assert any(d.startswith("transformers") for d in extras["hf"])


def test_main_job_runs_without_triton():
    """A CPU-only install (no triton): the README's main job still runs and checks, compiled."""
    r = python_c(
        "import sys\n"
        "sys.modules['triton'] = None\n"          # `import triton` (and triton.*) fails from here on
        "import fastpipe\n"
        "from fastpipe.cli import main\n"
        "code = main(['run', 'graphs/tp_mlp/pipeline.json', '--inputs', 'graphs/tp_mlp/inputs.safetensors',\n"
        "             '--check', 'graphs/tp_mlp/expected.safetensors', '--repeat', '2'])\n"
        "assert sys.modules['triton'] is None\n"
        "sys.exit(code)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("tp_mlp: region processor (1 region on cpu; "), r.stdout
    assert "check: 1 outputs match graphs/tp_mlp/expected.safetensors" in r.stdout
