"""An example HTTP server over fastpipe's generation engine: continuous batching, streaming (stdlib only).

Build a serving set (prefill buckets and one static-cache decode step per batch size), then serve it:

    fastpipe build path/to/hf_model -o out/ --serve --max-len 256 --batches 1,8
        (in Python: fastpipe.serving.build.build_serving_set("path/to/hf_model", "out/",
                                                                 max_len=256, batches=(1, 8)))
    python examples/server.py out/ --port 8000            # [--host H] [--batch 8] [--compile background|wait|off]

    curl -s localhost:8000/generate -d '{"input_ids": [5, 7, 9], "max_new_tokens": 16}'
        -> {"tokens": [...16 ids...], "finish_reason": "length"}
    curl -sN localhost:8000/generate -d '{"input_ids": [5, 7, 9], "max_new_tokens": 16, "stream": true}'
        -> data: {"token": 31}                           (one Server-Sent Event per token, as it is made)
           ...
           data: {"done": true, "tokens": [...], "finish_reason": "length"}
    curl -s localhost:8000/health
        -> {"ok": true, "batch": 8, "max_len": 256, "active": 0}

POST /generate takes one prompt: "input_ids" (up to the largest prefill bucket) and "max_new_tokens"
(prompt + new tokens <= max_len), both required; optional "temperature", "top_k", "top_p", "seed"
(fastpipe.serving.sampling; the default is greedy), "ignore_eos" and "stream" (booleans).
finish_reason is "eos", "length", "cancelled" (the server stopping, or a streaming client gone) or
"error". A bad request gets HTTP 400 and {"error": "<one line>"} (the engine's InputError message).

One Engine serves everything. Each HTTP connection runs on its own thread (ThreadingHTTPServer) and
submits to the engine, whose worker admits the request into a free row of the decode batch between
steps: concurrent requests share the decode rows (continuous batching), and a request's tokens do
not depend on which others share its step.

Streams use HTTP/1.1 chunked transfer encoding (one chunk per event) rather than Connection: close.
It costs three lines (the chunk framing), and in return the connection stays open for the client's
next request (keep-alive, as for the JSON answers, which carry a Content-Length), and a client can
tell a complete stream (it ends with an empty chunk) from one cut off by a dropped connection.

SIGINT or SIGTERM stops the server: no new connections, the engine's in-flight requests end at once
(engine.close(cancel=True): their answers say "cancelled"), their answers are written, exit code 0.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from fastpipe.errors import FastpipeError, InputError
from fastpipe.serving.engine import Engine
from fastpipe.serving.sampling import SamplingParams

FIELDS = ("input_ids", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "stream")


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def submit(engine: Engine, body: bytes):
    """Check the JSON body and submit it: (request, stream?); a bad one raises InputError."""
    try:
        req = json.loads(body)
    except ValueError as e:                      # JSONDecodeError, or bytes that are not UTF-8
        raise InputError(f"body: expected JSON, found {one_line(e)}") from None
    if not isinstance(req, dict):
        raise InputError(f"body: expected a JSON object, found {type(req).__name__}")
    unknown = sorted(set(req) - set(FIELDS))
    missing = [k for k in ("input_ids", "max_new_tokens") if k not in req]
    if unknown or missing:
        raise InputError(f"body: expected the fields {', '.join(FIELDS)} (the first two required), found "
                         + (f"unknown {', '.join(unknown)}" if unknown else f"no {', '.join(missing)}"))
    flags = {k: req.get(k, False) for k in ("ignore_eos", "stream")}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise InputError(f"{k}: expected true or false, found {json.dumps(v)}")
    sampling = SamplingParams(temperature=req.get("temperature", 0.0), top_k=req.get("top_k", 0),
                              top_p=req.get("top_p", 1.0), seed=req.get("seed"))
    request = engine.submit(req["input_ids"], max_new_tokens=req["max_new_tokens"], sampling=sampling,
                            ignore_eos=flags["ignore_eos"])                 # checks the rest
    return request, flags["stream"]


def answer(request) -> dict:
    out = {"tokens": request.tokens, "finish_reason": request.finish_reason}
    return out if request.error is None else {**out, "error": one_line(request.error)}


class InFlight:
    """Counts the /generate answers being made, so that the shutdown can wait for them to be written."""

    def __init__(self):
        self.count, self.changed = 0, threading.Condition()

    def __enter__(self):
        with self.changed:
            self.count += 1

    def __exit__(self, *exc):
        with self.changed:
            self.count -= 1
            self.changed.notify_all()

    def wait_none(self, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.count == 0, timeout)


def make_handler(engine: Engine, inflight: InFlight):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"            # keep-alive; streams are chunked
        disable_nagle_algorithm = True           # TCP_NODELAY: each event leaves at once, not 40 ms later

        def send_json(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if urlsplit(self.path).path == "/health":
                self.send_json(200, {"ok": True, "batch": engine.batch, "max_len": engine.max_len,
                                     "active": engine.active})
            else:
                self.send_json(404, {"error": f"not found: GET {self.path}"})

        def do_POST(self):
            length = self.headers.get("Content-Length", "")
            if not length.isdecimal():           # the body cannot be skipped: answer, then close
                self.close_connection = True     # (send_json says so: Connection: close)
                self.send_json(400, {"error": f"Content-Length: expected a byte count, found {length!r}"})
                return
            body = self.rfile.read(int(length))
            if urlsplit(self.path).path != "/generate":
                self.send_json(404, {"error": f"not found: POST {self.path}"})
                return
            with inflight:                       # shutdown waits for the answers being written
                try:
                    request, stream = submit(engine, body)
                except InputError as e:
                    self.send_json(400, {"error": one_line(e)})
                    return
                if stream:
                    self.stream(request)
                else:
                    with contextlib.suppress(FastpipeError):     # a failed step: the answer says so
                        request.result()
                    self.send_json(200 if request.error is None else 500, answer(request))

        def stream(self, request) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                with contextlib.suppress(FastpipeError):         # a failed step: the last event says so
                    for token in request:        # each token as the engine makes it
                        self.event({"token": token})
                self.event({"done": True, **answer(request)})
                self.wfile.write(b"0\r\n\r\n")  # the empty chunk: the stream is complete
            except OSError:                      # the client went away: free its decode row
                request.cancel()
                self.close_connection = True

        def event(self, data: dict) -> None:
            chunk = f"data: {json.dumps(data)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))     # one chunk, sent now (unbuffered)

        def log_message(self, *args):            # quiet: no line per request
            pass

    return Handler


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="a serving set (fastpipe build MODEL -o FOLDER --serve)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    ap.add_argument("--batch", type=int, help="decode rows: one of the built decode batches (default the largest)")
    ap.add_argument("--compile", choices=("background", "wait", "off"), default="background",
                    help="background (default): ready at once, each bucket compiled in the background as it is used; "
                         "wait: compile every bucket before listening; off: never compile")
    ap.add_argument("--no-compile", action="store_true", help="the same as --compile off")
    args = ap.parse_args(argv)
    mode = "off" if args.no_compile else args.compile
    try:
        engine = Engine(args.folder, batch=args.batch, compile=mode)     # loads (and with "wait" compiles)
    except FastpipeError as e:
        print(f"server: error: {one_line(e)}", file=sys.stderr)
        return 2
    inflight = InFlight()
    server = ThreadingHTTPServer((args.host, args.port), make_handler(engine, inflight))
    server.daemon_threads = True             # idle keep-alive connections do not hold up the exit
    stopping = threading.Event()

    def stop(*_):
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=server.shutdown, daemon=True).start()   # not from serve_forever's thread

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    host, port = server.server_address[:2]
    how = {"background": "buckets compile in the background as they are used", "wait": "every bucket compiled",
           "off": "not compiled"}[mode]
    print(f"listening on http://{host}:{port} ({how})", flush=True)
    server.serve_forever()
    engine.close(cancel=True)                # in-flight requests end now, "cancelled"
    inflight.wait_none(timeout=10)           # ... and their answers are written
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
