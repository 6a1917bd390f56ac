"""Ordering: no cycle when each comm group counts as one node; no dead supertasks.

Counting a group as one node is what makes collectives issued in opposite
orders on two slots (a hang on real NCCL) show up as a cycle: the group must
happen "at once" on all its members, so a path from one group to another on
one slot and back on another is a deadlock.
"""
from __future__ import annotations

from collections import defaultdict

from fastpipe.errors import ValidationError, key_path
from fastpipe.format.model import Pipeline
from fastpipe.validate.comm_groups import CommGroup
from fastpipe.validate.dataflow import Dataflow


def node_of(p: Pipeline, sid: str) -> str:
    st = p.supertasks[sid]
    return f"group \"{st.group}\"" if st.is_comm else key_path("supertasks", sid)


def merged_edges(p: Pipeline, flow: Dataflow) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for sid in p.supertasks:
        edges.setdefault(node_of(p, sid), set())
    for tensor, prods in flow.producers.items():
        for prod in prods:
            for cons in flow.consumers.get(tensor, []):
                a, b = node_of(p, prod), node_of(p, cons)
                edges[a].add(b)
    return edges


def check_acyclic(p: Pipeline, flow: Dataflow, groups: dict[str, CommGroup]) -> list[str]:
    """Return a topological order of merged nodes, or raise naming one cycle."""
    edges = merged_edges(p, flow)
    for a, succ in edges.items():
        if a in succ:
            raise ValidationError(f"supertasks: expected no cycle (a comm group counts as one node), found {a} feeding itself")
    indeg = {n: 0 for n in edges}
    for succ in edges.values():
        for b in succ:
            indeg[b] += 1
    ready = sorted(n for n, d in indeg.items() if d == 0)
    order = []
    while ready:
        n = ready.pop()
        order.append(n)
        for b in sorted(edges[n]):
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    if len(order) != len(edges):
        cycle = _find_cycle({n: s for n, s in edges.items() if indeg[n] > 0})
        raise ValidationError("supertasks: expected no cycle (a comm group counts as one node; collectives issued in "
                              f"opposite orders on two slots would hang), found {' -> '.join(cycle)}")
    return order


def _find_cycle(edges: dict[str, set[str]]) -> list[str]:
    # keep only nodes that still have a successor among the kept ones: what remains lies on cycles
    edges = {n: set(s) for n, s in edges.items()}
    while True:
        dead = [n for n, s in edges.items() if not (s & edges.keys())]
        if not dead:
            break
        for n in dead:
            del edges[n]
    start = min(edges)
    seen: dict[str, int] = {}
    path = [start]
    while path[-1] not in seen:
        seen[path[-1]] = len(path) - 1
        path.append(min(b for b in edges[path[-1]] if b in edges))
    return path[seen[path[-1]]:]


def check_live(p: Pipeline, flow: Dataflow) -> None:
    """Every supertask must contribute to the pipeline's outputs."""
    edges = merged_edges(p, flow)
    rev: dict[str, set[str]] = defaultdict(set)
    for a, succ in edges.items():
        for b in succ:
            rev[b].add(a)
    live = {node_of(p, flow.output_id)}
    stack = list(live)
    while stack:
        for a in rev[stack.pop()]:
            if a not in live:
                live.add(a)
                stack.append(a)
    for sid, st in p.supertasks.items():
        if st.kind == "input":
            continue
        if node_of(p, sid) not in live:
            raise ValidationError(f"{key_path('supertasks', sid)}: expected every supertask to contribute to the pipeline outputs, found it dead (its results reach no output)")
