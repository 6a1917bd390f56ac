"""Communication kinds (SPEC "Comm semantics").

``fastpipe.comm.reference`` is the plain-torch oracle every other
implementation is tested against. The reduce ops with every spelling producers
wrote for them, and each kind's output shape, are rules of the format
(``fastpipe.format.reduce_ops``, ``fastpipe.format.comm_shapes``): this package and
``fastpipe.comm.reduce_ops`` re-export the reduce ops, ``fastpipe.comm.shapes`` the
shape rule. What each kind is (its parameters, arity, output shape) is its spec in
``fastpipe.format.comm_kinds``; ``REFERENCE_KINDS`` (here) and ``fastpipe.comm.local.LOCAL_KINDS``
are this package's implementations of each kind, keyed by group kind.
"""
from fastpipe.comm.reference import (
    REFERENCE_KINDS,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    send_recv,
)
from fastpipe.format.reduce_ops import (
    REDUCE_OP_SPELLINGS,
    REDUCE_OPS,
    canonical_reduce_op,
)

__all__ = [
    "REFERENCE_KINDS",
    "REDUCE_OPS",
    "REDUCE_OP_SPELLINGS",
    "canonical_reduce_op",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "reduce",
    "gather",
    "broadcast",
    "send_recv",
]
