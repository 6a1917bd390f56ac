"""Every example in graphs/: the unsplit module (eager, torch.compile) vs fastpipe (reference runtime,
cpu processor eager and compiled), in one run. `--benchmark-disable` turns it into a correctness pass."""
import pytest
import torch
from safetensors.torch import load_file

import fastpipe
from fastpipe.format import read_pipeline
from tests.examples import EXAMPLES, GRAPHS, unsplit_module

VARIANTS = ["unsplit eager", "unsplit compiled", "fastpipe reference", "fastpipe cpu eager", "fastpipe cpu compiled",
            pytest.param("fastpipe cuda streams", marks=pytest.mark.cuda),
            pytest.param("fastpipe cuda replay", marks=pytest.mark.cuda)]


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
    if variant.startswith("unsplit"):
        m = unsplit_module(name)
        fn = torch.compile(m) if variant == "unsplit compiled" else m
        args = _model_inputs(name, ins)
        with torch.no_grad():
            out = benchmark(fn, *args)
        assert torch.isfinite(out).all()
    elif variant.startswith("fastpipe cuda"):
        dm = {s: "cuda:0" for s in read_pipeline(GRAPHS / name / "pipeline.json").devices}
        sess = fastpipe.load(GRAPHS / name / "pipeline.json", device_map=dm, processor="cuda", compile=True,
                             cuda_graph=variant.endswith("replay"))
        sess.compile()
        gins = {k: v.cuda() for k, v in ins.items()}

        def step():
            out = sess.run(gins)
            torch.cuda.synchronize()
            return out

        out = benchmark(step)
        for k, v in expected.items():
            torch.testing.assert_close(out[k].cpu(), v, rtol=1e-4, atol=1e-5)
    else:
        proc = "reference" if variant == "fastpipe reference" else "cpu"
        sess = fastpipe.load(GRAPHS / name / "pipeline.json", processor=proc, compile=variant.endswith("compiled"))
        if variant.endswith("compiled"):
            sess.compile()
        out = benchmark(sess.run, ins)
        for k, v in expected.items():
            torch.testing.assert_close(out[k], v, rtol=1e-4, atol=1e-5)
    record(variant=variant, size=sum(t.numel() for t in ins.values()))
