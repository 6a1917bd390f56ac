"""One region (fastpipe.lower.regions) as one fx graph: every step's graph and the comm between them.

    gm = stitch(program, region, group_fns)    # gm(*[env[n] for n in region.reads]) -> tuple of region.writes

The graphs of the region's compute steps are copied, in run order, into one fx.Graph; each
step's placeholders become the nodes that make its reads (a region input, a constant, or an
earlier step's output). Constants (bound pipeline tensors and the graphs' own buffers) become
buffers of the region module, once each. A comm group inside the region becomes one call of
its one-device function (fastpipe.comm.local: a cat, a sum, chunks, an alias), so a compiler
sees through it. Steps without an fx graph (registered compute kinds, fused kernels) stay
opaque calls of their bound callables.

The stitched module runs eagerly as one generated Python function (no per-step dispatch) and
is what torch.compile(fullgraph=True) compiles for the region.
"""
from __future__ import annotations

import operator
import re
from typing import Callable, Mapping

import torch
import torch.fx as fx

from fastpipe.comm.local import LocalComm
from fastpipe.lower.program import Program
from fastpipe.lower.regions import Region, by_unit


def _ident(name: str, used: set[str]) -> str:
    base = re.sub(r"\W", "_", name)
    if not base or base[0].isdigit():
        base = "t_" + base
    out, k = base, 1
    while out in used:
        out, k = f"{base}_{k}", k + 1
    used.add(out)
    return out


def attr_of(gm: torch.nn.Module, target: str):
    """What a get_attr node's dotted `target` names on `gm`."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _inlinable(gm) -> bool:
    return isinstance(gm, fx.GraphModule) and all(n.op != "call_module" for n in gm.graph.nodes)


class _Builder:
    def __init__(self, region: Region, device):
        self.root = torch.nn.Module()
        self.graph = fx.Graph()
        self.device = device
        self.used: set[str] = set()
        self.env: dict[str, fx.Node] = {}
        self.consts: dict[int, fx.Node] = {}       # id(tensor) -> its get_attr node

    def constant(self, t: torch.Tensor, hint: str) -> fx.Node:
        key = id(t)
        if key not in self.consts:
            name = _ident("c_" + hint, self.used)
            if isinstance(t, torch.Tensor) and self.device is not None and t.device != self.device:
                t = t.to(self.device)
            if isinstance(t, torch.nn.Parameter):
                self.root.register_parameter(name, t)
            else:
                self.root.register_buffer(name, t)
            self.consts[key] = self.graph.get_attr(name)
        return self.consts[key]

    def opaque(self, fn: Callable, args: list, n_out: int) -> list[fx.Node]:
        node = self.graph.call_function(fn, (args,))
        return [self.graph.call_function(operator.getitem, (node, k)) for k in range(n_out)]


def stitch(program: Program, region: Region, group_fns: Mapping[str, Callable]) -> fx.GraphModule:
    """The region as one GraphModule (see the module docstring). `group_fns`: the callable of each
    comm group in the region (one-device functions, or fused kernels)."""
    steps = program.steps
    first = steps[region.steps[0][0]][region.steps[0][1]]
    b = _Builder(region, first.device)
    for n in region.reads:
        b.env[n] = b.graph.placeholder(_ident(n, b.used))
    for unit in by_unit(program, region.steps):
        sts = [steps[s][i] for s, i in unit]
        args = [b.constant(st.constants[n], n) if n in st.constants else b.env[n] for st in sts for n in st.reads]
        writes = [n for st in sts for n in st.writes]
        st = sts[0]
        if st.kind == "comm":
            fn = group_fns[st.group]
            outs = _comm(b, fn, args) if isinstance(fn, LocalComm) else b.opaque(fn, args, len(writes))
        elif _inlinable(st.graph):
            outs = _inline(b, st.graph, args, st.supertask)
        else:
            outs = b.opaque(st.fn, args, len(writes))
        if len(outs) != len(writes):
            raise AssertionError(f"supertask {st.supertask}: graph gives {len(outs)} outputs for {len(writes)} writes")
        b.env.update(zip(writes, outs))
    b.graph.output(tuple(b.env[n] for n in region.writes))
    b.graph.lint()
    return fx.GraphModule(b.root, b.graph, class_name=f"Region_{region.name}")


def _comm(b: _Builder, c: LocalComm, args: list[fx.Node]) -> list[fx.Node]:
    """One node per distinct result of a one-device comm group; member writes that are the same
    tensor (an all_reduce's, an all_gather's) or an input (broadcast, p2p) are the same node."""
    if c.fn is None:
        vals = args
    else:
        node = b.graph.call_function(c.fn, (args, *c.args))
        vals = [node] if c.single else [b.graph.call_function(operator.getitem, (node, k))
                                        for k in range(max(c.take) + 1)]
    return [vals[j] for j in c.take]


def _inline(b: _Builder, gm: fx.GraphModule, args: list[fx.Node], sid: str) -> list[fx.Node]:
    """Copy gm's nodes into the region graph, its placeholders bound to `args`; returns its outputs."""
    val_map: dict[fx.Node, fx.Node] = {}
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(phs) != len(args):
        raise AssertionError(f"supertask {sid}: graph takes {len(phs)} inputs, the step reads {len(args)}")
    val_map.update(zip(phs, args))
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            val_map[n] = b.constant(attr_of(gm, n.target), f"{sid}_{n.target}")
    out = b.graph.graph_copy(gm.graph, val_map)
    return list(out) if isinstance(out, (tuple, list)) else [out]
