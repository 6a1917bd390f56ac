"""The reference processor: runs a bound Program one step at a time, on CPU or any device.

It is plain and sequential on purpose: the CPU and CUDA processors of the runtime are
tested against it. Steps run in the order ``simulate(program)`` gives (the checker's
deadlock-free completion order); a comm group runs whole, at its first member, and each
step's ``frees`` are dropped once it has completed. A failing step raises RunError naming
the supertask and slot.
"""
from __future__ import annotations

import time
from typing import Mapping

import torch

from fastpipe.lower.check import simulate
from fastpipe.lower.program import Program
from fastpipe.runtime.execute import run_compute, run_group
from fastpipe.runtime.processors.base import Processor


class ReferenceProcessor(Processor):
    name = "reference"
    background_compile = "eager"          # the oracle: nothing swapped under it (compile="wait" compiles)

    def __init__(self, program: Program):
        self.program = program
        self.order = simulate(program)
        self.keep = set(program.outputs)

    def run(self, parts: list[dict], *, trace: list | None = None) -> list[dict]:
        """Each part (micro-batch) in turn, one step at a time."""
        t0 = time.perf_counter()
        return [self._run_one(part, events=trace, chunk=c, t0=t0) for c, part in enumerate(parts)]

    @torch.inference_mode()
    def _run_one(self, inputs: Mapping[str, torch.Tensor], *, events: list | None, chunk: int,
                 t0: float) -> dict[str, torch.Tensor]:
        program, env = self.program, dict(inputs)
        pending: dict[str, float] = {}       # group -> start time (its members complete together)
        for slot, i in self.order:
            st = program.steps[slot][i]
            start = time.perf_counter()
            if st.kind == "compute":
                run_compute(st, env)
            elif st.group not in pending:
                pending[st.group] = start
                run_group(program, st.group, env)
            else:
                start = pending[st.group]
            if events is not None:
                events.append((slot, st.label, start - t0, time.perf_counter() - t0, chunk))
            for n in st.frees:
                if n not in self.keep:
                    env.pop(n, None)
        return {n: env[n] for n in program.outputs}
