"""The CUDA processor: runs a bound Program with a stream per slot, events for cross-slot waits, whole-run CUDA-graph replay.

One host thread issues every slot's steps, in an order the checker proved deadlock-free
(fastpipe.lower.simulate), onto the slot's own stream:
  * compute step: runs on its slot's stream (several slots may share one GPU and overlap);
  * comm group: the member streams join on the first member's stream (it waits for each
    member's event), the plain-torch comm runs there (device copies / reductions; between GPUs
    of one process, peer copies), and every member stream waits for its completion event;
  * no host synchronisation inside a run; tensors used on another stream than the one that
    made them are `record_stream`-ed so the caching allocator does not reuse them early.
With cuda_graph=True the whole run is captured and replayed by fastpipe.runtime.graph_replay
(as the region processor's is): the first call runs eagerly (warm-up: compiles, allocator
settles), the second captures the whole run into one CUDA graph (side streams forked from
and joined back to the capture stream), later calls copy the inputs into its static buffers
and replay it. A capture failure follows the compile policy: "warn" continues eagerly with a
warning naming the reason; "raise" raises CompileError. Outputs are cloned out of the
graph's static buffers unless `alias_outputs=True`.
"""
from __future__ import annotations

import warnings

import torch

from fastpipe.errors import InputError
from fastpipe.lower.check import simulate
from fastpipe.lower.program import Program
from fastpipe.runtime.execute import call, group_where, step_args, step_where
from fastpipe.runtime.graph_replay import GraphReplay


def check_cuda_devices(slot_devices) -> None:
    """Every slot on a CUDA device, or InputError naming the first that is not."""
    if not torch.cuda.is_available():
        raise InputError("processor: expected CUDA for processor \"cuda\", found none (use processor \"cpu\")")
    bad = [s for s, d in slot_devices.items() if d.type != "cuda"]
    if bad:
        raise InputError(f"device_map[\"{bad[0]}\"]: expected a cuda device for processor \"cuda\", "
                         f"found {slot_devices[bad[0]]}")


class CudaProcessor:
    def __init__(self, program: Program, *, cuda_graph: bool = True, compile_policy: str = "warn",
                 alias_outputs: bool = False):
        slot_devices = {slot: program.steps[slot][0].device for slot in program.slots if program.steps[slot]}
        check_cuda_devices(slot_devices)
        self.program = program
        self.order = simulate(program)                       # (slot, index) in a deadlock-free issue order
        self.streams = {slot: torch.cuda.Stream(device=dev) for slot, dev in slot_devices.items()}
        self.input_devices = program.input_devices()
        devices = set(slot_devices.values())
        use_graph = cuda_graph and len(devices) == 1
        if cuda_graph and len(devices) > 1:
            warnings.warn("fastpipe: CUDA-graph capture is per device; slots span "
                          f"{len(devices)} GPUs, so this run is issued eagerly on streams", RuntimeWarning, stacklevel=3)
        self.device = next(iter(devices))
        self.replay = (GraphReplay(self._issue_all, self.device, policy=compile_policy, alias_outputs=alias_outputs)
                       if use_graph else None)

    @property
    def graph(self):
        """The captured CUDA graph (None before the capture, or without one)."""
        return None if self.replay is None else self.replay.graph

    # ------------------------------------------------------------------ issue one run onto the streams
    def _issue(self, env: dict) -> None:
        done: dict[tuple[str, int], torch.cuda.Event] = {}
        made_on: dict[str, torch.cuda.Stream] = {}
        program = self.program
        for slot, i in self.order:
            st = program.steps[slot][i]
            stream = self.streams[slot]
            if st.kind == "comm":
                members = program.groups[st.group]
                if (members[0][0], members[0][1]) != (slot, i):
                    continue                     # the group is issued once, at its first member
                stream = self.streams[members[0][0]]
                for ms, mi in members:           # join: every member's inputs are ready
                    if mi > 0:
                        stream.wait_event(done[(ms, mi - 1)])
                steps = program.members(st.group)
                writes = [n for m in steps for n in m.writes]
                self._run_on(stream, steps, program.group_fns[st.group], writes, env, made_on,
                             lambda g=st.group: group_where(program, g), f"fp:group:{st.group}")
                ev = torch.cuda.Event()
                ev.record(stream)
                for ms, mi in members:
                    done[(ms, mi)] = ev
                    self.streams[ms].wait_event(ev)
                continue
            for ws, wi in st.waits:
                stream.wait_event(done[(ws, wi)])
            self._run_on(stream, [st], st.fn, st.writes, env, made_on, lambda st=st: step_where(st), st.label)
            ev = torch.cuda.Event()
            ev.record(stream)
            done[(slot, i)] = ev

    def _run_on(self, stream, steps, fn, writes, env, made_on, where, label: str) -> None:
        with torch.cuda.stream(stream):
            for st in steps:
                for n in st.reads:
                    if n in env and made_on.get(n, stream) is not stream:
                        env[n].record_stream(stream)
            args = [a for st in steps for a in step_args(st, env)]
            outs = call(fn, args, len(writes), where, label)
        for n, o in zip(writes, outs):
            env[n] = o
            made_on[n] = stream

    # ------------------------------------------------------------------ public
    def run(self, inputs, *, chunks: int = 1, trace: list | None = None):
        if chunks > 1:   # micro-batches issued back to back: the streams overlap them without host syncs
            return [self.run(part)[0] for part in inputs]
        return [self.replay(inputs) if self.replay is not None else self._issue_all(dict(inputs))]

    def _issue_all(self, inputs: dict) -> dict:
        """One whole run: inputs onto their devices, every slot stream forked from the current stream
        (under capture: the capture stream), the steps issued, the streams joined back."""
        cur = torch.cuda.current_stream(self.device)
        env = {n: t.to(self._input_device(n), non_blocking=True) for n, t in inputs.items()}
        for st in self.streams.values():
            st.wait_stream(cur)
        self._issue(env)
        for st in self.streams.values():
            cur.wait_stream(st)
        return {n: env[n] for n in self.program.outputs}

    def _input_device(self, name: str) -> torch.device:
        devs = self.input_devices.get(name) or {self.device}
        return next(iter(devs))
