"""validate_structure: every rule that reads only the pipeline's own data.

Roles and devices (structure.py), comm groups (comm_groups.py), order (order.py) and
metadata (metadata.py). Nothing here opens a file, decodes a payload or touches a
weight: these modules import no payload, weights, comm, runtime, lower or CLI code
(tests/test_layering.py checks it), so anything holding a Pipeline (the builder, the
lowering, a producer's own checks) can run them without loading those layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fastpipe.format.model import Pipeline
from fastpipe.validate.comm_groups import CommGroup, collect_groups
from fastpipe.validate.dataflow import Dataflow
from fastpipe.validate.metadata import check_metadata
from fastpipe.validate.order import check_acyclic, check_live
from fastpipe.validate.structure import (
    check_device_constraints,
    check_devices,
    check_tensors,
)


@dataclass(frozen=True)
class Checked:
    pipeline: Pipeline
    flow: Dataflow
    groups: dict[str, CommGroup]
    order: list[str]           # merged nodes (supertasks and groups) in a dependency order
    graphs: object = None  # supertask id -> DecodedGraph (validate(): a dict, or LazyGraphs unchecked)
    written: dict = field(default_factory=dict)   # pipeline input -> the supertask writing it in place (validate.written)


def validate_structure(p: Pipeline) -> Checked:
    """Run every pure-data rule; raise the first error found (a FastpipeError naming its JSON path)."""
    check_devices(p)
    check_device_constraints(p)
    flow = check_tensors(p)
    groups = collect_groups(p)
    order = check_acyclic(p, flow, groups)
    check_live(p, flow)
    check_metadata(p, flow)
    return Checked(p, flow, groups, order)


__all__ = ["Checked", "validate_structure"]
