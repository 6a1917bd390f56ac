"""Pipeline inputs a graph writes in place: state the caller's tensors carry from run to run.

    written = written_inputs(pipeline, graphs)    # {"d0_past_key_values_0_0": "3", ...}: input -> the supertask writing it

The producer's LLM pipelines update their paged KV caches inside the graph: an `index_put` into the
cache, then `aten.copy_` of the result into the cache placeholder; the graph returns only the logits.
Such a graph writes an input, which a run must leave in the caller's tensor, as the producer's eager
model leaves its caches (fastpipe.runtime.processors.base.Processor.call sees to it on every processor).

A graph writes placeholder k when an op whose schema marks an argument written (`Tensor(a!)`:
`copy_`, `index_put_`, `add_`, ...) is given that placeholder or a view of it (an op whose result
aliases its argument: view, slice, select, ...). The rules, checked at load:
- only pipeline inputs may be written: a graph writing a constant (a weight every session shares)
  or another supertask's output is refused, naming both;
- a written input is read by that supertask alone: another reader would see it before or after the
  write depending on the processor's order.
"""
from __future__ import annotations

import torch.fx as fx

from fastpipe.errors import ValidationError, key_path
from fastpipe.format.model import Pipeline
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


def written_inputs(p: Pipeline, graphs) -> dict[str, str]:
    """Pipeline input name -> the id of the supertask that writes it in place (module docstring);
    a ValidationError naming the supertask for what the rules refuse."""
    inputs = set(p.input_names)
    readers: dict[str, list[str]] = {}
    for sid, st in p.supertasks.items():
        for t in dict.fromkeys(st.inputs):
            readers.setdefault(t, []).append(sid)
    out: dict[str, str] = {}
    for sid, st in p.supertasks.items():
        if st.kind != "fx":
            continue
        g = graphs.get(sid)
        if g is None:
            continue
        for k, node in written_placeholders(g.gm).items():
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
            others = [r for r in readers.get(name, []) if r != sid]
            if others:
                raise ValidationError(f"{where}.inputs[{k}]: expected \"{name}\", written in place by this graph "
                                      f"(node {node}), to be read by this supertask alone, found it read by "
                                      f"{', '.join(key_path('supertasks', r) for r in others)} too")
            out[name] = sid
    return out


__all__ = ["written_inputs", "written_placeholders"]
