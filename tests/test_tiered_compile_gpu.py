"""Tiered compiles on a GPU (cuda-marked: skipped without one): the region runs eagerly at once, compiles in
the background, is adopted without measuring, and only then is the whole run captured as a CUDA graph, at
a call, on that call's inputs; outputs equal the reference processor's throughout."""
from __future__ import annotations

import pytest
import torch

import fastpipe
from fastpipe.runtime.compiling.background_compile import background
from tests.examples import GRAPHS

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def test_eager_then_compiled_then_captured_on_one_gpu():
    path = GRAPHS / "seq_parallel" / "pipeline.json"
    ref = fastpipe.load(path, processor="reference")
    dm = {s: "cuda:0" for s in ref.pipeline.devices}
    sess = fastpipe.load(path, device_map=dm)
    assert sess.processor == "region" and sess.background
    g = torch.Generator().manual_seed(3)
    ins = {n: torch.randn(ref.pipeline.tensors[n].shape, generator=g) for n in ref.pipeline.input_names}
    want = ref.run(ins)
    replay = sess.runner.replay
    (cg,) = sess.runner.compiled_graphs().values()
    for _ in range(2):                                # eager; the second call queues the compile
        out = sess.run(ins)
        assert not replay.replaying
    assert cg._queued or cg._ready, cg.state()       # never skipped on a GPU (no estimate there)
    assert background().wait_idle(600) and cg._ready
    sess.run(ins)                                     # adopted (no measuring on a GPU); the capture follows
    assert cg.compiled and not cg.use_eager and sess.compile_settled()
    for _ in range(3):
        out = sess.run(ins)
    torch.cuda.synchronize()
    assert replay.replaying and replay.failure is None and "replayed as one CUDA graph" in sess.describe()
    for k in want:
        torch.testing.assert_close(out[k].cpu(), want[k], rtol=1e-4, atol=1e-4)
