"""What differs between the transformers versions fastpipe traces with.

    model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache})

transformers 5.2x renamed the forward's cache argument from ``past_key_values`` to ``cache`` and
deprecates the old name (a FutureWarning per call; removal announced for 5.40); the versions before
know only ``past_key_values`` (the GPU machine has 5.17). The name is read from the forward's
signature, once per model class.
"""
from __future__ import annotations

import functools
import inspect


def cache_keyword(model) -> str:
    """The forward's name for the KV cache: "cache" where the forward takes it, else "past_key_values".
    `model` may be compiled (an OptimizedModule: its _orig_mod's forward)."""
    return _cache_keyword(type(getattr(model, "_orig_mod", model)))


@functools.lru_cache(maxsize=None)
def _cache_keyword(cls) -> str:         # once per model class: callers are timed, inspect.signature is not cheap
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
