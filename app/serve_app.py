"""The app's API server: `gapless serve`'s HTTP app on a thread, its requests run on the engine worker's thread
between the app's own commands, so chats and API requests take turns on one engine without touching each
other's state. The Server panel (ui/server_panel.py) drives it through app/gui.py."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

from PySide6.QtCore import QObject, QTimer, Signal

from app.engines import SELF_REMOTE
from app.server.engine_queue import EngineQueue, ModelFacts, ShuttingDown, model_key
from app.server.http import ServeConfig
from app.server.protocol import ApiError
from app.server.run import BackgroundServer
from app.worker import Call, EngineController
from engine.errors import GaplessError
from engine.types import source_label

log = logging.getLogger(__name__)

STATS_INTERVAL_MS = 500


def reaches(server_url: str, base_url: str) -> bool:
    """Whether a remote model's `base_url` is the server listening at `server_url`: the same port, and the same
    host, or, for a server on 0.0.0.0 or ::, any address of this machine (loopback, its LAN address, its name)."""
    from urllib.parse import urlsplit

    from app.server.http import is_loopback

    a, b = urlsplit(server_url), urlsplit(base_url)
    try:
        ports = a.port or 80, b.port or (443 if b.scheme == "https" else 80)
    except ValueError:  # a port that is not a number
        return False
    host, other = a.hostname or "", b.hostname or ""
    if ports[0] != ports[1]:
        return False
    if host == other or (is_loopback(host) and is_loopback(other)):
        return True
    return host in WILDCARD and _this_machine(other)


def _this_machine(host: str) -> bool:
    """Whether `host` names this machine: loopback, its own name, or an address one of its interfaces has (a
    socket binds only to those; nothing is sent, and no name is looked up)."""
    import ipaddress
    import socket

    from app.server.http import is_loopback

    if is_loopback(host) or host.lower() == socket.gethostname().lower():
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(address), 0))
    except OSError:
        return False
    return True


WILDCARD = ("0.0.0.0", "::")


def reachable_url(server_url: str) -> Optional[str]:
    """For a server on every address (0.0.0.0, ::), its URL at this machine's LAN address (the interface a packet
    would leave by; nothing is sent), else its name; None for a server on one address (its URL is the one)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(server_url)
    if parts.hostname not in WILDCARD:
        return None
    host = socket.gethostname()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        try:
            udp.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
            host = udp.getsockname()[0]
        except OSError:  # no route: the machine's name
            pass
    return parts._replace(netloc=f"{host}:{parts.port}").geturl()


class AppServer(QObject):
    started = Signal(str)  # the base URL
    stopped = Signal()
    failed = Signal(str)  # why it could not start, or why it stopped
    statsChanged = Signal(object)  # ServerStats.snapshot()

    def __init__(self, controller: EngineController, parent: Optional[QObject] = None):
        super().__init__(parent)
        self.controller = controller
        self.engines: Optional[EngineQueue] = None
        self.server: Optional[BackgroundServer] = None
        self._closing = threading.Event()
        self._timer = QTimer(self)
        self._timer.setInterval(STATS_INTERVAL_MS)
        self._timer.timeout.connect(self._poll)
        controller.loaded.connect(self._on_loaded)
        controller.loadAsked.connect(self._on_load_asked)

    @property
    def running(self) -> bool:
        return self.server is not None

    def start(self, host: str, port: int, api_key: str = "", max_waiting: int = 16) -> None:
        if self.server is not None:
            return
        self._closing.clear()
        model_id = self.controller.info.name if self.controller.info is not None else "no-model-loaded"
        info = self.controller.info
        engines = EngineQueue(
            None,
            max_waiting,
            run_on_engine=self._run_on_worker,
            model_id=model_id,
            facts=self._facts(),
            engine_key=model_key(info) if info is not None else None,
        )
        try:
            server = BackgroundServer(engines, host, port, ServeConfig(api_key=api_key or None))
        except GaplessError as exc:
            engines.close()
            self.failed.emit(str(exc))
            return
        info = self.controller.info
        if info is not None and info.source_kind == "remote":
            from engine.remote import RemoteSource

            if reaches(server.url, RemoteSource.parse(info.source).base_url):
                server.stop()
                engines.close()
                self.failed.emit(f"the loaded model is a remote one at {server.url}: {SELF_REMOTE}")
                return
        self.engines, self.server = engines, server
        self._timer.start()
        self.started.emit(server.url)
        self._poll()

    def stop(self) -> None:
        if self.server is None:
            return
        self._closing.set()
        self._timer.stop()
        server, engines = self.server, self.engines
        self.server = self.engines = None
        server.stop()
        if engines is not None:
            engines.close(timeout_s=10.0)
            self.statsChanged.emit(engines.stats.snapshot())
        self.stopped.emit()

    def serves(self, base_url: str) -> bool:
        """Whether a remote model at `base_url` would be this running server (asked on the engine worker's thread
        too, as each remote model loads: it reads one reference)."""
        return self.server is not None and reaches(self.server.url, base_url)

    def _run_on_worker(self, fn: Callable[[Any], None]) -> None:
        """Called on the queue's thread: hand fn to the worker and wait until it has run there."""
        done = threading.Event()
        call = Call(fn, done)
        self.controller.worker.commands.put(call)
        while not done.wait(0.25):
            if self._closing.is_set() and call.claim.take("caller"):  # not begun: the worker will skip it
                raise ShuttingDown("the app's server is stopping")
        if call.errors:
            raise call.errors[0]

    def _facts(self) -> ModelFacts:
        """What `gapless serve` would list for the loaded model, from what the worker reported when it loaded
        (the engine itself is touched only on the worker's thread)."""
        info = self.controller.info
        if info is None:
            return ModelFacts()
        return ModelFacts(max(0, info.context_length or 0), self.controller.sampling_extensions)

    def _on_load_asked(self, source: str) -> None:
        """The user opened another model: an API client's answer running now is stopped, with the reason, rather
        than the load waiting for all of it (minutes, for a long max_tokens) with nothing said."""
        if self.engines is not None:
            self.engines.stop_running(
                ApiError(
                    503,
                    f"the answer was stopped: the app is opening another model ({source_label(source)}); ask "
                    "again once it is in",
                    "server_error",
                    code="model_replaced",
                )
            )

    def _on_loaded(self, info: Any, _unavailable: Any) -> None:
        if self.engines is not None:
            self.engines.serve(info.name, self._facts(), model_key(info))

    def _poll(self) -> None:
        if self.engines is None or self.server is None:
            return
        self.statsChanged.emit(self.engines.stats.snapshot())
        if self.server.error is not None:
            message = f"the server stopped: {type(self.server.error).__name__}: {self.server.error}"
            self.stop()
            self.failed.emit(message)
