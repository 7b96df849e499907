"""One engine thread for the server. Requests wait first come first served in a bounded queue; past its bound a
request is refused at once (503 with Retry-After) rather than left waiting without end.

The engine is reached through `run_on_engine(fn)`, which runs fn(engine) on the thread that owns the engine and
returns when it is done: by default the queue's own thread owns it (`gapless serve`); in the app, the engine
worker's thread does, so API requests and the app's own chats take turns on one engine.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

from app.server.protocol import ApiError, Request, bad
from engine.errors import GaplessError, RemoteRefused
from engine.protocol import sampling_extensions
from engine.types import GenerationResult, SamplingParams, TextDelta

log = logging.getLogger(__name__)

Sink = Callable[[Any], None]
RunOnEngine = Callable[[Callable[[Any], None]], None]


# What a job's sink receives besides the TextDeltas: small immutable messages, one per event.
class Started(NamedTuple):
    prompt_tokens: int
    queue_ms: float


class Finished(NamedTuple):
    result: GenerationResult
    queue_ms: float


class Failed(NamedTuple):
    error: ApiError


@dataclass
class Job:
    """A request on its way through the engine. `sink` receives, on the engine thread, Started, the TextDeltas,
    then Finished, or Failed at any point; `cancel` stops it, queued or running."""

    request: Request
    sink: Sink
    cancel: threading.Event = field(default_factory=threading.Event)
    accepted: float = field(default_factory=time.perf_counter)
    engine_name: Optional[str] = None  # the model the server served when it accepted the request (EngineQueue)
    state: str = "queued"  # then "running", or "withdrawn": its client went away while it waited (the queue's lock)
    stopped: Optional[ApiError] = None  # why the server stopped it (EngineQueue.stop_running), for its client
    begun: bool = False  # the engine took it: it counts as running, no longer waiting (the queue's lock)


@dataclass(frozen=True)
class ModelFacts:
    """What the model list says of the served model besides its name: its context in tokens (0 where not known)
    and the sampling settings beyond OpenAI's it honours (engine.protocol.sampling_extensions)."""

    context_length: int = 0
    sampling_extensions: tuple[str, ...] = ()

    @classmethod
    def of(cls, engine: Any) -> "ModelFacts":
        """Read from the engine (on the thread that owns it)."""
        ctx = getattr(engine, "context_length", 0)
        return cls(ctx if isinstance(ctx, int) and ctx > 0 else 0, sampling_extensions(engine))


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", "server_error", code="shutting_down")


class ShuttingDown(Exception):
    """Raised by a runner that will not run the job because the server is stopping."""


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(f"{waiting} requests are already waiting for the engine")
        self.waiting = waiting
        self.retry_after_s = retry_after_s


@dataclass
class ServerStats:
    served: int = 0  # answered in full
    cancelled: int = 0  # the client went away first
    rejected: int = 0  # 503: the queue was full
    failed: int = 0  # refused by the engine (e.g. a prompt too long) or an internal error
    waiting: int = 0
    running: int = 0
    last_error: str = ""

    def snapshot(self) -> dict[str, Any]:
        return dict(self.__dict__)


def model_key(info: Any) -> str:
    """Which model an engine runs: its source and name (two models in files or folders of one name, or two
    servers' models of one name, are told apart: the second answered requests accepted for the first)."""
    return f"{getattr(info, 'source', '') or ''}\0{getattr(info, 'name', '')}"


class EngineQueue:
    def __init__(
        self,
        engine: Any,
        max_waiting: int = 16,
        run_on_engine: Optional[RunOnEngine] = None,
        model_id: Optional[str] = None,
        facts: Optional[ModelFacts] = None,
        engine_key: Optional[str] = None,
    ):
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.engine = engine
        self.max_waiting = max_waiting
        # The name clients use (model_id) and which model the engine runs (engine_name: model_key, its source and
        # name, as two files or two servers' models may share a name; model_id may be another name for it): a
        # request runs on the model it was accepted for or not at all. With them, what the model list says of it
        # (facts: read from the engine here, given by the app, which owns its engine on its worker). One tuple, so a
        # reader never gets one of them from before a change and another from after it.
        self._served: tuple[str, Optional[str], ModelFacts] = (
            model_id if model_id is not None else engine.info.name,
            model_key(engine.info) if engine is not None else engine_key or model_id,
            facts if facts is not None else ModelFacts.of(engine) if engine is not None else ModelFacts(),
        )
        self.stats = ServerStats()
        self._run_on_engine = run_on_engine or (lambda fn: fn(self.engine))
        self._lock = threading.Lock()
        self._jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._mean_job_s: Optional[float] = None
        self._current: Optional[Job] = None
        self._started = 0.0  # when the current job started running
        self._shutting_down = False
        self._thread = threading.Thread(target=self._loop, name="gapless-serve-engine", daemon=True)
        self._thread.start()

    @property
    def names(self) -> tuple[str, Optional[str]]:
        model_id, engine_name, _ = self._served
        return model_id, engine_name

    @property
    def listed(self) -> tuple[str, ModelFacts]:
        """The name clients use and what the model list says of the model."""
        model_id, _, facts = self._served
        return model_id, facts

    @property
    def model_id(self) -> str:
        return self._served[0]

    @model_id.setter
    def model_id(self, name: str) -> None:  # another name for the same model (--served-model-name)
        self._served = (name, *self._served[1:])

    @property
    def engine_name(self) -> Optional[str]:
        return self._served[1]

    def serve(self, name: str, facts: ModelFacts, key: Optional[str] = None) -> None:
        """The engine runs another model now (`key`: its model_key), served under its own name."""
        self._served = (name, key or name, facts)

    def stop_running(self, error: ApiError) -> None:
        """Stop the request running now, if any, its client told `error` (with the text it had, when streamed):
        the app's user opened another model, which waited for the whole answer."""
        with self._lock:
            job = self._current
            if job is not None:
                job.stopped = error
                job.cancel.set()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._shutting_down:
                raise shutting_down()
            if self.stats.waiting >= self.max_waiting + (0 if self.stats.running else 1):
                self.stats.rejected += 1
                raise QueueFull(self.stats.waiting, self._retry_after_s())
            self.stats.waiting += 1
            if job.engine_name is None:
                job.engine_name = self.engine_name
            self._jobs.put(job)  # with the count, so whoever sees one waiting finds it queued (put never blocks)

    def withdraw(self, job: Job) -> None:
        """`job`'s client went away: where the job still waits, its place in the queue is free at once (it counts
        as cancelled, and the engine never sees it); a running job is stopped by its cancel event instead."""
        job.cancel.set()
        with self._lock:
            if job.state != "queued":
                return
            job.state = "withdrawn"
            self.stats.waiting -= 1
            self.stats.cancelled += 1

    def shut_down(self) -> None:
        """The server is stopping (Ctrl-C, or the app's Stop): new requests are refused, and the running one and the
        queued ones end now, each with a 503 saying so (a stream's last event), rather than the generation running
        on through the HTTP server's graceful shutdown and being cut there."""
        with self._lock:
            self._shutting_down = True
            with self._jobs.mutex:
                jobs = [self._current, *self._jobs.queue]
        for job in jobs:
            if job is not None:
                job.cancel.set()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop taking jobs: the queued ones are cancelled, the running one stops at its next step."""
        pending = []
        while True:
            try:
                pending.append(self._jobs.get_nowait())
            except queue.Empty:
                break
        for job in [self._current, *pending]:
            if job is not None:
                job.cancel.set()
        for job in pending:
            self._jobs.put(job)
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _retry_after_s(self) -> int:
        per_job = self._mean_job_s if self._mean_job_s is not None else 1.0
        return max(1, min(600, math.ceil(per_job * (self.stats.waiting + 1))))

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                if job.state == "withdrawn":
                    continue
                job.state = "running"
                self._current = job
            try:
                self._run_on_engine(functools.partial(self._execute, job=job))
            except ShuttingDown:  # as a request the engine had not begun when the server stopped
                self._end(job, "cancelled", Failed(shutting_down()))
            except Exception as exc:  # the runner itself failed (e.g. the app's engine went away)
                log.exception("serve: running a request failed")
                self._fail(job, ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))
            finally:
                with self._lock:
                    self._release(job)  # where no outcome was sent (each one releases it first)

    def _begin(self, job: Job) -> None:
        """`job` reached the engine: it counts as running from now. In the app the engine may first finish the
        user's own answer, and a request waiting behind it still waits (the Server panel says so)."""
        with self._lock:
            if self._current is job and not job.begun:
                job.begun = True
                self.stats.waiting -= 1
                self.stats.running += 1
                self._started = time.perf_counter()

    def _release(self, job: Job) -> None:
        """The slot `job` held is free again (under the lock; once per job)."""
        if self._current is not job:
            return
        self._current = None
        if not job.begun:  # it ended before the engine took it (the server stopping, the runner failing)
            self.stats.waiting -= 1
            return
        self.stats.running -= 1
        took = time.perf_counter() - self._started
        self._mean_job_s = took if self._mean_job_s is None else 0.8 * self._mean_job_s + 0.2 * took

    def _end(self, job: Job, outcome: str, event: Any) -> None:
        """Count the job's outcome and free its slot in one step, then tell its client: a client that has its
        answer never sees the counts of a request still running."""
        with self._lock:
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
            if outcome == "failed":
                self.stats.last_error = event.error.message
            self._release(job)
        job.sink(event)

    def _fail(self, job: Job, error: ApiError) -> None:
        self._end(job, "failed", Failed(error))

    def _execute(self, engine: Any, *, job: Job) -> None:
        self._begin(job)
        req = job.request
        queue_ms = (time.perf_counter() - job.accepted) * 1e3
        if engine is None:
            self._fail(job, ApiError(503, "no model is loaded", "server_error", code="no_model"))
            return
        info = getattr(engine, "info", None)
        running = getattr(info, "name", None)
        if job.engine_name is not None and running is not None and model_key(info) != job.engine_name:
            self._fail(  # the app loaded another model while the request waited: it would answer as the other
                job,
                ApiError(
                    404,
                    f"the model {job.request.model!r} was replaced by {running!r} while the request waited; "
                    "ask again with the new model's name",
                    param="model",
                    code="model_not_found",
                ),
            )
            return
        if job.cancel.is_set():
            gone = ApiError(499, "the client went away before the request started", code="cancelled")
            self._end(job, "cancelled", Failed(shutting_down() if self._shutting_down else job.stopped or gone))
            return
        try:
            sampling, prompt_tokens = prepare(engine, req)
        except ApiError as exc:
            self._fail(job, exc)
            return
        except GaplessError as exc:
            self._fail(job, bad(str(exc), "messages" if req.chat else "prompt", "invalid_value"))
            return
        job.sink(Started(prompt_tokens, queue_ms))
        previous = engine.options
        try:
            if previous.candidates != req.n:
                engine.reconfigure(previous.with_(candidates=req.n))
            result = engine.generate(
                req.messages, sampling, on_event=_texts_to(job.sink), cancel=job.cancel, raw=req.raw
            )
        except RemoteRefused as exc:  # a remote model's server said no: what it meant is passed on
            self._fail(job, relayed(exc))
            return
        except GaplessError as exc:
            self._fail(job, ApiError(500, str(exc), "server_error", code="generation_failed"))
            return
        except Exception as exc:
            log.exception("serve: generation failed")
            self._fail(job, ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))
            return
        finally:
            if engine.options != previous:
                try:
                    engine.reconfigure(previous)
                except GaplessError as exc:
                    log.warning("serve: restoring the engine options failed: %s", exc)
        cancelled = job.cancel.is_set() and "cancelled" in result.finish_reasons
        if cancelled and self._shutting_down:
            self._end(job, "cancelled", Failed(shutting_down()))
            return
        if cancelled and job.stopped is not None:
            self._fail(job, job.stopped)
            return
        if not cancelled and len(result.texts) != req.n:  # fewer candidates ran (out of device memory, a server)
            said = result.unavailable.get("candidates") or "; ".join(n for n in result.notices if "candidates" in n)
            why = said or f"{len(result.texts)} were answered"
            self._fail(job, ApiError(503, f"n={req.n} could not be served: {why}; ask for fewer", "server_error"))
            return
        self._end(job, "cancelled" if cancelled else "served", Finished(result, queue_ms))


def relayed(exc: RemoteRefused) -> ApiError:
    """A remote server's refusal as this server's answer. The client's own mistakes (a prompt too long, a value
    out of range) keep their status, param and code, so a client does not retry them as it would a 500; being
    busy keeps its status and Retry-After; the rest (the remote server's key or model, its failures) are 502,
    this server's upstream failing it."""
    status = exc.status
    if status in (429, 503):
        headers = {"Retry-After": exc.retry_after} if exc.retry_after else None
        return ApiError(status, str(exc), "server_error", code=exc.code or "upstream_busy", headers=headers)
    if 400 <= status < 500 and status not in (401, 403, 404, 407):
        return ApiError(status, str(exc), "invalid_request_error", param=exc.param, code=exc.code)
    return ApiError(502, str(exc), "server_error", code="upstream_error")


def _texts_to(sink: Sink) -> Callable[[Any], None]:
    def on_event(event: Any) -> None:
        if isinstance(event, TextDelta) and event.text:
            sink(event)

    return on_event


# How many fewer characters a tokenizer's normaliser might leave (NFC joins a letter and its combining accent).
NORMALISATION_MARGIN = 2


_LONGEST: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # per tokenizer, while it lives


def longest_token(tokenizer: Any) -> int:
    """The most characters of text one token covers: its vocabulary's longest entry. A byte-level BPE entry has a
    character per byte, a SentencePiece one a character per character ("▁" for a space, "<0x41>" for a byte), so
    a text of c characters is at least c / longest tokens, whatever the text."""
    longest = _LONGEST.get(tokenizer)
    if longest is None:
        longest = _LONGEST[tokenizer] = max(1, max((len(piece) for piece in tokenizer.get_vocab()), default=1))
    return longest


def prepare(engine: Any, req: Request) -> tuple[SamplingParams, int]:
    """Sampling for `req` and its prompt length, or a 400 when the prompt and the answer do not fit the context
    (the engine would cut the prompt to fit; a client of this API expects to be told instead)."""
    from engine.prompt import build_prompt

    if getattr(engine, "tokenizer", None) is None:  # a remote model: its server checks the context itself
        if req.max_tokens is None:
            raise bad(
                "this model runs on a remote server whose context is not known here: give max_tokens",
                "max_tokens",
                "missing_max_tokens",
            )
        for name, off in (("top_k", 0), ("repetition_penalty", 1.0)):
            if getattr(req, name) != off and not engine.passes_on(name):
                raise bad(
                    f"'{name}' is not passed on to this remote model's server: it is not one known to take it "
                    "(Gapless, vLLM, llama.cpp)",
                    name,
                    "unsupported_parameter",
                )
        return sampling_of(req, req.max_tokens), 0
    ctx = engine.context_length
    where = "messages" if req.chat else "prompt"
    chars = sum(len(m["content"]) for m in req.messages)
    longest = longest_token(engine.tokenizer)
    if len(req.messages) >= ctx:  # each message takes a token or more of the template (its role's marker)
        raise bad(
            f"this model's maximum context length is {ctx} tokens, but the prompt has {len(req.messages):,} "
            "messages, and each takes at least one token",
            where,
            "context_length_exceeded",
        )
    if chars > NORMALISATION_MARGIN * longest * ctx:  # a prompt of megabytes would hold the engine for seconds
        raise bad(
            f"this model's maximum context length is {ctx} tokens, but the prompt has more than {ctx} tokens: "
            f"{chars:,} characters, and a token of this model covers at most {longest}",
            where,
            "context_length_exceeded",
        )
    full = build_prompt(engine.tokenizer, req.messages, 1 << 40, 1, raw=req.raw)
    n = len(full.ids)
    if n >= ctx:
        raise bad(
            f"this model's maximum context length is {ctx} tokens, but the prompt has {n} tokens",
            where,
            "context_length_exceeded",
        )
    room = ctx - n
    max_new = req.max_tokens if req.max_tokens is not None else room
    if max_new > room:
        raise bad(
            f"this model's maximum context length is {ctx} tokens, but {n + max_new} were requested ({n} in "
            f"the prompt, {max_new} for the answer)",
            "max_tokens",
            "context_length_exceeded",
        )
    return sampling_of(req, max_new), n


def sampling_of(req: Request, max_new_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=req.temperature,
        top_k=req.top_k,
        top_p=req.top_p,
        repetition_penalty=req.repetition_penalty,
        max_new_tokens=max_new_tokens,
        seed=req.seed,
        stop=req.stop,
    ).validate()
