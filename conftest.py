"""Shared by tests/ and bench/: the Triton interpreter on CPU-only machines, clean skips of `cuda` tests, and
tests that read only the packaged measurement tables."""
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


@pytest.fixture(autouse=True)
def _plain_tests_see_a_cpu_machine(request, monkeypatch):
    """A test not marked `cuda` states what happens on a CPU machine, so on a GPU machine it runs as
    on one: the slots' default device is the CPU (fastpipe.runtime.binding.device_map.default_device would
    put `npu`/`cuda` slots on the GPU), and the processes it starts see no GPU. The GPU's own
    behaviour, the default placement there included, is the `cuda` tests' (run with `pytest -m cuda`).
    On a CPU machine the Triton interpreter runs the fused kernels on CPU tensors, so fuse="always" on
    CPU slots is accepted at load here too (the tests that launch them call tests/test_fusion.py's
    needs_cpu_kernels and skip: this process's kernels were built for the GPU)."""
    if torch.cuda.is_available() and request.node.get_closest_marker("cuda") is None:
        from fastpipe.runtime.binding import device_map
        from fastpipe.runtime.passes import fuse

        monkeypatch.setattr(device_map, "default_device", lambda kind, idx: torch.device("cpu"))
        monkeypatch.setattr(fuse, "_cannot_launch", lambda device: None)
        # CUDA first, in this process: before it is initialized torch.cuda.device_count() re-reads
        # CUDA_VISIBLE_DEVICES (and dynamo caches the device list it sees), so hiding the GPU from the
        # children would hide it from every later test of this worker (seen on the GPU machine)
        torch.cuda.init()
        assert torch.cuda.device_count() > 0
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(autouse=True)
def _tests_see_the_packaged_tables(request, monkeypatch):
    """The tests state what the packaged measurements decide (fastpipe.kernels.tuned, fusion_rule): a
    FASTPIPE_TUNED_CONFIGS the caller set (a table `fastpipe tune` wrote) is not theirs to read; the tests
    that need one set it. Benchmarks under bench/ keep it: timing a tuned table is what it is for."""
    if request.node.path.parent.name == "tests":
        monkeypatch.delenv("FASTPIPE_TUNED_CONFIGS", raising=False)
