"""The bound Program is the one thing that runs: processors take it (never the Session), passes
rewrite it before the checker, `show --plan` prints it; run options are typed and validated."""
import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import fastpipe
from fastpipe.errors import InputError
from fastpipe.lower import check_program, format_table
from fastpipe.options import LoadOptions, RunOptions
from fastpipe.runtime.processors.registry import choose_processor, with_fields
from tests.examples import GRAPHS

RUNTIME = Path(fastpipe.__file__).parent / "runtime"
PROCESSOR_MODULES = ["processors/base.py", "processors/reference.py", "processors/cpu.py", "processors/cuda.py",
                    "processors/region.py", "processors/dist.py", "cuda/stream_issue.py", "execute.py"]
SESSION_PRIVATE = {"session", "_binder", "_compute_steps", "_comm_steps", "_input_devices", "_dist_plan", "_runner"}


@pytest.mark.parametrize("module", PROCESSOR_MODULES)
def test_processors_do_not_reach_into_the_session(module):
    tree = ast.parse((RUNTIME / module).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
    assert not names & SESSION_PRIVATE, f"{module} uses {sorted(names & SESSION_PRIVATE)}"


@pytest.mark.parametrize("processor", ["reference", "cpu"])
def test_the_session_runs_its_bound_program(processor):
    sess = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor=processor)
    program = sess.program
    assert sess.runner.program is program
    steps = [st for ss in program.steps.values() for st in ss]
    assert all(st.device == torch.device("cpu") for st in steps)
    assert all(callable(st.fn) for st in steps if st.kind == "compute")
    assert set(program.group_fns) == set(program.groups)
    # constants are bound on the steps that read them, under their names
    assert all(set(st.constants) == {n for n in st.reads if sess.pipeline.tensors[n].is_constant} for st in steps)
    # a step's callable is what runs: swap one and the run sees it
    slot, i = next((s, i) for s, ss in program.steps.items() for i, st in enumerate(ss) if st.kind == "compute")
    calls = []
    st = program.steps[slot][i]

    def spy(xs, fn=st.fn):
        calls.append(len(xs))
        return fn(xs)

    program.steps[slot] = tuple(dataclasses.replace(s, fn=spy) if j == i else s for j, s in enumerate(program.steps[slot]))
    sess._processor = type(sess.runner)(program).attach(sess.runner.prepared)
    sess.run({"x": torch.randn(8, 64)})
    assert calls == [len(st.reads)]


def test_a_fused_program_is_checked_as_it_runs():
    """fuse="always" (Triton interpreted on CPU): the pass renames what crosses the fused groups
    (`#a`, `#b`, `#mm`), frees follow, and the checker proves that Program."""
    path = GRAPHS / "seq_parallel" / "pipeline.json"
    sess = fastpipe.load(path, fuse="always", processor="reference")
    assert any(d.fused for d in sess.fusion)
    reads = {n for ss in sess.program.steps.values() for st in ss for n in st.reads}
    frees = {n for ss in sess.program.steps.values() for st in ss for n in st.frees}
    renamed = {n for n in reads if "#" in n}
    assert renamed and renamed <= frees
    check_program(sess.program, sess.checked)
    plain = fastpipe.load(path, fuse="off", processor="reference")
    assert not {n for ss in plain.program.steps.values() for st in ss for n in st.reads if "#" in n}


def test_show_plan_prints_the_program_that_runs(capsys):
    from fastpipe.cli import main

    path = GRAPHS / "seq_parallel" / "pipeline.json"
    assert main(["show", "--plan", str(path)]) == 0
    out = capsys.readouterr().out
    sess = fastpipe.load(path, processor="auto", compile="off")
    assert format_table(sess.program, pipeline=sess.pipeline) in out
    assert f"(run by the {sess.describe()})" in out
    assert "region r0 on cpu: 10 steps of slots 0, 1; takes x_0, x_1; hands on y" in out


# ---------------------------------------------------------------------------------- options
def test_options_are_frozen_and_validated():
    opts = RunOptions(processor="cpu", compile=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.processor = "cuda"
    for kwargs, message in [
        ({"processor": "gpu"}, 'processor: expected one of auto, reference, region, cpu, cuda, dist, found "gpu"'),
        ({"merge_shards": "no"}, "merge_shards: expected true or false, found 'no'"),
        ({"alias_outputs": 1}, "alias_outputs: expected true or false, found 1"),
        ({"compile": "yes"}, "compile: expected background, wait or off (or true / false), found 'yes'"),
        ({"compile_policy": "ignore"}, 'compile_policy: expected warn or raise, found "ignore"'),
        ({"cuda_graph": 1}, "cuda_graph: expected true or false, found 1"),
        ({"fuse": "yes"}, 'fuse: expected auto, off or always, found "yes"'),
        ({"dist_timeout": 0}, "dist_timeout: expected a number of seconds > 0, found 0"),
    ]:
        with pytest.raises(InputError) as e:      # each field checked by the dataclass that holds it
            with_fields(None, **kwargs)
        assert str(e.value) == message
    with pytest.raises(InputError) as e:          # a dist-only option given to another processor
        fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="cpu", slot_ranks={"0": 0}, compile="off")
    assert str(e.value) == 'slot_ranks: expected processor="dist", found processor="cpu"'
    with pytest.raises(TypeError, match="unexpected keyword argument 'cuda_graphs'"):
        with_fields(None, cuda_graphs=False)
    with pytest.raises(InputError, match="^check_payloads: expected true or false, found None$"):
        LoadOptions(check_payloads=None)


def test_auto_is_chosen_by_the_library():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert choose_processor("auto", {"0": cpu, "1": cpu}, {}) == "region"       # one device: one graph
    assert choose_processor("auto", {"0": gpu, "1": gpu}, {}) == "region"
    assert choose_processor("auto", {"0": gpu, "1": torch.device("cuda", 1)}, {}) == "cuda"
    assert choose_processor("auto", {"0": gpu, "1": cpu}, {}) == "cpu"
    assert choose_processor("auto", {"0": cpu}, {"WORLD_SIZE": "2"}) == "dist"
    assert choose_processor("reference", {"0": gpu}, {"WORLD_SIZE": "2"}) == "reference"
    sess = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="auto", compile="off")
    assert sess.processor == "region" and sess.run_options.processor == "auto"


def test_load_takes_the_option_dataclasses():
    path = GRAPHS / "tp_mlp" / "pipeline.json"
    sess = fastpipe.load(path, run_options=RunOptions(processor="cpu"), load_options=LoadOptions(check_payloads=False))
    assert sess.processor == "cpu" and sess.options.check_payloads is False
    with pytest.raises(InputError, match="^run_options: expected either run_options or its fields as keywords, found both$"):
        fastpipe.load(path, run_options=RunOptions(), processor="cpu")
    with pytest.raises(InputError, match="^run_options: expected either run_options or its fields as keywords"):
        fastpipe.load(path, run_options=RunOptions(), merge_shards=False)      # a processor's option too
    # a keyword left at its default is not given (the engine sets processor="auto" beside a caller's run_options)
    assert fastpipe.load(path, run_options=RunOptions(processor="cpu"), processor="auto", cuda_graph=True).processor == "cpu"
