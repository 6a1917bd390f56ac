"""Multi-device tiling patterns (SPEC §3).

A tensor of shape S is tiled by a ``pattern`` P and an ``assignment``
(tile -> instance). Decisions (where SPEC is silent or its formula is loose):

* Coordinates are ROW-MAJOR MIXED-RADIX: tile j sits at coordinate
  ``(j // prod(P[i+1:])) % P[i]`` in dim i, and covers
  ``[floor(c*S[i]/P[i]), min(S[i], floor((c+1)*S[i]/P[i])))``. SPEC's literal
  ``j % P[i % r]`` repeats tiles once two dims are split ({2,2}: tiles 0 and 2
  coincide); the two agree whenever at most one dim is split.
* "Leading 1s may be omitted": a pattern shorter than the tensor's rank is
  LEFT-PADDED with 1s (``{2}`` on a [4, 6] tensor is ``{1,2}``: split the last
  dim). SPEC's ``P[i % r]`` would instead repeat the pattern cyclically, which
  for ``{2}`` on rank 2 gives two diagonal blocks that do not cover the tensor.
  A pattern longer than the rank is refused, except the scalar ``{1}``.
* Any pattern of volume 1 (``{1}``, ``{1,1}``, ``()``) means REPLICATE: every
  instance in the assignment gets the whole tensor; the assignment may then
  list any number (>= 1) of instances, default ``(0,)``. ``{1:0,1}`` is
  replicated on 0 and 1. A volume-1 pattern works on a rank-0 tensor; placements
  of a rank-0 tensor are ``[]``. Otherwise the assignment has exactly V entries,
  default ``0..V-1``.
* -1 suppresses a tile (or a replica); suppressed tiles are absent from the
  results. Entries below -1 are refused.
* Pattern entries larger than the dim size are allowed: some tiles are then
  empty (start == stop), exactly as the formula gives.
* One instance holding several tiles: ``tile``/``placements`` refuse it
  (TilingError); ``tiles_by_instance`` returns every tile per instance.
* Communication (``infer_comm``), between two tilings of the same tensor:
  equal per-instance placements -> ``[]``; otherwise a gather phase (tiled
  producer: a hierarchical all-gather, one stage per split dim from the last to
  the first, each stage a set of groups; replicated producer: nothing), then a
  ``broadcast`` from the smallest instance holding the whole tensor to the
  consumer instances that lack it (omitted when none lack it), then, for a tiled
  consumer, a local ``slice`` per consumer instance. Slice placements are
  absolute coordinates in the whole tensor, which every consumer instance then
  holds. A tiled producer must hold every non-empty tile (a suppressed
  non-empty tile means the data is nowhere); suppressed empty tiles are allowed
  only when the producer splits one dim.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

from fastpipe.errors import InvalidInput
from fastpipe.builder.tiling_topology import (  # noqa: F401  (re-exported API)
    Topology, TopologyError, mesh, parse_topology, ring, star, topology_to_json, torus, tree,
)


class TilingError(InvalidInput):
    """A tiling pattern/assignment is invalid, or does not fit a tensor."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _norm_pattern(pattern: Any) -> tuple[int, ...]:
    if _is_int(pattern):
        pattern = (pattern,)
    if not isinstance(pattern, (list, tuple)):
        raise TilingError(f"tile pattern: expected a list of integers >= 1 or the scalar 1, found {pattern!r}")
    pattern = tuple(pattern)
    for i, p in enumerate(pattern):
        if not _is_int(p) or p < 1:
            raise TilingError(f"tile pattern[{i}]: expected an integer >= 1, found {p!r}")
    return pattern or (1,)


def _norm_assignment(assignment: Any, volume: int) -> tuple[int, ...] | None:
    if assignment is None:
        return None
    if not isinstance(assignment, (list, tuple)):
        raise TilingError(f"tile assignment: expected a list of instance numbers, found {assignment!r}")
    assignment = tuple(assignment)
    for i, a in enumerate(assignment):
        if not _is_int(a) or a < -1:
            raise TilingError(f"tile assignment[{i}]: expected an instance >= 0 or -1 (suppressed), found {a!r}")
    if volume == 1:
        if not assignment:
            raise TilingError("tile assignment: expected at least one instance for a replicated tensor, found none")
    elif len(assignment) != volume:
        raise TilingError(f"tile assignment: expected {volume} entries (the pattern's volume), found {len(assignment)}")
    return assignment


@dataclass(frozen=True)
class Tiling:
    """``pattern`` () or any volume-1 pattern = replicate; ``assignment`` None = default.

    Lists are accepted and stored as tuples; ``()`` is stored as ``(1,)``.
    Construction validates everything that does not depend on the tensor.
    """

    pattern: tuple[int, ...]
    assignment: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        pattern = _norm_pattern(self.pattern)
        object.__setattr__(self, "pattern", pattern)
        object.__setattr__(self, "assignment", _norm_assignment(self.assignment, math.prod(pattern)))

    @property
    def volume(self) -> int:
        return math.prod(self.pattern)

    @property
    def replicated(self) -> bool:
        return self.volume == 1

    def resolved_assignment(self) -> tuple[int, ...]:
        if self.assignment is not None:
            return self.assignment
        return (0,) if self.replicated else tuple(range(self.volume))

    def __str__(self) -> str:
        return format_tiling(self)


_INTS = r"\s*-?\d+\s*(?:,\s*-?\d+\s*)*"
_NOTATION = re.compile(rf"\{{(?P<pat>{_INTS})(?::(?P<asg>{_INTS}))?\}}")


def parse_tiling(text: str) -> Tiling:
    """``"{2,1:0,1}"``, ``"{1:0,1}"``, ``"{1:0}"``, ``"{2,2}"`` -> Tiling. Spaces are allowed."""
    if not isinstance(text, str):
        raise TilingError(f"tiling: expected a string like '{{2,1:0,1}}', found {type(text).__name__}")
    s = text.strip()
    m = _NOTATION.fullmatch(s)
    if m is None:
        if not (s.startswith("{") and s.endswith("}")):
            raise TilingError(f"tiling {text!r}: expected '{{pattern}}' or '{{pattern:assignment}}' in braces, found no braces")
        raise TilingError(f"tiling {text!r}: expected comma-separated integers, optionally ':' and comma-separated "
                          f"instances, e.g. '{{2,1:0,1}}'")
    pat = tuple(int(x) for x in m["pat"].split(","))
    asg = None if m["asg"] is None else tuple(int(x) for x in m["asg"].split(","))
    try:
        return Tiling(pat, asg)
    except TilingError as e:
        raise TilingError(f"tiling {text!r}: {e}") from None


def format_tiling(t: Tiling) -> str:
    body = ",".join(map(str, t.pattern))
    if t.assignment is not None:
        body += ":" + ",".join(map(str, t.assignment))
    return "{" + body + "}"


def _check_shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)):
        raise TilingError(f"shape: expected a list of non-negative integers, found {shape!r}")
    shape = tuple(shape)
    for i, s in enumerate(shape):
        if not _is_int(s) or s < 0:
            raise TilingError(f"shape[{i}]: expected a non-negative integer, found {s!r}")
    return shape


def _padded(shape: tuple[int, ...], t: Tiling) -> tuple[int, ...]:
    if t.replicated:
        return (1,) * len(shape)
    if len(t.pattern) > len(shape):
        raise TilingError(f"tile pattern {format_tiling(Tiling(t.pattern))}: expected at most {len(shape)} entries "
                          f"(the tensor's rank), found {len(t.pattern)}")
    return (1,) * (len(shape) - len(t.pattern)) + t.pattern


def tile_coords(j: int, padded: Sequence[int]) -> tuple[int, ...]:
    """Row-major mixed-radix coordinate of tile j: ``(j // prod(P[i+1:])) % P[i]``."""
    return tuple((j // math.prod(padded[i + 1:])) % p for i, p in enumerate(padded))


def tile_box(shape: Sequence[int], padded: Sequence[int], j: int) -> list[tuple[int, int]]:
    """[(start, stop) per dim] of tile j (pattern already padded to the rank)."""
    return [((c * s) // p, min(s, ((c + 1) * s) // p)) for c, s, p in zip(tile_coords(j, padded), shape, padded)]


def _as_tiling(pattern: Any, assignment: Any = None) -> Tiling:
    if isinstance(pattern, Tiling):
        if assignment is not None:
            raise TilingError(f"tiling {format_tiling(pattern)}: expected no separate assignment with a Tiling, found {assignment!r}")
        return pattern
    return Tiling(_norm_pattern(pattern), assignment)


def _all_tiles(shape: Any, t: Tiling) -> list[tuple[int, list[tuple[int, int]]]]:
    """[(instance or -1, box)] in tile order (replicate: one entry per listed instance)."""
    shape = _check_shape(shape)
    padded = _padded(shape, t)
    asg = t.resolved_assignment()
    if t.replicated:
        return [(a, [(0, s) for s in shape]) for a in asg]
    return [(a, tile_box(shape, padded, j)) for j, a in enumerate(asg)]


def tiles_by_instance(shape, pattern, assignment=None) -> dict[int, list[list[tuple[int, int]]]]:
    """{instance: [box, ...]} in tile order; allows one instance to hold several tiles."""
    out: dict[int, list[list[tuple[int, int]]]] = {}
    for a, box in _all_tiles(shape, _as_tiling(pattern, assignment)):
        if a >= 0:
            out.setdefault(a, []).append(box)
    return out


def tile(shape, pattern, assignment=None) -> dict[int, list[tuple[int, int]]]:
    """{instance: [(start, stop) per dim]}. ``pattern`` is a sequence, the scalar 1, or a Tiling.

    Suppressed (-1) tiles are absent; replicate gives every listed instance the
    whole tensor. Raises TilingError if an instance holds more than one tile.
    """
    t = _as_tiling(pattern, assignment)
    out: dict[int, list[tuple[int, int]]] = {}
    for j, (a, box) in enumerate(_all_tiles(shape, t)):
        if a < 0:
            continue
        if a in out:
            raise TilingError(f"tiling {format_tiling(t)}: expected each instance to hold at most one tile, "
                              f"found instance {a} again at tile {j} (use tiles_by_instance)")
        out[a] = box
    return out


def placements(shape, tiling: Tiling | str) -> dict[int, list[list[int]]]:
    """instance -> placements ``[[start, end], ...]`` (ParamValue / tensor_slices format)."""
    t = parse_tiling(tiling) if isinstance(tiling, str) else _as_tiling(tiling)
    return {a: [[s, e] for s, e in box] for a, box in tile(shape, t).items()}


def input_layout(name: str, shape, tiling: Tiling | str) -> dict[int, list[list[int]]]:
    """An input's layout stated as a tiling -> per-instance placements for metadata.tensor_slices."""
    try:
        return placements(shape, tiling)
    except TilingError as e:
        raise TilingError(f"input {name!r}: {e}") from None


@dataclass(frozen=True)
class CommStep:
    """One inferred communication step.

    ``all_gather``: instances concatenate their blocks along ``dim`` in the listed
    order (device_idx = position); every member gets the result.
    ``broadcast``: ``src`` (a member of ``instances``) sends its whole tensor to all.
    ``slice``: the single instance keeps ``placements`` (absolute [start, stop) per
    dim) of the whole tensor it holds.
    """

    kind: str
    instances: tuple[int, ...]
    dim: int | None = None
    src: int | None = None
    placements: tuple[tuple[int, int], ...] | None = None


def _gather_steps(shape: tuple[int, ...], t: Tiling) -> list[CommStep]:
    padded = _padded(shape, t)
    asg = t.resolved_assignment()
    split = [i for i, p in enumerate(padded) if p > 1]
    for j, a in enumerate(asg):
        if a < 0:
            if len(split) > 1:
                raise TilingError(f"producer tiling {format_tiling(t)}: expected no suppressed tile when more than "
                                  f"one dim is split, found tile {j} suppressed")
            start, stop = tile_box(shape, padded, j)[split[0]]
            if start < stop:
                raise TilingError(f"producer tiling {format_tiling(t)}: expected every tile that is not empty along "
                                  f"dim {split[0]} to be held, found tile {j} [{start}, {stop}) suppressed")
    steps: list[CommStep] = []
    coords = [tile_coords(j, padded) for j in range(len(asg))]
    for d in reversed(split):
        groups: dict[tuple, list[tuple[int, int]]] = {}
        for j, c in enumerate(coords):
            if asg[j] >= 0:
                groups.setdefault(c[:d] + c[d + 1:], []).append((c[d], asg[j]))
        for key in sorted(groups):
            members = tuple(a for _, a in sorted(groups[key]))
            if len(members) > 1:
                steps.append(CommStep("all_gather", members, dim=d))
    return steps


def infer_comm(shape, producer: Tiling | str, consumer: Tiling | str) -> list[CommStep]:
    """Steps turning the producer's tiles into the consumer's; ``[]`` when they already agree."""
    shape = _check_shape(shape)
    prod = parse_tiling(producer) if isinstance(producer, str) else _as_tiling(producer)
    cons = parse_tiling(consumer) if isinstance(consumer, str) else _as_tiling(consumer)
    have, want = tile(shape, prod), tile(shape, cons)
    if not have:
        raise TilingError(f"producer tiling {format_tiling(prod)}: expected at least one instance, found every tile suppressed")
    if have == want:
        return []
    whole = [(0, s) for s in shape]
    steps = [] if prod.replicated else _gather_steps(shape, prod)
    holders = sorted(have)  # after the gather phase each producer instance holds the whole tensor
    missing = sorted(set(want) - set(holders))
    if missing:
        src = holders[0]
        steps.append(CommStep("broadcast", tuple(sorted({src, *missing})), src=src))
    if not cons.replicated:
        for a, box in want.items():
            if box != whole:
                steps.append(CommStep("slice", (a,), placements=tuple(box)))
    return steps
