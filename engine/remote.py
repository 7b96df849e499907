"""A remote engine: chats through an OpenAI-compatible server (vLLM, llama.cpp's server, Ollama, `gapless serve`)
with the generate interface of engine.engine.Engine, so the worker, the CLI and the server use it unchanged.

What a client can measure it measures over HTTP (TTFT, decode tok/s and inter-token latency from the arrival
times of the SSE chunks; token counts from `usage`); what the server reports about itself it reads where it does
(llama.cpp's `timings`, vLLM's Prometheus `/metrics`), each with its source. Figures of the GPU are n/a: the
model runs on another machine. The API key goes in the Authorization header only; it is never logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import queue
import re
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, AsyncIterator, Callable, Optional
from urllib.parse import urlsplit

import httpx

from engine import figures
from engine.errors import GenerationError, ModelLoadError, OptionsError, RemoteRefused
from engine.protocol import SAMPLING_EXTENSION_NAMES, option_limits
from engine.types import (
    REMOTE_DEVICE,
    REMOTE_PREFIX,
    EngineOptions,
    GenerationMetrics,
    GenerationResult,
    ModelInfo,
    MonitorSample,
    Progress,
    SamplingParams,
    TextDelta,
    api_key_problem,
    is_remote,
    remote_address_problem,
    whole_text,
)

log = logging.getLogger(__name__)

REMOTE_REASON = "the model runs on a remote server"
NOT_SAMPLED = f"{REMOTE_REASON}; its machine is not sampled here"
SAMPLE_KEYS = tuple(f.key for f in figures.SAMPLE_FIGURES)
DEFAULT_TIMEOUT_S = 60.0
NO_USAGE = "the server reported no token usage"  # why the counts (and what needs them) are n/a
CANCEL_POLL_S = 0.05  # how often a generation waiting for the server looks at its cancel event
CONNECT_TIMEOUT_S = 10.0  # to open a connection: a host that is down or unreachable is said so without a long wait
LIST_TIMEOUT_S = 30.0  # GET /models when a remote model is opened: the app waits on it, with no way to stop it
MAX_LINE_CHARS = 16 * 2**20  # of one line of an answer's event stream (a token's event is a few hundred)
MAX_ERROR_BYTES = 2**20  # of an error body read for its message
MAX_LIST_BYTES = 64 * 2**20  # of a server's model list (a router's lists hundreds of models, each with its metadata)
BURST_GAP_MS = 0.2  # text events all closer than this came in one read: their arrival times time nothing
BURST = "the text arrived in one burst (the server or a proxy held the stream back): nothing to time"
USAGE_GRACE_S = 2.0  # after every answer ended, the most the usage is waited for (a server may never send [DONE])
METRICS_TIMEOUT_S = 2.0  # vLLM's /metrics: read beside the answer, which never waits longer for it
MAX_METRICS_BYTES = 4 * 2**20  # of vLLM's /metrics (tens of KiB with a few models)
# The sampling settings OpenAI's API lacks, under the names of the servers known to take them (recognised by the
# `owned_by` of their model list). OpenAI's own API refuses fields it does not know, so other servers get neither;
# a Gapless server lists those it honours in its model object (x_gapless.sampling_extensions).
SAMPLING_EXTENSIONS: dict[str, dict[str, str]] = {
    "vllm": {"top_k": "top_k", "repetition_penalty": "repetition_penalty"},
    "llamacpp": {"top_k": "top_k", "repetition_penalty": "repeat_penalty"},  # llama.cpp's llama-server
}


@dataclass(frozen=True)
class RemoteSource:
    """Where a remote model is: the server's OpenAI base URL (…/v1) and the model's name there."""

    base_url: str
    model: str
    timeout_s: float = DEFAULT_TIMEOUT_S  # connect, and the longest wait for the next chunk

    def validate(self) -> "RemoteSource":
        problem = remote_address_problem(self.base_url)
        if problem:
            raise OptionsError(problem)
        if not self.model or "#" in self.model or "|" in self.model:
            raise OptionsError(f"a remote model needs a name (without '#' or '|'), got {self.model!r}")
        if not isinstance(self.timeout_s, (int, float)) or not 0 < self.timeout_s <= 3600:
            raise OptionsError(f"the remote timeout must be in (0, 3600] seconds, got {self.timeout_s}")
        return self

    def to_source(self) -> str:
        """The source string the app stores and loads: remote:<base URL>#<model>[|timeout=<s>]."""
        tail = "" if self.timeout_s == DEFAULT_TIMEOUT_S else f"|timeout={self.timeout_s:g}"
        return f"{REMOTE_PREFIX}{self.base_url.rstrip('/')}#{self.model}{tail}"

    @classmethod
    def parse(cls, source: str) -> "RemoteSource":
        if not is_remote(source):
            raise OptionsError(f"not a remote source: {source!r}")
        rest, _, opts = source[len(REMOTE_PREFIX) :].partition("|")
        url, sep, model = rest.rpartition("#")
        if not sep:
            raise OptionsError(f"a remote source is remote:<base URL>#<model>, got {source!r}")
        timeout = DEFAULT_TIMEOUT_S
        if opts:
            name, _, value = opts.partition("=")
            try:
                timeout = float(value) if name == "timeout" else float("nan")
            except ValueError:
                timeout = float("nan")
            if timeout != timeout:
                raise OptionsError(f"a remote source takes |timeout=<seconds> after the model, got {opts!r}")
        return cls(url.rstrip("/"), model, timeout).validate()


def _server_root(base_url: str) -> str:
    return base_url.removesuffix("/").removesuffix("/v1")


def _v1_url(base_url: str) -> str:
    """The address cut after its /v1 (an endpoint pasted whole, …/v1/chat/completions), or with /v1 added."""
    parts = urlsplit(base_url)
    segments = parts.path.split("/")
    path = "/".join(segments[: segments.index("v1") + 1]) if "v1" in segments else parts.path.rstrip("/") + "/v1"
    return parts._replace(path=path).geturl()


def _error_text(response: httpx.Response) -> str:
    """The server's own error message where it sent one (OpenAI's {"error": {"message"}} or a plain string)."""
    if response.is_redirect:
        return f"{response.reason_phrase}, to {response.headers.get('location', 'an address it did not give')}"
    try:
        body = response.json()
    except ValueError:
        title = re.search(r"<title[^>]*>(.*?)</title>", response.text, re.IGNORECASE | re.DOTALL)
        text = title.group(1) if title else response.text
        if title is None and re.match(r"\s*<(!doctype|html)", text, re.IGNORECASE):
            text = ""  # an HTML page without a title: its markup says nothing
        return " ".join(text.split())[:200] or response.reason_phrase
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        err = err.get("message") or err
    return " ".join(str(err).split())[:300]


def _error_fields(response: httpx.Response) -> tuple[Optional[str], Optional[str]]:
    """The `param` and `code` of an OpenAI error body, where they are text."""
    try:
        body = response.json()
    except ValueError:
        return None, None
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return None, None
    param, code = err.get("param"), err.get("code")
    return (param if isinstance(param, str) else None), (code if isinstance(code, str) else None)


def _why(exc: httpx.HTTPError) -> str:
    """What went wrong, without the request's headers: httpx quotes an invalid header value, the key among them."""
    if isinstance(exc, httpx.LocalProtocolError):
        return "the request could not be sent (a header value is not valid)"
    return str(exc) or type(exc).__name__


# The finish reasons of OpenAI's API (and servers') with one of the app's own (engine.types.FINISH_WORDS) beside them.
KNOWN_FINISH = {"stop": "stop", "eos": "eos", "length": "length", "content_filter": "filtered"}


def _without(text: str, key: str) -> str:
    """`text` with `key` taken out, and the start of it where the text ends in one (a server's message is cut to a
    few hundred characters before it is shown)."""
    text = text.replace(key, "[the API key]")
    cut = next((n for n in range(len(key) - 1, 3, -1) if text.endswith(key[:n])), 0)
    return text[: len(text) - cut] + "[the API key]" if cut else text


def _count(v: Any) -> Optional[int]:
    """A usage count as a whole number of tokens (3.0 too); None where it cannot be one (-7, true, "5")."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf or v != int(v):
        return None
    return int(v)


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


class VllmMetrics:
    """vLLM's Prometheus endpoint: running and waiting requests, KV-cache usage, and its TTFT histogram."""

    def __init__(self, headers: dict, url: str):
        self.headers = headers
        self.url = url

    def read(self, timeout_s: float) -> dict[str, float]:
        """Each vllm: series, summed over its labels (one model per server: the sum is that model's)."""
        out: dict[str, float] = {}
        for line in _bounded_get(self.headers, self.url, timeout_s, timeout_s, MAX_METRICS_BYTES).text.splitlines():
            m = _PROM_LINE.match(line)
            if m is None:
                continue
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
            except ValueError:
                continue
        return out


class _TooLarge(Exception):
    """A body past the bytes read of it (_bounded_get)."""


def _bounded_get(headers: dict, url: str, seconds: float, connect_s: float, limit: int) -> httpx.Response:
    """GET `url` read whole, its headers too, within `seconds` (httpx's timeout is per read: a server sending a byte
    at a time held the call for as long as it liked) and at most `limit` bytes (_TooLarge past it); httpx.ReadTimeout
    past the time. On an event loop of its own, whose deadline cancels the request wherever it is."""

    async def read() -> httpx.Response:
        async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(seconds, connect=connect_s)) as client:
            async with client.stream("GET", url) as r:
                body = bytearray()
                async for piece in r.aiter_bytes():
                    body += piece
                    if len(body) > limit:
                        raise _TooLarge(f"more than {limit >> 20} MiB")
                return _as_read(r, bytes(body))

    try:
        return asyncio.run(asyncio.wait_for(read(), seconds))
    except asyncio.TimeoutError:
        raise httpx.ReadTimeout(f"not read whole within {seconds:g} s") from None


_PROM_LINE = re.compile(r"^(vllm:[A-Za-z0-9_:]+)(?:\{[^}]*\})?\s+(\S+)")


def _sampling_extensions(entry: dict) -> dict[str, str]:
    """What this server's model entry says of the sampling settings beyond OpenAI's it takes: {ours: its name}."""
    owner = entry.get("owned_by")
    if owner == "gapless":
        ours = entry.get("x_gapless")
        told = ours.get("sampling_extensions") if isinstance(ours, dict) else None
        return {n: n for n in SAMPLING_EXTENSION_NAMES if isinstance(told, list) and n in told}
    return SAMPLING_EXTENSIONS.get(owner, {}) if isinstance(owner, str) else {}


class RemoteEngine:
    """One model on an OpenAI-compatible server. Same methods as Engine; options other than the candidate count
    cannot apply and are reported unavailable with the reason."""

    def __init__(
        self,
        source: RemoteSource,
        options: EngineOptions,
        api_key: Optional[str] = None,
    ):
        self.source = source.validate()
        self.options = options.validate()
        api_key = (api_key or "").strip()
        problem = api_key_problem(api_key) if api_key else None
        if problem:
            raise OptionsError(problem)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._key = api_key  # taken out of what a server says back (_redact)
        self._connect_timeout_s = min(CONNECT_TIMEOUT_S, source.timeout_s)
        self._list_timeout_s = min(LIST_TIMEOUT_S, source.timeout_s)
        self._metrics_timeout_s = min(METRICS_TIMEOUT_S, source.timeout_s)
        timeout = httpx.Timeout(source.timeout_s, connect=self._connect_timeout_s)
        # each request's own client, on an event loop of its own: a deadline or a Stop ends it wherever it is
        self._headers, self._timeout = headers, timeout
        self._requests: set[_Request] = set()  # answers being read: close() ends them
        self._context_length = 0
        self._extensions: dict[str, str] = {}  # SAMPLING_EXTENSIONS of this server
        self._gapless = False  # the server lists the model as a Gapless server's: its x_gapless figures are read
        self._vllm: Optional[VllmMetrics] = None
        self.tokenizer = None

    # ---- loading ----

    @classmethod
    def load(
        cls,
        source: "str | RemoteSource",
        options: EngineOptions = EngineOptions(),
        progress: Optional[Callable[[Progress], None]] = None,
        api_key: Optional[str] = None,
    ) -> "RemoteEngine":
        """Connect: the model must be among those the server lists."""
        src = RemoteSource.parse(source) if isinstance(source, str) else source
        engine = cls(src, options, api_key)
        try:
            if progress is not None:
                progress(Progress("load", None, f"asking {src.base_url} for its models"))
            engine._connect()
        except BaseException as exc:
            engine.close()
            engine._redact(exc)
            raise
        if progress is not None:
            progress(Progress("load", 1.0, "remote model ready"))
        return engine

    def _connect(self) -> None:
        url = f"{self.source.base_url}/models"
        try:
            r = self._read_list(url)
        except httpx.ConnectTimeout as exc:
            raise ModelLoadError(
                f"cannot reach the remote server at {self.source.base_url}: no connection within "
                f"{self._connect_timeout_s:g} s"
            ) from exc
        except httpx.TimeoutException as exc:
            raise ModelLoadError(
                f"the remote server at {self.source.base_url} did not list its models within {self._list_timeout_s:g} s"
            ) from exc
        except httpx.HTTPError as exc:
            raise ModelLoadError(f"cannot reach the remote server at {self.source.base_url}: {_why(exc)}") from exc
        except (UnicodeError, ValueError) as exc:  # a host name httpx takes and its IDNA check refuses on the way
            raise ModelLoadError(f"cannot reach the remote server at {self.source.base_url}: {exc}") from exc
        if r.status_code in (401, 403):
            raise ModelLoadError(
                f"the remote server at {self.source.base_url} refused the API key "
                f"(HTTP {r.status_code}): {_error_text(r)}"
            )
        if r.status_code != 200:
            hint = ""
            if r.status_code == 404 and not urlsplit(self.source.base_url).path.rstrip("/").endswith("/v1"):
                hint = f" (OpenAI-compatible servers answer under /v1: try {_v1_url(self.source.base_url)})"
            raise ModelLoadError(
                f"the remote server at {self.source.base_url} answered HTTP {r.status_code} to "
                f"GET /models: {_error_text(r)}{hint}"
            )
        try:
            listed = r.json()["data"]
            ids = {m["id"]: m for m in listed if isinstance(m, dict)}
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ModelLoadError(f"{url} did not answer with an OpenAI model list") from exc
        if self.source.model not in ids:
            names = ", ".join(sorted(ids)[:8]) or "none"
            raise ModelLoadError(
                f"the remote server at {self.source.base_url} has no model {self.source.model!r}; it serves: {names}"
            )
        entry = ids[self.source.model]
        meta = entry.get("meta")
        meta = meta if isinstance(meta, dict) else {}
        ctx = entry.get("max_model_len") or meta.get("n_ctx_train") or entry.get("context_length")
        self._context_length = int(ctx) if isinstance(ctx, int) and ctx > 0 else 0
        self._extensions = _sampling_extensions(entry)
        self._gapless = entry.get("owned_by") == "gapless"
        self._probe_vllm()

    def _read_list(self, url: str) -> httpx.Response:
        """GET `url` read whole within the list's time (an opening cannot be stopped) and at most MAX_LIST_BYTES."""
        try:
            return _bounded_get(self._headers, url, self._list_timeout_s, self._connect_timeout_s, MAX_LIST_BYTES)
        except _TooLarge:
            raise ModelLoadError(
                f"the remote server at {self.source.base_url} sent more than {MAX_LIST_BYTES >> 20} MiB for its "
                "model list"
            ) from None

    def _probe_vllm(self) -> None:
        """vLLM's figures where the server has its /metrics: read within METRICS_TIMEOUT_S and MAX_METRICS_BYTES,
        else none (a /metrics sent a byte a second held the opening for ever, and an endless one filled the
        memory)."""
        url = f"{_server_root(self.source.base_url)}/metrics"
        try:
            r = _bounded_get(self._headers, url, self._metrics_timeout_s, self._metrics_timeout_s, MAX_METRICS_BYTES)
        except (httpx.HTTPError, _TooLarge) as exc:
            log.info("no vLLM /metrics read at %s: %s", url, exc)
            return
        if r.status_code == 200 and "vllm:" in r.text:
            self._vllm = VllmMetrics(self._headers, url)

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(
            name=self.source.model,
            family="remote",
            architecture="OpenAI-compatible server",
            backend="remote",
            parameters=0,
            dtype="set by the server",
            device=self.source.base_url,
            context_length=self._context_length,
            weight_bytes=0,
            source=self.source.to_source(),
            source_kind="remote",
            backend_reason=REMOTE_REASON,
            unknown={
                "parameters": "n/a: the server does not say how many parameters its model has",
                "weight_bytes": "n/a: the server does not say how large its model's weights are",
                **({} if self._context_length else {"context_length": "n/a: the server does not report it"}),
            },
        )

    def passes_on(self, setting: str) -> bool:
        """Whether this server is known to take `setting` ("top_k", "repetition_penalty"), which OpenAI's API
        lacks (SAMPLING_EXTENSIONS)."""
        return setting in self._extensions

    @property
    def context_length(self) -> int:
        """0 when the server does not report it."""
        return self._context_length

    # ---- options ----

    def unavailable(self, options: Optional[EngineOptions] = None) -> dict[str, str]:
        """Every option but the candidate count (sent as n) is the server's: one set away from its default is
        reported (the app turns it back, and the default is what the server's own setting stands for)."""
        o = options or self.options
        default = EngineOptions()
        return {
            f.name: f"{REMOTE_REASON}, which decides its own {f.name.replace('_', ' ')}"
            for f in fields(o)
            if f.name != "candidates" and getattr(o, f.name) != getattr(default, f.name)
        }

    def effective(self, options: EngineOptions) -> tuple[EngineOptions, dict[str, str]]:
        return options, self.unavailable(options)

    def reconfigure(
        self,
        options: EngineOptions,
        progress: Optional[Callable[[Progress], None]] = None,
        cancelled: Optional[Callable[[], bool]] = None,
    ) -> None:
        self.options = options.validate()

    # ---- generation ----

    def measure_prompt(self, messages: list[dict], max_new_tokens: int, overflow: str = "rolling"):
        """The context meter's count needs the model's tokenizer, which stays on the server."""
        raise GenerationError("n/a: the remote server tokenizes the conversation; its count is not known here")

    def generate(
        self,
        messages: list[dict],
        sampling: SamplingParams,
        on_event: Optional[Callable] = None,
        cancel: Optional[threading.Event] = None,
        raw: bool = False,
        overflow: str = "rolling",  # unused: the server fits the conversation to its own context
    ) -> GenerationResult:
        """Stream one answer (n = the candidate count) from the server. A server that is down, slow, sends
        garbage or drops the stream raises GenerationError; the text streamed until then has been delivered."""
        try:
            return self._generate(messages, sampling, on_event, cancel, raw)
        except BaseException as exc:
            self._redact(exc)
            raise

    def _redact(self, exc: BaseException) -> None:
        """The API key taken out of an error's message: a server may quote it back ("invalid api key: Bearer
        sk-..."), and the message is shown, logged and relayed."""
        key = self._key
        if key:
            exc.args = tuple(_without(a, key) if isinstance(a, str) else a for a in exc.args)

    def _generate(
        self,
        messages: list[dict],
        sampling: SamplingParams,
        on_event: Optional[Callable],
        cancel: Optional[threading.Event],
        raw: bool,
    ) -> GenerationResult:
        sampling = sampling.validate()
        emit = on_event or (lambda _e: None)
        cancel = cancel or threading.Event()
        n = self.options.candidates
        body: dict[str, Any] = {
            "model": self.source.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
        }
        if n > 1:
            body["n"] = n
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        left = []  # settings the server is not known to take
        wanted = {
            "top_k": (
                f"top-k {sampling.top_k}",
                sampling.top_k if sampling.top_k and sampling.temperature > 0 else None,
            ),
            "repetition_penalty": (
                f"repetition penalty {sampling.repetition_penalty:g}",
                sampling.repetition_penalty if sampling.repetition_penalty != 1.0 else None,
            ),
        }
        for name, (said, setting) in wanted.items():
            if setting is not None and self.passes_on(name):
                body[self._extensions[name]] = setting
            elif setting is not None:
                left.append(said)
        if raw:
            body["prompt"] = messages[-1]["content"]
        else:
            body["messages"] = [{"role": m["role"], "content": m["content"]} for m in messages]
        # The HUD's monitor series (GPU, this process's CPU and memory) stay empty: say why, as a local monitor does.
        emit(MonitorSample(time.perf_counter(), unavailable=dict.fromkeys(SAMPLE_KEYS, NOT_SAMPLED)))
        before = self._vllm_read()  # short: METRICS_TIMEOUT_S
        stream = _Stream(n)
        side: dict[str, Optional[dict[str, float]]] = {}
        reader: Optional[threading.Thread] = None
        path = "/completions" if raw else "/chat/completions"
        lines: "queue.Queue[tuple[str, Any, float]]" = queue.Queue()
        request = _Request()
        self._requests.add(request)
        pump = threading.Thread(
            target=self._pump, args=(path, body, lines, request), daemon=True, name="gapless-remote-read"
        )
        try:
            pump.start()
            while True:
                try:
                    kind, value, t = lines.get(timeout=CANCEL_POLL_S)
                except queue.Empty:
                    kind = "wait"
                if cancel.is_set():  # a stalled server must not hold up a stop: its request is ended below
                    stream.cancelled = True
                    break
                if kind == "error":
                    raise value
                if kind == "end":
                    break
                if kind == "line":
                    if stream.feed(value, raw, emit, t) and reader is None and self._vllm is not None:
                        reader = threading.Thread(target=lambda: side.update(during=self._vllm_read()), daemon=True)
                        reader.start()
                    if stream.done:
                        break
                if stream.all_finished and stream.finished_at is None:
                    stream.finished_at = time.perf_counter()
                if stream.finished_at is not None and (
                    stream.usage is not None or time.perf_counter() - stream.finished_at > USAGE_GRACE_S
                ):
                    break  # every answer ended and its usage came (or did not within the grace): no [DONE] needed
        except _Garbage as exc:
            raise GenerationError(self._dropped(stream, str(exc))) from None
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # before TimeoutException, its base class
            raise GenerationError(f"cannot reach the remote server at {self.source.base_url}: {_why(exc)}") from exc
        except httpx.TimeoutException as exc:
            raise GenerationError(
                self._dropped(
                    stream,
                    f"did not send anything for {self.source.timeout_s:g} s (the remote model's timeout: the Remote "
                    "dialog's, or |timeout=SECONDS after the model's name)",
                )
            ) from exc
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            raise GenerationError(self._dropped(stream, f"dropped the connection ({_why(exc)})")) from exc
        except httpx.HTTPError as exc:
            raise GenerationError(self._dropped(stream, f"failed: {_why(exc)}")) from exc
        finally:
            request.end()
        if stream.error:
            raise GenerationError(self._dropped(stream, f"reported an error: {stream.error}"))
        if not stream.done and not stream.cancelled and not stream.all_finished and not stream.sent_finished:
            raise GenerationError(self._dropped(stream, "closed the stream before the answer ended"))
        if reader is not None and not stream.cancelled:  # a stop waits for nothing more
            reader.join(METRICS_TIMEOUT_S)  # the server's figures never hold up the answer for long
        stream.flush(emit)
        result = stream.result(sampling, self.options, self.unavailable())
        result.limits = option_limits(self)
        if stream.reasoning:
            result.notices.append(
                f"the server sent {stream.reasoning:,} characters of the model's reasoning apart from the answer "
                "(reasoning_content); they are not shown"
            )
        if stream.mended:
            s = "s" if stream.mended > 1 else ""
            result.notices.append(
                f"the server sent {stream.mended} half character{s} without {'their' if s else 'its'} other half; "
                f"shown as \ufffd"
            )
        after = None if stream.cancelled else self._vllm_read()
        self._server_figures(result.metrics, stream, before, side.get("during"), after)
        if n > 1 and len(stream.texts) < n:
            result.notices.append(f"the server returned {len(stream.texts)} answer(s) for {n} candidates")
        if stream.stray:
            result.notices.append(
                f"the server sent {stream.stray:,} part(s) of answers it was not asked for (an index past the "
                f"{n} asked for); they are left out"
            )
        for i, said in sorted(stream.finish.items()):
            if said not in KNOWN_FINISH:
                which = f"answer {i + 1}" if len(result.texts) > 1 else "the answer"
                result.notices.append(f"the server ended {which} with the finish reason {said[:80]!r}")
        if left:
            result.notices.append(
                f"{' and '.join(left)} not applied: the OpenAI API has no such setting, and this server is not one "
                "known to take it (Gapless, vLLM, llama.cpp), so it sampled without it"
            )
        return result

    def _pump(self, path: str, body: dict, lines: "queue.Queue[tuple[str, Any, float]]", request: "_Request") -> None:
        """The HTTP stream's lines with their arrival times, read on a thread of their own; then "end", or
        "error" with the exception. The request runs on this thread's own event loop, so that `request.end()`
        from any thread closes its connection at once: before the server's headers, in a stall, or after an
        answer that ended (a server then stops working for nobody, and a queue behind it moves on)."""

        async def read() -> None:
            async with httpx.AsyncClient(headers=self._headers, timeout=self._timeout) as client:
                async with client.stream("POST", f"{self.source.base_url}{path}", json=body) as r:
                    if r.status_code != 200:
                        said = await _capped_body(r, MAX_ERROR_BYTES)
                        wait = r.headers.get("retry-after", "").strip()
                        again = f"; it asks to be asked again in {wait} s" if wait.isdigit() else ""
                        raise RemoteRefused(
                            f"the remote server refused the request (HTTP {r.status_code}): {_error_text(said)}{again}",
                            r.status_code,
                            *_error_fields(said),
                            retry_after=r.headers.get("retry-after"),
                        )
                    async for line in _capped_lines(r, MAX_LINE_CHARS):
                        lines.put(("line", line, time.perf_counter()))
            lines.put(("end", None, time.perf_counter()))

        try:
            asyncio.run(request.run(read()))
        except asyncio.CancelledError:  # ended from outside: by the answer's own end (nobody reads on), or close()
            closed = GenerationError(f"the remote model at {self.source.base_url} was closed while it answered")
            lines.put(("error", closed, time.perf_counter()))
        except RecursionError:  # JSON nested past Python's limit in an error body
            lines.put(("error", _Garbage("sent an error nested too deeply to read"), time.perf_counter()))
        except Exception as exc:  # handed to the generating thread, which says what went wrong
            lines.put(("error", exc, time.perf_counter()))
        finally:
            self._requests.discard(request)

    def _dropped(self, stream: "_Stream", what: str) -> str:
        kept = " (the partial answer is kept)" if any(stream.texts.values()) else ""
        return f"the remote server at {self.source.base_url} {what}{kept}"

    def _vllm_read(self) -> Optional[dict[str, float]]:
        if self._vllm is None:
            return None
        try:
            return self._vllm.read(self._metrics_timeout_s)
        except (httpx.HTTPError, _TooLarge) as exc:
            log.info("vLLM /metrics unreadable: %s", exc)
            return None

    def _server_figures(
        self,
        m: GenerationMetrics,
        stream: "_Stream",
        before: Optional[dict],
        during: Optional[dict],
        after: Optional[dict],
    ) -> None:
        t = stream.timings
        if t and isinstance(t.get("prompt_ms"), (int, float)):
            m.put("server_ttft_ms", float(t["prompt_ms"]), "llama.cpp timings.prompt_ms (prompt processing)")
        if t and isinstance(t.get("predicted_per_second"), (int, float)):
            m.put("server_decode_tok_s", float(t["predicted_per_second"]), "llama.cpp timings.predicted_per_second")
        # Only from a server that lists its model as a Gapless server's: another one's "x_gapless" is not ours.
        for key, name in (("server_ttft_ms", "ttft_ms"), ("server_decode_tok_s", "decode_tok_s")):
            f = ((stream.gapless if self._gapless else None) or {}).get(name)
            if isinstance(f, dict) and isinstance(f.get("value"), (int, float)) and f.get("source"):
                m.put(key, float(f["value"]), f"gapless serve: {f['source']}")
        if before is not None and after is not None:
            key = "vllm:time_to_first_token_seconds"
            count = after.get(f"{key}_count", 0.0) - before.get(f"{key}_count", 0.0)
            total = after.get(f"{key}_sum", 0.0) - before.get(f"{key}_sum", 0.0)
            if count >= 1:
                m.put(
                    "server_ttft_ms",
                    total / count * 1e3,
                    f"vLLM /metrics time_to_first_token_seconds (mean of {count:.0f} request(s) meanwhile)",
                )
        if during is not None:
            for key, name in (
                ("server_running_requests", "vllm:num_requests_running"),
                ("server_waiting_requests", "vllm:num_requests_waiting"),
            ):
                if name in during:
                    m.put(key, during[name])
            kv = during.get("vllm:kv_cache_usage_perc", during.get("vllm:gpu_cache_usage_perc"))
            if kv is not None:
                m.put("server_kv_cache_pct", kv * 100)
        for spec in figures.GENERATION_FIGURES:
            value = getattr(m, spec.key)
            problem = None if value is None else figures.value_problem(spec, value)
            if problem:  # a server's odd report is not passed on as a figure (a stored chat would refuse it)
                m.mark_na(spec.key, f"the server reported a value that {problem}")
            elif value is None and spec.key not in m.unavailable:
                m.mark_na(spec.key, self._reason(spec.key))

    def _reason(self, key: str) -> str:
        if key.startswith("server_"):
            if self._vllm is None and key in (
                "server_running_requests",
                "server_waiting_requests",
                "server_kv_cache_pct",
            ):
                return "the server has no vLLM /metrics endpoint"
            return "the server did not report it"
        if key in ("prompt_tokens", "new_tokens_total"):
            return NO_USAGE
        if key.startswith(("http_", "inter_token")):
            return "too few text chunks arrived to time"
        return f"{REMOTE_REASON}; measured there, not here"

    def close(self) -> None:
        for request in list(self._requests):  # answers still being read (a model switched mid-answer)
            request.end()


class _Garbage(GenerationError):
    """A line of the stream that is not an OpenAI event."""


class _Request:
    """One answer's HTTP request, running on its reading thread's event loop; end() from any thread cancels it,
    which closes its connection (end() before the loop runs makes run() return at once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ended = False
        self._task: Optional[tuple[asyncio.AbstractEventLoop, asyncio.Task]] = None

    async def run(self, work: Any) -> None:
        with self._lock:
            if self._ended:
                work.close()
                return
            self._task = (asyncio.get_running_loop(), asyncio.ensure_future(work))
        await self._task[1]

    def end(self) -> None:
        with self._lock:
            self._ended = True
            if self._task is not None:
                loop, task = self._task
                try:
                    loop.call_soon_threadsafe(task.cancel)
                except RuntimeError:  # the loop has already closed: the request is over
                    pass


_NEWLINE = re.compile(r"\r\n|\r|\n")


async def _capped_lines(response: httpx.Response, limit: int) -> AsyncIterator[str]:
    """The body's lines, none longer than `limit` characters: httpx's own reader keeps a line without an end in
    memory however long it grows (a 200 MB line cost 624 MB before it failed)."""
    pending: list[str] = []
    size = 0
    async for piece in response.aiter_text():
        parts = _NEWLINE.split(piece)
        for part in parts[:-1]:
            pending.append(part)
            yield "".join(pending)
            pending, size = [], 0
        if parts[-1]:
            pending.append(parts[-1])
            size += len(parts[-1])
            if size > limit:
                raise _Garbage(f"sent a line of more than {limit:,} characters")
    if pending:
        yield "".join(pending)


async def _capped_body(response: httpx.Response, limit: int) -> httpx.Response:
    """An error response read to at most `limit` bytes, as a response of its own for _error_text."""
    got = bytearray()
    async for piece in response.aiter_bytes():
        got += piece[: limit - len(got)]
        if len(got) >= limit:
            break
    return _as_read(response, bytes(got))


def _as_read(response: httpx.Response, body: bytes) -> httpx.Response:
    """`response` with `body`, what was read of it (decoded: the headers of the body as sent are left out)."""
    kept = {k: v for k, v in response.headers.items() if k.lower() not in _BODY_HEADERS}
    return httpx.Response(response.status_code, headers=kept, content=body, request=response.request)


_BODY_HEADERS = ("content-encoding", "content-length", "transfer-encoding")  # of the body as sent, not as read


class _Stream:
    """The SSE lines of one answer as they arrive: text per choice, arrival times, usage, llama.cpp timings."""

    def __init__(self, n: int):
        self.n = n
        self.t_sent = time.perf_counter()
        self.arrivals: list[float] = []  # text chunks of choice 0
        self.first_text: Optional[float] = None
        self.last_text: Optional[float] = None
        self.texts: dict[int, str] = {}
        self.finish: dict[int, str] = {}
        self.usage: Optional[dict] = None
        self.timings: Optional[dict] = None  # llama.cpp's server
        self.gapless: Optional[dict] = None  # gapless serve's figures
        self.error: Optional[str] = None
        self.done = False
        self.cancelled = False
        self.finished_at: Optional[float] = None  # when every answer had its finish reason
        self.held: dict[int, str] = {}  # per answer, a first UTF-16 half waiting for its second in the next event
        self.mended = 0  # halves that came alone, replaced by U+FFFD
        self.reasoning = 0  # characters of reasoning sent apart from the answer (llama.cpp's, vLLM's servers)
        self.stray = 0  # choices with an index outside the n asked for, left out

    @property
    def all_finished(self) -> bool:
        """Every answer asked for has its finish reason: complete even where the server closes without [DONE]."""
        return all(i in self.finish for i in range(self.n))

    @property
    def sent_finished(self) -> bool:
        """Every answer the server sent has its finish reason: complete where a server that ignores n (one answer
        for several candidates) closes without [DONE]."""
        sent = self.texts.keys() | self.finish.keys()
        return bool(sent) and all(i in self.finish for i in sent)

    def feed(self, line: str, raw: bool, emit: Callable, now: float) -> bool:
        """Take one SSE line; True when it carried the answer's first text."""
        line = line.strip()
        if not line or line.startswith(":") or line.startswith(("event:", "id:", "retry:")):
            return False
        if not line.startswith("data:"):
            raise _Garbage(f"sent something that is not an event stream: {line[:80]!r}")
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return False
        try:
            obj = json.loads(data)
        except ValueError:
            raise _Garbage(f"sent an event that is not JSON: {data[:80]!r}") from None
        except RecursionError:
            raise _Garbage(f"sent an event nested too deeply to read: {data[:80]!r}") from None
        if not isinstance(obj, dict):
            raise _Garbage(f"sent an unexpected event: {data[:80]!r}")
        if "error" in obj:
            err = obj["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)
            self.done = True
            return False
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        if isinstance(obj.get("timings"), dict):
            self.timings = obj["timings"]
        if isinstance(obj.get("x_gapless"), dict):
            self.gapless = obj["x_gapless"]
        first = False
        choices = obj.get("choices") or []
        if not isinstance(choices, list):
            raise _Garbage(f"sent an event whose choices are not a list: {data[:80]!r}")
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            i = choice.get("index")
            i = 0 if i is None else i  # left out or null: the first (a server that sends one answer)
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < max(self.n, 1):
                self.stray += 1  # an answer not asked for: merged into the first, its finish ended that one
                continue
            delta = choice.get("delta") or {}
            if not raw and not isinstance(delta, dict):
                raise _Garbage(f"sent an event whose delta is not an object: {data[:80]!r}")
            text = choice.get("text") if raw else delta.get("content")
            for key in () if raw else ("reasoning_content", "reasoning"):
                if isinstance(delta.get(key), str):
                    self.reasoning += len(delta[key])
                    break
            if isinstance(text, str) and text:
                text = self._whole(i, text)
            if isinstance(text, str) and text:
                first = first or self.first_text is None
                self.first_text = self.first_text or now
                self.last_text = now
                if i == 0:
                    self.arrivals.append(now)
                self.texts[i] = self.texts.get(i, "") + text
                emit(TextDelta(i, text))
            if choice.get("finish_reason"):
                self.finish[i] = str(choice["finish_reason"])
        return first

    def _whole(self, i: int, text: str) -> str:
        """An event's text joined to a half character held from the one before, as text that can be stored and
        shown: a server that cuts its text by UTF-16 index (JavaScript's strings) may send an emoji's two halves
        in two events, and halves added as Python strings never join. A first half at the end waits for the
        next event; a half alone is replaced by U+FFFD."""
        text = self.held.pop(i, "") + text
        if "\ud800" <= text[-1] <= "\udbff":
            self.held[i], text = text[-1], text[:-1]
        whole = whole_text(text)
        self.mended += whole.count("\ufffd") - text.count("\ufffd")  # the halves it replaced
        return whole

    def flush(self, emit: Callable) -> None:
        """The stream ended: a first half still waiting for its second never gets it."""
        for i, _half in sorted(self.held.items()):
            self.mended += 1
            self.texts[i] = self.texts.get(i, "") + "\ufffd"
            emit(TextDelta(i, "\ufffd"))
        self.held.clear()

    def result(self, sampling: SamplingParams, options: EngineOptions, unavailable: dict[str, str]) -> GenerationResult:
        count = max(self.texts.keys() | self.finish.keys(), default=0) + 1
        stop_reason = "stop" if sampling.stop else "eos"
        finishes = []
        for i in range(count):
            f = self.finish.get(i)
            # a server that ends the stream without a finish reason ended the answer (none was stopped here)
            if f is None or f in ("stop", "eos"):
                finishes.append("cancelled" if self.cancelled and f is None else stop_reason)
            else:  # "length", or the server's own: held back by a filter, or another ("tool_calls", "abort")
                finishes.append(KNOWN_FINISH.get(f, "server"))
        m = GenerationMetrics()
        for key in ("decode_steps", "profiled_steps"):
            m.mark_na(key, f"{REMOTE_REASON}; its steps are not seen here")
        # Without usage (llama-cpp-python's server sends none in a stream) the counts are unknown: n/a, not 0.
        usage = self.usage or {}
        prompt, completion = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
        no_usage = "stopped before the server reported its token usage" if self.cancelled else NO_USAGE
        for key, said, v in (
            ("prompt_tokens", usage.get("prompt_tokens"), prompt),
            ("new_tokens_total", usage.get("completion_tokens"), completion),
        ):
            if v is not None:
                m.put(key, v, figures.SERVER_USAGE)
            elif said is not None:  # reported, as no count can be: -7, true, "5"
                m.mark_na(key, f"the server reported {json.dumps(said)[:40]}, not a count of tokens")
            else:
                m.mark_na(key, no_usage)
        if completion is not None:
            m.new_tokens = [completion] if count == 1 else []
        gaps = [(b - a) * 1e3 for a, b in zip(self.arrivals, self.arrivals[1:])]
        # Text that arrived in one burst (a proxy or the server buffered the stream) has no timing to read: a
        # rate over microseconds said 400,000 tok/s.
        burst = bool(gaps) and max(gaps) < BURST_GAP_MS
        if self.first_text is not None:
            m.put("http_ttft_ms", (self.first_text - self.t_sent) * 1e3)
            span = (self.last_text or self.first_text) - self.first_text
            if not isinstance(completion, int):
                m.mark_na("http_decode_tok_s", no_usage)
            elif burst:
                m.mark_na("http_decode_tok_s", BURST)
            elif completion > count and span > 0:
                m.put("http_decode_tok_s", (completion - count) / span)
        if burst:
            m.mark_na("inter_token_ms_p50", BURST)
            m.mark_na("inter_token_ms_p99", BURST)
        elif gaps:
            m.put("inter_token_ms_p50", _percentile(gaps, 50))
            m.put("inter_token_ms_p99", _percentile(gaps, 99))
        return GenerationResult(
            texts=[self.texts.get(i, "") for i in range(count)],
            token_ids=[[] for _ in range(count)],
            finish_reasons=finishes,
            metrics=m,
            options=options.with_(device=REMOTE_DEVICE),  # the server's settings: none but n is known here
            unavailable=unavailable,
            seed=sampling.seed,
        )
