"""The output shape of each comm kind, from its input shape (SPEC §1 "Comm semantics").

A rule of the format (pure data): the validator checks declared shapes with it, and the
builder and assembler write them with it. Each kind's rule is its spec's `shape`
(fastpipe.format.comm_kinds). ``fastpipe.comm.shapes`` re-exports it."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from fastpipe.format.comm_kinds import COMM_KINDS


def comm_output_shape(kind: str, in_shape: Sequence[int], n: int, params: Mapping[str, int]) -> tuple[int, ...]:
    """Shape of a participant's output for a group of n; `params` holds non-negative dims. A kind
    outside the table (the builder's local transitions, such as to_partial) keeps the shape."""
    spec = COMM_KINDS.get(kind)
    return tuple(in_shape) if spec is None else tuple(spec.shape(tuple(in_shape), n, params))
