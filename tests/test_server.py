"""fastpipe.server over real HTTP on localhost, with real clients (the official `openai` package and httpx):
a tiny llama with a trained byte-level BPE tokenizer and a chat template, served by uvicorn in a thread.

Tokens are checked against the engine's own greedy run and transformers' greedy generate; stop strings,
bad requests (400/404/413 with OpenAI's error object), a full queue (503), timeouts (504), a client
that goes away (its row frees), a burst of 64 streams, and the metrics.
"""
import asyncio
import json
import random
import socket
import threading
import time

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
starlette = pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from fastpipe.server import ServerSettings, make_app  # noqa: E402
from fastpipe.serving.engine import Engine  # noqa: E402
from fastpipe.serving.tokenizer import Tokenizer  # noqa: E402
from tests.server_model import ServerThread, build_set, hf_greedy, make_model, make_tokenizer  # noqa: E402

MAX_LEN, BATCH, PROMPT_LENS = 64, 8, (16, 32)
PROMPTS = ["Hello world, once upon", "the quick brown fox", "Crème brûlée 東京", "a naive cafe"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    model, hf_tok = make_model(folder / "model")
    build_set(folder / "model", folder / "set", max_len=MAX_LEN, batches=(BATCH,), prompt_lens=PROMPT_LENS)
    engine = Engine(folder / "set", compile="off")
    tok = Tokenizer.load(folder / "set")
    server = ServerThread(make_app(engine, tok, ServerSettings(model_name="tiny")))
    try:
        yield type("Served", (), dict(engine=engine, tok=tok, model=model, eos=hf_tok.eos_token_id, server=server,
                                      url=server.url, folder=folder))
    finally:
        server.stop()
        engine.close(cancel=True)


@pytest.fixture()
def extra_server(served):
    """Another app over the same engine, with other settings (or tokenizer): extra_server(settings, tok)."""
    started = []

    def start(tok="same", **settings):
        app = make_app(served.engine, served.tok if tok == "same" else tok, ServerSettings(model_name="tiny", **settings))
        started.append(ServerThread(app))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def client(url) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def engine_greedy(served, ids, n) -> list[int]:
    return served.engine.generate([ids], max_new_tokens=n)[0]


# --------------------------------------------------------------------------------------- answers
@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_tokens_equal_the_engines_and_transformers_greedy(served, prompt):
    c = client(served.url)
    ids = served.tok.encode(prompt)
    n = 24
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                             extra_body={"return_token_ids": True})
    got = r.choices[0].model_extra["token_ids"]
    assert got == engine_greedy(served, ids, n)
    assert got == hf_greedy(served.model, ids, n, served.eos)
    assert r.choices[0].text == served.tok.decode(got)
    assert r.choices[0].finish_reason == ("stop" if got[-1] == served.eos else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), len(got),
                                                                                        len(ids) + len(got))
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")


def test_token_id_prompts_need_no_text(served):
    ids = [5, 17, 42, 99, 7]
    r = client(served.url).completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0,
                                              extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == engine_greedy(served, ids, 10)
    assert r.usage.prompt_tokens == 5


def test_streamed_completion_equals_the_whole_one(served):
    c = client(served.url)
    whole = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0)
    chunks = list(c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len(chunks) > 3                                   # streamed in pieces, not at once


def test_chat_streams_through_the_template_and_equals_the_engine(served):
    c = client(served.url)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    ids = served.tok.apply_chat_template(messages)
    want = engine_greedy(served, ids, 20)
    whole = c.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert whole.choices[0].message.content == served.tok.decode(want)
    assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == len(want)
    stream = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                            stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == served.tok.decode(want)
    assert stream[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(ch.object == "chat.completion.chunk" and ch.id == stream[0].id for ch in stream)
    # no max_tokens: the rest of the context (as vLLM); ignore_eos (an extension) fills it
    rest = c.chat.completions.create(model="tiny", messages=messages, temperature=0, extra_body={"ignore_eos": True})
    assert rest.usage.completion_tokens == MAX_LEN - len(ids) and rest.choices[0].finish_reason == "length"


def test_seeded_sampling_repeats(served):
    c = client(served.url)
    a, b = (c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0.9, top_p=0.9, seed=5,
                                 extra_body={"return_token_ids": True, "top_k": 50}) for _ in range(2))
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]


def _stop_case(served):
    """A prompt, its greedy text, and a stop string (ASCII, two characters) starting a few characters in."""
    for prompt in PROMPTS:
        ids = served.tok.encode(prompt)
        full = served.tok.decode(engine_greedy(served, ids, 40))
        for k in range(3, len(full) - 2):
            stop = full[k:k + 2]
            if stop.isascii() and stop.strip() and full.find(stop) == k:
                return prompt, full, stop
    pytest.fail("no prompt's greedy text has an ASCII stop string to cut at")


def test_stop_strings_cut_the_text_whole_and_streamed(served):
    prompt, full, stop = _stop_case(served)
    c = client(served.url)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].text == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"
    # the row was freed: the engine is idle again
    deadline = time.monotonic() + 10
    while served.engine.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.engine.active == 0


# ---------------------------------------------------------------------------------- bad requests
def _post(url, path, body, **kw):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=data, headers={"Content-Type": "application/json"}, timeout=60, **kw)


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/v1/completions", b"{oops", 400, None, "body: expected a JSON object, found invalid JSON"),
    ("/v1/completions", {"prompt": "w " * 40, "max_tokens": 2}, 400, "prompt",
     "prompt: expected at most 32 tokens (the largest prefill bucket), found"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, 400, "max_tokens",
     "max_tokens: expected at most"),
    ("/v1/completions", {"prompt": [1, 2, 10 ** 6], "max_tokens": 2}, 400, "prompt", "prompt: expected token ids in"),
    ("/v1/completions", {"prompt": "hi", "n": 3}, 400, "n", "n: expected 1"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of", "best_of: not supported"),
    ("/v1/completions", {"prompt": "hi", "mystery": 1}, 400, "mystery", "Unrecognized request argument supplied"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "model: expected \"tiny\""),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "messages: expected a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w " * 40}]}, 400, "messages",
     "messages: expected at most 32 tokens"),
], ids=["json", "too-long", "past-max-len", "id-past-vocab", "n", "best_of", "unknown", "model", "messages",
        "chat-too-long"])
def test_bad_requests_get_openais_error_object_and_the_server_goes_on(served, path, body, status, param, words):
    r = _post(served.url, path, body)
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert words in err["message"] and "\n" not in err["message"], err
    assert err["param"] == param and err["type"] == "invalid_request_error"
    ok = client(served.url).completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_the_openai_client_raises_the_servers_message(served):
    with pytest.raises(openai.BadRequestError) as e:
        client(served.url).completions.create(model="tiny", prompt="hi", max_tokens=500)
    assert "max_tokens: expected at most" in str(e.value)


def test_text_without_a_tokenizer_and_chat_without_a_template(served, extra_server, tmp_path):
    bare = extra_server(tok=None)
    r = _post(bare.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "the served folder has no tokenizer" in r.json()["error"]["message"]
    r = _post(bare.url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "stop": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    ids = _post(bare.url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "temperature": 0}).json()
    assert ids["choices"][0]["token_ids"] == engine_greedy(served, [5, 6], 3) and ids["choices"][0]["text"] == ""
    make_tokenizer(tmp_path, chat_template=None)
    plain = extra_server(tok=Tokenizer.load(tmp_path))
    r = _post(plain.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("chat template: expected a tokenizer with one")


def test_a_body_past_the_limit_is_refused_before_it_is_read(served, extra_server):
    with socket.create_connection(("127.0.0.1", served.server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000000\r\n\r\n{\"prompt\": ")        # 1 TB announced, 11 bytes sent
        head = b""
        while chunk := s.recv(65536):                    # until the server closes: the answer, then EOF
            head += chunk
        head = head.decode()
    assert head.startswith("HTTP/1.1 413 "), head
    assert "body: expected at most 4194304 bytes, found Content-Length 1000000000000" in head
    small = extra_server(max_body_bytes=1000)

    def chunks():                                        # no Content-Length: counted as it comes
        for _ in range(10):
            yield b" " * 500

    r = httpx.post(small.url + "/v1/completions", content=chunks(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert client(served.url).completions.create(model="tiny", prompt="hi", max_tokens=1).usage.completion_tokens == 1


# ------------------------------------------------------------------------ queue, timeout, disconnect
def _open_stream(url, body, opened: list, done: list):
    with httpx.Client(timeout=60) as h, h.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        opened.append(r.status_code)
        done.append(r.read().decode())


def test_a_full_queue_answers_503_with_retry_after(served, extra_server):
    small = extra_server(max_queue=2)                     # at most 8 rows + 2 waiting in flight
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    opened, done = [], []
    with served.engine._busy:                             # the engine's worker waits: nothing finishes
        threads = [threading.Thread(target=_open_stream, args=(small.url, body, opened, done)) for _ in range(10)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while small.state.in_flight < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert small.state.in_flight == 10
        r = _post(small.url, "/v1/completions", body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full" and "max_queue 2" in r.json()["error"]["message"]
    for t in threads:
        t.join(60)
    assert opened == [200] * 10 and all(d.rstrip().endswith("data: [DONE]") for d in done)
    assert _post(small.url, "/v1/completions", body).status_code == 200      # room again
    assert 'outcome="rejected"' in httpx.get(small.url + "/metrics").text


def test_a_request_past_its_timeout_is_answered_at_once(served, extra_server):
    quick = extra_server(request_timeout=0.3)
    body = {"prompt": [5, 6, 7], "max_tokens": 20, "temperature": 0}
    with served.engine._busy:                             # the engine is stuck in a step
        t = time.perf_counter()
        r = _post(quick.url, "/v1/completions", body)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        assert time.perf_counter() - t < 10
        with httpx.stream("POST", quick.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-2][6:])["error"]["code"] == "timeout" and events[-1] == "data: [DONE]"
    _wait_idle(served.engine)


def _wait_idle(engine, seconds=30):
    deadline = time.monotonic() + seconds
    while (engine.active or engine.waiting) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.active == 0 and engine.waiting == 0


def _metric(url, name) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            if line.split(" ")[0] == name or line.rsplit(" ", 1)[0] == name:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_that_goes_away_frees_its_row(served, monkeypatch):
    key = 'fastpipe_requests_total{outcome="disconnect",route="completions"}'
    before, made = _metric(served.url, key), _metric(served.url, "fastpipe_generation_tokens_total")
    gate = threading.Event()
    decode_run = served.engine.decode.run

    def gated_decode(*a, **kw):                           # the decode steps wait for the test: the stream
        gate.wait(30)                                     # has its first token (the prefill's), no more
        return decode_run(*a, **kw)

    monkeypatch.setattr(served.engine.decode, "run", gated_decode)
    body = {"prompt": [5, 6, 7], "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
    h = httpx.Client(timeout=30)
    s = h.send(h.build_request("POST", served.url + "/v1/completions", json=body), stream=True)
    lines = s.iter_lines()
    assert next(line for line in lines if line.startswith("data: "))          # the first token came
    assert served.engine.active == 1
    s.close()                                             # mid-stream: 59 tokens to go
    h.close()
    deadline = time.monotonic() + 10
    while _metric(served.url, key) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _metric(served.url, key) == before + 1         # the server saw it go ...
    gate.set()
    _wait_idle(served.engine)                             # ... and the row freed at the next step
    assert _metric(served.url, "fastpipe_generation_tokens_total") - made <= 2


# ------------------------------------------------------------------------------------------ burst
def test_a_burst_of_64_streams_all_complete_with_their_solo_tokens(served):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 30))] for _ in range(64)]
    want = served.engine.generate(prompts, max_new_tokens=8)

    async def one(h, ids):
        body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "stream": True, "return_token_ids": True}
        got = []
        async with h.stream("POST", served.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    got += json.loads(line[6:])["choices"][0]["token_ids"]
        return got

    async def burst():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as h:
            return await asyncio.gather(*(one(h, ids) for ids in prompts))

    assert asyncio.run(burst()) == want


# ----------------------------------------------------------------------------- models, health, metrics
def test_models_health_metrics_and_unknown_routes(served):
    models = client(served.url).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    h = httpx.get(served.url + "/health").json()
    assert h["status"] == "ok" and (h["batch"], h["max_len"]) == (BATCH, MAX_LEN)
    text = httpx.get(served.url + "/metrics")
    assert text.headers["content-type"].startswith("text/plain; version=0.0.4")
    before = _metric(served.url, 'fastpipe_requests_total{outcome="length",route="completions"}')
    ttft = _metric(served.url, "fastpipe_time_to_first_token_seconds_count")
    client(served.url).completions.create(model="tiny", prompt=[5, 6], max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert _metric(served.url, 'fastpipe_requests_total{outcome="length",route="completions"}') == before + 1
    assert _metric(served.url, "fastpipe_time_to_first_token_seconds_count") == ttft + 1
    for g in ("fastpipe_queue_depth", "fastpipe_batch_occupancy", "fastpipe_requests_running", "fastpipe_batch_rows"):
        assert g + " " in httpx.get(served.url + "/metrics").text
    r = httpx.get(served.url + "/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(served.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
