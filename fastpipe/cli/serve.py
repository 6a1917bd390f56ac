"""`fastpipe serve`: a serving set behind the OpenAI API (fastpipe.server), until SIGTERM.

It binds the port (a taken one fails at once), loads the engine (and the folder's tokenizer, when it
has one), prints one line "listening on http://HOST:PORT (...)" on stdout once requests are accepted
(connections made while loading wait in the listen backlog until then), and serves; SIGTERM or SIGINT
drains (fastpipe.server.run) and exits 0. Start-up errors are the CLI's one line and exit 2.
"""
from __future__ import annotations

import sys
from pathlib import Path

from fastpipe.errors import InputError


def cmd_serve(args) -> int:
    from fastpipe.cli.common import compile_mode, device_map_of
    from fastpipe.cli.generate import check_serving_folder, open_engine
    from fastpipe.serving.tokenizer import Tokenizer, has_tokenizer

    folder = Path(args.serving_set)
    check_serving_folder(folder)
    for name in ("max_queue", "grace"):
        if getattr(args, name) < 0:
            raise InputError(f"--{name.replace('_', '-')}: expected a number >= 0, found {getattr(args, name)}")
    for name in ("max_body_bytes", "request_timeout"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise InputError(f"--{name.replace('_', '-')}: expected a number > 0, found {v}")
    from fastpipe.server import require_extra

    require_extra()                        # refused now, before loading, where the extra is missing
    from fastpipe.server import ServerSettings, make_app, serve
    from fastpipe.server.run import bind

    tok = Tokenizer.load(folder, who="serve") if has_tokenizer(folder) else None
    sock = bind(args.host, args.port)      # before loading: a taken port fails now; early clients wait in the backlog
    mode = compile_mode(args)
    try:
        engine = open_engine(folder, args.batch, largest=True, processor=args.processor, compile=mode,
                             device_map=device_map_of(args))
    except BaseException:
        sock.close()
        raise
    try:
        warm_s = engine.warmup()
        settings = ServerSettings(model_name=args.model_name or folder.resolve().name, max_queue=args.max_queue,
                                  max_body_bytes=args.max_body_bytes, request_timeout=args.request_timeout,
                                  grace=args.grace)
        app = make_app(engine, tok, settings)
        how = {"wait": f"compiled in {warm_s:.1f} s", "off": "not compiled",
               "background": "buckets compile in the background as they are used"}[mode]
        text = "text and token ids" if tok is not None else "token ids only: no tokenizer in the folder"

        def ready(address) -> None:
            host, port = address
            print(f"listening on http://{host}:{port} (model \"{settings.model_name}\", decode batch {engine.batch}, "
                  f"max_len {engine.max_len}, {text}; {how})", flush=True)

        serve(app, grace=args.grace, log_level=args.log_level, ready=ready, sock=sock)
    finally:
        sock.close()
        engine.close(cancel=True, timeout=10)
    print("stopped", file=sys.stderr, flush=True)
    return 0


def add_parser(sub, common_flags) -> None:
    s = sub.add_parser("serve", help="serve a serving set (fastpipe build --serve) behind the OpenAI API "
                                     "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)",
                       description="Load a serving set and serve it over HTTP until SIGTERM or SIGINT (which drain: "
                                   "no new requests, in-flight ones get --grace seconds, exit 0). Needs the serve "
                                   "extra: pip install 'fastpipe[serve]'. docs/serving.md, 'fastpipe serve'.")
    s.add_argument("serving_set", metavar="FOLDER", help="a folder written by `fastpipe build MODEL -o FOLDER --serve`")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every one)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one, printed)")
    s.add_argument("--model-name", metavar="NAME", help="the model's name in the API (default: the folder's name)")
    s.add_argument("--batch", type=int, metavar="B", help="decode rows: one of the built decode batches (default the "
                                                          "largest)")
    s.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests waiting for a decode row past which new ones get 503 with Retry-After (default 256)")
    s.add_argument("--max-body-bytes", type=int, default=4 << 20, metavar="N",
                   help="largest request body; larger gets 413 before it is read (default 4 MiB)")
    s.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="a request running longer ends: 504, or an error event in a stream (default 600)")
    s.add_argument("--grace", type=float, default=30.0, metavar="S",
                   help="at SIGTERM: seconds in-flight requests may still run (default 30)")
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning",
                   help="uvicorn's log level (info and debug also log each request)")
    common_flags(s)
