"""The engine's fault-isolation rule, driven by hypothesis: a request's outcome (tokens, finish_reason)
depends only on its own prompt and parameters, whatever else is submitted, cancelled, failed or closed
around it (docs/serving.md, "Faults").

Random mixes of submit (greedy and seeded sampling, with and without EOS), bad submits, cancels, injected
transient step failures (a decode step or a prefill raising once), prompts whose prefill always fails,
prompts whose logits turn nan at the first decode step, and close (finishing or cancelling), checked
against a model of each outcome: the request's solo run on its own engine, cut where the model says.
"""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from fastpipe.errors import InputError
from fastpipe.serving.build import build_serving_set
from fastpipe.serving.engine import Engine
from fastpipe.serving.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test  # noqa: E402

from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint  # noqa: E402

VOCAB, MAX_LEN, LONGEST = 64, 24, 8
POISON = 63           # a prompt holding it fails its prefill, every time
NAN = 62              # a prompt holding it gets nan logits at every decode step

prompts = st.lists(st.integers(0, NAN - 1), min_size=1, max_size=LONGEST)
samplings = st.one_of(st.just(SamplingParams()),
                      st.builds(SamplingParams, temperature=st.sampled_from([0.7, 1.0, 1.5]),
                                top_k=st.sampled_from([0, 5]), top_p=st.sampled_from([1.0, 0.9]),
                                seed=st.integers(0, 3)))
BAD = [  # (submit keywords, the one-line error's start): refused at submit, touching nobody
    (dict(prompt=[1] * (LONGEST + 1), max_new_tokens=2), "prompt: expected at most"),
    (dict(prompt=[1, 2], max_new_tokens=MAX_LEN), "max_new_tokens: expected at most"),
    (dict(prompt=[1, VOCAB], max_new_tokens=2), "prompt: expected token ids"),
    (dict(prompt=[1], max_new_tokens=2, sampling=SamplingParams(temperature=1e-40, seed=0)), "sampling.temperature"),
    (dict(prompt=[1], max_new_tokens=2, sampling=SamplingParams(temperature=1.0, top_p=0.0)), "sampling.top_p"),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("stateful")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB)
    save_random_checkpoint(config, root / "m", seed=2)
    build_serving_set(root / "m", root / "set", max_len=MAX_LEN, batches=(4,), prompt_lens=(4, LONGEST), tp=2)
    with Engine(root / "set", eos_token_id=None, compile=False) as probe:   # an EOS that does occur
        made = probe.generate([[i, i + 1] for i in range(0, 40, 5)], max_new_tokens=8)
    eos = torch.tensor(made).flatten().bincount().argmax().item()
    return root / "set", eos


class Solo:
    """Each (prompt, max_new_tokens, sampling, ignore_eos)'s outcome run alone, on an engine of its own."""

    def __init__(self, folder, eos):
        self.engine = Engine(folder, eos_token_id=eos, compile=False)
        self.known: dict[tuple, tuple[list[int], str]] = {}

    def __call__(self, prompt, max_new, sampling, ignore_eos) -> tuple[list[int], str]:
        key = (tuple(prompt), max_new, sampling, ignore_eos)
        if key not in self.known:
            r = self.engine.submit(prompt, max_new_tokens=max_new, sampling=sampling, ignore_eos=ignore_eos)
            self.known[key] = (r.result(timeout=120), r.finish_reason)
        return self.known[key]


class Faults:
    """Wraps every bucket's run: `arm()` makes the next run raise once (its retry runs: a transient fault);
    a prompt holding POISON makes its prefill raise, every time."""

    def __init__(self, engine):
        self.armed = self.last_failed = False
        self.fired = 0
        for sess in engine.buckets.sessions():
            sess.run = self._wrap(sess.run)

    def arm(self):
        self.armed = True

    def _wrap(self, run):
        def run_with_faults(inputs, *a, **k):
            if self.armed and not self.last_failed:          # never the retry of a failed run
                self.armed, self.last_failed = False, True
                self.fired += 1
                raise RuntimeError("injected transient fault")
            if any((t == POISON).any() for n, t in inputs.items() if n.startswith("input_ids")):
                self.last_failed = True
                raise RuntimeError("poisoned prompt")
            self.last_failed = False
            return run(inputs, *a, **k)
        return run_with_faults


def _nan_rows(engine):
    """The decode step's logits turn nan in the rows of prompts holding NAN."""
    decode = engine._decode

    def decode_with_nan_rows(live):
        logits = decode(live)                                                 # [B, V]
        bad = [k for k, row in live if NAN in row.req.prompt]
        if bad:
            logits = logits.clone()
            logits[bad] = float("nan")
        return logits
    engine._decode = decode_with_nan_rows


class EngineMachine(RuleBasedStateMachine):
    def __init__(self, folder, eos, solo: Solo):
        super().__init__()
        self.solo = solo
        self.engine = Engine(folder, eos_token_id=eos, compile=False)
        self.faults = Faults(self.engine)
        _nan_rows(self.engine)
        self.requests = []           # (request, expected tokens, expected reason, kind)
        self.cancelled = set()
        self.closed = self.closed_cancelling = False

    def _submit(self, prompt, max_new, sampling, ignore_eos, kind):
        if self.closed:
            with pytest.raises(InputError, match="submit: expected an open engine, found it closed"):
                self.engine.submit(prompt, max_new_tokens=max_new, sampling=sampling, ignore_eos=ignore_eos)
            return
        req = self.engine.submit(prompt, max_new_tokens=max_new, sampling=sampling, ignore_eos=ignore_eos)
        clean = [t for t in prompt if t not in (POISON, NAN)] or [0]
        tokens, reason = self.solo(clean if kind == "poison" else prompt, max_new, sampling, ignore_eos)
        self.requests.append((req, tokens, reason, kind))

    @rule(prompt=prompts, max_new=st.integers(1, 8), sampling=samplings, ignore_eos=st.booleans())
    def submit(self, prompt, max_new, sampling, ignore_eos):
        self._submit(prompt, max_new, sampling, ignore_eos, "plain")

    @rule(prompt=prompts, at=st.integers(0, LONGEST - 1), max_new=st.integers(1, 8), sampling=samplings,
          kind=st.sampled_from(["poison", "nan"]))
    def submit_failing(self, prompt, at, max_new, sampling, kind):
        prompt = (prompt + [0])[:LONGEST]
        prompt[min(at, len(prompt) - 1)] = POISON if kind == "poison" else NAN
        self._submit(prompt, max_new, sampling, False, kind)

    @rule(case=st.sampled_from(BAD))
    def submit_bad(self, case):
        kwargs, message = case
        message = "submit: expected an open engine, found it closed" if self.closed else message
        with pytest.raises(InputError, match=message.replace(".", r"\.")):
            self.engine.submit(**kwargs)

    @rule(data=st.data())
    def cancel(self, data):
        if self.requests:
            req = data.draw(st.sampled_from(self.requests))[0]
            with contextlib.suppress(InputError):           # already finished: nothing to cancel
                self.engine.cancel(req)
            self.cancelled.add(req.id)

    @rule()
    def transient_fault(self):
        self.faults.arm()

    @rule(cancel=st.booleans())
    def close(self, cancel):
        if not self.closed:
            self.engine.close(cancel=cancel)
            self.closed, self.closed_cancelling = True, cancel

    @invariant()
    def every_stream_is_its_solo_runs_prefix(self):
        for req, tokens, _, kind in self.requests:
            if kind != "poison":
                got = list(req.tokens)
                assert got == tokens[:len(got)], (req, tokens)

    def teardown(self):
        self.engine.close()
        for req, tokens, reason, kind in self.requests:
            assert req.done, req
            stoppable = req.id in self.cancelled or self.closed_cancelling
            if kind == "poison":
                assert (req.finish_reason, req.tokens) in (("error", []), ("cancelled", [])), req
                assert req.finish_reason == "error" or stoppable, req
            elif kind == "nan" and len(tokens) > 1:            # one token from the prefill, then the nan step
                assert req.finish_reason in ("error", "cancelled") and req.tokens == tokens[:len(req.tokens)], req
                assert len(req.tokens) <= 1 and (req.finish_reason == "error" or stoppable), req
                if req.finish_reason == "error":
                    assert "finite logits" in str(req.error) and req.tokens == tokens[:1], req
            elif req.finish_reason == "cancelled":
                assert stoppable and req.tokens == tokens[:len(req.tokens)] and len(req.tokens) < len(tokens), req
            else:
                assert (req.tokens, req.finish_reason) == (tokens, reason), (req, tokens, reason)


def test_a_requests_outcome_depends_only_on_its_own_prompt_and_parameters(served):
    folder, eos = served
    solo = Solo(folder, eos)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)      # each retry warns; counted below instead
            run_state_machine_as_test(
                lambda: EngineMachine(folder, eos, solo),
                settings=settings(max_examples=25, stateful_step_count=12, deadline=None, derandomize=True,
                                  database=None, suppress_health_check=list(HealthCheck)))
    finally:
        solo.engine.close()
