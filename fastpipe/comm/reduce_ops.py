"""Re-exports :mod:`fastpipe.format.reduce_ops`: the reduce ops and their producer
spellings are a rule of the format, kept there so the validator needs no comm code."""
from fastpipe.format.reduce_ops import (
    REDOPTYPE_INT_TO_OP,
    REDUCE_OP_SPELLINGS,
    REDUCE_OPS,
    TORCH_REDOPTYPE_NAMES,
    canonical_reduce_op,
)

__all__ = [
    "REDOPTYPE_INT_TO_OP",
    "REDUCE_OPS",
    "REDUCE_OP_SPELLINGS",
    "TORCH_REDOPTYPE_NAMES",
    "canonical_reduce_op",
]
