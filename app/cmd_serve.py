"""`gapless serve`: the OpenAI-compatible server on one engine, in the foreground until Ctrl+C."""

from __future__ import annotations

import os
import sys

from app.cmd_generate import options_from_args
from app.server.engine_queue import EngineQueue
from app.server.http import ServeConfig
from app.server.run import ServeError, bind, check_address, check_origins, url_of, uvicorn_server
from engine.types import Progress

KEY_VARIABLE = "GAPLESS_SERVE_API_KEY"  # the key where --api-key would show it to every user in the process list


def run_serve(args) -> int:
    from engine.engine import Engine

    key = args.api_key or os.environ.get(KEY_VARIABLE, "").strip() or None
    config = ServeConfig(api_key=key, max_body_bytes=args.max_body_bytes, cors_origins=tuple(args.cors_origin))
    if args.max_queue < 0:
        raise ServeError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_body_bytes < 1024:
        raise ServeError(f"--max-body-bytes must be at least 1024, got {args.max_body_bytes}")
    check_address(args.host, config.api_key)
    check_origins(config.cors_origins, config.api_key)
    options = options_from_args(args)
    sock = bind(args.host, args.port)  # before the model loads: a taken port is said at once

    def progress(p: Progress) -> None:
        if sys.stderr.isatty():
            frac = f" {p.fraction:.0%}" if p.fraction is not None else ""
            print(f"\r[{p.stage}{frac}] {p.message}\033[K", end="", file=sys.stderr, flush=True)

    try:
        engine = Engine.load(args.model, options, progress)
    except BaseException:
        sock.close()
        raise
    engines = EngineQueue(engine, max_waiting=args.max_queue)
    try:
        if args.served_model_name:
            engines.model_id = args.served_model_name
        for option, reason in engine.unavailable().items():
            print(f"note: {option} unavailable: {reason}", file=sys.stderr)
        print(
            f"\rserving {engines.model_id} at {url_of(sock)}{' (API key required)' if config.api_key else ''}\033[K",
            file=sys.stderr,
            flush=True,
        )
        uvicorn_server(engines, config).run(sockets=[sock])
    finally:
        engines.close()
        engine.close()
        sock.close()
    return 0
