"""fastpipe.kernels: Triton kernels, each beside its torch reference and launcher.

Importing the package imports nothing but the standard library: each name below loads
its module on first use (``mm_reduce_scatter_kernel``: matmul_reduce_scatter, its
reference and overlapped variant, the shared launch helpers; ``all_gather_mm_kernel``:
all_gather_matmul and its variants; ``fusion_rule``: ``fused_is_faster``). No module is
named after a function it defines, so ``fastpipe.kernels.matmul_reduce_scatter`` is always the function.

Without triton the package still imports; a Triton kernel that cannot run here (no triton,
or CPU tensors without ``TRITON_INTERPRET=1``) raises ``KernelUnavailable`` when it is
launched; the references and the ``_overlapped`` variants on CPU need torch alone.

Fused matmul + collective kernels (tensor parallelism's row- and column-parallel layers):

* ``matmul_reduce_scatter(a, b, dim=0, op="sum")`` -- chunk_j(sum_i a[i] @ b[i]; dim):
  every output tile accumulates all participants' K-slices in fp32 and is written once.
  ``matmul_reduce_scatter_reference`` is the plain-torch oracle;
  ``matmul_reduce_scatter_overlapped`` runs it for participants on different GPUs, each
  partial chunk sent to its destination (ring order) while the next one computes.
* ``all_gather_matmul(a, b, dim=0)`` -- cat(a; dim) @ b[j] for each j, reading each tile's
  rows (dim 0) or K-slices (dim 1) straight from the shard that holds them;
  ``all_gather_matmul_reference`` and ``all_gather_matmul_overlapped`` likewise.
* ``fused_is_faster(M, N, K_total, n, dtype, kernel=..., dim=0, gpu=None)`` -- whether
  ``fuse="auto"`` uses the fused kernel on that GPU model: where it was measured faster than the
  runtime's unfused path (the nearest point of ``fusion_measured.json`` measured on that GPU, or
  on any where that GPU was not measured; measured by
  ``bench/bench_fused_kernels.py``; ``fusion_rule.estimate`` gives the reason too);
  ``pick_config`` and ``KernelConfig`` -- the launchers' block-size heuristic and its override
  (``KernelConfig.split_k``, for both launchers, and ``.tma``, the persistent TMA kernels, are options
  only a config measured on the GPU or passed by the caller picks).

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors; that is how the tests run
without a GPU. Set it before triton is first imported (Triton's own library functions,
``tl.zeros`` and the like, are defined then), i.e. before these kernel modules load.
``_triton_compat`` fixes the interpreter of Triton <= 3.6 for numpy >= 2.4 (loop bounds
given at run time), on import of the kernels.
"""
from __future__ import annotations

import importlib

# name -> module that defines it, imported on first use (PEP 562): importing this package stays
# cheap and imports neither triton nor the kernels, so TRITON_INTERPRET=1 may still be set after
# ``import fastpipe.kernels`` and before the first kernel is used.
_EXPORTS = {
    "KernelConfig": "mm_reduce_scatter_kernel",
    "KernelUnavailable": "mm_reduce_scatter_kernel",
    "fused_is_faster": "fusion_rule",
    "matmul_reduce_scatter": "mm_reduce_scatter_kernel",
    "matmul_reduce_scatter_overlapped": "mm_reduce_scatter_kernel",
    "matmul_reduce_scatter_reference": "mm_reduce_scatter_kernel",
    "pick_config": "mm_reduce_scatter_kernel",
    "all_gather_matmul": "all_gather_mm_kernel",
    "all_gather_matmul_overlapped": "all_gather_mm_kernel",
    "all_gather_matmul_reference": "all_gather_mm_kernel",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
