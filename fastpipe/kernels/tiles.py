"""Triton helpers the GEMM-shaped kernels share: which output tile a program owns, and how a tile is
stored (``@triton.jit`` functions, inlined into each kernel that calls them; nothing here launches).

* :func:`grouped_tile` -- the grouped (L2-friendly) program order: GROUP_M row tiles run one after
  another on the same column tile, so they share its B tile in L2.
* :func:`store_tile` -- the masked store of one tile into a plain [M, N] output, or into the column
  chunks of one [n, M, N/n] buffer.
"""
from __future__ import annotations

try:  # Triton is optional (see mm_reduce_scatter_kernel)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None

if triton is not None:

    @triton.jit
    def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """(row tile, column tile) of tile number ``pid`` of a num_pid_m x num_pid_n grid of tiles,
        in groups of GROUP_M row tiles that go through every column tile together."""
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m
        return pid_m, pid_n

    @triton.jit
    def store_tile(C, vals, offs_cm, offs_cn, M, N, stride_cm, stride_cn, chunk_n, stride_cj,
                   SPLIT_COLS: tl.constexpr):
        """C[offs_cm, offs_cn] <- vals (masked to M x N): element (r, c) at ``r*stride_cm + c*stride_cn``
        (a plain [M, N] output, or the row chunks of one [n, M/n, N] buffer, which is the same thing),
        or, with SPLIT_COLS, chunk ``j = c // chunk_n`` at ``j*stride_cj + r*stride_cm +
        (c - j*chunk_n)*stride_cn`` (the column chunks of one [n, M, N/n] buffer)."""
        mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
        rows = offs_cm.to(tl.int64)[:, None] * stride_cm
        if SPLIT_COLS:
            j = offs_cn // chunk_n
            cols = j.to(tl.int64) * stride_cj + (offs_cn - j * chunk_n).to(tl.int64) * stride_cn
        else:
            cols = offs_cn.to(tl.int64) * stride_cn
        tl.store(C + (rows + cols[None, :]), vals, mask=mask)

else:  # pragma: no cover
    grouped_tile = store_tile = None
