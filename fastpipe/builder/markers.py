"""Marker ops left in a traced rank-local graph, replaced when the graph is split.

    transition(x, src, dst, tp)   # x is `src` on every rank ("partial:sum" | "shard:D" | "replicate");
                                  # its consumer needs `dst`. Its fake kernel gives the local shape
                                  # after the communication, so tracing sees correct shapes downstream
                                  # (sequence parallelism shrinks the sequence dim).
    layout(x, spec) / require(x, spec)   # the same as a pair, for layouts that propagate through
                                         # shape-preserving ops before they meet their consumer
    pipe_split(x, stage)          # x crosses into pipeline stage `stage`
    vocab_offset(ids, vocab, tp)  # ids minus the first vocab row this rank holds (blocks of ceil(vocab/tp)):
                                  # the one rank-dependent value of a vocab-sharded embedding, so one
                                  # trace serves every rank (fastpipe.builder.rank_forms); the sharding
                                  # pass writes in each rank's own offset

They are identity functions (a copy, since custom ops may not alias) registered
as torch ops in the `fastpipe` namespace, so make_fx records them as nodes and
never inlines them. The sharding pass turns a layout/require mismatch into a
comm supertask (fastpipe.builder.dimops.comm_between); the splitter turns
pipe_split into a stage boundary. None of them survives into a pipeline.
"""
from __future__ import annotations

import torch

from fastpipe.errors import BuildError

_LIB = "fastpipe"


@torch.library.custom_op(f"{_LIB}::layout", mutates_args=())
def layout(x: torch.Tensor, spec: str) -> torch.Tensor:
    return x.clone()


@layout.register_fake
def _(x, spec):
    return torch.empty_like(x)


@torch.library.custom_op(f"{_LIB}::require", mutates_args=())
def require(x: torch.Tensor, spec: str) -> torch.Tensor:
    return x.clone()


@require.register_fake
def _(x, spec):
    return torch.empty_like(x)


@torch.library.custom_op(f"{_LIB}::pipe_split", mutates_args=())
def pipe_split(x: torch.Tensor, stage: int) -> torch.Tensor:
    return x.clone()


@pipe_split.register_fake
def _(x, stage):
    return torch.empty_like(x)


@torch.library.custom_op(f"{_LIB}::transition", mutates_args=())
def transition(x: torch.Tensor, src: str, dst: str, tp: int) -> torch.Tensor:
    """x has layout `src` on each of tp ranks; the consumer needs `dst`. Shape-correct stand-in."""
    shape = transition_shape(tuple(x.shape), src, dst, tp)
    return x.new_zeros(shape) if shape != tuple(x.shape) else x.clone()


@transition.register_fake
def _(x, src, dst, tp):
    return x.new_empty(transition_shape(tuple(x.shape), src, dst, tp))


def transition_shape(shape: tuple[int, ...], src: str, dst: str, tp: int) -> tuple[int, ...]:
    """The local shape after the communication from layout `src` to `dst` over tp ranks."""
    from fastpipe.builder.dimops import comm_between
    from fastpipe.comm.shapes import comm_output_shape

    comm = comm_between(parse_spec(src), parse_spec(dst))
    if comm is None or comm.kind == "to_partial":
        return shape
    if comm.kind == "slice":
        out = list(shape)
        out[comm.params["dim"]] //= tp
        return tuple(out)
    return comm_output_shape(comm.kind, shape, tp, comm.params)


@torch.library.custom_op(f"{_LIB}::vocab_offset", mutates_args=())
def vocab_offset(ids: torch.Tensor, vocab: int, tp: int) -> torch.Tensor:
    """A stand-in (rank 0's offset, 0): the sharding pass replaces it with ids - the rank's first row."""
    return ids.clone()


@vocab_offset.register_fake
def _(ids, vocab, tp):
    return torch.empty_like(ids)


def vocab_range(rank: int, tp: int, vocab: int) -> tuple[int, int]:
    """[start, end) of the vocab rows rank ``rank`` holds: blocks of ceil(V/tp) (the last may be short or empty)."""
    block = -(-vocab // tp)
    return min(rank * block, vocab), min((rank + 1) * block, vocab)


TRANSITION = torch.ops.fastpipe.transition.default
LAYOUT = torch.ops.fastpipe.layout.default
REQUIRE = torch.ops.fastpipe.require.default
PIPE_SPLIT = torch.ops.fastpipe.pipe_split.default
VOCAB_OFFSET = torch.ops.fastpipe.vocab_offset.default
MARKERS = (LAYOUT, REQUIRE, PIPE_SPLIT, TRANSITION, VOCAB_OFFSET)


def parse_spec(spec: str):
    """'partial:sum' -> Partial('sum'); 'shard:2' -> Shard(2); 'replicate' -> Replicate()."""
    from fastpipe.builder.dimops import Partial, Replicate, Shard

    kind, _, arg = spec.partition(":")
    if kind == "replicate":
        return Replicate()
    if kind == "shard":
        return Shard(int(arg))
    if kind == "partial":
        return Partial(arg or "sum")
    raise BuildError(f"layout spec: expected replicate, shard:D or partial[:op], found {spec!r}")
