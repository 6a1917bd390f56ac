"""Every example in graphs/: the unsplit module (eager, torch.compile) vs fastpipe (reference runtime,
cpu processor eager and compiled; region processor eager, compiled, and compiled with the shard matmuls
kept; on a GPU, marked `cuda`: the cuda processor on streams and replayed, the region processor with and
without CUDA-graph replay, the unsplit module compiled on the GPU), in one run. Compiled variants compile
before they are timed; the compile seconds go to the
row's extra_info as `compile_s`, apart from the run time. `--benchmark-disable` turns it into a
correctness pass."""
import time

import pytest
import torch
from safetensors.torch import load_file

import fastpipe
from fastpipe.format import read_pipeline
from tests.examples import EXAMPLES, GRAPHS, unsplit_module

VARIANTS = ["unsplit eager", "unsplit compiled", "fastpipe reference", "fastpipe cpu eager", "fastpipe cpu compiled",
            "fastpipe region eager", "fastpipe region compiled", "fastpipe region compiled, shards kept",
            pytest.param("fastpipe cuda streams", marks=pytest.mark.cuda),
            pytest.param("fastpipe cuda replay", marks=pytest.mark.cuda),
            pytest.param("fastpipe cuda region", marks=pytest.mark.cuda),
            pytest.param("fastpipe cuda region replay", marks=pytest.mark.cuda),
            pytest.param("unsplit cuda compiled", marks=pytest.mark.cuda)]


def _model_inputs(name, pipeline_inputs):
    """The unsplit module's arguments, rebuilt from the pipeline inputs via metadata."""
    p = read_pipeline(GRAPHS / name / "pipeline.json")
    origin = {}
    for t, s in p.metadata.slices_inputs.items():
        o = p.metadata.tensors_inputs[s.origin]
        buf = origin.setdefault(s.origin, torch.empty(o.shape))
        buf[tuple(slice(a, b) for a, b in s.placements)] = pipeline_inputs[t]
    return [origin[n] for n, _ in sorted(p.metadata.tensors_inputs.items(), key=lambda kv: kv[1].idx)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", EXAMPLES)
def test_example(benchmark, record, name, variant):
    benchmark.group = f"example {name}"
    ins = load_file(str(GRAPHS / name / "inputs.safetensors"))
    expected = load_file(str(GRAPHS / name / "expected.safetensors"))
    extra = {}
    if variant.startswith("unsplit"):
        m = unsplit_module(name)
        args = _model_inputs(name, ins)
        if variant == "unsplit cuda compiled":
            m, args = m.cuda(), [a.cuda() for a in args]
        fn = torch.compile(m) if variant.endswith("compiled") else m

        def call(*xs):
            out = fn(*xs)
            if variant.startswith("unsplit cuda"):
                torch.cuda.synchronize()
            return out

        with torch.no_grad():
            if variant.endswith("compiled"):      # compile (the first call) before timing
                t = time.perf_counter()
                call(*args)
                extra["compile_s"] = time.perf_counter() - t
            out = benchmark(call, *args)
        assert torch.isfinite(out).all()
    elif variant.startswith("fastpipe cuda"):
        dm = {s: "cuda:0" for s in read_pipeline(GRAPHS / name / "pipeline.json").devices}
        sess = fastpipe.load(GRAPHS / name / "pipeline.json", device_map=dm, compile=True,
                             processor="region" if "region" in variant else "cuda",
                             cuda_graph=variant.endswith("replay"))
        extra["compile_s"] = sess.compile().seconds
        extra["path"] = sess.describe()
        gins = {k: v.cuda() for k, v in ins.items()}

        def step():
            out = sess.run(gins)
            torch.cuda.synchronize()
            return out

        out = benchmark(step)
        for k, v in expected.items():
            torch.testing.assert_close(out[k].cpu(), v, rtol=1e-4, atol=1e-5)
    else:
        compiled = "compiled" in variant
        if variant.startswith("fastpipe region"):    # one graph per device; "shards kept": merge_shards=False
            kw = dict(processor="region", merge_shards=not variant.endswith("shards kept"))
        else:
            kw = dict(processor="reference" if variant == "fastpipe reference" else "cpu")
        sess = fastpipe.load(GRAPHS / name / "pipeline.json", compile=compiled, **kw)
        if compiled:
            rep = sess.compile()
            assert not rep.eager, f"{sess.describe()}: left eager by a failed compile: {rep.eager}"
            extra["compile_s"] = rep.seconds
        extra["path"] = sess.describe()
        out = benchmark(sess.run, ins)
        for k, v in expected.items():
            torch.testing.assert_close(out[k], v, rtol=1e-4, atol=1e-5)
    record(variant=variant, size=sum(t.numel() for t in ins.values()), **extra)
