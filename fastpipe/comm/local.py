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


def group_fn(kind: str, params: dict, n: int) -> LocalComm:
    """The one-device form of a comm group of `n` members (kind and params as validated)."""
    op = canonical_reduce_op(params["reduce_op"]) if "reduce_op" in params else None
    dim = params.get("dim")
    every, each = (0,) * n, tuple(range(n))
    table = {
        "p2p": (None, (), False, (0,)),
        "broadcast": (None, (), False, every),
        "all_reduce": (fold, (op,), True, every),
        "reduce": (fold, (op,), True, (0,)),
        "all_gather": (cat, (dim,), True, every),
        "gather": (cat, (dim,), True, (0,)),
        "reduce_scatter": (scatter, (op, n, dim), False, each),
        "all_to_all": (all_to_all, (n, params.get("src_dim"), params.get("dst_dim")), False, each),
    }
    if kind not in table:  # pragma: no cover - the validator admits no other kind
        raise AssertionError(kind)
    return LocalComm(kind, *table[kind])
