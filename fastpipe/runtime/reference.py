"""The reference runtime: run the steps in dependency order, one at a time, on CPU or any device.

It is plain and sequential on purpose: the CPU and CUDA processors of the
runtime issue are tested against it. A failing step raises RunError naming
the supertask and slot.
"""
from __future__ import annotations

import time
from typing import Mapping, Sequence

import torch

from fastpipe.runtime.steps import Step, run_step


class ReferenceRunner:
    def __init__(self, steps: Sequence[Step], outputs: Sequence[str]):
        self.steps = list(steps)
        self.outputs = tuple(outputs)
        last_use: dict[str, int] = {}
        for i, s in enumerate(self.steps):
            for r in s.reads:
                if isinstance(r, str):
                    last_use[r] = i
        keep = set(self.outputs)
        # names whose last reader is step i: freed right after it runs
        self._free_after = [tuple(n for n, j in last_use.items() if j == i and n not in keep) for i in range(len(self.steps))]

    @torch.inference_mode()
    def run(self, inputs: Mapping[str, torch.Tensor], *, events: list | None = None, chunk: int = 0,
            t0: float = 0.0) -> dict[str, torch.Tensor]:
        env: dict[str, torch.Tensor] = dict(inputs)
        for step, free in zip(self.steps, self._free_after):
            start = time.perf_counter() if events is not None else 0.0
            run_step(step, env)
            if events is not None:
                end = time.perf_counter()
                for slot in step.slots:
                    events.append((slot, step.label if len(step.slots) == 1 else f"fp:{slot}:{step.supertasks[step.slots.index(slot)]}",
                                   start - t0, end - t0, chunk))
            for n in free:
                env.pop(n, None)
        return {n: env[n] for n in self.outputs}
