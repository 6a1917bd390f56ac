"""What the runtime runs for a fusable group without fusion: the baseline a fused kernel must beat.

    outs = run_unfused(call, a, b, lanes)      # call: a fastpipe.kernels.calls.KernelCall; a, b: its operands

The cuda processor runs each member's compute step on its own stream (the slots' lanes, overlapping)
and the group's comm callable (fastpipe.runtime.execute.group_fn -> fastpipe.comm) after all of them:

    matmul_reduce_scatter  member i: torch.mm(a[i], b[i]) -> [M, N] partials; then
                           comm.reduce_scatter (a float32 fold, one cast, a fresh chunk per member)
    all_gather_matmul      comm.all_gather(a) (one gathered copy per member); then member j:
                           torch.mm(gathered, b[j]) -> [M, N_j]

``bench/bench_fused_kernels.py`` times it as its "unfused" variant, and ``fastpipe tune`` against the
fused kernel at a pipeline's own shapes (fastpipe.kernels.fusion_rule's points).
"""
from __future__ import annotations

import torch

from fastpipe import comm


def lanes_for(device: torch.device, n: int):
    """n streams for the members on a GPU (as the cuda processor gives each slot its own), None elsewhere."""
    device = torch.device(device)
    return [torch.cuda.Stream(device) for _ in range(n)] if device.type == "cuda" else None


def on_lanes(calls, lanes):
    """calls[i]() on lanes[i] (forked from and joined back to the current stream), as the cuda
    processor runs each slot's step on its own stream; lanes None: one after another here. Only
    inside a graph capture or before a synchronize: nothing is record_stream-ed."""
    if lanes is None:
        return [c() for c in calls]
    lanes = lanes[:len(calls)]        # only the lanes forked: joining an unforked one would wait on an
    cur = torch.cuda.current_stream()  # event outside the capture, which invalidates it
    outs = []
    for call, lane in zip(calls, lanes):
        lane.wait_stream(cur)
        with torch.cuda.stream(lane):
            outs.append(call())
    for lane in lanes:
        cur.wait_stream(lane)
    return outs


def matmul_then_reduce_scatter(a, b, dim: int, op: str = "sum", lanes=None):
    """n x ([M, K_i] @ [K_i, N]) on the lanes, then the group's reduce_scatter along dim."""
    parts = on_lanes([lambda x=x, y=y: torch.mm(x, y) for x, y in zip(a, b)], lanes)
    return comm.reduce_scatter(parts, op, dim, [x.device for x in a])


def all_gather_then_matmul(a, b, dim: int, lanes=None):
    """The group's all_gather of a along dim (one copy per member), then member j's [M, K] @ b[j] on its lane."""
    full = comm.all_gather(a, dim, [x.device for x in a])
    return on_lanes([lambda f=f, bj=bj: torch.mm(f, bj) for f, bj in zip(full, b)], lanes)


def run_unfused(call, a, b, lanes=None):
    """The unfused path of a recorded fused-kernel call (fastpipe.kernels.calls.KernelCall) on a and b."""
    if call.kernel == "matmul_reduce_scatter":
        return matmul_then_reduce_scatter(a, b, call.dim, call.op or "sum", lanes)
    return all_gather_then_matmul(a, b, call.dim, lanes)
