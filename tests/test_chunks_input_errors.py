"""Session.run(inputs, chunks=k) with inputs that do not fit k micro-batches: every refusal is an
InputError with a one-line message, under every in-process processor (never a raw IndexError,
KeyError or torch's RuntimeError)."""
import re

import numpy as np
import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.errors import InputError
from fastpipe.runtime.binding.microbatch import split_chunks
from tests.examples import GRAPHS

PROCESSORS = ["reference", "cpu", "region"]
K = 2
B = 8                                # graphs/tp_mlp: input "x" is [8, 64] f32


@pytest.fixture(scope="module", params=PROCESSORS)
def tp_mlp(request):
    return fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor=request.param)


def _rows(n, cols=64, dtype=torch.float32):
    return torch.zeros((n, cols), dtype=dtype)


def _dim0(found):
    return re.escape(f"inputs[\"x\"].shape[0]: expected {K * B} (chunks={K} x the pipeline's batch {B}), found {found}")


@pytest.mark.parametrize("n", [0, 1, B - 1, B, K * B - 1, K * B + 1, (K + 1) * B, 3 * K * B])
def test_wrong_dim0_is_an_input_error(tp_mlp, n):
    with pytest.raises(InputError, match=_dim0(n) + "$"):
        tp_mlp.run({"x": _rows(n)}, chunks=K)


def test_0dim_tensor_is_an_input_error(tp_mlp):
    with pytest.raises(InputError, match=_dim0("a scalar") + "$"):
        tp_mlp.run({"x": torch.tensor(1.0)}, chunks=K)


@pytest.mark.parametrize("value, kind", [([1.0, 2.0], "list"), (3, "int"), (None, "NoneType"),
                                         (np.zeros((K * B, 64), np.float32), "ndarray")])
def test_non_tensor_is_an_input_error(tp_mlp, value, kind):
    with pytest.raises(InputError, match=re.escape(f"inputs[\"x\"]: expected a torch.Tensor, found {kind}") + "$"):
        tp_mlp.run({"x": value}, chunks=K)


def test_other_dims_are_checked_against_the_whole_chunked_shape(tp_mlp):
    with pytest.raises(InputError, match=re.escape(f"inputs[\"x\"].shape: expected [{K * B}, 64], found [{K * B}, 65]") + "$"):
        tp_mlp.run({"x": _rows(K * B, cols=65)}, chunks=K)
    with pytest.raises(InputError, match=re.escape(f"inputs[\"x\"].shape: expected [{K * B}, 64], found [{K * B}]") + "$"):
        tp_mlp.run({"x": torch.zeros(K * B)}, chunks=K)
    with pytest.raises(InputError, match=re.escape("inputs[\"x\"].dtype: expected f32, found f64") + "$"):
        tp_mlp.run({"x": _rows(K * B, dtype=torch.float64)}, chunks=K)


def test_names_are_checked(tp_mlp):
    with pytest.raises(InputError, match=re.escape("inputs[\"zz\"]: expected one of the pipeline inputs (x), found an unknown name")):
        tp_mlp.run({"x": _rows(K * B), "zz": torch.zeros(1)}, chunks=K)          # was a raw KeyError
    with pytest.raises(InputError, match=re.escape("inputs[\"y\"]: expected one of the pipeline inputs (x), found an unknown name")):
        tp_mlp.run({"x": _rows(K * B), "y": _rows(K * B)}, chunks=K)             # a pipeline tensor, not an input
    with pytest.raises(InputError, match=re.escape("inputs[\"x\"]: expected a tensor for this pipeline input, found none")):
        tp_mlp.run({}, chunks=K)


def test_right_inputs_still_run(tp_mlp):
    x = torch.randn(K * B, 64, generator=torch.Generator().manual_seed(0))
    out = tp_mlp.run({"x": x}, chunks=K)
    for c in range(K):
        torch.testing.assert_close(out["y"][c * B:(c + 1) * B], tp_mlp.run({"x": x[c * B:(c + 1) * B]})["y"],
                                   rtol=1e-5, atol=1e-6)


class _ScalarIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x, t):
        return self.l(x) * t


class _ScalarOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        y = self.l(x)
        return y, y.sum()


@pytest.fixture(scope="module")
def scalar_pipelines(tmp_path_factory):
    d = tmp_path_factory.mktemp("scalar")
    torch.manual_seed(0)
    a = fastpipe.build(_ScalarIn(), (torch.randn(4, 8), torch.tensor(2.0)), input_names=["x", "t"]).save(d / "in")
    b = fastpipe.build(_ScalarOut(), (torch.randn(4, 8),), input_names=["x"], output_names=["y", "total"]).save(d / "out")
    return a, b


@pytest.mark.parametrize("processor", PROCESSORS)
def test_0dim_pipeline_input_refuses_chunks(scalar_pipelines, processor):
    sess = fastpipe.load(scalar_pipelines[0], processor=processor)
    assert sess.run({"x": torch.randn(4, 8), "t": torch.tensor(2.0)})["output"].shape == (4, 8)
    msg = re.escape(f"chunks: expected 1 (the pipeline input \"t\" has shape [], no dim 0 to split micro-batches "
                    f"along), found {K}") + "$"
    for t in (torch.tensor(2.0), torch.ones(K), [2.0]):                 # was a raw IndexError
        with pytest.raises(InputError, match=msg):
            sess.run({"x": torch.randn(K * 4, 8), "t": t}, chunks=K)


@pytest.mark.parametrize("processor", PROCESSORS)
def test_0dim_pipeline_output_refuses_chunks(scalar_pipelines, processor):
    sess = fastpipe.load(scalar_pipelines[1], processor=processor)
    assert sess.run({"x": torch.randn(4, 8)})["total"].shape == ()
    with pytest.raises(InputError, match=re.escape(f"chunks: expected 1 (the pipeline output \"total\" has shape [], no "
                                                   f"dim 0 to concatenate micro-batches along), found {K}") + "$"):
        sess.run({"x": torch.randn(K * 4, 8)}, chunks=K)                 # was torch.cat's RuntimeError


def test_split_chunks_gives_one_part_per_chunk():
    parts = split_chunks({"x": torch.zeros(0, 3), "y": torch.arange(6).reshape(6, 1)}, 3, {"x": 0, "y": 2})
    assert len(parts) == 3 and all(set(p) == {"x", "y"} for p in parts)        # a batch of 0 too
    assert [p["y"].flatten().tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(InputError, match=re.escape("inputs[\"y\"].shape[0]: expected 6 (chunks=3 x the pipeline's batch 2), "
                                                   "found a scalar") + "$"):
        split_chunks({"y": torch.tensor(1)}, 3, {"y": 2})


def test_dist_processor_refuses_chunks_of_a_0dim_input(scalar_pipelines):
    """The dist processor checks chunked inputs the same way (one rank under torchrun)."""
    from tests.test_distributed import torchrun

    proc = torchrun(1, str(scalar_pipelines[0]), "--chunks", "2", "--no-compile", "--repeat", "1")
    assert proc.returncode != 0      # the rank exits 2; torchrun reports a failed child as 1
    assert ('fastpipe: error: [rank 0] chunks: expected 1 (the pipeline input "t" has shape [], no dim 0 to split '
            'micro-batches along), found 2') in proc.stderr.splitlines()


def test_cli_run_refuses_chunks_of_a_0dim_input(scalar_pipelines):
    """`fastpipe run --chunks 2` on random inputs: a 0-dim input is not repeated, and the run says why."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "fastpipe", "run", str(scalar_pipelines[0]), "--chunks", "2",
                           "--no-compile", "--repeat", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ['fastpipe: error: chunks: expected 1 (the pipeline input "t" has '
                                                'shape [], no dim 0 to split micro-batches along), found 2']
