"""The output shape of each comm kind, from its input shape (SPEC §1 "Comm semantics").

A rule of the format (pure data): the validator checks declared shapes with it, and the
builder and assembler write them with it. ``fastpipe.comm.shapes`` re-exports it."""
from __future__ import annotations

from collections.abc import Mapping, Sequence


def comm_output_shape(kind: str, in_shape: Sequence[int], n: int, params: Mapping[str, int]) -> tuple[int, ...]:
    """Shape of a participant's output for a group of n; `params` holds non-negative dims."""
    out = list(in_shape)
    if kind in ("all_gather", "gather"):
        out[params["dim"]] *= n
    elif kind == "reduce_scatter":
        out[params["dim"]] //= n
    elif kind == "all_to_all":
        out[params["src_dim"]] //= n
        out[params["dst_dim"]] *= n
    return tuple(out)
