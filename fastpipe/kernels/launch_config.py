"""KernelConfig: the launch parameters of one GEMM-shaped Triton kernel (block sizes, warps, stages),
shared by the launchers (mm_reduce_scatter_kernel, all_gather_mm_kernel) and the table of configs
measured per GPU (tuned)."""
from __future__ import annotations

from dataclasses import dataclass

MAX_SPLIT_K = 16
TMA_MAX_BOX = 256
# The launchers (the tuned table's "launcher"): mm_sum (matmul_reduce_scatter), gather_rows (all_gather_matmul
# dim 0) and gather_cols (all_gather_matmul dim 1). The gather ones compute a group's n outputs in one launch.
LAUNCHERS = ("mm_sum", "gather_rows", "gather_cols")


def outputs_per_launch(launcher: str, n: int) -> int:
    """How many [M, N] outputs one launch of ``launcher`` computes for a group of n: its grid has that many
    times one output's tiles (the SMs they fill decide the heuristic's tiles and the split-K candidates)."""
    return n if launcher in ("gather_rows", "gather_cols") else 1


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one GEMM-shaped kernel.

    block_m/block_n/block_k: the output tile and the K step (powers of two, >= 16: tl.dot's minimum).
    group_m: row tiles per group in the grouped (L2-friendly) program order.
    num_warps/num_stages: Triton's; stages is the depth of the software pipeline of loads.
    split_k: the K-loop cut into this many programs per output tile, each summing its share of the
    K-steps (for mm_sum and gather_cols over all participants' K-slices; for gather_rows of the
    gathered K; for the gather launchers, of each output j) into a float32 workspace, then one more
    launch adds the shares in a fixed order and writes the tiles. More programs where the output has
    fewer tiles than the GPU has SMs (a decode's M), at the cost of split_k x M x N x 4 bytes (the
    gather launchers: per output) written and read back. 1: no split.
    tma: the persistent kernel that loads tiles with Hopper's tensor memory accelerator
    (``fastpipe.kernels.mm_sum_tma`` for the mm_sum launcher, and for gather_cols once per output;
    ``gather_rows_tma`` for gather_rows): one
    program per SM, each taking output tiles in turn, the operand tiles copied into shared memory by
    TMA descriptors instead of per-thread pointer loads. Needs compute capability 9.0 or newer, and
    operands TMA can address (a row-major a[i]; every b row-major or every one column-major; 16-byte
    aligned pointers and strides). Not with split_k.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    tma: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"KernelConfig.{name}: expected a power of two >= 16, found {v}")
        if self.group_m < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"KernelConfig: expected group_m, num_warps, num_stages >= 1, found {self}")
        if isinstance(self.split_k, bool) or not isinstance(self.split_k, int) or not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"KernelConfig.split_k: expected an integer from 1 to {MAX_SPLIT_K}, "
                             f"found {self.split_k!r}")
        if not isinstance(self.tma, bool):
            raise ValueError(f"KernelConfig.tma: expected true or false, found {self.tma!r}")
        if self.tma and self.split_k != 1:
            raise ValueError(f"KernelConfig.tma: expected split_k 1 with tma (the persistent TMA kernel writes "
                             f"each tile once), found split_k {self.split_k}")
        if self.tma and max(self.block_m, self.block_n, self.block_k) > TMA_MAX_BOX:
            raise ValueError(f"KernelConfig.tma: expected blocks of at most {TMA_MAX_BOX} (a TMA copy's box is at "
                             f"most {TMA_MAX_BOX} elements a side), found {self.block_m}x{self.block_n}x{self.block_k}")

    def text(self) -> str:
        """Short form for messages and tables: ``128x256x64 w8 s3`` (+ `` k4`` split-K, `` tma``)."""
        return (f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"
                + (f" k{self.split_k}" if self.split_k > 1 else "") + (" tma" if self.tma else ""))
