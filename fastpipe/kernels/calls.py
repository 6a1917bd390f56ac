"""The fused-kernel calls a run makes, recorded to be tuned (``fastpipe tune``, fastpipe.kernels.autotune).

    with recording() as calls:
        session.run(inputs)          # every matmul_reduce_scatter / all_gather_matmul call lands in calls
    calls[0].launch()                # ("mm_sum", M, N, K, n): what pick_config and the tuned table see

A KernelCall keeps what decides a launch config and the kernel's specialization: the function, dim,
op, dtype and every operand's shape and strides (a weight read as ``w.t()`` keeps its column-major
strides), not the data. ``operands`` makes fresh random tensors of those shapes and strides.
Recording costs one check of a global per call when off; it is on only inside ``recording()``,
for every thread (the processors may issue steps from several).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

_lock = threading.Lock()
_recorders: list[list] = []


@dataclass(frozen=True, order=True)
class KernelCall:
    kernel: str                  # "matmul_reduce_scatter" | "all_gather_matmul"
    dim: int                     # 0 or 1 (normalized)
    op: str                      # "sum" | "avg" (matmul_reduce_scatter); "" (all_gather_matmul)
    dtype: str                   # "bfloat16", ...
    a: tuple                     # ((shape, strides), ...) per participant
    b: tuple
    device: str                  # where it ran: "cuda:0", ...

    @classmethod
    def of(cls, kernel: str, a, b, dim: int, op: str = "") -> KernelCall:
        """The call ``kernel(a, b, dim, op)`` (a and b: tensors, meta ones too: only shapes and strides are kept)."""
        return cls(kernel, dim, op, str(a[0].dtype).replace("torch.", ""),
                   tuple((tuple(x.shape), tuple(x.stride())) for x in a),
                   tuple((tuple(x.shape), tuple(x.stride())) for x in b), str(a[0].device))

    def launch(self) -> tuple[str, int, int, int, int]:
        """(launcher, M, N, K, n) as pick_config sees this call's launch (fastpipe.kernels.tuned: what each
        launcher's M, N and K are)."""
        n = len(self.a)
        widest = max(s[1] for s, _ in self.b)
        if self.kernel == "matmul_reduce_scatter":
            return "mm_sum", self.a[0][0][0], self.b[0][0][1], max(s[1] for s, _ in self.a), n
        if self.dim == 0:       # one launch for the n outputs: the widest one's [M, N], the gathered K, and n
            return "gather_rows", n * self.a[0][0][0], widest, self.a[0][0][1], n
        return "gather_cols", self.a[0][0][0], widest, sum(s[1] for s, _ in self.a), n

    def rule_shape(self) -> tuple[int, int, int, int]:
        """(M, N, K_total, n) as fastpipe.kernels.fusion_rule measures the group (the bench's terms, which
        fastpipe.runtime.passes.fuse asks in): the whole product [M, K_total] @ [K_total, N]; for
        matmul_reduce_scatter K_total sums the members' K, for all_gather_matmul N sums their widths."""
        n = len(self.a)
        widths = sum(s[1] for s, _ in self.b)
        if self.kernel == "matmul_reduce_scatter":
            return self.a[0][0][0], self.b[0][0][1], sum(s[1] for s, _ in self.a), n
        if self.dim == 0:
            return sum(s[0] for s, _ in self.a), widths, self.a[0][0][1], n
        return self.a[0][0][0], widths, sum(s[1] for s, _ in self.a), n

    def operands(self, seed: int = 0) -> tuple[list, list]:
        """Fresh random a and b of the recorded shapes and strides on the call's device (contiguous where
        strides overlap)."""
        device = torch.device(self.device)
        g = torch.Generator(device=device).manual_seed(seed)
        dtype = getattr(torch, self.dtype)

        def make(shape, stride, scale):
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device) if 0 not in stride \
                else torch.empty(shape, dtype=dtype, device=device)
            return t.copy_(torch.randn(shape, generator=g, device=device, dtype=dtype) * scale)

        k = max(s[1] for s, _ in self.a)        # every a[i] is [rows, K_i] (dim 0 gathers: all K)
        return [make(s, st, 1.0) for s, st in self.a], [make(s, st, k ** -0.5) for s, st in self.b]

    def run(self, a, b, config=None):
        from fastpipe.kernels import all_gather_matmul, matmul_reduce_scatter

        if self.kernel == "matmul_reduce_scatter":
            return matmul_reduce_scatter(a, b, dim=self.dim, op=self.op, config=config)
        return all_gather_matmul(a, b, dim=self.dim, config=config)

    def text(self) -> str:
        launcher, M, N, K, n = self.launch()
        return f"{self.kernel} dim {self.dim} ({launcher} M={M} N={N} K={K} n={n} {self.dtype})"


@contextlib.contextmanager
def recording():
    """Collect the distinct KernelCalls made (by any thread) until the block ends, in first-call order."""
    calls: list[KernelCall] = []
    with _lock:
        _recorders.append(calls)
    try:
        yield calls
    finally:
        with _lock:
            _recorders.remove(calls)


def note(kernel: str, a, b, dim: int, op: str = "") -> None:
    """Called by the public kernel functions after checking their operands (a no-op unless recording)."""
    if not _recorders:
        return
    call = KernelCall.of(kernel, a, b, dim, op)
    with _lock:
        for calls in _recorders:
            if call not in calls:
                calls.append(call)
