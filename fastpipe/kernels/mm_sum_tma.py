"""The mm_sum launcher's persistent TMA kernel: ``out <- scale * sum_i a[i] @ b[i]`` on Hopper and newer.

``_mm_sum_kernel`` (mm_reduce_scatter_kernel) gives each output tile a program, and every thread
computes the addresses of its share of each A and B tile and loads it (``cp.async``, pipelined over
``num_stages``). This kernel is the other way Hopper GEMMs are written:

* **TMA loads.** Each operand is described once, on the host, by a tensor descriptor (a
  ``triton.tools.tensor_descriptor.TensorDescriptor``: base, shape, strides, and the tile's box).
  A tile load is then one instruction (``cp.async.bulk.tensor``) that the tensor memory accelerator
  carries out, copying the box into shared memory with the layout wgmma reads, and padding with
  zeros past the operand's edge: no address arithmetic in registers, no masks, no wrapped rows.
* **Persistent.** The grid has one program per SM (fewer when there are fewer tiles); program p
  takes tiles p, p + programs, ... in the grouped order of ``tiles.grouped_tile``, so a tile's
  set-up and the pipeline's prologue overlap the previous tile's tail, and no wave of programs
  leaves SMs idle at its end.

Layouts: ``a[i]: [M, K_i]`` row-major (unit K stride); ``b[i]: [K_i, N]`` either row-major, or
column-major (``w.t()`` of a [N, K_i] weight, the usual case: the box is taken from w and transposed
in shared memory, which wgmma reads either way). Every participant's b must have the same layout.
TMA also needs 16-byte aligned base pointers and leading strides. :func:`tma_problem` says why a
call's operands do not qualify; the launcher (``mm_reduce_scatter_kernel.launch_mm_sum``) then
refuses a config passed explicitly, or runs a tuned config's tiles with pointer loads, with a
warning. Participants with K_i = 0 add nothing and are left out (TMA has no empty boxes).

The output is stored as ``_mm_sum_kernel`` stores it (``tiles.store_tile``: a plain [M, N] tensor
of any strides, or the column chunks of [n, M, N/n]), so the two kernels compute the same thing with
the same float32 accumulation, tile by tile in the same K order. The heuristic (``pick_config``)
never picks this kernel: ``KernelConfig.tma`` comes from a table of configs measured on the GPU
(``bench/bench_fused_kernels.py --tune`` times TMA candidates on Hopper), so it runs only where it
was measured faster. Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (the tests).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

try:  # Triton is optional, and host-side tensor descriptors came with Triton 3.3
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - exercised only on machines without (a recent) triton
    triton = TensorDescriptor = None

from fastpipe.kernels.launch_config import KernelConfig

__all__ = ["device_problem", "launch_tma", "tma_problem"]

TMA_MIN_CAPABILITY = (9, 0)
MAX_DESCRIPTORS = 8      # participants (mm_reduce_scatter_kernel.MAX_PARTICIPANTS): the kernel's A0..A7, B0..B7
_ALIGN = 16   # bytes: a TMA descriptor's base address and every stride but the last


if TensorDescriptor is not None:
    from fastpipe.kernels.tiles import grouped_tile, store_tile

    @triton.jit
    def _mm_sum_tma_kernel(
        # the tensor descriptors, one argument each (Triton 3.6's launcher encodes a descriptor only as a
        # top-level argument, not inside a tuple); those past NPART are None:
        A0, A1, A2, A3, A4, A5, A6, A7,  # A_i over a[i] [M, K_i] (box BLOCK_M x BLOCK_K)
        B0, B1, B2, B3, B4, B5, B6, B7,  # B_i over b[i] [K_i, N] (box BLOCK_K x BLOCK_N), or with
                                         # B_KMAJOR over b[i].T [N, K_i] (box BLOCK_N x BLOCK_K)
        K,                       # tuple of NPART ints: K_i (each > 0)
        C,                       # output buffer, dtype of the result
        M, N,
        stride_cm, stride_cn,    # output strides within one chunk
        chunk_n, stride_cj,      # SPLIT_COLS: columns per chunk, and the distance between chunks
        scale,                   # APPLY_SCALE: multiply the fp32 sum by this (1/n for avg)
        num_programs,            # the grid's size: program p takes tiles p, p + num_programs, ...
        NPART: tl.constexpr,
        B_KMAJOR: tl.constexpr,  # b[i] is column-major: its descriptor is over b[i].T, boxes transposed on use
        SPLIT_COLS: tl.constexpr,
        APPLY_SCALE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,   # interpreter + bf16 only (see mm_reduce_scatter_kernel.dot_f32)
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """For each tile this program takes: C[tile] = scale * sum_i A[i][rows, :] @ B[i][:, cols], written
        once (``store_tile``). Boxes past an operand's edge read zeros (TMA's padding), so the K tail and
        the last row and column tiles need no masks."""
        A = (A0, A1, A2, A3, A4, A5, A6, A7)
        B = (B0, B1, B2, B3, B4, B5, B6, B7)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        for tile in range(tl.program_id(0), num_pid_m * num_pid_n, num_programs):
            pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in tl.static_range(NPART):  # every participant's K-slices, one accumulator
                for k in range(0, tl.cdiv(K[i], BLOCK_K)):
                    a_t = A[i].load([off_m, k * BLOCK_K])                 # [BLOCK_M, BLOCK_K]
                    if B_KMAJOR:
                        b_t = B[i].load([off_n, k * BLOCK_K]).T           # [BLOCK_N, BLOCK_K] -> [BLOCK_K, BLOCK_N]
                    else:
                        b_t = B[i].load([k * BLOCK_K, off_n])             # [BLOCK_K, BLOCK_N]
                    if DOT_F32:
                        a_t = a_t.to(tl.float32)
                        b_t = b_t.to(tl.float32)
                    acc = tl.dot(a_t, b_t, acc, input_precision=INPUT_PRECISION)
            if APPLY_SCALE:
                acc = acc * scale
            offs_cm = off_m + tl.arange(0, BLOCK_M)
            offs_cn = off_n + tl.arange(0, BLOCK_N)
            store_tile(C, acc.to(C.dtype.element_ty), offs_cm, offs_cn, M, N, stride_cm, stride_cn,
                       chunk_n, stride_cj, SPLIT_COLS)

else:  # pragma: no cover
    _mm_sum_tma_kernel = None


def b_layout(b: Sequence[Tensor]) -> str | None:
    """"rows" when every b[i] is row-major (unit N stride), "cols" when every one is column-major (unit
    K stride: ``w.t()``), else None. A matrix that is both (one row or one column) goes with the others."""
    if all(x.stride(1) == 1 for x in b):
        return "rows"
    if all(x.stride(0) == 1 for x in b):
        return "cols"
    return None


def device_problem(device: torch.device) -> str | None:
    """Why the TMA kernel cannot run on this device, or None: a CUDA device of compute capability 9.0
    or newer, with a triton that has host-side tensor descriptors (or any device under the interpreter,
    which the launcher checks)."""
    if TensorDescriptor is None:
        return "this triton has no host-side tensor descriptors (triton.tools.tensor_descriptor, Triton >= 3.3)"
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < TMA_MIN_CAPABILITY:
            return (f"TMA needs compute capability {TMA_MIN_CAPABILITY[0]}.{TMA_MIN_CAPABILITY[1]} or newer "
                    f"(Hopper), and {torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}")
    return None


def tma_problem(a: Sequence[Tensor], b: Sequence[Tensor], device: torch.device) -> str | None:
    """Why TMA descriptors cannot load these operands here, or None where they can.

    a[i]: [M, K_i], b[i]: [K_i, N], one dtype, all on ``device`` (already validated by the launcher).
    """
    why = device_problem(device)
    if why is not None:
        return why
    size = a[0].element_size()
    for i, x in enumerate(a):
        if x.shape[1] > 0 and x.stride(1) != 1 and x.shape[1] != 1:
            return f"a[{i}] is not row-major (strides {tuple(x.stride())}; TMA needs a unit stride along K)"
    layout = b_layout(b)
    if layout is None:
        return ("the b[i] are neither all row-major nor all column-major (strides "
                f"{[tuple(x.stride()) for x in b]}; TMA needs a unit stride along N, or along K for all)")
    lead = [("a", i, x, x.stride(0)) for i, x in enumerate(a)]
    lead += [("b", i, x, x.stride(0) if layout == "rows" else x.stride(1)) for i, x in enumerate(b)]
    for name, i, x, stride in lead:
        if x.numel() == 0:
            continue
        if x.data_ptr() % _ALIGN:
            return f"{name}[{i}]'s data pointer is not a multiple of {_ALIGN} bytes (TMA's alignment)"
        if (stride * size) % _ALIGN:
            return (f"{name}[{i}]'s leading stride, {stride} elements of {size} bytes, is not a multiple of "
                    f"{_ALIGN} bytes (TMA's alignment)")
    return None


def _descriptors(a: Sequence[Tensor], b: Sequence[Tensor], cfg: KernelConfig, layout: str) -> tuple[tuple, tuple]:
    """The TMA descriptors of every participant's a[i] [M, K_i] and b[i] (as [K_i, N], or its transpose)."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    ad = tuple(TensorDescriptor(x, [x.shape[0], x.shape[1]], [x.stride(0), 1], [bm, bk]) for x in a)
    if layout == "rows":
        bd = tuple(TensorDescriptor(x, [x.shape[0], x.shape[1]], [x.stride(0), 1], [bk, bn]) for x in b)
    else:   # the descriptor is over the [N, K_i] matrix whose transpose b[i] is
        bd = tuple(TensorDescriptor(x, [x.shape[1], x.shape[0]], [x.stride(1), 1], [bn, bk]) for x in b)
    return ad, bd


def launch_tma(a: Sequence[Tensor], b: Sequence[Tensor], out: Tensor, cfg: KernelConfig, out_args: tuple,
               *, split_cols: bool, scale: bool, input_precision: str, dot_f32: bool, sms: int) -> bool:
    """Launch ``_mm_sum_tma_kernel`` (tma_problem(a, b) is None; the current device is out's). ``out_args``:
    (M, N, stride_cm, stride_cn, chunk_n, stride_cj, scale) as ``_mm_sum_kernel`` takes them. Returns
    False, launching nothing, when no participant has K_i > 0 (the caller's kernel writes the zeros)."""
    parts = [(x, y) for x, y in zip(a, b) if x.shape[1] > 0]
    if not parts:
        return False
    a, b = [x for x, _ in parts], [y for _, y in parts]
    layout = b_layout(b)
    ad, bd = _descriptors(a, b, cfg, layout)
    M, N = out_args[0], out_args[1]
    programs = min(triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), sms)
    unused = (None,) * (MAX_DESCRIPTORS - len(a))
    _mm_sum_tma_kernel[(programs,)](
        *ad, *unused, *bd, *unused, tuple(int(x.shape[1]) for x in a), out, *out_args, programs,
        NPART=len(a), B_KMAJOR=layout == "cols", SPLIT_COLS=split_cols, APPLY_SCALE=scale,
        INPUT_PRECISION=input_precision, DOT_F32=dot_f32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return True
