"""Fused all_gather + matmul: ``out_j = cat(a_0, ..., a_{n-1}; dim) @ b[j]`` without the cat.

Tensor parallelism starts a column-parallel linear layer after a sequence-parallel region
with exactly this: participant i holds a shard ``a[i]`` of the activations, every
participant needs the whole activation times its own weight columns ``b[j]``. The story:

1. :func:`all_gather_matmul_reference` -- plain torch, the oracle, with the traffic of the
   unfused path (gather, then matmul) counted.
2. ``_gather_rows_kernel`` (dim 0) -- the ``@triton.jit`` kernel: a tile's rows are read
   straight from the shard that holds them (a tile may span shards when M_i is not a
   multiple of BLOCK_M; each row picks its own shard's pointer), and one launch computes
   every output j (the grid's axis 1). ``_gather_cols_kernel`` (dim 1, shards along K): a
   tile's K-loop runs over every shard's K-slice in turn, each multiplied by the rows of
   ``b[j]`` that match it, into one float32 accumulator; one launch computes every output j
   too (the grid's axis 1).
3. :func:`all_gather_matmul` -- the launcher: validates, picks block sizes, one launch for
   the n outputs. A config with ``tma`` runs dim 0 on :mod:`fastpipe.kernels.gather_rows_tma`,
   and dim 1 on ``mm_sum_tma``, once per output (``b[j]`` cut into row slices: views),
   Hopper's TMA loads.
4. :func:`all_gather_matmul_overlapped` -- for participants on different GPUs: participant
   j starts with its own shard and multiplies each other shard as it arrives (ring order),
   the copy of the next shard overlapping the current GEMM.

Shapes: dim 0 -- ``a[i]: [M_i, K]`` (equal M_i), ``b[j]: [K, N_j]``, ``out_j: [n*M_i, N_j]``;
dim 1 (or -1) -- ``a[i]: [M, K_i]`` (K_i may differ), ``b[j]: [sum K_i, N_j]``,
``out_j: [M, N_j]``. N_j may differ between participants. dtypes float32, bfloat16,
float16; float32 accumulation, output in the input dtype.

A change here that can change the kernel's speed bumps its revision in
``fastpipe.kernels.fusion_rule.KERNEL_REVISIONS`` (with a line in ``REVISION_CHANGES``): the
fusion rule's measured points then say they timed an older kernel.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fastpipe.kernels import calls, gather_rows_tma, mm_sum_tma
from fastpipe.kernels.mm_reduce_scatter_kernel import (
    KernelConfig,
    _input_precision,
    _norm_dim,
    _num_sms,
    _require_launchable,
    _Transfers,
    check_devices,
    check_group,
    device_guard,
    dot_f32,
    launch_mm_sum,
    mm_f32,
    pick_config,
    tl,
    triton,
    use_tma,
)
from fastpipe.kernels.tiles import dot_step, grouped_tile, pick_output, split_k_share, steps_in_share, store_tile

__all__ = ["all_gather_matmul", "all_gather_matmul_overlapped", "all_gather_matmul_reference"]


# ---------------------------------------------------------------------------
# 1. reference
# ---------------------------------------------------------------------------

def all_gather_matmul_reference(a: Sequence[Tensor], b: Sequence[Tensor], dim: int = 0) -> list[Tensor]:
    """[cat(a; dim) @ b[j] for j] in plain torch: float32 products, one cast; on b[j]'s device.

    Memory traffic of the unfused path (element size s, A = cat(a) of M x K elements),
    per output j, of which the fused kernel keeps only the last two lines::

        gather: read the shards, write A     2 * s * M*K   (once per participant in a real group)
        read A and b[j]                      s * (M*K + K*N_j)
        write out_j                          s * M*N_j
    """
    what = "all_gather_matmul_reference"
    dim, M, K, ns = _check_operands(what, a, b, dim, same_device=False)
    outs = []
    for bj in b:
        full = torch.cat([x.to(bj.device, torch.float32) for x in a], dim=dim)
        outs.append((full @ bj.to(torch.float32)).to(bj.dtype))
    return outs


# ---------------------------------------------------------------------------
# 2. the kernels (dim 0: gather_rows; dim 1: gather_cols; their split-K shares' sum)
# ---------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _store_gathered(acc, W, c_base, j, pid_m, pid_n, M, N, N_MAX, scm, scn,
                        SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """A gather kernel's tile (pid_m, pid_n) of output j: its float32 share into W[j, s] (SPLIT_K > 1: W a
        row-major [NPART, SPLIT_K, M, N_MAX] float32 workspace, s = program_id(2)), else rounded once into
        out_j (c_base, strides scm, scn), masked to M x N."""
        offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if SPLIT_K > 1:   # W[j, s] is a row-major [M, N_MAX] float32 plane
            plane = W + (j * SPLIT_K + tl.program_id(2)).to(tl.int64) * M * N_MAX
            store_tile(plane, acc, offs_cm, offs_cn, M, N, N_MAX, 1, 1, 0, False)
        else:
            c_t = acc.to(c_base.dtype.element_ty)
            c_ptrs = c_base + (offs_cm.to(tl.int64)[:, None] * scm + offs_cn.to(tl.int64)[None, :] * scn)
            tl.store(c_ptrs, c_t, mask=(offs_cm[:, None] < M) & (offs_cn[None, :] < N))

    @triton.jit
    def _gather_rows_kernel(
        A, SAM, SAK,             # tuples of NPART: shard pointers [M_SHARD, K] and their strides
        B, SBK, SBN,             # tuples of NPART: b[j] -> [K, N_j] and its strides
        C, SCM, SCN,             # tuples of NPART: out_j -> [NPART * M_SHARD, N_j] and its strides
        NS,                      # tuple of NPART: N_j
        W,                       # SPLIT_K > 1: float32 workspace [NPART, SPLIT_K, M, N_MAX] (else unused)
        M_SHARD, K, N_MAX,
        NPART: tl.constexpr,
        SPLIT_K: tl.constexpr,   # programs per output tile (grid axis 2), each a share of the K-steps
        SAME_SAK: tl.constexpr,  # every shard has the same K stride (then loads vectorize along K)
        SAME_OUT: tl.constexpr,  # every b[j] and out_j have the same N_j and strides (read from [0], so
                                 # Triton's specialization of a stride of 1 survives: vectorized loads)
        ROW_ALIGN: tl.constexpr, # bytes every row start is a multiple of (16, or 1: unknown)
        INPUT_PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,   # interpreter + bf16 only (see mm_reduce_scatter_kernel.dot_f32)
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """out_j[tile] = cat(A; 0)[rows] @ B[j][:, cols]; j = program_id(1), row r from shard r // M_SHARD.

        One launch covers every output: axis 1 of the grid is j, axis 0 the tiles of an
        [M, max N_j] output (programs past their own N_j return at once). With SPLIT_K > 1,
        program (tile, j, s) sums the s-th of SPLIT_K equal runs of the tile's K-steps into
        W[j, s]; ``_gather_split_k_sum_kernel`` then adds the shares and writes the tiles."""
        j = tl.program_id(1)
        # this program's output: b[j], out_j and their shape
        b_base, c_base, N, sbk, sbn, scm, scn = pick_output(j, B, C, NS, SBK, SBN, SCM, SCN, NPART, SAME_OUT)

        M = M_SHARD * NPART
        num_pid_m = tl.cdiv(M, BLOCK_M)
        # the grid's column tiles: of the largest N_j
        pid_m, pid_n = grouped_tile(tl.program_id(0), num_pid_m, tl.num_programs(0) // num_pid_m, GROUP_M)
        if pid_n * BLOCK_N >= N:   # past this output's columns (only where the N_j differ)
            return

        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # wrapped: loads need no row mask
        shard = rows // M_SHARD
        local = (rows - shard * M_SHARD).to(tl.int64)
        # each row's base pointer in its own shard
        a_rows = A[0] + local * SAM[0]
        for s in tl.static_range(1, NPART):
            a_rows = tl.where(shard == s, A[s] + local * SAM[s], a_rows)
        if ROW_ALIGN > 1:
            # a select loses the pointers' alignment; without it loads are not vectorized
            # and not pipelined (cp.async needs >= 4-byte pieces). The launcher checked it.
            a_rows = tl.multiple_of(a_rows, ROW_ALIGN)
        offs_k = tl.arange(0, BLOCK_K)
        if SAME_SAK:
            a_ptrs = a_rows[:, None] + offs_k[None, :] * SAK[0]
            a_step = BLOCK_K * SAK[0]
        else:
            sak = tl.zeros((BLOCK_M,), dtype=tl.int64) + SAK[0]
            for s in tl.static_range(1, NPART):
                sak = tl.where(shard == s, SAK[s], sak)
            a_ptrs = a_rows[:, None] + offs_k[None, :] * sak[:, None]
            a_step = BLOCK_K * sak[:, None]
        offs_bn = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
        b_ptrs = b_base + (offs_k[:, None] * sbk + offs_bn[None, :] * sbn)
        if SPLIT_K > 1:   # this program's run [k0, k1) of the tile's K-steps
            per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
            k0 = tl.program_id(2) * per
            k1 = min(k0 + per, tl.cdiv(K, BLOCK_K))
            a_ptrs += k0 * a_step
            b_ptrs += k0 * BLOCK_K * sbk
        else:
            k0 = 0
            k1 = tl.cdiv(K, BLOCK_K)

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k0, k1):
            k_left = K - k * BLOCK_K
            acc = dot_step(acc, a_ptrs, b_ptrs, offs_k, k_left, INPUT_PRECISION, DOT_F32)
            a_ptrs += a_step
            b_ptrs += BLOCK_K * sbk

        _store_gathered(acc, W, c_base, j, pid_m, pid_n, M, N, N_MAX, scm, scn, SPLIT_K, BLOCK_M, BLOCK_N)

    @triton.jit
    def _gather_cols_kernel(
        A, SAM, SAK,             # tuples of NPART: shard pointers [M, K_i] and their strides
        KS, KOFF,                # tuples of NPART: K_i, and the row of b[j] where shard i's K-slice starts
        B, SBK, SBN,             # tuples of NPART: b[j] -> [sum K_i, N_j] and its strides
        C, SCM, SCN,             # tuples of NPART: out_j -> [M, N_j] and its strides
        NS,                      # tuple of NPART: N_j
        W,                       # SPLIT_K > 1: float32 workspace [NPART, SPLIT_K, M, N_MAX] (else unused)
        M, N_MAX,
        NPART: tl.constexpr,
        SPLIT_K: tl.constexpr,   # programs per output tile (grid axis 2), each a share of the K-steps
        SAME_OUT: tl.constexpr,  # every b[j] and out_j have the same N_j and strides (read from [0])
        INPUT_PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,   # interpreter + bf16 only (see mm_reduce_scatter_kernel.dot_f32)
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """out_j[tile] = sum_i A[i][rows, :] @ B[j][KOFF[i]:KOFF[i] + K_i, cols]; j = program_id(1).

        One launch covers every output: axis 1 of the grid is j, axis 0 the tiles of an
        [M, max N_j] output (programs past their own N_j return at once). A tile's K-loop runs over
        every shard's K-steps in turn (BLOCK_K each, shard 0 first), one float32 accumulator. With
        SPLIT_K > 1, program (tile, j, s) sums the s-th of SPLIT_K equal runs of those steps into
        W[j, s]; ``_gather_split_k_sum_kernel`` then adds the shares and writes the tiles."""
        j = tl.program_id(1)
        # this program's output: b[j], out_j and their shape
        b_base, c_base, N, sbk, sbn, scm, scn = pick_output(j, B, C, NS, SBK, SBN, SCM, SCN, NPART, SAME_OUT)

        num_pid_m = tl.cdiv(M, BLOCK_M)
        # the grid's column tiles: of the largest N_j
        pid_m, pid_n = grouped_tile(tl.program_id(0), num_pid_m, tl.num_programs(0) // num_pid_m, GROUP_M)
        if pid_n * BLOCK_N >= N:   # past this output's columns (only where the N_j differ)
            return

        # rows/cols wrap (% M, % N) so loads need no M/N mask; the store masks them
        offs_am = ((pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M).to(tl.int64)
        offs_bn = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        if SPLIT_K > 1:   # this program's run [lo, lo + per) of the tile's K-steps, counted over all shards
            lo, per = split_k_share(KS, NPART, BLOCK_K, SPLIT_K, 2)
            done = 0      # the steps of the shards before i
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in tl.static_range(NPART):  # every shard's K-slice, one accumulator
            if SPLIT_K > 1:
                k_steps = tl.cdiv(KS[i], BLOCK_K)
                k0, k1 = steps_in_share(k_steps, lo, per, done)
                done += k_steps
            else:
                k0 = 0
                k1 = tl.cdiv(KS[i], BLOCK_K)
            a_ptrs = A[i] + (offs_am[:, None] * SAM[i] + (offs_k[None, :] + k0 * BLOCK_K) * SAK[i])
            b_rows = (KOFF[i] + k0 * BLOCK_K + offs_k).to(tl.int64)        # b[j]'s rows of this K-step
            b_ptrs = b_base + (b_rows[:, None] * sbk + offs_bn[None, :] * sbn)
            for k in range(k0, k1):
                k_left = KS[i] - k * BLOCK_K
                acc = dot_step(acc, a_ptrs, b_ptrs, offs_k, k_left, INPUT_PRECISION, DOT_F32)
                a_ptrs += BLOCK_K * SAK[i]
                b_ptrs += BLOCK_K * sbk

        _store_gathered(acc, W, c_base, j, pid_m, pid_n, M, N, N_MAX, scm, scn, SPLIT_K, BLOCK_M, BLOCK_N)

    @triton.jit
    def _gather_split_k_sum_kernel(
        W, C, SCM, SCN, NS,      # the shares [NPART, SPLIT_K, M, N_MAX]; tuples of NPART: out_j, strides, N_j
        M, N_MAX,
        NPART: tl.constexpr, SPLIT_K: tl.constexpr, SAME_OUT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """out_j[tile] = sum_s W[j, s][tile], the shares added in order s = 0, 1, ... (deterministic), rounded
        once to out_j's dtype; j = program_id(2), so one launch writes every output."""
        j = tl.program_id(2)
        c_base = C[0]
        N, scm, scn = NS[0], SCM[0], SCN[0]
        for s in tl.static_range(1, NPART):
            c_base = tl.where(j == s, C[s], c_base)
            if not SAME_OUT:
                N = tl.where(j == s, NS[s], N)
                scm = tl.where(j == s, SCM[s], scm)
                scn = tl.where(j == s, SCN[s], scn)
        if tl.program_id(1) * BLOCK_N >= N:   # past this output's columns
            return
        offs_cm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_cn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
        rows = offs_cm.to(tl.int64)
        planes = W + j.to(tl.int64) * SPLIT_K * M * N_MAX
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(planes + ((rows + s * M)[:, None] * N_MAX + offs_cn[None, :]), mask=mask, other=0.0)
        c_ptrs = c_base + (rows[:, None] * scm + offs_cn.to(tl.int64)[None, :] * scn)
        tl.store(c_ptrs, acc.to(C[0].dtype.element_ty), mask=mask)

else:  # pragma: no cover
    _store_gathered = _gather_rows_kernel = _gather_cols_kernel = _gather_split_k_sum_kernel = None


# ---------------------------------------------------------------------------
# 3. launcher
# ---------------------------------------------------------------------------

def launch_gather_rows(a: Sequence[Tensor], b: Sequence[Tensor], outs: Sequence[Tensor],
                       config: KernelConfig | None = None) -> None:
    """outs[j] <- cat(a; 0) @ b[j] for every j, in ONE launch (operands already validated).

    a[i]: [M_i, K]; b[j]: [K, N_j]; outs[j]: [n*M_i, N_j], any strides. The grid's axis 1 is j, so
    the n outputs' tiles share the GPU's SMs at once (n launches one after another would each
    leave most SMs idle at a decode's M, and wait for the previous one)."""
    what = "all_gather_matmul"
    _require_launchable(what, outs[0].device)
    ms, K = a[0].shape
    M = outs[0].shape[0]
    nmax = max(int(o.shape[1]) for o in outs)
    if M == 0 or nmax == 0:
        return
    # pick_config sees one output's [M, max N_j] and n: the grid holds n of them (see its docstring)
    cfg = config or pick_config(M, nmax, K, b[0].dtype, outs[0].device, launcher="gather_rows", n=len(a))
    if cfg.tma and use_tma(gather_rows_tma.gather_rows_tma_problem(a, b, outs[0].device), cfg,
                           explicit=config is not None, what=what):
        with device_guard(outs[0].device):
            if gather_rows_tma.launch_gather_rows_tma(a, b, outs, cfg, input_precision=_input_precision(b[0].dtype),
                                                      dot_f32=dot_f32(b[0].dtype), sms=_num_sms(outs[0].device)):
                return
    # (a TMA config that did not launch runs its tiles here; split_k is 1 with tma)
    saks = tuple(x.stride(1) for x in a)
    _launch_gather(_gather_rows_kernel, (tuple(a), tuple(x.stride(0) for x in a), saks), (ms, K), b, outs, M, cfg,
                   SAME_SAK=len(set(saks)) == 1, ROW_ALIGN=_row_align(a))


def launch_gather_cols(a: Sequence[Tensor], b: Sequence[Tensor], outs: Sequence[Tensor],
                       config: KernelConfig | None = None) -> None:
    """outs[j] <- cat(a; 1) @ b[j] for every j, in ONE launch (operands already validated).

    a[i]: [M, K_i]; b[j]: [sum K_i, N_j]; outs[j]: [M, N_j], any strides. The grid's axis 1 is j, as
    gather_rows'. A config with ``tma`` runs mm_sum's persistent TMA kernel once per output instead
    (each b[j] cut into the shards' row slices: views), where TMA can load the operands."""
    what = "all_gather_matmul"
    _require_launchable(what, outs[0].device)
    M = outs[0].shape[0]
    ks = [int(x.shape[1]) for x in a]
    nmax = max(int(o.shape[1]) for o in outs)
    if M == 0 or nmax == 0:
        return
    device = outs[0].device
    # pick_config sees one output's [M, max N_j], the gathered K and n: the grid holds n of them
    cfg = config or pick_config(M, nmax, sum(ks), b[0].dtype, device, launcher="gather_cols", n=len(a))
    if cfg.tma:
        slices = [_k_slices(a, bj) for bj in b]
        why = next((w for w in (mm_sum_tma.tma_problem(a, s, device) for s in slices) if w), None)
        if use_tma(why, cfg, explicit=config is not None, what=what):
            for s, out in zip(slices, outs):   # checked above: each runs mm_sum_tma (a no-K call, its tiles)
                launch_mm_sum(a, s, out, config=cfg, what=what)
            return
    # (a TMA config that did not launch runs its tiles here; split_k is 1 with tma)
    koff = [sum(ks[:i]) for i in range(len(a))]
    _launch_gather(_gather_cols_kernel, (tuple(a), tuple(x.stride(0) for x in a), tuple(x.stride(1) for x in a),
                                         tuple(ks), tuple(koff)), (M,), b, outs, M, cfg)


def _launch_gather(kernel, shard_args: tuple, sizes: tuple, b: Sequence[Tensor], outs: Sequence[Tensor], M: int,
                   cfg: KernelConfig, **constexprs) -> None:
    """One launch of a gather kernel (its arguments: ``shard_args``, the b[j] and out_j tuples, the workspace,
    ``sizes``, N_MAX; its grid: the tiles of an [M, max N_j] output x the n outputs x split_k), then, with
    split-K, the one launch that adds every output's shares."""
    ns = [int(o.shape[1]) for o in outs]
    nmax, sk, n = max(ns), cfg.split_k, len(outs)
    same_out = len({(nj, bj.stride(), o.stride()) for nj, bj, o in zip(ns, b, outs)}) == 1
    c_args = (tuple(outs), tuple(o.stride(0) for o in outs), tuple(o.stride(1) for o in outs), tuple(ns))
    device = outs[0].device
    # split-K: the shares' float32 [n, split_k, M, max N_j] workspace (from the caching allocator; inside a
    # captured graph, from the graph's pool)
    ws = torch.empty(n * sk * M * nmax, dtype=torch.float32, device=device) if sk > 1 else outs[0]
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(nmax, cfg.block_n), n, sk)
    with device_guard(device):  # Triton launches on the current device, not the tensors'
        kernel[grid](
            *shard_args, tuple(b), tuple(x.stride(0) for x in b), tuple(x.stride(1) for x in b),
            *c_args, ws, *sizes, nmax,
            NPART=len(b), SPLIT_K=sk, SAME_OUT=same_out,
            INPUT_PRECISION=_input_precision(b[0].dtype), DOT_F32=dot_f32(b[0].dtype),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **constexprs,
        )
        if sk > 1:
            _sum_shares(ws, c_args, M, nmax, n, cfg, same_out=same_out)


def _sum_shares(ws: Tensor, c_args: tuple, M: int, nmax: int, n: int, cfg: KernelConfig, *, same_out: bool) -> None:
    """outs[j] <- the sum of output j's split-K shares in ``ws`` [n, split_k, M, nmax], every output in one launch
    (memory-bound: 32x128 tiles of 4 warps, as mm_sum's shares' sum). Inside the launchers' device guard."""
    bm, bn = min(cfg.block_m, 32), min(cfg.block_n, 128)
    _gather_split_k_sum_kernel[(triton.cdiv(M, bm), triton.cdiv(nmax, bn), n)](
        ws, *c_args, M, nmax, NPART=n, SPLIT_K=cfg.split_k, SAME_OUT=same_out, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=4)


def _row_align(a: Sequence[Tensor]) -> int:
    """16 when every shard's rows start on a 16-byte boundary, else 1 (no alignment hint)."""
    size = a[0].element_size()
    ok = all(x.data_ptr() % 16 == 0 and (x.stride(0) * size) % 16 == 0 for x in a)
    return 16 if ok else 1


def all_gather_matmul(a: Sequence[Tensor], b: Sequence[Tensor], dim: int = 0, *,
                      config: KernelConfig | None = None) -> list[Tensor]:
    """[cat(a; dim) @ b[j] for j = 0..n-1], never materializing cat(a).

    dim 0: a[i]: [M_i, K] (equal M_i), b[j]: [K, N_j] -> out_j: [n*M_i, N_j]; each tile's
    rows are loaded from the shard holding them. dim 1 (-1): a[i]: [M, K_i], b[j]:
    [sum K_i, N_j] -> out_j: [M, N_j]; each K-slice is read from its shard and multiplied by
    the matching rows of b[j]. Either way all n outputs come from one launch (their tiles share
    the SMs). Any strides; everything on one device; 1 <= n <= 8.
    Returns fresh contiguous tensors in the input dtype. ``config`` overrides pick_config.
    """
    what = "all_gather_matmul"
    dim, M, K, ns = _check_operands(what, a, b, dim, same_device=True)
    device = a[0].device
    _require_launchable(what, device)
    calls.note(what, a, b, dim)
    outs = [torch.empty(M, nj, dtype=bj.dtype, device=device) for bj, nj in zip(b, ns)]
    (launch_gather_rows if dim == 0 else launch_gather_cols)(a, b, outs, config)
    return outs


def _k_slices(a: Sequence[Tensor], bj: Tensor) -> list[Tensor]:
    """The rows of bj that multiply each shard a[i] (dim 1): views, no copies."""
    slices, start = [], 0
    for x in a:
        k = x.shape[1]
        slices.append(bj[start:start + k])
        start += k
    return slices


# ---------------------------------------------------------------------------
# 4. overlapped variant (participants on different GPUs)
# ---------------------------------------------------------------------------

def all_gather_matmul_overlapped(a: Sequence[Tensor], b: Sequence[Tensor], dim: int = 0) -> list[Tensor]:
    """all_gather_matmul for participants on different GPUs, shard transfers overlapped with GEMMs.

    Participant j (a[j] and b[j] on its device) computes with its own shard first, then
    with shard (j-1) % n, (j-2) % n, ... (ring order). Each shard is copied straight from
    its owner's device on a dedicated copy stream, one step ahead: the copy of the next
    shard runs while the current GEMM does. dim 0: each shard's GEMM writes its own row
    block of out_j (input dtype, float32 accumulation inside the GEMM). dim 1: each shard's
    product with its K-slice of b[j] is added into a float32 accumulator, cast once at the
    end. Output j lives on participant j's device.

    On CPU, or with every participant on one device, the same schedule runs sequentially
    (no streams).
    """
    what = "all_gather_matmul_overlapped"
    dim, M, K, ns = _check_operands(what, a, b, dim, same_device=False)
    n = len(a)
    devices = [x.device for x in a]
    net = _Transfers(devices)
    koff = [0]
    for x in a:
        koff.append(koff[-1] + x.shape[1])
    ms = a[0].shape[0]

    def fetch(j: int, step: int):  # shard (j - step) % n, on its way to participant j's device
        src = (j - step) % n
        if step == 0:
            return src, a[src], None
        t, event = net.send(a[src], devices[j], is_input=True)
        return src, t, event

    outs: list[Tensor] = [torch.empty(M, nj, dtype=a[0].dtype, device=devices[j]) for j, nj in enumerate(ns)]
    acc: list[Tensor | None] = [None] * n
    inflight = [fetch(j, 0) for j in range(n)]
    for step in range(n):
        current = inflight
        if step + 1 < n:  # start the next shard's copy before this step's GEMMs
            inflight = [fetch(j, step + 1) for j in range(n)]
        for j in range(n):
            src, shard, event = current[j]
            shard = net.wait(shard, event)
            if dim == 0:
                _mm_into(outs[j][src * ms:(src + 1) * ms], shard, b[j])
            else:
                p = mm_f32(shard, b[j][koff[src]:koff[src + 1]])
                if acc[j] is None:
                    acc[j] = p
                else:
                    acc[j].add_(p)
    if dim == 1:
        for j in range(n):
            outs[j].copy_(acc[j])
    return outs


def _mm_into(out: Tensor, a: Tensor, b: Tensor) -> None:
    """out <- a @ b (float32 accumulation, one rounding to out's dtype); out may be a row block view."""
    if out.device.type == "cuda":
        launch_mm_sum([a], [b], out, what="all_gather_matmul_overlapped")
    else:
        out.copy_(torch.mm(a.float(), b.float()))


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------

def _check_operands(what: str, a, b, dim, same_device: bool) -> tuple[int, int, int, list[int]]:
    """Returns (dim, M, K, [N_j]) of the gathered product cat(a; dim): [M, K] @ b[j]: [K, N_j]."""
    n = check_group(what, a, b)
    dim = _norm_dim(dim, what)
    if dim == 0:
        ms, K = a[0].shape
        for i, x in enumerate(a):
            if tuple(x.shape) != (ms, K):
                raise ValueError(f"{what}: a[{i}]: expected shape {[ms, K]} like a[0] (shards along dim 0), "
                                 f"found {list(x.shape)}")
        M = n * ms
    else:
        M = a[0].shape[0]
        for i, x in enumerate(a):
            if x.shape[0] != M:
                raise ValueError(f"{what}: a[{i}]: expected {M} rows like a[0] (shards along dim 1), "
                                 f"found shape {list(x.shape)}")
        K = sum(x.shape[1] for x in a)
    for j, bj in enumerate(b):
        if bj.shape[0] != K:
            raise ValueError(f"{what}: b[{j}]: expected {K} rows (the K of cat(a; {dim})), "
                             f"found shape {list(bj.shape)}")
    if same_device:
        check_devices(what, list(a) + list(b), True)
    else:
        check_devices(what, [], False, pairs=zip(a, b))
    return dim, int(M), int(K), [int(bj.shape[1]) for bj in b]
