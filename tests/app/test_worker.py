"""The engine worker and its GUI-thread controller: signal order, batching, stop, failed loads, live option
changes and model switches while generating.

Most tests run the real engine on a tiny random model. A scripted engine is used only where a test needs a
generation that waits for the test (a deterministic mid-answer moment) or a deliberate internal failure.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from app.worker import EngineController, EngineWorker
from engine.errors import ModelLoadError
from engine.types import (EngineOptions, GenerationMetrics, GenerationResult, ModelInfo, MonitorSample, Progress,
                          SamplingParams, StepRecord, TextDelta)

SIGNALS = ("loadStarted", "progress", "loaded", "loadFailed", "reconfigured", "reconfigureFailed",
           "generationStarted", "textBatch", "steps", "samples", "generationFinished", "generationFailed",
           "ladderProgress", "ladderFinished", "ladderFailed", "busyChanged")
TIMEOUT_MS = 60_000


class Recorder:
    """Every controller signal, in the order the GUI thread received it."""

    def __init__(self, controller: EngineController):
        self.events: list[tuple] = []
        for name in SIGNALS:
            getattr(controller, name).connect(lambda *args, _n=name: self.events.append((_n, *args)))

    def names(self, *only: str) -> list[str]:
        return [e[0] for e in self.events if not only or e[0] in only]

    def of(self, name: str) -> list[tuple]:
        return [e[1:] for e in self.events if e[0] == name]

    def text(self, request_id: int, candidate: int = 0) -> str:
        return "".join(b.get(candidate, "") for rid, b in self.of("textBatch") if rid == request_id)


# ---- a scripted engine: each step waits for the test when asked to -----------------------------------------


class ScriptedEngine:
    def __init__(self, source, options, progress=None, step_s=0.001, fail_with=None):
        if source.startswith("missing"):
            raise ModelLoadError(f"model not found: {source}")
        if source == "broken":
            raise RuntimeError("tensor shapes went sideways")
        if progress:
            progress(Progress("load", 0.0, "reading"))
            progress(Progress("load", 1.0, "loaded"))
        self.info = ModelInfo(source, "llama", "LlamaForCausalLM", "fast", 1000, "fp32", "cpu", 128, 4000, source, "hf-folder")
        self.options = options.validate()
        self.step_s = step_s
        self.fail_with = fail_with
        self.gate: threading.Event | None = None  # when set, generation pauses after its first token until the gate opens
        self.first_token = threading.Event()
        self.closed = False

    def unavailable(self, options=None):
        return {"cuda_graph": "needs CUDA"}

    def reconfigure(self, options, progress=None):
        self.options = options.validate()
        if progress:
            progress(Progress("compile", None, "applying options"))

    def generate(self, messages, sampling, on_event=None, cancel=None, raw=False):
        if self.fail_with:
            raise self.fail_with
        text, reason = "", "length"
        for i in range(sampling.max_new_tokens):
            if cancel is not None and cancel.is_set():
                reason = "cancelled"
                break
            time.sleep(self.step_s)
            piece = f"t{i} "
            text += piece
            on_event(TextDelta(0, piece))
            on_event(StepRecord(time.perf_counter(), i + 1, i + 1, self.step_s * 1000))
            if i % 10 == 0:
                on_event(MonitorSample(time.perf_counter(), cpu_util_pct=50.0, sources={"cpu_util_pct": "psutil"}))
            if i == 0:
                self.first_token.set()
                if self.gate is not None:
                    self.gate.wait(30)
        n = len(text.split())
        metrics = GenerationMetrics(prompt_tokens=3, new_tokens=[n], new_tokens_total=n)
        return GenerationResult([text], [list(range(n))], [reason], metrics, self.options, {}, sampling.seed)

    def close(self):
        self.closed = True


@pytest.fixture
def scripted(qtbot):
    made: list[ScriptedEngine] = []

    def factory(source, options, progress):
        made.append(ScriptedEngine(source, options, progress))
        return made[-1]

    ctl = EngineController(EngineWorker(engine_factory=factory, ladder_runner=fake_ladder))
    yield ctl, made
    assert ctl.shutdown(30)


def fake_ladder(engine, messages, sampling, presets, on_progress, cancel):
    rows = []
    for i, name in enumerate(presets or ["naive", "first-fixes"]):
        on_progress(i, len(presets or [0, 0]), name)
        rows.append({"preset": name, "label": name, "options": engine.options.to_dict(), "skipped": None,
                     "metrics": None, "decode_tok_s": None, "kernel_gap_pct": None, "kernel_gap_source": None})
    return rows


def load(qtbot, ctl, source, options=None):
    with qtbot.waitSignal(ctl.loaded, timeout=TIMEOUT_MS):
        ctl.load(source, options)


def wait_finished(qtbot, ctl, request_id):
    with qtbot.waitSignal(ctl.generationFinished, timeout=TIMEOUT_MS,
                          check_params_cb=lambda rid, _r: rid == request_id) as blocker:
        pass
    return blocker.args[1]


MESSAGES = [{"role": "user", "content": "hello"}]


def test_text_is_batched_and_whole(qtbot, scripted):
    ctl, _ = scripted
    load(qtbot, ctl, "tiny")
    rec = Recorder(ctl)
    with qtbot.waitSignal(ctl.generationFinished, timeout=TIMEOUT_MS) as done:
        rid = ctl.generate(MESSAGES, SamplingParams(max_new_tokens=300))
    result = done.args[1]
    assert rec.text(rid) == result.texts[0] == "".join(f"t{i} " for i in range(300))
    batches = rec.of("textBatch")
    assert 1 <= len(batches) < 300  # 300 tokens arrive in far fewer batches
    assert sum(len(s) for _, s in rec.of("steps")) == 300
    assert sum(len(s[0]) for s in rec.of("samples")) == 30
    # nothing of this generation arrives after its result
    names = rec.names()
    assert names.index("generationFinished") > max(i for i, n in enumerate(names) if n in ("textBatch", "steps", "samples"))


def test_scripted_generation_failure_and_internal_errors(qtbot, scripted):
    ctl, made = scripted
    rec = Recorder(ctl)
    with qtbot.waitSignal(ctl.generationFailed, timeout=TIMEOUT_MS):
        rid0 = ctl.generate(MESSAGES, SamplingParams())
    assert rec.of("generationFailed") == [(rid0, "no model is loaded")]
    load(qtbot, ctl, "tiny")
    made[0].fail_with = ValueError("bad\nthing")
    with qtbot.waitSignal(ctl.generationFailed, timeout=TIMEOUT_MS) as failed:
        ctl.generate(MESSAGES, SamplingParams())
    assert failed.args[1] == "internal error: ValueError: bad thing"
    with qtbot.waitSignal(ctl.loadFailed, timeout=TIMEOUT_MS) as failed:
        ctl.load("broken")
    assert failed.args == ["broken", "internal error: RuntimeError: tensor shapes went sideways"]
    made[0].fail_with = None
    with qtbot.waitSignal(ctl.generationFinished, timeout=TIMEOUT_MS):  # the worker and engine still work
        ctl.generate(MESSAGES, SamplingParams(max_new_tokens=2))


def test_load_while_generating_cancels_then_loads(qtbot, scripted):
    ctl, made = scripted
    load(qtbot, ctl, "first")
    first = made[0]
    first.gate = threading.Event()
    rec = Recorder(ctl)
    rid = ctl.generate(MESSAGES, SamplingParams(max_new_tokens=1000))
    assert first.first_token.wait(30)
    with qtbot.waitSignal(ctl.loaded, timeout=TIMEOUT_MS):
        ctl.load("second")
        first.gate.set()
    assert rec.names("generationFinished", "loadStarted", "loaded") == ["generationFinished", "loadStarted", "loaded"]
    (frid, result), = rec.of("generationFinished")
    assert frid == rid and result.finish_reasons == ["cancelled"] and result.texts[0].startswith("t0 ")
    assert len(result.texts[0].split()) < 1000
    assert first.closed and ctl.info.name == "second"


def test_reconfigure_while_generating_waits_for_it(qtbot, scripted):
    ctl, made = scripted
    load(qtbot, ctl, "tiny")
    made[0].gate = threading.Event()
    rec = Recorder(ctl)
    rid1 = ctl.generate(MESSAGES, SamplingParams(max_new_tokens=5))
    assert made[0].first_token.wait(30)
    ctl.reconfigure(EngineOptions(kv_cache="dynamic"))
    rid2 = ctl.generate(MESSAGES, SamplingParams(max_new_tokens=5))
    made[0].gate.set()
    r1 = wait_finished(qtbot, ctl, rid2) and rec.of("generationFinished")[0][1]
    assert r1.options == EngineOptions() and r1.texts[0] == "t0 t1 t2 t3 t4 "  # the running one is untouched
    started = dict(rec.of("generationStarted"))
    assert started[rid1] == EngineOptions() and started[rid2] == EngineOptions(kv_cache="dynamic")
    assert rec.names("generationFinished", "reconfigured", "generationStarted")[1:] == [
        "generationFinished", "reconfigured", "generationStarted", "generationFinished"]


def test_cancel_before_start_and_busy(qtbot, scripted):
    ctl, made = scripted
    rec = Recorder(ctl)
    load(qtbot, ctl, "tiny")
    assert rec.of("busyChanged") == [(True,), (False,)] and not ctl.busy
    made[0].gate = threading.Event()
    rid1 = ctl.generate(MESSAGES, SamplingParams(max_new_tokens=50))
    rid2 = ctl.generate(MESSAGES, SamplingParams(max_new_tokens=50))
    assert made[0].first_token.wait(30)
    ctl.cancel()  # stops the running one and the queued one
    made[0].gate.set()
    wait_finished(qtbot, ctl, rid2)
    results = dict(rec.of("generationFinished"))
    assert results[rid1].finish_reasons == ["cancelled"] and results[rid1].texts == ["t0 "]
    assert results[rid2].finish_reasons == ["cancelled"] and results[rid2].texts == [""]
    qtbot.waitUntil(lambda: not ctl.busy, timeout=TIMEOUT_MS)
    # one busy period for both generations
    assert rec.of("busyChanged") == [(True,), (False,), (True,), (False,)]
    rid3 = ctl.generate(MESSAGES, SamplingParams(max_new_tokens=3))  # a new generation is not cancelled
    assert wait_finished(qtbot, ctl, rid3).finish_reasons == ["length"]


def test_reconfigure_before_any_model_and_invalid_options(qtbot, scripted):
    ctl, made = scripted
    with qtbot.waitSignal(ctl.reconfigured, timeout=TIMEOUT_MS):
        ctl.reconfigure(EngineOptions(sampling="host"))
    assert ctl.options == EngineOptions(sampling="host")
    load(qtbot, ctl, "tiny")  # the options chosen before are used
    assert made[0].options == EngineOptions(sampling="host") and ctl.options == EngineOptions(sampling="host")
    assert ctl.unavailable == {"cuda_graph": "needs CUDA"}
    with qtbot.waitSignal(ctl.reconfigureFailed, timeout=TIMEOUT_MS) as failed:
        ctl.reconfigure(replace(EngineOptions(), candidates=0))
    assert failed.args == ["candidates must be between 1 and 32, got 0"]
    assert ctl.options == EngineOptions(sampling="host")


def test_ladder_progress_and_rows(qtbot, scripted):
    ctl, _ = scripted
    with qtbot.waitSignal(ctl.ladderFailed, timeout=TIMEOUT_MS) as failed:
        ctl.run_ladder(MESSAGES, SamplingParams())
    assert failed.args == ["no model is loaded"]
    load(qtbot, ctl, "tiny")
    rec = Recorder(ctl)
    with qtbot.waitSignal(ctl.ladderFinished, timeout=TIMEOUT_MS) as done:
        ctl.run_ladder(MESSAGES, SamplingParams(), presets=["naive", "compile"])
    assert rec.of("ladderProgress") == [(0, 2, "naive"), (1, 2, "compile")]
    assert [r["preset"] for r in done.args[0]] == ["naive", "compile"]


def test_shutdown_closes_the_engine(qtbot):
    made = []

    def factory(source, options, progress):
        made.append(ScriptedEngine(source, options, progress))
        return made[-1]

    ctl = EngineController(EngineWorker(engine_factory=factory))
    load(qtbot, ctl, "tiny")
    made[0].gate = threading.Event()  # a generation that would wait forever without the stop
    ctl.generate(MESSAGES, SamplingParams(max_new_tokens=10_000))
    assert made[0].first_token.wait(30)
    made[0].gate.set()
    assert ctl.shutdown(30)
    assert made[0].closed
    with pytest.raises(RuntimeError, match="shut down"):
        ctl.generate(MESSAGES, SamplingParams())
