"""Foundation benchmarks (pytest-benchmark): weight loading and per-supertask dispatch.

    pytest bench/test_bench_foundation.py --benchmark-columns=median,iqr,rounds
    pytest bench/ --benchmark-disable        # quick correctness pass

Each baseline is measured in the same run: `safetensors.torch.load_file` of the whole
checkpoint for load; the same ops as plain eager torch for dispatch.
"""
import pytest
import torch
from safetensors.torch import load_file

import fastpipe
from bench.pipelines import chain_reference, session_constants, touch_all, write_chain_pipeline, write_load_pipeline
from fastpipe.weights import WeightStore

CHAIN = 1000


@pytest.fixture(scope="module")
def load_files(tmp_path_factory):
    return write_load_pipeline(tmp_path_factory.mktemp("load"), total_mb=256)


@pytest.fixture(scope="module")
def chain_file(tmp_path_factory):
    return write_chain_pipeline(tmp_path_factory.mktemp("chain"), n=CHAIN)


@pytest.mark.benchmark(group="load")
def test_load_whole_file_baseline(benchmark, load_files):
    _, weights = load_files
    total = benchmark(lambda: touch_all(load_file(str(weights)).values()))
    whole = load_file(str(weights))
    assert sum(t.numel() for t in whole.values()) * 4 >= 200 * 2**20
    assert total == pytest.approx(touch_all(whole.values()), rel=1e-6)


@pytest.mark.benchmark(group="load")
def test_load_pipeline_slices(benchmark, load_files):
    pipeline, weights = load_files
    def load_and_read():
        sess = fastpipe.load(pipeline, store=WeightStore())
        touch_all(session_constants(sess))
        return sess

    sess = benchmark(load_and_read)
    whole = load_file(str(weights))
    assert touch_all(session_constants(sess)) == pytest.approx(touch_all(whole.values()), rel=1e-5)
    y = sess.run({"x": torch.zeros(1024)})
    per = next(iter(whole.values())).shape[0] // 2
    torch.testing.assert_close(y["y1"], sum(w[per] for w in whole.values()))


@pytest.mark.benchmark(group="dispatch")
def test_dispatch_eager_ops_baseline(benchmark):
    y = torch.randn(4)
    benchmark(chain_reference, y, CHAIN)


@pytest.mark.benchmark(group="dispatch")
def test_dispatch_reference_runtime(benchmark, chain_file):
    sess = fastpipe.load(chain_file)
    y = torch.randn(4)
    out = benchmark(sess.run, {"y0": y})
    torch.testing.assert_close(out[f"y{CHAIN}"], chain_reference(y, CHAIN))
