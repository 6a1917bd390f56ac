"""HTTP load: what `fastpipe serve` adds to the engine, under concurrent streaming clients.

    python -m bench.serve_load                  # writes bench/measured/serve_load_<device>_<date>.json
    python -m bench.serve_load --quick          # a smaller model and fewer requests (a smoke run)

The same requests two ways, alternating round after round:
- **in-process**: the Engine in this process; `clients` threads each submit their requests one after
  another, iterate the tokens and detokenise them (TextStream), as a library user embedding the engine;
- **HTTP**: `fastpipe serve` on the same serving set in a subprocess; `clients` concurrent connections
  (SSEClient on asyncio), each POSTing its requests to /v1/completions one after another with stream=true and
  reading the server-sent events (the server detokenises; return_token_ids gives each token's arrival).
`requests` prompts of random lengths (token ids, seeded), each asking for a random number of tokens
(`output_lens`, EOS ignored: each makes exactly that many), as requests of real traffic differ: with
one length for all, requests started together also end together, and the next ones arrive in waves.
Both run eagerly (--compile off) on the same serving set (batch buckets 1, 4, 16: the largest is the
decode batch) with torch on one thread (--threads): the same work, the same cache, and a core left for
the load generator, a minimal HTTP client (SSEClient) whose CPU would otherwise be taken from the
engine on a small machine.

Then `solo` requests one at a time from one client, both ways: with nothing else running, the time to
first token is the engine's prefill plus what the path itself adds. And (unless --no-waves) the same
requests all at one length: a client's requests end together and the next ones arrive in waves, each
waiting for a whole wave's prefill.

Per round: throughput (tokens over the time from the first request sent to the last token received),
time to first token (request sent -> its first token received) and inter-token latency (between a
request's tokens; tokens arriving together share the gap), p50 and p99. A figure is the median over
rounds. Targets: HTTP keeps at least 90 % of the in-process throughput and adds at most 5 ms to the
p50 time to first token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

THROUGHPUT_KEPT_TARGET = 0.90     # HTTP throughput / in-process throughput, at least
TTFT_ADDED_TARGET_S = 0.005       # HTTP p50 TTFT - in-process p50 TTFT, at most


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(records: list[dict], wall: float) -> dict:
    """records: per request {"sent", "times": [arrival of each token]}; wall: first send to last token."""
    ttft = [r["times"][0] - r["sent"] for r in records]
    itl = [b - a for r in records for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(len(r["times"]) for r in records)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "itl_p50_s": percentile(itl, 0.5), "itl_p99_s": percentile(itl, 0.99)}


def split_among(prompts: list, clients: int) -> list[list]:
    return [prompts[i::clients] for i in range(clients)]


# ------------------------------------------------------------------------------------ in-process
def run_in_process(engine, tok, prompts, clients: int) -> dict:
    records, lock = [], threading.Lock()

    def client(mine):
        for ids, max_tokens in mine:
            stream = tok.stream()
            sent = time.perf_counter()
            times = []
            req = engine.submit(ids, max_new_tokens=max_tokens, ignore_eos=True)
            for token in req:
                times.append(time.perf_counter())
                stream.add(token)
            stream.finish()
            with lock:
                records.append({"sent": sent, "times": times})

    threads = [threading.Thread(target=client, args=(mine,)) for mine in split_among(prompts, clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summary(records, max(t for r in records for t in r["times"]) - t0)


# ------------------------------------------------------------------------------------------- HTTP
class SSEClient:
    """A minimal HTTP/1.1 client for the load: one keep-alive connection, a POST, its chunked server-sent
    events read as they come. Lighter than a general client, so that on a small machine the load generator
    takes as little CPU from the server as it can."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def post_events(self, path: str, body: dict):
        """Yield each event's data (a str) of a streamed answer."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), len(data), data))
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200 or b"chunked" not in head.lower():
            raise RuntimeError(f"HTTP {status}: {head[:200]!r}")
        pending = b""
        while True:
            size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
            if size == 0:
                await self.reader.readexactly(2)
                return
            pending += (await self.reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield event[6:].decode()

    async def close(self):
        if self.writer is not None:
            self.writer.close()


async def _http_client(url, mine, records):
    host, port = url.split("//")[1].split(":")
    client = SSEClient(host, int(port))
    try:
        for ids, max_tokens in mine:
            body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                    "return_token_ids": True}
            sent = time.perf_counter()
            times = []
            async for data in client.post_events("/v1/completions", body):
                if data.startswith("{"):
                    n = len(json.loads(data)["choices"][0].get("token_ids", ()))
                    now = time.perf_counter()
                    times += [now] * n
            records.append({"sent": sent, "times": times})
    finally:
        await client.close()


def run_http(url, prompts, clients: int) -> dict:
    records: list[dict] = []

    async def main():
        t0 = time.perf_counter()
        await asyncio.gather(*(_http_client(url, mine, records)
                               for mine in split_among(prompts, clients)))
        return t0

    t0 = asyncio.run(main())
    return summary(records, max(t for r in records for t in r["times"]) - t0)


def start_server(folder: Path, batch: int, threads: int):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
    proc = subprocess.Popen([sys.executable, "-m", "fastpipe", "serve", str(folder), "--port", "0", "--no-compile",
                             "--batch", str(batch)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise RuntimeError(f"fastpipe serve did not start: {line}{proc.stderr.read()}")
    return proc, line.split()[2]


def stack_versions() -> dict:
    """The HTTP stack the server ran on (uvicorn picks uvloop and httptools when installed)."""
    from importlib import metadata

    out = {}
    for name in ("uvicorn", "starlette", "uvloop", "httptools"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


# ------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--batches", default="1,4,16", help="the serving set's batch buckets; the largest is the decode "
                                                        "batch both paths run on")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's intra-op threads in both paths (default 1: the other cores run the load generator "
                         "and the server's event loop)")
    ap.add_argument("--output-lens", default="16-48", metavar="LO-HI",
                    help="tokens each request asks for, drawn (seeded) from LO to HI (default 16-48, mean 32); "
                         "32-32: every request the same length, so that a client's requests end, and its next "
                         "arrive, in waves")
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--prompt-lens", default="32,64", help="prefill buckets; prompts are 4 to the largest tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--solo", type=int, default=8, help="requests sent one at a time by one client, per round")
    ap.add_argument("--no-waves", dest="waves", action="store_false",
                    help="leave out the same requests at one output length (LO+HI)/2 (they end, and the next "
                         "arrive, in waves)")
    ap.add_argument("--quick", action="store_true", help="2 layers, hidden 128, 16 requests, 2 rounds")
    ap.add_argument("--out", help="result file (default bench/measured/serve_load_<device>_<date>.json)")
    args = ap.parse_args(argv)
    if args.quick:                                 # what was not given explicitly
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
        for name, value in (("layers", 2), ("hidden", 128), ("requests", 16), ("rounds", 2)):
            if f"--{name}" not in given:
                setattr(args, name, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from bench.machine import machine_info, write_result
    from fastpipe.serving.engine import Engine
    from fastpipe.serving.tokenizer import Tokenizer
    from tests.server_model import build_set, make_model

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    lens = [int(s) for s in args.prompt_lens.split(",")]
    batches = tuple(int(b) for b in args.batches.split(","))
    batch = max(batches)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_model(folder / "model", layers=args.layers, hidden=args.hidden)
        build_set(folder / "model", folder / "set", max_len=args.max_len, batches=batches, prompt_lens=lens)
        tok = Tokenizer.load(folder / "set")
        vocab = len(tok.hf)
        rng = random.Random(0)
        lo, hi = (int(v) for v in args.output_lens.split("-"))
        prompts = [([rng.randrange(3, vocab) for _ in range(rng.randint(4, max(lens)))], rng.randint(lo, hi))
                   for _ in range(args.requests)]
        waves = [(ids, (lo + hi) // 2) for ids, _ in prompts]        # the same prompts, one length for all
        warm = prompts[:args.clients]
        engine = Engine(folder / "set", compile="off", batch=batch)
        proc, url = start_server(folder / "set", batch, args.threads)
        # path -> (requests, clients) of each round's run
        loads = {"": (prompts, args.clients), "_solo": (prompts[:args.solo], 1)}
        if args.waves:
            loads["_waves"] = (waves, args.clients)
        rounds = {f"{path}{load}": [] for load in loads for path in ("in_process", "http")}
        try:
            run_in_process(engine, tok, warm, args.clients)          # warm-up, untimed
            run_http(url, warm, args.clients)
            for k in range(args.rounds):
                for load, (reqs, clients) in loads.items():
                    rounds[f"in_process{load}"].append(run_in_process(engine, tok, reqs, clients))
                    rounds[f"http{load}"].append(run_http(url, reqs, clients))
                ip, ht = rounds["in_process"][-1], rounds["http"][-1]
                print(f"round {k}: in-process {ip['tokens_per_s']:.0f} tok/s, TTFT p50 {ip['ttft_p50_s'] * 1e3:.1f} ms; "
                      f"HTTP {ht['tokens_per_s']:.0f} tok/s, TTFT p50 {ht['ttft_p50_s'] * 1e3:.1f} ms", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
            engine.close(cancel=True)
    med = {path: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for path, rs in rounds.items()}
    kept = med["http"]["tokens_per_s"] / med["in_process"]["tokens_per_s"]
    added = med["http"]["ttft_p50_s"] - med["in_process"]["ttft_p50_s"]
    doc = {"machine": machine_info(), "args": vars(args),
           "model": {"layers": args.layers, "hidden": args.hidden, "vocab": vocab, "max_len": args.max_len,
                     "batch": batch, "dtype": "float32"},
           "stack": stack_versions(),
           "rows": med, "rounds": rounds, "throughput_kept": kept, "ttft_p50_added_s": added}
    print(f"HTTP keeps {kept:.1%} of the in-process throughput (target >= {THROUGHPUT_KEPT_TARGET:.0%}); adds "
          f"{added * 1e3:.2f} ms to p50 TTFT (target <= {TTFT_ADDED_TARGET_S * 1e3:.0f} ms)")
    print(f"wrote {write_result('serve_load', doc, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
