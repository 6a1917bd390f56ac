"""Communication kinds (SPEC "Comm semantics").

``fastpipe.comm.reference`` is the plain-torch oracle every other
implementation is tested against; ``fastpipe.comm.reduce_ops`` names the
reduce ops and accepts every spelling producers wrote for them.
"""
from fastpipe.comm.reduce_ops import REDUCE_OP_SPELLINGS, REDUCE_OPS, canonical_reduce_op
from fastpipe.comm.reference import (
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    send_recv,
)

__all__ = [
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
