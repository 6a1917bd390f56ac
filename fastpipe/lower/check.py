"""The Program checker: proves on CPU, running nothing, that a Program cannot hang.

    check_program(program)             # structure, collective order, then a simulated run
    check_program(program, checked)     # + the steps are the pipeline's, data is ready, frees are sound
                                        # (+ fastpipe.lower.regions.check_regions when program.regions is set)
    simulate(program) -> [(slot, index), ...]   # the order in which steps complete

The simulator advances every slot step by step. A compute step completes when its waits
have completed. A comm step is a rendezvous: it completes, on every member at once, only
when every member slot of its group is AT its step of that group and the waits of all the
group's steps have completed. When nothing can move before every step is done, that is a
deadlock, reported with each blocked slot's current step:

    program: deadlock: slot "0" blocked at step 3 (group "B"), slot "1" blocked at step 2 (group "A")

Before simulating, two groups that share two slots must be issued in the same relative
order on both (else real NCCL hangs):

    program: groups "A" and "B" are issued in opposite orders on slots "0" and "1"

Every failure is a ``ProgramError`` (a ValidationError, one line) whose ``marks`` maps
slot -> step index of the offending steps, for ``format_table(program, mark=err.marks)``.
"""
from __future__ import annotations

from fastpipe.lower.program import Program, ProgramError, Step
from fastpipe.lower.regions import check_regions
from fastpipe.validate import Checked


def check_program(program: Program, checked: Checked | None = None) -> None:
    """Raise ProgramError (one line, with marks) unless ``program`` is sound; see the module docstring."""
    check_structure(program)
    check_collective_order(program)
    _run(program)
    if checked is not None:
        check_against(program, checked)
    if program.regions:
        check_regions(program)


def simulate(program: Program) -> list[tuple[str, int]]:
    """The (slot, index) of every step in the order the steps complete (a group's steps together,
    in its members' order); raises ProgramError on a malformed Program or a deadlock."""
    check_structure(program)
    return _run(program)


# ---------------------------------------------------------------------------------- structure
def _n_steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _at(slot: str, i: int) -> str:
    return f"slot \"{slot}\" step {i}"


def check_structure(program: Program) -> None:
    """Slots, step kinds, group membership (one step per member slot) and waits that exist."""
    steps = program.steps
    if len(set(program.slots)) != len(program.slots):
        dup = next(s for s in program.slots if program.slots.count(s) > 1)
        raise ProgramError(f"program: slot \"{dup}\" is listed twice in slots")
    for slot in steps:
        if slot not in program.slots:
            raise ProgramError(f"program: steps has slot \"{slot}\", which is not in slots")
    for slot in program.slots:
        if slot not in steps:
            raise ProgramError(f"program: slot \"{slot}\" has no step list")
        for i, st in enumerate(steps[slot]):
            m = {slot: i}
            if st.slot != slot:
                raise ProgramError(f"program: {_at(slot, i)} says it is on slot \"{st.slot}\"", m)
            if st.kind == "compute" and st.group is not None:
                raise ProgramError(f"program: {_at(slot, i)} is a compute step with group \"{st.group}\"", m)
            if st.kind == "comm" and st.group is None:
                raise ProgramError(f"program: {_at(slot, i)} is a comm step without a group", m)
            if st.kind not in ("compute", "comm"):
                raise ProgramError(f"program: {_at(slot, i)}: expected kind compute or comm, found \"{st.kind}\"", m)
            if st.kind == "comm" and st.group not in program.groups:
                raise ProgramError(f"program: {_at(slot, i)} is a step of group \"{st.group}\", which is not in groups", m)
    for g, members in program.groups.items():
        seen: set[str] = set()
        existing = {s: i for s, i in members if s in steps and 0 <= i < len(steps[s])}
        for s, i in members:
            if s in seen:
                raise ProgramError(f"program: group \"{g}\" lists slot \"{s}\" twice", existing)
            seen.add(s)
            if s not in steps:
                raise ProgramError(f"program: group \"{g}\" lists slot \"{s}\", which is not a slot", existing)
            if not 0 <= i < len(steps[s]):
                raise ProgramError(f"program: group \"{g}\" lists {_at(s, i)}, which does not exist "
                                   f"(slot \"{s}\" has {_n_steps(len(steps[s]))})", existing)
            st = steps[s][i]
            if st.group != g:
                what = "a compute step" if st.kind == "compute" else f"a step of group \"{st.group}\""
                raise ProgramError(f"program: group \"{g}\" lists {_at(s, i)}, which is {what}", {s: i})
    for slot in program.slots:
        for i, st in enumerate(steps[slot]):
            if st.kind == "comm" and (slot, i) not in program.groups[st.group]:
                raise ProgramError(f"program: {_at(slot, i)} is a step of group \"{st.group}\", which does not list it",
                                   {slot: i})
            for ws, wi in st.waits:
                if ws not in steps:
                    raise ProgramError(f"program: {_at(slot, i)} waits for slot \"{ws}\", which is not a slot", {slot: i})
                if not 0 <= wi < len(steps[ws]):
                    past = "past the end of" if wi >= 0 else "before the start of"
                    raise ProgramError(f"program: {_at(slot, i)} waits for {_at(ws, wi)}, {past} slot \"{ws}\" "
                                       f"({_n_steps(len(steps[ws]))})", {slot: i})


def check_collective_order(program: Program) -> None:
    """Any two groups sharing two slots are issued in the same relative order on both."""
    pos = {slot: {st.group: i for i, st in enumerate(program.steps[slot]) if st.kind == "comm"} for slot in program.slots}
    for a_i, s in enumerate(program.slots):
        for t in program.slots[a_i + 1:]:
            shared = [g for g in pos[s] if g in pos[t]]       # in issue order on s
            for g, h in zip(shared, shared[1:]):
                if pos[t][g] > pos[t][h]:
                    raise ProgramError(f"program: groups \"{g}\" and \"{h}\" are issued in opposite orders on "
                                       f"slots \"{s}\" and \"{t}\"", {s: pos[s][g], t: pos[t][h]})


# ---------------------------------------------------------------------------------- simulation
def _run(program: Program) -> list[tuple[str, int]]:
    steps = program.steps
    pos = {s: 0 for s in program.slots}          # steps completed so far on each slot
    done: list[tuple[str, int]] = []

    def ready(st: Step) -> bool:
        return all(pos[ws] > wi for ws, wi in st.waits)

    progress = True
    while progress:
        progress = False
        for slot in program.slots:
            while pos[slot] < len(steps[slot]):
                st = steps[slot][pos[slot]]
                if st.kind == "compute":
                    if not ready(st):
                        break
                    done.append((slot, pos[slot]))
                    pos[slot] += 1
                else:
                    members = program.groups[st.group]
                    if not all(pos[s] == i for s, i in members) or not all(ready(steps[s][i]) for s, i in members):
                        break
                    for s, i in members:
                        done.append((s, i))
                        pos[s] += 1
                progress = True
    blocked = [s for s in program.slots if pos[s] < len(steps[s])]
    if blocked:
        parts = [f"slot \"{s}\" blocked at step {pos[s]} ({_why(program, pos, s)})" for s in blocked]
        raise ProgramError(f"program: deadlock: {', '.join(parts)}", {s: pos[s] for s in blocked})
    return done


def _why(program: Program, pos: dict[str, int], slot: str) -> str:
    st = program.steps[slot][pos[slot]]
    if st.kind == "comm":
        members = program.groups[st.group]
        if all(pos[s] == i for s, i in members):    # everyone is there: a wait holds the group
            ws, wi = next(w for s, i in members for w in program.steps[s][i].waits if pos[w[0]] <= w[1])
            return f"group \"{st.group}\" waits for {_at(ws, wi)}"
        return f"group \"{st.group}\""
    ws, wi = next(w for w in st.waits if pos[w[0]] <= w[1])
    return f"supertask \"{st.supertask}\" waits for {_at(ws, wi)}"


# ---------------------------------------------------------------------------------- against the pipeline
def check_against(program: Program, checked: Checked) -> None:
    """The steps are exactly the pipeline's supertasks on their slots, groups list their members in
    device_idx order, every read (as the step will run: after binding and passes such as fusion) is
    of data ready on the slot, and frees are sound (each intermediate freed once, after its last
    read, never a pipeline output)."""
    p = checked.pipeline
    seen: dict[str, tuple[str, int]] = {}
    for slot in program.slots:
        for i, st in enumerate(program.steps[slot]):
            m = {slot: i}
            sid = st.supertask
            if sid not in p.supertasks:
                raise ProgramError(f"program: {_at(slot, i)} runs supertask \"{sid}\", which is not in the pipeline", m)
            pst = p.supertasks[sid]
            if pst.device != slot:
                raise ProgramError(f"program: {_at(slot, i)} runs supertask \"{sid}\", which is on slot \"{pst.device}\"", m)
            if (st.kind == "compute") != pst.is_compute or (st.kind == "comm") != pst.is_comm:
                raise ProgramError(f"program: {_at(slot, i)} is a {st.kind} step for supertask \"{sid}\" ({pst.kind})", m)
            if st.kind == "comm" and st.group != pst.group:
                raise ProgramError(f"program: {_at(slot, i)} is a step of group \"{st.group}\" for supertask \"{sid}\" "
                                   f"of group \"{pst.group}\"", m)
            if sid in seen:
                raise ProgramError(f"program: supertask \"{sid}\" has two steps ({_at(*seen[sid])} and {_at(slot, i)})",
                                   dict([seen[sid]]) | m)
            seen[sid] = (slot, i)
    for sid, pst in p.supertasks.items():
        if (pst.is_compute or pst.is_comm) and sid not in seen:
            raise ProgramError(f"program: supertask \"{sid}\" ({pst.kind} on slot \"{pst.device}\") has no step")
    for g, cg in checked.groups.items():
        want = tuple(p.supertasks[m].device for m in cg.members)
        have = tuple(s for s, _ in program.groups.get(g, ()))
        if have != want:
            raise ProgramError(f"program: group \"{g}\" lists slots {_slots(have)}, expected {_slots(want)} (device_idx order)",
                               dict(program.groups.get(g, ())))
    _check_data(program, checked)


def _slots(slots: tuple[str, ...]) -> str:
    return ", ".join(f"\"{s}\"" for s in slots) or "none"


def _check_data(program: Program, checked: Checked) -> None:
    p = checked.pipeline
    given = set(p.input_names)
    outputs = set(p.output_names)
    for slot in program.slots:
        alive: set[str] = set()
        freed: dict[str, int] = {}
        for i, st in enumerate(program.steps[slot]):
            for t in st.reads:
                if t in alive or t in given or (t in p.tensors and p.tensors[t].is_constant):
                    continue
                if t in freed:
                    raise ProgramError(f"program: {_at(slot, i)} (supertask \"{st.supertask}\") reads \"{t}\", "
                                       f"freed after step {freed[t]}", {slot: i})
                raise ProgramError(f"program: {_at(slot, i)} (supertask \"{st.supertask}\") reads \"{t}\" before "
                                   f"any earlier step on slot \"{slot}\" produces it", {slot: i})
            alive.update(st.writes)
            for t in st.frees:
                if t in outputs:
                    raise ProgramError(f"program: {_at(slot, i)} frees pipeline output \"{t}\"", {slot: i})
                if t not in alive:
                    raise ProgramError(f"program: {_at(slot, i)} frees \"{t}\", which is not an intermediate alive "
                                       f"on slot \"{slot}\"", {slot: i})
                alive.discard(t)
                freed[t] = i
        leaked = sorted(alive - outputs)
        if leaked:
            raise ProgramError(f"program: slot \"{slot}\" never frees \"{leaked[0]}\"")
