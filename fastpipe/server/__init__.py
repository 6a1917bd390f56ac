"""`fastpipe serve`: an OpenAI-compatible HTTP server over one generation engine (the `[serve]` extra:
Starlette and uvicorn).

    from fastpipe.server import ServerSettings, make_app, serve
    app = make_app(engine, tokenizer, ServerSettings(model_name="llama"))   # an ASGI app: mount it anywhere
    serve(app, host="127.0.0.1", port=8000)                                # or run it: returns at SIGTERM

Modules: protocol (OpenAI's request bodies, checked), responses (OpenAI's answer shapes, SSE), stops
(stop strings on streamed text), job (one request on the event loop: the engine's tokens as text),
metrics (Prometheus), app (the routes and limits), run (uvicorn, the socket, the shutdown).
Importing this package imports neither Starlette nor uvicorn; make_app and serve do.
"""
from __future__ import annotations

from fastpipe.server.extra import require_extra

__all__ = ["ServerSettings", "make_app", "require_extra", "serve"]


def __getattr__(name: str):
    if name in ("ServerSettings", "make_app"):
        require_extra()
        from fastpipe.server import app

        return getattr(app, name)
    if name == "serve":
        from fastpipe.server.run import serve

        return serve
    raise AttributeError(f"module 'fastpipe.server' has no attribute {name!r}")
