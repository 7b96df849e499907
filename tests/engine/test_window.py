"""The profiler window: a real CPU trace, an injected idle, and hand-written CUDA traces in kineto's format."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import engine.telemetry.window as window_mod
from engine.telemetry.window import ProfileWindow, analyse_trace, warm_up_profiler

CUDA0 = torch.device("cuda", 0)


def run_loop(window: ProfileWindow, n_steps: int, work, idle_s: float = 0.0) -> None:
    """A decode loop as the engine runs it: idle (host work) then device work, wrapped in step_begin/end."""
    for step in range(n_steps):
        window.step_begin(step)
        if idle_s:
            time.sleep(idle_s)
        work()
        window.step_end(step)


def matmuls(x: torch.Tensor, n: int = 4):
    def work():
        y = x
        for _ in range(n):
            y = torch.tanh(y @ x)
        return y

    return work


@pytest.fixture(scope="module", autouse=True)
def _profiler_ready():
    warm_up_profiler(torch.device("cpu"))  # the first start in a process costs ~1-2 s; keep it out of windows


def test_cpu_window_on_real_workload():
    w = ProfileWindow(torch.device("cpu"), start=2, steps=3)
    assert [s for s in range(8) if w.in_window(s)] == [2, 3, 4]
    run_loop(w, 8, matmuls(torch.randn(64, 64)))
    st = w.finish()
    assert st is not None
    assert st.steps == 3
    assert st.events >= 3 * 4 * 2  # at least a matmul and a tanh per iteration, top-level only
    assert st.launches_per_step == st.events / 3
    assert 0.0 <= st.gap_pct <= 100.0
    assert 0 < st.busy_us <= st.span_us
    assert st.gap_source == "op gap — torch.profiler CPU ops, 3-step window (sampled)"
    assert st.sm_activity_est_pct is None and st.bytes_per_step is None
    assert w.finish() is None  # analysed once


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared machine, OpenMP workers waiting at barriers can stretch a small
    matmul a hundredfold, which is noise this test does not need."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_injected_idle_grows_the_gap(one_thread):
    """A host sleep between steps is idle time of the device; the gap must show it.

    Each step is one 128x128 matmul (~0.1-0.5 ms), so without sleeps the only idle time is the Python
    around one op per step: a gap of a few percent. With a 20 ms sleep per step, at least 8 x 20 ms of the
    window hold no op at all, however slowly the matmuls run: the measured idle time must cover the
    injected sleep, and the gap must rise by far more than 30 points (to ~99 %; ~90 % even if a busy
    machine made the matmuls ten times slower).
    """
    x = torch.randn(128, 128)

    def work():
        return x @ x

    work()  # warm the kernel
    steps, sleep_s = 8, 0.02
    tights = []
    for _ in range(3):  # a tight window is ~3 ms: one preemption can fill it; the least gap of three is the loop's
        tight = ProfileWindow(torch.device("cpu"), start=1, steps=steps)
        run_loop(tight, steps + 2, work)
        tights.append(tight.finish())
    idle = ProfileWindow(torch.device("cpu"), start=1, steps=steps)
    run_loop(idle, steps + 2, work, idle_s=sleep_s)
    b = idle.finish()
    assert all(t is not None for t in tights) and b is not None
    a = min(tights, key=lambda t: t.gap_pct)
    assert a.events == b.events == steps
    injected_us = steps * sleep_s * 1e6
    assert b.span_us - b.busy_us >= 0.98 * injected_us
    assert b.gap_pct > a.gap_pct + 30.0, (a, b)


def test_cpu_results_read_directly_equal_the_exported_trace():
    """The CPU window reads the profiler's results without the JSON round trip; what it measures must be what
    the exported trace says, also while another thread runs ops (this torch records only the profiling
    thread's; both routes keep to the window's thread should it record more)."""
    x = torch.randn(48, 48)
    stop = threading.Event()

    def other_thread():  # aten ops on another thread all through the window
        while not stop.is_set():
            torch.relu(x @ x)

    t = threading.Thread(target=other_thread)
    t.start()
    try:
        w = ProfileWindow(torch.device("cpu"), start=0, steps=3)
        run_loop(w, 3, matmuls(x, 3))  # the last step stops the profiler; nothing is analysed yet
    finally:
        stop.set()
        t.join()
    trace = window_mod._export_trace(w._prof)
    assert trace is not None
    assert any(e.get("name") == window_mod.WINDOW_MARKER for e in trace["traceEvents"])
    span_us = (w._t_end - w._t0) * 1e6
    via_trace = analyse_trace(trace, torch.device("cpu"), span_us=span_us, steps=3, tid=w._tid)
    via_results = w.finish()
    assert via_results is not None
    assert via_results.events == via_trace.events == 3 * 3 * 2  # a matmul and a tanh per iteration
    assert via_results.span_us == via_trace.span_us
    # the exported trace keeps times to the nanosecond, so each event's start and end may round apart
    busy_tol_us = 0.01 * via_trace.events
    assert via_results.busy_us == pytest.approx(via_trace.busy_us, abs=busy_tol_us)
    assert via_results.gap_pct == pytest.approx(via_trace.gap_pct, abs=100.0 * busy_tol_us / span_us)
    assert via_results.gap_source == via_trace.gap_source


def test_op_union_agrees_with_merging_interval_by_interval():
    import numpy as np

    from engine.telemetry.stats import busy_time, merge_intervals

    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 200):
        starts = rng.integers(0, 50, n).astype(float)
        ends = starts + rng.integers(0, 8, n)  # zero-length ones, ties, nesting and touching all occur
        ivs = list(zip(starts.tolist(), ends.tolist()))
        merged = merge_intervals(ivs)
        top, reach = 0, float("-inf")  # the interval-by-interval definition
        for s, e in sorted(ivs, key=lambda iv: (iv[0], -iv[1])):
            top, reach = (top + 1, e) if s >= reach else (top, max(reach, e))
        busy, first, last, count = window_mod.op_union(starts, ends)
        assert busy == busy_time(merged) and count == top
        assert (first, last) == ((merged[0][0], merged[-1][1]) if merged else (0.0, 0.0))
    assert window_mod.op_union(np.empty(0), np.empty(0)) == (0.0, 0.0, 0.0, 0)


def test_cpu_window_falls_back_to_the_exported_trace(monkeypatch):
    monkeypatch.setattr(window_mod, "_cpu_op_intervals", lambda prof: None)
    exported = []
    real_export = window_mod._export_trace
    monkeypatch.setattr(window_mod, "_export_trace", lambda prof: exported.append(1) or real_export(prof))
    w = ProfileWindow(torch.device("cpu"), start=0, steps=2)
    run_loop(w, 3, matmuls(torch.randn(32, 32), 2))
    st = w.finish()
    assert exported == [1] and st is not None and st.events == 2 * 2 * 2


def test_window_in_a_worker_thread_sees_that_threads_ops():
    result = {}

    def worker():
        w = ProfileWindow(torch.device("cpu"), start=0, steps=2)
        run_loop(w, 3, matmuls(torch.randn(32, 32), 2))
        result["stats"] = w.finish()

    # ops on the main thread during the window belong to another thread and are not counted
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    st = result["stats"]
    assert st is not None and st.steps == 2 and st.events >= 2 * 2 * 2 and st.gap_pct is not None


def test_generation_ending_inside_the_window():
    w = ProfileWindow(torch.device("cpu"), start=1, steps=8)
    t0 = time.perf_counter()
    run_loop(w, 4, matmuls(torch.randn(32, 32), 2))  # steps 1, 2, 3 traced, then the generation stops
    loop_us = (time.perf_counter() - t0) * 1e6
    time.sleep(0.05)  # post-loop work must not count as idle
    st = w.finish()
    assert st is not None and st.steps == 3
    assert st.span_us <= loop_us
    assert st.gap_source.startswith("op gap — torch.profiler CPU ops, 3-step window")


def test_window_never_reached_or_disabled():
    w = ProfileWindow(torch.device("cpu"), start=8, steps=8)
    run_loop(w, 4, matmuls(torch.randn(8, 8), 1))
    assert w.finish() is None
    off = ProfileWindow(torch.device("cpu"), start=0, steps=4, enabled=False)
    assert not any(off.in_window(s) for s in range(10))
    run_loop(off, 6, matmuls(torch.randn(8, 8), 1))
    assert off.finish() is None
    assert not torch.autograd.profiler._is_profiler_enabled


def test_another_profiler_running_skips_the_window(caplog):
    x = torch.randn(16, 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as outer:
        w = ProfileWindow(torch.device("cpu"), start=0, steps=2)
        with caplog.at_level(logging.WARNING, logger="engine.telemetry.window"):
            run_loop(w, 3, matmuls(x, 1))
        assert w.finish() is None
        x @ x
    assert "another torch profiler is running" in caplog.text
    assert any(e.key == "aten::mm" for e in outer.key_averages())  # the outer session was left intact


def test_a_profiler_that_cannot_start_skips_the_window_and_frees_the_next(monkeypatch, caplog):
    class Refusing:
        def __init__(self, **kw):
            pass

        def __enter__(self):
            raise ValueError("CUPTI_ERROR_NOT_INITIALIZED")

    x = torch.randn(16, 16)
    real = torch.profiler.profile
    monkeypatch.setattr(torch.profiler, "profile", Refusing)
    w = ProfileWindow(torch.device("cpu"), start=0, steps=2)
    with caplog.at_level(logging.WARNING, logger="engine.telemetry.window"):
        run_loop(w, 3, matmuls(x, 1))
    assert w.finish() is None
    assert "the profiler could not start: CUPTI_ERROR_NOT_INITIALIZED" in caplog.text
    monkeypatch.setattr(torch.profiler, "profile", real)
    later = ProfileWindow(torch.device("cpu"), start=0, steps=2)  # the one-window lock was released
    run_loop(later, 3, matmuls(x, 1))
    st = later.finish()
    assert st is not None and st.steps == 2


def test_bad_window_arguments():
    with pytest.raises(ValueError):
        ProfileWindow(torch.device("cpu"), start=-1)
    with pytest.raises(ValueError):
        ProfileWindow(torch.device("cpu"), steps=0)


# ---- hand-written traces ---------------------------------------------------------------------------


def kernel(ts, dur, grid=(1, 1, 1), device=0, name="k"):
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "pid": device,
        "tid": 7,
        "ts": ts,
        "dur": dur,
        "args": {"device": device, "stream": 7, "grid": list(grid), "block": [128, 1, 1]},
    }


def memcpy(ts, dur, nbytes, device=0):
    return {
        "ph": "X",
        "cat": "gpu_memcpy",
        "name": "Memcpy DtoH (Device -> Pinned)",
        "pid": device,
        "tid": 7,
        "ts": ts,
        "dur": dur,
        "args": {"device": device, "stream": 7, "bytes": nbytes},
    }


def cuda_trace(events, num_sms=132):
    runtime = {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "pid": 1,
        "tid": 1,
        "ts": 0.0,
        "dur": 5000.0,
        "args": {"cbid": 211},
    }
    return {
        "schemaVersion": 1,
        "deviceProperties": [{"id": 0, "name": "NVIDIA H200", "numSms": num_sms}],
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
            runtime,
            *events,
        ],
    }


def test_cuda_trace_kernel_gap_and_sm_estimate():
    events = [
        kernel(1000.0, 100.0, grid=(132, 1, 1)),  # full GPU: weight 1
        kernel(1050.0, 100.0, grid=(33, 2, 1)),  # overlaps the first (another stream): 66/132 = 0.5
        kernel(1300.0, 200.0, grid=(1, 1, 1)),  # one block: 1/132
        memcpy(1600.0, 50.0, 4096),
        kernel(1700.0, 100.0, grid=(264, 1, 1)),  # more blocks than SMs: capped at 1
    ]
    st = analyse_trace(cuda_trace(events), CUDA0, span_us=2000.0, steps=4)
    # busy = [1000,1150] + [1300,1500] + [1600,1650] + [1700,1800] = 150 + 200 + 50 + 100 = 500
    assert st.busy_us == pytest.approx(500.0)
    assert st.span_us == 2000.0
    assert st.gap_pct == pytest.approx(75.0)
    assert st.events == 5
    expected_sm = (100 * 1 + 100 * 0.5 + 200 / 132 + 100 * 1) / 2000 * 100
    assert st.sm_activity_est_pct == pytest.approx(expected_sm)
    assert "132 SMs" in st.sm_activity_source
    assert st.bytes_per_step == pytest.approx(1024.0)
    assert st.gap_source == "kernel gap — torch.profiler, 4-step window (sampled)"
    assert st.launches_per_step == 1.0  # 4 kernels over 4 steps; the copy is not a launch
    assert st.launches_source == "kernels per step — torch.profiler, 4-step window (sampled)"


def test_cuda_trace_sm_count_argument_wins_and_other_devices_are_ignored():
    events = [kernel(0.0, 100.0, grid=(50, 1, 1)), kernel(100.0, 100.0, grid=(50, 1, 1), device=1)]
    st = analyse_trace(cuda_trace(events), CUDA0, span_us=400.0, steps=1, sm_count=100)
    assert st.events == 1
    assert st.gap_pct == pytest.approx(75.0)
    assert st.sm_activity_est_pct == pytest.approx(100 * 0.5 / 400 * 100)
    assert st.bytes_per_step is None  # no copies traced


def test_cuda_trace_span_shorter_than_extent_falls_back_and_says_so():
    events = [kernel(0.0, 10.0), kernel(90.0, 10.0)]
    st = analyse_trace(cuda_trace(events), CUDA0, span_us=50.0, steps=2)
    assert st.span_us == 100.0 and st.gap_pct == pytest.approx(80.0)
    assert st.gap_source.endswith("span = first to last device event")


def test_cuda_trace_without_grid_or_kernels_gives_reasons_not_numbers():
    no_grid = kernel(0.0, 10.0)
    del no_grid["args"]["grid"]
    st = analyse_trace(cuda_trace([no_grid]), CUDA0, span_us=100.0, steps=1)
    assert st.gap_pct == pytest.approx(90.0)
    assert st.sm_activity_est_pct is None and "grid sizes missing" in st.sm_activity_source
    empty = analyse_trace(cuda_trace([]), CUDA0, span_us=100.0, steps=1)
    assert empty.gap_pct is None and empty.events == 0
    assert empty.launches_per_step is None and empty.launches_source is None
    assert empty.sm_activity_est_pct is None and "no kernels" in empty.sm_activity_source
    unknown = analyse_trace({"traceEvents": [kernel(0.0, 10.0)]}, CUDA0, span_us=100.0, steps=1)
    assert unknown.sm_activity_est_pct is None and "SM count unknown" in unknown.sm_activity_source


def test_cpu_trace_counts_top_level_ops_of_the_thread():
    def op(name, ts, dur, tid=11):
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    events = [
        op("aten::linear", 0.0, 100.0),
        op("aten::t", 1.0, 5.0),
        op("aten::addmm", 10.0, 80.0),
        op("aten::silu", 150.0, 50.0),
        op("aten::mm", 300.0, 100.0, tid=99),  # another thread
        {"ph": "X", "cat": "python_function", "name": "decode", "pid": 1, "tid": 11, "ts": 0.0, "dur": 400.0},
    ]
    st = analyse_trace({"traceEvents": events}, torch.device("cpu"), span_us=400.0, steps=2, tid=11)
    assert st.events == 2
    assert st.busy_us == pytest.approx(150.0)
    assert st.gap_pct == pytest.approx(100 * (1 - 150 / 400))
    assert st.launches_per_step == 1.0  # 2 top-level ops of the thread over 2 steps
    assert st.launches_source == "aten ops per step — torch.profiler CPU ops, 2-step window (sampled)"


@pytest.mark.parametrize("route", ["results", "exported trace"])
def test_cpu_window_counts_the_own_int8_kernel_as_an_op(monkeypatch, route):
    """The int8 kernel is a ctypes call torch does not see; unmarked, its time would read as idle and its calls
    would be missing from the op count."""
    import engine.cpu_kernels as cpu_kernels
    from engine.quant import quantize_int8

    kernel = cpu_kernels.kernel()
    if kernel is None:
        pytest.skip(f"the int8 kernel did not build: {cpu_kernels.unavailable_reason()}")
    if route == "exported trace":
        monkeypatch.setattr(window_mod, "_cpu_op_intervals", lambda prof: None)
    q, scales = quantize_int8(torch.randn(4096, 1024))
    x = torch.randn(1, 1024)

    def work():
        for _ in range(3):
            kernel.linear(x, q, scales, None)

    w = ProfileWindow(torch.device("cpu"), start=0, steps=2)
    run_loop(w, 3, work)
    st = w.finish()
    assert st is not None and st.launches_per_step == 3.0  # the kernel's calls; its aten::empty nests inside
    assert st.launches_source == "aten and own-kernel ops per step — torch.profiler CPU ops, 2-step window (sampled)"
    assert st.gap_pct is not None and st.gap_pct < 50  # the 4 MiB streamed three times a step is busy time
