"""Integer inputs used as indices (fastpipe.runtime.binding.index_bounds): the bound finder on hand-made FX
graphs, random inputs that stay inside the bounds, and the check of a caller's inputs; end to end on
a tiny BERT built with tp 2 and pp 2, whose token_type_ids index an embedding of 2 rows."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.fx.experimental.proxy_tensor import make_fx

import fastpipe
from fastpipe.cli import main
from fastpipe.errors import InputError
from fastpipe.format import read_pipeline
from fastpipe.random_inputs import INT_HIGH, random_inputs
from fastpipe.runtime.binding.index_bounds import IndexBound, IndexUse, check_index_bounds, graph_index_uses, index_bounds
from tests.examples import GRAPHS, ROOT

F = torch.nn.functional


def _uses(fn, *example, shapes=True):
    """graph_index_uses of make_fx(fn) (an aten graph, as payloads decode), keyed by argument position."""
    gm = make_fx(fn)(*example)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    got = graph_index_uses(gm, {ph.name: tuple(x.shape) for ph, x in zip(phs, example)} if shapes else None)
    return {i: got[ph.name] for i, ph in enumerate(phs) if ph.name in got}, gm


def _ranges(uses):
    return {i: sorted((u.low, u.high) for u in us) for i, us in uses.items()}


# ------------------------------------------------------------------------------------------ the finder
def test_embedding_through_a_view_bounds_its_ids_by_the_weight_rows():
    uses, gm = _uses(lambda ids, w: F.embedding(ids.view(-1).unsqueeze(0), w), torch.zeros(2, 3, dtype=torch.long),
                     torch.randn(5, 4))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.view.default in targets and torch.ops.aten.embedding.default in targets
    assert _ranges(uses) == {0: [(0, 5)]}
    assert uses[0][0].what == "indices into an embedding of 5 rows" and uses[0][0].path == ()


def test_index_select_and_index_bound_by_the_indexed_dim():
    uses, gm = _uses(lambda w, i: torch.index_select(w, 1, i.reshape(-1)), torch.randn(3, 7), torch.zeros(4, dtype=torch.int32))
    assert torch.ops.aten.index_select.default in {n.target for n in gm.graph.nodes}
    assert _ranges(uses) == {1: [(0, 7)]}
    # aten.index.Tensor wraps negative indices: [-size, size)
    uses, gm = _uses(lambda w, i: w[i.clone()], torch.randn(6, 2), torch.zeros(3, dtype=torch.long))
    assert torch.ops.aten.index.Tensor in {n.target for n in gm.graph.nodes}
    assert _ranges(uses) == {1: [(-6, 6)]}


def test_an_input_that_is_not_used_as_an_index_has_no_bound():
    # arithmetic before the use (a vocab-parallel embedding's offset), a float cast, a plain value
    uses, _ = _uses(lambda ids, w: F.embedding(ids + 1, w), torch.zeros(3, dtype=torch.long), torch.randn(5, 4))
    assert uses == {}
    uses, _ = _uses(lambda ids, w: w[0] * ids.float().sum(), torch.zeros(3, dtype=torch.long), torch.randn(5, 4))
    assert uses == {}
    uses, _ = _uses(lambda ids, w: F.embedding(ids.to(torch.float32).long(), w), torch.zeros(3, dtype=torch.long),
                    torch.randn(5, 4))
    assert uses == {}


def test_several_uses_and_the_tightest_bound():
    def f(ids, big, small):
        return F.embedding(ids, big).sum() + F.embedding(ids.flatten(), small).sum()

    uses, _ = _uses(f, torch.zeros(2, 2, dtype=torch.long), torch.randn(9, 3), torch.randn(4, 3))
    assert _ranges(uses) == {0: [(0, 4), (0, 9)]}
    b = IndexBound(tuple(sorted(uses[0], key=lambda u: u.high)))
    assert (b.low, b.high) == (0, 4)


def test_torch_level_graph_and_a_constant_weight():
    """symbolic_trace keeps torch functions and Tensor methods (F.embedding takes (input, weight)); the
    weight a get_attr constant of the graph module."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(3, 4))

        def forward(self, ids, x):
            return F.embedding(ids.view(-1).long(), self.table) + x

    gm = torch.fx.symbolic_trace(M())
    assert {n.op for n in gm.graph.nodes} >= {"get_attr", "call_method"}
    got = graph_index_uses(gm)
    assert list(got) == ["ids"] and [(u.low, u.high) for u in got["ids"]] == [(0, 3)]


def test_a_part_of_an_input_used_as_indices_is_the_part_checked():
    uses, _ = _uses(lambda ids, w: F.embedding(ids[:, :2], w).sum() + ids[:, 2:].sum(), torch.zeros(2, 5, dtype=torch.long),
                    torch.randn(3, 4))
    assert _ranges(uses) == {0: [(0, 3)]}
    bounds = {"ids": IndexBound(tuple(uses[0]))}
    ok = torch.tensor([[0, 2, 99, -7, 5], [1, 1, 50, 3, 4]])
    check_index_bounds({"ids": ok}, bounds)                 # out of range only where no index is taken
    bad = ok.clone()
    bad[1, 1] = 3
    with pytest.raises(InputError, match=r'^inputs\["ids"\]: expected integers in \[0, 3\) \(indices into an embedding of 3 rows\), found 3$'):
        check_index_bounds({"ids": bad}, bounds)


def test_check_names_the_input_the_range_and_the_value():
    bounds = {"t": IndexBound((IndexUse(0, 2, "indices into an embedding of 2 rows", "1"),))}
    check_index_bounds({"t": torch.tensor([[0, 1, 1]])}, bounds)
    with pytest.raises(InputError) as e:
        check_index_bounds({"t": torch.tensor([[0, 5, 1]])}, bounds)
    assert str(e.value) == 'inputs["t"]: expected integers in [0, 2) (indices into an embedding of 2 rows), found 5'
    with pytest.raises(InputError, match=r"found -1$"):
        check_index_bounds({"t": torch.tensor([-1, 0], dtype=torch.int32)}, bounds)
    wraps = {"t": IndexBound((IndexUse(-4, 4, "indices into dim 0 of a tensor of size 4", "1"),))}
    check_index_bounds({"t": torch.tensor([-4, 3])}, wraps)
    with pytest.raises(InputError, match=r"expected integers in \[-4, 4\) .* found -5$"):
        check_index_bounds({"t": torch.tensor([-5, 3])}, wraps)
    check_index_bounds({"t": torch.tensor([9]).to("meta")}, bounds)   # not on the CPU: not checked


# ------------------------------------------------------------------------------------------ random inputs
def test_random_inputs_keep_the_old_draws_and_respect_bounds():
    p = read_pipeline(GRAPHS / "tp_mlp" / "pipeline.json")
    old = random_inputs(p, 3)
    assert set(old) == set(p.input_names)
    for k, v in random_inputs(p, 3, bounds={}).items():
        assert torch.equal(v, old[k])
    # an integer input: the same draw as before without a bound, capped with one
    import dataclasses

    from fastpipe.format.model import TensorInfo

    q = dataclasses.replace(p, tensors={**p.tensors, "x": TensorInfo((64, 64), "i64")})
    free = random_inputs(q, 1)["x"]
    assert free.min() >= 0 and free.max() == INT_HIGH - 1
    two = random_inputs(q, 1, bounds={"x": 2})["x"]
    assert set(two.unique().tolist()) == {0, 1}
    assert torch.equal(random_inputs(q, 1, bounds={"x": 100})["x"], free)          # bounds above 8 keep [0, 8)
    assert torch.equal(random_inputs(q, 1, bounds={"x": IndexBound((IndexUse(0, 2, "", "1"),))})["x"], two)


# ------------------------------------------------------------------------------------------ tiny BERT, end to end
@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint

    root = tmp_path_factory.mktemp("bert")
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                     vocab_size=100, type_vocab_size=2)
    model = save_random_checkpoint(config, root / "ckpt", seed=0).eval()
    assert main(["build", str(root / "ckpt"), "--tp", "2", "--pp", "2", "--batch", "2", "--seq-len", "8",
                 "-o", str(root / "out")]) == 0
    return model, root / "out" / "pipeline.json"


def _reference(model, p, inputs):
    """The unsplit HF model on the pipeline's inputs (assembled into the model's by metadata)."""
    originals = {}
    for name, s in p.metadata.slices_inputs.items():
        o = p.metadata.tensors_inputs[s.origin]
        full = originals.setdefault(s.origin, torch.zeros(o.shape, dtype=inputs[name].dtype))
        full[tuple(slice(a, b) for a, b in s.placements)] = inputs[name]
    with torch.no_grad():
        out = model(**originals)
    return {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output}


def _assert_matches_reference(p, outs, ref):
    assert set(outs) == set(p.metadata.slices_outputs)
    for name, s in p.metadata.slices_outputs.items():
        want = ref[s.origin][tuple(slice(a, b) for a, b in s.placements)]
        torch.testing.assert_close(outs[name], want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_bert_token_type_ids_are_bounded_by_their_embedding(bert):
    _, path = bert
    p = read_pipeline(path)
    bounds = index_bounds(p)
    assert "token_type_ids" in bounds and (bounds["token_type_ids"].low, bounds["token_type_ids"].high) == (0, 2)
    assert bounds["token_type_ids"].uses[0].what == "indices into an embedding of 2 rows"
    assert "attention_mask" not in bounds
    # what the session finds on its validated graphs is the same
    with fastpipe.load(path, processor="reference") as sess:
        assert {k: b.high for k, b in sess.index_bounds.items()} == {k: b.high for k, b in bounds.items()}


def test_bert_random_inputs_run_compiled_and_match_the_unsplit_model(bert, tmp_path, capsys):
    model, path = bert
    out = tmp_path / "out.safetensors"
    rc = main(["run", str(path), "--outputs", str(out), "--warmup", "0", "--repeat", "1", "--seed", "4"])
    err = capsys.readouterr().err
    assert rc == 0, err
    p = read_pipeline(path)
    inputs = random_inputs(p, 4, bounds=index_bounds(p))        # what the run drew
    tt = inputs["token_type_ids"]
    assert tt.min() == 0 and tt.max() == 1
    assert inputs["input_ids"].max() >= 2, "the other integer inputs keep their range"
    _assert_matches_reference(p, load_file(str(out)), _reference(model, p, inputs))


def test_bert_token_type_out_of_range_is_a_one_line_input_error(bert, tmp_path):
    model, path = bert
    p = read_pipeline(path)
    inputs = random_inputs(p, 0, bounds=index_bounds(p))
    with fastpipe.load(path, processor="reference") as sess:
        _assert_matches_reference(p, sess.run(inputs), _reference(model, p, inputs))
        bad = dict(inputs, token_type_ids=inputs["token_type_ids"].clone())
        bad["token_type_ids"][1, 3] = 5
        with pytest.raises(InputError) as e:
            sess.run(bad)
        assert str(e.value) == ('inputs["token_type_ids"]: expected integers in [0, 2) '
                                '(indices into an embedding of 2 rows), found 5')
        with pytest.raises(InputError, match=r'^inputs\["token_type_ids"\]: .* found 5$'):
            sess.run({k: torch.cat([v, v]) for k, v in bad.items()}, chunks=2)
    # the command line, compiled, region processor, in its own process: exit 2, one line, no abort
    f = tmp_path / "bad.safetensors"
    save_file(bad, str(f))
    r = subprocess.run([sys.executable, "-m", "fastpipe", "run", str(path), "--inputs", str(f), "--processor", "region",
                        "--warmup", "0", "--repeat", "1"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2, r.stderr
    assert r.stderr == ('fastpipe: error: inputs["token_type_ids"]: expected integers in [0, 2) '
                        '(indices into an embedding of 2 rows), found 5\n')
