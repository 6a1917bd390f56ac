"""Shared by tests/ and bench/: the Triton interpreter on CPU-only machines, and clean skips of `cuda` tests."""
import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through the interpreter; it must be set before triton is
    # first imported (transformers may import it early), hence here.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests and benchmarks marked `cuda` are skipped cleanly (with the reason) where CUDA is unavailable."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m cuda` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
