"""The continuous-batching engine over a serving set: tokens equal transformers' generate, rows join and
leave between steps, a fixed set of pipelines and graphs serves any number of tokens, bad input fails alone."""
import threading
import time

import pytest
import torch

from fastpipe.errors import InputError, RunError
from fastpipe.serving.build import build_serving_set
from fastpipe.serving.engine import Engine
from fastpipe.serving.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint  # noqa: E402

MAX_LEN = 80          # prompts up to 16 tokens + 64 new ones
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                              num_key_value_heads=2, intermediate_size=128, vocab_size=100),
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=99, n_positions=128),
}
TP = {"llama": 2, "gpt2": 1}


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def served(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    model = save_random_checkpoint(CONFIGS[family](), root / "m", seed=11).eval()
    paths = build_serving_set(root / "m", root / "set", max_len=MAX_LEN, batches=(1, 4), prompt_lens=(8, 16),
                              tp=TP[family])
    return family, model, root / "set", paths


@pytest.fixture(scope="module")
def llama_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_engine")
    model = save_random_checkpoint(CONFIGS["llama"](), root / "m", seed=3).eval()
    build_serving_set(root / "m", root / "set", max_len=48, batches=(2, 4), prompt_lens=(8, 16), tp=2)
    return model, root / "set"


def _prompts(n, seed, vocab, lo=1, hi=16):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


def _hf_greedy(model, prompt, n, eos=None):
    """transformers' greedy generate for one prompt (an explicit all-ones mask: without one, generate
    masks every prompt token equal to pad_token_id)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_tokens_equal_transformers_generate(served):
    """A batch of prompts of mixed lengths, more than the decode rows, 64 new tokens each: one decode
    pipeline per batch bucket, each request's tokens equal transformers' greedy generate."""
    family, model, folder, paths = served
    vocab = model.config.vocab_size
    prompts = _prompts(6, 1, vocab)
    assert len({len(p) for p in prompts}) > 2
    with Engine(folder, eos_token_id=None, compile=False) as eng:
        assert eng.batch == 4 and len(eng.buckets.decodes) == 2 and len(paths) == 2 * (2 + 1)
        got = eng.generate(prompts, max_new_tokens=64)
        assert eng.steps < 6 * 63          # requests shared the decode steps
    for p, toks in zip(prompts, got):
        assert toks == _hf_greedy(model, p, 64)


def test_prefills_write_the_prompts_into_the_engines_cache(served, monkeypatch):
    """The serving set's prefills take logits_index [B], cache_row [B] and the caches [R, Hkv, M, D] (R = the
    largest batch) and return logits [B, 1, V] and those caches, updated: the engine hands them its own
    cache tensors, nothing is returned to be copied (KVState.admit is never called), and its tokens are
    checked above."""
    from fastpipe.format import read_pipeline
    from fastpipe.serving.buckets import last_logits_only, writes_cache
    from fastpipe.serving.kv_state import KVState

    family, model, folder, paths = served
    prefills = [read_pipeline(p) for p in paths if p.parent.name.startswith("prefill_")]
    assert len(prefills) == 4
    for p in prefills:
        b, s = p.metadata.tensors_inputs["input_ids"].shape
        ins, outs = p.metadata.tensors_inputs, p.metadata.tensors_outputs
        assert ins["logits_index"].shape == ins["cache_row"].shape == (b,)
        assert outs["logits"].shape == (b, 1, model.config.vocab_size)
        caches = [n for n in ins if n.startswith("past_key_values_")]
        assert caches and set(caches) == set(outs) - {"logits"}
        assert all(ins[n].shape[0] == 4 and ins[n].shape[2] == MAX_LEN for n in caches)
    monkeypatch.setattr(KVState, "admit", lambda *a: pytest.fail("a prefill's caches were copied"))
    seen = []
    with Engine(folder, eos_token_id=None, compile=False, warmup=False) as eng:
        assert all(last_logits_only(s) and writes_cache(s) for s in eng.buckets.prefills.values())
        for sess in eng.buckets.prefills.values():
            run = sess.run
            monkeypatch.setattr(sess, "run", lambda inputs, run=run, **kw: seen.append(inputs) or run(inputs, **kw))
        prompts = _prompts(3, 9, model.config.vocab_size)
        got = eng.generate(prompts, max_new_tokens=3)
        full = {t.data_ptr() for t in eng.kv.full.values()}
    assert got == [_hf_greedy(model, p, 3) for p in prompts]
    assert seen and all(full <= {t.data_ptr() for t in inputs.values()} for inputs in seen)


def test_a_smaller_engine_batch_decodes_the_first_rows_of_the_prefills_cache(llama_set):
    """batch=2 of a set built for batches 2 and 4: the cache has the prefills' 4 rows, the decode step gets
    views of its first 2 (the same objects at every step), and tokens still equal transformers'."""
    model, folder = llama_set
    with Engine(folder, eos_token_id=None, compile=False, batch=2) as eng:
        assert eng.kv.rows == 4
        for name, t in eng.kv.tensors.items():
            full = eng.kv.full[name]
            assert full.shape[0] == 4 and t.shape[0] == 2 and t.data_ptr() == full.data_ptr() and t._base is full
        views = dict(eng.kv.tensors)
        prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3]]
        got = eng.generate(prompts, max_new_tokens=5)
        assert all(eng.kv.tensors[n] is t for n, t in views.items())
    assert got == [_hf_greedy(model, p, 5) for p in prompts]


def test_prefills_into_a_cache_of_another_size_are_refused(tmp_path):
    import shutil

    from fastpipe.builder.hf.build import build_hf

    save_random_checkpoint(CONFIGS["llama"](), tmp_path / "m", seed=5)
    build_serving_set(tmp_path / "m", tmp_path / "set", max_len=32, batches=(2,), prompt_lens=(8, 16), tp=2)
    shutil.rmtree(tmp_path / "set" / "prefill_b2_s8")
    build_hf(tmp_path / "m", tp=2, batch=2, seq_len=8, max_len=32, cache_rows=3,
             last_logits=True).save(tmp_path / "set" / "prefill_b2_s8")
    with pytest.raises(InputError, match=r"expected prefills writing into one cache of at least 2 rows \(the decode "
                                         r"batch\), found caches of \[2, 3\] rows"):
        Engine(tmp_path / "set", compile=False, warmup=False)


@pytest.mark.parametrize("older", ["caches-out", "full-logits"])
def test_an_older_set_whose_prefills_return_caches_still_serves(tmp_path, older):
    """Serving sets written before prefills wrote into the engine's cache: prefills returning their caches
    [B, Hkv, S, D] (with logits_index -> logits [B, 1, V], or older still input_ids only -> [B, S, V]) are
    still served: the engine copies the caches into the rows and reads each row's last real token."""
    import shutil

    from fastpipe.builder.hf.build import build_hf
    from fastpipe.serving.buckets import last_logits_only, writes_cache

    model = save_random_checkpoint(CONFIGS["llama"](), tmp_path / "m", seed=5).eval()
    build_serving_set(tmp_path / "m", tmp_path / "set", max_len=32, batches=(2,), prompt_lens=(8,), tp=2)
    shutil.rmtree(tmp_path / "set" / "prefill_b2_s8")
    build_hf(tmp_path / "m", tp=2, batch=2, seq_len=8, past_len=0,
             last_logits=older == "caches-out").save(tmp_path / "set" / "prefill_b2_s8")
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    with Engine(tmp_path / "set", eos_token_id=None, compile=False) as eng:
        sess = eng.buckets.prefills[(2, 8)]
        assert not writes_cache(sess) and last_logits_only(sess) == (older == "caches-out")
        assert eng.kv.rows == 2
        got = eng.generate(prompts, max_new_tokens=6)
    assert got == [_hf_greedy(model, p, 6) for p in prompts]


def test_pipelines_and_graphs_do_not_grow_with_tokens(llama_set):
    """Compiled: 4 tokens and then 40 tokens use the same sessions and the same compiled graphs; no
    recompilation happens after warm-up; the caches keep their addresses."""
    from torch._dynamo.utils import counters

    model, folder = llama_set
    with Engine(folder, eos_token_id=None, compile=True, compile_policy="raise", batch=2) as eng:
        sessions = set(map(id, eng.buckets.sessions()))
        graphs = eng.buckets.compiled_graphs()
        assert graphs == len(sessions) == 2 * 2 + 2
        frames = counters["stats"]["unique_graphs"]
        ptrs = {n: t.data_ptr() for n, t in eng.kv.tensors.items()}
        prompt = [7, 3, 9, 1]
        short = eng.generate([prompt], max_new_tokens=4)[0]
        steps = eng.steps
        long = eng.generate([prompt], max_new_tokens=40)[0]
        assert eng.steps - steps == 39
        assert set(map(id, eng.buckets.sessions())) == sessions and eng.buckets.compiled_graphs() == graphs
        assert counters["stats"]["unique_graphs"] == frames
        assert {n: t.data_ptr() for n, t in eng.kv.tensors.items()} == ptrs
        assert "in place" in eng.decode.describe() and "compiled" in eng.decode.describe()
    assert long[:4] == short and long == _hf_greedy(model, prompt, 40)


def test_requests_join_and_leave_rows_between_steps(llama_set):
    """Batch 2, five requests of different lengths: never more than 2 rows run, a waiting request takes
    a row as soon as one frees, and each result is the request's solo greedy run."""
    model, folder = llama_set
    prompts = _prompts(5, 3, 100)
    news = [3, 12, 5, 9, 2]
    with Engine(folder, eos_token_id=None, compile=False, batch=2) as eng:
        active = []
        step = eng._step

        def counting():
            active.append(eng.active)
            step()
        eng._step = counting
        reqs = [eng.submit(p, max_new_tokens=n) for p, n in zip(prompts, news)]
        got = [r.result(timeout=120) for r in reqs]
    assert max(active) == 2 and len(active) < sum(n - 1 for n in news)
    assert all(r.finish_reason == "length" for r in reqs)
    for p, n, toks in zip(prompts, news, got):
        assert toks == _hf_greedy(model, p, n)


def test_streaming_yields_tokens_as_they_are_made(llama_set):
    model, folder = llama_set
    with Engine(folder, eos_token_id=None, compile=False, batch=2) as eng:
        run = eng.decode.run

        def slow(*a, **k):
            time.sleep(0.02)
            return run(*a, **k)
        eng.decode.run = slow
        req = eng.submit([5, 6, 7], max_new_tokens=30)
        it = iter(req)
        first = next(it)
        assert not req.done and len(req.tokens) < 30          # the rest is still being made
        rest = list(it)
    assert [first] + rest == req.tokens == req.result() == _hf_greedy(model, [5, 6, 7], 30)


def test_sampling_is_seeded_and_independent_of_the_batch(llama_set):
    _, folder = llama_set
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=1234)
    with Engine(folder, eos_token_id=None, compile=False, batch=4) as eng:
        alone = eng.generate([[4, 8, 15]], max_new_tokens=20, sampling=sp)[0]
        others = [eng.submit(p, max_new_tokens=20, sampling=SamplingParams(temperature=1.0, seed=i))
                  for i, p in enumerate(_prompts(3, 9, 100))]
        crowded = eng.submit([4, 8, 15], max_new_tokens=20, sampling=sp).result()
        other = eng.generate([[4, 8, 15]], max_new_tokens=20, sampling=SamplingParams(temperature=0.9, seed=99))[0]
        [r.result() for r in others]
    assert alone == crowded and alone != other


def test_eos_ends_a_row_and_others_go_on(llama_set):
    model, folder = llama_set
    prompts = _prompts(2, 5, 100)
    solo = [_hf_greedy(model, p, 12) for p in prompts]
    eos = solo[0][4]                                    # request 0 makes this token at step 5
    k = solo[1].index(eos) + 1 if eos in solo[1] else 12
    with Engine(folder, eos_token_id=eos, compile=False, batch=2) as eng:
        a, b = (eng.submit(p, max_new_tokens=12) for p in prompts)
        c = eng.submit(prompts[0], max_new_tokens=12, ignore_eos=True)
        assert a.result() == solo[0][:solo[0].index(eos) + 1] and a.finish_reason == "eos"
        assert b.result() == solo[1][:k]
        assert c.result() == solo[0] and c.finish_reason == "length"
    assert _hf_greedy(model, prompts[0], 12, eos=eos) == a.tokens


def test_bad_requests_fail_alone_with_one_line_errors(llama_set):
    _, folder = llama_set
    with Engine(folder, eos_token_id=None, compile=False, batch=2) as eng:
        good = eng.submit([1, 2, 3], max_new_tokens=8)
        cases = [
            (dict(prompt=list(range(1, 18)), max_new_tokens=4), r"prompt: expected at most 16 tokens \(the largest prefill bucket\), found 17"),
            (dict(prompt=[1, 2, 3], max_new_tokens=46), r"max_new_tokens: expected at most 45 \(max_len 48 - the prompt's 3 tokens\), found 46"),
            (dict(prompt=[1, 100], max_new_tokens=4), r"prompt: expected token ids in \[0, 100\), found 100"),
            (dict(prompt=[], max_new_tokens=4), r"prompt: expected at least one token, found none"),
            (dict(prompt=torch.tensor([1.0, 2.0]), max_new_tokens=4), r"prompt: expected a 1-d tensor of int64 token ids, found 1-d float32"),
            (dict(prompt=torch.tensor([[1, 2]]), max_new_tokens=4), r"prompt: expected a 1-d tensor of int64 token ids, found 2-d int64"),
            (dict(prompt="hello", max_new_tokens=4), r"prompt: expected a list of token ids, found str"),
            (dict(prompt=[1, 2], max_new_tokens=0), r"max_new_tokens: expected an integer >= 1, found 0"),
            (dict(prompt=[1, 2], max_new_tokens=4, sampling=SamplingParams(top_p=1.5)), r"sampling.top_p: expected"),
        ]
        for kwargs, msg in cases:
            with pytest.raises(InputError, match=msg) as e:
                eng.submit(**kwargs)
            assert "\n" not in str(e.value)
        with pytest.raises(InputError, match=r"cancel: expected a waiting or running request, found id 12345"):
            eng.cancel(12345)
        assert len(good.result()) == 8 and good.finish_reason == "length"
    with pytest.raises(InputError, match=r"submit: expected an open engine, found it closed"):
        eng.submit([1], max_new_tokens=1)
    with pytest.raises(InputError, match=r"batch: expected one of the decode buckets \[2, 4\], found 3"):
        Engine(folder, batch=3, compile=False)


def _failing(run, calls: set[int], what="device lost"):
    """`run`, raising RuntimeError(what) at the given call numbers (1-based)."""
    n = {"calls": 0}

    def flaky(*a, **k):
        n["calls"] += 1
        if n["calls"] in calls:
            raise RuntimeError(what)
        return run(*a, **k)
    return flaky


def test_a_step_failing_once_runs_again_and_changes_nothing(llama_set):
    """A decode step or a prefill that raises once runs once more (it rewrites the same cache positions),
    with a warning naming the reason; every request's tokens are those of a run without the fault."""
    model, folder = llama_set
    prompts = _prompts(3, 21, 100)
    with Engine(folder, eos_token_id=None, compile=False, batch=2) as eng:
        eng.decode.run = _failing(eng.decode.run, {3})
        for sess in eng.buckets.prefills.values():
            sess.run = _failing(sess.run, {1}, "out of memory")
        with pytest.warns(RuntimeWarning) as caught:
            got = eng.generate(prompts, max_new_tokens=10)
        assert eng.retries >= 2
    said = [str(w.message) for w in caught]
    assert any(m.startswith("fastpipe: decode step failed (RuntimeError: device lost); running it once more") for m in said)
    assert any("prefill" in m and "(RuntimeError: out of memory)" in m for m in said)
    assert got == [_hf_greedy(model, p, 10) for p in prompts]


def test_a_step_failing_twice_fails_its_requests_and_the_engine_goes_on(llama_set):
    model, folder = llama_set
    with Engine(folder, eos_token_id=None, compile=False, batch=2) as eng:
        eng.decode.run = _failing(eng.decode.run, {3, 4})
        with pytest.warns(RuntimeWarning, match="decode step failed"):
            doomed = eng.submit([3, 4], max_new_tokens=10)
            with pytest.raises(RunError, match=r"generation step: RuntimeError: device lost"):
                doomed.result(timeout=60)
        later = eng.submit([3, 4], max_new_tokens=10).result(timeout=60)
    solo = _hf_greedy(model, [3, 4], 10)
    assert doomed.finish_reason == "error" and doomed.tokens == solo[:3]      # the prefill's, then 2 steps
    assert later == solo


def test_close_finishes_or_cancels_in_flight_requests(llama_set):
    _, folder = llama_set
    eng = Engine(folder, eos_token_id=None, compile=False, batch=2)
    reqs = [eng.submit([1, 2, 3], max_new_tokens=30) for _ in range(3)]
    eng.close()
    assert all(len(r.result()) == 30 and r.finish_reason == "length" for r in reqs)
    eng = Engine(folder, eos_token_id=None, compile=False, batch=2)
    run = eng.decode.run
    eng.decode.run = lambda *a, **k: (time.sleep(0.01), run(*a, **k))[1]
    reqs = [eng.submit([1, 2, 3], max_new_tokens=40) for _ in range(3)]
    next(iter(reqs[0]))
    eng.close(cancel=True, timeout=60)
    assert all(r.done and r.finish_reason == "cancelled" and len(r.tokens) < 40 for r in reqs)
    assert list(reqs[2]) == [] or reqs[2].tokens       # iterating a cancelled request ends


def test_cancel_one_request(llama_set):
    _, folder = llama_set
    with Engine(folder, eos_token_id=None, compile=False, batch=2) as eng:
        run = eng.decode.run
        eng.decode.run = lambda *a, **k: (time.sleep(0.01), run(*a, **k))[1]
        a = eng.submit([1, 2, 3], max_new_tokens=40)
        b = eng.submit([4, 5], max_new_tokens=10)
        next(iter(a))
        eng.cancel(a)
        assert b.result(timeout=60) and len(b.tokens) == 10
        a.result(timeout=60)
    assert a.finish_reason == "cancelled" and len(a.tokens) < 40


def test_64_requests_from_8_threads_equal_their_solo_runs(llama_set):
    """The load test, in process: 64 requests of random prompt lengths from 8 threads through a batch-4
    engine; every request's tokens equal its solo greedy run; none lost or duplicated."""
    model, folder = llama_set
    prompts = _prompts(64, 7, 100)
    news = [4 + (i * 5) % 9 for i in range(64)]
    results: dict[int, list[int]] = {}
    errors = []
    with Engine(folder, eos_token_id=None, compile=False, batch=4) as eng:
        def worker(t):
            try:
                for i in range(t, 64, 8):
                    results[i] = list(eng.submit(prompts[i], max_new_tokens=news[i]))
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    assert not errors and sorted(results) == list(range(64))
    for i in range(64):
        assert results[i] == _hf_greedy(model, prompts[i], news[i]), i
