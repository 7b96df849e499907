"""Listening: the address checks, the socket, and uvicorn run in the foreground (`gapless serve`) or on a
thread (the app's Server panel and the tests)."""

from __future__ import annotations

import logging
import re
import socket
import threading
from types import FrameType
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

import uvicorn

from app.server.engine_queue import EngineQueue
from app.server.http import ServeConfig, create_app, is_loopback
from engine.errors import GaplessError
from engine.types import api_key_problem

log = logging.getLogger(__name__)


class ServeError(GaplessError):
    """The server cannot listen as asked."""


def check_address(host: str, api_key: Optional[str]) -> None:
    """Another address than loopback needs an API key; a key must be one a client can send."""
    if not is_loopback(host) and not api_key:
        raise ServeError(
            f"refusing to listen on {host} without an API key: anyone who can reach this machine "
            "could use the model; give an API key (--api-key KEY or GAPLESS_SERVE_API_KEY; the Server panel's key in the "
            "app), or listen on 127.0.0.1"
        )
    problem = api_key_problem(api_key) if api_key else None
    if problem:
        raise ServeError(problem)


def check_origins(origins: "tuple[str, ...]", api_key: Optional[str]) -> None:
    """An allowed browser origin is what a browser sends in Origin: scheme://host[:port], nothing after. "*"
    (any page) only with a key: without one, any page this machine's browser opens could use the model."""
    for origin in origins:
        if origin == "*":
            if not api_key:
                raise ServeError(
                    "--cors-origin '*' lets every web page use the model: it needs an API key (--api-key KEY or "
                    "GAPLESS_SERVE_API_KEY; pages cannot know the key); without one, name each page's origin, e.g. "
                    "--cors-origin http://localhost:3000"
                )
            continue
        parts = urlsplit(origin)
        # any scheme a page can have: http(s), and a browser extension's or a desktop app's own (chrome-extension,
        # moz-extension, app, tauri), whose pages send theirs
        scheme = re.fullmatch(r"[a-z][a-z0-9+.-]*", parts.scheme)
        if not scheme or not parts.netloc or origin != f"{parts.scheme}://{parts.netloc}":
            raise ServeError(
                f"--cors-origin {origin!r} is not an origin as a browser sends it: scheme://host[:port], with no "
                "path or trailing slash (e.g. http://localhost:3000)"
            )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one)."""
    if not 0 <= port <= 65535:
        raise ServeError(f"port must be between 0 and 65535, got {port}")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServeError(f"cannot resolve {host}: {exc.strerror}") from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}/v1"


class _Server(uvicorn.Server):
    """uvicorn's server, which first calls `on_exit` when told to stop (Ctrl-C, SIGTERM): the generations in
    flight end then, so their clients are answered before the graceful shutdown would cut them."""

    def __init__(self, app: Any, on_exit: Optional[Callable[[], None]] = None):
        super().__init__(
            uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5)
        )
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        if self.on_exit is not None:
            # a signal handler runs between two bytecodes of the main thread, which may hold the lock on_exit takes
            threading.Thread(target=self.on_exit, name="gapless-serve-exit", daemon=True).start()
        super().handle_exit(sig, frame)


def uvicorn_server(engines: EngineQueue, config: ServeConfig) -> uvicorn.Server:
    return _Server(create_app(engines, config), engines.shut_down)


class AsgiThread:
    """An ASGI app served by uvicorn on its own thread, on a socket bound here. stop() lets running requests
    end (cut after the graceful-shutdown time) and closes the socket."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, on_stop: Optional[Callable[[], None]] = None):
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        self.server = _Server(app, on_stop)
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="gapless-serve-http", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as exc:  # reported by the owner (the app shows it); the thread must end cleanly
            log.exception("serve: the HTTP server stopped on an error")
            self.error = exc

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.server.on_exit is not None:
            self.server.on_exit()
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self.sock.close()


class BackgroundServer(AsgiThread):
    """`gapless serve`'s app on a thread (the app's Server panel, the tests)."""

    def __init__(
        self, engines: EngineQueue, host: str = "127.0.0.1", port: int = 0, config: Optional[ServeConfig] = None
    ):
        config = config or ServeConfig()
        check_address(host, config.api_key)
        self.engines = engines
        super().__init__(create_app(engines, config), host, port, engines.shut_down)
