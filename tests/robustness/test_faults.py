"""Faults while a generation runs, on the real engine with a tiny model: stop in the middle of the stream,
options or the model switched underneath, NVML lost mid-run. Each is compared token for token with the same
generation left alone."""

from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from fake_nvml import FakeNVMLError, NVMLConstants
from worker_gate import on_first_batch

from engine.engine import Engine
from engine.telemetry.monitor import Monitor
from engine.types import EngineOptions, MonitorSample, SamplingParams, TextDelta

CPU = EngineOptions(device="cpu")
MESSAGES = [{"role": "user", "content": "hello world, the quick brown fox"}]
TIMEOUT_MS = 120_000


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, seed=0)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = Engine.load(str(tiny_llama), CPU)
    yield eng
    eng.close()


# ---- stop in the middle of the token stream ------------------------------------------------------------------


def cancel_on_first_text(engine, sampling):
    cancel = threading.Event()
    deltas: list[TextDelta] = []

    def on_event(e):
        if isinstance(e, TextDelta):
            deltas.append(e)
            cancel.set()

    result = engine.generate(MESSAGES, sampling, on_event, cancel)
    return result, deltas


@pytest.mark.parametrize("candidates", [1, 3])
@pytest.mark.parametrize("sampling", ["device", "host"])
@pytest.mark.parametrize("kv", ["static", "dynamic", "none"])
def test_stop_after_the_first_text_keeps_an_exact_prefix(engine, kv, sampling, candidates, monkeypatch):
    import engine.observers as loop_module

    engine.reconfigure(CPU.with_(kv_cache=kv, sampling=sampling, candidates=candidates))
    full = engine.generate(MESSAGES, greedy(200))
    # Text leaves after every step, so the stop lands a few tokens in however fast this machine decodes.
    monkeypatch.setattr(loop_module, "FLUSH_INTERVAL_S", 0.0)
    assert full.finish_reasons == ["length"] * candidates, "the reference must run to its budget"
    stopped, deltas = cancel_on_first_text(engine, greedy(200))
    assert stopped.finish_reasons == ["cancelled"] * candidates
    for row, (ids, text) in enumerate(zip(stopped.token_ids, stopped.texts)):
        assert 1 <= len(ids) < 200
        assert ids == full.token_ids[row][: len(ids)]
        assert full.texts[row].startswith(text)
        assert "".join(d.text for d in deltas if d.candidate == row) == text
    assert stopped.metrics.new_tokens == [len(ids) for ids in stopped.token_ids]
    engine.reconfigure(CPU)


def test_stop_before_the_generation_begins_reads_nothing_and_writes_no_token(engine):
    """Stop pressed while the generation waited for the worker: it read the prompt and wrote its first token
    anyway, which the app kept as a new version of the answer (a regenerate stopped at once)."""
    engine.reconfigure(CPU)
    full = engine.generate(MESSAGES, greedy(20))
    cancel = threading.Event()
    cancel.set()  # stop pressed before the worker reached this generation
    result = engine.generate(MESSAGES, greedy(20), cancel=cancel)
    assert result.finish_reasons == ["cancelled"] and result.token_ids == [[]] and result.texts == [""]
    assert engine.generate(MESSAGES, greedy(20)).token_ids == full.token_ids  # and it answers as before


# ---- options switched from another thread while generating ---------------------------------------------------


def test_reconfigure_from_another_thread_waits_for_the_running_generation(engine):
    engine.reconfigure(CPU)
    reference = engine.generate(MESSAGES, greedy(120))
    switched = threading.Event()
    seen_switched: list[bool] = []
    other: list[threading.Thread] = []
    new = CPU.with_(kv_cache="dynamic", dtype="bf16", candidates=2)  # bf16 re-places every weight

    def switch():
        engine.reconfigure(new)
        switched.set()

    def on_event(e):
        if isinstance(e, TextDelta) and not other:
            other.append(threading.Thread(target=switch, name="switcher"))
            other[0].start()
            other[0].join(0.3)  # give the switch every chance to get in while this generation runs
        seen_switched.append(switched.is_set())

    running = engine.generate(MESSAGES, greedy(120), on_event=on_event)
    other[0].join(60)
    assert switched.is_set() and not other[0].is_alive()
    assert seen_switched and not any(seen_switched), "the switch happened while the generation was running"
    assert running.token_ids == reference.token_ids and running.texts == reference.texts
    assert (running.options.kv_cache, running.options.dtype, running.options.candidates) == ("static", "fp32", 1)
    after = engine.generate(MESSAGES, greedy(8))
    assert (after.options.kv_cache, after.options.dtype, after.options.candidates) == ("dynamic", "bf16", 2)
    assert engine.info.dtype == "bf16"
    engine.reconfigure(CPU)


# ---- the model switched while generating, through the app's controller ----------------------------------------


def generate_and_wait(qtbot, ctl, sampling):
    """Start a generation and wait for its result."""
    box: dict = {}
    with qtbot.waitSignal(
        ctl.generationFinished, timeout=TIMEOUT_MS, check_params_cb=lambda rid, _r: rid == box.get("rid")
    ) as blocker:
        box["rid"] = ctl.generate(MESSAGES, sampling)
    return blocker.args[1]


def test_switch_to_a_broken_model_while_generating_keeps_the_old_one(qtbot, ctl, tiny_llama, tmp_path, monkeypatch):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    with qtbot.waitSignal(ctl.loaded, timeout=TIMEOUT_MS):
        ctl.load(str(tiny_llama), CPU)
    reference = generate_and_wait(qtbot, ctl, greedy(200))
    failures: list[tuple] = []
    ctl.loadFailed.connect(lambda source, message: failures.append((source, message)))

    fired = on_first_batch(ctl, lambda: ctl.load(str(broken)), monkeypatch)
    with qtbot.waitSignal(ctl.loadFailed, timeout=TIMEOUT_MS):
        stopped = generate_and_wait(qtbot, ctl, greedy(200))
    assert fired
    assert stopped.finish_reasons == ["cancelled"]
    assert 1 <= len(stopped.token_ids[0]) < 200
    assert stopped.token_ids[0] == reference.token_ids[0][: len(stopped.token_ids[0])]
    [(source, message)] = failures
    assert source == str(broken) and "config.json" in message and "\n" not in message
    assert ctl.info.source == str(tiny_llama)
    again = generate_and_wait(qtbot, ctl, greedy(200))
    assert again.token_ids == reference.token_ids  # the previous model is whole and in use


# ---- NVML lost during a real generation -------------------------------------------------------------------


class LosableNVML(NVMLConstants):
    """The NVML calls the monitor makes, answering until `lost` is set, then failing as a fallen-off GPU does
    (NVML_ERROR_GPU_IS_LOST). Utilization samples and GPM are not supported, as on many consumer cards."""

    def __init__(self):
        self.lost = threading.Event()
        self.failed_calls = 0

    def _answer(self, value):
        if self.lost.is_set():
            self.failed_calls += 1
            raise FakeNVMLError(15)
        return value

    def nvmlInit(self):
        return None

    def nvmlShutdown(self):
        return None

    def nvmlDeviceGetHandleByIndex(self, i):
        return self._answer(("gpu", i))

    def nvmlGpmQueryDeviceSupport(self, h):
        return self._answer(SimpleNamespace(isSupportedDevice=0))

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        return self._answer(2619)

    def nvmlDeviceGetMemoryBusWidth(self, h):
        return self._answer(5120)

    def nvmlDeviceGetSamples(self, h, kind, last_ts):
        raise FakeNVMLError(3)

    def nvmlDeviceGetUtilizationRates(self, h):
        return self._answer(SimpleNamespace(gpu=55, memory=20))

    def nvmlDeviceGetMemoryInfo(self, h):
        return self._answer(SimpleNamespace(used=3 << 30, total=24 << 30, free=21 << 30))

    def nvmlDeviceGetPowerUsage(self, h):
        return self._answer(90_000)

    def nvmlDeviceGetClockInfo(self, h, kind):
        return self._answer(1800)


@pytest.fixture
def nvml_engine(tiny_llama):
    """An engine whose monitor reads a GPU through `nvml` (the model itself runs on the CPU)."""
    eng = Engine.load(str(tiny_llama), CPU.with_(kv_cache="none"))
    nvml = LosableNVML()
    eng.monitor.close()
    eng.monitor = Monitor(torch.device("cuda", 0), interval_s=0.005, nvml=nvml)
    eng.monitor.start()
    yield eng, nvml
    eng.close()


def wait_for_gpu_sample(monitor: Monitor) -> None:
    deadline = time.monotonic() + 30
    while not any(s.gpu_util_pct is not None for s in monitor.history()):
        assert time.monotonic() < deadline, "the monitor never read the GPU"
        time.sleep(0.01)


@pytest.fixture
def sampled_nvml_engine(engine, nvml_engine):
    """nvml_engine once its monitor has read the GPU, with the answer it must keep giving (read on `engine`)."""
    eng, nvml = nvml_engine
    engine.reconfigure(CPU.with_(kv_cache="none"))
    reference = engine.generate(MESSAGES, greedy(150))
    engine.reconfigure(CPU)
    wait_for_gpu_sample(eng.monitor)
    return eng, nvml, reference


def test_nvml_lost_in_the_middle_of_a_generation(sampled_nvml_engine):
    eng, nvml, reference = sampled_nvml_engine
    samples: list[MonitorSample] = []

    def on_event(e):
        if isinstance(e, MonitorSample):
            samples.append(e)
        elif isinstance(e, TextDelta) and not nvml.lost.is_set():
            nvml.lost.set()
            # hold this generation until the monitor has met the lost GPU, so the failure falls inside it
            deadline = time.monotonic() + 30
            while "gpu_util_pct" not in eng.monitor.unavailable and time.monotonic() < deadline:
                time.sleep(0.005)

    result = eng.generate(MESSAGES, greedy(150), on_event=on_event)
    assert result.token_ids == reference.token_ids and result.finish_reasons == ["length"]
    assert nvml.lost.is_set() and nvml.failed_calls > 0
    assert eng.monitor.unavailable["gpu_util_pct"] == "nvmlDeviceGetUtilizationRates failed: GPU is lost"
    assert eng.monitor.unavailable["power_w"] == "nvmlDeviceGetPowerUsage failed: GPU is lost"
    assert eng.monitor._thread.is_alive(), "the monitor goes on with the figures it still has"
    last = samples[-1]
    assert last.gpu_util_pct is None and last.power_w is None and last.gpu_memory_used_bytes is None
    assert last.process_rss_bytes is not None and last.cpu_util_pct is not None
    # A figure measured over part of the generation keeps its source, and says how much it covers and why it
    # stopped; none is invented for the rest.
    m = result.metrics
    assert m.gpu_util_pct in (None, 55.0)
    if m.gpu_util_pct is None:
        assert m.unavailable["gpu_util_pct"] == "nvmlDeviceGetUtilizationRates failed: GPU is lost"
    else:
        assert re.fullmatch(
            r"GPU util — NVML utilization rates \(the first \d+ % of the interval only; then "
            r"nvmlDeviceGetUtilizationRates failed: GPU is lost\)",
            m.gpu_util_source,
        ), m.gpu_util_source


def test_nvml_lost_before_a_generation_gives_na_with_the_reason(sampled_nvml_engine):
    eng, nvml, reference = sampled_nvml_engine
    nvml.lost.set()
    deadline = time.monotonic() + 30
    while "gpu_util_pct" not in eng.monitor.unavailable:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    result = eng.generate(MESSAGES, greedy(150))
    assert result.token_ids == reference.token_ids
    m = result.metrics
    assert m.gpu_util_pct is None and m.gpu_util_source is None
    assert m.unavailable["gpu_util_pct"] == "nvmlDeviceGetUtilizationRates failed: GPU is lost"
    assert m.sm_activity_pct is None and m.unavailable["sm_activity_pct"] == "GPM not supported on this GPU"
    again = eng.generate(MESSAGES, greedy(10))  # and the engine keeps going
    assert again.token_ids[0] == reference.token_ids[0][:10]


# ---- two engines in one process profile at once ---------------------------------------------------------------


def test_two_profile_windows_at_once_one_skips_and_nothing_crashes():
    """The torch profiler is one per process, and its busy flag is per thread: two engines' windows opened from
    two threads both used to start, and kineto crashed the process when they stopped."""
    from engine.telemetry.window import ProfileWindow

    barrier = threading.Barrier(2, timeout=30)
    windows = [ProfileWindow(torch.device("cpu"), start=0, steps=1) for _ in range(2)]
    started: list[bool] = []

    def run(w: ProfileWindow) -> None:
        barrier.wait()
        w.step_begin(0)
        started.append(w._prof is not None)
        barrier.wait()  # both have tried before either stops
        torch.ones(64, 64) @ torch.ones(64, 64)
        w.step_end(0)
        w.finish()

    threads = [threading.Thread(target=run, args=(w,)) for w in windows]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(started) == [False, True]
    again = ProfileWindow(torch.device("cpu"), start=0, steps=1)  # the profiler is free again afterwards
    again.step_begin(0)
    torch.ones(64, 64) @ torch.ones(64, 64)
    again.step_end(0)
    stats = again.finish()
    assert stats is not None and stats.events > 0


# ---- a generation failing inside the profiled window ------------------------------------------------------------


def failing_step(monkeypatch, at: int, error: BaseException, times: int = 1):
    from engine.decode import StaticRunner

    real = StaticRunner.step
    left = [times]

    def step(self, i):
        if i == at and left[0] > 0:
            left[0] -= 1
            raise error
        return real(self, i)

    monkeypatch.setattr(StaticRunner, "step", step)


def test_a_fault_inside_the_profiled_window_leaves_later_generations_profiled(engine, monkeypatch):
    from engine.telemetry.window import profiler_busy

    engine.reconfigure(CPU)
    reference = engine.generate(MESSAGES, greedy(30))
    assert reference.metrics.kernel_gap_pct is not None, "steps 8-15 are traced on every generation"
    failing_step(monkeypatch, at=10, error=RuntimeError("device fault (simulated)"))
    with pytest.raises(RuntimeError, match="simulated"):
        engine.generate(MESSAGES, greedy(30))
    assert not profiler_busy()
    after = engine.generate(MESSAGES, greedy(30))
    assert after.token_ids == reference.token_ids
    assert after.metrics.kernel_gap_pct is not None and after.metrics.kernel_gap_source.startswith("op gap")


def test_out_of_memory_inside_the_window_retries_with_a_profiled_window(engine, monkeypatch):
    import engine.observers as loop_module

    engine.reconfigure(CPU.with_(candidates=2))
    reference = engine.generate(MESSAGES, greedy(30))
    # The engine retries smaller only while no text has left; hold the text back so this does not depend on
    # how fast the first ten steps run on a busy machine.
    monkeypatch.setattr(loop_module, "FLUSH_INTERVAL_S", 3600.0)
    failing_step(monkeypatch, at=10, error=torch.OutOfMemoryError("out of memory (simulated)"))
    result = engine.generate(MESSAGES, greedy(30))
    assert result.options.candidates == 1
    assert "out of device memory with 2 candidates: ran 1" in result.notices
    assert result.token_ids == reference.token_ids[:1]
    assert result.metrics.kernel_gap_pct is not None
    engine.reconfigure(CPU)


# ---- out of device memory at CUDA-graph capture (the GPU-only fault, injected) ---------------------------------


def test_out_of_memory_at_graph_capture_drops_the_graph_then_candidates(engine, monkeypatch):
    """On a GPU the capture allocates the graph's memory pool; running out there must drop the graph first, then
    halve the candidates. Here the effective options keep cuda_graph as a CUDA machine's would, and the run
    raises torch.OutOfMemoryError wherever that configuration would not fit."""
    from dataclasses import replace

    engine.reconfigure(CPU.with_(candidates=4))
    reference = engine.generate(MESSAGES, greedy(12))
    real_effective, real_run = Engine.effective, Engine._run
    attempts: list[tuple[bool, int]] = []

    def effective_on_cuda(self, options):
        eff, reasons = real_effective(self, options)
        reasons.pop("cuda_graph", None)
        return replace(eff, cuda_graph=True), reasons

    def run(self, prompt_ids, max_new, sampling, opts, *rest):
        attempts.append((opts.cuda_graph, opts.candidates))
        if opts.cuda_graph or opts.candidates > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_run(self, prompt_ids, max_new, sampling, opts, *rest)

    monkeypatch.setattr(Engine, "effective", effective_on_cuda)
    monkeypatch.setattr(Engine, "_run", run)
    result = engine.generate(MESSAGES, greedy(12))
    assert attempts == [(True, 4), (False, 4), (False, 2)]
    assert result.notices == [
        "out of device memory with the CUDA graph on: ran without it",
        "out of device memory with 4 candidates: ran 2",
        "the 2 candidates are one answer 2 times: greedy decoding (temperature 0) picks the same tokens in every "
        "row; raise the temperature for different ones",  # as many as ran
    ]
    assert result.unavailable["cuda_graph"] == "ran out of device memory with it on"
    assert result.unavailable["candidates"] == "out of device memory at 4"
    assert (result.options.cuda_graph, result.options.candidates) == (False, 2)
    assert result.token_ids == reference.token_ids[:2]  # greedy: every candidate is the same answer
    monkeypatch.undo()
    engine.reconfigure(CPU)
