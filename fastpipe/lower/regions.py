"""The region pass: a Program's steps grouped into runs that one device executes as one graph.

    program = with_regions(program, device_of)     # device_of: slot -> device string ("cpu", "cuda:0")
    check_regions(program)                         # (check_program calls it when program.regions is set)

Slots that share a physical device cost nothing when their steps, and the comm between them,
run as one function that a compiler sees whole (DESIGN.md: "region"). The pass orders every
step once, in an order the checker's rules allow (each slot's steps in order, every wait
before its waiter, a comm group's members together), preferring to stay on the device it is
on; then it cuts that order into regions:

    a run of consecutive steps on one device      -> Region(device="cpu", ...)   compiled as one graph
    a comm group whose members span devices       -> Region(device=None, ...)    run by the comm reference

With every slot on one device (the CPU default, one GPU) the whole Program is one region.
Each region lists what it takes from outside (`reads`: pipeline inputs and earlier regions'
writes; constants are bound to the steps), what it hands on (`writes`: what a later region or
the caller reads) and what is dead once it has run (`frees`). Tensors made and used inside a
region never leave it: the compiler plans their memory.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from fastpipe.lower.program import Program, ProgramError


@dataclass(frozen=True)
class Region:
    name: str                                   # "r0", "r1", ... in run order
    device: str | None                          # the one device its steps run on; None: a comm group across devices
    steps: tuple[tuple[str, int], ...]          # (slot, index) in run order; a group's members together
    reads: tuple[str, ...] = ()                 # tensors taken from outside (pipeline inputs, earlier regions' writes)
    writes: tuple[str, ...] = ()                # tensors handed on (read by a later region, or pipeline outputs)
    frees: tuple[str, ...] = ()                 # tensors dead once the region has run

    @property
    def label(self) -> str:
        return f"fp:region:{self.name}"


def _units(program: Program, device_of: Mapping[str, str]) -> list[tuple[str | None, tuple[tuple[str, int], ...]]]:
    """Every step once, as units (a compute step, or a whole comm group) in a valid order that
    stays on one device while it can: [(device or None, ((slot, index), ...)), ...]."""
    steps, pos = program.steps, {s: 0 for s in program.slots}
    units: list = []
    cur = None

    def done(slot, i):
        return pos[slot] > i

    while True:
        ready = []
        for slot in program.slots:
            i = pos[slot]
            if i >= len(steps[slot]):
                continue
            st = steps[slot][i]
            if st.kind == "compute":
                if all(done(ws, wi) for ws, wi in st.waits):
                    ready.append((device_of[slot], ((slot, i),)))
                continue
            members = program.groups[st.group]
            if members[0][0] != slot or not all(pos[s] == j for s, j in members):
                continue
            if all(done(ws, wi) for s, j in members for ws, wi in steps[s][j].waits):
                devs = {device_of[s] for s, _ in members}
                ready.append((devs.pop() if len(devs) == 1 else None, tuple(members)))
        if not ready:
            return units              # all done (the caller has proved the Program deadlock-free)
        unit = next((u for u in ready if u[0] is not None and u[0] == cur), ready[0])
        for s, _ in unit[1]:
            pos[s] += 1
        units.append(unit)
        cur = unit[0]


def with_regions(program: Program, device_of: Mapping[str, str]) -> Program:
    """The Program with `regions` set (see the module docstring). `program` must be deadlock-free
    (fastpipe.lower.check.simulate)."""
    cuts: list[tuple[str | None, list]] = []
    for dev, members in _units(program, device_of):
        if dev is not None and cuts and cuts[-1][0] == dev:
            cuts[-1][1].extend(members)
        else:
            cuts.append((dev, list(members)))
    written_by: dict[str, int] = {}               # tensor -> the region that writes it
    reads_of: list[list[str]] = []
    writes_of: list[list[str]] = []
    last_read: dict[str, int] = {}
    inputs = set(program.inputs)
    for r, (_, members) in enumerate(cuts):
        inside: set[str] = set()
        reads, made = [], []
        for unit in by_unit(program, members):
            for slot, i in unit:
                for n in program.steps[slot][i].reads:
                    if n in inside:
                        continue
                    if n in written_by or n in inputs:
                        if n not in reads:
                            reads.append(n)
                        last_read[n] = r
            for slot, i in unit:
                for n in program.steps[slot][i].writes:
                    inside.add(n)
                    made.append(n)
        for n in made:
            written_by[n] = r
        reads_of.append(reads)
        writes_of.append(made)
    outputs = set(program.outputs)
    regions = []
    for r, (dev, members) in enumerate(cuts):
        writes = tuple(n for n in writes_of[r] if n in outputs or last_read.get(n, -1) > r)
        frees = tuple(n for n in (*reads_of[r], *writes) if n not in outputs and last_read.get(n, -1) <= r)
        regions.append(Region(f"r{r}", dev, tuple(members), tuple(reads_of[r]), writes, frees))
    return dataclasses.replace(program, regions=tuple(regions))


def region_lines(program: Program) -> list[str]:
    """One line per region, for `fastpipe show --plan`:
    region r0 on cpu: 10 steps of slots 0, 1; takes x; hands on y"""
    out = []
    for r in program.regions:
        slots = sorted({s for s, _ in r.steps}, key=program.slots.index)
        where = f"on {r.device}" if r.device is not None else "across devices (the comm reference)"
        n = len(r.steps)
        out.append(f"region {r.name} {where}: {n} step{'s' if n != 1 else ''} of slot{'s' if len(slots) != 1 else ''} "
                   f"{', '.join(slots)}; takes {', '.join(r.reads) or 'nothing'}; hands on {', '.join(r.writes) or 'nothing'}")
    return out


def by_unit(program: Program, members) -> list[list[tuple[str, int]]]:
    """A region's steps as units: a compute step alone, a comm group's members together."""
    out: list[list[tuple[str, int]]] = []
    for slot, i in members:
        st = program.steps[slot][i]
        if st.kind == "comm" and out and program.steps[out[-1][0][0]][out[-1][0][1]].group == st.group:
            out[-1].append((slot, i))
        else:
            out.append([(slot, i)])
    return out


def check_regions(program: Program) -> None:
    """Raise ProgramError unless `program.regions` runs every step once, in an order every slot,
    wait and group allows, on the devices the steps are bound to, reading only what is there."""
    steps = program.steps
    seen: dict[tuple[str, int], str] = {}
    next_on = {s: 0 for s in program.slots}
    written = {n for ss in steps.values() for st in ss for n in st.writes}
    avail = set(program.inputs)
    for reg in program.regions:
        where = f"program: region \"{reg.name}\""
        inside: set[str] = set()
        for n in reg.reads:
            if n not in avail:
                raise ProgramError(f"{where} reads \"{n}\", which no earlier region hands on and is not a pipeline input")
        for unit in by_unit(program, reg.steps):
            first = steps[unit[0][0]][unit[0][1]]
            if first.kind == "comm" and sorted(unit) != sorted(program.groups[first.group]):
                raise ProgramError(f"{where} runs part of group \"{first.group}\"", dict(unit))
            for slot, i in unit:
                st = steps[slot][i]
                m = {slot: i}
                if (slot, i) in seen:
                    raise ProgramError(f"{where} runs slot \"{slot}\" step {i}, which region \"{seen[slot, i]}\" runs", m)
                seen[slot, i] = reg.name
                if next_on[slot] != i:
                    raise ProgramError(f"{where} runs slot \"{slot}\" step {i} before step {next_on[slot]}", m)
                next_on[slot] += 1
                for ws, wi in st.waits:
                    if next_on[ws] <= wi:
                        raise ProgramError(f"{where} runs slot \"{slot}\" step {i} before slot \"{ws}\" step {wi}, "
                                           "which it waits for", m)
                if reg.device is not None and st.device is not None and str(st.device) != reg.device:
                    raise ProgramError(f"{where} is on {reg.device}, but slot \"{slot}\" step {i} is bound to {st.device}", m)
                for n in st.reads:
                    if n not in inside and n in written and n not in reg.reads:
                        raise ProgramError(f"{where}: slot \"{slot}\" step {i} reads \"{n}\", which the region neither "
                                           "makes before it nor takes in its reads", m)
                    if n in program.inputs and n not in inside and n not in reg.reads:
                        raise ProgramError(f"{where}: slot \"{slot}\" step {i} reads pipeline input \"{n}\", which "
                                           "is not in the region's reads", m)
            for slot, i in unit:
                inside.update(steps[slot][i].writes)
        if reg.device is None and len(by_unit(program, reg.steps)) != 1:
            raise ProgramError(f"{where} spans devices but is not one comm group")
        for n in reg.writes:
            if n not in inside:
                raise ProgramError(f"{where} hands on \"{n}\", which it does not make")
        avail |= set(reg.writes)
        for n in reg.frees:
            if n in program.outputs:
                raise ProgramError(f"{where} frees pipeline output \"{n}\"")
            avail.discard(n)
    missing = [(s, i) for s in program.slots for i in range(len(steps[s])) if (s, i) not in seen]
    if missing:
        s, i = missing[0]
        raise ProgramError(f"program: slot \"{s}\" step {i} is in no region", {s: i})
    lost = [n for n in program.outputs if n not in avail]
    if lost:
        raise ProgramError(f"program: pipeline output \"{lost[0]}\" is not handed on by any region")
