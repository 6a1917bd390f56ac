"""How a tensor is laid out over the n slots of a split, and the
communication that turns one layout into another.

Layouts (of one logical tensor X over slots 0..n-1):

* ``Replicate()`` -- every slot holds all of X.
* ``Shard(dim)`` -- slot i holds the i-th of n equal contiguous chunks of X
  along ``dim`` (``torch.chunk(X, n, dim)[i]``).
* ``Partial(op)`` -- slot i holds x_i with ``op(x_0, ..., x_{n-1}) == X``
  elementwise; ``op`` is one of ``"sum"``, ``"avg"``, ``"max"``, ``"min"``.

:func:`comm_between` gives the step from a producer's layout to the layout a
consumer wants. Collective kinds and their parameters follow SPEC §1 "Comm
semantics"; two kinds are local (no data moves between slots)::

    producer      consumer     Comm
    ------------  -----------  ---------------------------------------------
    L             L (equal)    None
    Partial(op)   Replicate    all_reduce      {op}
    Partial(op)   Shard(d)     reduce_scatter  {op, dim: d}
    Shard(d)      Replicate    all_gather      {dim: d}
    Shard(a)      Shard(b)     all_to_all      {src_dim: b, dst_dim: a}
    Replicate     Shard(d)     slice           {dim: d}          (local)
    Replicate     Partial(op)  to_partial      {op}              (local)
    Shard(d)      Partial(op)  to_partial      {op, dim: d}      (local)
    Partial(op)   Partial(op2) refused (AnnotationError), op != op2

all_to_all, precisely: slot j holds X's chunk j along a; it splits that piece
into n chunks along b (``src_dim = b``) and sends chunk i to slot i; slot i
concatenates what it receives from slots 0..n-1 along a (``dst_dim = a``),
which is X's chunk i along b.

slice: slot i keeps ``torch.chunk(X, n, d)[i]`` of its copy.

to_partial: from Replicate, slot 0 keeps its copy and every other slot holds
op's identity element (0 for sum; for avg every slot keeps its copy; -inf for
max; +inf for min). From Shard(d), every slot places its chunk at its offset
along d in a full-shape tensor filled with op's identity (for avg: filled
with 0 and scaled by n). Either way ``op`` over the slots gives X.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from fastpipe.builder.dimops.errors import AnnotationError

PARTIAL_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True)
class Replicate:
    """Every slot holds the whole tensor."""

    def __str__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Shard:
    """Slot i holds the i-th of n equal contiguous chunks along ``dim`` (>= 0)."""

    dim: int

    def __post_init__(self):
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise AnnotationError(f"Shard.dim: expected an int >= 0, found {self.dim!r}")

    def __str__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Partial:
    """Slot i holds x_i; ``op`` over all slots' pieces gives the tensor."""

    op: str = "sum"

    def __post_init__(self):
        if self.op not in PARTIAL_OPS:
            raise AnnotationError(f"Partial.op: expected one of {', '.join(PARTIAL_OPS)}, found {self.op!r}")

    def __str__(self) -> str:
        return f"Partial({self.op!r})"


Layout = Union[Replicate, Shard, Partial]


@dataclass(frozen=True)
class Comm:
    """One step between layouts: ``kind`` (a SPEC comm kind, or the local
    ``"slice"``/``"to_partial"``) and its ``params`` (a plain dict)."""

    kind: str
    params: dict = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash((self.kind, tuple(sorted(self.params.items()))))

    @property
    def is_local(self) -> bool:
        """True for steps that move no data between slots."""
        return self.kind in ("slice", "to_partial")


def comm_between(producer: Layout, consumer: Layout) -> Comm | None:
    """The step that turns ``producer``'s layout into ``consumer``'s (table in
    the module docstring); ``None`` when they are equal."""
    for name, layout in (("producer", producer), ("consumer", consumer)):
        if not isinstance(layout, (Replicate, Shard, Partial)):
            raise AnnotationError(f"comm_between: {name} must be Replicate(), Shard(dim) or Partial(op), found {layout!r}")
    if producer == consumer:
        return None
    if isinstance(producer, Partial):
        if isinstance(consumer, Replicate):
            return Comm("all_reduce", {"op": producer.op})
        if isinstance(consumer, Shard):
            return Comm("reduce_scatter", {"op": producer.op, "dim": consumer.dim})
        raise AnnotationError(f"comm_between: no single step turns {producer} into {consumer}; all_reduce first")
    if isinstance(producer, Shard):
        if isinstance(consumer, Replicate):
            return Comm("all_gather", {"dim": producer.dim})
        if isinstance(consumer, Shard):
            return Comm("all_to_all", {"src_dim": consumer.dim, "dst_dim": producer.dim})
        return Comm("to_partial", {"op": consumer.op, "dim": producer.dim})
    # producer is Replicate
    if isinstance(consumer, Shard):
        return Comm("slice", {"dim": consumer.dim})
    return Comm("to_partial", {"op": consumer.op})


__all__ = ["Replicate", "Shard", "Partial", "Layout", "Comm", "comm_between", "PARTIAL_OPS"]
