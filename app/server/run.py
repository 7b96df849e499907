"""Listening: the address checks, the socket, and uvicorn run in the foreground (`gapless serve`) or on a
thread (the app's Server panel and the tests)."""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from typing import Any, Optional

import uvicorn

from app.server.engine_queue import EngineQueue
from app.server.http import ServeConfig, create_app
from engine.errors import GaplessError

log = logging.getLogger(__name__)


class ServeError(GaplessError):
    """The server cannot listen as asked."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_address(host: str, api_key: Optional[str]) -> None:
    if not is_loopback(host) and not api_key:
        raise ServeError(
            f"refusing to listen on {host} without an API key: anyone who can reach this machine "
            "could use the model; pass --api-key KEY, or listen on 127.0.0.1"
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


def uvicorn_server(engines: EngineQueue, config: ServeConfig) -> uvicorn.Server:
    app = create_app(engines, config)
    return uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5)
    )


class AsgiThread:
    """An ASGI app served by uvicorn on its own thread, on a socket bound here. stop() lets running requests
    end (cut after the graceful-shutdown time) and closes the socket."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5)
        )
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
        super().__init__(create_app(engines, config), host, port)
