"""The Program: what each slot does, in order, and what it waits for.

A Program is the lowered form of a validated pipeline (DESIGN.md: the compiler/processor
split) and the one thing every processor executes. ``lower`` makes it as pure data;
``fastpipe.runtime.binding.bind`` fills in the callables and constants (a *bound* Program); passes
such as fusion (fastpipe.runtime.passes.fuse) rewrite it; the checker (fastpipe.lower.check) proves
on CPU, without running anything, that the Program as it will run cannot hang and reads
nothing before it is made or after it is freed.

    steps[slot]   the slot's steps in issue order
    step.waits    (slot, index) pairs: that step must have completed before this one starts
                  (cross-slot waits; steps on one slot run in order anyway)
    step.group    for comm steps: the comm group; every member slot has exactly one step
                  of that group, and a group completes when all its members have issued it
    step.reads    tensor names the step reads (pipeline inputs, constants, intermediates);
    step.writes   tensor names it writes (for comm steps: this member's share of the group)
    step.frees    intermediates on this slot that are dead once this step completes
    groups[g]     (slot, index) of each member's step, in device_idx order
    peak_bytes    per slot: the most bytes of intermediates alive at once (constants apart)

Bound, a step also has its ``device``, its ``constants`` (name -> tensor for the reads that
are constants) and, for compute steps, ``fn``: list of read tensors -> sequence of written
tensors; ``graph`` is the eager fx.GraphModule behind ``fn`` when there is one (fx supertasks),
which the region pass stitches into one graph per device. A comm group's callable is
``group_fns[g]``: the reads of its member steps, in member order, concatenated -> their writes,
concatenated. ``regions`` (fastpipe.lower.regions) is set by the region pass: the steps cut into
runs that one device executes as one graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from fastpipe.errors import ValidationError


class ProgramError(ValidationError):
    """A Program that would hang or is malformed. ``marks``: slot -> index of the offending step."""

    def __init__(self, message: str, marks: dict[str, int] | None = None):
        super().__init__(message)
        self.marks: dict[str, int] = dict(marks or {})


@dataclass(frozen=True)
class Step:
    slot: str
    kind: str                                    # "compute" | "comm"
    supertask: str                               # supertask id (for comm: this slot's member)
    group: str | None = None                     # comm group (comm steps only)
    waits: tuple[tuple[str, int], ...] = ()      # (slot, index) that must have completed first
    frees: tuple[str, ...] = ()                  # tensors dead after this step
    reads: tuple[str, ...] = ()                  # tensor names read, in argument order
    writes: tuple[str, ...] = ()                 # tensor names written, in result order
    # -- bound (fastpipe.runtime.binding.bind); not part of equality
    device: Any = field(default=None, compare=False)                  # torch.device the step runs on
    constants: Mapping[str, Any] = field(default_factory=dict, compare=False)   # read name -> bound tensor
    fn: Callable | None = field(default=None, compare=False, repr=False)       # compute steps
    graph: Any = field(default=None, compare=False, repr=False)   # the eager fx.GraphModule fn runs, if it runs one

    @property
    def label(self) -> str:
        return f"fp:{self.slot}:{self.supertask}"


@dataclass(frozen=True)
class Program:
    slots: tuple[str, ...]
    steps: dict[str, tuple[Step, ...]]
    groups: dict[str, tuple[tuple[str, int], ...]]
    peak_bytes: dict[str, int] = field(default_factory=dict)
    constant_bytes: dict[str, int] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()                 # pipeline input names (the caller's tensors)
    outputs: tuple[str, ...] = ()                # pipeline output names (what a run returns)
    group_fns: dict[str, Callable] = field(default_factory=dict, compare=False, repr=False)
    regions: tuple = ()                          # fastpipe.lower.regions.Region, in run order (the region pass)

    def step(self, slot: str, index: int) -> Step:
        return self.steps[slot][index]

    @property
    def depth(self) -> int:
        return max((len(s) for s in self.steps.values()), default=0)

    def members(self, group: str) -> list[Step]:
        """The group's member steps, in device_idx order."""
        return [self.steps[s][i] for s, i in self.groups[group]]

    def input_devices(self) -> dict[str, set]:
        """Pipeline input name -> the devices of the bound steps that read it."""
        out: dict[str, set] = {n: set() for n in self.inputs}
        for ss in self.steps.values():
            for st in ss:
                for n in st.reads:
                    if n in out and st.device is not None:
                        out[n].add(st.device)
        return out
