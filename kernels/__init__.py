"""fastpipe.kernels: Triton kernels, each beside its torch reference and launcher.

The package is installed as ``fastpipe.kernels`` (see pyproject.toml). Importing it
imports nothing but the standard library: each name below loads its submodule on first
use. Without triton the package still imports; a Triton kernel that cannot run here (no
triton, or CPU tensors without ``TRITON_INTERPRET=1``) raises ``KernelUnavailable`` when it
is launched; the references and the ``_overlapped`` variants on CPU need torch alone.

Fused matmul + collective kernels (tensor parallelism's row- and column-parallel layers):

* ``matmul_reduce_scatter(a, b, dim=0, op="sum")`` -- chunk_j(sum_i a[i] @ b[i]; dim):
  every output tile accumulates all participants' K-slices in fp32 and is written once.
  ``matmul_reduce_scatter_reference`` is the plain-torch oracle;
  ``matmul_reduce_scatter_overlapped`` runs it for participants on different GPUs, each
  partial chunk sent to its destination (ring order) while the next one computes.
* ``all_gather_matmul(a, b, dim=0)`` -- cat(a; dim) @ b[j] for each j, reading each tile's
  rows (dim 0) or K-slices (dim 1) straight from the shard that holds them;
  ``all_gather_matmul_reference`` and ``all_gather_matmul_overlapped`` likewise.
* ``fused_is_faster(M, N, K_total, n, dtype)`` -- when to use the fused kernel (a
  documented placeholder rule until GPU measurements replace it); ``pick_config`` and
  ``KernelConfig`` -- the launchers' block-size heuristic and its override.

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors; that is how the tests run
without a GPU. Set it before triton is first imported (Triton's own library functions,
``tl.zeros`` and the like, are defined then), i.e. before these kernel modules load.
"""
from __future__ import annotations

import importlib
import sys
import types

# name -> submodule that defines it. Imported on first use: importing this package stays
# cheap and imports neither triton nor the kernels. That matters beyond speed: with the
# repository root on sys.path this directory is also importable as a top-level ``kernels``
# package, which transformers imports while probing for Hugging Face's ``kernels``; an
# eager import here would import triton before a test could set TRITON_INTERPRET=1.
_EXPORTS = {
    "KernelConfig": "matmul_reduce_scatter",
    "KernelUnavailable": "matmul_reduce_scatter",
    "fused_is_faster": "matmul_reduce_scatter",
    "matmul_reduce_scatter": "matmul_reduce_scatter",
    "matmul_reduce_scatter_overlapped": "matmul_reduce_scatter",
    "matmul_reduce_scatter_reference": "matmul_reduce_scatter",
    "pick_config": "matmul_reduce_scatter",
    "all_gather_matmul": "all_gather_matmul",
    "all_gather_matmul_overlapped": "all_gather_matmul",
    "all_gather_matmul_reference": "all_gather_matmul",
}

__all__ = sorted(_EXPORTS)


class _Package(types.ModuleType):
    """This package's module type: ``matmul_reduce_scatter`` and ``all_gather_matmul`` are both
    submodules and functions. The import system binds a submodule as an attribute of its package
    once loaded; keep the function of that name instead (reach a submodule through
    ``sys.modules["fastpipe.kernels.<name>"]`` or ``from fastpipe.kernels.<name> import ...``)."""

    def __setattr__(self, name, value):
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __getattr__(self, name):
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        super().__setattr__(name, value)
        return value

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_EXPORTS))


sys.modules[__name__].__class__ = _Package
