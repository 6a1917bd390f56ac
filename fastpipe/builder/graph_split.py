"""Split one rank's traced aten graph into segments: (stage, level) -> nodes.

* stage: pipeline stage; `pipe_split(x, s)` moves x into stage s and each node's stage is
  the largest of its inputs'. Nodes fed only by parameters, pipeline inputs or free nodes
  ("floating") take the smallest stage among their consumers.
* level: how many comm points lie upstream within the stage. Cutting segments at levels
  guarantees no compute supertask both feeds a collective and consumes its result.
* free nodes (no tensor inputs at all, e.g. arange/full) are recomputed in every segment
  that uses them instead of being passed around.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import operator

import torch.fx as fx

from fastpipe.builder.markers import PIPE_SPLIT


def comm_point(x, comm):  # pragma: no cover - never executed: replaced by a comm supertask
    raise RuntimeError("comm_point is a placeholder for a comm supertask")


@dataclass
class Segments:
    stage: dict[fx.Node, int] = field(default_factory=dict)
    level: dict[fx.Node, int] = field(default_factory=dict)
    free: set = field(default_factory=set)
    groups: dict[tuple[int, int], list[fx.Node]] = field(default_factory=dict)   # (stage, level) -> compute nodes
    comms: list[fx.Node] = field(default_factory=list)                           # comm points in graph order


def _inputs(n: fx.Node) -> list[fx.Node]:
    return list(n.all_input_nodes)


def split_graph(gm: fx.GraphModule, n_params: int) -> Segments:
    """`n_params`: how many leading placeholders are parameters (the rest are pipeline inputs)."""
    seg = Segments()
    nodes = list(gm.graph.nodes)
    placeholders = {n for n in nodes if n.op == "placeholder"}
    pipeline_inputs = [n for n in nodes if n.op == "placeholder"][n_params:]
    for n in nodes:
        if n.op == "get_attr":     # graph constants (e.g. rotary inv_freq): copied where used
            seg.free.add(n)
        elif n.op == "call_function" and not any(i in placeholders or i not in seg.free for i in _inputs(n)) \
                and n.target is not comm_point and n.target is not PIPE_SPLIT:
            seg.free.add(n)
    anchored: dict[fx.Node, bool] = {}
    for n in pipeline_inputs:          # pipeline inputs anchor their consumers at stage 0 or later
        anchored[n] = True
        seg.stage[n] = 0
    for n in nodes:
        if n.op != "call_function" or n in seg.free:
            continue
        ins = [i for i in _inputs(n) if i in anchored and anchored[i]]
        if n.target is PIPE_SPLIT:
            seg.stage[n] = int(n.args[1])
            anchored[n] = True
        elif ins:
            seg.stage[n] = max(seg.stage[i] for i in ins)
            anchored[n] = True
        else:
            anchored[n] = False
    # floating nodes: the smallest stage among consumers (reverse order so consumers come first)
    for n in reversed(nodes):
        if n.op == "call_function" and n not in seg.free and not anchored[n]:
            stages = [seg.stage[u] for u in n.users if u in seg.stage]
            seg.stage[n] = min(stages) if stages else 0
    for n in nodes:   # a getitem always lives with the multi-output node it reads
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in seg.stage:
            seg.stage[n] = seg.stage[n.args[0]]
    for n in nodes:
        if n.op != "call_function" or n in seg.free:
            continue
        lv = 0
        if n.target is operator.getitem and n.args[0] in seg.level:
            seg.level[n] = seg.level[n.args[0]]
            continue
        for i in _inputs(n):
            if i in seg.level and seg.stage.get(i) == seg.stage[n]:
                lv = max(lv, seg.level[i] + (1 if i.target is comm_point else 0))
        seg.level[n] = lv
    _float_to_first_use(seg, nodes, {n for n, a in anchored.items() if not a})
    for n in nodes:
        if n not in seg.level:
            continue
        if n.target is comm_point:
            seg.comms.append(n)
        elif n.target is not PIPE_SPLIT:
            seg.groups.setdefault((seg.stage[n], seg.level[n]), []).append(n)
    return seg


def _float_to_first_use(seg: Segments, nodes: list[fx.Node], floating: set) -> None:
    """A floating node (fed by parameters alone: a weight's transpose, a weight's dtype cast) has no
    upstream comm point, so any level of its stage may compute it: it takes the lowest level among its
    users there, and so is computed in the segment that reads it. (At level 0, where the level pass
    leaves it, a later segment received it as a supertask output: a view of a weight became an
    intermediate tensor to plan, name and carry.) A node read at several levels is computed at the
    lowest and handed to the others. Comm points keep their level; a getitem stays with the node it reads."""
    for n in reversed(nodes):
        if n not in floating or n.target is comm_point or n.target is PIPE_SPLIT:
            continue
        here = [seg.level[u] for u in n.users if u in seg.level and seg.stage.get(u) == seg.stage[n]]
        if here:
            seg.level[n] = min(here)
    for n in nodes:
        if n in floating and n.target is operator.getitem and n.args[0] in seg.level:
            seg.level[n] = seg.level[n.args[0]]
