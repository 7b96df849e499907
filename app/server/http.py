"""The Starlette app of `gapless serve`: the OpenAI routes, the API key, the body limit and SSE streaming.

Every answer that is not a completion is an OpenAI error object; no traceback ever reaches a client. A client that
goes away (while queued, while waiting for a whole answer, or mid-stream) cancels its generation.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from app.server.engine_queue import EngineQueue, Failed, Finished, Job, ModelFacts, QueueFull, Started
from app.server.protocol import (
    FINISH,
    ApiError,
    Request,
    bad,
    chunk,
    completion_object,
    delta_choice,
    gapless_figures,
    parse_request,
    usage,
)
from engine import figures
from engine.types import TextDelta, whole_text

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class ServeConfig:
    api_key: Optional[str] = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    cors_origins: tuple[str, ...] = ()


Item = Union[Started, Finished, Failed, TextDelta]


class StrictJSONResponse(JSONResponse):
    """JSON as strict readers take it, as every JSON of the command line is (engine.figures.strict_json): a figure
    that is not a finite number is null, where Starlette's own refused it and the client got a 500 for its answer.
    Half a character (a field's name the request wrote with a lone surrogate, named back in an error) is sent as
    U+FFFD, as the stream's events send it; it was a 500."""

    def render(self, content: Any) -> bytes:
        text = figures.strict_json(content, escape_unencodable=False, ensure_ascii=False, separators=(",", ":"))
        return whole_text(text).encode("utf-8")


def _error_response(exc: ApiError) -> JSONResponse:
    return StrictJSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _api_error(_request: HttpRequest, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error_response(exc)


async def _http_error(_request: HttpRequest, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    messages = {404: "no such endpoint", 405: "method not allowed for this endpoint"}
    message = messages.get(exc.status_code, str(exc.detail))
    codes = {404: "not_found", 405: "method_not_allowed"}
    return _error_response(
        ApiError(exc.status_code, message, code=codes.get(exc.status_code), headers=dict(exc.headers or {}))
    )


async def _internal_error(_request: HttpRequest, exc: Exception) -> Response:
    log.error("serve: unexpected error", exc_info=exc)
    return _error_response(ApiError(500, f"internal error: {type(exc).__name__}", "server_error"))


class SSEResponse(StreamingResponse):
    """A stream that also listens for the client going away whatever the ASGI server's version, and then sets
    the generation's cancel event."""

    def __init__(self, content: AsyncIterator[str], cancel: threading.Event):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.cancel = cancel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    self.cancel.set()
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            self.cancel.set()
            tg.cancel_scope.cancel()


def is_loopback(host: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1 (bracketed or not)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, without its port: "127.0.0.1:8080" -> "127.0.0.1", "[::1]:80" -> "[::1]"."""
    if header.startswith("["):
        return header.partition("]")[0] + "]"
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class LocalOnly:
    """A server without an API key listens on loopback only (run.check_address): other machines cannot reach it,
    but web pages in this machine's browser can. Any page may send it a POST that needs no preflight (a form's
    text/plain body is read as JSON here), starting generations; a page whose name is made to resolve to 127.0.0.1
    (DNS rebinding) may also read the answers. So without a key a request is answered only where it names this
    machine in its Host header and carries no Origin (browsers send one with every cross-origin request, and
    with every POST) other than the origins allowed with --cors-origin. A server with a key needs neither check:
    a page cannot know the key."""

    def __init__(self, app: ASGIApp, allowed_origins: tuple[str, ...] = ()):
        self.app = app
        self.allowed_origins = allowed_origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            host, origin = headers.get("host"), headers.get("origin")
            why = None
            if host is not None and not is_loopback(host_name(host)):
                why = (
                    f"this server has no API key, so it answers only requests addressed to this machine "
                    f"(Host: localhost or a loopback address), not {host!r}"
                )
            elif origin is not None and origin not in self.allowed_origins:
                why = (
                    f"this server has no API key, so it does not answer web pages (Origin: {origin!r}); "
                    "allow the page's origin with --cors-origin, or serve with --api-key"
                )
            if why is not None:
                await _error_response(ApiError(403, why, code="forbidden"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _sse(obj: Any) -> str:
    # strict: never NaN, which JSON.parse refuses; whole: a half character would end the stream as it is encoded
    return whole_text(f"data: {figures.strict_json(obj, escape_unencodable=False, ensure_ascii=False)}\n\n")


class Api:
    def __init__(self, engines: EngineQueue, config: ServeConfig):
        self.engines = engines
        self.config = config

    def check_key(self, request: HttpRequest) -> None:
        if self.config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if not header:
            raise ApiError(
                401,
                "missing API key: send it as 'Authorization: Bearer KEY'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.config.api_key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def read_json(self, request: HttpRequest) -> Any:
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise ApiError(413, f"the request body is over the {limit}-byte limit", code="request_too_large")
        data = bytearray()
        try:
            async for part in request.stream():
                data += part
                if len(data) > limit:
                    raise ApiError(413, f"the request body is over the {limit}-byte limit", code="request_too_large")
        except ClientDisconnect:  # an ordinary client event: answered (to no one) and logged as such, not a crash
            raise ApiError(499, "the client went away while sending the request", code="cancelled") from None
        try:
            return json.loads(bytes(data))
        except (ValueError, RecursionError) as exc:
            raise bad(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None

    @staticmethod
    def model_object(listed: tuple[str, ModelFacts]) -> dict[str, Any]:
        model_id, facts = listed  # together: a model switch between them changes neither
        out: dict[str, Any] = {"id": model_id, "object": "model", "created": 0, "owned_by": "gapless"}
        if facts.context_length:  # vLLM's name for it, which clients (and Gapless's remote engine) read
            out["max_model_len"] = facts.context_length
        # The sampling settings beyond OpenAI's this server honours: all of them on its own engine, only those the
        # server behind passes on where the model is itself remote (a client sending others would get a 400).
        out["x_gapless"] = {"sampling_extensions": list(facts.sampling_extensions)}
        return out

    async def models(self, request: HttpRequest) -> Response:
        self.check_key(request)
        return StrictJSONResponse({"object": "list", "data": [self.model_object(self.engines.listed)]})

    async def model(self, request: HttpRequest) -> Response:
        self.check_key(request)
        listed = self.engines.listed
        if request.path_params["model"] != listed[0]:
            raise ApiError(
                404, f"the model {request.path_params['model']!r} does not exist", param="model", code="model_not_found"
            )
        return StrictJSONResponse(self.model_object(listed))

    async def chat(self, request: HttpRequest) -> Response:
        return await self.complete(request, chat=True)

    async def text(self, request: HttpRequest) -> Response:
        return await self.complete(request, chat=False)

    async def complete(self, request: HttpRequest, chat: bool) -> Response:
        self.check_key(request)
        body = await self.read_json(request)
        model_id, engine_name = self.engines.names  # together: a model switch between them changes neither
        req = parse_request(body, chat, model_id)
        loop = asyncio.get_running_loop()
        items: "asyncio.Queue[Item]" = asyncio.Queue()
        cancel = threading.Event()

        def sink(item: Item) -> None:
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the event loop is gone: the server is stopping
                cancel.set()

        job = Job(req, sink, cancel, engine_name=engine_name)
        try:
            self.engines.submit(job)
        except QueueFull as exc:
            raise ApiError(
                503,
                f"the server is busy: {exc}; retry in {exc.retry_after_s} s",
                "server_error",
                code="queue_full",
                headers={"Retry-After": str(exc.retry_after_s)},
            ) from None
        gone: "asyncio.Future[Any]" = asyncio.ensure_future(self._disconnected(request))
        try:
            first = await self._next(items, gone, cancel, (Started, Failed))
            if isinstance(first, Failed):
                raise first.error
            if not req.stream:
                last = await self._next(items, gone, cancel, (Finished, Failed))
                if isinstance(last, Failed):
                    raise last.error
                assert isinstance(last, Finished)
                return StrictJSONResponse(completion_object(req, last.result, last.queue_ms))
        except BaseException:
            self.engines.withdraw(job)  # sets its cancel event; a waiting job also frees its place in the queue
            raise
        finally:
            gone.cancel()
        assert isinstance(first, Started)
        return SSEResponse(self._events(req, items, cancel), cancel)

    @staticmethod
    async def _disconnected(request: HttpRequest) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    @staticmethod
    async def _next(
        items: "asyncio.Queue[Item]", gone: "asyncio.Future[Any]", cancel: threading.Event, kinds: tuple[type, ...]
    ) -> Item:
        """The next item of one of `kinds` (text before it is dropped); the client going away cancels."""
        while True:
            get: "asyncio.Future[Any]" = asyncio.ensure_future(items.get())
            waiters: "list[asyncio.Future[Any]]" = [get, gone]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                cancel.set()
                raise ApiError(499, "the client went away", code="cancelled")
            item: Item = get.result()
            if isinstance(item, kinds):
                return item

    async def _events(self, req: Request, items: "asyncio.Queue[Item]", cancel: threading.Event) -> AsyncIterator[str]:
        started: set[int] = set()
        extra = {"usage": None} if req.include_usage else {}
        try:
            while True:
                item = await items.get()
                if isinstance(item, TextDelta):
                    choice = delta_choice(req, item.candidate, item.text, first=item.candidate not in started)
                    started.add(item.candidate)
                    yield _sse(chunk(req, [choice], **extra))
                elif isinstance(item, Finished):
                    r = item.result
                    last = [
                        delta_choice(req, i, "", FINISH[f], first=i not in started)
                        for i, f in enumerate(r.finish_reasons)
                    ]
                    yield _sse(chunk(req, last, **extra, x_gapless=gapless_figures(r.metrics, item.queue_ms)))
                    if req.include_usage:
                        yield _sse(chunk(req, [], usage=usage(r)))
                    yield "data: [DONE]\n\n"
                    return
                elif isinstance(item, Failed):
                    yield _sse(item.error.body())
                    yield "data: [DONE]\n\n"
                    return
        finally:
            cancel.set()


def create_app(engines: EngineQueue, config: Optional[ServeConfig] = None) -> Starlette:
    config = config or ServeConfig()
    api = Api(engines, config)
    routes = [
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.text, methods=["POST"]),
    ]
    middleware = []
    if config.api_key is None:
        middleware.append(Middleware(LocalOnly, allowed_origins=config.cors_origins))
    if config.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_origins),
                allow_methods=["GET", "POST"],
                # any header a preflight names: the OpenAI SDKs send their own (X-Stainless-*) on every request
                allow_headers=["*"],
            )
        )
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error},
    )
