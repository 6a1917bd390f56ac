"""The OpenAI-compatible ASGI app (Starlette) over one Engine: routes, limits, answers.

    app = make_app(engine, tokenizer, ServerSettings(model_name="llama"))    # tokenizer: a Tokenizer or None
    uvicorn.run(app)                   # or mount it in your own Starlette / FastAPI app (examples/server.py)

Routes: POST /v1/completions, POST /v1/chat/completions (fastpipe.server.protocol says what they take),
GET /v1/models, GET /health (503 while draining), GET /metrics (Prometheus text; fastpipe.server.metrics).

What every generation request goes through, in order (docs/serving.md, "fastpipe serve"):
1. draining (shutdown begun): 503;
2. the body: a Content-Length past max_body_bytes is answered 413 before a byte of the body is read (and
   a body without one is cut off at the limit, 413);
3. the fields (protocol.parse_request), the prompt's tokens (the tokenizer runs in a worker thread, off
   the event loop), its length against the largest prefill bucket and max_tokens against max_len: 400;
4. admission: at most engine.batch + max_queue requests in flight (decoding or queued); past it 503 with
   Retry-After (overload is the server's state, not the client's rate: 429 would say the client sent
   too much);
5. the engine (submit), the answer whole or streamed (job.Job), ended early by a stop string, the
   client going away, request_timeout (504, or an error event in a stream) or the end of the grace
   period of a shutdown (503, or an error event).
Every error is OpenAI's error object {"error": {"message", "type", "param", "code"}}, one line.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fastpipe.errors import InputError
from fastpipe.server.job import Job, Watch
from fastpipe.server.metrics import CONTENT_TYPE, ServerMetrics
from fastpipe.server.protocol import COMPLETIONS_DEFAULT_MAX_TOKENS, ApiError, Ask, parse_request
from fastpipe.server.responses import DONE, Shapes, sse, usage


@dataclass
class ServerSettings:
    model_name: str                        # what /v1/models lists and requests may name
    max_queue: int = 256                   # requests waiting for a decode row before 503
    max_body_bytes: int = 4 << 20          # larger bodies: 413
    request_timeout: float | None = 600.0  # seconds from arrival to the last token (None: no limit)
    grace: float = 30.0                    # shutdown: in-flight requests may finish for this long, then end
    retry_after: int = 1                   # the Retry-After (seconds) of a 503


class ServerState:
    """What the routes share: the engine, the tokenizer, the settings, the metrics, the in-flight count,
    and the shutdown: draining (no new requests) and, once the grace period is over, `shutdown` set."""

    def __init__(self, engine, tokenizer, settings: ServerSettings):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.in_flight = 0
        self.draining = False
        self.shutdown: asyncio.Event | None = None           # made on the loop, at the first request
        self.metrics = ServerMetrics(engine, lambda: self.in_flight)

    def shutdown_event(self) -> asyncio.Event:
        if self.shutdown is None:
            self.shutdown = asyncio.Event()
        return self.shutdown

    def begin_drain(self) -> None:
        """Stop taking requests; end the in-flight ones once the grace period is over (on the loop)."""
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().call_later(self.settings.grace, self.shutdown_event().set)

    def capacity(self) -> int:
        return self.engine.batch + self.settings.max_queue


def make_app(engine, tokenizer, settings: ServerSettings) -> Starlette:
    state = ServerState(engine, tokenizer, settings)

    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completions")

    async def chat(request: Request) -> Response:
        return await _generate(state, request, "chat")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": settings.model_name, "object": "model", "created": _STARTED, "owned_by": "fastpipe",
             "max_model_len": engine.max_len}]})

    async def health(request: Request) -> Response:
        body = {"status": "draining" if state.draining else "ok", "model": settings.model_name,
                "batch": engine.batch, "max_len": engine.max_len, "running": engine.active,
                "waiting": engine.waiting}
        return JSONResponse(body, status_code=503 if state.draining else 200)

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.text(), media_type=CONTENT_TYPE)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        what = "not found" if exc.status_code == 404 else exc.detail
        return _error(ApiError(exc.status_code, f"{request.method} {request.url.path}: {what}",
                               code="not_found" if exc.status_code == 404 else None))

    async def internal_error(request: Request, exc: Exception) -> Response:
        return _error(ApiError(500, f"server: internal error: {type(exc).__name__}: {exc}", type="server_error"))

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error, Exception: internal_error})
    app.state.fastpipe = state
    return app


_STARTED = int(time.time())


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes: a larger Content-Length is refused before reading (413)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdecimal() and int(length) > limit:
        raise ApiError(413, f"body: expected at most {limit} bytes, found Content-Length {length}",
                       code="body_too_large", headers={"Connection": "close"})
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"body: expected at most {limit} bytes, found more", code="body_too_large",
                           headers={"Connection": "close"})
        chunks.append(chunk)
    return b"".join(chunks)


async def _prompt_ids(state: ServerState, ask: Ask) -> list[int]:
    """The prompt's token ids: given, or from the text or the chat template (in a worker thread)."""
    if isinstance(ask.prompt, list):
        return ask.prompt
    tok = state.tokenizer
    what = "prompt" if ask.route == "completions" else "messages"
    if tok is None:
        raise ApiError(400, f"{what}: expected token ids (a list of ints as prompt of /v1/completions): the served "
                            "folder has no tokenizer, found text", param=what)
    try:
        if ask.route == "chat":
            return await asyncio.to_thread(tok.apply_chat_template, ask.messages)
        return await asyncio.to_thread(tok.encode, ask.prompt)
    except InputError as e:
        raise ApiError(400, str(e), param=what) from None


def _max_new_tokens(state: ServerState, ask: Ask, n_prompt: int) -> int:
    engine, what = state.engine, "prompt" if ask.route == "completions" else "messages"
    if n_prompt > engine.longest_prompt:
        raise ApiError(400, f"{what}: expected at most {engine.longest_prompt} tokens (the largest prefill bucket), "
                            f"found {n_prompt}", param=what, code="context_length_exceeded")
    room = engine.max_len - n_prompt
    if room < 1:
        raise ApiError(400, f"{what}: expected fewer than {engine.max_len} tokens (max_len), found {n_prompt}",
                       param=what, code="context_length_exceeded")
    if ask.max_tokens is None:
        return min(COMPLETIONS_DEFAULT_MAX_TOKENS, room) if ask.route == "completions" else room
    if ask.max_tokens > room:
        raise ApiError(400, f"max_tokens: expected at most {room} (max_len {engine.max_len} less the prompt's "
                            f"{n_prompt} tokens), found {ask.max_tokens}", param="max_tokens",
                       code="context_length_exceeded")
    return ask.max_tokens


async def _generate(state: ServerState, request: Request, route: str) -> Response:
    received = time.perf_counter()
    settings, engine = state.settings, state.engine
    try:
        if state.draining:
            raise ApiError(503, "server: shutting down, expected no new requests", type="server_error",
                           code="shutting_down", headers={"Retry-After": str(settings.retry_after)})
        ask = parse_request(route, await read_body(request, settings.max_body_bytes), model=settings.model_name)
        if ask.stop and state.tokenizer is None:
            raise ApiError(400, "stop: expected none: the served folder has no tokenizer to check text with",
                           param="stop")
        ids = await _prompt_ids(state, ask)
        max_new = _max_new_tokens(state, ask, len(ids))
        try:
            engine.check(ids, max_new_tokens=max_new, sampling=ask.sampling)
        except InputError as e:
            raise ApiError(400, str(e), param=str(e).split(":")[0].split(".")[0]) from None
        if state.in_flight >= state.capacity():
            raise ApiError(503, f"server: expected at most {state.capacity()} requests in flight (decode batch "
                                f"{engine.batch} + max_queue {settings.max_queue}), found it full; retry later",
                           type="server_error", code="queue_full",
                           headers={"Retry-After": str(settings.retry_after)})
        try:
            req = engine.submit(ids, max_new_tokens=max_new, sampling=ask.sampling, ignore_eos=ask.ignore_eos)
        except InputError as e:                 # the engine closed under us: the server is stopping
            raise ApiError(503, str(e), type="server_error", code="shutting_down") from None
    except ApiError as e:
        state.metrics.requests.inc(route=route, outcome="rejected" if e.status == 503 else "invalid")
        return _error(e)
    state.in_flight += 1
    state.metrics.prompt_tokens.inc(len(ids))
    job = Job(req, state.tokenizer, stops=ask.stop, received=received, metrics=state.metrics,
              loop=asyncio.get_running_loop())
    shapes = Shapes(route, model=settings.model_name, include_usage=ask.include_usage)
    deadline = None if settings.request_timeout is None else received + settings.request_timeout
    answer = _Answer(state, route, job, ask, shapes, len(ids), deadline)
    if ask.stream:
        return _EventStream(answer)
    return await answer.whole(request.receive)


_ENDED = {
    "timeout": (504, "timeout", "request: expected it finished within the server's request timeout of {t} s, "
                                "found it running"),
    "shutdown": (503, "shutting_down", "server: shutting down, the request was ended after the grace period"),
    "disconnect": (499, "client_closed", "client: closed the connection"),
}


class _Answer:
    """One request's answer, whole (whole()) or streamed (events()); finished() counts it out once."""

    def __init__(self, state: ServerState, route: str, job: Job, ask: Ask, shapes: Shapes, n_prompt: int,
                 deadline: float | None):
        self.state, self.route, self.job, self.ask, self.shapes = state, route, job, ask, shapes
        self.n_prompt, self.deadline = n_prompt, deadline
        self._counted = False

    def watch(self, receive) -> asyncio.Future:
        return asyncio.ensure_future(Watch(self.job, receive, deadline=self.deadline,
                                           shutdown=self.state.shutdown_event()).run())

    def finished(self) -> None:
        if self._counted:
            return
        self._counted = True
        if self.job.finish_reason is None:           # the handler itself was cancelled (the server stopping)
            self.job.end("shutdown")
        self.state.in_flight -= 1
        outcome = self.job.finish_reason or self.job.ended_by or "shutdown"
        self.state.metrics.requests.inc(route=self.route, outcome=outcome)

    def failure(self) -> ApiError:
        job = self.job
        if job.finish_reason in _ENDED:
            status, code, msg = _ENDED[job.finish_reason]
            return ApiError(status, msg.format(t=self.state.settings.request_timeout),
                            type="timeout" if code == "timeout" else "server_error", code=code)
        why = " ".join(str(job.error).split()) if job.error is not None else "the engine ended it"
        return ApiError(500, f"generation: {why}", type="server_error")

    async def whole(self, receive) -> Response:
        watch = self.watch(receive)
        text, ids = [], []
        try:
            async for piece in self.job.pieces():
                text.append(piece.text)
                ids += piece.token_ids
        finally:
            watch.cancel()
            self.finished()
        if self.job.finish_reason not in ("stop", "length"):
            return _error(self.failure())
        use = usage(self.n_prompt, self.job.completion_tokens)
        body = self.shapes.whole("".join(text), self.job.finish_reason, use,
                                 ids if self.ask.return_token_ids or self.state.tokenizer is None else None)
        return JSONResponse(body)

    async def events(self):
        """The stream's events (bytes), [DONE] last."""
        shapes, with_ids = self.shapes, self.ask.return_token_ids or self.state.tokenizer is None
        if shapes.chat:
            yield sse(shapes.chunk(None, role=True))
        async for piece in self.job.pieces():
            if piece.text or with_ids:            # text held back (half a character, a stop's prefix): later
                yield sse(shapes.chunk(piece.text, token_ids=piece.token_ids if with_ids else None))
        if self.job.finish_reason in ("stop", "length"):
            yield sse(shapes.chunk(None, finish_reason=self.job.finish_reason, token_ids=[] if with_ids else None))
            if shapes.include_usage:
                yield sse(shapes.usage_chunk(usage(self.n_prompt, self.job.completion_tokens)))
        elif self.job.finish_reason != "disconnect":
            yield sse(self.failure().body())
        yield DONE


class _EventStream(Response):
    """A Server-Sent Events answer that watches its client: a disconnect ends the job (its row frees at the
    engine's next step) rather than waiting for the next write to fail."""

    media_type = "text/event-stream"

    def __init__(self, answer: _Answer):
        self.status_code, self.background, self.answer = 200, None, answer     # no body: no Content-Length
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        watch = self.answer.watch(receive)
        try:
            async for event in self.answer.events():
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:                        # the client went away mid-write
            self.answer.job.end("disconnect")
        finally:
            watch.cancel()
            self.answer.finished()
