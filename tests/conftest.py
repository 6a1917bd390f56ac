import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are skipped cleanly (with the reason) where CUDA is unavailable."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m cuda` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
