"""Comm between slots that share one device, as plain tensor code a compiler can see through.

The region processor (fastpipe.runtime.processors.region) stitches the compute of every slot on
one device into one graph; the comm groups between those slots become these functions. Each
returns the same values as the reference (fastpipe.comm.reference) - every member's output, in
member order, concatenated as the group's writes - but without the reference's copies:

    all_reduce      one reduction, the same tensor for every member
    reduce          one reduction, for the destination member only
    all_gather      one cat, the same tensor for every member
    gather          one cat, for the destination member only
    reduce_scatter  one reduction, chunked along dim (views)
    all_to_all      chunk each input along src_dim, cat the i-th chunks along dst_dim
    broadcast, p2p  the input itself (an alias)

LOCAL_KINDS maps each group kind (fastpipe.format.comm_kinds) to `(params, n) -> LocalComm`;
a new kind registers its one-device form with `LOCAL_KINDS.register(kind, factory)`. Its fn
is called in the region graph as `fn(xs, *args)` on the inputs of the members that hold one.

Outputs may alias an input and each other. That is safe because every graph the region runs
is functional (torch.export / the producer's graphs never mutate their inputs) and a compiler
that sees the whole region (inductor) turns the aliases into nothing at all.

Reductions follow the reference's numerics exactly: f16/bf16/f8 inputs are accumulated in
float32, folded left to right in member order, and rounded to the input dtype once; wider
dtypes reduce in their own dtype; bool sum/max are OR and min is AND. In a compiled region the
up-cast, the adds and the down-cast fuse into one elementwise kernel, so the accuracy costs no
extra memory traffic; accumulating in bf16 would round n-1 times instead of once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from fastpipe.format.comm_kinds import KindTable
from fastpipe.format.reduce_ops import canonical_reduce_op


def fold(xs: Sequence[Tensor], op: str) -> Tensor:
    """op(x_0, ..., x_{n-1}) as fastpipe.comm.reference computes it (`op` canonical)."""
    dtype = xs[0].dtype
    narrow = dtype.is_floating_point and dtype.itemsize < 4
    vals = [x.float() for x in xs] if narrow else list(xs)
    acc = vals[0]
    for v in vals[1:]:
        if dtype == torch.bool:
            acc = torch.logical_and(acc, v) if op == "min" else torch.logical_or(acc, v)
        elif op in ("sum", "avg"):
            acc = acc + v
        elif op == "max":
            acc = torch.maximum(acc, v)
        else:
            acc = torch.minimum(acc, v)
    if op == "avg":
        acc = acc / len(xs)
    return acc.to(dtype) if acc.dtype != dtype else acc


def cat(xs: Sequence[Tensor], dim: int) -> Tensor:
    return torch.cat(list(xs), dim=dim)


def scatter(xs: Sequence[Tensor], op: str, n: int, dim: int) -> list[Tensor]:
    """The n chunks of fold(xs, op) along dim (views)."""
    return list(torch.chunk(fold(xs, op), n, dim=dim))


def all_to_all(xs: Sequence[Tensor], n: int, src_dim: int, dst_dim: int) -> list[Tensor]:
    parts = [torch.chunk(x, n, dim=src_dim) for x in xs]            # parts[j][i]: x_j's chunk for member i
    return [torch.cat([parts[j][i] for j in range(n)], dim=dst_dim) for i in range(n)]


@dataclass(frozen=True)
class LocalComm:
    """A comm group on one device: `fn(xs, *args)` makes the distinct results (one tensor when
    `single`, else a list; fn None: the results are the inputs themselves), and member write k is
    result `take[k]`. Calling it gives every write, the contract of
    fastpipe.runtime.execute.group_fn; the region graph makes one node per distinct result."""
    kind: str
    fn: Callable | None
    args: tuple
    single: bool
    take: tuple[int, ...]

    def __call__(self, xs: list) -> list:
        if self.fn is None:
            vals = xs
        else:
            out = self.fn(xs, *self.args)
            vals = [out] if self.single else out
        return [vals[j] for j in self.take]


def _op(params: dict) -> str:
    return canonical_reduce_op(params["reduce_op"])


def _every(n: int) -> tuple[int, ...]:
    return (0,) * n                      # every member writes result 0


def _each(n: int) -> tuple[int, ...]:
    return tuple(range(n))               # member k writes result k


# group kind -> (params, n) -> its LocalComm (kind and params as validated; n members)
LOCAL_KINDS: KindTable = KindTable("fastpipe.comm.local.LOCAL_KINDS", {
    "p2p": lambda p, n: LocalComm("p2p", None, (), False, (0,)),
    "broadcast": lambda p, n: LocalComm("broadcast", None, (), False, _every(n)),
    "all_reduce": lambda p, n: LocalComm("all_reduce", fold, (_op(p),), True, _every(n)),
    "reduce": lambda p, n: LocalComm("reduce", fold, (_op(p),), True, (0,)),
    "all_gather": lambda p, n: LocalComm("all_gather", cat, (p["dim"],), True, _every(n)),
    "gather": lambda p, n: LocalComm("gather", cat, (p["dim"],), True, (0,)),
    "reduce_scatter": lambda p, n: LocalComm("reduce_scatter", scatter, (_op(p), n, p["dim"]), False, _each(n)),
    "all_to_all": lambda p, n: LocalComm("all_to_all", all_to_all, (n, p["src_dim"], p["dst_dim"]), False, _each(n)),
})


def group_fn(kind: str, params: dict, n: int) -> LocalComm:
    """The one-device form of a comm group of `n` members (kind and params as validated)."""
    return LOCAL_KINDS[kind](params, n)
