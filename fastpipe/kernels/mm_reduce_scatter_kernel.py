"""Fused matmul + reduce_scatter: ``out_j = chunk_j(op(a_0 @ b_0, ..., a_{n-1} @ b_{n-1}); dim)``.

Tensor parallelism ends a row-parallel linear layer with exactly this: participant i holds
an activation slice ``a[i]: [M, K_i]`` and the matching weight rows ``b[i]: [K_i, N]``;
the layer's output is ``sum_i a[i] @ b[i]``, and a reduce_scatter hands chunk j of it to
participant j. The story of this file:

1. :func:`matmul_reduce_scatter_reference` -- plain torch, the oracle, with the memory
   traffic of the unfused path counted.
2. ``_mm_sum_kernel`` -- the ``@triton.jit`` kernel. One program owns one output tile and
   runs the K-loop of *every* participant into the same fp32 accumulator, then writes the
   tile once, straight into the chunk it belongs to. No partial product ever reaches
   memory -- unless the config splits K (``KernelConfig.split_k``, from a tuned table only):
   then each of split_k programs per tile writes its float32 share of the K-steps, and
   ``_split_k_sum_kernel`` adds the shares in order and writes the tile.
3. :func:`pick_config` / :func:`matmul_reduce_scatter` -- the launcher: validates, picks
   block sizes, allocates the n output chunks as one buffer and launches one grid.
4. :func:`matmul_reduce_scatter_overlapped` -- for participants on *different* GPUs: each
   participant computes its partial product chunk by chunk in ring order and hands every
   finished chunk to its destination on a copy stream while the rest of its GEMM runs.
5. ``fastpipe.kernels.fusion_rule.fused_is_faster`` (not in this file) -- when the runtime
   should pick the fused kernel.

Semantics follow ``fastpipe.comm.reference.reduce_scatter``: the sum is taken in float32
and rounded to the input dtype once, ``avg`` is that sum divided by n, the split into n
chunks must be exact (``ValueError`` otherwise). ``max``/``min`` are refused: a maximum of
matmuls is not a sum over K-slices, so it cannot be fused into one accumulator.

dtypes: float32, bfloat16, float16. Accumulation is always float32. For float32 inputs
``tl.dot`` uses IEEE fp32 unless ``torch.backends.cuda.matmul.allow_tf32`` is set (then
TF32, as torch.mm would).

Triton features used: tuple kernel arguments (one pointer/stride/K per participant,
indexed under ``tl.static_range``; Triton >= 3.2), ``tl.dot(..., input_precision=)``
(Triton >= 3.0). Both run under ``TRITON_INTERPRET=1``, which is how the tests run the
kernel on CPU tensors.

A change here that can change the kernel's speed bumps its revision in
``fastpipe.kernels.fusion_rule.KERNEL_REVISIONS`` (with a line in ``REVISION_CHANGES``): the
fusion rule's measured points then say they timed an older kernel.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from fastpipe.errors import RunError
from fastpipe.kernels import calls, mm_sum_tma
from fastpipe.kernels.fusion_rule import gpu_name
from fastpipe.kernels.launch_config import KernelConfig, outputs_per_launch
from fastpipe.kernels.tuned import lookup

try:  # Triton is optional: the references and the validation work without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None
else:
    from fastpipe.kernels import _triton_compat

    _triton_compat.apply()  # Triton <= 3.6's interpreter with numpy >= 2.4 (see _triton_compat)
    from fastpipe.kernels.tiles import dot_step, grouped_tile, split_k_share, steps_in_share, store_tile

__all__ = [
    "KernelConfig",
    "KernelUnavailable",
    "MAX_PARTICIPANTS",
    "matmul_reduce_scatter",
    "matmul_reduce_scatter_overlapped",
    "matmul_reduce_scatter_reference",
    "pick_config",
]

MAX_PARTICIPANTS = 8
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class KernelUnavailable(RunError):
    """A Triton kernel cannot be launched here (no triton, or CPU tensors without TRITON_INTERPRET=1)."""


# ---------------------------------------------------------------------------
# 1. reference
# ---------------------------------------------------------------------------

def matmul_reduce_scatter_reference(a: Sequence[Tensor], b: Sequence[Tensor], dim: int = 0,
                                    op: str = "sum") -> list[Tensor]:
    """chunk_j(sum_i a[i] @ b[i]) in plain torch: products and sum in float32, one cast at the end.

    a[i]: [M, K_i], b[i]: [K_i, N] -> n tensors, [M/n, N] (dim 0) or [M, N/n] (dim 1),
    fresh and contiguous, on the device of a[0].

    Memory traffic of this unfused path (element size s, K = sum K_i), which the fused
    kernel avoids except for the first and last lines::

        read  a, b                      s * (M*K + K*N)
        write n partial products        n * M*N * 4   (float32 here; s in a bf16 pipeline)
        read  them back to sum          n * M*N * 4
        write the sum, cast, chunk      M*N * (4 + s)  (+ M*N*2s for the dim-1 chunk copies)

    The fused kernel reads a and b (tiles re-read from L2) and writes M*N*s once.
    """
    n, M, N, _, dtype = _check_operands("matmul_reduce_scatter_reference", a, b, same_device=False)
    dim = _norm_dim(dim, "matmul_reduce_scatter_reference")
    op = _fusable_op(op, "matmul_reduce_scatter_reference")
    _check_divisible(M if dim == 0 else N, n, dim, "matmul_reduce_scatter_reference")
    dev = a[0].device
    acc = torch.zeros(M, N, dtype=torch.float32, device=dev)
    for ai, bi in zip(a, b):
        acc += ai.to(dev, torch.float32) @ bi.to(dev, torch.float32)
    if op == "avg":
        acc = acc / n
    return [c.to(dtype).contiguous() for c in torch.chunk(acc, n, dim=dim)]


# ---------------------------------------------------------------------------
# 2. the kernel
# ---------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _mm_sum_kernel(
        A, B,                    # tuples of NPART pointers: A[i] -> [M, K_i], B[i] -> [K_i, N]
        K,                       # tuple of NPART ints: K_i
        SAM, SAK, SBK, SBN,      # tuples of NPART strides (elements): a[i].stride(), b[i].stride()
        C,                       # output buffer, dtype of the result
        W,                       # SPLIT_K > 1: float32 workspace [SPLIT_K, M, N] (else unused)
        M, N,
        stride_cm, stride_cn,    # output strides within one chunk
        chunk_n, stride_cj,      # SPLIT_COLS: columns per chunk, and the distance between chunks
        scale,                   # APPLY_SCALE: multiply the fp32 sum by this (1/n for avg)
        NPART: tl.constexpr,
        SPLIT_COLS: tl.constexpr,
        APPLY_SCALE: tl.constexpr,
        SPLIT_K: tl.constexpr,   # programs per output tile (grid axis 1), each a share of the K-steps
        INPUT_PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,   # interpreter + bf16 only: upcast tiles before tl.dot (see dot_f32)
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """C[tile] = scale * sum_i A[i][rows, :] @ B[i][:, cols]; one tile per program, written once
        (``store_tile``). With SPLIT_K > 1, program (tile, s) sums the s-th of SPLIT_K equal runs of
        the tile's K-steps (all participants' steps in order, BLOCK_K each) into W[s];
        ``_split_k_sum_kernel`` then adds the SPLIT_K shares and writes the tile."""
        # grouped ordering: GROUP_M row tiles share their B column tiles in L2
        pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

        # rows/cols wrap (% M, % N) so loads need no M/N mask; the store masks them
        offs_am = ((pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M).to(tl.int64)
        offs_bn = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        if SPLIT_K > 1:   # this program's run [lo, lo + per) of the tile's K-steps, counted over all participants
            lo, per = split_k_share(K, NPART, BLOCK_K, SPLIT_K, 1)
            done = 0      # the steps of the participants before i
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in tl.static_range(NPART):  # every participant's K-slices, one accumulator
            if SPLIT_K > 1:
                k_steps = tl.cdiv(K[i], BLOCK_K)
                k0, k1 = steps_in_share(k_steps, lo, per, done)
                done += k_steps
                a_ptrs = A[i] + (offs_am[:, None] * SAM[i] + (offs_k[None, :] + k0 * BLOCK_K) * SAK[i])
                b_ptrs = B[i] + ((offs_k[:, None] + k0 * BLOCK_K) * SBK[i] + offs_bn[None, :] * SBN[i])
            else:
                a_ptrs = A[i] + (offs_am[:, None] * SAM[i] + offs_k[None, :] * SAK[i])
                b_ptrs = B[i] + (offs_k[:, None] * SBK[i] + offs_bn[None, :] * SBN[i])
                k0 = 0
                k1 = tl.cdiv(K[i], BLOCK_K)
            for k in range(k0, k1):
                k_left = K[i] - k * BLOCK_K
                acc = dot_step(acc, a_ptrs, b_ptrs, offs_k, k_left, INPUT_PRECISION, DOT_F32)
                a_ptrs += BLOCK_K * SAK[i]
                b_ptrs += BLOCK_K * SBK[i]

        offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if SPLIT_K > 1:   # W[s] is a row-major [M, N] float32 plane
            store_tile(W + tl.program_id(1).to(tl.int64) * M * N, acc, offs_cm, offs_cn, M, N, N, 1, 1, 0, False)
        else:
            if APPLY_SCALE:
                acc = acc * scale
            store_tile(C, acc.to(C.dtype.element_ty), offs_cm, offs_cn, M, N, stride_cm, stride_cn,
                       chunk_n, stride_cj, SPLIT_COLS)

    @triton.jit
    def _split_k_sum_kernel(
        W, C, M, N, stride_cm, stride_cn, chunk_n, stride_cj, scale,
        SPLIT_K: tl.constexpr, SPLIT_COLS: tl.constexpr, APPLY_SCALE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """C[tile] = scale * sum_s W[s][tile], the shares added in order s = 0, 1, ... (deterministic),
        rounded once to C's dtype; C addressed as _mm_sum_kernel's output."""
        offs_cm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_cn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
        rows = offs_cm.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):   # W[s] is a row-major [M, N] plane
            acc += tl.load(W + ((rows + s * M)[:, None] * N + offs_cn[None, :]), mask=mask, other=0.0)
        if APPLY_SCALE:
            acc = acc * scale
        store_tile(C, acc.to(C.dtype.element_ty), offs_cm, offs_cn, M, N, stride_cm, stride_cn,
                   chunk_n, stride_cj, SPLIT_COLS)

else:  # pragma: no cover
    _mm_sum_kernel = _split_k_sum_kernel = None


# ---------------------------------------------------------------------------
# 3. launcher
# ---------------------------------------------------------------------------

def interpreting() -> bool:
    """True when the kernels were defined under TRITON_INTERPRET=1 (they then run on CPU tensors)."""
    return _mm_sum_kernel is not None and type(_mm_sum_kernel).__name__ == "InterpretedFunction"


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100 SXM, for planning only


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    """The GPU's name (the tuned table's key, as the fusion rule's), once per device: pick_config runs
    at every launch."""
    return gpu_name(device) or ""   # "": no table entry


def _pow2_clamp(x: int, lo: int, hi: int) -> int:
    p = lo
    while p < x and p < hi:
        p *= 2
    return p


def pick_config(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device | str = "cuda", *,
                launcher: str = "mm_sum", n: int = 1, use_tuned: bool = True) -> KernelConfig:
    """Block sizes for an [M, K] x [K, N] sum of products (K = the longest participant's K; n
    participants; launcher: the kernel, "mm_sum", "gather_rows" or "gather_cols"). A gather launch
    computes n such outputs at once (N: the widest one), so its grid has n times the tiles of one.

    On a GPU, a config measured for this GPU, dtype, N, K and n comes first
    (fastpipe.kernels.tuned: the table ``bench/bench_fused_kernels.py --tune`` and
    ``--write-tuned`` produce, or ``fastpipe tune`` for a pipeline's own shapes; ``use_tuned=False``
    skips it). Otherwise the rule (a starting point for Hopper):

    * Interpreter / CPU tensors: tiles of 16 or 32 in every dimension -- the interpreter
      runs every program in numpy, and small tiles keep the irregular-shape tests fast.
    * 16-bit dtypes on a GPU: ``BLOCK_M`` is M rounded up to a power of two, clamped to
      [16, 128] -- decode-sized M (16..64) should not waste a 128-row MMA tile.
      ``BLOCK_K`` is 64, or 128 when BLOCK_M <= 64: small M is bound by reading B, and a
      longer K step keeps more bytes in flight per stage. ``BLOCK_N`` starts at 256 (with
      BLOCK_M 128) or 128, and halves (down to 32) while the grid would leave SMs idle --
      the heuristic does not split K (a tuned config may: ``KernelConfig.split_k``), so
      parallelism comes from N tiles (the gather launchers: from the n outputs' N tiles together).
      ``num_warps`` 8 for tiles of >= 128x128, else 4; ``num_stages`` 3 for 128x256 tiles
      (3 x 48 KiB of shared memory), else 4.
    * float32 on a GPU: 128x128x32 (64x128 for M <= 64), 8 warps, 3 stages (2 for gather_cols'
      64x128 tiles, which spill registers with 3) -- fp32 tiles are twice the bytes, so K steps
      are shorter.

    ``scripts/compile_kernels.py`` compiles every config this picks for the benchmark grid's shapes
    for sm_90 without a GPU, and checks shared memory and register spills (tests/test_kernels_compile.py).
    """
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        bm = 16 if M <= 16 else 32
        bn = 16 if N <= 16 else 32
        bk = 16 if K <= 16 else 32
        return KernelConfig(bm, bn, bk, group_m=4, num_warps=4, num_stages=1)
    tuned = lookup(launcher, M, N, K, n, dtype, _device_name(device)) if use_tuned else None
    if tuned is not None:
        return tuned
    sms = _num_sms(device)
    if dtype == torch.float32:
        bm = 64 if M <= 64 else 128
        # 8 warps for both: fp32 (no TF32) runs on FMAs, and a 64x128 tile on 4 warps spills
        # registers on sm_90; so does gather_cols' 64x128 tile with 3 stages (it holds n outputs'
        # pointers; Triton 3.6 at n 2, 3.9 at n 4): 2 stages there (scripts/compile_kernels.py)
        stages = 2 if launcher == "gather_cols" and bm == 64 else 3
        return KernelConfig(bm, 128, 32, group_m=8, num_warps=8, num_stages=stages)
    bm = _pow2_clamp(M, 16, 128)
    bk = 64 if bm == 128 else 128
    bn = 256 if bm == 128 else 128
    outputs = outputs_per_launch(launcher, n)             # gather_*: one launch, n outputs' tiles
    while bn > 32 and outputs * -(-M // bm) * -(-N // bn) < sms:
        bn //= 2
    num_warps = 8 if bm * bn >= 128 * 128 else 4
    num_stages = 3 if bm * bn >= 128 * 256 else 4
    return KernelConfig(bm, bn, bk, group_m=8, num_warps=num_warps, num_stages=num_stages)


def _input_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"  # exact fp32 products; ignored for 16-bit inputs


def dot_f32(dtype: torch.dtype) -> bool:
    """Upcast bf16 tiles to fp32 before tl.dot -- under the interpreter only.

    The interpreter keeps bfloat16 as raw uint16 (numpy has no bf16) and its tl.dot
    multiplies those bits (Triton 3.9). bf16 x bf16 products are exact in fp32, so the
    upcast changes nothing numerically; compiled kernels never take this branch.
    """
    return dtype == torch.bfloat16 and interpreting()


def launch_problem(device) -> str | None:
    """Why the fused kernels cannot run on tensors of this device in this process, or None where
    they can (CUDA with triton installed; any device under TRITON_INTERPRET=1)."""
    device = torch.device(device)
    if _mm_sum_kernel is None:
        return "triton is not installed"
    if device.type != "cuda" and not interpreting():
        return (f"the Triton kernels run on CUDA tensors, not on {device.type} (unless TRITON_INTERPRET=1 "
                f"was set before fastpipe.kernels was first imported: the interpreter, for tests)")
    return None


def _require_launchable(what: str, device: torch.device) -> None:
    ref = what.removesuffix("_overlapped") + "_reference"
    why = launch_problem(device)
    if why is not None:
        raise KernelUnavailable(f"{what}: {why}; use {ref} (plain torch) instead")


def launch_mm_sum(a: Sequence[Tensor], b: Sequence[Tensor], out: Tensor, *, split_cols: int = 0,
                  chunk_stride: int = 0, scale: float | None = None, out_strides: tuple[int, int] | None = None,
                  config: KernelConfig | None = None, what: str = "matmul_reduce_scatter") -> Tensor:
    """out <- scale * sum_i a[i] @ b[i] with one launch (operands already validated).

    ``out`` is an [M, N] tensor (any strides), or -- with ``split_cols = N/n`` -- the
    [n, M, N/n] buffer whose chunk j receives columns ``j*split_cols ..``; then
    ``chunk_stride`` is the distance between chunks and ``out_strides`` the (row, col)
    strides inside one. all_gather_matmul's dim 1 runs here only under a TMA config (once per output).
    """
    M, N = a[0].shape[0], b[0].shape[1]
    _require_launchable(what, out.device)
    if M == 0 or N == 0:
        return out
    kmax = max(int(x.shape[1]) for x in a)
    cfg = config or pick_config(M, N, kmax, a[0].dtype, out.device, launcher="mm_sum", n=len(a))
    scm, scn = out_strides if out_strides is not None else out.stride()
    out_args = (M, N, scm, scn, max(split_cols, 1), chunk_stride, 1.0 if scale is None else float(scale))
    if cfg.tma and use_tma(mm_sum_tma.tma_problem(a, b, out.device), cfg, explicit=config is not None, what=what):
        with device_guard(out.device):
            if mm_sum_tma.launch_tma(a, b, out, cfg, out_args, split_cols=split_cols > 0, scale=scale is not None,
                                     input_precision=_input_precision(a[0].dtype), dot_f32=dot_f32(a[0].dtype),
                                     sms=_num_sms(out.device)):
                return out
    # (a TMA config that did not launch -- operands TMA cannot load, or no participant with K > 0 -- runs
    # its tiles here; this kernel has no TMA, and split_k is 1 with tma)
    sk = cfg.split_k
    # split-K: the shares' float32 [split_k, M, N] workspace (from the caching allocator; inside a
    # captured graph, from the graph's pool)
    ws = torch.empty(sk * M * N, dtype=torch.float32, device=out.device) if sk > 1 else out
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), sk)
    with device_guard(out.device):  # Triton launches on the current device, not the tensors'
        _mm_sum_kernel[grid](
            tuple(a), tuple(b), tuple(int(x.shape[1]) for x in a),
            tuple(x.stride(0) for x in a), tuple(x.stride(1) for x in a),
            tuple(x.stride(0) for x in b), tuple(x.stride(1) for x in b),
            out, ws, *out_args,
            NPART=len(a), SPLIT_COLS=split_cols > 0, APPLY_SCALE=scale is not None, SPLIT_K=sk,
            INPUT_PRECISION=_input_precision(a[0].dtype), DOT_F32=dot_f32(a[0].dtype),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if sk > 1:   # memory-bound: 32x128 tiles of 4 warps (32 accumulators a thread)
            bm, bn = min(cfg.block_m, 32), min(cfg.block_n, 128)
            _split_k_sum_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
                ws, out, *out_args, SPLIT_K=sk, SPLIT_COLS=split_cols > 0, APPLY_SCALE=scale is not None,
                BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    return out


_warned_tma: set[str] = set()


def use_tma(why: str | None, cfg: KernelConfig, *, explicit: bool, what: str) -> bool:
    """Whether a config with ``tma`` runs its TMA kernel: where it can load the operands (``why``, the
    launcher's TMA check, is None). Otherwise a config passed by the caller is refused (ValueError), and
    a tuned one runs its tiles with pointer loads (False), saying so once per reason."""
    if why is None:
        return True
    if explicit:
        raise ValueError(f"{what}: config.tma: the TMA kernel cannot load these operands: {why}")
    message = (f"{what}: the tuned launch config {cfg.text()} uses TMA, but {why}: its tiles run with "
               f"pointer loads instead (the plain kernel)")
    if message not in _warned_tma:
        _warned_tma.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
    return False


def device_guard(device: torch.device):
    """``torch.cuda.device(device)`` for CUDA tensors, else a no-op context."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def matmul_reduce_scatter(a: Sequence[Tensor], b: Sequence[Tensor], dim: int = 0, op: str = "sum", *,
                          config: KernelConfig | None = None) -> list[Tensor]:
    """chunk_j(op_i a[i] @ b[i]; dim) for j = 0..n-1, in ONE fused kernel launch.

    a[i]: [M, K_i], b[i]: [K_i, N] (K_i may differ; any strides -- ``b[i] = w.t()`` is read
    in place), all on one device, one dtype (float32, bfloat16, float16), 1 <= n <= 8.
    dim: 0 splits M (M % n == 0), 1 splits N (N % n == 0); -2/-1 are accepted.
    op: "sum" or "avg" (any spelling ``fastpipe.comm.reduce_ops`` accepts); max/min raise
    ``ValueError``.

    Returns n contiguous tensors of the input dtype: [M/n, N] (dim 0) or [M, N/n] (dim 1).
    They are non-overlapping views ``buf[j]`` of one fresh [n, ...] buffer (one allocation;
    none aliases an input). ``config`` overrides :func:`pick_config` (benchmark sweeps).
    """
    what = "matmul_reduce_scatter"
    n, M, N, _, dtype = _check_operands(what, a, b, same_device=True)
    dim = _norm_dim(dim, what)
    op = _fusable_op(op, what)
    _check_divisible(M if dim == 0 else N, n, dim, what)
    device = a[0].device
    _require_launchable(what, device)
    calls.note(what, a, b, dim, op)
    scale = (1.0 / n) if op == "avg" else None
    if dim == 0:  # row chunks of a row-major [M, N] buffer: a plain [M, N] store
        buf = torch.empty(n, M // n, N, dtype=dtype, device=device)
        launch_mm_sum(a, b, buf, scale=scale, out_strides=(N, 1), config=config, what=what)
    else:  # column chunks: element (r, c) goes to buf[c // (N/n), r, c % (N/n)]
        cn = N // n
        buf = torch.empty(n, M, cn, dtype=dtype, device=device)
        launch_mm_sum(a, b, buf, split_cols=cn, chunk_stride=M * cn, scale=scale, out_strides=(cn, 1),
                      config=config, what=what)
    return list(buf.unbind(0))


# ---------------------------------------------------------------------------
# 4. overlapped variant (participants on different GPUs)
# ---------------------------------------------------------------------------

def mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b as a fresh float32 [M, N] tensor on a's device, products summed in float32.

    CUDA: the fused kernel with one participant and a float32 output (no upcast copies of
    the weight). CPU: torch.mm on float32 upcasts (exact products of 16-bit inputs).
    """
    if a.device.type == "cuda":
        out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
        return launch_mm_sum([a], [b], out, what="matmul_reduce_scatter_overlapped")
    return torch.mm(a.float(), b.float())


class _Transfers:
    """Peer copies on dedicated streams, ordered with events.

    Each device gets a send stream and a receive stream besides the caller's current
    ("compute") stream. A copy src -> dst runs with send[src] current on src and recv[dst]
    current on dst: torch runs a cross-device copy on the source's current stream and fences
    it, both ways, against the destination's current stream -- which therefore must not be
    dst's busy compute stream. Compute waits for an arrival with an event, only when it
    needs the data.

    Only used when the participants span several CUDA devices; otherwise ``send`` is a
    plain ``.to(device)`` (a no-op on the same device) and ``wait`` does nothing, so the
    same schedule runs sequentially on CPU or on one GPU.
    """

    def __init__(self, devices: Sequence[torch.device], transfer_dtype: torch.dtype | None = None):
        distinct = list(dict.fromkeys(devices))
        self.cuda = len(distinct) > 1 and all(d.type == "cuda" for d in distinct)
        self.transfer_dtype = transfer_dtype
        if self.cuda:
            # the caller's streams: compute is enqueued there, so outputs are ordered for the caller
            self.compute = {d: torch.cuda.current_stream(d) for d in distinct}
            self.send_stream = {d: torch.cuda.Stream(device=d) for d in distinct}
            self.recv_stream = {d: torch.cuda.Stream(device=d) for d in distinct}
            # the inputs are ready once the caller's work enqueued so far is done
            self.inputs_ready = {}
            for d in distinct:
                self.inputs_ready[d] = torch.cuda.Event()
                self.inputs_ready[d].record(self.compute[d])

    def send(self, t: Tensor, dst: torch.device, is_input: bool = False) -> tuple[Tensor, object]:
        """Start copying ``t`` to ``dst``: a caller's input (``is_input``), or a tensor just
        produced on its device's compute stream (the copy then waits for that work).

        Returns (the tensor on dst, an event to wait for before using it there, or None).
        """
        if self.transfer_dtype is not None and t.dtype != self.transfer_dtype:
            t = t.to(self.transfer_dtype)  # on the compute stream: no longer a ready input
            is_input = False
        src = t.device
        if not self.cuda or src == dst:
            return t.to(dst), None
        if is_input:
            ready = self.inputs_ready[src]
        else:
            ready = torch.cuda.Event()
            ready.record(self.compute[src])
        send, recv = self.send_stream[src], self.recv_stream[dst]
        with torch.cuda.stream(send), torch.cuda.stream(recv):
            send.wait_event(ready)
            received = torch.empty(t.shape, dtype=t.dtype, device=dst)  # allocated on recv
            received.copy_(t, non_blocking=True)
        t.record_stream(send)  # t's memory must outlive the copy
        done = torch.cuda.Event()
        done.record(recv)  # torch made recv wait for the copy
        return received, done

    def wait(self, t: Tensor, event) -> Tensor:
        """Make t's device's compute stream wait for its arrival; return t."""
        if event is not None:
            stream = self.compute[t.device]
            stream.wait_event(event)
            t.record_stream(stream)  # allocated on the receive stream, used on compute
        return t


def matmul_reduce_scatter_overlapped(a: Sequence[Tensor], b: Sequence[Tensor], dim: int = 0, op: str = "sum", *,
                                     transfer_dtype: torch.dtype | None = None) -> list[Tensor]:
    """matmul_reduce_scatter for participants on different GPUs, transfers overlapped with compute.

    Participant i (a[i], b[i] on one device, its own) computes its partial product chunk
    by chunk, in the order the destinations need them: chunk (i+1) % n first, ..., its
    own chunk i last. Each finished chunk is copied to its destination's device on a
    dedicated copy stream while participant i's next chunk computes; the destination adds
    it into a float32 accumulator after its own next GEMM was enqueued (so arrivals never
    stall its compute stream). Output j lives on participant j's device, in the input dtype.

    Per device the compute stream runs: GEMM(step 1), GEMM(step 2), add(arrival 1),
    GEMM(step 3), add(arrival 2), ..., GEMM(own chunk), add(arrival n-1), add(own).

    transfer_dtype: the dtype partial chunks travel in. None: float32 (results equal the
    reference's single rounding; 2x the bytes of a bf16 chunk); the input dtype halves the
    traffic at the cost of one extra rounding per partial.

    On CPU, or with every participant on one device, the same schedule runs sequentially
    (no streams). Inputs: like :func:`matmul_reduce_scatter`, except that each participant
    may sit on its own device.
    """
    what = "matmul_reduce_scatter_overlapped"
    n, M, N, _, dtype = _check_operands(what, a, b, same_device=False)
    dim = _norm_dim(dim, what)
    op = _fusable_op(op, what)
    _check_divisible(M if dim == 0 else N, n, dim, what)
    devices = [x.device for x in a]
    net = _Transfers(devices, transfer_dtype)
    cm, cn = (M // n, N) if dim == 0 else (M, N // n)

    def partial(i: int, j: int) -> Tensor:  # participant i's contribution to chunk j, float32
        if dim == 0:
            return mm_f32(a[i][j * cm:(j + 1) * cm], b[i])
        return mm_f32(a[i], b[i][:, j * cn:(j + 1) * cn])

    acc: list[Tensor | None] = [None] * n
    arrived: list[tuple[int, Tensor, object]] = []  # (destination, tensor, event), from the last step

    def accumulate(j: int, t: Tensor, event) -> None:
        t = net.wait(t, event)
        if acc[j] is None:
            acc[j] = t if t.dtype == torch.float32 else t.float()
        else:
            acc[j].add_(t)

    for step in range(1, n + 1):
        sent = []
        for i in range(n):
            j = (i + step) % n  # step n: j == i, the participant's own chunk
            p = partial(i, j)
            if j == i:
                sent.append((j, p, None))
            else:
                received, event = net.send(p, devices[j])
                sent.append((j, received, event))
        for j, t, event in arrived:  # enqueued behind this step's GEMMs
            accumulate(j, t, event)
        arrived = sent
    for j, t, event in arrived:
        accumulate(j, t, event)

    outs = []
    for j in range(n):
        r = acc[j]
        if op == "avg":
            r = r / n
        outs.append(r.to(dtype).contiguous() if r.dtype != dtype else r.contiguous())
    return outs


# ---------------------------------------------------------------------------
# validation shared with all_gather_matmul
# ---------------------------------------------------------------------------

def _check_list(x, name: str, what: str) -> list[Tensor]:
    if isinstance(x, Tensor) or not isinstance(x, Sequence):
        raise ValueError(f"{what}: {name}: expected a list of tensors (one per participant), "
                         f"found {type(x).__name__}")
    for i, t in enumerate(x):
        if not isinstance(t, Tensor):
            raise ValueError(f"{what}: {name}[{i}]: expected a torch.Tensor, found {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{what}: {name}[{i}]: expected a 2-D tensor, found shape {list(t.shape)}")
    return list(x)


def check_group(what: str, a, b) -> int:
    """Lists of 2-D tensors, one per participant, same n, 1 <= n <= 8, one supported dtype; returns n."""
    a = _check_list(a, "a", what)
    b = _check_list(b, "b", what)
    n = len(a)
    if not 1 <= n <= MAX_PARTICIPANTS:
        raise ValueError(f"{what}: expected 1 <= n <= {MAX_PARTICIPANTS} participants (len(a)), found {n}")
    if len(b) != n:
        raise ValueError(f"{what}: expected one b per participant (len(b) == len(a) == {n}), found len(b) == {len(b)}")
    dtype = a[0].dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what}: expected dtype float32, bfloat16 or float16, found {dtype}")
    for name, xs in (("a", a), ("b", b)):
        for i, t in enumerate(xs):
            if t.dtype != dtype:
                raise ValueError(f"{what}: {name}[{i}]: expected dtype {dtype} like a[0], found {t.dtype}")
    return n


def check_devices(what: str, tensors: Sequence[Tensor], same_device: bool, pairs=()) -> None:
    """One device for everything (same_device), or per participant: a[i] and b[i] together."""
    if same_device:
        dev = tensors[0].device
        for t in tensors:
            if t.device != dev:
                raise ValueError(f"{what}: expected every tensor on {dev} (the fused kernel runs on one device), "
                                 f"found one on {t.device}; use the _overlapped variant for several devices")
    for i, (x, y) in enumerate(pairs):
        if x.device != y.device:
            raise ValueError(f"{what}: participant {i}: expected a[{i}] and b[{i}] on one device, "
                             f"found {x.device} and {y.device}")


def _check_operands(what: str, a, b, same_device: bool):
    """Returns (n, M, N, [K_i], dtype) for a[i]: [M, K_i], b[i]: [K_i, N]."""
    n = check_group(what, a, b)
    M, N = a[0].shape[0], b[0].shape[1]
    ks = []
    for i in range(n):
        if a[i].shape[0] != M:
            raise ValueError(f"{what}: a[{i}]: expected {M} rows like a[0], found shape {list(a[i].shape)}")
        if b[i].shape[1] != N:
            raise ValueError(f"{what}: b[{i}]: expected {N} columns like b[0], found shape {list(b[i].shape)}")
        if a[i].shape[1] != b[i].shape[0]:
            raise ValueError(f"{what}: participant {i}: expected a[{i}].shape[1] == b[{i}].shape[0] (K_{i}), "
                             f"found {a[i].shape[1]} and {b[i].shape[0]}")
        ks.append(int(a[i].shape[1]))
    check_devices(what, list(a) + list(b), same_device, pairs=zip(a, b))
    return n, int(M), int(N), ks, a[0].dtype


def _norm_dim(dim, what: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -2 <= dim < 2:
        raise ValueError(f"{what}: dim: expected 0, 1, -2 or -1, found {dim!r}")
    return dim % 2


def _check_divisible(size: int, n: int, dim: int, what: str) -> None:
    if size % n:
        raise ValueError(f"{what}: expected the size of dimension {dim} ({size}) to be divisible by "
                         f"the group size {n}")


def _fusable_op(op, what: str) -> str:
    from fastpipe.comm.reduce_ops import canonical_reduce_op

    op = canonical_reduce_op(op)  # ValueError listing the spellings for anything unknown
    if op not in ("sum", "avg"):
        raise ValueError(f"{what}: op: expected 'sum' or 'avg', found {op!r}: a {op} of matmuls is not a sum "
                         f"over K-slices and cannot be fused; run torch.mm per participant, then reduce_scatter")
    return op

