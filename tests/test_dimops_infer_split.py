"""Shape inference, the dim split algorithm, layouts/comm, the aten registry and
the @dimop decorator of fastpipe.builder.dimops -- with numeric checks that a
split op, run per slot on the sliced inputs and combined by the output
layouts, equals the unsplit op."""
from __future__ import annotations

import itertools

import pytest
import torch

from fastpipe.builder import dimops
from fastpipe.builder.dimops import (
    AnnotationError,
    Comm,
    Partial,
    Replicate,
    Shard,
    annotation_for,
    call_slots,
    comm_between,
    dimop,
    format_annotation,
    infer_shapes,
    input_shapes_for,
    parse,
    register_annotation,
    split,
)

aten = torch.ops.aten


def err(anno: str, message: str) -> str:
    return f'annotation "{anno}": {message}'


# ================================================================ infer_shapes


def test_infer_matmul():
    assert infer_shapes("m k+, k+ n -> m n", [(4, 6), (6, 8)]) == [(4, 8)]
    assert infer_shapes(parse("m k+, k+ n -> m n"), [torch.Size([4, 6]), [6, 8]]) == [(4, 8)]


def test_infer_batched_star():
    anno = "* m k+, * k+ n -> * m n"
    assert infer_shapes(anno, [(2, 3, 4, 5), (2, 3, 5, 6)]) == [(2, 3, 4, 6)]
    assert infer_shapes(anno, [(4, 5), (5, 6)]) == [(4, 6)]  # '*' may expand to no dims
    with pytest.raises(AnnotationError) as e:
        infer_shapes(anno, [(2, 4, 5), (3, 5, 6)])
    assert str(e.value) == err(anno, "'*' is [2] (input 0 dims 0..0) but [3] (input 1 dims 0..0)")


def test_infer_groups_with_kwargs():
    anno = "b s (h d) -> b h s d"
    assert infer_shapes(anno, [(2, 3, 12)], h=4) == [(2, 4, 3, 3)]
    assert infer_shapes(anno, [(2, 3, 12)], d=6) == [(2, 2, 3, 6)]
    assert infer_shapes(anno, [(2, 3, 12)], h=4, d=3) == [(2, 4, 3, 3)]
    assert infer_shapes(parse(anno).with_sizes(h=3), [(2, 3, 12)]) == [(2, 3, 3, 4)]
    # the group on the output side: sizes come from the input
    assert infer_shapes("b h s d -> b s (h d)", [(2, 4, 3, 5)]) == [(2, 3, 20)]
    # a number inside a group
    assert infer_shapes("(a 2) -> a 2", [(10,)]) == [(5, 2)]


def test_infer_group_errors():
    anno = "b s (h d) -> b h s d"
    with pytest.raises(AnnotationError) as e:
        infer_shapes(anno, [(2, 3, 12)])
    assert str(e.value) == err(
        anno, "input 0 dim 2: group (h d) has unknown sizes h, d; give all but one as keyword arguments (e.g. h=...)"
    )
    with pytest.raises(AnnotationError) as e:
        infer_shapes(anno, [(2, 3, 12)], h=5)
    assert str(e.value) == err(anno, "input 0 dim 2: group (h d) cannot be 12 (not a multiple of the known part 5)")
    with pytest.raises(AnnotationError) as e:
        infer_shapes(anno, [(2, 3, 12)], h=4, d=4)
    assert str(e.value) == err(anno, "input 0 dim 2: group (h d) is 16 but the dimension is 12")
    with pytest.raises(AnnotationError) as e:
        infer_shapes(anno, [(2, 3, 12)], x=4)
    assert str(e.value) == err(anno, 'keyword argument "x" names no identifier of the annotation')
    with pytest.raises(AnnotationError) as e:
        infer_shapes(anno, [(2, 3, 12)], h=0)
    assert str(e.value) == err(anno, "keyword argument h: expected a positive int, found 0")
    with pytest.raises(AnnotationError) as e:
        infer_shapes(parse(anno).with_sizes(h=3), [(2, 3, 12)], h=4)
    assert str(e.value) == err(anno, "keyword argument h=4 disagrees with the annotation's size h=3")


def test_infer_size_errors():
    anno = "m k+, k+ n -> m n"
    with pytest.raises(AnnotationError) as e:
        infer_shapes(anno, [(4, 6), (7, 8)])
    assert str(e.value) == err(anno, 'identifier "k" is 6 (input 0 dim 1) but 7 (input 1 dim 0)')
    with pytest.raises(AnnotationError) as e:
        infer_shapes(anno, [(4, 6, 1), (6, 8)])
    assert str(e.value) == err(anno, "input 0: expected 2 dims, found shape [4, 6, 1]")
    with pytest.raises(AnnotationError) as e:
        infer_shapes(anno, [(4, 6)])
    assert str(e.value) == err(anno, "expected 2 input shapes, found 1")
    with pytest.raises(AnnotationError) as e:
        infer_shapes(anno, [(4, 6), None])
    assert str(e.value) == err(anno, "input 1 is annotated as a tensor but has no shape")
    with pytest.raises(AnnotationError) as e:
        infer_shapes(anno, [(4, 6), (6, 8)], k=5)
    assert str(e.value) == err(anno, 'identifier "k" is 5 (keyword argument k=5) but 6 (input 0 dim 1)')
    with pytest.raises(AnnotationError) as e:
        infer_shapes("a 4 -> a", [(2, 5)])
    assert str(e.value) == err("a 4 -> a", "input 0 dim 1: expected 4 (a fixed size), found 5")
    with pytest.raises(AnnotationError) as e:
        infer_shapes("* m -> m", [()])
    assert str(e.value) == err("* m -> m", "input 0: expected at least 1 dims, found shape []")
    with pytest.raises(AnnotationError) as e:
        infer_shapes("m -> m", [(-1,)])
    assert str(e.value) == err("m -> m", "input 0: expected a shape of non-negative ints, found [-1]")


def test_infer_question_mark_and_numbers():
    assert infer_shapes("a b, ? -> a b", [(2, 3), None]) == [(2, 3)]
    assert infer_shapes("a b, ? -> a b", [(2, 3), (7, 7, 7)]) == [(2, 3)]  # ignored
    assert infer_shapes("-> 3 4", []) == [(3, 4)]
    assert infer_shapes("a b+ -> a, a 1, 5", [(2, 3)]) == [(2,), (2, 1), (5,)]


# ================================================================ layouts / comm_between

R, S0, S1, PS, PM = Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("max")

EXPECTED_COMMS = {
    (R, R): None,
    (R, S0): Comm("slice", {"dim": 0}),
    (R, S1): Comm("slice", {"dim": 1}),
    (R, PS): Comm("to_partial", {"op": "sum"}),
    (R, PM): Comm("to_partial", {"op": "max"}),
    (S0, R): Comm("all_gather", {"dim": 0}),
    (S0, S0): None,
    (S0, S1): Comm("all_to_all", {"src_dim": 1, "dst_dim": 0}),
    (S0, PS): Comm("to_partial", {"op": "sum", "dim": 0}),
    (S0, PM): Comm("to_partial", {"op": "max", "dim": 0}),
    (S1, R): Comm("all_gather", {"dim": 1}),
    (S1, S0): Comm("all_to_all", {"src_dim": 0, "dst_dim": 1}),
    (S1, S1): None,
    (S1, PS): Comm("to_partial", {"op": "sum", "dim": 1}),
    (S1, PM): Comm("to_partial", {"op": "max", "dim": 1}),
    (PS, R): Comm("all_reduce", {"op": "sum"}),
    (PS, S0): Comm("reduce_scatter", {"op": "sum", "dim": 0}),
    (PS, S1): Comm("reduce_scatter", {"op": "sum", "dim": 1}),
    (PS, PS): None,
    (PM, R): Comm("all_reduce", {"op": "max"}),
    (PM, S0): Comm("reduce_scatter", {"op": "max", "dim": 0}),
    (PM, S1): Comm("reduce_scatter", {"op": "max", "dim": 1}),
    (PM, PM): None,
}


@pytest.mark.parametrize("pair", list(EXPECTED_COMMS), ids=lambda p: f"{p[0]}->{p[1]}")
def test_comm_between_table(pair):
    assert comm_between(*pair) == EXPECTED_COMMS[pair]


def test_comm_between_partial_ops_refused():
    with pytest.raises(AnnotationError) as e:
        comm_between(PS, PM)
    assert str(e.value) == "comm_between: no single step turns Partial('sum') into Partial('max'); all_reduce first"
    with pytest.raises(AnnotationError):
        comm_between(PM, PS)
    with pytest.raises(AnnotationError, match="producer must be"):
        comm_between("Shard(0)", R)


def test_layout_validation():
    with pytest.raises(AnnotationError, match="Shard.dim: expected an int >= 0, found -1"):
        Shard(-1)
    with pytest.raises(AnnotationError, match="Partial.op: expected one of sum, avg, max, min, found 'prod'"):
        Partial("prod")
    assert Partial() == Partial("sum")
    assert hash(Comm("all_gather", {"dim": 1})) == hash(Comm("all_gather", {"dim": 1}))
    assert Comm("slice", {"dim": 0}).is_local and not Comm("all_reduce", {"op": "sum"}).is_local


# A simulator of SPEC §1 comm semantics on n slots, to check comm_between exactly.

N = 2
REDUCE = {
    "sum": lambda xs: sum(xs[1:], xs[0]),
    "avg": lambda xs: sum(xs[1:], xs[0]) / len(xs),
    "max": lambda xs: torch.stack(xs).amax(0),
    "min": lambda xs: torch.stack(xs).amin(0),
}
IDENTITY = {"sum": 0.0, "avg": 0.0, "max": float("-inf"), "min": float("inf")}


def pieces(x, layout, gen):
    if isinstance(layout, Replicate):
        return [x.clone() for _ in range(N)]
    if isinstance(layout, Shard):
        return [c.clone() for c in torch.chunk(x, N, layout.dim)]
    noise = [torch.rand(x.shape, generator=gen) for _ in range(N)]
    if layout.op == "sum":
        return noise[:-1] + [x - sum(noise[:-1])]
    if layout.op == "avg":
        return noise[:-1] + [N * x - sum(noise[:-1])]
    if layout.op == "max":
        return [x] + [x - n for n in noise[1:]]
    return [x] + [x + n for n in noise[1:]]


def apply(comm, xs, full_shape):
    if comm is None:
        return xs
    p = comm.params
    if comm.kind == "all_reduce":
        return [REDUCE[p["op"]](xs)] * N
    if comm.kind == "reduce_scatter":
        return list(torch.chunk(REDUCE[p["op"]](xs), N, p["dim"]))
    if comm.kind == "all_gather":
        return [torch.cat(xs, p["dim"])] * N
    if comm.kind == "all_to_all":
        return [torch.cat([torch.chunk(x, N, p["src_dim"])[i] for x in xs], p["dst_dim"]) for i in range(N)]
    if comm.kind == "slice":
        return [torch.chunk(x, N, p["dim"])[i] for i, x in enumerate(xs)]
    assert comm.kind == "to_partial"
    op = p["op"]
    if "dim" not in p:
        if op == "avg":
            return list(xs)
        return [xs[0]] + [torch.full_like(x, IDENTITY[op]) for x in xs[1:]]
    out = []
    for i, x in enumerate(xs):
        full = torch.full(full_shape, IDENTITY[op])
        full.narrow(p["dim"], i * x.shape[p["dim"]], x.shape[p["dim"]]).copy_(x)
        out.append(full * N if op == "avg" else full)
    return out


def holds(x, layout, ys):
    if isinstance(layout, Replicate):
        return all(torch.allclose(y, x) for y in ys)
    if isinstance(layout, Shard):
        return all(torch.allclose(y, c) for y, c in zip(ys, torch.chunk(x, N, layout.dim)))
    return torch.allclose(REDUCE[layout.op](ys), x, atol=1e-5)


ALL_LAYOUTS = [R, S0, S1, PS, PM, Partial("avg"), Partial("min")]


@pytest.mark.parametrize("producer,consumer", list(itertools.product(ALL_LAYOUTS, ALL_LAYOUTS)), ids=str)
def test_comm_between_semantics(producer, consumer):
    """Every step comm_between names, run with SPEC semantics, gives the consumer's layout."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=gen)
    if isinstance(producer, Partial) and isinstance(consumer, Partial) and producer != consumer:
        with pytest.raises(AnnotationError):
            comm_between(producer, consumer)
        return
    ys = apply(comm_between(producer, consumer), pieces(x, producer, gen), x.shape)
    assert holds(x, consumer, ys)


# ================================================================ split: plans


def test_split_matmul_rows():
    plan = split("m k+, k+ n -> m n", "m", 2, [(4, 6), (6, 8)])
    assert plan.inputs == (Shard(0), Replicate())
    assert plan.outputs == (Shard(0),)
    assert plan.comms == (None,)
    assert plan.input_shapes == ((2, 6), (6, 8)) and plan.output_shapes == ((2, 8),)
    assert plan.size == 4 and plan.n == 2 and dict(plan.local_sizes) == {"m": 2, "k": 6, "n": 8}
    assert plan.comm_to(0, Replicate()) == Comm("all_gather", {"dim": 0})
    assert plan.comm_to(0, Shard(1)) == Comm("all_to_all", {"src_dim": 1, "dst_dim": 0})


def test_split_matmul_cols():
    plan = split("m k+, k+ n -> m n", "n", 4, [(4, 6), (6, 8)])
    assert plan.inputs == (Replicate(), Shard(1))
    assert plan.outputs == (Shard(1),)
    assert plan.output_shapes == ((4, 2),)


def test_split_matmul_reduction():
    plan = split("m k+, k+ n -> m n", "k", 3, [(4, 6), (6, 8)])
    assert plan.inputs == (Shard(1), Shard(0))
    assert plan.outputs == (Partial("sum"),)
    assert plan.comms == (Comm("all_reduce", {"op": "sum"}),)
    assert plan.comm_to(0, Shard(0)) == Comm("reduce_scatter", {"op": "sum", "dim": 0})
    assert plan.output_shapes == ((4, 8),)


def test_split_refusals():
    anno = "m^ k+, k+ n -> m^ n"
    with pytest.raises(AnnotationError) as e:
        split(anno, "m", 2, [(4, 6), (6, 8)])
    assert str(e.value) == err(anno, "identifier \"m\" is marked '^' (not partitionable)")
    with pytest.raises(AnnotationError) as e:
        split(anno, "k", 4, [(4, 6), (6, 8)])
    assert str(e.value) == err(anno, 'identifier "k" has size 6, not divisible by 4')
    with pytest.raises(AnnotationError) as e:
        split(anno, "q", 2, [(4, 6), (6, 8)])
    assert str(e.value) == err(anno, 'no identifier "q" to split')
    with pytest.raises(AnnotationError) as e:
        split("a 4 -> a 4", "4", 2, [(2, 4)])
    assert str(e.value) == err("a 4 -> a 4", '"4" is a number (a fixed size), not partitionable')
    with pytest.raises(AnnotationError) as e:
        split("* a -> * a", "*", 2, [(2, 4)])
    assert str(e.value) == err("* a -> * a", "'*' cannot be split (name the dimensions to split them)")
    with pytest.raises(AnnotationError) as e:
        split(anno, "k", 0, [(4, 6), (6, 8)])
    assert str(e.value) == err(anno, "split over n slots: expected an int n >= 1, found 0")


def test_split_star_counts_expanded_dims():
    plan = split("* m k+, * k+ n -> * m n", "n", 2, [(2, 3, 4, 6), (2, 3, 6, 8)])
    assert plan.inputs == (Replicate(), Shard(3))
    assert plan.outputs == (Shard(3),)
    assert plan.output_shapes == ((2, 3, 4, 4),)


def test_split_group_outer_factor():
    anno = "b s (h d) -> b h s d"
    plan = split(anno, "h", 2, [(2, 3, 12)], h=4)
    assert plan.inputs == (Shard(2),)
    assert plan.outputs == (Shard(1),)
    assert plan.input_shapes == ((2, 3, 6),) and plan.output_shapes == ((2, 2, 3, 3),)
    assert dict(plan.local_sizes)["h"] == 2
    with pytest.raises(AnnotationError) as e:
        split(anno, "d", 3, [(2, 3, 12)], h=4)
    assert str(e.value) == err(
        anno, 'identifier "d" is not the outermost of group (h d) in input 0; only a group\'s first identifier can be split'
    )
    with pytest.raises(AnnotationError) as e:
        split(anno, "h", 3, [(2, 3, 12)], h=4)
    assert str(e.value) == err(anno, 'identifier "h" has size 4, not divisible by 3')


def test_keyword_sizes_may_use_any_identifier_name():
    # the leading parameters are positional-only, so identifiers named n or anno are fine
    plan = split("(n d) -> n d", "n", 2, [(8,)], n=4)
    assert plan.outputs == (Shard(0),) and plan.output_shapes == ((2, 2),)
    assert infer_shapes("(anno input_shapes) -> anno input_shapes", [(6,)], anno=3) == [(3, 2)]


def test_split_spatial_missing_from_output_is_replicate_and_question_mark_slots():
    plan = split("a b, ?, c -> a b, c", "a", 2, [(4, 2), None, (3,)])
    assert plan.inputs == (Shard(0), None, Replicate())
    assert plan.outputs == (Shard(0), Replicate())
    plan = split("a b, ? -> a b", "a", 2, [(4, 2), ()])  # an ignored 0-d tensor stays whole
    assert plan.inputs == (Shard(0), Replicate())


# ================================================================ split: numeric checks


def run_split(op, args, kwargs, ident, n, fix=None):
    """Split the call per the plan, run each slot, combine per output layout,
    and compare with the unsplit op. Returns the plan."""
    kwargs = dict(kwargs or {})
    anno = annotation_for(op, args, kwargs)
    assert anno is not None, f"no annotation for {op}"
    shapes = input_shapes_for(anno, op, args, kwargs)
    plan = split(anno, ident, n, shapes)
    layout_of = {}
    for slot, layout in zip(call_slots(op, args, kwargs), plan.inputs):
        if isinstance(slot, torch.Tensor):
            assert id(slot) not in layout_of, "use distinct tensors"
            layout_of[id(slot)] = layout

    def local(x, rank):
        if isinstance(x, torch.Tensor):
            layout = layout_of.get(id(x), Replicate())
            return torch.chunk(x, n, layout.dim)[rank] if isinstance(layout, Shard) else x
        if isinstance(x, list):
            return [local(e, rank) for e in x]
        return x

    per_rank = []
    for rank in range(n):
        largs = [local(a, rank) for a in args]
        lkw = {k: local(v, rank) for k, v in kwargs.items()}
        if fix is not None:
            largs, lkw = fix(largs, lkw, plan, rank)
        out = op(*largs, **lkw)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        for o, shape in zip(outs, plan.output_shapes):
            assert tuple(o.shape) == shape
        per_rank.append(outs)
    full = op(*args, **kwargs)
    fulls = list(full) if isinstance(full, (tuple, list)) else [full]
    assert len(fulls) == len(plan.outputs)
    for k, (f, layout) in enumerate(zip(fulls, plan.outputs)):
        got = [r[k] for r in per_rank]
        if isinstance(layout, Shard):
            torch.testing.assert_close(torch.cat(got, layout.dim), f)
        elif isinstance(layout, Partial):
            torch.testing.assert_close(sum(got[1:], got[0]), f, atol=1e-5, rtol=1e-5)
        else:
            for g in got:
                torch.testing.assert_close(g, f)
    return plan


@pytest.fixture
def g():
    return torch.Generator().manual_seed(1234)


def rn(g, *shape):
    return torch.randn(*shape, generator=g)


@pytest.mark.parametrize("ident,inputs,output", [
    ("m", (Shard(0), Replicate()), Shard(0)),
    ("n", (Replicate(), Shard(1)), Shard(1)),
    ("k", (Shard(1), Shard(0)), Partial("sum")),
])
def test_numeric_mm(g, ident, inputs, output):
    plan = run_split(aten.mm.default, (rn(g, 4, 6), rn(g, 6, 8)), {}, ident, 2)
    assert plan.inputs == inputs and plan.outputs == (output,)


def test_numeric_bmm_and_matmul(g):
    run_split(aten.bmm.default, (rn(g, 4, 3, 6), rn(g, 4, 6, 5)), {}, "b", 2)
    run_split(aten.bmm.default, (rn(g, 4, 3, 6), rn(g, 4, 6, 5)), {}, "k", 3)
    plan = run_split(aten.matmul.default, (rn(g, 2, 4, 3, 6), rn(g, 6, 5)), {}, "b1", 2)
    assert plan.inputs == (Shard(1), Replicate())
    run_split(aten.matmul.default, (rn(g, 2, 1, 3, 6), rn(g, 4, 6, 5)), {}, "k", 2)
    run_split(aten.matmul.default, (rn(g, 2, 1, 3, 6), rn(g, 4, 6, 5)), {}, "b1", 2)


def test_numeric_addmm_and_linear(g):
    plan = run_split(aten.addmm.default, (rn(g, 8), rn(g, 4, 6), rn(g, 6, 8)), {}, "n", 2)
    assert plan.inputs == (Shard(0), Replicate(), Shard(1))
    run_split(aten.addmm.default, (rn(g, 4, 1), rn(g, 4, 6), rn(g, 6, 8)), {}, "m", 2)
    with pytest.raises(AnnotationError, match="marked '\\^'"):
        run_split(aten.addmm.default, (rn(g, 8), rn(g, 4, 6), rn(g, 6, 8)), {}, "k", 2)
    run_split(aten.addmm.default, (rn(g, 8), rn(g, 4, 6), rn(g, 6, 8)), {"beta": 0}, "k", 2)
    # column-parallel linear with bias, row-parallel linear without
    plan = run_split(aten.linear.default, (rn(g, 2, 3, 6), rn(g, 8, 6), rn(g, 8)), {}, "n", 2)
    assert plan.inputs == (Replicate(), Shard(0), Shard(0)) and plan.outputs == (Shard(2),)
    plan = run_split(aten.linear.default, (rn(g, 2, 3, 6), rn(g, 8, 6)), {}, "k", 2)
    assert plan.inputs == (Shard(2), Shard(1)) and plan.outputs == (Partial("sum"),)


def test_numeric_attention_heads(g):
    q, k, v = rn(g, 2, 4, 5, 8), rn(g, 2, 4, 7, 8), rn(g, 2, 4, 7, 6)
    anno = annotation_for(aten.scaled_dot_product_attention.default, (q, k, v), {})
    assert format_annotation(anno) == "b0 b1 s d^, b0 b1 t^ d^, b0 b1 t^ e -> b0 b1 s e"
    plan = run_split(aten.scaled_dot_product_attention.default, (q, k, v), {}, "b1", 2)
    assert plan.inputs == (Shard(1),) * 3 and plan.outputs == (Shard(1),)
    run_split(aten.scaled_dot_product_attention.default, (q, k, v), {}, "s", 5)
    run_split(aten.scaled_dot_product_attention.default, (q, k, v), {}, "e", 3)
    for ident in ("d", "t"):
        with pytest.raises(AnnotationError, match="not partitionable"):
            split(anno, ident, 2, [q.shape, k.shape, v.shape])
    # a broadcast mask follows the queries
    mask = rn(g, 1, 4, 5, 7)
    run_split(aten.scaled_dot_product_attention.default, (q, k, v, mask), {}, "s", 5)
    plan = run_split(aten.scaled_dot_product_attention.default, (q, k, v, mask), {}, "b1", 2)
    assert plan.inputs[3] == Shard(1)
    # causal: the query positions are not partitionable, the heads are
    q2, k2, v2 = rn(g, 2, 4, 6, 8), rn(g, 2, 4, 6, 8), rn(g, 2, 4, 6, 8)
    causal = annotation_for(aten.scaled_dot_product_attention.default, (q2, k2, v2), {"is_causal": True})
    with pytest.raises(AnnotationError, match='"s" is marked'):
        split(causal, "s", 2, [q2.shape] * 3)
    run_split(aten.scaled_dot_product_attention.default, (q2, k2, v2), {"is_causal": True}, "b1", 4)
    # the CPU flash variant make_fx produces: (out, logsumexp)
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    plan = run_split(flash, (q2, k2, v2), {"is_causal": True}, "b1", 2)
    assert plan.outputs == (Shard(1), Shard(1))
    v8 = rn(g, 2, 4, 7, 8)
    plan = run_split(flash, (q, k, v8), {}, "s", 5)
    assert plan.outputs == (Shard(2), Shard(2))
    anno = annotation_for(flash, (q, k, v8), {})
    assert format_annotation(anno) == "b0 b1 s d^, b0 b1 t^ d^, b0 b1 t^ e^ -> b0 b1 s e^, b0 b1 s"
    with pytest.raises(AnnotationError, match='"e" is marked'):  # the kernel needs equal head sizes
        split(anno, "e", 2, input_shapes_for(anno, flash, (q, k, v8), {}))
    # its mask is a keyword-only argument: the slot after dropout_p and is_causal
    mask = rn(g, 2, 1, 5, 7)
    anno = annotation_for(flash, (q, k, v8), {"attn_mask": mask})
    assert format_annotation(anno).startswith("b0 b1 s d^, b0 b1 t^ d^, b0 b1 t^ e^, ?, ?, b0 1 s t^ ->")
    plan = run_split(flash, (q, k, v8), {"attn_mask": mask}, "b0", 2)
    assert plan.inputs == (Shard(0), Shard(0), Shard(0), None, None, Shard(0))


def test_attention_gqa_heads_not_partitionable(g):
    q, k, v = rn(g, 1, 4, 5, 8), rn(g, 1, 2, 5, 8), rn(g, 1, 2, 5, 8)
    anno = annotation_for(aten.scaled_dot_product_attention.default, (q, k, v), {"enable_gqa": True})
    assert format_annotation(anno) == "b0 h^ s d^, b0 g^ t^ d^, b0 g^ t^ e -> b0 h^ s e"


def test_numeric_layer_norm(g):
    x, w, b = rn(g, 4, 3, 8), rn(g, 8), rn(g, 8)
    op = aten.native_layer_norm.default
    plan = run_split(op, (x, [8], w, b, 1e-5), {}, "a", 2)
    assert plan.inputs == (Shard(0), None, Replicate(), Replicate())
    assert plan.outputs == (Shard(0), Shard(0), Shard(0))
    run_split(op, (x, [8], w, b, 1e-5), {}, "b", 3)
    anno = annotation_for(op, (x, [8], w, b, 1e-5), {})
    assert format_annotation(anno) == "a b c^, ?, c^, c^ -> a b c^, a b 1, a b 1"
    with pytest.raises(AnnotationError) as e:
        split(anno, "c", 2, input_shapes_for(anno, op, (x, [8], w, b, 1e-5), {}))
    assert str(e.value) == err(format_annotation(anno), "identifier \"c\" is marked '^' (not partitionable)")
    run_split(op, (x, [3, 8], None, None, 1e-5), {}, "a", 4)
    run_split(aten.layer_norm.default, (x, [8], w, b), {}, "b", 3)


def test_numeric_embedding(g):
    weight, idx = rn(g, 10, 8), torch.randint(0, 10, (2, 3), generator=g)
    plan = run_split(aten.embedding.default, (weight, idx), {}, "e", 2)
    assert plan.inputs == (Shard(1), Replicate()) and plan.outputs == (Shard(2),)
    plan = run_split(aten.embedding.default, (weight, idx), {}, "i0", 2)
    assert plan.inputs == (Replicate(), Shard(0)) and plan.outputs == (Shard(0),)
    anno = annotation_for(aten.embedding.default, (weight, idx), {})
    with pytest.raises(AnnotationError, match='"v" is marked'):
        split(anno, "v", 2, [weight.shape, idx.shape])


def _view_fix(largs, lkw, plan, rank):
    return [largs[0], list(plan.output_shapes[0])], lkw


def test_numeric_view_group_split(g):
    x = rn(g, 2, 3, 4 * 5)
    anno = annotation_for(aten.view.default, (x, [2, 3, 4, 5]), {})
    assert format_annotation(anno) == "a b (c d^) -> a b c d^" and anno.sizes == (("c", 4),)
    plan = run_split(aten.view.default, (x, [2, 3, 4, 5]), {}, "c", 2, fix=_view_fix)
    assert plan.inputs == (Shard(2),) and plan.outputs == (Shard(2),)
    with pytest.raises(AnnotationError, match="'\\^' \\(not partitionable\\)"):
        split(anno, "d", 5, [x.shape])
    # merging heads back, and the matmul decomposition's flattening
    y = rn(g, 2, 3, 4, 5)
    plan = run_split(aten.view.default, (y, [2, 3, 20]), {}, "c", 4, fix=_view_fix)
    assert plan.inputs == (Shard(2),) and plan.outputs == (Shard(2),)
    plan = run_split(aten._unsafe_view.default, (x, [6, 20]), {}, "a", 2, fix=_view_fix)
    assert plan.outputs == (Shard(0),)


def test_numeric_elementwise_and_reductions(g):
    x, bias = rn(g, 4, 6), rn(g, 6)
    plan = run_split(aten.add.Tensor, (x, bias), {}, "b", 3)
    assert plan.inputs == (Shard(1), Shard(0))  # the trailing alpha slot is left out
    plan = run_split(aten.mul.Tensor, (x, rn(g, 4, 1)), {}, "a", 2)
    assert plan.inputs[1] == Shard(0)
    run_split(aten.gelu.default, (rn(g, 4, 6),), {}, "b", 2)
    run_split(aten.where.self, (x > 0, rn(g, 4, 6), rn(g, 1, 6)), {}, "b", 2)
    plan = run_split(aten.sum.dim_IntList, (rn(g, 4, 6), [1]), {}, "b", 2)
    assert plan.outputs == (Partial("sum"),)
    run_split(aten.sum.dim_IntList, (rn(g, 4, 6), [1], True), {}, "a", 2)
    run_split(aten._softmax.default, (rn(g, 4, 6), -1, False), {}, "a", 4)
    with pytest.raises(AnnotationError, match="not partitionable"):
        anno = annotation_for(aten.mean.dim, (x, [1]), {})
        split(anno, "b", 2, [x.shape, None])
    run_split(aten.cat.default, ([rn(g, 4, 2), rn(g, 4, 3)], 1), {}, "a", 2)


def test_numeric_transposes(g):
    plan = run_split(aten.t.default, (rn(g, 4, 6),), {}, "a", 2)
    assert plan.inputs == (Shard(0),) and plan.outputs == (Shard(1),)
    run_split(aten.transpose.int, (rn(g, 2, 4, 6), 0, -1), {}, "b", 2)
    plan = run_split(aten.permute.default, (rn(g, 2, 4, 6), [2, 0, 1]), {}, "a", 2)
    assert plan.outputs == (Shard(1),)


# ================================================================ registry


def _cases():
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x3 = r(2, 3, 8)
    return [
        (aten.mm.default, (r(4, 6), r(6, 8)), {}, "m k+, k+ n -> m n"),
        (aten.bmm.default, (r(2, 4, 6), r(2, 6, 8)), {}, "b m k+, b k+ n -> b m n"),
        (aten.addmm.default, (r(8), r(4, 6), r(6, 8)), {}, "n, m k^, k^ n -> m n"),
        (aten.matmul.default, (r(2, 4, 6), r(6, 8)), {}, "b0 m k+, k+ n -> b0 m n"),
        (aten.matmul.default, (r(6), r(2, 6, 8)), {}, "k+, b0 k+ n -> b0 n"),
        (aten.linear.default, (x3, r(5, 8)), {}, "b0 b1 k+, n k+ -> b0 b1 n"),
        (aten.linear.default, (x3, r(5, 8), r(5)), {}, "b0 b1 k^, n k^, n -> b0 b1 n"),
        (aten.t.default, (r(4, 6),), {}, "a b -> b a"),
        (aten.transpose.int, (x3, 1, 2), {}, "a b c -> a c b"),
        (aten.permute.default, (x3, [2, 0, 1]), {}, "a b c -> c a b"),
        (aten.view.default, (x3, [6, 8]), {}, "a b^ c -> (a b^) c"),
        (aten.reshape.default, (x3, [2, 3, 2, 4]), {}, "a b (c d^) -> a b c d^"),
        (aten._unsafe_view.default, (x3, [2, 1, 24]), {}, "a b c^ -> a 1 (b c^)"),
        (aten.view.default, (r(6, 4), [4, 6]), {}, "6 4 -> 4 6"),
        (aten.view.default, (r(2, 1, 3), [2, 3, 1]), {}, "a 1 b -> a b 1"),
        (aten.view.default, (x3, [-1, 8]), {}, "a b^ c -> (a b^) c"),
        (aten.expand.default, (r(3, 1), [2, 3, 4]), {}, "a 1 -> 2 a 4"),
        (aten.expand.default, (r(3, 4), [-1, 4]), {}, "a b -> a b"),
        (aten.sum.dim_IntList, (x3, [1, 2]), {}, "a b+ c+ -> a"),
        (aten.sum.dim_IntList, (x3, [-1], True), {}, "a b c+ -> a b 1"),
        (aten.mean.dim, (x3, [-1], True), {}, "a b c^ -> a b 1"),
        (aten._softmax.default, (x3, -1, False), {}, "a b c^ -> a b c^"),
        (aten.softmax.int, (x3, 1), {}, "a b^ c -> a b^ c"),
        (aten.native_layer_norm.default, (x3, [8], r(8), None, 1e-5), {}, "a b c^, ?, c^, ? -> a b c^, a b 1, a b 1"),
        (aten.embedding.default, (r(10, 4), torch.tensor([[1, 2, 3]])), {}, "v^ e, i0 i1 -> i0 i1 e"),
        (aten.relu.default, (x3,), {}, "a b c -> a b c"),
        (aten.gelu.default, (x3,), {"approximate": "tanh"}, "a b c -> a b c"),
        (aten.silu.default, (x3,), {}, "a b c -> a b c"),
        (aten.tanh.default, (x3,), {}, "a b c -> a b c"),
        (aten.exp.default, (x3,), {}, "a b c -> a b c"),
        (aten.rsqrt.default, (x3.abs(),), {}, "a b c -> a b c"),
        (aten.neg.default, (x3,), {}, "a b c -> a b c"),
        (aten.sigmoid.default, (x3,), {}, "a b c -> a b c"),
        (aten.pow.Tensor_Scalar, (x3, 2), {}, "a b c -> a b c"),
        (aten._to_copy.default, (x3,), {"dtype": torch.float64}, "a b c -> a b c"),
        (aten.clone.default, (x3,), {}, "a b c -> a b c"),
        (aten.add.Tensor, (x3, r(8)), {}, "a b c, c -> a b c"),
        (aten.add.Tensor, (x3, 2.0), {}, "a b c -> a b c"),
        (aten.add.Tensor, (x3, torch.tensor(2.0)), {}, "a b c, ? -> a b c"),
        (aten.sub.Tensor, (r(3, 1), r(1, 4)), {}, "a 1, 1 b -> a b"),
        (aten.mul.Tensor, (x3, r(2, 1, 8)), {}, "a b c, a 1 c -> a b c"),
        (aten.div.Tensor, (x3, r(3, 8)), {}, "a b c, b c -> a b c"),
        (aten.add.Scalar, (x3, 1.0), {}, "a b c -> a b c"),
        (aten.sub.Scalar, (x3, 1.0), {}, "a b c -> a b c"),
        (aten.mul.Scalar, (x3, 2.0), {}, "a b c -> a b c"),
        (aten.div.Scalar, (x3, 2.0), {}, "a b c -> a b c"),
        (aten.where.self, (x3 > 0, x3, r(8)), {}, "a b c, a b c, c -> a b c"),
        (aten.cat.default, ([r(2, 3), r(2, 5)], -1), {}, "a 3, a 5 -> a 8"),
        (aten.cat.default, ([r(2, 3), r(4, 3)],), {}, "2 b, 4 b -> 6 b"),
        (aten.split.Tensor, (r(2, 7), 3, 1), {}, "a 7 -> a 3, a 3, a 1"),
        (aten.split_with_sizes.default, (r(5, 2), [2, 3]), {}, "5 b -> 2 b, 3 b"),
        (aten.slice.Tensor, (x3, 2, 0, 4), {}, "a b 8 -> a b 4"),
        (aten.slice.Tensor, (x3, 1, 0, 9223372036854775807), {}, "a b c -> a b c"),
        (aten.slice.Tensor, (x3, -1, 1, None, 2), {}, "a b 8 -> a b 4"),
        (aten.select.int, (x3, 1, 0), {}, "a 3 c -> a c"),
        (aten.unsqueeze.default, (x3, -1), {}, "a b c -> a b c 1"),
        (aten.unsqueeze.default, (x3, 0), {}, "a b c -> 1 a b c"),
        (aten.squeeze.dim, (r(2, 1, 3), 1), {}, "a 1 c -> a c"),
        (aten.squeeze.dims, (r(1, 2, 1), [0, 2]), {}, "1 b 1 -> b"),
        (aten.squeeze.default, (r(1, 2, 1),), {}, "1 b 1 -> b"),
        (aten.scaled_dot_product_attention.default, (r(2, 4, 5, 8), r(2, 4, 6, 8), r(2, 4, 6, 8)), {},
         "b0 b1 s d^, b0 b1 t^ d^, b0 b1 t^ e -> b0 b1 s e"),
        (aten.arange.default, (10,), {}, "-> 10"),
        (aten.arange.start_step, (1, 10, 2), {}, "-> 5"),
        (aten.full.default, ([2, 3], 1.0), {}, "-> 2 3"),
        (aten.zeros.default, ([4],), {}, "-> 4"),
        (aten.ones.default, ([4, 1],), {}, "-> 4 1"),
    ]


@pytest.mark.parametrize("op,args,kwargs,expected", _cases(), ids=lambda v: str(v) if isinstance(v, torch._ops.OpOverload) else None)
def test_registry_annotations(op, args, kwargs, expected):
    anno = annotation_for(op, args, kwargs)
    assert anno is not None and format_annotation(anno) == expected
    # the annotation infers the op's real output shapes
    out = op(*args, **kwargs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    assert infer_shapes(anno, input_shapes_for(anno, op, args, kwargs)) == [tuple(o.shape) for o in outs]


def test_registry_none_for_unknown_and_0d():
    x = torch.randn(3)
    assert annotation_for(aten.sum.default, (x,), {}) is None  # 0-d output
    assert annotation_for(aten.sum.dim_IntList, (x, [0]), {}) is None
    assert annotation_for(aten.relu.default, (torch.tensor(1.0),), {}) is None
    assert annotation_for(aten.nonzero.default, (x,), {}) is None  # no entry


def test_registry_matmul_decomposition_pieces():
    """make_fx's pieces of a batched matmul all have annotations."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda a, b: a @ b)(torch.randn(2, 3, 4), torch.randn(4, 5))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert calls
    for node in calls:
        anno = annotation_for(node.target, node.args, node.kwargs)  # fx Nodes are read via meta["val"]
        assert anno is not None, node.target
        shapes = input_shapes_for(anno, node.target, node.args, node.kwargs)
        assert infer_shapes(anno, shapes) == [tuple(node.meta["val"].shape)]


def test_register_annotation_spellings_and_factories():
    x = torch.randn(2, 3)
    try:
        register_annotation("aten::nonzero", "a^ b^ -> 6 2")
        assert format_annotation(annotation_for(aten.nonzero.default, (x,), {})) == "a^ b^ -> 6 2"
        register_annotation(torch.ops.aten.nonzero, lambda x: None)  # a packet: every overload
        dimops.unregister_annotation("aten.nonzero.default")
        assert annotation_for(aten.nonzero.default, (x,), {}) is None
        register_annotation("torch.ops.aten.nonzero.default", lambda x: ("(a b) -> a b", {"a": 2}))
        anno = annotation_for(aten.nonzero.default, (torch.randn(6),), {})
        assert anno.sizes == (("a", 2),)
        assert infer_shapes(anno, [(6,)]) == [(2, 3)]
    finally:
        dimops.unregister_annotation("aten.nonzero.default")
        dimops.unregister_annotation("aten.nonzero")
    with pytest.raises(AnnotationError, match="position 3: nested groups"):
        register_annotation("aten::nonzero", "a (( -> a")
    with pytest.raises(AnnotationError, match='op name "bad name"'):
        register_annotation("bad name", "a -> a")


def test_annotation_checked_against_call():
    x = torch.randn(2, 3)
    try:
        register_annotation(aten.nonzero.default, "a b, c -> a b")
        with pytest.raises(AnnotationError) as e:
            annotation_for(aten.nonzero.default, (x,), {})
        assert str(e.value) == 'annotation "a b, c -> a b" of aten.nonzero.default: 2 inputs but the call has 1 argument slots'
        register_annotation(aten.mm.default, "m k+ -> m")
        with pytest.raises(AnnotationError) as e:
            annotation_for(aten.mm.default, (x, x.t()), {})
        assert "argument slot 1 is a tensor the annotation leaves out" in str(e.value)
        register_annotation(aten.pow.Tensor_Scalar, "a b, c -> a b")
        with pytest.raises(AnnotationError) as e:
            annotation_for(aten.pow.Tensor_Scalar, (x, 2), {})
        assert "input 1 is annotated as a tensor but the call gives int" in str(e.value)
    finally:
        dimops.unregister_annotation(aten.nonzero.default)
        from fastpipe.builder.dimops import aten as rules

        register_annotation(aten.mm.default, "m k+, k+ n -> m n")
        register_annotation(aten.pow.Tensor_Scalar, rules.unary)


# ================================================================ custom ops


@dimop("m k+, k+ n -> m n")
def fp_test_scaled_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a @ b) * 2


@dimop("b s (h d) -> b h s d", name="fp_test_heads")
def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.reshape(b, s, h, -1).transpose(1, 2).contiguous()


@dimop("a b, c^ -> a b, c^", namespace="fp_test_ns")
def fp_test_two_outputs(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + 1, y * 2


def test_custom_op_end_to_end(g):
    a, b = rn(g, 4, 6), rn(g, 6, 8)
    overload = torch.ops.fastpipe_user.fp_test_scaled_mm.default
    torch.testing.assert_close(fp_test_scaled_mm(a, b), (a @ b) * 2)
    torch.testing.assert_close(overload(a, b), (a @ b) * 2)
    for op in (fp_test_scaled_mm, overload, "fastpipe_user::fp_test_scaled_mm"):
        assert format_annotation(annotation_for(op, (a, b), {})) == "m k+, k+ n -> m n"
    plan = run_split(overload, (a, b), {}, "k", 2)
    assert plan.outputs == (Partial("sum"),) and plan.comms == (Comm("all_reduce", {"op": "sum"}),)
    run_split(fp_test_scaled_mm, (rn(g, 4, 6), rn(g, 6, 8)), {}, "n", 4)


def test_custom_op_fake_and_trace():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        out = fp_test_scaled_mm(torch.empty(4, 6), torch.empty(6, 8))
        assert out.shape == (4, 8)
        assert _heads(torch.empty(2, 3, 12), 4).shape == (2, 4, 3, 3)
        o1, o2 = fp_test_two_outputs(torch.empty(3, 5), torch.empty(3))
        assert o1.shape == (3, 5) and o2.shape == (3,)
    gm = make_fx(lambda x: _heads(x, 4), tracing_mode="fake")(torch.randn(2, 3, 12))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert node.target == torch.ops.fastpipe_user.fp_test_heads.default
    anno = annotation_for(node.target, node.args, node.kwargs)
    assert anno.sizes == (("h", 4),)


def test_custom_op_group_split(g):
    x = rn(g, 2, 3, 12)

    def fix(largs, lkw, plan, rank):
        return [largs[0], dict(plan.local_sizes)["h"]], lkw

    plan = run_split(_heads, (x, 4), {}, "h", 2, fix=fix)
    assert plan.inputs == (Shard(2),) and plan.outputs == (Shard(1),)  # the int h is left out
    plan = run_split(fp_test_two_outputs, (rn(g, 3, 5), rn(g, 3)), {}, "b", 5)
    assert plan.inputs == (Shard(1), Replicate()) and plan.outputs == (Shard(1), Replicate())


def test_dimop_on_existing_ops():
    @torch.library.custom_op("fp_test_ns::plain_scale", mutates_args=())
    def plain_scale(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    same = dimop("a b -> a b")(plain_scale)
    assert same is plain_scale
    x = torch.randn(4, 2)
    assert format_annotation(annotation_for(torch.ops.fp_test_ns.plain_scale.default, (x,), {})) == "a b -> a b"
    run_split(plain_scale, (x,), {}, "a", 2)
    with pytest.raises(AnnotationError, match="position 0"):
        dimop(") -> a")


def test_public_names():
    for name in ["parse", "format_annotation", "infer_shapes", "annotation_for", "register_annotation", "dimop",
                 "split", "Replicate", "Shard", "Partial", "comm_between", "AnnotationError"]:
        assert hasattr(dimops, name), name
