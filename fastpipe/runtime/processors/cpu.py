"""The CPU processor: runs a bound Program with one thread per slot.

Each slot's thread issues its steps in order. A cross-slot wait blocks until the named
step has completed (for the same micro-batch). A comm step is a rendezvous: the group
runs (with the plain-torch reference, fastpipe.comm) once every member has arrived, and
each member continues with its outputs. torch ops release the GIL, so slots overlap.

Micro-batching (SPEC §4): with chunks=k the inputs are split along dim 0 into k
micro-batches of the pipeline's batch; every slot runs its steps for micro-batch 0, then
1, ... - so stage 0 starts micro-batch 1 while stage 1 still works on micro-batch 0
(GPipe fill-drain). Outputs are concatenated back along dim 0.

A failure on any slot stops every thread (no hang) and is raised as RunError naming the
supertask and slot; Ctrl-C (KeyboardInterrupt in the calling thread) stops every slot at its
next step boundary before it propagates. No thread outlives a call, and the processor keeps
no state between calls.
"""
from __future__ import annotations

import threading
import time

import torch

from fastpipe.errors import FastpipeError, RunError
from fastpipe.lower.program import Program
from fastpipe.runtime.execute import run_compute, run_group
from fastpipe.runtime.processors.base import Processor


class _Abort(Exception):
    pass


class _Run:
    """The shared state of one call."""

    def __init__(self, program: Program, chunks: int, trace: list | None):
        self.program, self.chunks, self.trace = program, chunks, trace
        self.cond = threading.Condition()
        self.progress = {s: 0 for s in program.slots}          # steps completed, over all chunks
        self.arrived: dict[tuple[str, int], set] = {}
        self.group_done: dict[tuple[str, int], bool] = {}
        self.error: BaseException | None = None
        self.finished = 0                                       # slot threads that have returned
        self.t0 = time.perf_counter()

    def wait_all(self, n: int) -> None:
        """Wait until n slot threads have returned (short, interruptible waits).

        Not Thread.join(): on Python 3.11 a KeyboardInterrupt inside join() marks the thread
        stopped while it still runs, and a later join() returns at once."""
        with self.cond:
            while self.finished < n:
                self.cond.wait(0.1)

    def fail(self, e: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = e
            self.cond.notify_all()

    def wait_until(self, pred) -> None:
        with self.cond:
            while not pred():
                if self.error is not None:
                    raise _Abort()
                self.cond.wait()
            if self.error is not None:
                raise _Abort()


class ThreadedProcessor(Processor):
    name = "cpu"
    folds_gemms = True
    writes_state_in_steps = True

    def __init__(self, program: Program):
        self.program = program
        self.outputs = tuple(program.outputs)
        self.keep = set(self.outputs)

    def run(self, parts: list[dict], *, trace: list | None = None) -> list[dict]:
        """`parts`: one dict of named tensors per micro-batch (chunk), issued together, fill-drain."""
        envs = [dict(c) for c in parts]
        run = _Run(self.program, len(parts), trace)
        threads = [threading.Thread(target=self._slot, args=(run, slot, envs), name=f"fastpipe-slot-{slot}", daemon=True)
                   for slot in self.program.slots]
        for t in threads:
            t.start()
        try:
            run.wait_all(len(threads))
        except KeyboardInterrupt:
            # Ctrl-C: stop every slot at its next step boundary, wait for them, then re-raise
            run.fail(KeyboardInterrupt())
            run.wait_all(len(threads))
            raise
        for t in threads:
            t.join()
        if run.error is not None:
            e = run.error
            if isinstance(e, FastpipeError):
                raise e
            raise RunError(" ".join(str(e).split())) from e
        return [{n: env[n] for n in self.outputs} for env in envs]

    # ------------------------------------------------------------------ one slot's thread
    def _slot(self, run: _Run, slot: str, envs: list[dict]) -> None:
        steps = self.program.steps[slot]
        n = len(steps)
        try:
            for c in range(run.chunks):
                env = envs[c]
                for i, st in enumerate(steps):
                    if run.error is not None:          # another slot failed (or Ctrl-C): stop here
                        raise _Abort()
                    for (ws, wi) in st.waits:
                        need = c * len(self.program.steps[ws]) + wi + 1
                        run.wait_until(lambda ws=ws, need=need: run.progress[ws] >= need)
                    t = time.perf_counter()
                    if st.kind == "compute":
                        with torch.inference_mode():
                            run_compute(st, env)
                    else:
                        self._rendezvous(run, st.group, c, slot, env)
                    if run.trace is not None:
                        run.trace.append((slot, st.label, t - run.t0, time.perf_counter() - run.t0, c))
                    for name in st.frees:
                        if name not in self.keep:
                            env.pop(name, None)
                    with run.cond:
                        run.progress[slot] = c * n + i + 1
                        run.cond.notify_all()
        except _Abort:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            run.fail(e)
        finally:
            with run.cond:
                run.finished += 1
                run.cond.notify_all()

    def _rendezvous(self, run: _Run, group: str, chunk: int, slot: str, env: dict) -> None:
        key = (group, chunk)
        members = {s for s, _ in self.program.groups[group]}
        with run.cond:
            arrived = run.arrived.setdefault(key, set())
            arrived.add(slot)
            last = arrived == members
        if last:   # everyone's inputs are in env (one env per chunk, shared by the slots)
            with torch.inference_mode():
                run_group(self.program, group, env)
            with run.cond:
                run.group_done[key] = True
                run.cond.notify_all()
        else:
            run.wait_until(lambda: run.group_done.get(key, False))
