"""Model families of the Hugging Face builder, as registered specs (``FamilySpec``).

    spec = family_for(config)            # by config.model_type, then the family's own checks
    spec = get_family("llama")           # by name
    supported_model_types()              # ['bert', 'gpt2', 'llama', 'mistral', 'qwen2']

Each family is one module of this folder (gpt2.py, llama.py, bert.py, qwen2.py, mistral.py)
that builds its ``FamilySpec`` and calls ``register_family``; importing this package imports
every module of the folder, so a new built-in family is one new file here (plus its tests).
A family defined outside the library registers the same way, before building:

    from fastpipe.builder.hf.families import FamilySpec, register_family
    register_family(FamilySpec(name=..., model_types=(...), model_class=..., layers=..., tp_rules=...))

(``with registered(spec): ...`` registers it for a block only). The registry and the fields
of a spec: fastpipe.builder.hf.families.registry. Importing this package does not import
transformers.
"""
from __future__ import annotations

import importlib
import pkgutil

from fastpipe.builder.hf.families.registry import (
    Dims, FamilySpec, accept_all, family_for, family_for_model_type, get_family, mha_dims, no_load_kwargs, refuse,
    register_family, registered, registered_families, supported_model_types, unregister_family,
)

__all__ = [
    "Dims", "FamilySpec", "accept_all", "family_for", "family_for_model_type", "get_family", "mha_dims",
    "no_load_kwargs", "refuse", "register_family", "registered", "registered_families", "supported_model_types",
    "unregister_family",
]


def _import_family_modules() -> None:
    """Import every module of this folder but the registry: each registers its family."""
    for info in pkgutil.iter_modules(__path__):
        if info.name != "registry" and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


_import_family_modules()
