"""Compatibility fixes for Triton's CPU interpreter (``TRITON_INTERPRET=1``), applied once on import.

numpy >= 2.4 refuses ``int()`` of an array with ndim > 0 (deprecated since numpy 1.25). The
interpreter of Triton <= 3.6 holds every scalar as a 1-element 1-D array and converts it with
``int(self.handle.data)`` in ``tensor.__index__``, so any kernel whose loop bound is a runtime
value (``for k in range(0, tl.cdiv(K, BLOCK_K))``, as both fused kernels have) fails with
``TypeError: only 0-dimensional arrays can be converted to Python scalars``. Triton 3.8 fixed
it upstream (``int(self.handle.data.squeeze())``); :func:`apply` installs the same fix on an
older interpreter, and only where numpy refuses the conversion. Compiled (GPU) kernels are
never touched: the interpreter's patching runs only under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import inspect

_BROKEN = "int(self.handle.data)"


def _numpy_refuses_1d_int() -> bool:
    import numpy as np

    try:
        int(np.array([1]))
    except TypeError:
        return True
    return False


def _index(self) -> int:
    return int(self.handle.data.reshape(-1)[0]) if self.handle.data.size == 1 else int(self.handle.data)


def apply() -> bool:
    """Fix the interpreter's ``tensor.__index__`` when it needs it; True when a fix was installed."""
    try:
        from triton.runtime import interpreter
    except Exception:  # no triton, or one without the interpreter module: nothing to fix
        return False
    orig = getattr(interpreter, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_fastpipe_compat", False) or not _numpy_refuses_1d_int():
        return False
    try:
        if _BROKEN not in inspect.getsource(orig):
            return False          # a fixed interpreter (Triton >= 3.8)
    except (OSError, TypeError):
        pass                      # no source to read: the fix is harmless on a fixed interpreter

    def _patch_lang_tensor(tensor, *args, **kwargs):
        orig(tensor, *args, **kwargs)
        scope = args[0] if args else kwargs.get("scope")
        if scope is not None and hasattr(scope, "set_attr"):
            scope.set_attr(tensor, "__index__", _index)   # restored with the interpreter's own patches
        else:
            tensor.__index__ = _index

    _patch_lang_tensor._fastpipe_compat = True
    interpreter._patch_lang_tensor = _patch_lang_tensor
    return True
