"""`fastpipe serve` as users start it: a subprocess on a free port, the official openai client streaming a chat
completion from it, SIGTERM under load (in-flight streams finish within the grace period, or end with an
error event past it; exit 0), and its one-line start-up errors."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from fastpipe.serving.engine import Engine  # noqa: E402
from fastpipe.serving.tokenizer import Tokenizer  # noqa: E402
from tests.server_model import build_set, make_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_LEN = 256


@pytest.fixture(scope="module")
def serving_set(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve_cli")
    make_model(folder / "model")
    return build_set(folder / "model", folder / "set", max_len=MAX_LEN, batches=(4,), prompt_lens=(16, 32))


class Served:
    def __init__(self, folder, *args):
        # OMP_NUM_THREADS=1: a decode step of this tiny model is faster on one thread than on a busy team
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        self.log = open(Path(folder).parent / f"serve-{time.monotonic_ns()}.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "fastpipe", "serve", str(folder), "--port", "0",
                                      "--no-compile", *args], stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        line = self.proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line + self.stderr()
        self.line = line
        self.url = line.split()[2]

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture()
def serve(serving_set):
    started = []

    def start(*args):
        started.append(Served(serving_set, *args))
        return started[-1]

    yield start
    for s in started:
        s.close()


def test_the_openai_client_streams_a_chat_completion_from_fastpipe_serve(serve, serving_set):
    s = serve("--model-name", "tiny-llama")
    assert "model \"tiny-llama\"" in s.line and "decode batch 4" in s.line and "text and token ids" in s.line
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Hello world, once upon a time"}]
    chunks = list(c.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    tok = Tokenizer.load(serving_set)
    ids = tok.apply_chat_template(messages)
    with Engine(serving_set, compile="off") as engine:            # the same set, in this process
        want = engine.generate([ids], max_new_tokens=24)[0]
    assert text == tok.decode(want)
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == len(want)
    assert [m.id for m in c.models.list().data] == ["tiny-llama"]


def _streams(url, n, max_tokens):
    """n streams of max_tokens each (EOS ignored), opened now; (threads, results: each stream's events)."""
    results = [None] * n
    started = threading.Barrier(n + 1)

    def one(i):
        body = {"prompt": [5 + i, 6, 7], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        events = []
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        if not events:
                            started.wait(60)
                        events.append(line[6:])
        except httpx.HTTPError as e:
            events.append(f"broken: {type(e).__name__}")
        results[i] = events

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    started.wait(60)                            # every stream has its first token
    return threads, results


def _sigterm_under_load(s, n: int) -> list:
    """SIGTERM while n streams run: the exit status 0 checked, each stream's events once it ended."""
    threads, results = _streams(s.url, n, MAX_LEN - 3)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=120) == 0, s.stderr()
    for t in threads:
        t.join(60)
    return results


def test_sigterm_lets_in_flight_streams_finish_and_exits_0(serve):
    s = serve("--grace", "60")
    for events in _sigterm_under_load(s, 4):
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"        # ran to the end
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health", timeout=5)                                         # no longer listening
    assert s.stderr().rstrip().endswith("stopped")


def test_sigterm_past_the_grace_period_ends_streams_with_an_error_event(serve):
    s = serve("--grace", "0")
    for events in _sigterm_under_load(s, 3):    # each had ~250 tokens to go: all were running at the signal
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["error"]["code"] == "shutting_down", events[-2]
        assert len(events) < MAX_LEN - 3


@pytest.mark.parametrize("args, words", [
    (["/nonexistent/set"], "serving set: expected a folder written by `fastpipe build --serve`"),
    (["{set}", "--batch", "3"], "--batch: expected one of the decode buckets [4], found 3"),
    (["{set}", "--max-queue", "-1"], "--max-queue: expected a number >= 0, found -1"),
], ids=["no-folder", "batch", "max-queue"])
def test_start_up_errors_are_one_line_and_exit_2(serving_set, args, words):
    args = [a.replace("{set}", str(serving_set)) for a in args]
    r = subprocess.run([sys.executable, "-m", "fastpipe", "serve", *args, "--port", "0", "--no-compile"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastpipe: error: ") and words in lines[0], r.stderr


def test_a_taken_port_is_one_line(serving_set, serve):
    s = serve()
    port = s.url.rsplit(":", 1)[1]
    r = subprocess.run([sys.executable, "-m", "fastpipe", "serve", str(serving_set), "--port", port, "--no-compile"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert r.returncode == 2 and f"--port: expected a free port on 127.0.0.1, found {port} taken" in r.stderr


def test_without_the_serve_extra_it_says_which_extra(serving_set, monkeypatch, capsys):
    from fastpipe.cli.main import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)          # as if not installed
    assert main(["serve", str(serving_set), "--port", "0", "--no-compile"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs starlette and uvicorn (pip install 'fastpipe[serve]')" in err[0]
