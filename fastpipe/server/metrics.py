"""The server's Prometheus metrics, written in Prometheus' text format (version 0.0.4) for GET /metrics.

Counters and histograms are updated on the server's event loop only (no locks); gauges are read when
scraped (the engine's queue depth and busy rows). Names (all prefixed fastpipe_):

    requests_total{route, outcome}        outcome: stop, length, error, timeout, disconnect, shutdown,
                                          rejected (queue full or draining: 503), invalid (4xx)
    prompt_tokens_total, generation_tokens_total
    time_to_first_token_seconds           histogram: request received -> its first token at the server
    inter_token_latency_seconds           histogram: between a request's tokens (tokens that arrive
                                          together share the gap)
    request_duration_seconds              histogram: received -> last token
    queue_depth, requests_running, batch_rows, batch_occupancy, requests_in_flight    gauges
"""
from __future__ import annotations

import bisect
from typing import Callable

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(pairs: tuple) -> str:
    if not pairs:
        return ""
    inner = ",".join(f'{k}="{v}"' for k, v in pairs)
    return "{" + inner + "}"


def _num(v: float) -> str:
    return repr(float(v)) if v != int(v) or abs(v) >= 1e15 else str(int(v))


class Counter:
    def __init__(self, name: str, help: str):
        self.name, self.help = name, help
        self.values: dict[tuple, float] = {}

    def inc(self, by: float = 1, **labels) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0) + by

    def get(self, **labels) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0)

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        items = self.values.items() if self.values else [((), 0)]
        out += [f"{self.name}{_labels(k)} {_num(v)}" for k, v in sorted(items)]
        return out


class Histogram:
    def __init__(self, name: str, help: str, buckets=LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)      # per bucket, the last one +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for le, n in zip(list(self.buckets) + ["+Inf"], self.counts):
            total += n
            out.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        out += [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {self.count}"]
        return out


class Gauge:
    def __init__(self, name: str, help: str, read: Callable[[], float]):
        self.name, self.help, self.read = name, help, read

    def lines(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge", f"{self.name} {_num(self.read())}"]


class ServerMetrics:
    """Every metric of one server (module docstring). engine: what the gauges read (waiting, active, batch);
    in_flight: a callable giving the requests the server has submitted and not yet answered."""

    def __init__(self, engine, in_flight: Callable[[], int]):
        p = "fastpipe_"
        self.requests = Counter(p + "requests_total", "Generation requests answered, by route and outcome.")
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of the requests admitted.")
        self.generation_tokens = Counter(p + "generation_tokens_total", "Tokens generated.")
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Request received to its first token.")
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between a request's tokens.")
        self.duration = Histogram(p + "request_duration_seconds", "Request received to its last token.",
                                  DURATION_BUCKETS)
        self.gauges = [
            Gauge(p + "queue_depth", "Requests waiting for a decode row.", lambda: engine.waiting),
            Gauge(p + "requests_running", "Requests decoding now (busy rows).", lambda: engine.active),
            Gauge(p + "batch_rows", "Decode rows (the decode batch).", lambda: engine.batch),
            Gauge(p + "batch_occupancy", "Busy decode rows over all of them (0 to 1).",
                  lambda: engine.active / engine.batch),
            Gauge(p + "requests_in_flight", "Requests submitted and not yet answered.", in_flight),
        ]

    def text(self) -> str:
        parts = [self.requests, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.duration,
                 *self.gauges]
        return "\n".join(line for m in parts for line in m.lines()) + "\n"
