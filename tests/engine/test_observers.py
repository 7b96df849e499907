"""The decode loop's observers (engine.observers): what each is told, in which order, and what an observer can do
to a generation (fill a figure, stop it)."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.decode import StaticRunner
from engine.engine import Engine
from engine.generate import run_loop
from engine.observers import HostReader, LoopState, StepObserver, TextFlush, reader_for
from engine.sampling import SamplerKind
from engine.stream import RowText
from engine.types import EngineOptions, GenerationMetrics, RowFinished, SamplingParams, StepRecord, TextDelta

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = Engine.load(str(tiny_llama), EngineOptions(device="cpu"))
    try:
        yield eng
    finally:
        eng.close()


class Recorder(StepObserver):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.metrics: GenerationMetrics | None = None
        self.seen_at_finish = -1

    def on_start(self, run: LoopState) -> None:
        self.calls.append(("on_start", run.step))

    def before_step(self, run: LoopState) -> None:
        self.calls.append(("before_step", run.step))

    def after_step(self, run: LoopState) -> None:
        self.calls.append(("after_step", run.step))

    def on_step(self, run: LoopState) -> None:
        self.calls.append(("on_step", run.step))

    def on_finish(self, run: LoopState) -> None:
        self.calls.append(("on_finish", run.step))
        self.seen_at_finish = run.seen

    def fill(self, run: LoopState, metrics: GenerationMetrics) -> None:
        self.calls.append(("fill", run.step))
        self.metrics = metrics


def loop(engine: Engine, observers, max_new: int = 10, cancel: threading.Event | None = None, eos=()):
    """The loop on a fresh static runner of the engine's model, no EOS unless given: a greedy answer of max_new."""
    runner = StaticRunner(engine.model, 1, 64, list(eos), engine.device, torch.float32)
    runner.sampler.set_params(GREEDY)
    prompt = torch.tensor(engine.tokenizer("hello world, the quick brown fox")["input_ids"], dtype=torch.long)
    rows = [RowText(engine.tokenizer, set(eos), ())]
    kind = SamplerKind.of(GREEDY)
    observers = [o(runner) if callable(o) and not isinstance(o, StepObserver) else o for o in observers]
    return run_loop(runner, prompt, kind, max_new, rows, cancel or threading.Event(), observers)


def test_an_observer_is_told_every_step_in_order_and_sees_the_metrics(engine):
    rec = Recorder()
    result = loop(engine, [lambda r: reader_for(r, host_reads=False), rec])
    steps = range(1, 10)  # 10 tokens: the prefill's and nine decode steps'
    assert rec.calls == [
        ("on_start", 0),
        ("on_step", 0),
        *[(hook, s) for s in steps for hook in ("before_step", "after_step", "on_step")],
        ("on_finish", 9),
        ("fill", 9),
    ]
    assert rec.seen_at_finish == 10  # the reader, listed first, had read every token when the recorder was told
    assert rec.metrics is result.metrics
    assert rec.metrics.decode_steps == 9 and rec.metrics.new_tokens == [10]
    assert result.rows[0].finish == "length"


def test_the_host_reader_and_the_device_reader_give_the_same_answer(engine):
    device = loop(engine, [lambda r: reader_for(r, host_reads=False)]).rows[0]
    host = loop(engine, [HostReader()]).rows[0]
    assert len(host.tokens) == 10
    assert (host.tokens, host.text) == (device.tokens, device.text)


def test_a_loop_without_exactly_one_reader_is_refused(engine):
    with pytest.raises(ValueError, match="one reader of its tokens among its observers, got 0"):
        loop(engine, [Recorder()])
    with pytest.raises(ValueError, match="got 2"):
        loop(engine, [HostReader(), HostReader()])


def test_an_observer_that_cancels_stops_the_loop_before_the_next_step(engine):
    cancel = threading.Event()

    class CancelAtStep3(StepObserver):
        def on_step(self, run: LoopState) -> None:
            if run.step == 3:
                cancel.set()

    rec = Recorder()
    result = loop(engine, [HostReader(), CancelAtStep3(), rec], cancel=cancel)
    assert [s for hook, s in rec.calls if hook == "before_step"] == [1, 2, 3]
    assert result.rows[0].finish == "cancelled" and len(result.rows[0].tokens) == 4
    assert result.metrics.decode_steps == 3


def test_the_flush_streams_the_whole_answer_and_one_end_per_row(engine):
    events: list = []
    eos = loop(engine, [HostReader()]).rows[0].tokens[4]  # the fifth token ends the answer this time
    result = loop(engine, [HostReader(), TextFlush(events.append)], eos=[eos])
    row = result.rows[0]
    assert row.finish == "eos" and row.tokens[-1] == eos and len(row.tokens) <= 5
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == row.text
    assert [(e.candidate, e.reason) for e in events if isinstance(e, RowFinished)] == [(0, "eos")]
    records = [e for e in events if isinstance(e, StepRecord)]
    assert records[-1].step == result.metrics.decode_steps and records[-1].tokens_total == len(row.tokens)


def test_an_observer_fills_the_figure_it_measured(engine):
    class PeakMemoryByHand(StepObserver):
        def fill(self, run: LoopState, metrics: GenerationMetrics) -> None:
            metrics.put("peak_memory_bytes", 1234, "counted by hand in this test")

    m = loop(engine, [HostReader(), PeakMemoryByHand()]).metrics
    assert (m.peak_memory_bytes, m.peak_memory_source) == (1234, "counted by hand in this test")
    assert "peak_memory_bytes" not in m.unavailable
    assert m.unavailable["drafted_tokens"] == "speculation off"  # the loop's own: no speculator was given


def test_a_gpu_without_a_known_peak_keeps_the_monitors_reason_for_the_bandwidth_na():
    """The bandwidth estimate needs NVML's peak on a GPU; where there is none, the figure is n/a with the reason the
    monitor gave, not the name of the peak it lacked."""
    from types import SimpleNamespace

    from engine.observers import MonitorDrain

    class NoPeak:
        peak_dram_bw_bytes_s = None

        def summary(self, t0, t1):
            return {"dram_bw_util_pct": (None, "no NVML GPM on this GPU")}

    run = SimpleNamespace(t_start=0.0, t_end=1.0, device=torch.device("cuda"), durations_s=lambda: [0.001, 0.001])
    metrics = GenerationMetrics()
    MonitorDrain(NoPeak(), lambda _e: None).fill(run, metrics)
    assert metrics.dram_bw_util_pct is None and metrics.unavailable["dram_bw_util_pct"] == "no NVML GPM on this GPU"


def test_a_generation_s_first_sample_says_why_the_monitor_leaves_series_empty():
    """power_w, sm_clock_mhz, gpu_memory_used_bytes were null in every sample and every export with no reason:
    the monitor knew why."""
    from types import SimpleNamespace

    from engine.observers import MonitorDrain
    from engine.types import MonitorSample

    class Sampling:
        unavailable = {"power_w": "the model runs on the CPU, not on a GPU"}

        def __init__(self):
            self.t = 0.0

        def drain(self):
            self.t += 1.0
            return [MonitorSample(t=self.t, cpu_util_pct=50.0), MonitorSample(t=self.t + 0.5, cpu_util_pct=60.0)]

    seen: list = []
    drain = MonitorDrain(Sampling(), seen.append, interval_s=0.0)
    run = SimpleNamespace()
    for _ in range(2):  # two generations: each one's first sample says it
        drain.on_start(run)
        drain.emit(run, final=False)
        drain.emit(run, final=True)
    told = [s.unavailable for s in seen]
    assert told == [Sampling.unavailable, {}, {}, {}] * 2
    assert [s.cpu_util_pct for s in seen] == [50.0, 60.0] * 4


@pytest.mark.parametrize("batch", [1, 3])
def test_a_dynamic_cache_step_reads_the_kv_of_the_positions_it_attends_over(engine, batch):
    """The DRAM estimate asks for the bytes of a step halfway through the answer; the dynamic cache answered with
    the KV of the whole answer as it stood at the end, whatever the position."""
    from engine.decode import DynamicRunner

    runner = DynamicRunner(engine.model, batch, 64, [], engine.device)
    runner.sampler.set_params(GREEDY)
    prompt = torch.tensor(engine.tokenizer("hello world, the quick brown fox")["input_ids"], dtype=torch.long)
    rows = [RowText(engine.tokenizer, set(), ()) for _ in range(batch)]
    run_loop(runner, prompt, SamplerKind.of(GREEDY), 12, rows, threading.Event(), [HostReader()])
    a = engine.model.args
    per_position = 2 * a.n_layers * batch * a.n_kv_heads * a.head_dim * 4  # K and V, fp32
    weights = engine.model.weight_bytes()
    for pos in (prompt.numel(), prompt.numel() + 5, prompt.numel() + 10):
        assert runner.bytes_per_step(pos) == weights + per_position * (pos + 1)
