"""The sharding pass: turn layout/require markers into comm points (or nothing).

A `layout(x, P)` marker says what x is on every rank (Partial, Shard(d), Replicate);
a `require(y, C)` marker says what its consumer needs. The layout propagates
forward from the producer through ops that keep it: a Partial through ops that
are linear in that input (views, casts, negation, scaling by a replicated
scalar); a Shard through ops whose dimops annotation carries the sharded
identifier to the output (elementwise and view-like ops). Where it reaches a
`require` (or an op that cannot take it, which requires Replicate), the
communication `comm_between(P, C)` is inserted:

    Partial -> Replicate : all_reduce          Partial -> Shard(d): reduce_scatter(d)
    Shard(d) -> Replicate: all_gather(d)       Shard(a) -> Shard(b): all_to_all
    Replicate -> Shard(d): a local slice (no communication)

It also writes in the rank's own values where the traced graph holds none, so one trace serves every
rank (fastpipe.builder.rank_forms): `vocab_offset(ids, V, tp)` becomes `ids - ` the rank's first vocab row.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fastpipe.builder.graph_split import comm_point
from fastpipe.builder.markers import LAYOUT, REQUIRE, TRANSITION, VOCAB_OFFSET, parse_spec, vocab_range
from fastpipe.errors import BuildError

aten = torch.ops.aten
# ops linear in their first input: a partial sum stays a partial sum through them
_LINEAR_UNARY = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
                 aten.permute.default, aten.transpose.int, aten.t.default, aten.unsqueeze.default,
                 aten.squeeze.dim, aten.neg.default, aten.contiguous.default if hasattr(aten, "contiguous") else None}
_LINEAR_UNARY.discard(None)


def _keeps_partial(n: fx.Node, src: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target in _LINEAR_UNARY and n.args[0] is src:
        return True
    if n.target in (aten.mul.Tensor, aten.div.Tensor) and n.args[0] is src and not isinstance(n.args[1], fx.Node):
        return True    # scaled by a Python scalar
    return False


def apply_sharding(gm: fx.GraphModule, rank: int, tp: int) -> int:
    """Rewrite markers in place; return the number of comm points inserted."""
    from fastpipe.builder.dimops import Replicate, comm_between

    count = 0
    for n in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is VOCAB_OFFSET]:
        ids, vocab, n_ranks = n.args
        with gm.graph.inserting_before(n):
            shifted = gm.graph.call_function(aten.sub.Tensor, (ids, vocab_range(rank, n_ranks, vocab)[0]))
        shifted.meta["val"] = n.meta["val"]
        n.replace_all_uses_with(shifted)
        gm.graph.erase_node(n)
    for t in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is TRANSITION]:
        x, src, dst, _ = t.args
        comm = comm_between(parse_spec(src), parse_spec(dst))
        if comm is None:
            t.replace_all_uses_with(x)
        elif comm.kind == "slice":
            d = comm.params["dim"]
            size = x.meta["val"].shape[d] // tp
            with gm.graph.inserting_before(t):
                sl = gm.graph.call_function(aten.slice.Tensor, (x, d, rank * size, (rank + 1) * size))
            sl.meta["val"] = t.meta["val"]
            t.replace_all_uses_with(sl)
        else:
            with gm.graph.inserting_before(t):
                c = gm.graph.call_function(comm_point, (x, comm))
            c.meta["val"] = t.meta["val"]
            t.replace_all_uses_with(c)
            count += 1
        gm.graph.erase_node(t)
    for layout_node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is LAYOUT]:
        produced = parse_spec(layout_node.args[1])
        # follow a single-use chain of layout-keeping ops (partial sums through linear ops)
        cur = layout_node
        while len(cur.users) == 1:
            (u,) = cur.users
            if u.target is not REQUIRE and type(produced).__name__ == "Partial" and _keeps_partial(u, cur):
                cur = u
                continue
            break
        users = list(cur.users)
        req = users[0] if len(users) == 1 and users[0].target is REQUIRE else None
        wanted = parse_spec(req.args[1]) if req is not None else Replicate()
        comm = comm_between(produced, wanted)
        value = layout_node.args[0]
        layout_node.replace_all_uses_with(value)
        gm.graph.erase_node(layout_node)
        if cur is layout_node:
            cur = value
        # `cur` now holds the produced value at the end of the chain: communicate right after it
        if comm is None:
            replacement = cur
        elif comm.kind == "slice":
            d = comm.params["dim"]
            size = cur.meta["val"].shape[d] // tp
            with gm.graph.inserting_after(cur):
                replacement = gm.graph.call_function(aten.slice.Tensor, (cur, d, rank * size, (rank + 1) * size))
            replacement.meta["val"] = cur.meta["val"].narrow(d, rank * size, size)
        else:
            with gm.graph.inserting_after(cur):
                replacement = gm.graph.call_function(comm_point, (cur, comm))
            replacement.meta["val"] = _comm_meta(cur.meta["val"], comm, tp)
            count += 1
        if req is not None:
            req.replace_all_uses_with(replacement)
            gm.graph.erase_node(req)
        elif replacement is not cur:
            for u in [u for u in cur.users if u is not replacement]:
                u.replace_input_with(cur, replacement)
    for n in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is REQUIRE]:
        wanted = parse_spec(n.args[1])   # a require with no layout upstream: the value is replicated
        if type(wanted).__name__ != "Replicate":
            raise BuildError(f"require({n.args[1]!r}) without a layout marker upstream")
        n.replace_all_uses_with(n.args[0])
        gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    return count


def _comm_meta(val, comm, tp: int):
    """The fake output value of a comm point (shapes by the comm kind's semantics)."""
    from fastpipe.comm.shapes import comm_output_shape

    shape = comm_output_shape(comm.kind, tuple(val.shape), tp, comm.params)
    return val.new_empty(shape)
