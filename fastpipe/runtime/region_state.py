"""Updated state written in place inside a region graph (fastpipe.runtime.state).

    n = write_in_place(gm, pairs)     # pairs: (placeholder index, output index) of (state input, its update)

For each pair, the region's output becomes the input tensor itself, updated:
- when the output is a functional scatter into that input (`aten.index_put`, the builder's
  static-cache write) that every other reader of the input precedes, the op becomes its in-place
  form (`index_put_`): only the new positions are written (counted in the return value);
- otherwise a `copy_` of the output into the input ends the graph.
torch.compile keeps both as writes into the caller's buffer (inductor re-inplaces the functional
form it traces), so a decode step allocates no cache.
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
_IN_PLACE = {aten.index_put.default: aten.index_put_.default}


def write_in_place(gm: fx.GraphModule, pairs: list[tuple[int, int]]) -> int:
    graph = gm.graph
    order = {n: k for k, n in enumerate(graph.nodes)}
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    native = 0
    for ph_idx, out_idx in pairs:
        x, y = phs[ph_idx], outs[out_idx]
        if (isinstance(y, fx.Node) and y.op == "call_function" and y.target in _IN_PLACE and y.args[0] is x
                and all(order[u] < order[y] for u in x.users if u is not y)):
            y.target = _IN_PLACE[y.target]
            native += 1
            continue
        with graph.inserting_before(out_node):
            outs[out_idx] = graph.call_function(aten.copy_.default, (x, y))
    out_node.args = (tuple(outs),)
    graph.lint()
    gm.recompile()
    return native
