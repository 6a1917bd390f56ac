"""GEMMs in the layout their fast kernels take: batched linears folded back into one mm.

A traced `F.linear` on a 3-d input whose rows cannot be folded into a matrix by a view (an
attention output after its transpose, a concatenation) decomposes into the batched form

    bmm(view(expand(x, [B, M, K])), view(expand(t(W), [B, K, N])))      # W: [N, K], one matrix for all B

Run as written, the backend sees a second operand that is a transposed view broadcast over the
batch. On the CPU (oneDNN, bf16) bmm then copies W into a batch-contiguous buffer on every call, a
strided transpose of the whole weight: at hidden 2048 a 2048 x 8192 projection takes 128 ms that
way against 2 ms for the `mm(x, t(W))` that `F.linear` itself reaches, the same bytes read once.
Inductor keeps the extern bmm, so a compiled graph pays it too. Folding restores the linear's GEMM:

    view(mm(reshape(x, [-1, K]), t(W)), [B, -1, N])

which computes the same products and sums (the batch shares one matrix), in the backend's own
order. Only a second operand that is an expand of a `t(...)` to 3-d is folded (the matrix is
expanded to [K, N] once more, a no-op view for a 2-d one, so a 1-d one stays correct); batched GEMMs
of two activations (attention scores) stay bmm.

    n = fold_batched_linears(gm)      # in place; how many bmm became mm
    gm2 = folded_copy(gm)             # a copy with them folded (gm itself when none is)
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_MATRIX = (aten.t.default,)          # a transposed weight: t(W) [K, N] of W [N, K]


def _broadcast_matrix(b: fx.Node) -> tuple[fx.Node, list[int]] | None:
    """(the 2-d matrix, [B, K, N]) when `b` is view(expand(matrix, [B, K, N])) or expand(...) itself."""
    if isinstance(b, fx.Node) and b.op == "call_function" and b.target in _VIEWS:
        b = b.args[0]
    if not (isinstance(b, fx.Node) and b.op == "call_function" and b.target == aten.expand.default):
        return None
    src, sizes = b.args[0], b.args[1]
    if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target in _MATRIX):
        return None
    if len(sizes) != 3 or not all(isinstance(s, int) for s in sizes):
        return None
    return src, list(sizes)


def fold_batched_linears(gm: fx.GraphModule) -> int:
    """Rewrite every bmm whose second operand is one matrix broadcast over the batch into an mm
    (the module docstring), in place. Returns how many were rewritten."""
    g, n = gm.graph, 0
    for node in list(g.nodes):
        if node.op != "call_function" or node.target != aten.bmm.default:
            continue
        a, b = node.args[0], node.args[1]
        hit = _broadcast_matrix(b)
        if hit is None:
            continue
        w, (batch, k, n_out) = hit
        with g.inserting_before(node):
            rows = g.call_function(aten.reshape.default, (a, [-1, k]))          # [B*M, K]
            mat = g.call_function(aten.expand.default, (w, [k, n_out]))          # [K, N]: t(W) itself
            mm = g.call_function(aten.mm.default, (rows, mat))                   # [B*M, N]
            out = g.call_function(aten.view.default, (mm, [batch, -1, n_out]))   # [B, M, N]
        node.replace_all_uses_with(out)
        g.erase_node(node)
        n += 1
    if n:
        g.eliminate_dead_code()
        g.lint()
        gm.recompile()
    return n


def folded_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` with its batched linears folded, on a copy sharing gm's constants; gm itself when it has none."""
    import copy

    if not any(n.op == "call_function" and n.target == aten.bmm.default and _broadcast_matrix(n.args[1])
               for n in gm.graph.nodes):
        return gm
    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    out.train(gm.training)
    fold_batched_linears(out)
    return out
