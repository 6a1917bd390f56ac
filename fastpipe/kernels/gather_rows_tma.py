"""The gather_rows launcher's persistent TMA kernel: all_gather_matmul with dim 0, ``out_j = cat(a; 0) @ b[j]``.

``_gather_rows_kernel`` (all_gather_mm_kernel) reads each tile's rows from the shard that holds them
with per-thread loads. This kernel loads its tiles with TMA, as ``mm_sum_tma`` does for the mm_sum
launcher, but its operands are chosen at run time: which shard a tile's rows come from, and which
output j it belongs to. A host-side descriptor cannot be picked from a tuple at run time, so each
program builds its two descriptors on the device (``tl.make_tensor_descriptor`` over the pointer it
selected; Triton writes each into a 128-byte scratch slot per program, which the launcher
allocates through ``triton.set_allocator``, set only inside the launch's own context).

So that a program builds them once, the grid is split into n x n blocks, one per (shard s, output
j): the block computes ``out_j[s * M_i : (s + 1) * M_i] = a[s] @ b[j]`` (an [M_i, N_j] product), and
its programs take that product's tiles in turn, in the grouped order. The n x n blocks get equal
shares of the SMs (the grid is the largest multiple of n x n up to the SM count, or fewer where the
blocks have fewer tiles). A shard's last row tile may run past its M_i rows: TMA reads zeros there,
and the store is masked to the shard's rows, so M_i need not be a multiple of BLOCK_M.

Layouts and alignment are ``mm_sum_tma``'s (``tma_problem``): every a[i] row-major, every b[j]
row-major or every one column-major (``w.t()``), 16-byte aligned pointers and leading strides. The
heuristic never picks it: ``KernelConfig.tma`` comes from a table measured on the GPU (``--tune``
times it on Hopper) or from the caller. Under ``TRITON_INTERPRET=1`` it runs on CPU tensors.
"""
from __future__ import annotations

import contextvars
from collections.abc import Sequence

import torch
from torch import Tensor

from fastpipe.kernels.launch_config import KernelConfig
from fastpipe.kernels.mm_sum_tma import b_layout, tma_problem

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None

__all__ = ["launch_gather_rows_tma", "gather_rows_tma_problem"]


if triton is not None and hasattr(tl, "make_tensor_descriptor"):
    from fastpipe.kernels.tiles import grouped_tile, store_tile

    @triton.jit
    def _gather_rows_tma_kernel(
        A, SAM,                  # tuples of NPART: shard pointers [M_SHARD, K] (row-major) and their row strides
        B, SB,                   # tuples of NPART: b[j] -> [K, N_j] and its leading stride (B_KMAJOR: b[j].T's)
        C, SCM, SCN,             # tuples of NPART: out_j -> [NPART * M_SHARD, N_j] and its strides
        NS,                      # tuple of NPART: N_j
        M_SHARD, K,              # K > 0
        num_programs,            # the grid's size: a multiple of NPART * NPART
        NPART: tl.constexpr,
        B_KMAJOR: tl.constexpr,  # b[j] is column-major: its descriptor is over b[j].T [N_j, K], boxes transposed
        INPUT_PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,   # interpreter + bf16 only (see mm_reduce_scatter_kernel.dot_f32)
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """Block (s, j) = program_id % NPART**2: out_j[rows of shard s] = a[s] @ b[j], its tiles taken by the
        block's programs in turn. Both descriptors are built once per program."""
        pid = tl.program_id(0)
        block = pid % (NPART * NPART)
        s = block // NPART
        j = block % NPART
        # this block's shard, weight and output, picked from the tuples (static unroll)
        a_base, sam = A[0], SAM[0]
        b_base, sb, c_base, scm, scn, N = B[0], SB[0], C[0], SCM[0], SCN[0], NS[0]
        for t in tl.static_range(1, NPART):
            a_base = tl.where(s == t, A[t], a_base)
            sam = tl.where(s == t, SAM[t], sam)
            b_base = tl.where(j == t, B[t], b_base)
            sb = tl.where(j == t, SB[t], sb)
            c_base = tl.where(j == t, C[t], c_base)
            scm = tl.where(j == t, SCM[t], scm)
            scn = tl.where(j == t, SCN[t], scn)
            N = tl.where(j == t, NS[t], N)
        a_desc = tl.make_tensor_descriptor(a_base, shape=[M_SHARD, K], strides=[sam, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        if B_KMAJOR:
            b_desc = tl.make_tensor_descriptor(b_base, shape=[N, K], strides=[sb, 1], block_shape=[BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(b_base, shape=[K, N], strides=[sb, 1], block_shape=[BLOCK_K, BLOCK_N])
        c_shard = c_base + (s * M_SHARD).to(tl.int64) * scm          # out_j's row block of shard s

        num_pid_m = tl.cdiv(M_SHARD, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        per_block = num_programs // (NPART * NPART)
        for tile in range(pid // (NPART * NPART), num_pid_m * num_pid_n, per_block):
            pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                a_t = a_desc.load([off_m, k * BLOCK_K])                   # [BLOCK_M, BLOCK_K]
                if B_KMAJOR:
                    b_t = b_desc.load([off_n, k * BLOCK_K]).T             # [BLOCK_N, BLOCK_K] -> [BLOCK_K, BLOCK_N]
                else:
                    b_t = b_desc.load([k * BLOCK_K, off_n])               # [BLOCK_K, BLOCK_N]
                if DOT_F32:
                    a_t = a_t.to(tl.float32)
                    b_t = b_t.to(tl.float32)
                acc = tl.dot(a_t, b_t, acc, input_precision=INPUT_PRECISION)
            offs_cm = off_m + tl.arange(0, BLOCK_M)                        # rows within the shard
            offs_cn = off_n + tl.arange(0, BLOCK_N)
            store_tile(c_shard, acc.to(C[0].dtype.element_ty), offs_cm, offs_cn, M_SHARD, N, scm, scn, 1, 0, False)

else:  # pragma: no cover
    _gather_rows_tma_kernel = None


def gather_rows_tma_problem(a: Sequence[Tensor], b: Sequence[Tensor], device: torch.device) -> str | None:
    """Why this kernel cannot load these operands here, or None. a[i]: [M_i, K], b[j]: [K, N_j]."""
    if _gather_rows_tma_kernel is None:
        return "this triton has no device-side tensor descriptors (tl.make_tensor_descriptor, Triton >= 3.4)"
    return tma_problem(a, b, device)


def _scratch_on(device: torch.device):
    """Triton's allocator protocol: the descriptors' scratch, from torch's caching allocator on ``device``
    (inside a captured CUDA graph, from the graph's pool)."""
    def allocate(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=device)
    return allocate


def launch_gather_rows_tma(a: Sequence[Tensor], b: Sequence[Tensor], outs: Sequence[Tensor], cfg: KernelConfig,
                           *, input_precision: str, dot_f32: bool, sms: int) -> bool:
    """Launch ``_gather_rows_tma_kernel`` (gather_rows_tma_problem is None; the current device is the outputs').
    Returns False, launching nothing, where K is 0 (the caller's kernel writes the zeros)."""
    ms, K = a[0].shape
    if K == 0:
        return False
    n = len(a)
    blocks = n * n
    tiles = triton.cdiv(ms, cfg.block_m) * triton.cdiv(max(int(o.shape[1]) for o in outs), cfg.block_n)
    programs = blocks * max(1, min(tiles, sms // blocks))
    kmajor = b_layout(b) == "cols"
    args = (tuple(a), tuple(x.stride(0) for x in a),
            tuple(b), tuple(x.stride(1) if kmajor else x.stride(0) for x in b),
            tuple(outs), tuple(o.stride(0) for o in outs), tuple(o.stride(1) for o in outs),
            tuple(int(o.shape[1]) for o in outs), ms, K, programs)
    meta = dict(NPART=n, B_KMAJOR=kmajor, INPUT_PRECISION=input_precision, DOT_F32=dot_f32,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def launch():
        # the allocator is a context variable: set in a copy of the caller's context, it never leaks
        triton.set_allocator(_scratch_on(outs[0].device))
        _gather_rows_tma_kernel[(programs,)](*args, **meta)

    contextvars.copy_context().run(launch)
    return True
