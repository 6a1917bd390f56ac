"""Triton helpers the GEMM-shaped kernels share: which output tile a program owns, and how a tile is
stored (``@triton.jit`` functions, inlined into each kernel that calls them; nothing here launches).

* :func:`grouped_tile` -- the grouped (L2-friendly) program order: GROUP_M row tiles run one after
  another on the same column tile, so they share its B tile in L2.
* :func:`store_tile` -- the masked store of one tile into a plain [M, N] output, or into the column
  chunks of one [n, M, N/n] buffer.
* :func:`dot_step` -- one K-step of a GEMM loop: the masked A and B tiles, multiplied into the accumulator.
* :func:`split_k_share` and :func:`steps_in_share` -- split-K over several participants' K-loops: which
  run of a tile's K-steps, counted over every participant in turn, one program sums, and which of one
  participant's steps fall in it.
* :func:`pick_output` -- the gather kernels' output j (b[j], out_j, N_j and their strides), picked from
  the argument tuples.
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

    @triton.jit
    def dot_step(acc, a_ptrs, b_ptrs, offs_k, k_left, INPUT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
        """acc + A tile @ B tile: one K-step of a GEMM loop, the [BLOCK_M, BLOCK_K] A tile and [BLOCK_K, BLOCK_N]
        B tile loaded with the K positions past ``k_left`` as zeros (DOT_F32: upcast before tl.dot, the
        interpreter's bf16; see mm_reduce_scatter_kernel.dot_f32)."""
        a_t = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b_t = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if DOT_F32:
            a_t = a_t.to(tl.float32)
            b_t = b_t.to(tl.float32)
        return tl.dot(a_t, b_t, acc, input_precision=INPUT_PRECISION)

    @triton.jit
    def split_k_share(K, NPART: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, AXIS: tl.constexpr):
        """(lo, per): the program whose id along grid axis AXIS is s (its share, of SPLIT_K) sums the K-steps
        [lo, lo + per) of a tile, lo = s * per, the steps (BLOCK_K each) counted over the NPART participants'
        K[i] in turn."""
        steps = 0
        for i in tl.static_range(NPART):
            steps += tl.cdiv(K[i], BLOCK_K)
        per = tl.cdiv(steps, SPLIT_K)
        return tl.program_id(AXIS) * per, per

    @triton.jit
    def steps_in_share(k_steps, lo, per, done):
        """(k0, k1): the steps [k0, k1) of one participant's k_steps that fall in the share [lo, lo + per),
        ``done`` being the steps of the participants before it."""
        return min(max(lo - done, 0), k_steps), min(max(lo + per - done, 0), k_steps)

    @triton.jit
    def pick_output(j, B, C, NS, SBK, SBN, SCM, SCN, NPART: tl.constexpr, SAME_OUT: tl.constexpr):
        """(b[j], out_j, N_j, b[j]'s strides, out_j's strides) from tuples of NPART (a static unroll of
        selects); with SAME_OUT every output's shape and strides are read from [0] (Triton's specialization of
        a unit stride then survives: vectorized loads)."""
        b_base, c_base = B[0], C[0]
        N, sbk, sbn, scm, scn = NS[0], SBK[0], SBN[0], SCM[0], SCN[0]
        for s in tl.static_range(1, NPART):
            b_base = tl.where(j == s, B[s], b_base)
            c_base = tl.where(j == s, C[s], c_base)
            if not SAME_OUT:
                N = tl.where(j == s, NS[s], N)
                sbk = tl.where(j == s, SBK[s], sbk)
                sbn = tl.where(j == s, SBN[s], sbn)
                scm = tl.where(j == s, SCM[s], scm)
                scn = tl.where(j == s, SCN[s], scn)
        return b_base, c_base, N, sbk, sbn, scm, scn

else:  # pragma: no cover
    grouped_tile = store_tile = dot_step = split_k_share = steps_in_share = pick_output = None
