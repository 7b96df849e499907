"""The bridge between the GUI thread and the engine: one worker in a QThread, fed by a command queue.

GUI thread                              worker thread
EngineController.generate() --queue-->  EngineWorker.run() -> engine.generate(on_event=...)
            <--queued signals, ~30 Hz-- text, step records and monitor samples, batched

The GUI thread never waits on the engine: commands are put on a `queue.Queue`, stop is a `threading.Event` the
engine checks between steps (set directly, never queued), and results come back as signals, which Qt delivers
queued to receivers in the GUI thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.collector import GuiThreadCollector, gui_thread_waits
from engine import heap
from engine.errors import GaplessError
from engine.protocol import EngineLike, option_limits, sampling_extensions
from engine.types import EngineOptions, MonitorSample, Progress, RowFinished, SamplingParams, StepRecord, TextDelta

log = logging.getLogger(__name__)

BATCH_INTERVAL_S = 1 / 30  # text, step records and samples reach the GUI at most this often
PROGRESS_INTERVAL_S = 1 / 30

EngineFactory = Callable[[str, EngineOptions, Optional[Callable[[Progress], None]]], EngineLike]
LadderRunner = Callable[..., list]


def _load_engine(source: str, options: EngineOptions, progress: Optional[Callable[[Progress], None]]) -> EngineLike:
    # Imported on first use: torch and transformers take seconds to import, the window should not wait for them.
    from app.engines import load_engine

    return load_engine(source, options, progress)


def _run_ladder(*args: Any, **kwargs: Any) -> list:
    from engine.ladder import run_ladder

    return run_ladder(*args, **kwargs)


def one_line(exc: BaseException) -> str:
    """The message the user sees: a GaplessError says it itself; anything else is an internal error."""
    if isinstance(exc, GaplessError):
        return " ".join(str(exc).split()) or type(exc).__name__
    return f"internal error: {type(exc).__name__}: {' '.join(str(exc).split())}"


# ---- commands ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    source: str
    options: Optional[EngineOptions]  # None: keep the current options


@dataclass(frozen=True)
class Reconfigure:
    options: EngineOptions


@dataclass(frozen=True)
class Generate:
    request_id: int
    messages: list
    sampling: SamplingParams
    raw: bool
    cancel: threading.Event = field(compare=False)
    overflow: str = "rolling"  # engine.types.OVERFLOW_POLICIES


@dataclass(frozen=True)
class Ladder:
    messages: list
    sampling: SamplingParams
    presets: Optional[list]
    cancel: threading.Event = field(compare=False)


class Claim:
    """Who takes a Call first: the worker, to run it, or its caller, to give up on it (then it is skipped)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: Optional[str] = None

    def take(self, by: str) -> bool:
        with self._lock:
            if self._by is None:
                self._by = by
            return self._by == by


@dataclass(frozen=True)
class Call:
    """Run fn(engine) on the worker thread (the API server's requests share the engine this way)."""

    fn: Callable[[Any], None]
    done: threading.Event = field(compare=False)
    errors: list = field(compare=False, default_factory=list)
    claim: Claim = field(compare=False, default_factory=Claim)


@dataclass(frozen=True)
class Shutdown:
    pass


# ---- the worker -------------------------------------------------------------------------------------------


class _Batcher:
    """Collects the events of one generation and hands them out at most every `interval_s`."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._lock = threading.Lock()  # the engine may report monitor samples from its own thread
        self._text: dict[int, str] = {}
        self._steps: list[StepRecord] = []
        self._samples: list[MonitorSample] = []
        self._ended: dict[int, str] = {}  # candidate -> finish reason, since the last take
        self._last = 0.0

    def add(self, event: Any) -> bool:
        """Keep the event; True when it is time to flush."""
        with self._lock:
            if isinstance(event, TextDelta):
                self._text[event.candidate] = self._text.get(event.candidate, "") + event.text
            elif isinstance(event, StepRecord):
                self._steps.append(event)
            elif isinstance(event, MonitorSample):
                self._samples.append(event)
            elif isinstance(event, RowFinished):
                self._ended[event.candidate] = event.reason
                return True  # a candidate's end is shown when it happens, not with the others' at the next flush
            return time.monotonic() - self._last >= self.interval_s

    def take(self) -> tuple[dict[int, str], list[StepRecord], list[MonitorSample]]:
        with self._lock:
            out = (self._text, self._steps, self._samples)
            self._text, self._steps, self._samples = {}, [], []
            self._last = time.monotonic()
            return out

    def take_ended(self) -> dict[int, str]:
        with self._lock:
            out, self._ended = self._ended, {}
            return out


class EngineEvents(QObject):
    """What the engine's worker reports, declared once: the worker emits these on its thread and the controller
    passes each on to the GUI thread under the same name."""

    loadStarted = Signal(str)
    progress = Signal(object)  # Progress
    loaded = Signal(object, object)  # ModelInfo, {option: reason unavailable}
    loadFailed = Signal(str, str)  # source, message
    reconfigured = Signal(object, object)  # EngineOptions, {option: reason unavailable}
    reconfigureFailed = Signal(str)  # message; the previous options stay in force
    generationStarted = Signal(int, object)  # request id, EngineOptions used
    textBatch = Signal(int, object)  # request id, {candidate: text since the last batch}
    rowsFinished = Signal(int, object)  # request id, {candidate: finish reason} of candidates ended since the last
    steps = Signal(int, object)  # request id, [StepRecord]
    samples = Signal(object)  # [MonitorSample]
    generationFinished = Signal(int, object)  # request id, GenerationResult
    generationFailed = Signal(int, str)  # request id, message
    ladderProgress = Signal(int, int, str)  # done, total, label
    ladderFinished = Signal(object)  # rows
    ladderFailed = Signal(str)
    busyChanged = Signal(bool)


EVENT_NAMES: tuple[str, ...] = tuple(name for name, v in vars(EngineEvents).items() if isinstance(v, Signal))


class EngineWorker(EngineEvents):
    """Owns the engine; runs every command on its thread. Signals are emitted from that thread."""

    # The engine's state after a load or a reconfigure, emitted just before `loaded` / `reconfigured`: the
    # EngineOptions in force, the ModelInfo (dtype, device, weight bytes), {(option, value): reason} for what this
    # model and machine never run, and the sampling settings beyond OpenAI's it honours (the app's server lists them).
    engineState = Signal(object, object, object, object)

    def __init__(
        self,
        engine_factory: EngineFactory = _load_engine,
        ladder_runner: LadderRunner = _run_ladder,
        batch_interval_s: float = BATCH_INTERVAL_S,
    ):
        super().__init__()
        self.commands: "queue.Queue[Any]" = queue.Queue()
        self.engine: Optional[EngineLike] = None  # touched only on the worker thread
        self._engine_factory = engine_factory
        self._ladder_runner = ladder_runner
        self._pending_options: Optional[EngineOptions] = None  # options chosen before any model was loaded
        self._request_id = 0
        self._batcher = _Batcher(batch_interval_s)
        self._last_progress = (0.0, "")
        self._busy = False
        self._stop_reading = threading.Event()  # set by Stop: a draft model's read in progress is given up
        # Options in force that were not reported: their draft model's read stopped for options or a model queued
        # after them, whose reply says what is in force (said before anything else, or where those fail).
        self._unreported = False

    @Slot()
    def run(self) -> None:
        """The command loop; returns after Shutdown (the engine is closed on the way out)."""
        while True:
            command = self.commands.get()
            if isinstance(command, Shutdown):
                break
            if not self._busy:
                self._busy = True
                self.busyChanged.emit(True)
            if not (isinstance(command, Reconfigure) and self._superseded()):
                self._dispatch(command)
            if self.commands.empty():
                self._busy = False
                self.busyChanged.emit(False)
        self._close_engine(self.engine)
        self.engine = None
        if self._busy:
            self.busyChanged.emit(False)
        self.thread().quit()

    def _superseded(self) -> bool:
        """Whether the next command chooses options again: options changed one by one while an answer ran were
        each applied after it (an int8 quantisation among them), and the next answer waited for all of them."""
        with self.commands.mutex:
            return bool(self.commands.queue) and isinstance(self.commands.queue[0], Reconfigure)

    def stop_reading(self) -> None:
        """Give up the draft model's read a reconfigure is doing (Stop); safe from any thread."""
        self._stop_reading.set()

    def _replaced(self) -> bool:
        """Whether the next command chooses options or a model again (or ends the worker)."""
        with self.commands.mutex:
            return bool(self.commands.queue) and isinstance(self.commands.queue[0], (Reconfigure, Load, Shutdown))

    def _read_not_wanted(self) -> bool:
        """Whether the options being applied are moot: Stop was pressed, or other options, another model or the
        end are queued (a draft model's read held them back until it was whole)."""
        if self._stop_reading.is_set():
            return True
        with self.commands.mutex:
            return any(isinstance(c, (Reconfigure, Load, Shutdown)) for c in self.commands.queue)

    def _dispatch(self, command: Any) -> None:
        handler: dict[type, Callable[[Any], None]] = {
            Load: self._load,
            Reconfigure: self._reconfigure,
            Generate: self._generate,
            Ladder: self._ladder,
            Call: self._call,
        }
        try:
            if self._unreported and not isinstance(command, (Reconfigure, Load)):
                self._report_options()  # before what runs with them
            handler[type(command)](command)
        except Exception as exc:  # a bug here must neither end the loop nor leave the GUI waiting for an answer
            log.exception("engine worker: %s failed", type(command).__name__)
            message = one_line(exc)
            if isinstance(command, Load):
                self.loadFailed.emit(command.source, message)
            elif isinstance(command, Reconfigure):
                self.reconfigureFailed.emit(message)
            elif isinstance(command, Generate):
                self.generationFailed.emit(command.request_id, message)
            else:
                self.ladderFailed.emit(message)

    # ---- commands ----

    def _load(self, cmd: Load) -> None:
        self.loadStarted.emit(cmd.source)
        if cmd.options is not None:
            options = cmd.options
        elif self.engine is not None:
            options = self.engine.options
        else:
            options = self._pending_options or EngineOptions()
        try:
            engine = self._engine_factory(cmd.source, options, self._on_progress)
            unavailable = dict(engine.unavailable())
        except Exception as exc:
            self._log_unless_expected(exc, f"loading {cmd.source}")
            if self._unreported:  # the previous engine, and the options it has in force, stay
                self._report_options()
            self.loadFailed.emit(cmd.source, one_line(exc))  # the previous engine stays loaded and usable
            return
        previous, self.engine = self.engine, engine
        self._unreported = False
        self._pending_options = None
        self._close_engine(previous)
        self.engineState.emit(engine.options, engine.info, option_limits(engine), sampling_extensions(engine))
        self.loaded.emit(engine.info, unavailable)

    def _reconfigure(self, cmd: Reconfigure) -> None:
        if self.engine is None:
            try:
                self._pending_options = cmd.options.validate()
            except Exception as exc:
                self._log_unless_expected(exc, "choosing options")
                self.reconfigureFailed.emit(one_line(exc))
                return
            self.reconfigured.emit(self._pending_options, {})
            return
        self._stop_reading.clear()  # a Stop pressed before was for what ran before
        stopped = threading.Event()

        def not_wanted() -> bool:
            if self._read_not_wanted():
                stopped.set()
                return True
            return False

        try:
            self.engine.reconfigure(cmd.options, self._on_progress, not_wanted)
        except Exception as exc:
            self._log_unless_expected(exc, "reconfiguring")
            if self._unreported:  # the options in force before these stay
                self._report_options()
            self.reconfigureFailed.emit(one_line(exc))
            return
        release = getattr(self.engine, "release_unused_drafts", None)
        if release is not None:  # drafting turned off here frees the draft model (a remote engine has none)
            release()
        if stopped.is_set() and self._replaced():
            # Moot: what comes next says what is in force (a reply here showed these options just before those).
            self._unreported = True
            return
        self._report_options()

    def _report_options(self) -> None:
        """engineState and reconfigured for the options the engine has in force."""
        assert self.engine is not None
        self._unreported = False
        unavailable = dict(self.engine.unavailable())
        self.engineState.emit(
            self.engine.options, self.engine.info, option_limits(self.engine), sampling_extensions(self.engine)
        )
        self.reconfigured.emit(self.engine.options, unavailable)

    def _generate(self, cmd: Generate) -> None:
        if self.engine is None:
            self.generationFailed.emit(cmd.request_id, "no model is loaded")
            return
        self._request_id = cmd.request_id
        self._batcher.take()  # start clean
        self.generationStarted.emit(cmd.request_id, self.engine.options)
        try:
            result = self.engine.generate(
                cmd.messages, cmd.sampling, self._on_event, cmd.cancel, cmd.raw, overflow=cmd.overflow
            )
        except Exception as exc:
            self._flush()
            self._log_unless_expected(exc, "generating")
            self.generationFailed.emit(cmd.request_id, one_line(exc))
            return
        self._flush()
        self.generationFinished.emit(cmd.request_id, result)

    def _call(self, cmd: Call) -> None:
        try:
            if cmd.claim.take("worker"):
                cmd.fn(self.engine)
        except Exception as exc:  # handed back to the caller, which reports it
            cmd.errors.append(exc)
        finally:
            cmd.done.set()

    def _ladder(self, cmd: Ladder) -> None:
        if self.engine is None:
            self.ladderFailed.emit("no model is loaded")
            return

        def on_progress(done: int, total: int, label: str) -> None:
            self.ladderProgress.emit(done, total, label)

        try:
            rows = self._ladder_runner(
                self.engine, cmd.messages, cmd.sampling, presets=cmd.presets, on_progress=on_progress, cancel=cmd.cancel
            )
        except Exception as exc:
            self._log_unless_expected(exc, "running the ladder")
            self.ladderFailed.emit(one_line(exc))
            return
        self.ladderFinished.emit(rows)

    # ---- engine callbacks (worker thread) ----

    def _on_event(self, event: Any) -> None:
        if isinstance(event, Progress):
            self._on_progress(event)
        elif self._batcher.add(event):
            self._flush()

    def _flush(self) -> None:
        text, steps, samples = self._batcher.take()
        ended = self._batcher.take_ended()
        if text:
            self.textBatch.emit(self._request_id, text)
        if ended:
            self.rowsFinished.emit(self._request_id, ended)
        if steps:
            self.steps.emit(self._request_id, steps)
        if samples:
            self.samples.emit(samples)

    def _on_progress(self, p: Progress) -> None:
        # Downloads report many small steps: pass stage changes and the ends, and the rest at ~30 Hz.
        now = time.monotonic()
        last_t, last_stage = self._last_progress
        if p.stage != last_stage or p.fraction in (None, 0.0, 1.0) or now - last_t >= PROGRESS_INTERVAL_S:
            self._last_progress = (now, p.stage)
            self.progress.emit(p)

    # ---- helpers ----

    @staticmethod
    def _log_unless_expected(exc: BaseException, what: str) -> None:
        if isinstance(exc, GaplessError):
            log.warning("%s: %s", what, exc)
        else:
            log.error("%s: unexpected error", what, exc_info=exc)

    @staticmethod
    def _close_engine(engine: Any) -> None:
        if engine is None:
            return
        try:
            engine.close()
        except Exception:  # closing frees memory; a failure there is logged and must not stop the worker
            log.exception("closing the engine failed")


# ---- the GUI-thread facade --------------------------------------------------------------------------------


class EngineController(EngineEvents):
    """What the GUI talks to. Every method returns at once; results arrive as this object's signals, in the
    GUI thread. `info`, `options`, `unavailable` and `busy` mirror the worker's last reports."""

    # Events that update the mirrors first; their handlers emit them on. Every other event is passed on as is.
    _MIRRORED = ("loaded", "reconfigured", "generationFinished", "generationFailed", "busyChanged")
    contextCounted = Signal(int, object)  # request id, engine.types.ContextUse or a message saying why not
    loadAsked = Signal(str)  # the source of a load, as it is asked for (the app's server stops its running answer)

    def __init__(self, worker: Optional[EngineWorker] = None, parent: Optional[QObject] = None):
        super().__init__(parent)
        self.worker = worker or EngineWorker()
        self.info: Any = None  # ModelInfo of the loaded model, None before the first load
        self.options: EngineOptions = EngineOptions()
        self.unavailable: dict[str, str] = {}
        self.limits: dict[tuple[str, Any], str] = {}  # what the loaded model and this machine never run
        self.sampling_extensions: tuple[str, ...] = ()  # top_k, repetition_penalty: those the loaded model honours
        self.busy = False
        self._ids = itertools.count(1)
        self._generation_cancels: dict[int, threading.Event] = {}
        self._ladder_cancels: list[threading.Event] = []
        self._shut_down = False
        # Counting for the context meter runs beside the engine worker, which may be busy generating.
        self._counter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="context-meter")
        self._count_ids = itertools.count(1)
        self._count_latest = 0
        # The worker and the other threads must run no collection: one frees whatever unreachable cycle it finds,
        # the Qt objects of this thread's among them, on its own thread. The app's build hands the passes to the
        # GUI thread first; a controller made without it (a tool, the tests) does so itself, until it shuts down.
        self._collector: Optional[GuiThreadCollector] = None if heap.is_handed() else GuiThreadCollector()

        # The mirrors are updated before the signal is passed on, so a receiver reading them sees the news.
        self.worker.engineState.connect(self._on_engine_state)
        self.worker.loaded.connect(self._on_loaded)
        self.worker.reconfigured.connect(self._on_reconfigured)
        self.worker.generationFinished.connect(self._on_generation_finished)
        self.worker.generationFailed.connect(self._on_generation_failed)
        self.worker.ladderFinished.connect(self._on_ladder_done)
        self.worker.ladderFailed.connect(self._on_ladder_done)
        self.worker.busyChanged.connect(self._on_busy)
        for name in EVENT_NAMES:
            if name not in self._MIRRORED:
                getattr(self.worker, name).connect(getattr(self, name))

        self._thread = QThread()
        self._thread.setObjectName("engine-worker")
        self.worker.moveToThread(self._thread)
        self._thread.started.connect(self.worker.run)
        self._thread.start()

    # ---- commands (return at once) ----

    def load(self, source: str, options: Optional[EngineOptions] = None) -> None:
        """Load a model; a running generation or ladder is stopped first and finishes with what it had."""
        self.cancel()
        self.cancel_ladder()
        self._put(Load(source, options))
        # after the load is queued: an API request the server hands the worker from now on waits behind it
        self.loadAsked.emit(source)

    def reconfigure(self, options: EngineOptions) -> None:
        """Use `options` from the next generation on; a running generation is not touched."""
        self._put(Reconfigure(options))

    def generate(self, messages: list, sampling: SamplingParams, raw: bool = False, overflow: str = "rolling") -> int:
        request_id = next(self._ids)
        cancel = threading.Event()
        self._generation_cancels[request_id] = cancel
        self._put(Generate(request_id, list(messages), sampling, raw, cancel, overflow))
        return request_id

    def measure_context(self, messages: list, max_new_tokens: int, overflow: str = "rolling") -> int:
        """Count what `messages` would take of the loaded model's context, off this thread; the answer comes as
        contextCounted(request id, ContextUse). A newer request makes the older ones not counted at all."""
        request_id = next(self._count_ids)
        self._count_latest = request_id
        if not self._shut_down:
            self._counter.submit(self._measure, request_id, list(messages), max_new_tokens, overflow)
        return request_id

    def _measure(self, request_id: int, messages: list, max_new_tokens: int, overflow: str) -> None:
        if request_id != self._count_latest:
            return
        engine = self.worker.engine  # a reference: a load replacing it meanwhile leaves this one usable
        if engine is None:
            self.contextCounted.emit(request_id, "no model is loaded")
            return
        try:
            use = engine.measure_prompt(messages, max_new_tokens, overflow)
        except Exception as exc:  # reported in the meter; a bad count must not end the counting thread
            if not isinstance(exc, GaplessError):
                log.exception("counting the context failed")
            self.contextCounted.emit(request_id, one_line(exc))
            return
        self.contextCounted.emit(request_id, use)

    def cancel(self) -> None:
        """Stop the running generation (and any queued one): each finishes with its partial text; and a draft
        model's read in progress (the options stay in force; it is read when next needed). Safe to call from any
        thread (it only sets events)."""
        for event in list(self._generation_cancels.values()):
            event.set()
        self.worker.stop_reading()

    def run_ladder(self, messages: list, sampling: SamplingParams, presets: Optional[list] = None) -> None:
        cancel = threading.Event()
        self._ladder_cancels.append(cancel)
        self._put(Ladder(list(messages), sampling, list(presets) if presets is not None else None, cancel))

    def cancel_ladder(self) -> None:
        for event in list(self._ladder_cancels):
            event.set()

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop everything and wait (at exit only) up to `timeout` s for the worker to close the engine."""
        with gui_thread_waits():  # this thread waits for the worker now: what it asks of this one is not waited for
            if not self._shut_down:
                self._shut_down = True
                self.cancel()
                self.cancel_ladder()
                if self._collector is not None:
                    self._collector.begin_close()
                self.worker.commands.put(Shutdown())
                self._counter.shutdown(wait=True, cancel_futures=True)
            finished = self._thread.wait(int(timeout * 1000))
        if not finished:
            log.warning("the engine worker did not stop within %.1f s", timeout)
        if self._collector is not None:  # a worker still busy keeps the passes here (GuiThreadCollector.close)
            self._collector.close(others_stopped=finished)
        return finished

    def _put(self, command: Any) -> None:
        if self._shut_down:
            raise RuntimeError("the engine controller was shut down")
        self.worker.commands.put(command)

    # ---- mirrors (GUI thread) ----

    @Slot(object, object, object, object)
    def _on_engine_state(self, options: EngineOptions, info: Any, limits: Any, extensions: Any) -> None:
        self.options = options
        self.info = info
        self.limits = dict(limits)
        self.sampling_extensions = tuple(extensions)

    @Slot(object, object)
    def _on_loaded(self, info: Any, unavailable: Any) -> None:
        self.unavailable = dict(unavailable)
        self.loaded.emit(info, unavailable)

    @Slot(object, object)
    def _on_reconfigured(self, options: EngineOptions, unavailable: Any) -> None:
        self.options = options  # also where no model is loaded yet: the options wait for the load, no state came
        self.unavailable = dict(unavailable)
        self.reconfigured.emit(options, unavailable)

    @Slot(int, object)
    def _on_generation_finished(self, request_id: int, result: Any) -> None:
        self._generation_cancels.pop(request_id, None)
        self.generationFinished.emit(request_id, result)

    @Slot(int, str)
    def _on_generation_failed(self, request_id: int, message: str) -> None:
        self._generation_cancels.pop(request_id, None)
        self.generationFailed.emit(request_id, message)

    @Slot()
    def _on_ladder_done(self, *_: Any) -> None:
        if self._ladder_cancels:
            self._ladder_cancels.pop(0)

    @Slot(bool)
    def _on_busy(self, busy: bool) -> None:
        self.busy = busy
        self.busyChanged.emit(busy)
