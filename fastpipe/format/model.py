"""The pipeline's types (SPEC §1) as plain, immutable data.

Where producers spell a thing several ways (device objects or strings, `FX`
or `fx`, reduce ops as strings or ints) the model keeps the spelling it read
in a ``raw``/``spelling`` field so that writing round-trips, and exposes the
canonical meaning through plain fields.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from fastpipe.format.comm_kinds import COMM_KINDS   # comm kind -> its spec; a live table (registered kinds too)

COMPUTE_KINDS = ("fx", "dfg", "edf")   # dfg, edf: NPU compiler graphs (run only through a registered handler)
IO_KINDS = ("input", "output")


def all_kinds() -> tuple[str, ...]:
    """Every supertask kind, in the order the format lists them (registered comm kinds too)."""
    return COMPUTE_KINDS + tuple(COMM_KINDS) + IO_KINDS


@dataclass(frozen=True)
class Device:
    """A device slot's declared device. ``spelling`` is the producer's string form, if used."""

    kind: str                      # cpu | npu | cuda   (gpu is read as cuda)
    idx: int                       # device index in the machine (first chip for multi-chip strings)
    pe: str | None = None          # npu processing elements: "3", "0-3", "*"; "xK" for rngd:N:K (K fused PEs)
    chips: tuple[int, ...] = ()    # all chips of a comma-joined string
    spelling: str | None = None    # original string form, or None for the object form


@dataclass(frozen=True)
class ParamFile:
    path: str
    format: str


@dataclass(frozen=True)
class ParamValue:
    name: str
    placements: tuple[tuple[int, int], ...] | None
    path: str | None = None         # inline file reference (seed format) ...
    format: str | None = None
    param_file: str | None = None   # ... or an id into Pipeline.param_files
    name_in_graph: str | None = None


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str
    value: ParamValue | None = None

    @property
    def is_constant(self) -> bool:
        return self.value is not None


@dataclass(frozen=True)
class SuperTask:
    kind: str                                   # canonical (lower-case) kind
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    device: str | None = None
    data: str | None = None
    data_blob: str | None = None
    group: str | None = None
    device_idx: int | None = None
    metadata: Mapping[str, Any] | None = None   # comm metadata as written
    kind_spelling: str | None = None            # e.g. "FX" when the file said so
    null_fields: tuple[str, ...] = ()           # optional fields the file wrote as null (kept on write)

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def group_is_null(self) -> bool:
        """A comm supertask written with `"group": null`: a group of its own (one participant);
        ``group`` then holds a name made from the supertask id (see NULL_GROUP_PREFIX)."""
        return "group" in self.null_fields


# The name given to the group of a comm supertask whose group is null: "<null:ID>". Such a
# supertask is the only member of its group (fastpipe's reading of the producer's
# `group: str | None`; docs/format.md).
NULL_GROUP_PREFIX = "<null:"


@dataclass(frozen=True)
class OriginalTensor:
    shape: tuple[int, ...]
    dtype: str
    idx: int


@dataclass(frozen=True)
class TensorSlice:
    placements: tuple[tuple[int, int], ...]
    origin: str
    dtype: str
    device: str


@dataclass(frozen=True)
class Metadata:
    tensors_inputs: Mapping[str, OriginalTensor] = field(default_factory=dict)
    tensors_outputs: Mapping[str, OriginalTensor] = field(default_factory=dict)
    slices_inputs: Mapping[str, TensorSlice] = field(default_factory=dict)
    slices_outputs: Mapping[str, TensorSlice] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceConstraint:
    """A `device_constraints` entry: a constraint of some kind over slots, kept and shown, not
    enforced. ``devices`` is the nested array of slot ids as written, or None when the file has
    `{}` there (what the producer's `dataclasses.asdict` makes of its TopologyDeviceConstraint)."""

    kind: str
    devices: Any = None         # nested tuples of slot-id strings, or None


@dataclass(frozen=True)
class Pipeline:
    name: str
    devices: Mapping[str, Device]
    tensors: Mapping[str, TensorInfo]
    supertasks: Mapping[str, SuperTask]
    metadata: Metadata
    version: str | None = None
    param_files: Mapping[str, ParamFile] | None = None
    blobs: Mapping[str, str | None] | None = None
    device_constraints: tuple[DeviceConstraint, ...] | None = None
    source_dir: Path | None = field(default=None, compare=False)  # folder of the file it was read from
    dtype_spellings: Mapping[str, str] = field(default_factory=dict)  # canonical dtype -> alias the file used

    def input_supertask(self) -> tuple[str, SuperTask]:
        return next((i, t) for i, t in self.supertasks.items() if t.kind == "input")

    def output_supertask(self) -> tuple[str, SuperTask]:
        return next((i, t) for i, t in self.supertasks.items() if t.kind == "output")

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.input_supertask()[1].outputs

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.output_supertask()[1].inputs
