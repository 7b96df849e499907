"""The engine worker and its GUI-thread controller: signal order, batching, stop, failed loads, live option
changes and model switches while generating.

The behaviour tests run the real engine on a tiny random model. A scripted engine is used only where a test
needs what a real model cannot give on demand: a generation that pauses at a chosen token, a deliberate bug,
hundreds of tokens in a blink.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from worker_gate import on_first_batch

from app.worker import EngineController, EngineWorker, _Batcher
from engine.errors import ModelLoadError
from engine.protocol import option_limits
from engine.types import (
    EngineOptions,
    GenerationMetrics,
    GenerationResult,
    LadderRow,
    ModelInfo,
    MonitorSample,
    Progress,
    RowFinished,
    SamplingParams,
    StepRecord,
    TextDelta,
)

SIGNALS = (
    "loadStarted",
    "progress",
    "loaded",
    "loadFailed",
    "reconfigured",
    "reconfigureFailed",
    "generationStarted",
    "textBatch",
    "steps",
    "samples",
    "generationFinished",
    "generationFailed",
    "ladderProgress",
    "ladderFinished",
    "ladderFailed",
    "busyChanged",
)
STREAM = {"textBatch", "steps", "samples", "progress"}
TIMEOUT_MS = 120_000
MESSAGES = [{"role": "user", "content": "hello"}]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, seed=0)


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

    def result(self, request_id: int) -> GenerationResult:
        return dict(self.of("generationFinished"))[request_id]


def load(qtbot, ctl, source, options=None):
    with qtbot.waitSignal(ctl.loaded, timeout=TIMEOUT_MS):
        ctl.load(str(source), options)


def wait_finished(qtbot, ctl, request_id) -> GenerationResult:
    with qtbot.waitSignal(
        ctl.generationFinished, timeout=TIMEOUT_MS, check_params_cb=lambda rid, _r: rid == request_id
    ) as blocker:
        pass
    return blocker.args[1]


def generate(qtbot, ctl, sampling) -> tuple[int, GenerationResult]:
    box = {}
    with qtbot.waitSignal(
        ctl.generationFinished, timeout=TIMEOUT_MS, check_params_cb=lambda rid, _r: rid == box.get("rid")
    ) as blocker:
        box["rid"] = ctl.generate(MESSAGES, sampling)
    return box["rid"], blocker.args[1]


# ---- the real engine on a tiny model ------------------------------------------------------------------------


def test_signal_order_of_a_load_and_a_generation(qtbot, ctl, tiny_llama):
    rec = Recorder(ctl)
    with qtbot.waitSignals([ctl.loadStarted, ctl.loaded], order="strict", timeout=TIMEOUT_MS):
        ctl.load(str(tiny_llama), EngineOptions(device="cpu"))
    assert ctl.info.name == tiny_llama.name and ctl.info.backend == "fast"
    assert ctl.options == EngineOptions(device="cpu") and ctl.unavailable == {}
    # The limits are mirrored with the options and the info, before `loaded`.
    assert ctl.limits and ctl.limits == option_limits(ctl.worker.engine)
    qtbot.waitUntil(lambda: not ctl.busy, timeout=TIMEOUT_MS)
    rec.events.clear()
    box = {}
    with qtbot.waitSignals([ctl.generationStarted, ctl.generationFinished], order="strict", timeout=TIMEOUT_MS):
        box["rid"] = ctl.generate(MESSAGES, greedy(24))
    qtbot.waitUntil(lambda: not ctl.busy, timeout=TIMEOUT_MS)
    rid = box["rid"]
    seq = [n for n in rec.names() if n not in STREAM]
    assert seq == ["busyChanged", "generationStarted", "generationFinished", "busyChanged"]
    assert [a for (a,) in rec.of("busyChanged")] == [True, False]
    names = rec.names()
    first, last = names.index("generationStarted"), names.index("generationFinished")
    assert "textBatch" in names[first:last] and "steps" in names[first:last]
    assert all(n in STREAM for n in names[first + 1 : last])  # the stream lies between start and finish
    ((srid, started_options),) = rec.of("generationStarted")
    assert srid == rid and started_options == EngineOptions(device="cpu")
    result = rec.result(rid)
    assert result.finish_reasons == ["length"] and len(result.token_ids[0]) == 24
    assert rec.text(rid) == result.texts[0] != ""  # the batches add up to the answer, character for character
    assert all(rid_ == rid for rid_, _ in rec.of("steps"))
    assert result.options.kv_cache == "static" and result.metrics.new_tokens_total == 24


def test_cancel_keeps_the_partial_answer(qtbot, ctl, tiny_llama, monkeypatch):
    load(qtbot, ctl, tiny_llama)
    rec = Recorder(ctl)
    fired = on_first_batch(ctl, ctl.cancel, monkeypatch)
    rid, result = generate(qtbot, ctl, greedy(200))
    assert fired
    assert result.finish_reasons == ["cancelled"]
    assert 0 < len(result.token_ids[0]) < 200
    assert rec.text(rid) == result.texts[0] != ""
    # A new generation starts with a fresh stop flag.
    _, again = generate(qtbot, ctl, greedy(6))
    assert again.finish_reasons == ["length"] and len(again.token_ids[0]) == 6


def test_failed_load_keeps_the_previous_model(qtbot, ctl, tiny_llama, tmp_path):
    load(qtbot, ctl, tiny_llama)
    _, before = generate(qtbot, ctl, greedy(12))
    missing = tmp_path / "no-such-model"
    rec = Recorder(ctl)
    with qtbot.waitSignal(ctl.loadFailed, timeout=TIMEOUT_MS) as failed:
        ctl.load(str(missing))
    source, message = failed.args
    assert source == str(missing) and str(missing) in message
    assert "\n" not in message and not message.startswith("internal error")
    assert rec.names("loadStarted", "loaded", "loadFailed") == ["loadStarted", "loadFailed"]
    assert ctl.info.name == tiny_llama.name
    _, after = generate(qtbot, ctl, greedy(12))
    assert after.token_ids == before.token_ids and after.texts == before.texts


def test_reconfigure_between_generations(qtbot, ctl, tiny_llama):
    load(qtbot, ctl, tiny_llama)
    rec = Recorder(ctl)
    rid1, first = generate(qtbot, ctl, greedy(16))
    dynamic = EngineOptions(kv_cache="dynamic", sampling="host")
    with qtbot.waitSignal(ctl.reconfigured, timeout=TIMEOUT_MS) as done:
        ctl.reconfigure(dynamic)
    assert done.args[0] == dynamic and ctl.options == dynamic
    rid2, second = generate(qtbot, ctl, greedy(16))
    started = dict(rec.of("generationStarted"))
    assert started[rid1] == EngineOptions() and started[rid2] == dynamic
    assert (first.options.kv_cache, second.options.kv_cache) == ("static", "dynamic")
    assert (first.options.sampling, second.options.sampling) == ("device", "host")
    assert second.token_ids == first.token_ids  # greedy: the cache mode changes speed, not tokens


def test_drafting_turned_off_in_the_app_lets_the_draft_model_go(qtbot, ctl, tiny_llama):
    """Drafting turned off (or n-gram chosen) in the app kept the draft model and its cache of the chat in memory
    until the model was loaded again."""
    import gc
    import weakref

    load(qtbot, ctl, tiny_llama)
    drafting = EngineOptions(speculation="draft", draft_model=str(tiny_llama), draft_tokens=3)
    with qtbot.waitSignal(ctl.reconfigured, timeout=TIMEOUT_MS):
        ctl.reconfigure(drafting)
    engine = ctl.worker.engine
    (model,) = engine._draft_models.values()
    held = weakref.ref(model)
    del model
    with qtbot.waitSignal(ctl.reconfigured, timeout=TIMEOUT_MS):
        ctl.reconfigure(drafting.with_(speculation="ngram"))
    gc.collect()
    assert held() is None and engine._draft_models == {}


def test_reconfigure_while_generating_applies_after(qtbot, ctl, tiny_llama, monkeypatch):
    load(qtbot, ctl, tiny_llama)
    rec = Recorder(ctl)
    later = {}

    def change_and_resend():
        ctl.reconfigure(EngineOptions(kv_cache="none"))
        later["rid"] = ctl.generate(MESSAGES, greedy(4))

    on_first_batch(ctl, change_and_resend, monkeypatch)
    rid1, first = generate(qtbot, ctl, greedy(40))
    second = wait_finished(qtbot, ctl, later["rid"])
    assert first.finish_reasons == ["length"] and first.options.kv_cache == "static"  # the running one untouched
    assert second.options.kv_cache == "none"
    assert dict(rec.of("generationStarted"))[later["rid"]].kv_cache == "none"
    assert rec.names("generationFinished", "reconfigured", "generationStarted")[1:] == [
        "generationFinished",
        "reconfigured",
        "generationStarted",
        "generationFinished",
    ]
    assert second.token_ids[0] == first.token_ids[0][:4]


def test_load_while_generating_stops_it_then_loads(qtbot, ctl, tiny_llama, tiny_factory, monkeypatch):
    other = tiny_factory("qwen2")
    load(qtbot, ctl, tiny_llama)
    rec = Recorder(ctl)
    on_first_batch(ctl, lambda: ctl.load(str(other)), monkeypatch)
    with qtbot.waitSignal(ctl.loaded, timeout=TIMEOUT_MS):
        rid = ctl.generate(MESSAGES, greedy(200))
    assert rec.names("generationFinished", "loadStarted", "loaded") == ["generationFinished", "loadStarted", "loaded"]
    result = rec.result(rid)
    assert result.finish_reasons == ["cancelled"] and 0 < len(result.token_ids[0]) < 200
    assert rec.text(rid) == result.texts[0]
    assert ctl.info.family == "qwen2" and ctl.info.source == str(other)
    _, on_new = generate(qtbot, ctl, greedy(5))
    assert on_new.finish_reasons == ["length"] and len(on_new.token_ids[0]) == 5


class HeldDraftRead:
    """A model loaded with `plain` options, then `drafting` chosen: its draft model's read is held at its first
    weights until go is set."""

    def __init__(self, qtbot, ctl, tiny_llama, tmp_path, monkeypatch):
        from gguf_fixtures import hf_llama_to_gguf

        draft = hf_llama_to_gguf(tiny_llama, tmp_path / "draft.gguf")
        self.plain = EngineOptions(device="cpu")
        self.drafting = self.plain.with_(speculation="draft", draft_model=str(draft), draft_tokens=3)
        load(qtbot, ctl, tiny_llama, self.plain)
        qtbot.waitUntil(lambda: not ctl.busy, timeout=TIMEOUT_MS)
        self.first = ctl.worker.engine
        self.reading, self.go = threading.Event(), threading.Event()
        self.seen: list[str] = []
        forward = EngineWorker._on_progress

        def held_in_the_read(worker, p: Progress) -> None:
            self.seen.append(p.message)
            if p.stage == "dequantise" and not self.reading.is_set():  # the draft's weights: its read is under way
                self.reading.set()
                self.go.wait(60)
            forward(worker, p)

        monkeypatch.setattr(EngineWorker, "_on_progress", held_in_the_read)
        self.rec = Recorder(ctl)
        ctl.reconfigure(self.drafting)
        assert self.reading.wait(60)

    def said(self) -> list[tuple]:
        """The controller's signals but the streamed ones: a load's by its source, the others' first argument."""
        return [e[:2] if e[0] != "loaded" else (e[0], e[1].source) for e in self.rec.events if e[0] not in STREAM]


@pytest.mark.parametrize("then", ["options chosen again", "stop", "another model"])
def test_a_draft_model_read_stops_for_what_was_asked_after_it(qtbot, ctl, tiny_llama, tmp_path, monkeypatch, then):
    """Drafting turned on and then off (or Stop, or another model opened) while the draft model was read: the read
    went on to its end under the engine lock, and whatever was asked after it waited for the whole read."""
    held = HeldDraftRead(qtbot, ctl, tiny_llama, tmp_path, monkeypatch)
    plain, drafting, first, seen, rec = held.plain, held.drafting, held.first, held.seen, held.rec
    last = ctl.loaded if then == "another model" else ctl.reconfigured
    with qtbot.waitSignal(last, timeout=TIMEOUT_MS, check_params_cb=lambda *a: then == "stop" or a[0] != drafting):
        if then == "options chosen again":
            ctl.reconfigure(plain)
        elif then == "stop":
            ctl.cancel()
        else:
            ctl.load(str(tiny_llama), plain)
        held.go.set()
    qtbot.waitUntil(lambda: not ctl.busy, timeout=TIMEOUT_MS)
    assert not any(m.startswith("de-quantised") for m in seen) and "draft model ready" not in seen
    assert rec.of("reconfigureFailed") == [] and rec.of("loadFailed") == []
    assert first._draft_models == {} and first._draft_refused == {}  # nothing half-read kept, nothing refused
    engine = ctl.worker.engine
    # What the stopped read's options were to become is said only where they stay in force (Stop): a reply for
    # options already replaced showed them in the Optimizations panel just before the newer ones.
    applied = {"options chosen again": [("reconfigured", plain)], "stop": [("reconfigured", drafting)]}
    assert held.said() == [
        ("busyChanged", True),
        *applied.get(then, [("loadStarted", str(tiny_llama)), ("loaded", str(tiny_llama))]),
        ("busyChanged", False),
    ]
    if then == "another model":
        assert engine is not first and engine.options == plain and len(rec.of("loaded")) == 1
    else:
        assert rec.of("reconfigured")[-1][0] == (plain if then == "options chosen again" else drafting)
    assert engine.options == ctl.options and "speculation" not in ctl.unavailable
    with qtbot.waitSignal(ctl.reconfigured, timeout=TIMEOUT_MS):  # asked for again: read whole, and it drafts
        ctl.reconfigure(drafting)
    assert "speculation" not in ctl.unavailable and "draft model ready" in seen
    _, got = generate(qtbot, ctl, greedy(12))
    assert got.options.speculation == "draft" and got.metrics.drafted_tokens > 0


@pytest.mark.parametrize("then", ["options refused", "a model that cannot be read"])
def test_options_whose_draft_read_was_stopped_are_said_when_what_replaced_them_fails(
    qtbot, ctl, tiny_llama, tmp_path, monkeypatch, then
):
    """Options whose draft model's read stopped for newer ones are not said, as the newer ones' reply says what is
    in force; where that reply is a failure (the previous options or model stay), they are said just before it."""
    held = HeldDraftRead(qtbot, ctl, tiny_llama, tmp_path, monkeypatch)
    missing = str(tmp_path / "missing.gguf")
    failed = ctl.reconfigureFailed if then == "options refused" else ctl.loadFailed
    with qtbot.waitSignal(failed, timeout=TIMEOUT_MS):
        if then == "options refused":
            ctl.reconfigure(replace(held.plain, draft_tokens=-1))  # as a settings file could give them
        else:
            ctl.load(missing, held.plain)
        held.go.set()
    qtbot.waitUntil(lambda: not ctl.busy, timeout=TIMEOUT_MS)
    if then == "options refused":
        failure = [
            ("reconfigured", held.drafting),
            ("reconfigureFailed", "draft_tokens must be between 1 and 15 (0 = adaptive), got -1"),
        ]
    else:
        failure = [("loadStarted", missing), ("reconfigured", held.drafting), ("loadFailed", missing)]
    assert held.said() == [("busyChanged", True), *failure, ("busyChanged", False)]
    assert ctl.worker.engine is held.first and ctl.options == held.first.options == held.drafting


# ---- a scripted engine: a generation that pauses where the test says ------------------------------------------


class ScriptedEngine:
    def __init__(self, source, options, progress=None):
        if source.startswith("missing"):
            raise ModelLoadError(f"model not found: {source}")
        if source == "broken":
            raise RuntimeError("tensor shapes\nwent sideways")
        if progress:
            progress(Progress("load", 0.0, "reading"))
            progress(Progress("load", 1.0, "loaded"))
        self.info = ModelInfo(
            source, "llama", "LlamaForCausalLM", "fast", 1000, "fp32", "cpu", 128, 4000, source, "hf-folder"
        )
        self.options = options.validate()
        self.fail_with = None
        self.gate: threading.Event | None = None  # when given, the generation waits after its first token
        self.first_token = threading.Event()
        self.closed = False

    def unavailable(self, options=None):
        return {"cuda_graph": "needs CUDA"}

    def reconfigure(self, options, progress=None, cancelled=None):
        self.options = options.validate()

    def measure_prompt(self, messages, max_new_tokens, overflow="rolling"):
        from engine.errors import GenerationError

        raise GenerationError("the scripted engine has no tokenizer to count with")

    def generate(self, messages, sampling, on_event=None, cancel=None, raw=False, overflow="rolling"):
        if self.fail_with:
            raise self.fail_with
        text, reason = "", "length"
        for i in range(sampling.max_new_tokens):
            if cancel is not None and cancel.is_set():
                reason = "cancelled"
                break
            time.sleep(0.0005)
            piece = f"t{i} "
            text += piece
            on_event(TextDelta(0, piece))
            on_event(StepRecord(time.perf_counter(), i + 1, i + 1, 0.5))
            if i % 10 == 0:
                on_event(MonitorSample(time.perf_counter(), cpu_util_pct=50.0, sources={"cpu_util_pct": "test"}))
            if i == 0:
                self.first_token.set()
                if self.gate is not None:
                    self.gate.wait(30)
        n = len(text.split())
        metrics = GenerationMetrics(prompt_tokens=3, new_tokens=[n], new_tokens_total=n)
        return GenerationResult([text], [list(range(n))], [reason], metrics, self.options, {}, sampling.seed)

    def close(self):
        self.closed = True


def scripted_ladder(engine, messages, sampling, presets=None, on_progress=None, cancel=None):
    names = presets or ["naive", "first-fixes"]
    rows = []
    for i, name in enumerate(names):
        on_progress(i, len(names), name)
        rows.append(LadderRow(name, name, "ok", engine.options.to_dict()))
    return rows


def test_the_scripted_engine_is_what_the_app_needs():
    from engine.protocol import EngineLike

    assert isinstance(ScriptedEngine("m", EngineOptions()), EngineLike)


@pytest.fixture
def scripted(qtbot):
    made: list[ScriptedEngine] = []

    def factory(source, options, progress):
        made.append(ScriptedEngine(source, options, progress))
        return made[-1]

    controller = EngineController(EngineWorker(engine_factory=factory, ladder_runner=scripted_ladder))
    yield controller, made
    assert controller.shutdown(30)


def test_text_is_batched_and_whole(qtbot, scripted):
    ctl, _ = scripted
    load(qtbot, ctl, "tiny")
    rec = Recorder(ctl)
    rid, result = generate(qtbot, ctl, SamplingParams(max_new_tokens=300))
    assert rec.text(rid) == result.texts[0] == "".join(f"t{i} " for i in range(300))
    assert 1 <= len(rec.of("textBatch")) < 300  # 300 tokens arrive in far fewer batches
    assert sum(len(s) for _, s in rec.of("steps")) == 300
    assert sum(len(s) for (s,) in rec.of("samples")) == 30
    names = rec.names()
    assert names.index("generationFinished") > max(i for i, n in enumerate(names) if n in STREAM)


def test_a_candidates_end_flushes_at_once_and_text_waits_for_the_interval():
    b = _Batcher(interval_s=3600.0)
    b.take()  # just flushed: the next interval is an hour away
    assert not b.add(TextDelta(candidate=0, text="a"))
    assert b.add(RowFinished(candidate=0, reason="stop"))  # shown when it happens, with the text before it
    assert b.take()[0] == {0: "a"} and b.take_ended() == {0: "stop"}
    assert not b.add(TextDelta(candidate=1, text="b")) and b.take_ended() == {}


def test_errors_become_one_line_messages(qtbot, scripted):
    ctl, made = scripted
    with qtbot.waitSignal(ctl.generationFailed, timeout=TIMEOUT_MS) as failed:
        ctl.generate(MESSAGES, SamplingParams())
    assert failed.args[1] == "no model is loaded"
    load(qtbot, ctl, "tiny")
    made[0].fail_with = ValueError("bad\nthing")
    with qtbot.waitSignal(ctl.generationFailed, timeout=TIMEOUT_MS) as failed:
        ctl.generate(MESSAGES, SamplingParams())
    assert failed.args[1] == "internal error: ValueError: bad thing"
    with qtbot.waitSignal(ctl.loadFailed, timeout=TIMEOUT_MS) as failed:
        ctl.load("broken")
    assert failed.args == ["broken", "internal error: RuntimeError: tensor shapes went sideways"]
    with qtbot.waitSignal(ctl.loadFailed, timeout=TIMEOUT_MS) as failed:
        ctl.load("missing-x")
    assert failed.args == ["missing-x", "model not found: missing-x"]
    made[0].fail_with = None
    options = made[0].options
    del made[0].options  # a fault outside the engine call itself still answers the request
    with qtbot.waitSignal(ctl.generationFailed, timeout=TIMEOUT_MS) as failed:
        ctl.generate(MESSAGES, SamplingParams())
    assert failed.args[1].startswith("internal error: AttributeError:")
    made[0].options = options
    _, result = generate(qtbot, ctl, SamplingParams(max_new_tokens=2))  # the worker and the engine still work
    assert result.texts == ["t0 t1 "] and ctl.info.name == "tiny"


def test_stop_reaches_queued_generations_and_busy_spans_the_queue(qtbot, scripted):
    ctl, made = scripted
    rec = Recorder(ctl)
    load(qtbot, ctl, "tiny")
    qtbot.waitUntil(lambda: not ctl.busy, timeout=TIMEOUT_MS)  # busyChanged(False) follows loaded
    assert rec.of("busyChanged") == [(True,), (False,)]
    made[0].gate = threading.Event()
    rid1 = ctl.generate(MESSAGES, SamplingParams(max_new_tokens=50))
    rid2 = ctl.generate(MESSAGES, SamplingParams(max_new_tokens=50))
    assert made[0].first_token.wait(30)
    ctl.cancel()
    made[0].gate.set()
    wait_finished(qtbot, ctl, rid2)
    assert rec.result(rid1).finish_reasons == ["cancelled"] and rec.result(rid1).texts == ["t0 "]
    assert rec.result(rid2).finish_reasons == ["cancelled"] and rec.result(rid2).texts == [""]
    qtbot.waitUntil(lambda: not ctl.busy, timeout=TIMEOUT_MS)
    assert rec.of("busyChanged") == [(True,), (False,), (True,), (False,)]  # one busy span for both


def test_options_chosen_one_by_one_during_an_answer_apply_once_after_it(qtbot, scripted, monkeypatch):
    """Six changes made while an answer ran were each applied after it (one of them quantising to int8), and the
    next answer waited for all of them: only the last choice is applied."""
    ctl, made = scripted
    load(qtbot, ctl, "tiny")
    applied: list[EngineOptions] = []
    monkeypatch.setattr(ScriptedEngine, "reconfigure", lambda self, o, progress=None, cancelled=None: applied.append(o))
    rec = Recorder(ctl)
    made[0].gate = threading.Event()
    rid = ctl.generate(MESSAGES, SamplingParams(max_new_tokens=5))
    assert made[0].first_token.wait(30)
    chosen = [EngineOptions(dtype=d) for d in ("fp16", "bf16", "fp32")]
    for options in chosen:
        ctl.reconfigure(options)
    made[0].gate.set()
    wait_finished(qtbot, ctl, rid)
    qtbot.waitUntil(lambda: not ctl.busy, timeout=TIMEOUT_MS)
    assert applied == [chosen[-1]] and len(rec.of("reconfigured")) == 1


def test_options_chosen_before_a_model_and_invalid_options(qtbot, scripted):
    ctl, made = scripted
    with qtbot.waitSignal(ctl.reconfigured, timeout=TIMEOUT_MS):
        ctl.reconfigure(EngineOptions(sampling="host"))
    assert ctl.options == EngineOptions(sampling="host")
    load(qtbot, ctl, "tiny")
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
    assert [r.preset for r in done.args[0]] == ["naive", "compile"]


def test_a_controller_made_outside_the_app_runs_no_collection_on_the_worker(qtbot):
    """A collection frees every unreachable cycle on the thread that runs it, and Qt crashes when its objects are
    freed off their thread. The app's build hands the passes to the GUI thread; a controller made without it (a
    tool, these tests) does so itself until it shuts down: the full pass a closed model asks for (engine.heap)
    frees this thread's Qt objects here, not on the worker."""
    import gc

    from PySide6.QtCore import QObject, Qt

    from engine import heap

    class Releasing(ScriptedEngine):
        def close(self):
            super().close()
            heap.release()  # what a real engine's close runs: a full pass for its model's cycles

    enabled = gc.isenabled()
    ctl = EngineController(EngineWorker(engine_factory=Releasing))
    freed: list[str] = []
    try:
        load(qtbot, ctl, "first")

        def left_behind() -> None:  # a QObject only the collector frees: a closed dialog's, a plot's
            obj = QObject()
            obj.cycle = obj
            obj.destroyed.connect(
                lambda *_: freed.append(threading.current_thread().name), Qt.ConnectionType.DirectConnection
            )

        left_behind()
        load(qtbot, ctl, "second")  # the worker closes the first model
        qtbot.waitUntil(lambda: bool(freed), timeout=TIMEOUT_MS)
        assert freed == [threading.main_thread().name]
    finally:
        assert ctl.shutdown(30)
    assert gc.isenabled() == enabled  # handed back as the controller shut down


def test_shutdown_stops_the_generation_and_closes_the_engine(qtbot):
    made = []

    def factory(source, options, progress):
        made.append(ScriptedEngine(source, options, progress))
        return made[-1]

    ctl = EngineController(EngineWorker(engine_factory=factory))
    load(qtbot, ctl, "tiny")
    ctl.generate(MESSAGES, SamplingParams(max_new_tokens=1_000_000))
    assert made[0].first_token.wait(30)
    assert ctl.shutdown(30)
    assert made[0].closed
    with pytest.raises(RuntimeError, match="shut down"):
        ctl.generate(MESSAGES, SamplingParams())


def test_signal_emits_keep_the_interpreter_whole():
    """PySide6 6.12.0 on CPython 3.11 drops a reference to True on every emit, and the interpreter aborts after a
    few hundred; pyproject.toml pins PySide6 below 6.12 for that. This test fails on such a release: the pin can
    go once a newer release passes it."""
    import sys

    from PySide6.QtCore import QObject, Signal

    class Talker(QObject):
        said = Signal(object)

    talker, heard = Talker(), []
    talker.said.connect(heard.append)
    before = sys.getrefcount(True)
    for i in range(2000):
        talker.said.emit(i)
    assert len(heard) == 2000
    assert abs(sys.getrefcount(True) - before) < 100


def test_the_controller_passes_on_every_worker_event_once(qtbot, ctl):
    """The events are declared once (EngineEvents); each one the worker emits reaches the GUI under its name."""
    from app.worker import EVENT_NAMES

    args = {
        "loadStarted": ("m",),
        "progress": (None,),
        "loaded": (None, {}),
        "loadFailed": ("m", "bad"),
        "reconfigured": (EngineOptions(), {}),
        "reconfigureFailed": ("bad",),
        "generationStarted": (7, None),
        "textBatch": (7, {0: "x"}),
        "rowsFinished": (7, {0: "eos"}),
        "steps": (7, []),
        "samples": ([],),
        "generationFinished": (7, None),
        "generationFailed": (8, "bad"),
        "ladderProgress": (1, 2, "x"),
        "ladderFinished": ([],),
        "ladderFailed": ("bad",),
        "busyChanged": (False,),
    }
    assert set(EVENT_NAMES) == set(args)
    heard: list[str] = []
    for name in EVENT_NAMES:
        getattr(ctl, name).connect(lambda *_, name=name: heard.append(name))
    for name in EVENT_NAMES:
        getattr(ctl.worker, name).emit(*args[name])
    qtbot.waitUntil(lambda: len(heard) >= len(EVENT_NAMES), timeout=5000)
    assert sorted(heard) == sorted(EVENT_NAMES)


def test_ladder_on_the_real_engine_gives_rows_and_keeps_the_options(qtbot, ctl, tiny_llama):
    """The app's Run ladder through the worker and engine.bench.run_ladder, end to end."""
    opts = EngineOptions(device="cpu", kv_cache="none")
    load(qtbot, ctl, tiny_llama, opts)
    qtbot.waitUntil(lambda: not ctl.busy, timeout=TIMEOUT_MS)
    rec = Recorder(ctl)
    with qtbot.waitSignal(ctl.ladderFinished, timeout=TIMEOUT_MS) as done:
        ctl.run_ladder(MESSAGES, greedy(6), presets=["naive", "first-fixes"])
    rows = done.args[0]
    assert [r.preset for r in rows] == ["naive", "first-fixes"]
    assert all(r.skipped is None and (r.decode_tok_s or 0) > 0 for r in rows)
    progress = rec.of("ladderProgress")
    assert progress and progress[-1][0] == progress[-1][1]
    qtbot.waitUntil(lambda: not ctl.busy, timeout=TIMEOUT_MS)
    rid, result = generate(qtbot, ctl, greedy(4))
    assert result.options.kv_cache == "none"


QUIT_WHILE_LOADING = r"""
import os, sys, time
os.environ["QT_QPA_PLATFORM"] = "offscreen"
sys.path.insert(0, sys.argv[1])
from engine.engine import Engine
marker = sys.argv[4]
def stuck_load(cls, *a, **k):  # a load that cannot be interrupted
    open(marker, "w").close()
    time.sleep(600)
Engine.load = classmethod(stuck_load)
from app.gui import build, leave, qt_application
from app.paths import AppPaths
from PySide6.QtCore import QCoreApplication
app = qt_application()
gui = build(AppPaths.resolve(sys.argv[2]), "light")
gui.window.load_model(sys.argv[3])
deadline = time.monotonic() + 60
while not os.path.exists(marker) and time.monotonic() < deadline:  # until the worker is inside the load
    QCoreApplication.processEvents(); time.sleep(0.01)
stopped = gui.close(timeout=0.5)
print("stopped" if stopped else "busy", flush=True)
sys.exit(leave(0, stopped))
"""


def test_quitting_during_a_load_that_cannot_be_interrupted_exits_cleanly(tmp_path, tiny_llama):
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    t0 = time.perf_counter()
    marker = tmp_path / "inside-the-load"
    proc = subprocess.run(
        [sys.executable, "-c", QUIT_WHILE_LOADING, str(root), str(tmp_path / "data"), str(tiny_llama), str(marker)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert marker.exists()
    assert proc.stdout.strip() == "busy"  # the worker was still in the load
    assert proc.returncode == 0, proc.stderr[-2000:]  # not Qt's abort on a running thread (134)
    assert time.perf_counter() - t0 < 300  # and without waiting for the load (600 s)
    assert (tmp_path / "data").exists()


def test_a_call_its_caller_gave_up_on_is_skipped_and_one_begun_is_run(qtbot, scripted):
    """The app's server gives up on a request still waiting for the worker when it stops (and answers it 503): the
    worker must not run it after. One the worker took first runs, and its caller waits for it."""
    from app.worker import Call

    ctl, _ = scripted
    ran: list[str] = []
    given_up = Call(lambda _e: ran.append("given up"), threading.Event())
    assert given_up.claim.take("caller")
    taken = Call(lambda _e: ran.append("taken"), threading.Event())
    ctl.worker.commands.put(given_up)
    ctl.worker.commands.put(taken)
    assert given_up.done.wait(30) and taken.done.wait(30)
    assert ran == ["taken"] and not taken.claim.take("caller")  # too late to give it up
