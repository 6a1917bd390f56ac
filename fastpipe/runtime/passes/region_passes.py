"""Passes over a stitched region graph (fastpipe.runtime.passes.region_graph), run before it is compiled.

    report = optimize(gm, merge=True)       # in place; report.cse, report.merged, report.pieces
    optimize(gm, on_merge=rebind)           # rebind(pieces) per merged group, as it is made

cse            nodes that compute the same pure op on the same arguments become one. The slots of a
               tensor-parallel split replicate work (norms, residual adds, rotary tables, the views of
               one input); on one device a replica is pure waste. Skipped for a graph with any
               mutating op.
merge shards   matmuls that the split cut into shards become one GEMM again, on weights
               concatenated once when the region is built:
  column-parallel   mm(x, t(W_0)), mm(x, t(W_1)), ...  (one x; also addmm with a bias each)
                    -> mm(x, t(cat(W_i, 0))), each shard's result a column slice of it
                    (q/k/v projections, gate/up, a vocab-parallel head: one GEMM for all shards)
  row-parallel      fold_sum(mm(a_0, t(W_0)) [+ b + r], mm(a_1, t(W_1)), ...)   (an all_reduce of partials)
                    -> mm(cat(a_i, 1), t(cat(W_i, 1))) [+ b + r]    (also the bmm form of a linear;
                    a bias or residual one member adds before the reduction is added once after it)
               One device then runs the unsplit model's GEMM shapes. Results equal the split ones
               within the dtype's rounding (one f32-accumulated GEMM instead of partial GEMMs summed
               in f32). The concatenated weights replace their shards in the region; the caller
               rebinds the steps' shard constants to views of them, so weight memory does not grow.
               Each group's shards leave the graph as soon as their merged weight is made (their
               nodes, and the buffers no node reads any more), and `on_merge(pieces)` hears of the
               group then: a caller that rebinds there and keeps no shard lets each group's shards go
               before the next group is concatenated, so a load holds at most one group twice (on a
               GPU: its weights plus one group's, not twice its weights). Without on_merge the pieces
               collect in `report.pieces` (which keeps every shard until the report goes).
"""
from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from fastpipe.comm import local
from fastpipe.runtime.passes.region_graph import attr_of
from fastpipe.torch_compat import is_mutable_op, is_pure_op

aten = torch.ops.aten
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
PURE_PY = {operator.getitem, local.fold, local.cat, local.scatter, local.all_to_all}


@dataclass
class PassReport:
    cse: int = 0                       # nodes removed as duplicates
    merged: int = 0                    # shard matmuls merged away (k shards -> 1 counts k - 1)
    pieces: list = field(default_factory=list)   # (shard tensor, merged tensor, dim, offset)


Pieces = list            # [(shard tensor, merged tensor, dim, offset)]: one merged group's shards


def optimize(gm: fx.GraphModule, *, merge: bool = True, on_merge: Callable[[Pieces], None] | None = None) -> PassReport:
    """cse, then (merge) the shard merges, in place. on_merge(pieces): called once per merged group,
    right after its shards left the graph (see the module docstring); None: they go to report.pieces."""
    rep = PassReport()
    if any(_mutates(n) for n in gm.graph.nodes):
        return rep
    rep.cse += cse(gm.graph)
    if merge:
        report_to = on_merge if on_merge is not None else rep.pieces.extend
        # rows first: their shards usually tile one stored tensor (no copy) and go at once, before the
        # column merges allocate theirs (a CPU load's peak: fastpipe.weights.store.whole_of)
        _merge_rows(gm, rep, report_to)
        _merge_columns(gm, rep, report_to)
        rep.cse += cse(gm.graph)
    gm.graph.eliminate_dead_code()
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in [n for n, _ in gm.named_buffers(recurse=False)] + [n for n, _ in gm.named_parameters(recurse=False)]:
        if name not in used:
            delattr(gm, name)
    gm.graph.lint()
    gm.recompile()
    return rep


# ------------------------------------------------------------------------------------------ cse
def _mutates(node: fx.Node) -> bool:
    return node.op == "call_function" and is_mutable_op(node.target)


def _pure(node: fx.Node) -> bool:
    if node.op == "get_attr":
        return True
    if node.op != "call_function":
        return False
    return is_pure_op(node.target) or node.target in PURE_PY


def _freeze(v):
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, *(_freeze(x) for x in v))
    if isinstance(v, dict):
        return ("dict", *sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (bool, int, float, complex)):   # 1 == 1.0 == True and 0.0 == -0.0 as keys, but not as
        return (type(v).__name__, repr(v))           # arguments: add(x, 1) keeps an int x int, add(x, 1.0) does not
    hash(v)                             # raises TypeError for what cannot be a key
    return v


def cse(graph: fx.Graph) -> int:
    """Merge nodes with the same pure target and the same arguments; returns how many went away."""
    seen: dict = {}
    removed = 0
    for node in list(graph.nodes):
        if not _pure(node):
            continue
        try:
            key = (node.op, node.target, _freeze(node.args), _freeze(node.kwargs))
        except TypeError:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
            removed += 1
        else:
            seen[key] = node
    return removed


# ------------------------------------------------------------------------------------------ merging
def _call(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _attr(gm: fx.GraphModule, node) -> torch.Tensor | None:
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    obj = attr_of(gm, node.target)
    return obj if isinstance(obj, torch.Tensor) else None


def _linear(gm, node):
    """node computes x @ W.T with W a constant [N, K]: (x, W node, form) with form "mm" (x [M, K])
    or ("bmm", b) (x [b, M, K], the weight expanded to [b, K, N]); else None."""
    if _call(node, aten.mm.default):
        x, wt = node.args
        if _call(wt, aten.t.default) and _weight(gm, wt.args[0]) is not None:
            return x, wt.args[0], "mm"
    if _call(node, aten.bmm.default):
        x, v = node.args
        if _call(v, *VIEWS) and _call(v.args[0], aten.expand.default):
            e = v.args[0]
            if _call(e.args[0], aten.t.default) and _weight(gm, e.args[0].args[0]) is not None:
                w = _weight(gm, e.args[0].args[0])
                size = list(e.args[1])
                if len(size) == 3 and size[1:] == [w.shape[1], w.shape[0]] and list(v.args[1]) == size:
                    return x, e.args[0].args[0], ("bmm", size[0])
    return None


def _weight(gm, node) -> torch.Tensor | None:
    w = _attr(gm, node)
    return w if w is not None and w.dim() == 2 else None


def _register(gm: fx.GraphModule, t: torch.Tensor, hint: str) -> str:
    k = 0
    while hasattr(gm, f"{hint}_{k}"):
        k += 1
    gm.register_buffer(f"{hint}_{k}", t)
    return f"{hint}_{k}"


def _weight_node(graph, gm, w: torch.Tensor, hint: str, form) -> fx.Node:
    """The [M, K] @ W.T operand for `form`, made from the constant W."""
    wt = graph.call_function(aten.t.default, (graph.get_attr(_register(gm, w, hint)),))
    if form == "mm":
        return wt
    size = [form[1], w.shape[1], w.shape[0]]
    return graph.call_function(aten.view.default, (graph.call_function(aten.expand.default, (wt, size)), size))


def _merge_columns(gm: fx.GraphModule, rep: PassReport, on_merge: Callable[[Pieces], None]) -> None:
    """mm(x, t(W_i)) for several shards W_i of one x -> one mm on cat(W_i, 0); each shard's result
    is a column slice (its view users become reshapes: a column slice is not contiguous)."""
    groups: dict = {}
    for node in gm.graph.nodes:
        if _call(node, aten.mm.default):
            lin = _linear(gm, node)
            if lin is not None:
                groups.setdefault((lin[0], None), []).append((node, lin[1]))
        elif _call(node, aten.addmm.default) and not node.kwargs:
            b, x, wt = node.args
            bias = _attr(gm, b)
            if (bias is not None and bias.dim() == 1 and _call(wt, aten.t.default)
                    and _weight(gm, wt.args[0]) is not None):
                groups.setdefault((x, "bias"), []).append((node, wt.args[0], b))
    for (_, kind), members in groups.items():
        if len(members) >= 2:
            _merge_column_group(gm, kind, members, rep, on_merge)


def _merge_column_group(gm, kind, members, rep: PassReport, on_merge) -> None:
    """One column group (a function of its own: no shard outlives it in a local)."""
    graph = gm.graph
    ws = [_weight(gm, m[1]) for m in members]
    if len({(w.shape[1], w.dtype, w.device) for w in ws}) != 1:
        return
    x = members[0][0].args[0 if kind is None else 1]   # x may be an earlier group's shard result: now its slice
    merged = concat_weights(ws, 0)
    pieces = []
    with graph.inserting_before(members[0][0]):
        wt = _weight_node(graph, gm, merged, "merged_cols", "mm")
        if kind == "bias":
            biases = [_attr(gm, m[2]) for m in members]
            bias = concat_weights(biases, 0)
            boff = 0
            for b in biases:
                pieces.append((b, bias, 0, boff))
                boff += b.shape[0]
            y = graph.call_function(aten.addmm.default, (graph.get_attr(_register(gm, bias, "merged_bias")), x, wt))
        else:
            y = graph.call_function(aten.mm.default, (x, wt))
    off = 0
    inputs = []
    for (node, *_), w in zip(members, ws):
        with graph.inserting_after(node):
            piece = graph.call_function(aten.slice.Tensor, (y, 1, off, off + w.shape[0]))
        node.replace_all_uses_with(piece)
        for user in list(piece.users):
            if _call(user, aten.view.default, aten._unsafe_view.default):
                user.target = aten.reshape.default
        pieces.append((w, merged, 0, off))
        off += w.shape[0]
        inputs += node.all_input_nodes
        graph.erase_node(node)
    rep.merged += len(members) - 1
    _drop_dead(gm, inputs)
    on_merge(pieces)


def _chain(gm, p: fx.Node):
    """A fold input p = add(...add(view(linear), a_1)..., a_k), each node on the way used once (the
    adds and the view optional): (linear node, (x, W node, form), view args or None, [a_1..a_k]);
    else None. The addends (a bias, a residual) are added once to the merged result instead."""
    addends = []
    while _call(p, aten.add.Tensor) and not p.kwargs and len(p.users) == 1:
        a, b = p.args
        if isinstance(a, fx.Node) and _leads_to_linear(gm, a):
            p = a
            addends.insert(0, b)
        elif isinstance(b, fx.Node) and _leads_to_linear(gm, b):
            p = b
            addends.insert(0, a)
        else:
            return None
    view = None
    if _call(p, *VIEWS) and len(p.users) == 1:
        view, p = (p.target, tuple(p.args[1])), p.args[0]
    if not isinstance(p, fx.Node) or len(p.users) != 1:
        return None
    lin = _linear(gm, p)
    return None if lin is None else (p, lin, view, addends)


def _leads_to_linear(gm, p) -> bool:
    while _call(p, aten.add.Tensor, *VIEWS):
        p = p.args[0]
    return _linear(gm, p) is not None


def _merge_rows(gm: fx.GraphModule, rep: PassReport, on_merge: Callable[[Pieces], None]) -> None:
    """fold_sum(x_i @ W_i.T, ...) over K-shards -> cat(x_i) @ cat(W_i, 1).T (+ the members' biases)."""
    for fold in list(gm.graph.nodes):
        if fold.op == "call_function" and fold.target is local.fold and fold.args[1] == "sum":
            _merge_row_group(gm, fold, rep, on_merge)


def _merge_row_group(gm, fold: fx.Node, rep: PassReport, on_merge) -> None:
    """One row group (a function of its own: no shard outlives it in a local)."""
    graph = gm.graph
    chains = [_chain(gm, p) for p in fold.args[0]]
    if any(c is None for c in chains) or len(chains) < 2:
        return
    forms = {c[1][2] for c in chains}
    views = {c[2] for c in chains}
    ws = [_weight(gm, c[1][1]) for c in chains]
    if len(forms) != 1 or len(views) != 1 or len({(w.shape[0], w.dtype, w.device) for w in ws}) != 1:
        return
    form, view = forms.pop(), views.pop()
    merged = concat_weights(ws, 1)
    with graph.inserting_before(fold):
        x = graph.call_function(aten.cat.default, ([c[1][0] for c in chains], 1 if form == "mm" else 2))
        w = _weight_node(graph, gm, merged, "merged_rows", form)
        out = graph.call_function(aten.mm.default if form == "mm" else aten.bmm.default, (x, w))
        if view is not None:
            out = graph.call_function(view[0], (out, list(view[1])))
        for c in chains:
            for a in c[3]:
                out = graph.call_function(aten.add.Tensor, (out, a))
    fold.replace_all_uses_with(out)
    pieces, off = [], 0
    for w in ws:
        pieces.append((w, merged, 1, off))
        off += w.shape[1]
    rep.merged += len(chains) - 1
    _drop_dead(gm, [fold])
    on_merge(pieces)


def _drop_dead(gm: fx.GraphModule, nodes) -> None:
    """Erase each of `nodes` that nothing uses any more, and then what only it used (pure nodes only), and
    the buffers of the erased get_attr nodes (optimize's cse left one get_attr node per buffer): a merged
    group's shard weights leave the graph at once."""
    graph, erased, work = gm.graph, set(), list(nodes)
    while work:
        n = work.pop()
        if n in erased or n.users or not _pure(n):
            continue
        work += n.all_input_nodes
        if n.op == "get_attr":          # after cse, the one node of its target
            owner, _, name = n.target.rpartition(".")
            delattr(attr_of(gm, owner) if owner else gm, name)
        graph.erase_node(n)
        erased.add(n)


_CONCATS: dict = {}      # (shard ids, dim) -> (weakref to the merged tensor, weakrefs to the shards)


def concat_weights(ws: list[torch.Tensor], dim: int) -> torch.Tensor:
    """cat(ws, dim), made once per process for the same shard tensors: sessions that share their
    shards (buckets of one model, through one WeightStore) share the merged weight too. Shards that tile
    one stored tensor in order (a row-parallel weight's column blocks, a vocab-parallel head's rows) are
    not copied: the merged weight is that tensor, as the weight store reads it (on the CPU a view of the
    checkpoint's mapping)."""
    entry = _CONCATS.get((tuple(id(w) for w in ws), dim))
    if entry is not None:
        merged, shards = entry[0](), [r() for r in entry[1]]
        if merged is not None and all(a is b for a, b in zip(shards, ws)):
            return merged
    from fastpipe.weights.store import whole_of

    merged = whole_of(ws, dim)        # shards tiling one stored tensor: that tensor (a view of its file)
    if merged is None:
        merged = torch.cat(ws, dim)
    remember_concat(ws, dim, merged)
    return merged


def remember_concat(ws: list[torch.Tensor], dim: int, merged: torch.Tensor) -> None:
    """Record that cat(ws, dim) is `merged` (also for views of it that stand in for the shards)."""
    for k in [k for k, (m, _) in _CONCATS.items() if m() is None]:
        del _CONCATS[k]
    _CONCATS[(tuple(id(w) for w in ws), dim)] = (weakref.ref(merged), tuple(weakref.ref(w) for w in ws))
