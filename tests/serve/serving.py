"""Helpers of the server tests: a tiny model served in-process on a free loopback port, and an engine held at
its first text so that a test can act while a generation surely runs."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from app.server.engine_queue import EngineQueue
from app.server.http import ServeConfig
from app.server.run import BackgroundServer
from engine.types import EngineOptions, GenerationResult, TextDelta


def load_engine(path) -> Any:
    from engine.engine import Engine

    return Engine.load(str(path), EngineOptions(device="cpu"))


@contextmanager
def serving(engine: Any, max_waiting: int = 16, config: Optional[ServeConfig] = None) -> Iterator[BackgroundServer]:
    engines = EngineQueue(engine, max_waiting=max_waiting)
    server = BackgroundServer(engines, "127.0.0.1", 0, config)
    try:
        yield server
    finally:
        server.stop()
        engines.close()


def request_body(server: BackgroundServer, content: str = "hello world", **fields: Any) -> dict:
    """A chat completion request of one user message to the served model; `fields` add to it or replace."""
    return {"model": server.engines.model_id, "messages": [{"role": "user", "content": content}], **fields}


def wait_until(predicate: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Poll until predicate() holds (bounded: a broken server fails the test's assertion instead of hanging)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


class HeldEngine:
    """The real engine, whose next generation waits at its first text until `release` is set."""

    def __init__(self, engine: Any):
        self._engine = engine
        self.reached = threading.Event()
        self.release = threading.Event()
        self.cancel: Optional[threading.Event] = None
        self.results: list[GenerationResult] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, messages, sampling, on_event=None, cancel=None, raw=False) -> GenerationResult:
        self.cancel = cancel

        def held(event: Any) -> None:
            if isinstance(event, TextDelta) and not self.reached.is_set():
                self.reached.set()
                self.release.wait(120)
            if on_event is not None:
                on_event(event)

        result = self._engine.generate(messages, sampling, held, cancel, raw)
        self.results.append(result)
        return result


class BrokenEngine:
    """The real engine, whose generations fail with an unexpected error: at once, or after its first text."""

    def __init__(self, engine: Any, after_text: bool):
        self._engine = engine
        self.after_text = after_text

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, messages, sampling, on_event=None, cancel=None, raw=False) -> GenerationResult:
        def broken(event: Any) -> None:
            if on_event is not None:
                on_event(event)
            if isinstance(event, TextDelta) and self.after_text:
                raise RuntimeError("a bug in the engine")

        if not self.after_text:
            raise RuntimeError("a bug in the engine")
        return self._engine.generate(messages, sampling, broken, cancel, raw)
