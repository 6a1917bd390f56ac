"""Builder-made GPT-2 and Llama pipelines at prefill and decode shapes (tp=2 on one machine) vs the
unsplit Hugging Face model (eager and torch.compile), in one run. "llama512" is the runtime report's
model (bench/report_region.py): Llama decode step (4 layers, hidden 512, tp=2, 128 cached tokens,
batch 1) and its prefill step (batch 1, seq 64). Compiled variants compile before they are timed; the
compile seconds go to the row's extra_info as `compile_s`. Every fastpipe variant checks its logits
against the unsplit model's."""
import time

import pytest
import torch

import fastpipe

transformers = pytest.importorskip("transformers")

from bench.unsplit_calls import hf_call  # noqa: E402
from fastpipe.builder.hf.build import build_hf  # noqa: E402
from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint  # noqa: E402
from tests.tensor_compare import assert_close  # noqa: E402

CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_layer=4, n_embd=256, n_head=8, vocab_size=8000, n_positions=256),
    "llama": lambda: transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=8,
                                              num_key_value_heads=4, intermediate_size=1024, vocab_size=8000),
    "llama512": lambda: transformers.LlamaConfig(num_hidden_layers=4, hidden_size=512, num_attention_heads=8,
                                                 num_key_value_heads=4, intermediate_size=1408, vocab_size=8000),
}
SHAPES = {"prefill": dict(batch=1, seq_len=64, past_len=None), "decode": dict(batch=4, seq_len=1, past_len=64),
          "decode128": dict(batch=1, seq_len=1, past_len=128)}
CASES = [("gpt2", "prefill"), ("gpt2", "decode"), ("llama", "prefill"), ("llama", "decode"),
         ("llama512", "prefill"), ("llama512", "decode128")]
VARIANTS = ["unsplit eager", "unsplit compiled", "fastpipe reference", "fastpipe cpu compiled",
            "fastpipe region eager", "fastpipe region compiled", "fastpipe region compiled, shards kept"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_hf")
    return {f: (root / f, save_random_checkpoint(CONFIGS[f](), root / f, seed=0).eval()) for f in CONFIGS}


def _inputs(model, shape):
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (shape["batch"], shape["seq_len"]), generator=g)
    past = None
    if shape["past_len"]:
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        hd = cfg.hidden_size // heads
        layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
        past = [[torch.randn(shape["batch"], kv, shape["past_len"], hd, generator=g) for _ in range(2)] for _ in range(layers)]
    return ids, past


def _hf(model, ids, past):
    with torch.no_grad():
        return hf_call(model, ids, past)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family,shape", CASES)
def test_hf(benchmark, record, checkpoints, tmp_path, family, shape, variant):
    folder, model = checkpoints[family]
    benchmark.group = f"{family} {shape}"
    ids, past = _inputs(model, SHAPES[shape])
    ref = _hf(model, ids, past)
    extra = {}
    if variant.startswith("unsplit"):
        m = torch.compile(model) if variant == "unsplit compiled" else model
        if variant == "unsplit compiled":           # compile (the first call) before timing
            t = time.perf_counter()
            _hf(m, ids, past)
            extra["compile_s"] = time.perf_counter() - t
        out = benchmark(_hf, m, ids, past)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    else:
        compiled = "compiled" in variant
        if variant.startswith("fastpipe region"):   # one graph per device; "shards kept": merge_shards=False
            kw = dict(processor="region", merge_shards=not variant.endswith("shards kept"))
        else:
            kw = dict(processor="reference" if variant == "fastpipe reference" else "cpu")
        sess = fastpipe.load(build_hf(folder, tp=2, **SHAPES[shape]).save(tmp_path / "o"), compile=compiled, **kw)
        if compiled:
            rep = sess.compile()
            assert not rep.eager, f"{sess.describe()}: left eager by a failed compile: {rep.eager}"
            extra["compile_s"] = rep.seconds
        extra["path"] = sess.describe()
        kwargs = {"input_ids": ids} if past is None else {"input_ids": ids, "past_key_values": past}
        # the first call with the model's own inputs, timed apart: a recompile there (a guard that the
        # warm-up inputs did not exercise) shows as first_run_s and in pytest's warnings summary
        t = time.perf_counter()
        first = sess.run_model(**kwargs)
        extra["first_run_s"] = time.perf_counter() - t
        assert_close(first["logits"], ref, rtol=0.0, atol=1e-4 * ref.abs().max().item(), what="logits")
        out = benchmark(sess.run_model, **kwargs)
        assert_close(out["logits"], ref, rtol=0.0, atol=1e-4 * ref.abs().max().item(), what="logits")
    record(variant=variant, size=ids.numel(), **extra)
