"""`fastpipe serve`'s process: one engine, the app, uvicorn on a socket of our own, and the shutdown.

    serve(make_app(engine, tokenizer, settings), host="127.0.0.1", port=8000, ready=print)   # returns at shutdown

The socket is bound here (port 0: a free one), with a listen backlog of 2048, so that a burst of
connections waits in the kernel's queue instead of being reset, and `ready` is told the real address
once uvicorn accepts on it.

SIGTERM or SIGINT (a second SIGINT: at once): no new connections and no new requests (503, /health 503);
the requests in flight go on for `grace` seconds, then end (their answers say so: 503, or an
error event in a stream); the engine closes (cancelling what is left) and serve() returns, so that the
process exits 0. uvicorn's own handling re-raises the signal after its shutdown (the exit status would
be the signal's): this server installs its own handlers instead.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading

BACKLOG = 2048


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        from fastpipe.errors import InputError

        raise InputError(f"--port: expected a free port on {host}, found {port} taken or not allowed ({e.strerror})") \
            from None
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


def server_for(app, *, log_level: str = "warning", grace: float = 30.0, on_signal=None):
    """A uvicorn Server for `app` whose signal handlers begin the drain (on_signal, on the loop) and do not
    re-raise the signal afterwards. uvicorn's own grace (its backstop: it cancels the handlers' tasks) is
    the app's grace plus 10 s."""
    from fastpipe.server.extra import require_extra

    require_extra()
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame):
            if on_signal is not None and not self.should_exit:
                with contextlib.suppress(RuntimeError):         # no loop running yet
                    loop = asyncio.get_running_loop()
                    loop.call_soon_threadsafe(on_signal)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level=log_level, access_log=log_level in ("debug", "info"), lifespan="off",
                            timeout_graceful_shutdown=grace + 10, backlog=BACKLOG)
    return _Server(config)


def serve(app, *, host: str = "127.0.0.1", port: int = 8000, grace: float = 30.0, log_level: str = "warning",
          ready=None, sock: socket.socket | None = None) -> None:
    """Run `app` (make_app's) until SIGTERM/SIGINT; returns after the drain (module docstring). sock: a
    socket from bind() to serve on instead of host:port (`fastpipe serve` binds before loading the model,
    so that a taken port fails at once, not after minutes of loading)."""
    sock = sock if sock is not None else bind(host, port)
    state = app.state.fastpipe
    server = server_for(app, log_level=log_level, grace=grace, on_signal=state.begin_drain)

    async def main():
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started and ready is not None:
            ready(sock.getsockname()[:2])
        await task

    try:
        run_loop(main(), server.config)
    finally:
        sock.close()


def run_loop(coro, config) -> None:
    """Run coro on the event loop uvicorn would pick (loop="auto": uvloop when installed, else asyncio)."""
    factory = config.get_loop_factory() if hasattr(config, "get_loop_factory") else None
    if factory is None:
        if hasattr(config, "setup_event_loop"):        # older uvicorn: sets the policy instead
            config.setup_event_loop()
        asyncio.run(coro)
        return
    loop = factory()
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(coro)
    finally:
        asyncio.set_event_loop(None)
        loop.close()
