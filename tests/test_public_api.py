"""The public names of ``fastpipe`` stay what they are, whatever else gets imported.

A subpackage whose name equals a public function (``fastpipe/build/`` beside
``fastpipe.build(...)``) is rebound over that function as soon as any of its submodules
is imported, so ``fastpipe.build(...)`` worked once and then raised
``TypeError: 'module' object is not callable``.
"""
import importlib
import importlib.util
import pkgutil
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fastpipe
import fastpipe.builder


class Block(nn.Module):
    """tests/test_build_core.py's smallest TP case: a column- then a row-parallel linear."""

    def __init__(self, d=8, h=16):
        super().__init__()
        self.fc1, self.fc2, self.ln = nn.Linear(d, h), nn.Linear(h, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(x + self.fc2(F.gelu(self.fc1(x))))


def _import_every_builder_module():
    for info in pkgutil.walk_packages(fastpipe.builder.__path__, prefix="fastpipe.builder."):
        importlib.import_module(info.name)


def test_no_submodule_shares_a_public_name():
    import fastpipe.kernels

    for package in (fastpipe, fastpipe.kernels):
        for name in package.__all__:
            full = f"{package.__name__}.{name}"
            assert importlib.util.find_spec(full) is None, (
                f"{full} is both a public name and a submodule: importing the submodule rebinds the name")


def test_kernel_names_stay_functions_after_their_modules_load():
    """fastpipe/runtime/passes/fuse.py calls ``kernels.matmul_reduce_scatter(...)`` after ``from fastpipe import kernels``."""
    from fastpipe import kernels

    for info in pkgutil.iter_modules(kernels.__path__, prefix="fastpipe.kernels."):
        importlib.import_module(info.name)
    for name in ("matmul_reduce_scatter", "all_gather_matmul", "matmul_reduce_scatter_reference",
                 "all_gather_matmul_reference", "matmul_reduce_scatter_overlapped", "all_gather_matmul_overlapped",
                 "fused_is_faster", "pick_config"):
        assert callable(getattr(kernels, name)) and not isinstance(getattr(kernels, name), type(kernels)), name
    assert set(kernels.__all__) <= set(dir(kernels))


def test_build_twice_in_one_process(tmp_path):
    _import_every_builder_module()
    assert callable(fastpipe.build) and not isinstance(fastpipe.build, type(fastpipe))
    torch.manual_seed(0)
    m = Block().eval()
    x = torch.randn(5, 8)
    plan = {"fc1": "column", "fc2": "row"}
    first = fastpipe.build(m, (x,), tp=2, plan=plan)
    second = fastpipe.build(m, (x,), tp=2, plan=plan)      # raised TypeError with fastpipe/build/
    assert first.doc == second.doc
    with torch.no_grad():
        ref = m(x)
    for i, built in enumerate((first, second)):
        out = fastpipe.load(built.save(tmp_path / f"out{i}")).run({"input_0": x})
        torch.testing.assert_close(out["output"], ref, rtol=1e-4, atol=1e-5)


def test_bad_build_input_raises_build_error():
    """The builder's refusals are FastpipeErrors (exit 2), and still ValueErrors for older callers."""
    from fastpipe.builder.dimops import AnnotationError
    from fastpipe.errors import BuildError, FastpipeError, InvalidInput

    m, x = Block().eval(), torch.randn(5, 8)
    for kwargs, message in [
        ({"tp": 2, "plan": {"nope": "column"}}, "plan: no submodule named 'nope'"),
        ({"tp": 2, "plan": {"fc1": "diagonal"}}, "plan['fc1']: expected column, column_gather, row or vocab"),
        ({"pp": 2}, "pp=2 needs 1 split points"),
        ({"tp": 0}, "tp and pp must be >= 1"),
        ({"tp": 3, "plan": {"fc1": "column", "fc2": "row"}}, "cannot split 16 evenly over 3 ranks"),
    ]:
        with pytest.raises(BuildError, match=re.escape(message)) as info:
            fastpipe.build(m, (x,), **kwargs)
        err = info.value
        assert isinstance(err, FastpipeError) and isinstance(err, InvalidInput) and isinstance(err, ValueError)
        assert err.exit_code == 2
    with pytest.raises(BuildError, match="example_inputs are for nn.Module models"):
        fastpipe.build("some/hf_dir", (x,))
    assert issubclass(AnnotationError, BuildError)
