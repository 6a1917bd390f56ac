"""Generation rows for pytest-benchmark: one greedy generation at batch 1 (the engine, compiled and eager,
vs transformers' generate with its static cache, eager and compiled), and 16 requests through a batch-8
engine from 8 threads vs one at a time. Tokens are checked against transformers' in every row.
The printed comparison (and the RSS and load-test rows) is bench/report_serving.py."""
import pytest

transformers = pytest.importorskip("transformers")

from bench.generation_cases import hf_generate, load_requests, make_model, make_set, one_at_a_time, serve  # noqa: E402
from fastpipe.serving.engine import Engine  # noqa: E402

NEW = 32
MAX_LEN = 128         # the engine's static cache; transformers' gets as many positions (equal attention work)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_generation")
    mdir, model = make_model(root, layers=2, hidden=256, vocab=4000)
    folder = make_set(mdir, root / "set", max_len=MAX_LEN, batches=(1, 8), prompt_lens=(16, 64), tp=2)
    prompt = list(range(3, 19))
    return model, folder, prompt, hf_generate(model, prompt, NEW, compiled=False)


@pytest.mark.parametrize("variant", ["transformers eager", "transformers compiled", "engine eager", "engine compiled"])
def test_decode_batch1(benchmark, record, served, variant):
    model, folder, prompt, ref = served
    benchmark.group = f"greedy generation, batch 1, {NEW} tokens"
    if variant.startswith("transformers"):
        compiled = variant.endswith("compiled")
        hf_generate(model, prompt, NEW, compiled=compiled, max_cache_len=MAX_LEN)     # compile before timing
        toks = benchmark(hf_generate, model, prompt, NEW, compiled=compiled, max_cache_len=MAX_LEN)
        record(tokens=NEW)
    else:
        with Engine(folder, batch=1, eos_token_id=None, compile=variant.endswith("compiled")) as eng:
            toks = benchmark(lambda: eng.generate([prompt], max_new_tokens=NEW, ignore_eos=True)[0])
            record(tokens=NEW, warmup_s=eng.warmup_seconds, how=eng.decode.describe())
    assert toks == ref


@pytest.mark.parametrize("variant", ["one at a time, batch 1", "continuous batching, batch 8"])
def test_continuous_batching(benchmark, record, served, variant):
    model, folder, _, _ = served
    benchmark.group = "16 requests, greedy"
    prompts, news = load_requests(16, 4000, prompt=(8, 64), new=(8, 32))
    batched = variant.startswith("continuous")
    with Engine(folder, batch=8 if batched else 1, eos_token_id=None) as eng:
        run = (lambda: serve(eng, prompts, news)[0]) if batched else (lambda: one_at_a_time(eng, prompts, news)[0])
        out = benchmark.pedantic(run, rounds=3, iterations=1)
        record(tokens=sum(news))
    assert out[0] == hf_generate(model, prompts[0], news[0], compiled=False)
