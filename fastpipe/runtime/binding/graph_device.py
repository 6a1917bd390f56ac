"""A compute graph placed on its step's device: its device arguments retargeted there.

A producer traces its graphs on one device (fastpipe's builder and furiosa-llm trace on the CPU),
so the ops that make tensors carry that device as an argument:

    aten.arange.default(8, device=cpu)          aten.full.default([1, 8], -inf, device=cpu)
    aten.zeros.default([2, 4], device=cpu)      aten._to_copy.default(x, device=cpu)

A slot's graph runs on the slot's device (SPEC: the device slot is where the supertask runs), so
every `torch.device` argument of a call (a `device=` keyword given as a string too) becomes the
step's device; left alone, a graph run on a GPU would mix those CPU tensors with its inputs.

    placed = placed_graph(gm, torch.device("cuda", 0))   # gm itself when nothing differs
"""
from __future__ import annotations

import copy

import torch
import torch.fx as fx


def _as_device(v) -> torch.device | None:
    if isinstance(v, torch.device):
        return v
    if isinstance(v, str):
        try:
            return torch.device(v)
        except (RuntimeError, TypeError):
            return None
    return None


def _foreign(n: fx.Node, device: torch.device):
    """(positional index or keyword, value) of every device argument of `n` other than `device`."""
    for i, a in enumerate(n.args):
        if isinstance(a, torch.device) and a != device:
            yield i, a
    d = _as_device(n.kwargs.get("device"))
    if d is not None and d != device:
        yield "device", d


def foreign_devices(gm: fx.GraphModule, device: torch.device) -> list[str]:
    """The device arguments of `gm`'s calls that are not `device` (as `node: device` strings)."""
    return [f"{n.name}: {d}" for n in gm.graph.nodes if n.op == "call_function" for _, d in _foreign(n, device)]


def retarget_devices(gm: fx.GraphModule, device: torch.device) -> int:
    """Point every device argument of `gm`'s calls at `device`, in place; returns how many changed."""
    changed = 0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        hits = list(_foreign(n, device))
        if not hits:
            continue
        args, kwargs = list(n.args), dict(n.kwargs)
        for where, _ in hits:
            if where == "device":
                kwargs["device"] = device
            else:
                args[where] = device
        n.args, n.kwargs = tuple(args), kwargs
        changed += len(hits)
    if changed:
        gm.recompile()
    return changed


def constants_on(gm: fx.GraphModule, device: torch.device) -> bool:
    """Whether every tensor `gm` holds (parameters, buffers, plain tensor attributes) is on `device`."""
    tensors = list(gm.parameters()) + list(gm.buffers())
    tensors += [v for v in vars(gm).values() if isinstance(v, torch.Tensor)]
    return all(t.device == device for t in tensors)


def placed_graph(gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """`gm` on `device`: its constants moved and its device arguments retargeted, on a deep copy
    (the decoded graph is shared by every step of its payload, on every device); `gm` itself when
    it is already there."""
    if constants_on(gm, device) and not foreign_devices(gm, device):
        return gm
    gm = copy.deepcopy(gm).to(device)
    retarget_devices(gm, device)
    return gm
