"""One trace per distinct rank-local form (fastpipe.builder.rank_forms): a build that shares traces
writes the same pipeline, byte for byte, as one that traces every rank, for every tensor-parallel
layout the builders make; and ranks that differ are traced apart."""
import json

import pytest
import torch
from torch import nn

from fastpipe.builder import rank_forms
from fastpipe.builder.api import build
from fastpipe.builder.rank_forms import RankForms, copy_graph_module, form_of
from fastpipe.builder.tp_layers import ColumnLinear, VocabEmbedding
from tests.hf_models import make_checkpoint
from tests.test_build_core import LM, PLAN, Block

from fastpipe.builder.hf import build as hf_build  # noqa: E402  (after the transformers importorskip)


def _doc(built) -> str:
    return json.dumps(built.doc, sort_keys=True)


@pytest.fixture
def count_traces(monkeypatch):
    """The number of traces each build below ran, by RankForms.graph calls that traced."""
    counts = []
    graph = RankForms.graph

    def counting(self, local, key, trace):
        before = self.traced
        out = graph(self, local, key, trace)
        counts.append(self.traced - before)
        return out

    monkeypatch.setattr(RankForms, "graph", counting)
    return counts


def _every_rank_traced(monkeypatch):
    """form_of made unique per call: no two ranks share a trace (the builders' behaviour before)."""
    monkeypatch.setattr(rank_forms, "form_of", lambda module: object())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("forms")
    return {fam: root / fam for fam in ("gpt2", "llama", "bert") if make_checkpoint(fam, root / fam) is not None}


# (family, build_hf keywords, traces expected): llama's vocab 100 divides by 2 and 4; gpt2's 99 does not,
# so its last vocab block is short (a second form); at tp=4 llama's 2 KV heads are replicated.
HF_CASES = [
    ("llama", dict(tp=2, batch=2, seq_len=8), 1),
    ("llama", dict(tp=4, pp=2, batch=2, seq_len=8, past_len=5), 1),
    ("llama", dict(tp=2, batch=2, seq_len=1, max_len=16), 1),
    ("llama", dict(tp=4, batch=2, seq_len=8, max_len=16, cache_rows=4, last_logits=True), 1),
    ("llama", dict(tp=2, batch=2, seq_len=8, sequence_parallel=True), 1),
    ("gpt2", dict(tp=2, batch=2, seq_len=8), 2),
    ("gpt2", dict(tp=4, pp=2, batch=2, seq_len=8, past_len=5), 2),
    ("bert", dict(tp=4, batch=2, seq_len=8), 2),           # vocab 99 too
]


@pytest.mark.parametrize("family, kw, forms", HF_CASES, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(HF_CASES)])
def test_hf_build_shares_traces_and_writes_the_same_pipeline(checkpoints, monkeypatch, count_traces, family, kw, forms):
    shared = hf_build.build_hf(checkpoints[family], **kw)
    assert sum(count_traces) == forms
    count_traces.clear()
    _every_rank_traced(monkeypatch)
    apart = hf_build.build_hf(checkpoints[family], **kw)
    assert sum(count_traces) == kw["tp"]
    assert _doc(shared) == _doc(apart)


@pytest.mark.parametrize("tp, vocab, forms", [(2, 50, 1), (4, 52, 1), (3, 50, 2)])
def test_module_build_shares_traces_and_writes_the_same_pipeline(monkeypatch, count_traces, tp, vocab, forms):
    """vocab 50 over 3 ranks: blocks of 17, 17, 16 rows, so the last rank is a form of its own."""
    torch.manual_seed(tp)
    m = LM(vocab, d=18 if tp == 3 else 16).eval()
    if tp == 3:
        m.b0, m.b1 = Block(18, 36), Block(18, 36)
    ids = torch.randint(0, vocab, (2, 6))
    shared = build(m, (ids,), tp=tp, plan=PLAN, input_names=["ids"])
    assert sum(count_traces) == forms
    _every_rank_traced(monkeypatch)
    assert _doc(build(m, (ids,), tp=tp, plan=PLAN, input_names=["ids"])) == _doc(shared)


def test_form_holds_what_a_forward_can_read():
    a, b = VocabEmbedding("e", (50, 8), 0, 2), VocabEmbedding("e", (50, 8), 1, 2)
    assert (a.start, b.start) == (0, 25)
    assert form_of(a) == form_of(b)                      # start/stop reach the graph through a marker only
    assert form_of(VocabEmbedding("e", (49, 8), 1, 2)) != form_of(a)     # 24 rows, not 25
    c, d = ColumnLinear("l", (8, 8), True, 0, 2), ColumnLinear("l", (8, 8), True, 1, 2)
    assert form_of(c) == form_of(d)
    d.gather = True                                      # a plain attribute the forward reads
    assert form_of(c) != form_of(d)
    e, f = nn.Module(), nn.Module()
    e.register_buffer("table", torch.arange(4.0))
    f.register_buffer("table", torch.arange(4.0) + 1)    # a real buffer's values are baked into the graph
    assert form_of(e) != form_of(f)
    f.table = torch.arange(4.0)
    assert form_of(e) == form_of(f)
    f.register_forward_hook(lambda m, a, out: out)
    assert form_of(e) != form_of(f)


def test_a_copy_is_rewritten_apart_from_its_template():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: torch.relu(x) + 1, tracing_mode="fake")(torch.ones(3))
    cp = copy_graph_module(gm)
    assert [n.name for n in cp.graph.nodes] == [n.name for n in gm.graph.nodes]
    assert all(a.meta.get("val") is b.meta.get("val") for a, b in zip(cp.graph.nodes, gm.graph.nodes))
    relu = next(n for n in cp.graph.nodes if n.target is torch.ops.aten.relu.default)
    relu.replace_all_uses_with(relu.args[0])
    cp.graph.erase_node(relu)
    cp.recompile()
    assert any(n.target is torch.ops.aten.relu.default for n in gm.graph.nodes)
    x = torch.tensor([-1.0, 2.0])
    assert torch.equal(gm(x), torch.tensor([1.0, 3.0])) and torch.equal(cp(x), torch.tensor([0.0, 3.0]))
