"""KernelConfig: the launch parameters of one GEMM-shaped Triton kernel (block sizes, warps, stages),
shared by the launchers (mm_reduce_scatter_kernel, all_gather_mm_kernel) and the table of configs
measured per GPU (tuned)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one GEMM-shaped kernel.

    block_m/block_n/block_k: the output tile and the K step (powers of two, >= 16: tl.dot's minimum).
    group_m: row tiles per group in the grouped (L2-friendly) program order.
    num_warps/num_stages: Triton's; stages is the depth of the software pipeline of loads.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"KernelConfig.{name}: expected a power of two >= 16, found {v}")
        if self.group_m < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"KernelConfig: expected group_m, num_warps, num_stages >= 1, found {self}")
