"""Updated state written in place inside a graph (fastpipe.runtime.binding.state).

    done = write_in_place(gm, pairs)     # pairs: (placeholder index, output index) of (state input, its update)
    done = write_in_place(gm, pairs, copy_rest=False)   # only the in-place scatters; the rest left as they are

For each pair, the graph's output becomes the input tensor itself, updated:
- when the output is a functional scatter into that input (`aten.index_put`, the builder's
  static-cache write) that every other reader of the input precedes, the op becomes its in-place
  form (`index_put_`): only the new positions are written (the pairs returned);
- otherwise a `copy_` of the output into the input ends the graph (copy_rest=True, the region
  processor's graphs) or the output stays a new tensor that the session copies in afterwards
  (copy_rest=False, the per-step graphs of the cpu and cuda processors: fastpipe.runtime.binding.bind).
torch.compile keeps both as writes into the caller's buffer (inductor re-inplaces the functional
form it traces), so a decode step allocates no cache.
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
_IN_PLACE = {aten.index_put.default: aten.index_put_.default}


def write_in_place(gm: fx.GraphModule, pairs: list[tuple[int, int]], *, copy_rest: bool = True) -> list[tuple[int, int]]:
    graph = gm.graph
    order = {n: k for k, n in enumerate(graph.nodes)}
    phs, out_node, outs, single = _ends(gm)
    native = []
    for ph_idx, out_idx in pairs:
        x, y = phs[ph_idx], outs[out_idx]
        if (isinstance(y, fx.Node) and y.op == "call_function" and y.target in _IN_PLACE and y.args[0] is x
                and _read_before(x, y, order)):
            y.target = _IN_PLACE[y.target]
            native.append((ph_idx, out_idx))
            continue
        if not copy_rest:
            continue
        with graph.inserting_before(out_node):
            outs[out_idx] = graph.call_function(aten.copy_.default, (x, y))
    out_node.args = (outs[0] if single else tuple(outs),)
    graph.lint()
    gm.recompile()
    return native


def _read_before(x: fx.Node, y: fx.Node, order: dict) -> bool:
    """Whether every read of x other than y, and every read of a view of x (an op whose schema says its
    result aliases its input; any op of unknown schema is taken to), comes before y: then y may write
    into x without changing what they read."""
    todo, seen = [u for u in x.users if u is not y], set()
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op == "output" or order[u] > order[y]:
            return False
        schema = getattr(u.target, "_schema", None)
        if schema is None or any(r.alias_info is not None for r in schema.returns):
            todo.extend(w for w in u.users if w is not y)
    return True


def writes_in_place(gm: fx.GraphModule, ph_idx: int, out_idx: int) -> bool:
    """Whether output `out_idx` of gm is an in-place scatter into placeholder `ph_idx` (write_in_place made it)."""
    phs, _, outs, _ = _ends(gm)
    if not (ph_idx < len(phs) and out_idx < len(outs)):
        return False
    y = outs[out_idx]
    return (isinstance(y, fx.Node) and y.op == "call_function" and y.target in _IN_PLACE.values()
            and y.args[0] is phs[ph_idx])


def _ends(gm: fx.GraphModule) -> tuple[list, fx.Node, list, bool]:
    """(placeholders, the output node, its values as a list, whether the graph returns one value, not a tuple)."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    single = not isinstance(out_node.args[0], (tuple, list))
    return phs, out_node, [out_node.args[0]] if single else list(out_node.args[0]), single
