"""The weight store: load constants (slices of parameter files) safely and shared.

See ``store.py`` for sharing and contiguity, ``paths.py`` for path confinement,
``safetensors_header.py`` for header checks, ``formats.py`` per format.
"""
from .paths import resolve_param_path
from .ref import FORMATS, ParamRef
from .store import WeightStore, default_store

__all__ = ["FORMATS", "ParamRef", "WeightStore", "default_store", "resolve_param_path"]
