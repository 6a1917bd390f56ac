"""One generation request on the server's event loop: the engine's tokens, as text pieces, until it ends.

    job = Job(engine_request, tokenizer, stops=["\\n"], received=t0, metrics=m, loop=asyncio.get_running_loop())
    async for piece in job.pieces():          # Piece(text, token_ids): text safe to send, the ids it came from
        ...
    job.finish_reason                         # "stop" | "length" | "timeout" | "disconnect" | "shutdown" | "error"

The engine's worker thread never waits on the loop, and the loop never waits on the worker: the request
calls back after each token (Request.on_change), and the callback only schedules an asyncio.Event's set
on the loop (call_soon_threadsafe). The job then reads whatever tokens have come (Request.since) and
turns them into text (TextStream: whole characters only) checked against the stop strings (StopText).
Tokens that arrive together make one piece.

A job ends early (Request.cancel: its row is free at the engine's next step) when its text reaches a
stop string, or when `end(reason)` is called: the client went away ("disconnect"), its time ran out
("timeout"), or the server is shutting down past its grace period ("shutdown"); Watch calls it. end()
finishes the job at once, without waiting for the engine: a timeout is answered on time even while
the engine is busy with a long step.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastpipe.server.stops import StopText

ENGINE_REASONS = {"eos": "stop", "length": "length", "error": "error"}


@dataclass
class Piece:
    text: str
    token_ids: list[int]


class TokenFeed:
    """The engine request's tokens on the event loop: `await next()` -> (new tokens, finished)."""

    def __init__(self, request, loop: asyncio.AbstractEventLoop):
        self.request, self._loop = request, loop
        self._wake = asyncio.Event()
        self._read = 0
        self.ended = False                    # end(): the feed stops now, whatever the engine is doing
        request.on_change(self._poke)

    def _poke(self) -> None:                  # the engine's worker thread
        self._loop.call_soon_threadsafe(self._wake.set)

    def end(self) -> None:
        self.ended = True
        self._wake.set()

    async def next(self) -> tuple[list[int], bool]:
        while True:
            self._wake.clear()                # cleared before reading: a token after the read sets it again
            new, finished = self.request.since(self._read)
            finished = finished or self.ended
            if new or finished:
                self._read += len(new)
                return new, finished
            await self._wake.wait()


class Job:
    def __init__(self, request, tokenizer, *, stops, received: float, metrics, loop):
        self.request = request
        self.feed = TokenFeed(request, loop)
        self.text = tokenizer.stream() if tokenizer is not None else None
        self.stops = StopText(stops)
        self.received, self.metrics = received, metrics
        self.completion_tokens = 0
        self.ended_by: str | None = None      # set by end(): disconnect, timeout, shutdown
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.first_token_at: float | None = None
        self._last_at: float | None = None

    def end(self, reason: str) -> None:
        """Finish the job now with `reason` (its answer goes out at once), and the engine request at the
        engine's next step (its row frees then)."""
        if self.finish_reason is None and self.ended_by is None:
            self.ended_by = reason
            self.request.cancel()
            self.feed.end()

    async def pieces(self):
        """The request's text in pieces as it is made (each piece non-empty or carrying token ids), up to
        a stop string; sets finish_reason (and error) at the end."""
        while True:
            tokens, finished = await self.feed.next()
            if tokens:
                self._timed(len(tokens))
                piece = self._take(tokens)
                if piece.text or piece.token_ids:
                    yield piece
                if self.stops.stopped is not None:
                    self.request.cancel()                    # the row frees at the next step
                    self._ended("stop")
                    return
            if finished:
                break
        tail = self.stops.add(self.text.finish()) if self.text is not None else ""
        if self.stops.stopped is not None:
            self._ended("stop")
        else:
            tail += self.stops.finish()
            r = self.request           # not done: ended by end(); "cancelled": by end(), or the engine closing
            reason = (r.done and ENGINE_REASONS.get(r.finish_reason)) or self.ended_by or "shutdown"
            self._ended(reason, r.error if reason == "error" else None)
        if tail:
            yield Piece(tail, [])

    def _take(self, tokens: list[int]) -> Piece:
        """The text these tokens make final, cut at a stop string; the tokens taken (none after a stop)."""
        out, taken = [], []
        for t in tokens:
            taken.append(t)
            self.completion_tokens += 1
            if self.text is not None:
                out.append(self.stops.add(self.text.add(t)))
                if self.stops.stopped is not None:
                    break
        return Piece("".join(out), taken)

    def _timed(self, n: int) -> None:
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.received)
            n -= 1
        elif n:
            gap = (now - self._last_at) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
        self._last_at = now

    def _ended(self, reason: str, error: BaseException | None = None) -> None:
        self.finish_reason, self.error = reason, error
        self.metrics.generation_tokens.inc(self.completion_tokens)
        if self.first_token_at is not None:
            self.metrics.duration.observe(self._last_at - self.received)


class Watch:
    """Ends a job when its client disconnects, its time runs out, or the server's grace period does:
    run() as a task beside the job's answer; cancel it once the answer is complete."""

    def __init__(self, job: Job, receive, *, deadline: float | None, shutdown: asyncio.Event):
        self.job, self.receive, self.deadline, self.shutdown = job, receive, deadline, shutdown

    async def _disconnected(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass

    async def run(self) -> None:
        waits = {asyncio.ensure_future(self._disconnected()): "disconnect",
                 asyncio.ensure_future(self.shutdown.wait()): "shutdown"}
        try:
            timeout = None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())
            done, _ = await asyncio.wait(list(waits), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            self.job.end(next((waits[t] for t in done), "timeout"))
        finally:
            for t in waits:
                t.cancel()
