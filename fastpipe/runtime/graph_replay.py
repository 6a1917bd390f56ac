"""Whole-run CUDA-graph capture and replay of a function of named tensors, on one GPU.

    replay = GraphReplay(fn, device, policy="warn")   # fn(inputs: dict) -> dict of outputs
    outs = replay(inputs)       # call 1: eager (warm-up: compiles, allocator settles)
                                # call 2: captures fn into one CUDA graph, replays it
                                # later:  copies inputs into the static buffers, replays

Pipeline inputs are copied into static buffers the graph reads; outputs are cloned out of the
graph's static buffers (the next replay overwrites them) unless `alias_outputs=True`.
`state` (input -> its updated output, fastpipe.runtime.state): the state tensors given at capture,
when dense on the device, become the graph's own buffers, and their outputs are those buffers,
not clones; a caller passing the same tensors every call (an engine's KV cache) copies nothing.
Other tensors are copied in (and the session writes the outputs back into them); the tensors of
the capture call then serve as the graph's scratch. A capture
failure follows the compile policy: "warn" keeps running `fn` eagerly, with a warning naming
the reason; "raise" raises CompileError. Never silent.
"""
from __future__ import annotations

import warnings
from typing import Callable, Mapping

import torch

from fastpipe.errors import CompileError


class GraphReplay:
    def __init__(self, fn: Callable[[dict], dict], device: torch.device, *, policy: str = "warn",
                 alias_outputs: bool = False, state: Mapping[str, str] | None = None):
        self.fn, self.device, self.policy, self.alias_outputs = fn, device, policy, alias_outputs
        self.state = dict(state or {})
        self._state_outputs = frozenset(self.state.values())
        self.enabled = True
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_in: dict[str, torch.Tensor] = {}
        self.static_out: dict[str, torch.Tensor] = {}

    @property
    def replaying(self) -> bool:
        return self.graph is not None

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> dict:
        self.calls += 1
        if self.graph is not None:
            for n, t in inputs.items():
                buf = self.static_in[n]
                if t is not buf:
                    buf.copy_(t, non_blocking=True)
            self.graph.replay()
            return self._outputs()
        if self.enabled and self.calls >= 2:
            try:
                return self._capture(inputs)
            except CompileError:
                raise
            except Exception as e:  # noqa: BLE001 - reported with its reason, per policy
                self.graph = None
                reason = " ".join(str(e).split())[:300]
                if self.policy == "raise":
                    raise CompileError(f"CUDA-graph capture failed: {type(e).__name__}: {reason}") from e
                warnings.warn(f"fastpipe: CUDA-graph capture failed ({type(e).__name__}: {reason}); "
                              "running without a graph", RuntimeWarning, stacklevel=3)
                self.enabled = False
        return self.fn(dict(inputs))

    def _capture(self, inputs) -> dict:
        self.static_in = {n: t if n in self.state and t.device == self.device and t.is_contiguous()
                          else t.to(self.device).clone() for n, t in inputs.items()}
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.static_out = dict(self.fn(dict(self.static_in)))
        self.graph = g
        g.replay()
        return self._outputs()

    def _outputs(self) -> dict:
        out = self.static_out
        return dict(out) if self.alias_outputs else {n: t if n in self._state_outputs else t.clone()
                                                     for n, t in out.items()}
