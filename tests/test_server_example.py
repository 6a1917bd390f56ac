"""examples/server.py over real HTTP: a tiny random llama serving set (tp=2), the server as a subprocess.

Every answer is checked against transformers' own greedy generate on the same checkpoint.
"""
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastpipe.serving.build import build_serving_set
from tests.hf_models import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
MAX_LEN, PROMPT_LENS, BATCH = 64, (8, 16, 32), 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    model = make_checkpoint("llama", folder / "model", seed=7)
    build_serving_set(folder / "model", folder / "serve", max_len=MAX_LEN, batches=(BATCH,), prompt_lens=PROMPT_LENS,
                      tp=2)
    log = open(folder / "server.log", "w+")
    # OMP_NUM_THREADS=1: the CPU processor runs each tp slot on a fresh thread per call, and each would
    # start its own OpenMP team: on a busy 2-core machine, decode steps were tens of times slower
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "server.py"), str(folder / "serve"),
                             "--port", "0", "--no-compile"], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line + (folder / "server.log").read_text()
        host, port = line.split("//")[1].split()[0].split(":")
        assert line.rstrip().endswith("(not compiled)"), line
        yield SimpleNamespace(proc=proc, host=host, port=int(port), model=model,
                              eos=model.generation_config.eos_token_id, log=folder / "server.log")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        log.close()


def connect(server) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(server.host, server.port, timeout=120)


def call(conn, method: str, path: str, body=None):
    """(status, JSON answer) of one request on a (keep-alive) connection."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.getheader("Content-Type") == "application/json"
    return r.status, json.loads(r.read())


def open_stream(conn, body: dict) -> http.client.HTTPResponse:
    conn.request("POST", "/generate", body=json.dumps({**body, "stream": True}).encode())
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
    assert r.getheader("Transfer-Encoding") == "chunked"
    return r


def next_event(r: http.client.HTTPResponse) -> dict:
    """The next Server-Sent Event's data, read line by line as it arrives."""
    data = []
    while True:
        line = r.readline()
        assert line, "the stream ended inside an event"
        line = line.decode().rstrip("\n")
        if not line:
            assert len(data) == 1, data
            return json.loads(data[0])
        assert line.startswith("data: "), line
        data.append(line[len("data: "):])


def read_stream(r: http.client.HTTPResponse, first: list | None = None) -> dict:
    """Read events to the end: one {"token"} event per token, then the done event with the same tokens."""
    tokens = list(first or [])
    while "token" in (ev := next_event(r)):
        assert set(ev) == {"token"} and isinstance(ev["token"], int)
        tokens.append(ev["token"])
    assert ev["done"] is True and ev["tokens"] == tokens, ev
    assert r.read() == b""                  # the last, empty chunk: a complete stream
    return ev


def reference(server, prompt: list, n: int, ignore_eos: bool) -> list:
    """transformers' greedy generate of this prompt alone, with the server's EOS handling. The attention
    mask is given: generate would otherwise mask the prompt's tokens equal to pad_token_id (0)."""
    ids, threads = torch.tensor([prompt]), torch.get_num_threads()
    torch.set_num_threads(1)             # a tiny model: one thread is many times faster on a busy machine
    try:
        with torch.no_grad():
            out = server.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                        pad_token_id=0, eos_token_id=None if ignore_eos else server.eos)
    finally:
        torch.set_num_threads(threads)
    return out[0, len(prompt):].tolist()


def test_concurrent_requests_equal_solo_greedy_runs(server):
    assert server.eos == 2               # a random llama config: EOS is a token of the vocabulary (100)
    rng = random.Random(0)
    jobs = [dict(input_ids=[rng.randrange(100) for _ in range(rng.randint(1, 32))],
                 max_new_tokens=rng.randint(4, 16), ignore_eos=i % 4 < 2, stream=i % 2 == 1) for i in range(64)]
    answers = [None] * len(jobs)
    errors = []

    def client(t):
        conn = connect(server)           # one keep-alive connection per thread, streams and not
        try:
            for i in range(t, len(jobs), 8):
                if jobs[i]["stream"]:
                    answers[i] = read_stream(open_stream(conn, jobs[i]))
                else:
                    status, answers[i] = call(conn, "POST", "/generate", jobs[i])
                    assert status == 200, answers[i]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert all(a is not None for a in answers)
    eos_stops = went_past_eos = 0
    for job, a in zip(jobs, answers):
        want = reference(server, job["input_ids"], job["max_new_tokens"], job["ignore_eos"])
        assert a["tokens"] == want, (job, a)
        stopped = not job["ignore_eos"] and want[-1] == server.eos
        assert a["finish_reason"] == ("eos" if stopped else "length"), (job, a)
        eos_stops += stopped
        went_past_eos += job["ignore_eos"] and server.eos in want[:-1]
    assert eos_stops and went_past_eos   # this data meets EOS, both with and without ignore_eos
    # each answer matched its own request: 64 different prompts, and answers that tell requests apart
    assert len({tuple(j["input_ids"]) for j in jobs}) == 64
    assert len({tuple(a["tokens"]) for a in answers}) > 48


def test_stream_sends_tokens_as_they_are_made(server):
    # The first event is read while the request (prompt 1, MAX_LEN - 1 tokens) still holds its decode row
    # (/health: active 1). A server that answered only when done could never pass; a streaming one fails a
    # try only if /health takes longer than the other 62 decode steps, so three tries are plenty.
    prompt = [5]
    want = reference(server, prompt, MAX_LEN - 1, ignore_eos=True)
    conn, health = connect(server), connect(server)
    try:
        for _ in range(3):
            r = open_stream(conn, dict(input_ids=prompt, max_new_tokens=MAX_LEN - 1, ignore_eos=True))
            first = next_event(r)
            status, h = call(health, "GET", "/health")
            done = read_stream(r, first=[first["token"]])
            assert done["tokens"] == want and done["finish_reason"] == "length"
            if h["active"] == 1:
                break
        else:
            pytest.fail("the first event arrived only once the request had finished, three times")
    finally:
        conn.close()
        health.close()


def test_bad_requests_get_400_and_the_server_goes_on(server):
    ok = {"input_ids": [1, 2, 3], "max_new_tokens": 4}
    bad = [
        (b"{not json", "body: expected JSON"),
        (b"\xff\xfe", "body: expected JSON"),
        (b"[1, 2]", "body: expected a JSON object, found list"),
        ({"max_new_tokens": 4}, "found no input_ids"),
        ({"input_ids": [1]}, "found no max_new_tokens"),
        ({**ok, "prompt": [1]}, "found unknown prompt"),
        ({**ok, "input_ids": "hello"}, "prompt: expected a list of token ids"),
        ({**ok, "input_ids": []}, "prompt: expected at least one token"),
        ({**ok, "input_ids": [[1, 2]]}, "prompt: expected token ids in [0, 100), found [1, 2]"),
        ({**ok, "input_ids": [1, 100]}, "prompt: expected token ids in [0, 100), found 100"),
        ({**ok, "input_ids": [-1]}, "found -1"),
        ({**ok, "input_ids": [1.5]}, "found 1.5"),
        ({**ok, "input_ids": [1] * 33}, "prompt: expected at most 32 tokens"),
        ({**ok, "max_new_tokens": MAX_LEN}, f"max_new_tokens: expected at most {MAX_LEN - 3}"),
        ({**ok, "max_new_tokens": 0}, "max_new_tokens: expected an integer >= 1"),
        ({**ok, "max_new_tokens": "4"}, "max_new_tokens: expected an integer >= 1"),
        ({**ok, "temperature": -1}, "sampling.temperature"),
        ({**ok, "temperature": 1e-40}, "sampling.temperature: expected 0 (greedy) or a finite number >= 1e-05, found 1e-40"),
        ({**ok, "top_k": 1.5}, "sampling.top_k"),
        ({**ok, "top_p": 0}, "sampling.top_p"),
        ({**ok, "seed": -1}, "sampling.seed"),
        ({**ok, "stream": "yes"}, "stream: expected true or false"),
        ({**ok, "ignore_eos": 1}, "ignore_eos: expected true or false"),
    ]
    conn = connect(server)               # 400s keep the connection usable
    try:
        for body, says in bad:
            status, answer = call(conn, "POST", "/generate", body)
            assert status == 400 and set(answer) == {"error"}, (body, answer)
            assert says in answer["error"] and "\n" not in answer["error"], (body, answer)
        status, answer = call(conn, "POST", "/generate", ok)
        assert status == 200 and answer == {"tokens": reference(server, [1, 2, 3], 4, False),
                                            "finish_reason": "length"}
        sampled = {**ok, "max_new_tokens": 8, "temperature": 0.9, "top_k": 20, "seed": 3, "ignore_eos": True}
        assert call(conn, "POST", "/generate", sampled) == call(conn, "POST", "/generate", sampled)
        assert call(conn, "GET", "/health") == (200, {"ok": True, "batch": BATCH, "max_len": MAX_LEN, "active": 0})
        assert call(conn, "GET", "/health?verbose=1")[0] == 200
        for method in ("GET", "POST"):
            status, answer = call(conn, method, "/nowhere", b"{}" if method == "POST" else None)
            assert status == 404 and "not found" in answer["error"]
    finally:
        conn.close()
    conn = connect(server)               # no Content-Length: 400, and the connection closes
    try:
        conn.putrequest("POST", "/generate")
        conn.endheaders()
        r = conn.getresponse()
        assert r.status == 400 and "Content-Length" in json.loads(r.read())["error"]
        assert r.getheader("Connection") == "close"
    finally:
        conn.close()


def test_sigterm_ends_streams_and_exits_0(server):
    """Last in this module: it stops the server."""
    idle = connect(server)               # an idle keep-alive connection does not hold up the exit
    stream = connect(server)
    try:
        assert call(idle, "GET", "/health")[0] == 200
        r = open_stream(stream, dict(input_ids=[5], max_new_tokens=MAX_LEN - 1, ignore_eos=True))
        first = next_event(r)
        t = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        done = read_stream(r, first=[first["token"]])        # answered to the end: "cancelled" or, late, "length"
        assert done["finish_reason"] in ("cancelled", "length")
        assert server.proc.wait(timeout=15) == 0, server.log.read_text()
        assert time.monotonic() - t < 10
    finally:
        idle.close()
        stream.close()
