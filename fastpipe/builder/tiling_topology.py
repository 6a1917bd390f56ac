"""Multi-device topologies (SPEC §3): ``instance_count`` and ``instance_map``.

``instance_map[i]`` lists the instances that instance ``i`` connects to. Links
are undirected: the map must be symmetric (``j in map[i]`` iff ``i in map[j]``);
self loops and repeated neighbours are refused. A topology need not be
connected. Builders (``ring``, ``mesh``, ``torus``, ``star``, ``tree``) return
validated topologies with each neighbour list sorted ascending. Re-exported by
``fastpipe.builder.tiling``.

JSON form (``parse_topology`` / ``topology_to_json``)::

    {"instance_count": 3, "instance_map": [[1, 2], [0, 2], [0, 1]]}

``parse_topology`` also accepts ``instance_map`` as an object keyed by the
instance number as a string (``{"0": [1], "1": [0]}``), with exactly one key per
instance; ``topology_to_json`` always writes the list form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastpipe.errors import InvalidInput


class TopologyError(InvalidInput):
    """A topology (count, map or builder argument) is invalid."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _validate(count: Any, imap: Any, where: str) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """Check count/map and return them normalized; messages name ``where``-relative paths."""
    if not _is_int(count) or count < 1:
        raise TopologyError(f"{where}instance_count: expected an integer >= 1, found {count!r}")
    if isinstance(imap, dict):
        keys = {str(i) for i in range(count)}
        extra = sorted(set(imap) - keys, key=str)
        if extra:
            raise TopologyError(f"{where}instance_map: expected keys \"0\"..\"{count - 1}\", found key {extra[0]!r}")
        missing = sorted(keys - set(imap), key=int)
        if missing:
            raise TopologyError(f"{where}instance_map: expected an entry for every instance, found none for \"{missing[0]}\"")
        rows = [imap[str(i)] for i in range(count)]
    elif isinstance(imap, (list, tuple)):
        if len(imap) != count:
            raise TopologyError(f"{where}instance_map: expected {count} entries (one per instance), found {len(imap)}")
        rows = list(imap)
    else:
        raise TopologyError(f"{where}instance_map: expected a list of neighbour lists, found {type(imap).__name__}")
    out: list[tuple[int, ...]] = []
    for i, row in enumerate(rows):
        p = f"{where}instance_map[{i}]"
        if not isinstance(row, (list, tuple)):
            raise TopologyError(f"{p}: expected a list of instance numbers, found {type(row).__name__}")
        seen: set[int] = set()
        for k, n in enumerate(row):
            if not _is_int(n) or not 0 <= n < count:
                raise TopologyError(f"{p}[{k}]: expected an instance 0 <= n < {count}, found {n!r}")
            if n == i:
                raise TopologyError(f"{p}[{k}]: expected no self loop, found {n}")
            if n in seen:
                raise TopologyError(f"{p}[{k}]: expected each neighbour once, found {n} again")
            seen.add(n)
        out.append(tuple(row))
    for i, row in enumerate(out):
        for n in row:
            if i not in out[n]:
                raise TopologyError(f"{where}instance_map[{n}]: expected {i} (links are undirected: "
                                    f"{n} is in instance_map[{i}]), found {list(out[n])}")
    return count, tuple(out)


@dataclass(frozen=True)
class Topology:
    """A validated undirected topology; construction raises TopologyError if invalid."""

    instance_count: int
    instance_map: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        count, imap = _validate(self.instance_count, self.instance_map, "")
        object.__setattr__(self, "instance_map", imap)

    def neighbours(self, i: int) -> tuple[int, ...]:
        return self.instance_map[i]

    def links(self) -> list[tuple[int, int]]:
        """Each undirected link once, as (a, b) with a < b, sorted."""
        return sorted((i, n) for i, row in enumerate(self.instance_map) for n in row if i < n)

    def is_connected(self) -> bool:
        seen, todo = {0}, [0]
        while todo:
            for n in self.instance_map[todo.pop()]:
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return len(seen) == self.instance_count


def parse_topology(obj: Any) -> Topology:
    """``{"instance_count": n, "instance_map": [[...], ...]}`` -> Topology (validated)."""
    if not isinstance(obj, dict):
        raise TopologyError(f"topology: expected an object with instance_count and instance_map, found {type(obj).__name__}")
    for key in ("instance_count", "instance_map"):
        if key not in obj:
            raise TopologyError(f"topology: expected field {key!r}, found fields {sorted(obj)}")
    extra = sorted(set(obj) - {"instance_count", "instance_map"})
    if extra:
        raise TopologyError(f"topology: expected only instance_count and instance_map, found field {extra[0]!r}")
    count, imap = _validate(obj["instance_count"], obj["instance_map"], "topology.")
    return Topology(count, imap)


def topology_to_json(t: Topology) -> dict:
    return {"instance_count": t.instance_count, "instance_map": [list(r) for r in t.instance_map]}


def _arg(name: str, v: Any, least: int = 1) -> int:
    if not _is_int(v) or v < least:
        raise TopologyError(f"{name}: expected an integer >= {least}, found {v!r}")
    return v


def _from_links(n: int, links) -> Topology:
    nb: list[set[int]] = [set() for _ in range(n)]
    for a, b in links:
        if a != b:
            nb[a].add(b)
            nb[b].add(a)
    return Topology(n, tuple(tuple(sorted(s)) for s in nb))


def ring(n: int) -> Topology:
    """i <-> (i+1) % n. ring(1) has no links; ring(2) is one link."""
    n = _arg("ring(n)", n)
    return _from_links(n, [(i, (i + 1) % n) for i in range(n)])


def mesh(rows: int, cols: int) -> Topology:
    """rows x cols grid, instance r*cols + c, 4-neighbour links, no wrap-around."""
    rows, cols = _arg("mesh(rows)", rows), _arg("mesh(cols)", cols)
    links = [(r * cols + c, r * cols + c + 1) for r in range(rows) for c in range(cols - 1)]
    links += [(r * cols + c, (r + 1) * cols + c) for r in range(rows - 1) for c in range(cols)]
    return _from_links(rows * cols, links)


def torus(rows: int, cols: int) -> Topology:
    """mesh with wrap-around links in both directions (duplicates and self links dropped)."""
    rows, cols = _arg("torus(rows)", rows), _arg("torus(cols)", cols)
    links = [(r * cols + c, r * cols + (c + 1) % cols) for r in range(rows) for c in range(cols)]
    links += [(r * cols + c, ((r + 1) % rows) * cols + c) for r in range(rows) for c in range(cols)]
    return _from_links(rows * cols, links)


def star(n: int) -> Topology:
    """Hub 0 linked to 1..n-1."""
    n = _arg("star(n)", n)
    return _from_links(n, [(0, i) for i in range(1, n)])


def tree(n: int, arity: int = 2) -> Topology:
    """Complete ``arity``-ary tree in heap order: the parent of i > 0 is (i - 1) // arity."""
    n, arity = _arg("tree(n)", n), _arg("tree(arity)", arity)
    return _from_links(n, [((i - 1) // arity, i) for i in range(1, n)])
