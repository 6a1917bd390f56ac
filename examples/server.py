"""An example HTTP server: greedy generation over a set of fastpipe pipelines (stdlib only).

    python examples/generate.py build path/to/hf_model out/ --batch 2 --prompt-len 8 --max-new-tokens 32
    python examples/server.py out/ --port 8000
    curl -s localhost:8000/generate -d '{"input_ids": [[5, 7, 9, 11, 2, 3, 4, 8]], "max_new_tokens": 32}'
        -> {"tokens": [[...32 ids...]]}

At start-up it loads every pipeline under the folder into one ModelSet (weights shared),
warms it up, and prints `listening on http://HOST:PORT`. Requests run concurrently on
threads (each bucket serialises its own calls). A bad request gets HTTP 400 with the
one-line error; the server stops on SIGINT/SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from fastpipe.errors import FastpipeError
from fastpipe.generate import greedy_generate
from fastpipe.serving import ModelSet


def make_handler(models: ModelSet, max_new_limit: int):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {"ok": True, "buckets": len(models.buckets)})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self):
            if self.path != "/generate":
                self._send(404, {"error": "not found"})
                return
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
                ids = torch.tensor(req["input_ids"], dtype=torch.int64)
                n = int(req.get("max_new_tokens", max_new_limit))
                if ids.dim() != 2 or not 1 <= n <= max_new_limit:
                    raise ValueError(f"expected input_ids [batch, seq] and 1 <= max_new_tokens <= {max_new_limit}")
                tokens = greedy_generate(models, ids, n)
                self._send(200, {"tokens": tokens.tolist()})
            except (FastpipeError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
                self._send(400, {"error": " ".join(str(e).split())})

        def log_message(self, *args):  # quiet
            pass

    return Handler


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="folder whose */pipeline.json are the buckets (prefill + decode steps)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    args = ap.parse_args(argv)
    paths = sorted(Path(args.folder).glob("*/pipeline.json"))
    if not paths:
        print(f"server: error: no */pipeline.json under {args.folder}", file=sys.stderr)
        return 2
    models = ModelSet(paths)
    models.warmup()
    decode_steps = sum(1 for p in paths if p.parent.name.startswith("decode"))
    server = ThreadingHTTPServer((args.host, args.port), make_handler(models, decode_steps + 1))
    server.daemon_threads = True
    stop = threading.Event()

    def shutdown(*_):
        if not stop.is_set():
            stop.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    print(f"listening on http://{server.server_address[0]}:{server.server_address[1]}", flush=True)
    server.serve_forever()
    models.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
