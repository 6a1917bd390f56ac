"""The step x slot table of a Program, in a tiny action language that prints, parses and diffs.

    print(format_table(program, pipeline=p))
    print(format_table(program, mark=err.marks))       # after a ProgramError: offending cells get "!!"

    step       0                    1
    0          fx:1                 fx:3
    1          fx:2                 all_reduce:ar0<-0:1
    2          all_reduce:ar0<-1:0  fx:7
    3          fx:6                 reduce:red0<-0:3
    4          reduce:red0<-1:2     .
    peak       4.0KiB               4.0KiB
    constants  65.5KiB              65.0KiB

(graphs/tp_mlp.) Rows are step indexes, one column per slot; "." is no step. A cell is one action:

    [!!]<op>:<name>[<-<slot>:<index>]...

    op      the supertask's kind: fx | dfg for compute, the comm kind (all_reduce, send,
            recv, reduce, ...) for comm steps; without ``pipeline=`` it is just
            "compute" or "comm"
    name    compute: the supertask id; comm: the group name (send and recv of a pair
            share it: send:p2p_h2 on one slot, recv:p2p_h2 on the other)
    <-s:i   a cross-slot wait: this step starts after slot s's step i has completed
            (one suffix per wait, in the step's order)
    !!      a marked (offending) step

Names and slots must not contain "<-" or whitespace for a cell to parse back;
``parse_action(str(action)) == action`` otherwise, and ``parse_table`` reads a whole
table back into slot -> [Action | None].
"""
from __future__ import annotations

from dataclasses import dataclass

from fastpipe.lower.program import Program, Step

MARK = "!!"
EMPTY = "."


@dataclass(frozen=True)
class Action:
    op: str                                      # fx | dfg | <comm kind> | compute | comm
    name: str                                    # supertask id (compute) or group (comm)
    waits: tuple[tuple[str, int], ...] = ()
    marked: bool = False

    def __str__(self) -> str:
        waits = "".join(f"<-{s}:{i}" for s, i in self.waits)
        return f"{MARK if self.marked else ''}{self.op}:{self.name}{waits}"


def action_of(step: Step, pipeline=None, *, marked: bool = False) -> Action:
    if pipeline is not None:
        op = pipeline.supertasks[step.supertask].kind
    else:
        op = step.kind
    name = step.supertask if step.kind == "compute" else step.group
    return Action(op, name, tuple(step.waits), marked)


def parse_action(text: str) -> Action:
    """Read one cell back (see the module docstring); raises ValueError on anything else."""
    s = text.strip()
    marked = s.startswith(MARK)
    if marked:
        s = s[len(MARK):]
    head, *waits = s.split("<-")
    op, sep, name = head.partition(":")
    if not sep or not op or not name:
        raise ValueError(f"action {text!r}: expected <op>:<name>[<-slot:index]...")
    parsed = []
    for w in waits:
        slot, sep, index = w.rpartition(":")
        if not sep or not slot or not index.isdigit():
            raise ValueError(f"action {text!r}: expected a wait <-slot:index, found {'<-' + w!r}")
        parsed.append((slot, int(index)))
    return Action(op, name, tuple(parsed), marked)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_table(program: Program, *, mark: dict[str, int] | None = None, pipeline=None) -> str:
    mark = mark or {}
    rows = [["step", *program.slots]]
    for i in range(program.depth):
        row = [str(i)]
        for slot in program.slots:
            steps = program.steps[slot]
            row.append(str(action_of(steps[i], pipeline, marked=mark.get(slot) == i)) if i < len(steps) else EMPTY)
        rows.append(row)
    for label, sizes in (("peak", program.peak_bytes), ("constants", program.constant_bytes)):
        rows.append([label, *(human_bytes(sizes[s]) if s in sizes else "-" for s in program.slots)])
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def parse_table(text: str) -> dict[str, list[Action | None]]:
    """Read the step rows of ``format_table``'s output back: slot -> its cells' actions (None for ".")."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    head = lines[0].split()
    if not head or head[0] != "step":
        raise ValueError("table: expected a header line starting with 'step'")
    slots = head[1:]
    out: dict[str, list[Action | None]] = {s: [] for s in slots}
    for ln in lines[1:]:
        cells = ln.split()
        if not cells[0].isdigit():
            break                                # the peak / constants lines
        if len(cells) != len(slots) + 1:
            raise ValueError(f"table: expected {len(slots)} cells in row {cells[0]}, found {len(cells) - 1}")
        for slot, cell in zip(slots, cells[1:]):
            out[slot].append(None if cell == EMPTY else parse_action(cell))
    for slot in slots:                           # trailing "." cells are padding, not steps
        while out[slot] and out[slot][-1] is None:
            out[slot].pop()
    return out
