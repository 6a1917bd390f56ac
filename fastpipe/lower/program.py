"""The Program: what each slot does, in order, and what it waits for (pure data).

A Program is the lowered form of a validated pipeline (DESIGN.md: the compiler/processor
split). Processors (cpu threads, cuda streams) only execute it; the checker
(fastpipe.lower.check) proves on CPU, without running anything, that it cannot hang.

    steps[slot]   the slot's steps in issue order
    step.waits    (slot, index) pairs: that step must have completed before this one starts
                  (cross-slot waits; steps on one slot run in order anyway)
    step.group    for comm steps: the comm group; every member slot has exactly one step
                  of that group, and a group completes when all its members have issued it
    step.frees    intermediates on this slot that are dead once this step completes
    groups[g]     (slot, index) of each member's step, in device_idx order
    peak_bytes    per slot: the most bytes of intermediates alive at once (constants apart)
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ProgStep:
    slot: str
    kind: str                                    # "compute" | "comm"
    supertask: str                               # supertask id (for comm: this slot's member)
    group: str | None = None                     # comm group (comm steps only)
    waits: tuple[tuple[str, int], ...] = ()      # (slot, index) that must have completed first
    frees: tuple[str, ...] = ()                  # tensors dead after this step

    @property
    def label(self) -> str:
        return f"fp:{self.slot}:{self.supertask}"


@dataclass(frozen=True)
class Program:
    slots: tuple[str, ...]
    steps: dict[str, tuple[ProgStep, ...]]
    groups: dict[str, tuple[tuple[str, int], ...]]
    peak_bytes: dict[str, int] = field(default_factory=dict)
    constant_bytes: dict[str, int] = field(default_factory=dict)

    def step(self, slot: str, index: int) -> ProgStep:
        return self.steps[slot][index]

    @property
    def depth(self) -> int:
        return max((len(s) for s in self.steps.values()), default=0)
