"""The builder's core on plain PyTorch modules: comm insertion, each TP layer kind, stages, shared parameters."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import fastpipe
from fastpipe.builder import markers
from fastpipe.builder.api import build
from fastpipe.builder.graph_split import comm_point
from fastpipe.builder.sharding import apply_sharding


def run_built(built, tmp_path, *inputs, names=None):
    sess = fastpipe.load(built.save(tmp_path / "out"))
    names = names or [f"input_{i}" for i in range(len(inputs))]
    return sess, sess.run(dict(zip(names, inputs)))


def kinds(built):
    return sorted(st["kind"] for st in built.doc["supertasks"].values() if st["kind"] not in ("input", "output", "fx"))


# ---------------------------------------------------------------- the sharding pass: one rule each
@pytest.mark.parametrize("src, dst, kind, params, out_shape", [
    ("partial:sum", "replicate", "all_reduce", {"op": "sum"}, (4, 6)),
    ("partial:sum", "shard:0", "reduce_scatter", {"op": "sum", "dim": 0}, (2, 6)),
    ("shard:1", "replicate", "all_gather", {"dim": 1}, (4, 12)),
    ("shard:0", "shard:1", "all_to_all", {"src_dim": 1, "dst_dim": 0}, (8, 3)),
])
def test_transition_becomes_comm(src, dst, kind, params, out_shape):
    gm = make_fx(lambda x: markers.transition(x * 2, src, dst, 2) + 1, tracing_mode="fake")(torch.empty(4, 6))
    assert apply_sharding(gm, rank=0, tp=2) == 1
    (c,) = [n for n in gm.graph.nodes if n.target is comm_point]
    comm = c.args[1]
    assert (comm.kind, dict(comm.params)) == (kind, params)
    assert tuple(c.meta["val"].shape) == out_shape
    assert not [n for n in gm.graph.nodes if n.target in markers.MARKERS]


def test_replicate_to_shard_is_a_local_slice():
    gm = make_fx(lambda x: markers.transition(x, "replicate", "shard:0", 2), tracing_mode="fake")(torch.empty(4, 3))
    assert apply_sharding(gm, rank=1, tp=2) == 0
    x = torch.arange(12.0).reshape(4, 3)
    torch.testing.assert_close(gm(x)[0] if isinstance(gm(x), tuple) else gm(x), x[2:4])


def test_equal_layouts_need_nothing():
    gm = make_fx(lambda x: markers.transition(x, "shard:0", "shard:0", 2) + 1, tracing_mode="fake")(torch.empty(4))
    assert apply_sharding(gm, rank=0, tp=2) == 0
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [torch.ops.aten.add.Tensor]


def test_partial_propagates_through_views_to_its_consumer():
    """layout/require pairs: the partial sum is reduced where its consumer needs it, after the views."""
    def f(x):
        y = markers.layout(x @ x.t(), "partial:sum")
        return markers.require(y.reshape(16) * 0.5, "replicate").relu()
    gm = make_fx(f, tracing_mode="fake")(torch.empty(4, 3))
    assert apply_sharding(gm, rank=0, tp=2) == 1
    order = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert order.index(comm_point) > order.index(torch.ops.aten.mul.Tensor)      # reduced after the scaling
    assert order.index(comm_point) < order.index(torch.ops.aten.relu.default)    # and before the nonlinearity


def test_partial_stops_at_a_nonlinear_op():
    def f(x):
        return markers.layout(x * 3, "partial:sum").exp()
    gm = make_fx(f, tracing_mode="fake")(torch.empty(4))
    assert apply_sharding(gm, rank=0, tp=2) == 1
    order = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert order.index(comm_point) < order.index(torch.ops.aten.exp.default)


# ---------------------------------------------------------------- each TP layer kind, numerically
class Block(nn.Module):
    def __init__(self, d=16, h=32, bias=True):
        super().__init__()
        self.fc1, self.fc2, self.ln = nn.Linear(d, h, bias=bias), nn.Linear(h, d, bias=bias), nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(x + self.fc2(F.gelu(self.fc1(x))))


class LM(nn.Module):
    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb, self.b0, self.b1, self.head = nn.Embedding(vocab, d), Block(d), Block(d), nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(self.b1(self.b0(self.emb(ids))))


PLAN = {"emb": "vocab", "b0.fc1": "column", "b0.fc2": "row", "b1.fc1": "column", "b1.fc2": "row", "head": "column_gather"}


@pytest.mark.parametrize("tp, vocab", [(2, 50), (4, 52), (3, 50)])
def test_column_row_vocab_and_head(tmp_path, tp, vocab):
    """vocab 50 over 3 ranks: blocks of 17, 17, 16 rows; ids outside a block give zeros on that rank."""
    torch.manual_seed(tp)
    m = LM(vocab).eval()
    if tp == 3:     # hidden sizes must divide by 3
        m = LM(vocab, d=18).eval()
        m.b0, m.b1 = Block(18, 36), Block(18, 36)
    ids = torch.randint(0, vocab, (2, 6))
    built = build(m, (ids,), tp=tp, plan=PLAN, input_names=["ids"], output_names=["logits"])
    _, out = run_built(built, tmp_path, ids, names=["ids"])
    with torch.no_grad():
        ref = m(ids)
    for k, v in out.items():
        torch.testing.assert_close(v, ref, rtol=1e-4, atol=1e-5)
    k = kinds(built)
    assert k.count("all_reduce") == 3 * tp            # embedding + two row layers, one per rank
    assert k.count("all_gather") == (tp if vocab % tp == 0 else 0)   # head kept whole when the vocab does not divide
    assert len(out) == tp                              # the replicated logits come back from every rank


def test_row_bias_added_once(tmp_path):
    torch.manual_seed(1)
    m = Block(8, 16).eval()
    with torch.no_grad():
        m.fc2.bias.fill_(3.0)
    x = torch.randn(5, 8)
    built = build(m, (x,), tp=4, plan={"fc1": "column", "fc2": "row"})
    _, out = run_built(built, tmp_path, x)
    torch.testing.assert_close(out["output"], m(x), rtol=1e-4, atol=1e-5)


def test_packed_column_per_part(tmp_path):
    """A fused [q; k; v] projection: every rank gets its share of each part, concatenated."""
    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return self.out(q * torch.sigmoid(k) + v)

    torch.manual_seed(2)
    m = QKV().eval()
    x = torch.randn(3, 8)
    built = build(m, (x,), tp=2, plan={"qkv": {"kind": "column", "parts": [8, 8, 8]}, "out": "row"})
    _, out = run_built(built, tmp_path, x)
    torch.testing.assert_close(out["output"], m(x), rtol=1e-4, atol=1e-5)
    qkv = sorted(tuple(t["value"]["placements"][0]) for t in built.doc["tensors"].values()
                 if t.get("value", {}).get("name") == "qkv.weight")
    assert qkv == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 24)]


def test_sequence_parallel(tmp_path):
    torch.manual_seed(3)
    m = LM().eval()
    ids = torch.randint(0, 50, (2, 6))
    built = build(m, (ids,), tp=2, plan=PLAN, sequence_parallel=True)
    assert {"reduce_scatter", "all_gather"} <= set(kinds(built))
    _, out = run_built(built, tmp_path, ids)
    torch.testing.assert_close(out["output"], m(ids), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- stages
class Skip(nn.Module):
    """Three stages; stage 0's output is used again by stage 2 (a skip connection)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(torch.relu(self.b(h))) + h


def test_skip_connection_sent_to_every_consumer_stage(tmp_path):
    torch.manual_seed(4)
    m = Skip().eval()
    x = torch.randn(4, 8)
    built = build(m, (x,), pp=3, split_points=["b", "c"])
    sess, out = run_built(built, tmp_path, x)
    torch.testing.assert_close(out["output"], m(x), rtol=1e-5, atol=1e-6)
    p = sess.pipeline
    sends = [(st.device, p.supertasks[next(s for s, t in p.supertasks.items() if t.kind == "recv" and t.group == st.group)].device)
             for st in p.supertasks.values() if st.kind == "send"]
    assert ("0", "2") in sends and ("0", "1") in sends   # h goes straight from stage 0 to stage 2
    assert len(p.devices) == 3


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.mid = nn.Linear(8, 8)

    def forward(self, x):
        return self.mid(x @ self.w) @ self.w.t()


@pytest.mark.parametrize("transmit", [False, True])
def test_parameter_used_by_two_stages(tmp_path, transmit):
    torch.manual_seed(5)
    m = Tied().eval()
    x = torch.randn(3, 8)
    built = build(m, (x,), pp=2, split_points=["mid"], transmit=["w"] if transmit else ())
    sess, out = run_built(built, tmp_path, x)
    torch.testing.assert_close(out["output"], m(x), rtol=1e-5, atol=1e-6)
    p = sess.pipeline
    w_consumers = {st.device for st in p.supertasks.values() if "w" in st.inputs}
    if transmit:   # loaded on stage 0 only, sent to stage 1
        assert w_consumers == {"0"} and any(st.kind == "send" and "w" in st.inputs for st in p.supertasks.values())
    else:          # each stage reads its own slice of the file
        assert w_consumers == {"0", "1"}


def test_save_writes_weights_and_validates(tmp_path):
    m = Skip().eval()
    x = torch.randn(2, 8)
    built = build(m, (x,), pp=2, split_points=["c"], input_names=["x"], output_names=["y"])
    path = built.save(tmp_path / "o")
    doc = json.loads(path.read_text())
    assert (tmp_path / "o" / "weights.safetensors").is_file()
    assert doc["metadata"]["tensors"]["inputs"] == {"x": {"shape": [2, 8], "dtype": "f32", "idx": 0}}
    from fastpipe.validate import validate
    from fastpipe.format import read_pipeline
    assert validate(read_pipeline(path)).graphs


def test_bad_arguments():
    m = Skip().eval()
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="pp=2 needs 1 split points"):
        build(m, (x,), pp=2)
    with pytest.raises(ValueError, match="no submodule named 'nope'"):
        build(m, (x,), tp=2, plan={"nope": "column"})
    with pytest.raises(ValueError, match="expected column, column_gather, row or vocab, found 'diagonal'"):
        build(m, (x,), tp=2, plan={"a": "diagonal"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_module_keeps_its_dtype(tmp_path, dtype):
    """A bf16/f16 module splits into shards of its own dtype (they were made float32 once, and the
    traced graph then mixed dtypes); the split model matches the unsplit one within the dtype's rounding."""
    torch.manual_seed(0)
    m = LM(52).eval().to(dtype)
    ids = torch.randint(0, 52, (2, 6))
    built = build(m, (ids,), tp=2, plan=PLAN, input_names=["ids"], output_names=["logits"])
    sess, out = run_built(built, tmp_path, ids, names=["ids"])
    consts = [t for t in sess.pipeline.tensors.values() if t.value is not None]
    assert consts and {t.dtype for t in consts} == {"bf16" if dtype == torch.bfloat16 else "f16"}
    with torch.no_grad():
        ref = m(ids)
    for v in out.values():
        assert v.dtype == dtype
        torch.testing.assert_close(v.float(), ref.float(), rtol=0, atol=3e-2 * ref.abs().max().item())


# ---------------------------------------------------------------- segments: where a weight-only node goes
def _two_level_graph():
    """w0, w1, w2: parameters; x: the pipeline input. y = x @ w0.t(); c = comm(y); z = (c @ w1.t()) @ w0.t()
    + w2.float(); w1's and w2's derived nodes are read only after the comm, w0's transpose before and after."""
    g = torch.fx.Graph()
    w0, w1, w2, x = (g.placeholder(n) for n in ("w0", "w1", "w2", "x"))
    t0 = g.call_function(torch.ops.aten.t.default, (w0,))
    y = g.call_function(torch.ops.aten.mm.default, (x, t0))
    c = g.call_function(comm_point, (y, None))
    t1 = g.call_function(torch.ops.aten.t.default, (w1,))
    cast = g.call_function(torch.ops.aten._to_copy.default, (w2,), {"dtype": torch.float32})
    z = g.call_function(torch.ops.aten.mm.default, (c, t1))
    z2 = g.call_function(torch.ops.aten.mm.default, (z, t0))
    out = g.call_function(torch.ops.aten.add.Tensor, (z2, cast))
    g.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), g), dict(t0=t0, y=y, c=c, t1=t1, cast=cast, z=z, z2=z2, out=out)


def test_a_weight_only_node_is_computed_where_it_is_first_read():
    """A weight's transpose or cast (fed by parameters alone) goes to the segment of its first reader, so a
    later segment does not receive a view of a weight as an input it must be handed (and the plan count as
    an intermediate); one read before and after the comm stays in the first segment."""
    from fastpipe.builder.graph_split import split_graph

    gm, n = _two_level_graph()
    seg = split_graph(gm, n_params=3)
    name = {v: k for k, v in n.items()}
    groups = {key: [name[m] for m in ns] for key, ns in seg.groups.items()}
    assert groups == {(0, 0): ["t0", "y"], (0, 1): ["t1", "cast", "z", "z2", "out"]}
    assert seg.comms == [n["c"]] and seg.level[n["c"]] == 0


@pytest.mark.parametrize("tp", [2, 4])
def test_no_weight_view_is_handed_between_supertasks(tp):
    """Across the LM's segments (a comm between each), every tensor one compute supertask hands another
    is an activation ([2, 6, ...]): no weight, transposed or not, travels as an intermediate."""
    torch.manual_seed(0)
    m = LM(52).eval()
    built = build(m, (torch.randint(0, 52, (2, 6)),), tp=tp, plan=PLAN, input_names=["ids"], output_names=["logits"])
    doc = built.doc
    made_by_fx = {o for st in doc["supertasks"].values() if st["kind"] == "fx" for o in st["outputs"]}
    handed = {i for st in doc["supertasks"].values() if st["kind"] == "fx" for i in st["inputs"] if i in made_by_fx}
    assert handed, "the LM's segments hand each other activations"
    weights = {tuple(t["shape"]) for t in doc["tensors"].values() if "value" in t and len(t["shape"]) == 2}
    assert len(weights) >= 2                           # shards of the embedding and head, of the blocks
    for name in handed:
        shape = tuple(doc["tensors"][name]["shape"])
        assert shape[:2] == (2, 6) and shape not in weights and shape[::-1] not in weights, (name, shape)
