"""Issuing a bound Program's whole run, all its micro-batches, onto one lane (stream) per slot.

    runner = LaneRunner(program, backend, lane_devices)      # lane_devices: slot -> device
    outs = runner.run(parts, trace=None)    # parts: one dict of inputs per micro-batch -> one outputs dict each
    runner.chunk_order(k)                   # [(slot, index, chunk), ...]: the order it issues a k-chunk run

The CUDA processor (fastpipe.runtime.processors.cuda) runs this with CudaBackend: a lane is a
torch.cuda.Stream, an event a torch.cuda.Event. Everything that decides what is issued where,
and when memory is let go, lives here and is the same with every backend; the backend only
makes streams, records and waits for events, and keeps memory alive across streams. That makes
the issuing testable on CPU with HostBackend (tests only: it runs each op synchronously, in issue
order, and logs every call).

One run, with k micro-batches ("chunks"):
  * pipeline inputs are placed on every device that reads them, on the caller's stream there;
  * fork: every lane waits for the caller's current stream on EVERY device the lanes are on;
  * ops are issued in one pass over all k chunks, in the order of fastpipe.lower.simulate run on
    the Program unrolled k times (each slot's steps repeated per chunk, waits and groups within
    their chunk): the proof that the k-chunk schedule cannot deadlock is the checker's. A lane
    waits only for the Program's own waits (and a comm group's members' previous steps), each
    within its chunk; so stage s works on chunk c+1 while stage s+1 works on chunk c
    (fill-drain), and nothing joins between chunks;
  * a compute step runs on its slot's lane; a comm group runs whole, once, on its first member's
    lane (after every member's previous step), and every other member lane waits for it; it runs
    its Program.group_fns callable, whatever its kind (fastpipe.runtime.execute.EXECUTE_KINDS, or
    a fused kernel): no comm kind is special here;
  * each chunk has its own environment; right after an op is issued, the intermediates its
    steps' `frees` name are dropped from it (pipeline inputs and outputs never are), so the
    allocator can reuse their memory for later steps (and a captured graph's pool can);
  * a tensor used on another lane than the one that made it is handed to the backend (`use`:
    record_stream on CUDA), so its memory is not reused before that lane is done with it;
  * join: the caller's current stream on every device waits for every lane; outputs made on a
    lane are marked used by the caller's stream on their device (`hand_out`: record_stream).
Everything runs under torch.inference_mode. With a trace list, each op is timed by markers on
its lane (CUDA events with timing), read after the run (`finish` synchronizes): one event
(slot, label, t0, t1, chunk) per step, a comm group's time given to each of its members, in
seconds from a marker recorded on the caller's stream of the lane's device at the fork.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from fastpipe.lower.check import simulate
from fastpipe.lower.program import Program, Step
from fastpipe.lower.table import human_bytes
from fastpipe.runtime.execute import call, group_where, step_where
from fastpipe.runtime.binding.inputs import to_device

SEP = "\x00"       # flat name of input/output `name` of chunk c: f"{c}{SEP}{name}" (one dict for a k-chunk graph)


# ---------------------------------------------------------------------------------- the k-chunk order
def chunk_order(program: Program, chunks: int) -> list[tuple[str, int, int]]:
    """(slot, index, chunk) of every step of a k-chunk run, in the order simulate() completes the
    Program unrolled k times (slot s's steps for chunk 0, then chunk 1, ...; a wait or a group
    stays within its chunk). Raises ProgramError if that could deadlock (it cannot, for a checked
    Program: every chunk's dependencies are the Program's own)."""
    if chunks == 1:
        return [(s, i, 0) for s, i in simulate(program)]
    n = {s: len(program.steps[s]) for s in program.slots}
    steps = {s: tuple(Step(s, st.kind, st.supertask, None if st.group is None else f"{st.group}{SEP}{c}",
                           tuple((ws, c * n[ws] + wi) for ws, wi in st.waits))
                      for c in range(chunks) for st in program.steps[s])
             for s in program.slots}
    groups = {f"{g}{SEP}{c}": tuple((s, c * n[s] + i) for s, i in members)
              for c in range(chunks) for g, members in program.groups.items()}
    unrolled = Program(program.slots, steps, groups)
    return [(s, j % n[s], j // n[s]) for s, j in simulate(unrolled)]


# ---------------------------------------------------------------------------------- what one op is
@dataclass(frozen=True)
class Op:
    """One issued unit, the same for every chunk: a compute step, or a whole comm group."""
    lane: str                                   # the slot whose lane runs it
    steps: tuple[Step, ...]                     # the step, or the group's member steps (member order)
    keys: tuple[tuple[str, int], ...]           # (slot, index) of each of those steps
    waits: tuple[tuple[str, int], ...]          # (slot, index) that must complete first (same chunk)
    fn: Callable
    reads: tuple[tuple[str, str, Any], ...]     # (name, how, device key): how is "const", "input" or "env"
    writes: tuple[str, ...]
    frees: tuple[str, ...]                      # dropped from the chunk's env once issued
    label: str
    where: Callable[[], str]


def _ops(program: Program, lane_devices: Mapping[str, Any]) -> dict[tuple[str, int], Op]:
    """(slot, index) of a compute step, or of a group's first member -> its Op."""
    inputs, keep = set(program.inputs), set(program.inputs) | set(program.outputs)
    out: dict[tuple[str, int], Op] = {}

    def reads(st: Step):
        dev = lane_devices[st.slot]
        return tuple((n, "const" if n in st.constants else "input" if n in inputs else "env",
                      st.constants.get(n, dev)) for n in st.reads)

    for slot in program.slots:
        for i, st in enumerate(program.steps[slot]):
            if st.kind == "compute":
                out[(slot, i)] = Op(slot, (st,), ((slot, i),), tuple(st.waits), st.fn, reads(st), tuple(st.writes),
                                    tuple(n for n in st.frees if n not in keep), st.label,
                                    lambda st=st: step_where(st))
    for g, members in program.groups.items():
        steps = tuple(program.steps[s][i] for s, i in members)
        waits = {w: None for st in steps for w in st.waits}                       # the Program's waits, and
        waits.update({(s, i - 1): None for s, i in members if i > 0})          # every member's previous step
        out[members[0]] = Op(members[0][0], steps, tuple(members), tuple(waits), program.group_fns.get(g),
                             tuple(r for st in steps for r in reads(st)), tuple(n for st in steps for n in st.writes),
                             tuple(n for st in steps for n in st.frees if n not in keep), f"fp:group:{g}",
                             lambda g=g: group_where(program, g))
    return out


# ---------------------------------------------------------------------------------- backends
class CudaBackend:
    """Lanes are torch.cuda.Streams (one per slot, on its device); events torch.cuda.Events."""

    def lane(self, slot: str, device):
        return torch.cuda.Stream(device=device)

    def caller(self, device):
        return torch.cuda.current_stream(device)

    def place(self, t: torch.Tensor, device) -> torch.Tensor:
        return to_device(t, device, non_blocking=True)   # on the caller's stream there (the current one)

    def fork(self, lane, caller) -> None:
        lane.wait_stream(caller)

    def join(self, caller, lane) -> None:
        caller.wait_stream(lane)

    def record(self, lane, key):
        ev = torch.cuda.Event()
        ev.record(lane)
        return ev

    def wait(self, lane, event) -> None:
        lane.wait_event(event)

    def running(self, lane):
        return torch.cuda.stream(lane)

    def use(self, t: torch.Tensor, lane) -> None:
        # memory made on one stream and used on `lane`: the caching allocator keeps it until lane's
        # work queued so far is done. A tensor on another device is read by a peer copy that torch
        # issues on *that* device's current stream (ordered after lane's waits by the copy's two-way
        # barrier): its memory must wait for that stream, or the producing lane could reuse it first.
        t.record_stream(lane if t.device == lane.device else torch.cuda.current_stream(t.device))

    def hand_out(self, t: torch.Tensor, callers: Mapping) -> None:
        caller = callers.get(t.device)        # the caller's stream on the output's device
        if caller is not None:
            t.record_stream(caller)

    def mark(self, stream):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def seconds(self, origin, marker) -> float:
        return origin.elapsed_time(marker) / 1e3

    def finish(self, devices) -> None:
        for d in devices:
            torch.cuda.synchronize(d)


class HostBackend:
    """For tests on CPU only: a lane is a name, an op runs at once (in issue order), every call is
    logged in `log` as a tuple: ("fork", lane, caller), ("join", caller, lane), ("record", lane, key,
    token), ("wait", lane, token), ("run", lane), ("use", lane), ("hand_out",), ("place", device).
    `key` is (slot, index, chunk) of what the event marks (for a group: its first member)."""

    def __init__(self):
        self.log: list[tuple] = []
        self._tokens = 0

    def lane(self, slot, device):
        return f"lane:{slot}"

    def caller(self, device):
        return f"caller:{device}"

    def place(self, t, device):
        self.log.append(("place", device))
        return t

    def fork(self, lane, caller):
        self.log.append(("fork", lane, caller))

    def join(self, caller, lane):
        self.log.append(("join", caller, lane))

    def record(self, lane, key):
        self._tokens += 1
        self.log.append(("record", lane, key, self._tokens))
        return self._tokens

    def wait(self, lane, token):
        self.log.append(("wait", lane, token))

    def running(self, lane):
        self.log.append(("run", lane))
        return nullcontext()

    def use(self, t, lane):
        self.log.append(("use", lane))

    def hand_out(self, t, callers):
        self.log.append(("hand_out",))

    def mark(self, stream):
        return time.perf_counter()

    def seconds(self, origin, marker) -> float:
        return marker - origin

    def finish(self, devices) -> None:
        pass


# ---------------------------------------------------------------------------------- the runner
class LaneRunner:
    """Issues whole runs of `program` (any number of chunks) onto a lane per slot; see the module docstring.
    `lane_devices`: slot -> its device (slots without steps may be left out)."""

    def __init__(self, program: Program, backend, lane_devices: Mapping[str, Any]):
        self.program, self.backend = program, backend
        self.lane_devices = {s: lane_devices[s] for s in program.slots if program.steps[s]}
        self.devices = list(dict.fromkeys(self.lane_devices.values()))
        self.lanes = {s: backend.lane(s, d) for s, d in self.lane_devices.items()}
        self.ops = _ops(program, self.lane_devices)
        readers: dict[str, dict] = {n: {} for n in program.inputs}
        for s, ss in program.steps.items():
            for st in ss:
                for n in st.reads:
                    if n in readers and n not in st.constants:
                        readers[n][self.lane_devices[s]] = None
        first = self.devices[0] if self.devices else None
        self.input_devices = {n: tuple(d) or (first,) for n, d in readers.items()}
        # keys some other op waits for (a group's members all wait for the group): only those record an event
        self.awaited = {w for op in self.ops.values() for w in op.waits} | {
            k for op in self.ops.values() if len(op.keys) > 1 for k in op.keys}
        self._orders: dict[int, list[tuple[Op, int]]] = {}

    def chunk_order(self, chunks: int) -> list[tuple[str, int, int]]:
        return chunk_order(self.program, chunks)

    def schedule(self, chunks: int) -> list[tuple[Op, int]]:
        """The ops of a k-chunk run, in issue order, each with its chunk (made once per k)."""
        if chunks not in self._orders:
            out = []
            for s, i, c in chunk_order(self.program, chunks):
                op = self.ops.get((s, i))
                if op is not None:                    # a group is issued at its first member
                    out.append((op, c))
            self._orders[chunks] = out
        return self._orders[chunks]

    def run(self, parts: Sequence[Mapping[str, torch.Tensor]], *, trace: list | None = None) -> list[dict]:
        """One whole run: parts[c] are chunk c's inputs; returns chunk c's outputs at [c]."""
        with torch.inference_mode():
            return self._run(parts, trace)

    def _run(self, parts, trace):
        b, lanes, program = self.backend, self.lanes, self.program
        callers = {d: b.caller(d) for d in self.devices}
        placed = [{(n, d): b.place(t, d) for n, t in part.items() for d in self.input_devices.get(n, ())}
                  for part in parts]
        envs: list[dict] = [{} for _ in parts]
        for part, env in zip(parts, envs):
            for n in program.outputs:                 # an input handed straight out as an output
                if n in part:
                    env[n] = part[n]
        origins = {d: b.mark(callers[d]) for d in self.devices} if trace is not None else None
        for lane in lanes.values():
            for d in self.devices:
                b.fork(lane, callers[d])
        made_on: list[dict[str, str]] = [{} for _ in parts]      # name -> the slot whose lane made it
        done: dict[tuple[str, int, int], tuple[str, Any]] = {}   # (slot, index, chunk) -> (lane slot, event)
        waited: dict[str, set] = {s: set() for s in lanes}        # events each lane already waits for
        timings = []
        ok = False
        try:
            for op, c in self.schedule(len(parts)):
                lane = lanes[op.lane]
                for ws, wi in op.waits:
                    src, ev = done[(ws, wi, c)]
                    if src != op.lane and id(ev) not in waited[op.lane]:
                        b.wait(lane, ev)
                        waited[op.lane].add(id(ev))
                t0 = b.mark(lane) if trace is not None else None
                self._issue(op, lane, envs[c], placed[c], made_on[c])
                if trace is not None:
                    timings.append((op, c, t0, b.mark(lane)))
                if any(k in self.awaited for k in op.keys):
                    ev = b.record(lane, (*op.keys[0], c))
                    for k in op.keys:
                        done[(*k, c)] = (op.lane, ev)
                    for s, _ in op.keys:                  # a group completes on every member at once
                        if s != op.lane and id(ev) not in waited[s]:
                            b.wait(lanes[s], ev)
                            waited[s].add(id(ev))
                env = envs[c]
                for n in op.frees:
                    env.pop(n, None)
            ok = True
        finally:
            try:
                for d in self.devices:
                    for lane in lanes.values():
                        b.join(callers[d], lane)
            except Exception:                 # a failed run's own error is the one to report
                if ok:
                    raise
        outs = []
        for env, made in zip(envs, made_on):
            out = {n: env[n] for n in program.outputs}
            for n, t in out.items():
                if n in made:
                    b.hand_out(t, callers)
            outs.append(out)
        if trace is not None:
            self._trace(trace, timings, origins)
        return outs

    def _issue(self, op: Op, lane, env: dict, placed: dict, made_on: dict) -> None:
        """Run one op on its lane (in a function of its own: its argument list dies on return)."""
        b = self.backend
        args = []
        for n, how, x in op.reads:
            if how == "const":
                args.append(x)
            elif how == "input":
                args.append(placed[(n, x)])
            else:
                t = env[n]
                if made_on.get(n, op.lane) != op.lane:
                    b.use(t, lane)
                args.append(t)
        with b.running(lane):
            outs = call(op.fn, args, len(op.writes), op.where, op.label)
        for n, t in zip(op.writes, outs):
            env[n] = t
            made_on[n] = op.lane

    def _trace(self, trace: list, timings, origins) -> None:
        b = self.backend
        b.finish(self.devices)
        for op, c, t0, t1 in timings:
            origin = origins[self.lane_devices[op.lane]]
            s0, s1 = b.seconds(origin, t0), b.seconds(origin, t1)
            for st in op.steps:
                trace.append((st.slot, st.label, s0, s1, c))


# ---------------------------------------------------------------------------------- flat chunk dicts
def flatten_chunks(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """k per-chunk dicts -> one dict (names f"{c}\\x00{name}"); one chunk keeps its names."""
    if len(parts) == 1:
        return dict(parts[0])
    return {f"{c}{SEP}{n}": t for c, part in enumerate(parts) for n, t in part.items()}


def unflatten_chunks(flat: Mapping[str, Any], chunks: int) -> list[dict]:
    """flatten_chunks undone."""
    if chunks == 1:
        return [dict(flat)]
    out: list[dict] = [{} for _ in range(chunks)]
    for key, t in flat.items():
        c, _, n = key.partition(SEP)
        out[int(c)][n] = t
    return out


# ---------------------------------------------------------------------------------- memory
def planned_memory(program: Program, lane_devices: Mapping[str, Any],
                   peak: Mapping[str, int] | None = None) -> dict[str, dict]:
    """Per device (its str): the plan's predicted peak bytes, the sum over the slots on it of
    program.peak_bytes (intermediates alive at once, one micro-batch; or `peak`, per slot, where given)
    and constant_bytes.
    -> {device: {"slots": (...), "activation_bytes": int, "constant_bytes": int, "predicted_peak_bytes": int}}"""
    out: dict[str, dict] = {}
    peak = program.peak_bytes if peak is None else peak
    for slot, dev in lane_devices.items():
        r = out.setdefault(str(dev), {"slots": (), "activation_bytes": 0, "constant_bytes": 0})
        r["slots"] += (slot,)
        r["activation_bytes"] += peak.get(slot, 0)
        r["constant_bytes"] += program.constant_bytes.get(slot, 0)
    for r in out.values():
        r["predicted_peak_bytes"] = r["activation_bytes"] + r["constant_bytes"]
    return out


def format_memory_report(report: Mapping[str, Mapping]) -> list[str]:
    """One line per device of a memory report (CudaProcessor.memory_report(), or planned_memory()
    with "measured_peak_bytes" added), e.g.
    `cuda:0 (slots 0, 1): measured peak 3.1MiB; plan 2.0MiB (intermediates 1.0MiB + constants 1.0MiB); 1.55x`."""
    lines = []
    for dev, r in report.items():
        plan = r["predicted_peak_bytes"]
        head = f"{dev} (slot{'s' if len(r['slots']) != 1 else ''} {', '.join(r['slots'])}): "
        planned = (f"plan {human_bytes(plan)} (intermediates {human_bytes(r['activation_bytes'])} + constants "
                   f"{human_bytes(r['constant_bytes'])})")
        measured = r.get("measured_peak_bytes")
        if measured is None:
            lines.append(head + planned)
            continue
        ratio = f"; {measured / plan:.2f}x" if plan else ""
        lines.append(f"{head}measured peak {human_bytes(measured)}; {planned}{ratio}")
    return lines
