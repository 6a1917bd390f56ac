"""The engine under faults: a request that fails (its sampling, its prefill) fails alone; its batch-mates'
tokens are those of their solo runs; close() never releases the sessions under a running step and ends
what it stops as "cancelled"."""
import contextlib
import gc
import time

import pytest
import torch

from fastpipe.errors import InputError, RunError
from fastpipe.serving.build import build_serving_set
from fastpipe.serving.engine import Engine
from fastpipe.serving.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint  # noqa: E402

POISON = 99           # a prompt holding this token fails its prefill (injected below)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=100)
    model = save_random_checkpoint(config, root / "m", seed=8).eval()
    build_serving_set(root / "m", root / "set", max_len=40, batches=(2, 4), prompt_lens=(8, 16), tp=2)
    return model, root / "set"


def _engine(folder, **kw):
    return Engine(folder, eos_token_id=None, compile=False, **kw)


def _solo(folder, prompt, n, sampling=None):
    with _engine(folder, batch=2) as eng:
        return eng.submit(prompt, max_new_tokens=n, sampling=sampling).result(timeout=60)


def test_a_temperature_too_small_to_sample_from_is_refused_at_submit(served):
    _, folder = served
    with _engine(folder, batch=2) as eng:
        with pytest.raises(InputError, match=r"sampling\.temperature: expected 0 \(greedy\) or a finite number "
                                             r">= 1e-05, found 1e-40"):
            eng.submit([1, 2], max_new_tokens=4, sampling=SamplingParams(temperature=1e-40, seed=1))
        floor = SamplingParams(temperature=1e-5, seed=1)           # the smallest accepted: no overflow
        assert eng.submit([1, 2], max_new_tokens=6, sampling=floor).result(timeout=60) == \
            eng.submit([1, 2], max_new_tokens=6).result(timeout=60)


def test_a_row_whose_sampling_fails_fails_alone(served):
    """One row's logits turn nan in a decode step (and another's in its prefill): those requests end
    "error" with one line; their batch-mates, greedy and sampled, get their solo tokens."""
    _, folder = served
    sampled = SamplingParams(temperature=0.9, top_k=20, seed=4)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    params = [None, sampled, None, sampled]
    solo = [_solo(folder, p, 10, s) for p, s in zip(prompts, params)]
    with _engine(folder, batch=4) as eng:
        decode, prefill = eng._decode, eng._prefill
        victims = {}

        def nan_row(logits, req):
            for row_k, row in enumerate(eng.rows):
                if row is not None and row.req is req:
                    logits[row_k] = float("nan")

        def decode_with_a_nan_row(live):
            logits = decode(live).clone()                                 # [B, V]
            if len(victims["step"].tokens) == 3:
                nan_row(logits, victims["step"])
            return logits

        def prefill_with_a_nan_row(sess, b, s, rows, group):
            last = prefill(sess, b, s, rows, group).clone()               # [n, V]
            for i, r in enumerate(group):
                if r is victims.get("prefill"):
                    last[i] = float("nan")
            return last
        eng._decode, eng._prefill = decode_with_a_nan_row, prefill_with_a_nan_row
        reqs = [eng.submit(p, max_new_tokens=10, sampling=s) for p, s in zip(prompts[:2], params[:2])]
        victims["step"] = eng.submit([20, 21], max_new_tokens=10)
        victims["prefill"] = eng.submit([22], max_new_tokens=10, sampling=sampled)
        reqs += [eng.submit(p, max_new_tokens=10, sampling=s) for p, s in zip(prompts[2:], params[2:])]
        for victim, made in (("step", 3), ("prefill", 0)):
            with pytest.raises(RunError, match=r"^sampling: expected finite logits, found nan or \+inf in this "
                                               r"request's row$"):
                victims[victim].result(timeout=60)
            assert victims[victim].finish_reason == "error" and len(victims[victim].tokens) == made
        assert [r.result(timeout=60) for r in reqs] == solo


def test_a_prompt_whose_prefill_fails_fails_alone(served):
    """A prefill that fails twice for a group of prompts is run again one prompt at a time: only the
    prompt that fails alone fails; the others of its group get their solo tokens."""
    _, folder = served
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, POISON, 9], [10]]
    solo = {i: _solo(folder, p, 6) for i, p in enumerate(prompts) if POISON not in p}
    with _engine(folder, batch=4) as eng:
        for sess in eng.buckets.prefills.values():
            run = sess.run

            def poisoned(inputs, *a, _run=run, **k):
                if any((t == POISON).any() for n, t in inputs.items() if n.startswith("input_ids")):
                    raise RuntimeError("poisoned prompt")
                return _run(inputs, *a, **k)
            sess.run = poisoned
        with pytest.warns(RuntimeWarning, match="poisoned prompt"):
            reqs = [eng.submit(p, max_new_tokens=6) for p in prompts]
            for r in reqs:
                with contextlib.suppress(RunError):
                    r.result(timeout=60)
    assert reqs[2].finish_reason == "error" and reqs[2].tokens == []
    assert "RuntimeError: poisoned prompt" in str(reqs[2].error) and "\n" not in str(reqs[2].error)
    assert {i: r.result() for i, r in enumerate(reqs) if i != 2} == solo


def test_close_with_a_timeout_shorter_than_the_step_cancels_and_releases_after_it(served):
    """close(timeout=) returns after the timeout with the in-flight requests "cancelled" (not an error from
    sessions released under the running step); the worker releases the sessions once its step returns."""
    _, folder = served
    eng = _engine(folder, batch=2)
    decode = eng._decode
    eng._decode = lambda live: (time.sleep(0.5), decode(live))[1]
    reqs = [eng.submit([1, 2, 3], max_new_tokens=30) for _ in range(3)]
    next(iter(reqs[0]))
    eng.close(timeout=0.1)
    assert all(r.done and r.finish_reason == "cancelled" and r.error is None for r in reqs)
    kept = [list(r.tokens) for r in reqs]
    eng._worker.join(30)
    assert not eng._worker.is_alive() and not eng.buckets.decodes and not eng.buckets.prefills
    assert [r.tokens for r in reqs] == kept          # the step in flight added nothing after the close
    with pytest.raises(InputError, match="expected an open engine"):
        eng.submit([1], max_new_tokens=1)


def test_close_collects_garbage_once(served, monkeypatch):
    """Releasing the sessions collects garbage once for all of them, not once per session (seconds each
    in a process holding a large heap)."""
    _, folder = served
    eng = _engine(folder, batch=4)
    reqs = [eng.submit([1, 2, 3], max_new_tokens=30) for _ in range(6)]
    next(iter(reqs[0]))
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or 0)
    eng.close(cancel=True, timeout=60)
    assert len(eng.buckets.sessions()) == 0 and len(calls) == 1
    assert all(r.finish_reason in ("cancelled", "length") for r in reqs)
