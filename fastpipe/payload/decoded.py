"""The result types of decoding a compute-supertask payload."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class DecodedGraph:
    """A decoded payload.

    ``gm(*inputs)`` always returns a tuple with one tensor per output. Embedded
    constants are buffers of ``gm`` reached by ``get_attr`` nodes;
    ``constant_attrs`` maps each constant's attribute name in the payload to
    the buffer name on ``gm`` (they differ only when the payload name is not a
    plain, free identifier). External constants are registered as ``meta``
    placeholders until :func:`bind_external` replaces them.
    """

    gm: torch.fx.GraphModule
    input_metas: tuple[TensorMeta, ...]
    output_metas: tuple[TensorMeta, ...]
    constants: dict[str, torch.Tensor]
    external_constants: dict[str, tuple[str, str, str]]
    # Additions beyond the minimal contract (defaults keep construction simple).
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    constant_attrs: dict[str, str] = field(default_factory=dict)
    constant_metas: dict[str, TensorMeta] = field(default_factory=dict)
    where: str = "payload"
