"""Pipeline inputs a graph writes in place: state the caller's tensors carry from run to run.

    written = written_inputs(pipeline, checked.flow, graphs)   # {"d0_arg2_1": "2", ...}: input -> the supertask writing it

The producer's LLM pipelines update their paged KV caches inside the graph: an `index_put` into the
cache, then `aten.copy_` of the result into the cache placeholder; the graph returns only the logits.
Such a graph writes an input, which a run must leave in the caller's tensor, as the producer's eager
model leaves its caches (fastpipe.runtime.processors.base.Processor.call sees to it on every processor).

A graph writes placeholder k when an op whose schema marks an argument written (`Tensor(a!)`:
`copy_`, `index_put_`, `add_`, ...) is given that placeholder or a view of it (an op whose result
aliases its argument: view, slice, select, ...). The rules, checked at load:
- only pipeline inputs may be written: a graph writing a constant (a weight every session shares)
  or another supertask's output is refused, naming both;
- every other reader of a written input comes before the writer in the dataflow (a path of tensors or
  comm groups leads from it to the writer), so each processor runs it before the write, as the
  producer's own order does (its decode stages read the cache in one graph, write it in the next);
  a reader the write could overtake is refused.
"""
from __future__ import annotations

import torch.fx as fx

from fastpipe.errors import ValidationError, key_path
from fastpipe.format.model import Pipeline
from fastpipe.validate.dataflow import Dataflow
from fastpipe.validate.order import merged_edges, node_of
from fastpipe.torch_compat import OpOverload


def written_placeholders(gm: fx.GraphModule) -> dict[int, str]:
    """Placeholder index -> the name of the first node writing it (or a view of it) in place; get_attr
    constants written in place are reported under the key -1 - (their first writer's position)."""
    phs = {n: k for k, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    out: dict[int, str] = {}
    for pos, node in enumerate(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, OpOverload):
            continue
        schema = node.target._schema
        if not schema.is_mutable:
            continue
        for k, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
            for v in (value if isinstance(value, (list, tuple)) else (value,)):
                root = _base(v)
                if root is None:
                    continue
                if root.op == "placeholder":
                    out.setdefault(phs[root], node.name)
                elif root.op == "get_attr":
                    out.setdefault(-1 - pos, f"{node.name} (into the graph's constant {root.target!r})")
    return out


def _base(v) -> fx.Node | None:
    """The placeholder or get_attr a value is (a view of), else None (memory made inside the graph)."""
    while isinstance(v, fx.Node):
        if v.op in ("placeholder", "get_attr"):
            return v
        target = v.target
        if v.op != "call_function" or not isinstance(target, OpOverload) or not v.args:
            return None
        returns = target._schema.returns
        if not returns or returns[0].alias_info is None:
            return None            # a new tensor
        v = v.args[0]              # a view (or an in-place op's result): its base
    return None


def written_inputs(p: Pipeline, flow: Dataflow, graphs) -> dict[str, str]:
    """Pipeline input name -> the id of the supertask that writes it in place (module docstring);
    a ValidationError naming the supertask for what the rules refuse."""
    inputs = set(p.input_names)
    edges = None
    out: dict[str, str] = {}
    by_graph: dict[int, dict[int, str]] = {}     # replicas share one decoded graph: walk it once
    for sid, st in p.supertasks.items():
        if st.kind != "fx":
            continue
        g = graphs.get(sid)
        if g is None:
            continue
        if id(g) not in by_graph:
            by_graph[id(g)] = written_placeholders(g.gm)
        for k, node in by_graph[id(g)].items():
            where = f"{key_path('supertasks', sid)}"
            if k < 0:
                raise ValidationError(f"{where}: expected a graph that writes only pipeline inputs in place, "
                                      f"found node {node}")
            name = st.inputs[k]
            if name not in inputs:
                what = "a constant (shared by every session)" if p.tensors[name].value is not None \
                    else "another supertask's output"
                raise ValidationError(f"{where}.inputs[{k}]: expected a pipeline input where the graph writes "
                                      f"in place (node {node}), found \"{name}\", {what}")
            if name in out:
                raise ValidationError(f"{where}.inputs[{k}]: expected \"{name}\" written in place by one supertask, "
                                      f"found it written by {key_path('supertasks', out[name])} too")
            edges = edges if edges is not None else merged_edges(p, flow)
            late = [r for r in flow.consumers.get(name, []) if r != sid and not _reaches(edges, node_of(p, r), node_of(p, sid))]
            if late:
                raise ValidationError(f"{where}.inputs[{k}]: expected every other reader of \"{name}\", written in "
                                      f"place by this graph (node {node}), to come before it in the dataflow, found "
                                      f"{', '.join(key_path('supertasks', r) for r in late)}, which the write could overtake")
            out[name] = sid
    return out


def _reaches(edges: dict[str, set[str]], a: str, b: str) -> bool:
    """Whether a path leads from node a to node b (validate.order's merged nodes)."""
    todo, seen = [a], {a}
    while todo:
        for n in edges.get(todo.pop(), ()):
            if n == b:
                return True
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return False


__all__ = ["written_inputs", "written_placeholders"]
