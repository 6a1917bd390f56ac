"""Pipeline inputs derived through the metadata (fastpipe.model_io.complete_inputs): a producer-style
pipeline reads one input per slot (`x`, `x_slot1`) tied to one model input; `fastpipe run --inputs`
with a file naming only one of them (or the model input itself) fills the others by slicing."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastpipe.cli import main
from fastpipe.cli.dist import read_local_inputs
from fastpipe.errors import InputError
from fastpipe.format import read_pipeline, write_pipeline
from fastpipe.model_io import complete_inputs, input_sources
from tests.examples import copy_example


def producer_copy(name: str, tmp_path):
    src = copy_example(name, tmp_path)
    out = src.parent / "producer.json"
    write_pipeline(read_pipeline(src), out, style="producer")
    return src.parent, out


def run(capsys, pipeline, inputs, outputs, *extra):
    rc = main(["run", str(pipeline), "--inputs", str(inputs), "--outputs", str(outputs), "--processor", "reference",
               "--no-compile", "--warmup", "0", "--repeat", "1", *map(str, extra)])
    return rc, capsys.readouterr().err


def assert_same(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_producer_copies_of_one_input_are_derived_from_any_whole_one(tmp_path, capsys):
    folder, path = producer_copy("tp_mlp", tmp_path)
    q = read_pipeline(path)
    assert q.input_names == ("x", "x_slot1")
    x = load_file(str(folder / "inputs.safetensors"))["x"]
    expected = load_file(str(folder / "expected.safetensors"))       # the unsplit module's outputs
    save_file({"x": x, "x_slot1": x.clone()}, str(tmp_path / "all.safetensors"))
    rc, err = run(capsys, path, tmp_path / "all.safetensors", tmp_path / "all.out")
    assert rc == 0, err
    want = load_file(str(tmp_path / "all.out"))
    assert_same(want, expected)
    for given in ({"x": x}, {"x_slot1": x}):
        f = tmp_path / f"{'_'.join(given)}.safetensors"
        save_file(given, str(f))
        rc, err = run(capsys, path, f, tmp_path / "got.out", "--check", folder / "expected.safetensors")
        assert rc == 0, err
        assert_same(load_file(str(tmp_path / "got.out")), want)
    # chunked: the file carries 2 batches along dim 0, each sliced alike
    x2 = torch.cat([x, 2 * x])
    save_file({"x_slot1": x2}, str(tmp_path / "two.safetensors"))
    save_file({"x": x2, "x_slot1": x2.clone()}, str(tmp_path / "two_all.safetensors"))
    assert run(capsys, path, tmp_path / "two.safetensors", tmp_path / "two.out", "--chunks", 2)[0] == 0
    assert run(capsys, path, tmp_path / "two_all.safetensors", tmp_path / "two_all.out", "--chunks", 2)[0] == 0
    assert_same(load_file(str(tmp_path / "two.out")), load_file(str(tmp_path / "two_all.out")))
    # the multi-process reader derives the same (what one rank needs)
    got = read_local_inputs(str(tmp_path / "x_slot1.safetensors"), q, ("x_slot1", "x"))
    assert list(got) == ["x_slot1", "x"] and torch.equal(got["x"], x) and torch.equal(got["x_slot1"], x)


def test_split_input_comes_from_the_model_input_not_from_a_part(tmp_path, capsys):
    folder, path = producer_copy("seq_parallel", tmp_path)
    q = read_pipeline(path)
    assert q.input_names == ("x_0", "x_1") and {s.origin for s in q.metadata.slices_inputs.values()} == {"x"}
    given = load_file(str(folder / "inputs.safetensors"))
    x = torch.cat([given["x_0"], given["x_1"]])                       # the model input, whole
    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    rc, err = run(capsys, path, tmp_path / "x.safetensors", tmp_path / "out", "--check", folder / "expected.safetensors")
    assert rc == 0, err
    save_file({"x_0": given["x_0"]}, str(tmp_path / "part.safetensors"))
    rc, err = run(capsys, path, tmp_path / "part.safetensors", tmp_path / "out")
    assert rc == 2
    assert err == ('fastpipe: error: inputs["x_1"]: expected a tensor for this pipeline input, found none, nor all of '
                   'the model input "x" it is a slice of (give "x_1", or "x" whole: under its own name or a pipeline '
                   'input\'s that holds all of it)\n')
    save_file({"x": x[:8]}, str(tmp_path / "short.safetensors"))
    rc, err = run(capsys, path, tmp_path / "short.safetensors", tmp_path / "out")
    assert rc == 2 and err.count("\n") == 1
    assert 'inputs["x"].shape: expected [16, 32] (all of the model\'s input "x", from which "x_0" is sliced), found [8, 32]' in err
    with pytest.raises(InputError, match=r'^inputs\["x_1"\]: expected a tensor .* model input "x"'):
        read_local_inputs(str(tmp_path / "part.safetensors"), q, ())


def test_complete_inputs_keeps_what_is_given_and_leaves_untied_inputs_to_the_run(tmp_path):
    _, path = producer_copy("tp_mlp", tmp_path)
    q = read_pipeline(path)
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    both = complete_inputs(q, {"x": x, "x_slot1": y})
    assert both["x"] is x and both["x_slot1"] is y                  # given ones win
    assert input_sources(q, ["x"]) == {"x_slot1": "x"} and input_sources(q, ["x_slot1"]) == {"x": "x_slot1"}
    # a pipeline without metadata for its input: nothing derived, Session.run names what is missing
    import dataclasses

    from fastpipe.format.model import Metadata

    bare = dataclasses.replace(q, metadata=Metadata())
    assert complete_inputs(bare, {"x": x}) == {"x": x}
    with pytest.raises(InputError, match=r'^inputs\["x_slot1"\]: expected a tensor for this pipeline input, found none$'):
        input_sources(bare, ["x"])


def test_producer_built_llama_runs_from_its_model_inputs(tmp_path, capsys):
    """`fastpipe build --style producer` of a tiny Llama (tp 2): its integer inputs are read on both slots."""
    pytest.importorskip("transformers")
    from tests.hf_models import build_producer_llama

    path = build_producer_llama(tmp_path)
    q = read_pipeline(path)
    copies = [n for n in q.input_names if n.endswith("_slot1")]
    assert copies, q.input_names
    g = torch.Generator().manual_seed(0)
    full = {}
    for name in q.input_names:
        s = q.metadata.slices_inputs[name]
        o = q.metadata.tensors_inputs[s.origin]
        if s.origin not in full:
            full[s.origin] = (torch.randint(0, 64, o.shape, generator=g) if o.dtype == "i64"
                              else torch.randn(o.shape, generator=g))
    every = {n: full[q.metadata.slices_inputs[n].origin][tuple(slice(a, b) for a, b in q.metadata.slices_inputs[n].placements)].clone()
             for n in q.input_names}
    save_file(every, str(tmp_path / "every.safetensors"))
    save_file(full, str(tmp_path / "model.safetensors"))
    assert run(capsys, path, tmp_path / "every.safetensors", tmp_path / "a.out")[0] == 0
    rc, err = run(capsys, path, tmp_path / "model.safetensors", tmp_path / "b.out")
    assert rc == 0, err
    assert_same(load_file(str(tmp_path / "b.out")), load_file(str(tmp_path / "a.out")))
