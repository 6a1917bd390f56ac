"""The dist processor: a Program run by several processes (torchrun ranks) with torch.distributed.

Every rank loads the pipeline, binds only its own slots (fastpipe.runtime.processors.dist_setup decides
which) and issues its steps from ONE thread, in the order simulate(program) gives: the
Program's deadlock-free global completion order, projected onto this rank's slots. The global
order is the same on every rank, so every rank issues the groups it shares with another rank
in the same relative order, and blocking collectives cannot deadlock (the earliest unfinished
step of the global order always has all its participants at it). Slots of one rank therefore
run one after the other; different ranks run concurrently. With chunks=k each rank runs its
steps for micro-batch 0, then 1, ... (fill-drain across ranks).

A comm group runs one of three ways on a rank that has a member:
  local    every member on this rank: the plain-torch reference (fastpipe.comm), as the cpu
           processor does;
  native   every member on its own rank: one torch.distributed collective on the group's
           sub-group (created once, at setup, by every rank): all_reduce, all_gather_single,
           reduce_scatter_single, all_to_all_single (one tensor in, one out: the chunks along
           dim 0 as they are, or moved there in one copy), reduce, gather, broadcast, send/recv;
  generic  some rank holds several members: each member's input is broadcast from its rank
           to the sub-group, in member order, and every rank computes its own members'
           outputs with the reference.
Numerics of native reductions (reduce_dtype): on NCCL f16/bf16 are reduced in their own dtype
(the bytes of the data, no upcast; NCCL's ring/tree keeps partial sums in that dtype, so a sum
over n ranks rounds up to n-1 times where the reference rounds once); f8 (torch has no NCCL f8
reduction), and every narrow float on gloo (CPU: kept as close to the reference as it costs
little), are reduced in float32 and rounded once, as the reference does. bool reduces as uint8
(sum/max = or, min = and), i16 (in neither backend) in i32, wrapping as the reference does. avg is
AVG on NCCL, sum then divide on gloo. The summation order is the backend's (ring/tree), not the
reference's left fold, so float results agree within rounding, not bitwise. Data moves of dtypes
the backends lack (i16, f8) travel as same-width views (f16, u8).

Outputs: every pipeline output is sent to rank 0 (point to point, from the rank of the slot
that produced it); Session.run returns all outputs on rank 0 and {} on every other rank.
A failure raises RunError prefixed with the rank (`[rank 1] supertasks["7"] on slot "1": failed:
...`); a rank blocked in a collective whose peer died gets an error from the backend (a closed
connection), or at the latest the process group's timeout.
"""
from __future__ import annotations

import atexit
import time
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Mapping

import torch
import torch.distributed as dist

from fastpipe import dtypes
from fastpipe.errors import FastpipeError, InputError, RunError
from fastpipe.format.comm_kinds import KindTable
from fastpipe.lower.check import simulate
from fastpipe.lower.program import Program, Step
from fastpipe.runtime.processors.dist_setup import RankPlan, init_process_group, make_subgroups, rank_cuda_device
from fastpipe.runtime.execute import run_compute, run_group, step_args
from fastpipe.runtime.processors.base import Placement, Prepared, Processor

_WIRE = {torch.int16: torch.float16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
for _n in ("float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _n):
        _WIRE[getattr(torch, _n)] = torch.uint8


def _wire(t: torch.Tensor) -> torch.Tensor:
    """A contiguous same-width view in a dtype every backend moves (bytes unchanged)."""
    t = t.contiguous()
    return t.view(_WIRE[t.dtype]) if t.dtype in _WIRE else t


def _unwire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(dtype) if t.dtype != dtype else t


def reduce_dtype(dtype: torch.dtype, nccl: bool) -> torch.dtype:
    """The dtype a native reduction of `dtype` runs in (on the wire too): f16/bf16 as they are on
    NCCL; other narrow floats (f8: torch has no NCCL f8 reduction), and every narrow float on gloo,
    in f32; bool as u8; i16 (in neither backend) in i32; any other dtype as it is."""
    if dtype == torch.bool:
        return torch.uint8
    if dtype == torch.int16:
        return torch.int32
    if dtype.is_floating_point and dtype.itemsize < 4:
        return dtype if nccl and dtype in (torch.float16, torch.bfloat16) else torch.float32
    return dtype


def _acc(x: torch.Tensor, nccl: bool = False) -> torch.Tensor:
    """A fresh contiguous buffer to reduce in, in reduce_dtype (one copy, the cast included)."""
    return x.to(reduce_dtype(x.dtype, nccl), copy=True, memory_format=torch.contiguous_format)


def _stacked(x: torch.Tensor, dim: int, n: int, order, dtype: torch.dtype) -> torch.Tensor:
    """(n, *chunk) in `dtype`: row k is x's chunk order[k] of n along `dim` (what a one-tensor
    collective sends to sub-group rank k). A view of x when it already is that (dim 0, order
    0..n-1, contiguous, same dtype); otherwise one copy, the cast included."""
    dim %= x.dim()
    m = x.shape[dim] // n
    if dim == 0 and list(order) == list(range(n)) and x.dtype == dtype and x.is_contiguous():
        return x.view(n, m, *x.shape[1:])
    chunks = x.split(m, dim=dim)
    out = torch.empty((n, *chunks[0].shape), dtype=dtype, device=x.device)
    for k, i in enumerate(order):
        out[k].copy_(chunks[i])
    return out


def _unstacked(t: torch.Tensor, dim: int, order) -> torch.Tensor:
    """cat(t[order[0]], t[order[1]], ..., dim): a view of t for dim 0 in order 0..n-1, else one copy."""
    dim %= t.dim() - 1
    if dim == 0 and list(order) == list(range(t.shape[0])):
        return t.flatten(0, 1)
    return torch.cat([t[j] for j in order], dim=dim)


def _reduce_scatter_single(out, inp, op, group):
    # `inp`: the n chunks concatenated along dim 0 (gloo refuses the stacked (n, *chunk) form NCCL takes).
    # torch 2.13 names it reduce_scatter_single (reduce_scatter_tensor: deprecated); older torch only the latter
    f = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return f(out, inp, op=op, group=group)


def _all_gather_single(out, inp, group):
    f = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return f(out, inp, group=group)


def _reduce_op(op: str, dtype: torch.dtype, nccl: bool):
    R = dist.ReduceOp
    if dtype == torch.bool:
        return R.MIN if op == "min" else R.MAX
    return {"sum": R.SUM, "avg": R.AVG if nccl else R.SUM, "max": R.MAX, "min": R.MIN}[op]


@dataclass
class _Group:
    name: str
    kind: str
    params: dict
    members: tuple[str, ...]             # supertask ids, device_idx order
    slots: tuple[str, ...]
    ranks: tuple[int, ...]               # rank of each member
    mode: str                            # "local" | "native" | "generic"
    pg: object                           # process group (None for local)
    device: torch.device                 # where its tensors travel: this rank's GPU (NCCL) or cpu (gloo)
    steps: tuple[Step, ...]              # the member steps of the bound Program
    fn: object                           # the group's callable (local and generic modes)
    out_meta: tuple = ()                 # per member: ((shape, dtype) of each output)

    @property
    def writes(self) -> tuple[tuple[str, ...], ...]:
        return tuple(st.writes for st in self.steps)

    def gr(self, i: int) -> int:
        """Rank of member i inside the sub-group (new_group orders by global rank)."""
        return sorted(set(self.ranks)).index(self.ranks[i])

    def at(self, k: int) -> int:
        """The member whose rank is the sub-group's k-th."""
        return self.ranks.index(sorted(set(self.ranks))[k])

    def where(self) -> str:
        return f"group \"{self.name}\" ({self.kind}, supertasks {', '.join(self.members)})"


@dataclass(frozen=True)
class DistOptions:
    """The dist processor's own options (RunOptions.processor_options, or fastpipe.load's keywords);
    refused by every other processor."""
    slot_ranks: Mapping[str, int] | None = None
    """slot -> rank (default: contiguous blocks of slots)."""
    dist_timeout: float | None = None
    """Seconds any collective may wait (default 120)."""
    only_for_its_processors = True            # (a class attribute: not a field)

    def __post_init__(self):
        t = self.dist_timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise InputError(f"dist_timeout: expected a number of seconds > 0, found {t!r}")


class DistProcessor(Processor):
    """Executes this rank's share of a bound Program (bound for plan.local_slots). `checked`: the
    validated pipeline, for comm kinds and the declared shapes of what crosses ranks."""

    name = "dist"
    options = (DistOptions,)
    folds_gemms = True
    background_compile = "warm-up"      # every rank compiles at warm-up, together
    one_process_per_rank = True

    @classmethod
    def place(cls, pipeline, slot_devices: dict, run_options) -> Placement:
        """Which rank runs which slot (dist_setup.make_plan); this rank binds only its own; nothing is fused."""
        from fastpipe.runtime.passes import fuse
        from fastpipe.runtime.processors.dist_setup import make_plan

        if run_options.state_in_place:
            raise InputError("state_in_place: expected a one-process processor (outputs of dist live on rank 0), "
                             "found processor=\"dist\"")
        fuse.check_fuse_for_dist(run_options.fuse)
        plan = make_plan(pipeline, slot_devices, run_options.of(DistOptions).slot_ranks)
        return Placement(plan.slot_devices, "off", fuse.DIST_OFF, local_slots=plan.local_slots, detail=plan)

    @classmethod
    def prepare(cls, program: Program, prepared: Prepared) -> "DistProcessor":
        return cls(program, prepared.checked, prepared.placement.detail,
                   timeout_s=prepared.run_options.of(DistOptions).dist_timeout).attach(prepared)

    def call(self, inputs: Mapping[str, torch.Tensor], *, chunks: int = 1, trace=None) -> dict:
        return self.session_run(inputs, chunks=chunks, trace=trace)

    def outputs_here(self) -> bool:
        return self.rank == 0

    def __init__(self, program: Program, checked, plan: RankPlan, *, timeout_s: float | None = None):
        self.plan, self.rank = plan, plan.rank
        p = checked.pipeline
        self.pipeline, self.program = p, program
        self._owns_world = init_process_group(plan, timeout_s)
        local = set(plan.local_slots)
        self.local = local
        self.order = [(s, i) for s, i in simulate(program) if s in local]
        self.input_devices = program.input_devices()
        rank_sets, infos = [], []
        for g in program.groups:
            cg = checked.groups[g]
            slots = tuple(p.supertasks[m].device for m in cg.members)
            ranks = tuple(plan.slot_ranks[s] for s in slots)
            rank_sets.append(tuple(sorted(set(ranks))))
            infos.append((cg, slots, ranks))
        pgs = make_subgroups(rank_sets, timeout_s)     # every rank, every set, the same order
        self._subgroups = [pg for pg in pgs.values() if pg not in (dist.group.WORLD, dist.GroupMember.NON_GROUP_MEMBER)]
        self._closed = False
        _LIVE.add(self)
        self.groups: dict[str, _Group] = {}
        for cg, slots, ranks in infos:
            if self.rank not in ranks:
                continue
            rset = tuple(sorted(set(ranks)))
            mode = "local" if len(rset) == 1 else ("native" if len(rset) == len(ranks) else "generic")
            cuda = all(plan.slot_types[s] == "cuda" for s in slots)
            dev = rank_cuda_device(plan) if cuda else torch.device("cpu")
            self.groups[cg.name] = _Group(cg.name, cg.kind, dict(cg.params), tuple(cg.members), slots, ranks, mode,
                                          pgs.get(rset), dev, tuple(program.members(cg.name)),
                                          program.group_fns[cg.name],
                                          tuple(tuple((p.tensors[t].shape, dtypes.to_torch(p.tensors[t].dtype))
                                                      for t in p.supertasks[m].outputs) for m in cg.members))
        self.outputs = tuple(dict.fromkeys(p.output_names))
        self.keep = set(self.outputs)
        self.out_rank = {}
        for n in self.outputs:
            prod = [s for s in checked.flow.producers.get(n, []) if p.supertasks[s].device is not None]
            self.out_rank[n] = plan.slot_ranks[p.supertasks[prod[0]].device] if prod else 0
        self.out_device = rank_cuda_device(plan) if plan.backend == "nccl" else torch.device("cpu")
        consumers = checked.flow.consumers
        self.needed_inputs = tuple(
            n for n in p.input_names
            if any(p.supertasks[c].device in local for c in consumers.get(n, []))
            or (self.rank == 0 and self.out_rank.get(n, -1) == 0 and n in self.outputs))

    def close(self) -> None:
        """Let go of this runner's process groups (idempotent): its sub-groups are destroyed, and the
        default group too when this runner created it. Runs at exit for every live runner: a process
        group still referenced when the interpreter shuts down can abort the process (gloo, once its
        peers have exited)."""
        for g in self.groups.values():
            g.pg = None
        subgroups, self._subgroups = self._subgroups, []
        if dist.is_available() and dist.is_initialized():
            if self._owns_world:
                dist.destroy_process_group()
            else:
                for pg in subgroups:
                    try:
                        dist.destroy_process_group(pg)
                    except (RuntimeError, ValueError):   # already gone with its default group
                        pass
        self._owns_world, self._closed = False, True
        _LIVE.discard(self)

    # ------------------------------------------------------------------ Session.run on this rank
    def session_run(self, inputs: Mapping[str, torch.Tensor], *, chunks: int = 1, trace=None) -> dict:
        """Session.run for processor "dist": call it on EVERY rank (same chunks; trace given on every
        rank or on none). `inputs` needs only this rank's (`needed_inputs`); rank 0 gets every
        output, other ranks {}."""
        if self._closed:
            raise RunError(f"[rank {self.rank}] processor \"dist\": expected an open session, found one closed "
                           "(DistProcessor.close / dist_processor.shutdown let go of its process groups)")
        self.check_inputs(inputs, chunks)
        back = ()
        if self.prepared.written:      # this rank's inputs written in place: the caller's tensors get the update
            from fastpipe.runtime.binding.state import working_inputs

            inputs, back = working_inputs(inputs, self.prepared.written, self.input_devices, chunks)
        if chunks == 1:
            parts = [dict(inputs)]
        else:
            from fastpipe.runtime.binding.microbatch import split_chunks

            parts = split_chunks(inputs, chunks, {n: self.pipeline.tensors[n].shape[0] for n in inputs})
        events: list | None = [] if trace is not None else None
        results = self.run(parts, trace=events)
        for given, work in back:
            given.copy_(work)
        if trace is not None:
            self._write_trace(trace, events)
        if self.rank != 0:
            return {}
        if chunks == 1:
            return results[0]
        return {n: torch.cat([r[n] for r in results], dim=0) for n in self.pipeline.output_names}

    def check_inputs(self, inputs: Mapping[str, torch.Tensor], chunks: int = 1) -> None:
        from fastpipe.runtime.binding.inputs import check_inputs

        p = self.pipeline
        for name in inputs:
            if name not in p.input_names:
                raise InputError(f"inputs[\"{name}\"]: expected one of the pipeline inputs ({', '.join(p.input_names) or 'none'}), "
                                 "found an unknown name")
        for name in self.needed_inputs:
            if name not in inputs:
                raise InputError(f"inputs[\"{name}\"]: expected a tensor for this pipeline input (rank {self.rank} "
                                 "runs a supertask that reads it), found none")
        present = SimpleNamespace(input_names=tuple(n for n in p.input_names if n in inputs),
                                  output_names=p.output_names, tensors=p.tensors)
        if chunks > 1:
            from fastpipe.runtime.binding.microbatch import check_chunked_inputs

            check_chunked_inputs(present, inputs, chunks, self.input_devices)
        else:
            check_inputs(present, inputs, self.input_devices)

    # ------------------------------------------------------------------ one call
    def run(self, parts: list[dict], *, trace: list | None = None) -> list[dict]:
        events = trace
        envs = [dict(x) for x in parts]
        t0 = time.perf_counter()
        for c, env in enumerate(envs):
            done: set[str] = set()
            for slot, i in self.order:
                st = self.program.steps[slot][i]
                t = time.perf_counter()
                if st.kind == "compute":
                    self._execute(run_compute, st, env)
                elif st.group not in done:
                    done.add(st.group)
                    self._group(self.groups[st.group], env)
                if events is not None:
                    events.append((slot, st.label, t - t0, time.perf_counter() - t0, c))
                for name in st.frees:
                    if name not in self.keep:
                        env.pop(name, None)
        return self._gather_outputs(envs)

    def _fail(self, what: str, e: BaseException, hint: str = "") -> RunError:
        msg = " ".join(str(e).split()) or type(e).__name__
        return RunError(f"[rank {self.rank}] {what}: failed: {type(e).__name__}: {msg}{hint}")

    def _execute(self, run, *args) -> None:
        """run(*args) (execute.run_compute / run_group) with its errors prefixed by this rank."""
        try:
            with torch.inference_mode():
                run(*args)
        except FastpipeError as e:
            raise type(e)(f"[rank {self.rank}] {e}") from e

    def _group(self, g: _Group, env: dict) -> None:
        if g.mode == "local":
            return self._execute(run_group, self.program, g.name, env)
        try:
            with torch.inference_mode(), torch.profiler.record_function(f"fp:group:{g.name}"):
                if g.mode == "native" and g.kind in DIST_KINDS:
                    (me,) = [i for i, r in enumerate(g.ranks) if r == self.rank]
                    x = step_args(g.steps[me], env)[0] if g.steps[me].reads else None
                    outs = {me: _native(g, me, x, self.plan.backend != "gloo" and g.device.type == "cuda")}
                else:
                    outs = self._generic(g, env)
        except FastpipeError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._fail(g.where(), e, " (if another rank failed first, its error names the cause)") from e
        for i, ys in outs.items():
            dev = self.plan.slot_devices[g.slots[i]]
            env.update((n, y if y.device == dev else y.to(dev)) for n, y in zip(g.writes[i], ys))

    def _generic(self, g: _Group, env: dict) -> dict[int, list]:
        """Members sharing ranks: broadcast each member's input from its rank, then the reference."""
        p = self.pipeline
        xs = []
        for i, m in enumerate(g.members):
            for j, name in enumerate(p.supertasks[m].inputs):
                info = p.tensors[name]
                dtype = dtypes.to_torch(info.dtype)
                if g.ranks[i] == self.rank:
                    buf = _wire(step_args(g.steps[i], env)[j].to(g.device))
                else:
                    buf = _wire(torch.empty(info.shape, dtype=dtype, device=g.device))
                dist.broadcast(buf, src=g.ranks[i], group=g.pg)
                xs.append(_unwire(buf, dtype))
        mine = [i for i, r in enumerate(g.ranks) if r == self.rank]
        if not any(g.writes[i] for i in mine):
            return {}
        outs = g.fn(xs)
        flat, k = {}, 0
        for i, w in enumerate(g.writes):
            flat[i] = list(outs[k:k + len(w)])
            k += len(w)
        return {i: flat[i] for i in mine}

    # ------------------------------------------------------------------ outputs and traces
    def _gather_outputs(self, envs: list[dict]) -> list[dict]:
        p = self.pipeline
        results = [dict() for _ in envs]
        reqs, bufs = [], []
        try:
            for c, env in enumerate(envs):
                for n in self.outputs:
                    src = self.out_rank[n]
                    if src == self.rank == 0:
                        results[c][n] = env[n]
                    elif src == self.rank:
                        reqs.append(dist.isend(_wire(env[n].to(self.out_device)), dst=0))
                    elif self.rank == 0:
                        dtype = dtypes.to_torch(p.tensors[n].dtype)
                        buf = _wire(torch.empty(p.tensors[n].shape, dtype=dtype, device=self.out_device))
                        reqs.append(dist.irecv(buf, src=src))
                        bufs.append((c, n, buf, dtype))
            for r in reqs:
                r.wait()
        except Exception as e:  # noqa: BLE001
            raise self._fail("sending outputs to rank 0", e, " (if another rank failed first, its error names the cause)") from e
        for c, n, buf, dtype in bufs:
            results[c][n] = _unwire(buf, dtype)
        return results

    def _write_trace(self, path, events: list) -> None:
        """Rank 0 writes one Chrome trace with a lane per slot of every rank (clocks aligned by wall time)."""
        from fastpipe.runtime.trace import write_chrome_trace

        mine = (time.time() - time.perf_counter(), events)
        got = [None] * self.plan.world if self.rank == 0 else None
        dist.gather_object(mine, got, dst=0)
        if self.rank != 0:
            return
        base = got[0][0]
        merged = [(s, lab, a + off - base, b + off - base, c) for off, evs in got for (s, lab, a, b, c) in evs]
        write_chrome_trace(path, merged, tuple(self.pipeline.devices))


_LIVE: "weakref.WeakSet[DistProcessor]" = weakref.WeakSet()


@atexit.register
def shutdown() -> None:
    """Close every live dist runner (see DistProcessor.close); also registered to run at exit."""
    for r in list(_LIVE):
        r.close()


def _native(g: _Group, me: int, x: torch.Tensor | None, nccl: bool) -> list[torch.Tensor]:
    """This member's outputs of group g, every member on its own rank: one torch.distributed call
    (DIST_KINDS[g.kind]); `x`: this member's input, None where it has none."""
    if x is not None:
        x = x.to(g.device)
    return DIST_KINDS[g.kind](g, me, x, nccl)


def _p2p(g: _Group, me: int, x, nccl: bool) -> list[torch.Tensor]:
    if me == 0:                                     # the send
        dist.send(_wire(x), dst=g.ranks[1], group=g.pg)
        return []
    return [_recv_like(g, 1, lambda b: dist.recv(b, src=g.ranks[0], group=g.pg))]


def _broadcast(g: _Group, me: int, x, nccl: bool) -> list[torch.Tensor]:
    src = g.params["src"]
    if me == src:
        buf = _wire(x.clone(memory_format=torch.contiguous_format))
        dist.broadcast(buf, src=g.ranks[src], group=g.pg)
        return [_unwire(buf, x.dtype)]
    return [_recv_like(g, me, lambda b: dist.broadcast(b, src=g.ranks[src], group=g.pg))]


def _reduced(g: _Group, x: torch.Tensor, buf: torch.Tensor, nccl: bool) -> list[torch.Tensor]:
    """A native reduction's result `buf` (reduce_dtype) as x's dtype; avg divided here off NCCL."""
    if g.params["reduce_op"] == "avg" and not nccl:
        buf = buf / len(g.members)
    return [buf.to(x.dtype)]


def _all_reduce(g: _Group, me: int, x, nccl: bool) -> list[torch.Tensor]:
    buf = _acc(x, nccl)                              # reduced in place: a fresh buffer
    dist.all_reduce(buf, op=_reduce_op(g.params["reduce_op"], x.dtype, nccl), group=g.pg)
    return _reduced(g, x, buf, nccl)


def _reduce(g: _Group, me: int, x, nccl: bool) -> list[torch.Tensor]:
    dst = g.params["dst"]
    buf = _acc(x, nccl)
    dist.reduce(buf, dst=g.ranks[dst], op=_reduce_op(g.params["reduce_op"], x.dtype, nccl), group=g.pg)
    return _reduced(g, x, buf, nccl) if me == dst else []


def _reduce_scatter(g: _Group, me: int, x, nccl: bool) -> list[torch.Tensor]:
    # x is only read: no copy when its chunks are in place
    n = len(g.members)
    inp = _stacked(x, g.params["dim"], n, [g.at(k) for k in range(n)], reduce_dtype(x.dtype, nccl))  # (n, *chunk)
    buf = torch.empty(inp.shape[1:], dtype=inp.dtype, device=inp.device)
    rop = _reduce_op(g.params["reduce_op"], x.dtype, nccl)
    _reduce_scatter_single(buf, inp.flatten(0, 1), rop, g.pg)     # the chunks concatenated along dim 0
    return _reduced(g, x, buf, nccl)


def _all_gather(g: _Group, me: int, x, nccl: bool) -> list[torch.Tensor]:
    n, xw = len(g.members), _wire(x)
    got = torch.empty((n, *xw.shape), dtype=xw.dtype, device=xw.device)                   # (n, *x)
    _all_gather_single(got.flatten(0, 1) if xw.dim() else got, xw, g.pg)   # gloo: concatenated, not stacked
    return [_unstacked(_unwire(got, x.dtype), g.params["dim"], [g.gr(i) for i in range(n)])]


def _gather(g: _Group, me: int, x, nccl: bool) -> list[torch.Tensor]:
    n, xw, dst = len(g.members), _wire(x), g.params["dst"]
    got = [torch.empty_like(xw) for _ in range(n)] if me == dst else None
    dist.gather(xw, got, dst=g.ranks[dst], group=g.pg)
    if me != dst:
        return []
    return [torch.cat([_unwire(got[g.gr(i)], x.dtype) for i in range(n)], dim=g.params["dim"])]


def _all_to_all(g: _Group, me: int, x, nccl: bool) -> list[torch.Tensor]:
    n, xw = len(g.members), _wire(x)
    inp = _stacked(xw, g.params["src_dim"], n, [g.at(k) for k in range(n)], xw.dtype)    # (n, *chunk)
    got = torch.empty_like(inp)
    dist.all_to_all_single(got, inp, group=g.pg)
    return [_unstacked(_unwire(got, x.dtype), g.params["dst_dim"], [g.gr(j) for j in range(n)])]


# group kind -> (group, this member, its input or None, nccl) -> this member's outputs, over g.pg.
# A kind without an entry runs the generic path (each input broadcast, then EXECUTE_KINDS).
DIST_KINDS: KindTable = KindTable("fastpipe.runtime.processors.dist.DIST_KINDS", {
    "p2p": _p2p, "broadcast": _broadcast, "all_reduce": _all_reduce, "reduce": _reduce,
    "reduce_scatter": _reduce_scatter, "all_gather": _all_gather, "gather": _gather, "all_to_all": _all_to_all,
})


def _recv_like(g: _Group, member: int, fill) -> torch.Tensor:
    """Receive `member`'s single output (its declared shape and dtype) into a fresh buffer."""
    shape, dtype = g.out_meta[member][0]
    buf = _wire(torch.empty(shape, dtype=dtype, device=g.device))
    fill(buf)
    return _unwire(buf, dtype)
