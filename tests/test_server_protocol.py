"""The server's pieces that need no server: OpenAI request bodies checked (fastpipe.server.protocol), stop
strings on streamed text (fastpipe.server.stops), the Prometheus text (fastpipe.server.metrics)."""
import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from fastpipe.server.metrics import Counter, Histogram, ServerMetrics
from fastpipe.server.protocol import ApiError, parse_request
from fastpipe.server.stops import StopText


def ask(route="completions", **fields):
    base = {"prompt": "hi"} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    return parse_request(route, json.dumps({**base, **fields}).encode(), model="m")


def refused(route="completions", body=None, **fields) -> ApiError:
    with pytest.raises(ApiError) as e:
        if body is not None:
            parse_request(route, body, model="m")
        else:
            ask(route, **fields)
    assert "\n" not in e.value.message
    return e.value


# ------------------------------------------------------------------------------------------ protocol
def test_a_completion_takes_openais_fields_and_defaults():
    a = ask(max_tokens=5, temperature=0, top_p=0.5, seed=7, stop="\n", stream=True,
            stream_options={"include_usage": True}, n=1, user="u", model="m")
    assert (a.prompt, a.max_tokens, a.stop, a.stream, a.include_usage) == ("hi", 5, ["\n"], True, True)
    assert (a.sampling.temperature, a.sampling.top_p, a.sampling.seed) == (0.0, 0.5, 7)
    d = ask()
    assert d.sampling.temperature == 1.0 and d.max_tokens is None and not d.stream   # OpenAI's defaults
    assert ask(prompt=[5, 7, 9]).prompt == [5, 7, 9]          # token ids
    assert ask(prompt=["one"]).prompt == "one"                # a batch of one
    # the neutral values of what is not implemented pass
    assert ask(echo=False, best_of=1, logprobs=None, presence_penalty=0, frequency_penalty=0.0, logit_bias={})


def test_chat_takes_messages_text_parts_and_max_completion_tokens():
    a = ask("chat", messages=[{"role": "system", "content": "be brief"},
                              {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            max_completion_tokens=3, max_tokens=9, tools=[], tool_choice="none", response_format={"type": "text"})
    assert a.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert a.max_tokens == 3


@pytest.mark.parametrize("fields, param, words", [
    ({"temperature": 3}, "temperature", "temperature: expected a number in [0, 2], found 3"),
    ({"temperature": "hot"}, "temperature", "found \"hot\""),
    ({"top_p": 0}, "top_p", "top_p: expected a number in (0, 1]"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens: expected an integer >= 1, found 0"),
    ({"max_tokens": True}, "max_tokens", "found true"),
    ({"n": 2}, "n", "n: expected 1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 strings"),
    ({"stop": 5}, "stop", "stop: expected a string or a list of strings"),
    ({"stream": "yes"}, "stream", "stream: expected true or false"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "null unless stream is true"),
    ({"seed": 1.5}, "seed", "seed: expected an integer"),
    ({"top_k": -2}, "top_k", "top_k: expected an integer >= 0"),
    ({"echo": True}, "echo", "echo: not supported by this server: expected null or false, found true"),
    ({"logprobs": 2}, "logprobs", "not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt (send one request per prompt)"),
    ({"prompt": []}, "prompt", "prompt: expected text or a non-empty list of token ids"),
    ({"prompt": ""}, "prompt", "non-empty"),
    ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_fields_are_one_line_naming_the_field(fields, param, words):
    e = refused(**fields)
    assert e.status == 400 and e.param == param and words in e.message, e.message
    body = e.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"


@pytest.mark.parametrize("fields, words", [
    ({"messages": []}, "messages: expected a non-empty list"),
    ({"messages": [{"content": "x"}]}, "messages[0]: expected {\"role\": string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]: expected {\"type\": \"text\""),
    ({"tools": [{"type": "function"}]}, "tools: not supported"),
    ({"prompt": "x"}, "Unrecognized request argument supplied: prompt"),
])
def test_bad_chat_fields(fields, words):
    assert words in refused("chat", **fields).message


def test_body_and_model_errors():
    assert refused(body=b"{not json").message.startswith("body: expected a JSON object, found invalid JSON")
    assert refused(body=b"[1]").message == "body: expected a JSON object, found a JSON list"
    assert refused(body=b"\xff\xfe").status == 400
    e = refused(model="other")
    assert e.status == 404 and e.code == "model_not_found" and "\"m\"" in e.message


# ----------------------------------------------------------------------------------------------- stops
def run_stops(pieces, stops):
    s = StopText(stops)
    out = "".join(s.add(p) for p in pieces) + s.finish()
    return out, s.stopped


def causal_cut(pieces, stops):
    """The reference, as generation meets the text: after each piece, if a stop string has appeared, the text
    before the earliest one then (a stop string that would only have been completed later, by text never
    generated, does not count)."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [(text.find(s), s) for s in stops if s and s in text]
        if hits:
            i, s = min(hits)
            return text[:i], s
    return text, None


def test_stop_strings_cut_where_they_start_and_hold_back_their_prefixes():
    s = StopText(["END"])
    assert s.add("abc E") == "abc " and s.held == "E"        # could be the start of END
    assert s.add("N") == "" and s.held == "EN"
    assert s.add("x") == "ENx"                               # it was not
    assert s.add("yEND and more") == "y" and s.stopped == "END"
    assert s.add("more") == "" and s.finish() == ""
    t = StopText(["\n\n", "o w"])
    assert t.add("hello world\n\nbye") == "hell" and t.stopped == "o w"      # the earliest wins
    u = StopText(["xyz"])
    assert u.add("ab") == "ab" and u.add("x") == "" and u.finish() == "x"    # the end flushes what was held


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abcAB 東🙂\n", max_size=40),
       stops=st.lists(st.text(alphabet="abcAB 東🙂\n", min_size=1, max_size=4), max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_streamed_text_is_the_text_cut_at_the_first_stop_string_to_appear(text, stops, cuts):
    bounds = sorted({c for c in cuts if c <= len(text)} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, stopped = run_stops(pieces, stops)
    assert (out, stopped) == causal_cut(pieces, stops)
    assert text.startswith(out) and not any(s in out for s in stops if s)
    if not any(s in text for s in stops if s):
        assert out == text and stopped is None


# --------------------------------------------------------------------------------------------- metrics
def test_prometheus_text_counters_histograms_gauges():
    class Engine:
        waiting, active, batch = 3, 6, 8

    m = ServerMetrics(Engine(), lambda: 9)
    m.requests.inc(route="chat", outcome="stop")
    m.requests.inc(route="chat", outcome="stop")
    m.requests.inc(route="completions", outcome="length")
    for v in (0.002, 0.02, 0.2, 100.0):
        m.ttft.observe(v)
    text = m.text()
    assert 'fastpipe_requests_total{outcome="stop",route="chat"} 2' in text
    assert 'fastpipe_requests_total{outcome="length",route="completions"} 1' in text
    buckets = [(le, int(n)) for le, n in re.findall(r'fastpipe_time_to_first_token_seconds_bucket\{le="([^"]+)"\} (\d+)',
                                                     text)]
    counts = [n for _, n in buckets]
    assert counts == sorted(counts) and buckets[-1] == ("+Inf", 4)          # cumulative, +Inf = count
    assert dict(buckets)["0.0025"] == 1 and dict(buckets)["0.25"] == 3
    assert "fastpipe_time_to_first_token_seconds_count 4" in text
    assert "fastpipe_queue_depth 3" in text and "fastpipe_batch_occupancy 0.75" in text
    assert "fastpipe_requests_in_flight 9" in text
    # every sample line is `name{labels} value` after its HELP and TYPE
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or re.fullmatch(
            r'[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [0-9.e+-]+', line), line


def test_counter_and_histogram_edges():
    c = Counter("x_total", "h")
    assert "x_total 0" in c.lines()                          # an unlabelled counter shows 0 before any inc
    h = Histogram("y", "h", buckets=(1.0,))
    h.observe(1.0)                                           # le is inclusive
    assert 'y_bucket{le="1.0"} 1' in h.lines()


# ------------------------------------------------------------------------- the engine's hook (Request)
def test_request_on_change_calls_back_per_token_and_at_the_end():
    from fastpipe.serving.request import Request
    from fastpipe.serving.sampling import SamplingParams

    r = Request(0, [5], 3, SamplingParams(), frozenset())
    calls, bad_calls = [], []

    def bad():
        bad_calls.append(1)
        raise RuntimeError("event loop closed")

    r.on_change(lambda: calls.append(r.since(0)))
    r.on_change(bad)
    assert calls == [] and bad_calls == []            # nothing yet: not called at registration
    assert r._emit(7) and r._emit(8)                 # the failing listener does not stop the engine's side
    r._finish("length")
    assert calls == [([7], False), ([7, 8], False), ([7, 8], True)]
    assert bad_calls == [1]                          # dropped after it raised
    late = []
    r.on_change(lambda: late.append(r.since(1)))     # a finished request calls back at once
    assert late == [([8], True)]
