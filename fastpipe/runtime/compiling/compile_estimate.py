"""Whether compiling a graph can pay on the CPU: a cheap estimate made at its second (eager) call.

    reason = not_worth_compiling(gm, n_args, out_bytes)   # None: compile it; else why not

On a GPU fastpipe always compiles (fusion saves launches and memory traffic, and a replayed CUDA graph
hides the compiled call's fixed cost). On the CPU a compiled call has a fixed cost of its own (dynamo's
guards on every argument, inductor's wrapper: tens of microseconds) and what compiling saves is the
dispatch of the ops it fuses (a few microseconds each) plus the memory traffic between them (each fused
op no longer writes and re-reads an intermediate); matmuls run the same BLAS either way. So a graph of a
few ops on small tensors runs faster eagerly, and its compile (seconds to a minute) would never be paid
back. The estimate, from the graph and the sizes of its call's outputs alone (no timing: it must not
depend on what else the machine is doing):

    fusable  = call_function nodes that are neither matmuls nor views (pointwise ops, reductions,
               norms, softmax, cat, index ops: what inductor fuses)
    saved    = fusable x (DISPATCH_S + out_bytes / BANDWIDTH)   (per call; out_bytes: the largest output,
               a stand-in for the intermediates' size)
    fixed    = CALL_FIXED_S + GUARD_S x n_args                  (per compiled call)
    compile when saved > MARGIN x fixed

The estimate only decides whether to start a compile; a compiled graph is then measured against eager
on real calls and the faster kept (fastpipe.runtime.compiling.compile), so a wrong guess costs a compile, never
speed.
"""
from __future__ import annotations

import operator

import torch

DISPATCH_S = 4e-6        # eager dispatch of one small aten op on a CPU (measured: 3-6 us)
CALL_FIXED_S = 50e-6     # a compiled call's fixed cost: guards, wrapper, output allocation
GUARD_S = 0.5e-6         # per argument guarded
MARGIN = 2.0             # the saving must clearly exceed the fixed cost
BANDWIDTH = 20e9         # bytes/s a CPU core streams an intermediate at (write plus re-read avoided)

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "conv1d", "conv2d", "convolution", "_scaled_mm",
            "addbmm", "einsum", "dot", "mv", "addmv"}
_VIEWS = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze", "slice",
          "select", "alias", "detach", "as_strided", "split", "split_with_sizes", "chunk", "unbind", "flatten",
          "narrow", "contiguous", "view_as", "expand_as", "numpy_T", "unflatten", "movedim", "getitem", "size",
          "sym_size", "dim", "lift_fresh_copy"}


def _op_name(target) -> str:
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "__name__", None) or str(target)
    # aten overloads: "mm.default" -> "mm"; torch functions: "linear"
    return name.split(".")[0]


def fusable_ops(gm: torch.fx.GraphModule) -> int:
    """Nodes compiling can fuse: call_function / call_method nodes that are neither matmuls nor views."""
    n = 0
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = _op_name(node.target)
        if name not in _MATMULS and name not in _VIEWS:
            n += 1
    return n


def not_worth_compiling(gm: torch.fx.GraphModule, n_args: int, out_bytes: int) -> str | None:
    """None when compiling `gm` may pay on the CPU (by the module's estimate); else the reason, one phrase.
    n_args: the arguments a compiled call guards; out_bytes: the size of its call's largest output."""
    fusable = fusable_ops(gm)
    if fusable == 0:
        return "nothing to fuse (matmuls and views only)"
    saved = fusable * (DISPATCH_S + out_bytes / BANDWIDTH)
    fixed = CALL_FIXED_S + GUARD_S * n_args
    if saved > MARGIN * fixed:
        return None
    return f"{fusable} fusable ops would save ~{saved * 1e6:.0f} us a call, a compiled call costs ~{fixed * 1e6:.0f} us"
