"""The performance HUD fed with synthetic metric streams: what it holds, what it draws, what it exports."""

from __future__ import annotations

import csv
import json
import math
import time
from dataclasses import replace

import numpy as np
import pytest
from full_disk import fill_the_disk
from hud_streams import (
    CPU_REASON,
    DRAM_ESTIMATE,
    GPU_RUNGS,
    KERNEL_GAP,
    NVML_MISSING,
    OP_GAP,
    ManualClock,
    Rung,
    cpu_sources,
    feed_gpu_session,
    gpu_sources,
    ladder_rows,
    metrics_for,
    samples,
    steps,
)
from PySide6.QtCore import Qt
from PySide6.QtGui import QFont, QImage, QPainter, QPalette, QPicture
from PySide6.QtWidgets import QWidget

from engine.figures import GENERATION_FIGURES
from engine.types import (
    CPU_DTYPE_NOTE,
    EngineOptions,
    GenerationMetrics,
    LadderRow,
    MonitorSample,
    StepRecord,
    preset_options,
)
from ui.hud import HudPanel
from ui.hud.compare_table import COLUMN_INDEX, CompareRow, delta_colors
from ui.hud.decimate import peak_decimate
from ui.hud.live_plots import LivePlots
from ui.hud.paint_rate import PaintRate, budget_for
from ui.hud.ring import RingTable
from ui.hud.series import LiveSeries

GPU_VIEWS = ("gpu_util_pct", "sm_activity_pct", "dram_bw_util_pct")
CPU_VIEWS = ("cpu_util_pct", "process_rss_bytes")


@pytest.fixture
def hud(qtbot, tmp_path):
    clock = ManualClock(1000.0)
    asked = []

    def save_dialog(parent, caption, name, file_filter):
        asked.append((caption, name))
        return str(tmp_path / name)

    def size_dialog(parent, width, height):
        asked.append(("size", f"{width}x{height}"))
        return 900, 700

    panel = HudPanel(clock=clock, save_dialog=save_dialog, size_dialog=size_dialog)
    panel.resize(520, 1000)
    qtbot.addWidget(panel)
    panel.asked = asked
    return panel, clock


def wait_exposed(qtbot, widget) -> None:
    """Until the window holding an already shown widget is on screen (the offscreen platform's "screen")."""

    def exposed():
        handle = widget.window().windowHandle()
        return handle is not None and handle.isExposed()

    qtbot.waitUntil(exposed, timeout=5000)


def settle_paints(qtbot, painted: list, quiet_ms: int = 200, timeout_s: float = 10.0) -> None:
    """Run the event loop until no paint has arrived for quiet_ms, then forget the paints seen so far."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = len(painted)
        qtbot.wait(quiet_ms)
        if len(painted) == seen:
            break
    painted.clear()


def show_and_paint(qtbot, panel):
    panel.show()
    panel.tabs.setCurrentIndex(0)
    wait_exposed(qtbot, panel)
    qtbot.waitUntil(lambda: panel.live.paint_count > 0, timeout=3000)
    panel.live.refresh_labels()


def curve_xy(item):
    x, y = item.getData()
    return (np.array([]), np.array([])) if x is None else (np.asarray(x), np.asarray(y))


def sample_column(stream, field):
    return np.array([np.nan if getattr(s, field) is None else getattr(s, field) for s in stream], dtype=float)


# ---- ring buffers ---------------------------------------------------------------------------------------


def test_ring_wraps_around_in_order_without_reallocating():
    ring = RingTable(5, ("t", "v"))
    storage = ring._data
    ring.extend([(0, 0), (1, 10), (2, None)])
    assert len(ring) == 3 and ring.total == 3
    np.testing.assert_array_equal(ring.column("t"), [0, 1, 2])
    assert math.isnan(ring.column("v")[2]) and ring.last("v") is None

    ring.extend([(i, i * 10) for i in range(3, 7)])  # wraps: 7 rows into 5 slots
    assert len(ring) == 5 and ring.total == 7 and ring.dropped == 2
    np.testing.assert_array_equal(ring.column("t"), [2, 3, 4, 5, 6])
    np.testing.assert_array_equal(ring.column("v"), [np.nan, 30, 40, 50, 60])
    assert ring.last("v") == 60.0

    ring.extend(np.array([(i, -i) for i in range(100, 112)], dtype=float))  # a block larger than the ring
    np.testing.assert_array_equal(ring.column("t"), [107, 108, 109, 110, 111])
    ring.append((112, 1.5))
    np.testing.assert_array_equal(ring.column("t"), [108, 109, 110, 111, 112])
    assert ring.total == 20 and ring._data is storage

    with pytest.raises(ValueError, match="2 values"):
        ring.append((1, 2, 3))
    with pytest.raises(ValueError, match="capacity"):
        RingTable(0, ("t",))


def test_ring_reads_a_time_window_in_place():
    ring = RingTable(8, ("t", "v"))
    ring.extend([(t, 10 * t) for t in range(5)])  # not full yet
    assert ring.search("t", 2.5) == 3 and ring.search("t", -1) == 0 and ring.search("t", 99) == 5
    np.testing.assert_array_equal(ring.column("v", 3), [30, 40])
    assert ring.first("t") == 0.0
    ring.extend([(t, 10 * t) for t in range(5, 13)])  # wrapped: holds 5..12, the oldest in the middle of storage
    held = ring.column("t")
    np.testing.assert_array_equal(held, np.arange(5, 13))
    for value in (-1, 5, 5.5, 7, 8, 9.5, 12, 12.5):
        start = ring.search("t", value)
        assert start == int(np.searchsorted(held, value))
        np.testing.assert_array_equal(ring.column("t", start), held[start:])
        np.testing.assert_array_equal(ring.column("v", start), 10 * held[start:])
    assert ring.first("t") == 5.0 and ring.last("t") == 12.0
    assert RingTable(4, ("t",)).first("t") is None


# ---- decimation ------------------------------------------------------------------------------------------


def test_peak_decimation_keeps_extremes_edges_and_gaps():
    rng = np.random.default_rng(1)
    x = np.sort(rng.uniform(0.0, 60.0, 20000))
    x[0], x[-1] = -0.5, 59.9  # one row before the window lets the line enter from the edge
    y = rng.normal(50.0, 5.0, x.size)
    gap = (x >= 20.0) & (x < 25.0)
    y[gap] = np.nan  # five seconds nobody measured
    y[np.searchsorted(x, 40.0)] = np.nan  # one missing point: narrower than a pixel
    y[np.searchsorted(x, 10.0)] = 500.0  # a single spike must survive
    columns = 100
    dx, dy = peak_decimate(x, y, 0.0, 60.0, columns)

    assert dx.size <= 2 * columns + columns // 10 + 1  # two per column, plus gap markers and the edge row
    assert (dx[0], dy[0]) == (x[0], y[0]) and dx[-1] == x[-1]
    assert np.all(np.diff(dx) >= 0)
    assert np.nanmax(dy) == 500.0 and np.nanmin(dy) == np.nanmin(y) and np.nanmax(dy[dy < 500]) == np.nanmax(y[y < 500])
    # The gap stays a gap: nothing drawn inside it, and the runs either side are not joined.
    inside = (dx > 20.0 + 0.6) & (dx < 25.0 - 0.6)
    assert np.isnan(dy[inside]).all()
    before, after = np.flatnonzero(dx < 20.0)[-1], np.flatnonzero(dx >= 25.0)[0]
    assert np.isnan(dy[before + 1 : after]).any()
    # Small series are drawn as they are.
    sx, sy = x[:150], y[:150]
    assert peak_decimate(sx, sy, 0.0, 60.0, columns) == (sx, sy)


def test_series_ring_keeps_the_newest_steps(hud, qtbot):
    series = LiveSeries(step_capacity=64)
    series.begin_generation("long", EngineOptions(), 0.0)
    fed = steps(0.0, 200, 5.0, profiled=(0, 0))
    series.add_steps(fed)
    assert series.series_lengths()["steps"] == 64
    np.testing.assert_array_equal(series.steps.column("t"), [r.t for r in fed[-64:]])
    np.testing.assert_array_equal(series.steps.column("tokens_total"), [r.tokens_total for r in fed[-64:]])


def test_the_hud_says_what_its_rings_dropped(qtbot, tmp_path):
    """Live, the rings keep the newest records of a long session; the oldest they overwrite are counted, and the
    plots and the series JSON say how many are no longer held (the note and the count were nowhere)."""
    series = LiveSeries(step_capacity=64, sample_capacity=16)
    panel = HudPanel(series=series, clock=ManualClock(1000.0))
    panel.resize(520, 1000)
    qtbot.addWidget(panel)
    panel.begin_generation("long", EngineOptions(device="cpu"))
    fed = steps(1000.0, 60, 5.0, profiled=(0, 0))
    panel.add_steps(fed)
    monitored = samples(1000.0, 1004.0, 10.0, {}, cpu_sources())[:40]  # 0.1 s apart: no gap rows
    panel.add_samples(monitored[:4])
    show_and_paint(qtbot, panel)
    assert series.dropped() == {"steps": 0, "samples": 0} and not panel.live.dropped_note.isVisible()
    panel.add_steps(steps(fed[-1].t, 140, 5.0, profiled=(0, 0)))  # 200 steps into 64 rows
    panel.add_samples(monitored[4:])  # 40 samples into 16 rows
    assert series.steps_seen == 200 and series.samples_seen == 40
    assert series.dropped() == {"steps": 136, "samples": 24}
    panel.live.refresh_labels()
    assert panel.live.dropped_note.isVisible()
    assert panel.live.dropped_note.text() == (
        "Not plotted or exported: the oldest 136 step records and 24 monitor samples, overwritten when the HUD's "
        "rings filled"
    )
    doc = json.loads(panel.export_series_json(tmp_path / "series.json").read_text(encoding="utf-8"))
    assert doc["dropped"] == {"steps": 136, "samples": 24}
    assert (len(doc["steps"]), len(doc["samples"])) == (64, 16)


# ---- the tokens/s series ---------------------------------------------------------------------------------


def test_tokens_per_s_is_a_rolling_rate_over_untraced_steps():
    series = LiveSeries(rate_window_s=1.0)
    series.begin_generation("g", EngineOptions(candidates=2), 10.0)
    recs, t = [], 10.0
    for i in range(1, 81):
        t += 0.05 if i <= 40 else 0.1  # 40 tok/s (2 candidates), then 20 tok/s
        recs.append(StepRecord(t=t, step=i, tokens_total=2 * i, step_ms=50.0, profiled=10 <= i < 14))
    series.add_steps(recs)
    rate = series.values("tokens_per_s")

    def expected(i):  # independent: the newest record at least 1 s back in the same untraced run, else its first
        if recs[i].profiled:
            return math.nan
        start = max([j + 1 for j in range(i) if recs[j].profiled], default=0)
        run = range(start, i)
        if not run:
            return math.nan
        back = [j for j in run if recs[j].t <= recs[i].t - 1.0]
        j = back[-1] if back else start
        return (recs[i].tokens_total - recs[j].tokens_total) / (recs[i].t - recs[j].t)

    np.testing.assert_allclose(rate, [expected(i) for i in range(len(recs))], rtol=1e-12)
    assert np.isnan(rate[0]) and np.isnan(rate[9:13]).all() and np.isnan(rate[13])  # first, traced, first after
    assert np.isfinite(rate[1:9]).all() and np.isfinite(rate[14:]).all()
    assert rate[30] == pytest.approx(40.0) and rate[79] == pytest.approx(20.0)

    series.end_generation(20.0)
    series.begin_generation("next", EngineOptions(), 30.0)
    series.add_steps([StepRecord(t=30.1, step=1, tokens_total=1, step_ms=5.0)])
    assert series.last_values()["tokens_per_s"] == pytest.approx(20.0)  # the new run has no rate yet
    assert np.isnan(series.values("tokens_per_s")[-1])


def test_tokens_per_s_is_never_negative_where_a_stop_string_took_tokens_back():
    """A step whose count is below the one before (a stop string took back tokens counted before, or a recording
    edited by hand) made the rate negative: -1.76 tok/s in the plot's header and the exported series."""
    series = LiveSeries(rate_window_s=1.0)
    series.begin_generation("g", EngineOptions(), 10.0)
    counts = [1, 2, 3, 4, 1, 2, 3]
    series.add_steps(
        [StepRecord(t=10.0 + 0.1 * i, step=i + 1, tokens_total=n, step_ms=1.0) for i, n in enumerate(counts)]
    )
    rate = series.values("tokens_per_s")
    assert np.isnan(rate[4])  # a window begins again at the step that went back
    np.testing.assert_allclose(rate[[1, 2, 3, 5, 6]], 10.0)


# ---- what the plots draw ---------------------------------------------------------------------------------


def test_headers_show_the_running_generations_figures_only():
    series = LiveSeries()
    series.begin_generation("one", EngineOptions(), 100.0)
    first = steps(100.0, 40, 10.0, profiled=(16, 24))
    series.add_steps(first)
    series.end_generation(first[-1].t)
    after_one = series.header_values()
    assert after_one["step_ms"] == first[-1].step_ms and after_one["tokens_per_s"] == pytest.approx(100, rel=0.2)

    series.begin_generation("two", EngineOptions(), 200.0)
    assert series.header_values()["tokens_per_s"] is None and series.header_values()["step_ms"] is None
    second = steps(200.0, 23, 5.0, profiled=(16, 24))  # ends inside its traced window
    series.add_steps(second[:1])
    assert series.header_values()["step_ms"] == second[0].step_ms
    assert series.header_values()["tokens_per_s"] is None  # one record gives no rate yet, and no old one shows
    series.add_steps(second[1:])
    shown = series.header_values()
    assert shown["step_ms"] == second[14].step_ms  # the last untraced step, not a traced (slowed) one
    assert series.last_values()["step_ms"] == second[-1].step_ms  # what the plot's last point is


def test_plots_draw_exactly_what_was_fed_with_sources(hud, qtbot):
    panel, clock = hud
    panel.begin_generation("first", EngineOptions(device="cuda"))
    recs = steps(1000.0, 60, 4.0, profiled=(16, 24))
    stream = samples(
        1000.0, 1000.3, 100.0, {"gpu_util_pct": 55.0, "sm_activity_pct": 30.0, "dram_bw_util_pct": 9.0}, gpu_sources()
    )
    stream[3] = MonitorSample(
        t=stream[3].t,
        gpu_util_pct=None,
        sm_activity_pct=31.0,
        dram_bw_util_pct=None,
        cpu_util_pct=99.0,
        process_rss_bytes=10,
        sources=gpu_sources(),
    )
    panel.add_steps(recs)
    panel.add_samples(stream)
    show_and_paint(qtbot, panel)
    t0 = panel.series.t0
    assert t0 == 1000.0

    for field in GPU_VIEWS:
        x, y = curve_xy(panel.live.view(field).curve)
        np.testing.assert_array_equal(x, [s.t - t0 for s in stream])
        np.testing.assert_array_equal(y, sample_column(stream, field))
    _, gpu_y = curve_xy(panel.live.view("gpu_util_pct").curve)
    assert np.isnan(gpu_y[3])  # not measured stays a gap, never 0

    step_x, step_y = curve_xy(panel.live.view("step_ms").curve)
    traced_x, traced_y = curve_xy(panel.live.view("step_ms").profiled_curve)
    np.testing.assert_array_equal(step_x, [r.t - t0 for r in recs])
    np.testing.assert_array_equal(step_y, [math.nan if r.profiled else r.step_ms for r in recs])
    np.testing.assert_array_equal(traced_y, [r.step_ms if r.profiled else math.nan for r in recs])
    tok_x, tok_y = curve_xy(panel.live.view("tokens_per_s").curve)
    np.testing.assert_array_equal(tok_y, panel.series.values("tokens_per_s"))

    labels = {name: panel.live.view(name).label_text for name in panel.live.views}
    assert labels["gpu_util_pct"] == "GPU util — NVML samples"  # the engine's "GPU util — NVML samples"
    assert labels["sm_activity_pct"] == "SM activity — NVML GPM"
    assert labels["dram_bw_util_pct"] == "DRAM bandwidth — NVML GPM"
    assert labels["tokens_per_s"].startswith("Tokens/s — engine step records")
    assert panel.live.view("gpu_util_pct").value.text() == f"{stream[-1].gpu_util_pct:,.1f} %"
    assert not panel.live.cpu_mode()
    assert all(panel.live.view(n).isHidden() for n in CPU_VIEWS)
    assert all(panel.live.view(n).plot_widget.isVisible() for n in GPU_VIEWS)


def test_without_gpm_the_generation_estimates_are_drawn_and_labelled_as_estimates(hud, qtbot):
    panel, clock = hud
    rung = GPU_RUNGS[1]
    panel.begin_generation("no gpm", rung.options)
    recs = steps(1000.0, 60, rung.step_ms, profiled=(16, 24))
    stream = samples(
        1000.0,
        recs[-1].t,
        10.0,
        {"gpu_util_pct": 70.0, "sm_activity_pct": None, "dram_bw_util_pct": None},
        gpu_sources(gpm=False),
    )
    panel.add_steps(recs)
    panel.add_samples(stream)
    show_and_paint(qtbot, panel)
    assert panel.live.view("sm_activity_pct").na_reason == "not measured so far"

    clock.t = recs[-1].t + 0.01
    m = metrics_for(recs, rung, gpm=False)
    panel.end_generation(m, rung.options, "no gpm")
    qtbot.waitUntil(lambda: len(curve_xy(panel.live.view("sm_activity_pct").estimate_curve)[0]) == 2, timeout=3000)
    panel.live.refresh_labels()

    t0, traced = panel.series.t0, [r for r in recs if r.profiled]
    sm = panel.live.view("sm_activity_pct")
    x, y = curve_xy(sm.estimate_curve)  # over the traced window the estimate comes from
    np.testing.assert_allclose(x, [traced[0].t - traced[0].step_ms / 1000 - t0, traced[-1].t - t0])
    np.testing.assert_array_equal(y, [m.sm_activity_pct, m.sm_activity_pct])
    assert len(curve_xy(sm.curve)[0]) == 0  # no live SM samples drawn: none were measured
    assert sm.plot_widget.isVisible() and sm.na_reason is None
    assert sm.label_text == "SM activity — estimate from the profiler window (kernel time × min(1, blocks/132 SMs))"
    dram = panel.live.view("dram_bw_util_pct")
    x, y = curve_xy(dram.estimate_curve)  # over the decode steps
    np.testing.assert_allclose(x, [recs[0].t - recs[0].step_ms / 1000 - t0, recs[-1].t - t0])
    np.testing.assert_array_equal(y, [m.dram_bw_util_pct] * 2)
    assert dram.label_text == f"DRAM bandwidth — {DRAM_ESTIMATE}"
    assert panel.series_lengths()["sm_activity_pct"] == 1
    assert panel.last_values()["sm_activity_pct"] == m.sm_activity_pct
    assert panel.live.view("gpu_util_pct").label_text == "GPU util — NVML samples"


def _answer_with_an_estimate(panel, clock, rung) -> GenerationMetrics:
    """A 30-step answer without GPM: its DRAM bandwidth an estimate from its steps' times."""
    panel.begin_generation("long", rung.options)
    recs = steps(1000.0, 30, rung.step_ms)
    panel.add_steps(recs)
    clock.t = recs[-1].t + 0.01
    m = metrics_for(recs, rung, gpm=False)
    panel.end_generation(m, rung.options, "long")
    return m


def _end_one_token_answer(panel, clock, rung) -> None:
    one = GenerationMetrics(new_tokens=[1], new_tokens_total=1, decode_steps=0)
    one.mark_na("dram_bw_util_pct", "estimated from the decode steps' timings: no decode step was timed")
    clock.t += 0.1
    panel.end_generation(one, rung.options, "one token")


def test_an_answer_without_an_estimate_does_not_call_an_earlier_estimate_n_a(hud, qtbot, tmp_path):
    """After a one-token answer the series export said DRAM bandwidth was n/a beside the estimate it held and
    the HUD drew."""
    panel, clock = hud
    rung = GPU_RUNGS[1]
    _answer_with_an_estimate(panel, clock, rung)
    panel.begin_generation("one token", rung.options)
    _end_one_token_answer(panel, clock, rung)
    show_and_paint(qtbot, panel)
    panel.live.refresh_labels()
    doc = json.loads(panel.export_series_json(tmp_path / "series.json").read_text(encoding="utf-8"))
    assert [e["series"] for e in doc["estimates"]].count("dram_bw_util_pct") == 1
    assert "dram_bw_util_pct" not in doc["unavailable"]
    assert panel.live.view("dram_bw_util_pct").na_reason is None


def test_after_an_answer_without_a_decode_step_the_step_plots_say_why_and_the_exports_say_what_ran(
    hud, qtbot, tmp_path
):
    """An answer that ended at its first token: the step plots' headers showed a bare n/a (or the answer before
    it's figure) under the live source; a monitor sample afterwards put "runs on the CPU" back as DRAM bandwidth's
    reason beside the estimates held; the series exports kept the options asked for ("auto") and the label without
    "(stopped by you)"."""
    panel, clock = hud
    rung = GPU_RUNGS[1]
    _answer_with_an_estimate(panel, clock, rung)
    panel.begin_generation("one token", EngineOptions())  # as asked: device and dtype "auto"
    ran = EngineOptions(device="cpu", dtype="fp32")
    one = GenerationMetrics(new_tokens=[1], new_tokens_total=1, decode_steps=0)
    why = "no decode step ran: the answer ended at its first token"
    for key in ("decode_tok_s", "decode_seconds"):
        one.mark_na(key, why)
    one.mark_na("dram_bw_util_pct", "estimated from the decode steps' timings: no decode step was timed")
    clock.t += 0.1
    panel.end_generation(one, ran, "one token (stopped by you)")
    cpu = "the model runs on the CPU, not on a GPU"
    panel.add_samples(
        [MonitorSample(t=clock.t + 0.1, cpu_util_pct=50.0, unavailable={"dram_bw_util_pct": cpu}, sources={})]
    )
    show_and_paint(qtbot, panel)
    panel.live.refresh_labels()
    for key, name in (("tokens_per_s", "Tokens/s"), ("step_ms", "Step latency")):
        view = panel.live.view(key)
        assert view.value.text() == "n/a" and view.label_text == f"{name} — n/a for this answer: {why}", key
    doc = json.loads(panel.export_series_json(tmp_path / "series.json").read_text(encoding="utf-8"))
    assert "dram_bw_util_pct" not in doc["unavailable"]
    last = doc["generations"][-1]
    assert (last["label"], last["options"]["device"], last["options"]["dtype"]) == (
        "one token (stopped by you)",
        "cpu",
        "fp32",
    )


def test_an_estimate_that_left_the_window_no_longer_sets_the_y_range(hud, qtbot):
    """A 250 % DRAM estimate an hour of answers ago kept the plot's range at 0-500 %, the 10 % levels in the
    window lying flat on its bottom."""
    panel, clock = hud
    cpu = Rung(
        "x", preset_options("first-fixes", EngineOptions(device="cpu"), half_dtype="fp32"), 30.0, None, None, None, 20.0
    )
    none = {"gpu_util_pct": None, "sm_activity_pct": None, "dram_bw_util_pct": None}

    def answer(level: float) -> None:
        panel.begin_generation("g", cpu.options)
        recs = steps(clock.t, 40, cpu.step_ms)
        panel.add_samples(samples(clock.t, recs[-1].t, 10.0, none, cpu_sources(), cpu_util=150.0))
        panel.add_steps(recs)
        clock.t = recs[-1].t + 0.01
        m = metrics_for(recs, cpu, gpu=False)
        m.dram_bw_util_pct, m.dram_bw_util_source = level, "DRAM bandwidth — estimate: x"
        panel.end_generation(m, cpu.options, "g")
        clock.t += 1.0

    answer(250.0)
    show_and_paint(qtbot, panel)
    live, view = panel.live, panel.live.view("dram_bw_util_pct")
    live.refresh_labels()
    assert view.plot.viewRange()[1][1] > 250  # in the window, it sets the range
    while clock.t < panel.series.estimates["dram_bw_util_pct"][0].t_end + 2 * live.window_s:
        answer(10.0)
    live.paint(force=True)
    live.refresh_labels()
    assert view.plot.viewRange()[1][1] <= 102  # the 10 % levels' range (percent plots reach 100 at least)
    # an answer that ends with no new record: the estimates drawn again, and nothing else
    panel.begin_generation("g", cpu.options)
    panel.end_generation(metrics_for(steps(clock.t, 2, 30.0), cpu, gpu=False), cpu.options, "g")
    live.paint()
    live.refresh_labels()
    assert view.plot.viewRange()[1][1] <= 102


def test_an_earlier_answer_s_estimate_is_not_shown_as_the_next_answer_s_figure(hud, qtbot):
    """The DRAM plot's header kept the last estimate while the next answer ran, and after an answer that had
    none (one token), under the estimate's source; the answer's own reason was never said."""
    panel, clock = hud
    rung = GPU_RUNGS[1]
    m = _answer_with_an_estimate(panel, clock, rung)
    show_and_paint(qtbot, panel)
    dram = panel.live.view("dram_bw_util_pct")
    panel.live.refresh_labels()
    assert (
        dram.value.text() == f"{m.dram_bw_util_pct:,.1f} %" and dram.label_text == f"DRAM bandwidth — {DRAM_ESTIMATE}"
    )
    panel.begin_generation("one token", rung.options)
    panel.live.refresh_labels()
    assert dram.value.text() == "n/a" and dram.label_text == "DRAM bandwidth — n/a for this answer so far"
    _end_one_token_answer(panel, clock, rung)
    panel.live.refresh_labels()
    assert dram.value.text() == "n/a"
    assert dram.label_text == (
        "DRAM bandwidth — n/a for this answer: estimated from the decode steps' timings: no decode step was timed"
    )
    assert dram.plot_widget.isVisible()  # the earlier answer's estimate stays drawn over its own time
    assert len(curve_xy(dram.estimate_curve)[0]) == 2


def test_a_dram_estimate_over_100_percent_is_in_range_and_exported_as_separate_levels(
    hud, qtbot, tmp_path, monkeypatch
):
    """On the CPU the DRAM estimate can pass 100 % (counted bytes over a measured peak): a level of 140 % was
    drawn above a fixed 0-100 range, and the PNG joined two answers' levels across the idle time between them."""
    import pyqtgraph as pg

    panel, clock = hud
    src = {"cpu_util_pct": "CPU util — process CPU time", "process_rss_bytes": "RSS — /proc/self/statm"}
    for g, (t0, dram) in enumerate(((1000.0, 30.0), (1020.0, 140.0))):
        clock.t = t0
        opts = EngineOptions(device="cpu")
        panel.begin_generation(f"gen{g}", opts)
        panel.add_samples(
            [MonitorSample(t=t0 + 0.1 * i, cpu_util_pct=100.0, process_rss_bytes=10**9, sources=src) for i in range(20)]
        )
        panel.add_steps(
            [StepRecord(t=t0 + 0.05 + 0.02 * i, step=i, tokens_total=i + 1, step_ms=20.0) for i in range(1, 90)]
        )
        m = GenerationMetrics(prompt_tokens=5, new_tokens=[90], new_tokens_total=90, decode_tok_s=50.0, ttft_ms=10.0)
        m.put("dram_bw_util_pct", dram, "DRAM bandwidth — estimate: bytes per step / step time / measured peak")
        clock.t = t0 + 2.0
        panel.end_generation(m, opts, f"gen{g}")
    show_and_paint(qtbot, panel)
    dram = panel.live.view("dram_bw_util_pct")
    qtbot.waitUntil(lambda: len(curve_xy(dram.estimate_curve)[0]) == 4, timeout=3000)
    panel.live.refresh_labels()
    _, (_, top) = dram.plot.viewRange()
    assert top >= 140.0 and dram.value.text() == "140.0 %"

    joined = []
    real = pg.PlotItem.addItem

    def spy(plot, item, *args, **kwargs):
        if isinstance(item, pg.PlotCurveItem):
            joined.append((len(item.xData), item.opts.get("connect")))
        return real(plot, item, *args, **kwargs)

    monkeypatch.setattr(pg.PlotItem, "addItem", spy)
    panel.export_plots_png(tmp_path / "plots.png", 800, 900)
    assert (4, "pairs") in joined  # the two levels, each its own segment


def test_the_plots_png_marks_each_answer_and_says_which_series_are_n_a(hud, qtbot, tmp_path, monkeypatch):
    """The image left out the generations' boundaries and "#N" marks (which answer a stretch of a curve belonged
    to) and the series the HUD shows as n/a, with no reason."""
    import pyqtgraph as pg

    panel, clock = hud
    rung = GPU_RUNGS[0]
    for _ in range(2):
        panel.begin_generation("cpu answer", EngineOptions(device="cpu"))
        recs = steps(clock.t, 20, 30.0)
        panel.add_steps(recs)
        panel.add_samples(
            samples(clock.t, recs[-1].t, 10.0, dict.fromkeys(("gpu_util_pct", "sm_activity_pct")), cpu_sources())
        )
        clock.t = recs[-1].t + 0.5
        panel.end_generation(metrics_for(recs, rung, gpu=False), EngineOptions(device="cpu"), "cpu answer")
    show_and_paint(qtbot, panel)
    panel.live.refresh_labels()
    on_screen = [v for v in panel.live.views.values() if v.plotted][0]
    starts = sorted(on_screen.boundary_values())[::2]
    marks: list[tuple[float, str]] = []
    labels: list[str] = []
    real_add, real_label = pg.PlotItem.addItem, pg.GraphicsLayout.addLabel

    def add(plot, item, *args, **kwargs):
        if isinstance(item, pg.InfiniteLine):
            marks.append((float(item.value()), item.label.format if getattr(item, "label", None) else ""))
        return real_add(plot, item, *args, **kwargs)

    def label(layout, text=" ", *args, **kwargs):
        labels.append(text)
        return real_label(layout, text, *args, **kwargs)

    monkeypatch.setattr(pg.PlotItem, "addItem", add)
    monkeypatch.setattr(pg.GraphicsLayout, "addLabel", label)
    panel.export_plots_png(tmp_path / "plots.png", 800, 900)
    assert {text for _, text in marks if text} == {"#1", "#2"}
    assert {x for x, _ in marks} >= set(starts) and len(starts) == 2
    na = [v for v in panel.live.views.values() if not v.plotted and v.na_reason]
    assert na and all(f"{v.spec.title}: n/a — " in "".join(labels) for v in na)


def test_live_gpm_samples_take_precedence_over_estimates(hud):
    panel, clock = hud
    rung = GPU_RUNGS[2]
    panel.begin_generation("gpm", rung.options)
    recs = steps(1000.0, 60, rung.step_ms)
    panel.add_steps(recs)
    panel.add_samples(
        samples(
            1000.0,
            recs[-1].t,
            100.0,
            {"gpu_util_pct": 90.0, "sm_activity_pct": 70.0, "dram_bw_util_pct": 40.0},
            gpu_sources(),
        )
    )
    panel.end_generation(metrics_for(recs, rung, gpm=False), rung.options, "gpm")
    assert not panel.series.estimates["sm_activity_pct"] and not panel.series.estimates["dram_bw_util_pct"]


def test_missing_nvml_shows_na_with_reason_and_cpu_series_instead(hud, qtbot):
    panel, clock = hud
    panel.begin_generation("cpu", EngineOptions(device="cpu"))
    gpu_none = {"gpu_util_pct": None, "sm_activity_pct": None, "dram_bw_util_pct": None}
    stream = samples(1000.0, 1002.0, 10.0, gpu_none, cpu_sources(), cpu_util=180.0)
    recs = steps(1000.0, 80, 25.0)
    panel.add_steps(recs)
    panel.add_samples(stream)
    show_and_paint(qtbot, panel)
    assert panel.live.view("gpu_util_pct").na_label.text() == "n/a — not measured so far"

    clock.t = 1002.5  # the generation's metrics say why, as soon as it ends
    panel.end_generation(metrics_for(recs, GPU_RUNGS[0], gpu=False, gpu_reason=NVML_MISSING), EngineOptions(), "cpu")
    for name in GPU_VIEWS:
        view = panel.live.view(name)
        assert view.na_label.isVisible() and not view.plot_widget.isVisible()
        assert view.na_label.text() == f"n/a — {NVML_MISSING}"
        assert view.value.text() == "n/a" and view.label_text.endswith("— n/a")
        assert len(curve_xy(view.curve)[0]) == 0  # nothing drawn, not even zeros
    assert panel.live.cpu_mode()
    for name, label in (
        ("cpu_util_pct", "CPU (this process) — process CPU time (time.process_time)"),
        ("process_rss_bytes", "Process memory — /proc/self/statm"),
    ):
        view = panel.live.view(name)
        assert view.isVisible() and view.plot_widget.isVisible()
        assert view.label_text == label
        x, y = curve_xy(view.curve)
        np.testing.assert_array_equal(y, sample_column(stream, name))
    assert panel.live.view("cpu_util_pct").plot.viewRange()[1][1] >= 200  # a core at a time: 180% fits

    lengths, last = panel.series_lengths(), panel.last_values()
    assert lengths["gpu_util_pct"] == lengths["sm_activity_pct"] == lengths["dram_bw_util_pct"] == 0
    assert lengths["cpu_util_pct"] == lengths["process_rss_bytes"] == lengths["samples"] == len(stream)
    assert lengths["steps"] == lengths["step_ms"] == 80
    assert last["gpu_util_pct"] is None and last["sm_activity_pct"] is None
    assert last["process_rss_bytes"] == stream[-1].process_rss_bytes and isinstance(last["process_rss_bytes"], int)


def test_before_any_data_every_series_says_why_it_is_empty(hud, qtbot):
    panel, _ = hud
    panel.show()
    wait_exposed(qtbot, panel)
    panel.live.refresh_labels()
    assert panel.live.view("tokens_per_s").na_label.text() == "n/a — no decode steps yet"
    assert panel.live.view("gpu_util_pct").na_label.text() == "n/a — no monitor samples yet"
    assert panel.series_lengths()["steps"] == 0 and panel.last_values()["tokens_per_s"] is None


def test_an_answer_without_decode_steps_gives_its_own_reason_to_the_step_plots(hud, qtbot):
    """A one-token answer (or a remote server's, whose steps are not seen) left the step plots saying "no decode
    steps yet" after it ended; they say why, until steps come in."""
    panel, clock = hud
    panel.show()
    wait_exposed(qtbot, panel)
    panel.begin_generation("one", EngineOptions())
    m = GenerationMetrics(new_tokens=[1], new_tokens_total=1)
    m.mark_na("decode_tok_s", "no decode step ran: the answer ended at its first token")
    clock.t += 0.1
    panel.end_generation(m, EngineOptions(), "one")
    panel.live.refresh_labels()
    for key in ("tokens_per_s", "step_ms", "tokens_per_step"):
        assert panel.live.view(key).na_label.text() == "n/a — no decode step ran: the answer ended at its first token"
    panel.begin_generation("two", EngineOptions())
    recs = steps(clock.t, 20, 10.0)
    panel.add_steps(recs)
    clock.t = recs[-1].t + 0.01
    panel.end_generation(metrics_for(recs, GPU_RUNGS[0]), EngineOptions(), "two")
    panel.live.refresh_labels()
    assert panel.live.view("tokens_per_s").na_reason is None and panel.series.reasons.get("step_ms") is None


def test_generation_boundaries_are_marked(hud, qtbot):
    panel, clock = hud
    clock.t = 1000.5  # the GUI hears of the start after the worker's first record: that record dates it
    panel.begin_generation("a", EngineOptions())
    first = steps(1000.0, 30, 10.0, first_step_delay_s=0.1)
    panel.add_steps(first)
    clock.t = 1002.0
    panel.end_generation(metrics_for(first, GPU_RUNGS[0]), EngineOptions(), "a")
    clock.t = 1003.0
    panel.begin_generation("b", EngineOptions())
    second = steps(1003.0, 30, 10.0)
    panel.add_steps(second)
    show_and_paint(qtbot, panel)

    t0 = panel.series.t0
    expected = [first[0].t - t0, first[-1].t - t0, 1003.0 - t0]  # b is still running: no end line yet
    for name in ("tokens_per_s", "gpu_util_pct", "step_ms"):
        np.testing.assert_allclose(panel.live.view(name).boundary_values(), expected)
    # The step curve breaks between generations instead of joining a's last point to b's first.
    _, y = curve_xy(panel.live.view("step_ms").curve)
    assert np.isnan(y[len(first)]) and len(y) == len(first) + 1 + len(second)


# ---- paint discipline ------------------------------------------------------------------------------------


def test_nothing_paints_while_hidden(hud, qtbot):
    panel, clock = hud
    calls = []
    for view in panel.live.views.values():
        original = view.curve.setData
        view.curve.setData = lambda *a, _o=original, **k: (calls.append(panel.live.isVisible()), _o(*a, **k))[1]
    panel.begin_generation("hidden", EngineOptions())
    panel.add_steps(steps(1000.0, 50, 10.0))
    panel.add_samples(samples(1000.0, 1000.5, 10.0, {"gpu_util_pct": 50.0}, gpu_sources()))
    qtbot.wait(300)
    assert panel.live.tick_count == 0 and panel.live.paint_count == 0 and calls == []
    assert panel.live.paint() is False

    show_and_paint(qtbot, panel)
    assert calls and all(calls)
    painted = panel.live.paint_count
    length = len(curve_xy(panel.live.view("step_ms").curve)[0])

    panel.tabs.setCurrentIndex(1)  # the Live tab is hidden behind Compare
    assert not panel.live.isVisible()
    ticks, n_calls = panel.live.tick_count, len(calls)
    panel.add_steps(steps(1000.6, 50, 10.0, seed=3))
    qtbot.wait(300)
    assert panel.live.tick_count == ticks and panel.live.paint_count == painted and len(calls) == n_calls
    assert len(curve_xy(panel.live.view("step_ms").curve)[0]) == length

    panel.tabs.setCurrentIndex(0)
    qtbot.waitUntil(lambda: len(curve_xy(panel.live.view("step_ms").curve)[0]) == length + 50, timeout=3000)
    assert all(calls)

    panel.hide()
    ticks = panel.live.tick_count
    qtbot.wait(200)
    assert panel.live.tick_count == ticks


def test_a_long_stream_is_drawn_at_two_points_per_pixel_column(hud, qtbot):
    panel, _ = hud
    panel.begin_generation("fast", EngineOptions(device="cpu"))
    recs = steps(1000.0, 24000, 2.5, profiled=(12000, 12008))  # ~60 s at 400 tok/s
    for k in range(0, len(recs), 4000):
        panel.add_steps(recs[k : k + 4000])
    show_and_paint(qtbot, panel)
    panel.live.paint()  # the first paint may come before the layout settled; a new width re-feeds the curves
    t0 = panel.series.t0
    view = panel.live.view("step_ms")
    columns = view.columns()
    assert 300 < columns < 520
    x, y = curve_xy(view.curve)
    tx, ty = curve_xy(view.profiled_curve)
    assert x.size <= 2 * columns + 8 and tx.size <= 2 * columns + 8
    x_lo, x_hi = panel.live._x_shown
    shown = [r for r in recs if r.t - t0 >= x_lo]
    assert np.nanmax(y) == max(r.step_ms for r in shown if not r.profiled)
    assert np.nanmin(y) == min(r.step_ms for r in shown if not r.profiled)
    assert np.nanmax(ty) == max(r.step_ms for r in recs if r.profiled)
    assert x[-1] == pytest.approx(recs[-1].t - t0) and x_hi >= x[-1]
    _, tok = curve_xy(panel.live.view("tokens_per_s").curve)
    rate = panel.series.values("tokens_per_s")
    assert tok.size <= 2 * columns + 8 and np.nanmax(tok) == np.nanmax(rate[-len(shown) :])


def test_showing_all_held_moves_the_time_range_in_steps(hud, qtbot):
    panel, _ = hud
    panel.begin_generation("long", EngineOptions(device="cpu"))
    recs = steps(1000.0, 6000, 10.0, profiled=(0, 0))  # 60 s
    panel.add_steps(recs[:1000])
    show_and_paint(qtbot, panel)
    panel.live.window_box.setCurrentIndex(panel.live.window_box.count() - 1)  # all held
    assert panel.live.window_s is None
    ranges = []
    for k in range(1000, 6000, 25):
        panel.add_steps(recs[k : k + 25])
        panel.live.paint()
        ranges.append(panel.live._x_shown)
        # from the generation's start, where its "#1" mark is drawn, a little before its first record
        first, latest = panel.series.generations[-1].t_start - panel.series.t0, recs[k + 24].t - panel.series.t0
        x_lo, x_hi = panel.live._x_shown
        assert x_lo == pytest.approx(first) and latest <= x_hi <= first + 1.25 * (latest - first)
    assert len(set(ranges)) <= 15  # of 200 paints: each range change repaints every axis


def test_only_changed_and_shown_series_are_fed_at_most_once_a_pixel_column(qtbot):
    wall = ManualClock(5000.0)
    series = LiveSeries()
    live = LivePlots(series, now=wall)
    live.resize(500, 900)
    qtbot.addWidget(live)
    series.begin_generation("cpu", EngineOptions(device="cpu"), 1000.0)
    gpu_none = {"gpu_util_pct": None, "sm_activity_pct": None, "dram_bw_util_pct": None}
    recs = steps(1000.0, 60, 10.0, profiled=(0, 0))
    series.add_steps(recs[:40])
    series.add_samples(samples(1000.0, 1000.4, 10.0, gpu_none, cpu_sources()))
    live.show()
    wait_exposed(qtbot, live)
    live.refresh_labels()
    qtbot.waitUntil(lambda: live.view("cpu_util_pct").plot_widget.isVisible(), timeout=3000)
    live.paint()
    fed = []
    for name, view in live.views.items():
        for curve in (view.curve, view.profiled_curve):
            if curve is not None:
                original = curve.setData
                curve.setData = lambda *a, _o=original, _n=name, **k: (fed.append(_n), _o(*a, **k))[1]
    x_lo, x_hi = live._x_shown
    column_s = (x_hi - x_lo) / live.view("step_ms").columns()  # data time per pixel column

    assert live.paint() is False and fed == []  # nothing new: nothing fed
    series.add_steps(recs[40:41])
    wall.t += column_s / 2
    assert live.paint() is False and fed == []  # not a pixel column's worth of time since the last feed
    wall.t += column_s / 2
    assert live.paint() is True
    assert set(fed) == {"tokens_per_s", "step_ms"}  # the samples did not change: their plots are left alone
    fed.clear()
    series.add_samples(samples(1000.5, 1000.5, 10.0, gpu_none, cpu_sources()))
    wall.t += column_s
    assert live.paint() is True
    assert set(fed) == {"cpu_util_pct", "process_rss_bytes"}  # the GPU series are n/a: never fed
    assert all(len(curve_xy(live.view(n).curve)[0]) == 0 for n in GPU_VIEWS)
    fed.clear()
    series.add_steps(recs[41:])  # the last records of a generation are drawn once the time has passed
    assert live.paint() is False
    wall.t += column_s
    assert live.paint() is True and set(fed) == {"tokens_per_s", "step_ms"}
    x, y = curve_xy(live.view("step_ms").curve)
    assert x[-1] == recs[-1].t - series.t0 and y[-1] == recs[-1].step_ms
    series.add_steps(steps(recs[-1].t, 1, 10.0, profiled=(0, 0)))
    assert live.paint(force=True) is True  # as the PNG export does: everything held, at once
    assert curve_xy(live.view("step_ms").curve)[0].size == len(recs) + 1


def test_paint_rate_keeps_painting_within_its_budget():
    rate = PaintRate(max_hz=20, min_hz=5, budget=0.03)
    assert rate.interval_ms == 50 and rate.share is None
    assert rate.frame(0.001, fed=True) == 50  # 1 ms a frame: 20 Hz costs 2 %
    rate = PaintRate(max_hz=20, min_hz=5, budget=0.03, smoothing=1.0)
    assert rate.frame(0.0015, fed=True) == 50
    rate.add_render(0.0015)  # the plots' paint events after the slot count towards the next frame
    assert rate.frame(0.0015, fed=True) == 100  # 3 ms a frame: 10 Hz keeps it at 3 %
    assert rate.share == pytest.approx(0.03)
    assert rate.frame(0.050, fed=False) == 100  # a tick that fed nothing leaves the rate as it is
    assert rate.frame(0.020, fed=True) == 200  # never slower than 5 Hz
    assert rate.frame(0.0001, fed=True) == 50  # and back up when painting is cheap again
    assert rate.frames == 4 and rate.render_s == pytest.approx(0.0015)
    with pytest.raises(ValueError, match="budget"):
        PaintRate(budget=0.0)


def test_the_paint_budget_is_a_share_of_the_machine(qtbot, monkeypatch):
    assert budget_for(2) == pytest.approx(0.01)
    assert budget_for(8) == pytest.approx(0.04)
    assert budget_for(64) == pytest.approx(0.10)  # never more than a tenth of the GUI thread
    assert budget_for(None) == pytest.approx(0.005)  # core count unknown: as if one core
    monkeypatch.setattr("ui.hud.live_plots.os.cpu_count", lambda: 2)
    live = LivePlots(LiveSeries())
    qtbot.addWidget(live)
    assert live.rate.budget == pytest.approx(0.01) and live.rate.max_ms == 500  # down to 2 Hz on a laptop
    other = LivePlots(LiveSeries(), paint_budget=0.05)
    qtbot.addWidget(other)
    assert other.rate.budget == 0.05


def test_the_paint_timer_slows_down_when_painting_is_expensive(qtbot):
    ticks = iter(range(10**6))
    slow_clock = lambda: next(ticks) * 0.004  # every reading 4 ms later: each paint slot "costs" 4 ms
    series = LiveSeries()
    live = LivePlots(series, paint_hz=20, min_paint_hz=5, paint_budget=0.03, clock=slow_clock)
    live.resize(500, 800)
    qtbot.addWidget(live)
    series.begin_generation("g", EngineOptions(), 1000.0)
    live.show()
    wait_exposed(qtbot, live)
    assert live._paint_timer.interval() == 50
    for k in range(5):
        series.add_steps(steps(1000.0 + k, 20, 10.0, seed=k))
        live._tick()
    assert 135 <= live._paint_timer.interval() <= 200  # >= 4 ms / 3 %, within 5 Hz
    assert live.rate.share is not None and live.rate.share <= 0.03 + 1e-9


def test_new_values_in_the_headers_do_not_repaint_the_rest_of_the_dock(qtbot):
    from PySide6.QtCore import QEvent, QObject
    from PySide6.QtWidgets import QDockWidget, QMainWindow, QTextEdit

    from ui.hud.bars import MiniBar

    clock = ManualClock(1000.0)
    panel = HudPanel(clock=clock)
    window = QMainWindow()
    window.setCentralWidget(QTextEdit())
    dock = QDockWidget("Performance", window)
    dock.setWidget(panel)
    window.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, dock)
    window.resize(1200, 900)
    qtbot.addWidget(window)
    feed_gpu_session(panel, clock, n_steps=20)
    window.show()
    wait_exposed(qtbot, window)
    panel.live._label_timer.stop()
    panel.live._paint_timer.stop()

    painted = []

    class PaintSpy(QObject):
        def eventFilter(self, obj, event):
            if event.type() == QEvent.Type.Paint:
                painted.append(obj)
            return False

    spy = PaintSpy()
    for w in panel.findChildren(QWidget):
        w.installEventFilter(spy)
    settle_paints(qtbot, painted)  # what the first show still had to paint
    for view in panel.live.views.values():
        assert view.value.minimumSize() == view.value.maximumSize()  # a fixed size: no relayout on new text
        wide = view.spec.format(88_888.0)
        assert view.value.fontMetrics().horizontalAdvance(wide) <= view.value.contentsRect().width()
    before = panel.live.view("gpu_util_pct").value.text()
    t = panel.series.samples.last("t")
    panel.add_samples(
        samples(
            t + 0.1,
            t + 0.3,
            10.0,
            {"gpu_util_pct": 3.0, "sm_activity_pct": 2.0, "dram_bw_util_pct": 1.0},
            gpu_sources(),
            cpu_util=1234.5,
        )
    )
    panel.live.refresh_labels()
    assert panel.live.view("gpu_util_pct").value.text() != before
    qtbot.waitUntil(lambda: any(w is panel.live.view("gpu_util_pct").value for w in painted), timeout=5000)
    qtbot.wait(200)  # a repaint of the rest would come with it
    repainted = [w for w in painted if isinstance(w, MiniBar)]
    for w in panel.findChildren(QWidget):  # the spy goes with this test: no widget keeps it as a filter
        w.removeEventFilter(spy)
    painted.clear()
    assert not repainted


def test_paint_and_label_rates_are_bounded(hud):
    panel, _ = hud
    assert panel.live._paint_timer.interval() >= 1000 / 30
    assert 250 <= panel.live._label_timer.interval() <= 1000
    with pytest.raises(ValueError, match="paint rate"):
        HudPanel(paint_hz=60)


# ---- the last generation's bars --------------------------------------------------------------------------


def test_a_long_plot_source_is_elided_with_the_whole_line_kept(qtbot):
    from ui.hud.series_view import PLOTS, SeriesView

    spec = next(p for p in PLOTS if p.key == "step_ms")
    view = SeriesView(spec)
    qtbot.addWidget(view)
    source = "engine step timings; traced window in orange, left out of tokens/s"
    view.set_header(source, 58.4)
    view.resize(260, 120)
    view.show()
    wait_exposed(qtbot, view)
    title = view.title
    whole = f"{spec.title} — {source}"
    assert title.text() == title.toolTip() == view.label_text == whole
    assert title.shown_source().endswith("…") and len(title.shown_source()) < len(source)
    view.resize(1400, 120)
    qtbot.waitUntil(lambda: title.shown_source() == f" — {source}", timeout=2000)  # all of it once it fits


def test_bars_show_the_last_generation_with_sources(hud):
    panel, clock = hud
    recs = steps(1000.0, 100, 4.6)
    m = metrics_for(recs, GPU_RUNGS[1])
    panel.begin_generation("fixes", GPU_RUNGS[1].options)
    panel.end_generation(m, GPU_RUNGS[1].options, "fixes")
    v = panel.bars.values()
    assert 100 < m.decode_tok_s < 1000 and v["decode_tok_s"]["text"] == f"{m.decode_tok_s:,.1f} tok/s"
    assert v["kernel_gap_pct"] == {"text": "42.0 %", "source": KERNEL_GAP, "fraction": pytest.approx(0.42)}
    assert v["ttft_ms"]["source"] == "engine timing, device-synchronised"
    assert v["step_ms_p99"]["fraction"] == pytest.approx(1.0)  # p50 and p99 share the scale of the largest
    assert v["step_ms_p50"]["fraction"] == pytest.approx(m.step_ms_p50 / m.step_ms_p99)
    assert v["peak_memory_bytes"]["text"] == "392.9 MiB"
    assert "fixes" in panel.bars.header.text()

    cpu = metrics_for(recs, GPU_RUNGS[0], gpu=False)
    panel.end_generation(cpu, EngineOptions(device="cpu"), "cpu")
    v = panel.bars.values()
    assert v["peak_memory_bytes"] == {
        "text": "n/a",
        "source": "n/a — no device memory counter on CPU",
        "fraction": None,
    }
    assert v["kernel_gap_pct"]["source"] == OP_GAP


def test_bar_header_while_running_says_whose_figures_are_shown(hud):
    panel, _ = hud
    panel.begin_generation("Naive", EngineOptions())
    assert panel.bars.header.text().endswith("Naive — its figures show when it ends")
    panel.end_generation(GenerationMetrics(decode_tok_s=50.0, new_tokens_total=12), EngineOptions(), "Naive")
    assert "Naive · 12 new tokens" in panel.bars.header.text()
    panel.begin_generation("Naive", EngineOptions())
    assert panel.bars.header.text().endswith("Naive — the figures below are from the previous generation")
    panel.end_generation(GenerationMetrics(new_tokens_total=1), EngineOptions(), "one")
    assert "one · 1 new token ·" in panel.bars.header.text()


def test_a_long_label_is_cut_and_keeps_the_hud_its_width(hud):
    """A model or recording name of 250 characters without a break made the HUD 1,630 px wide (520 asked for);
    one of 200,000 held the window 104 s."""
    from ui.hud.bars import LABEL_CHARS

    panel, _ = hud
    name = "x" * 200_000
    panel.begin_generation(name, EngineOptions())
    running = panel.bars.header.text()
    assert running.startswith("Running: " + "x" * (LABEL_CHARS - 1) + "… — ")
    panel.end_generation(GenerationMetrics(decode_tok_s=50.0, new_tokens_total=3), EngineOptions(), name)
    header = panel.bars.header
    assert "x" * LABEL_CHARS not in header.text() and "… · 3 new tokens" in header.text()
    assert header.minimumSizeHint().width() < 900


def test_after_a_failed_generation_the_bars_say_whose_figures_they_show(hud):
    """A generation that failed midway replaced the header with "The last generation failed: …" over the bars
    and the diagnosis of the one before, which then read as the failed one's."""
    panel, clock = hud
    panel.generation_failed("no model loaded")
    assert panel.bars.header.text() == "The last generation failed: no model loaded"
    panel.begin_generation("one", EngineOptions())
    recs = steps(clock.t, 30, 10.0)
    panel.add_steps(recs)
    clock.t = recs[-1].t + 0.01
    panel.end_generation(metrics_for(recs, GPU_RUNGS[0]), EngineOptions(), "one")
    panel.begin_generation("two", EngineOptions())
    panel.add_steps(steps(clock.t, 5, 10.0))
    panel.generation_failed("CUDA out of memory")
    assert panel.bars.header.text() == (
        "The last generation failed: CUDA out of memory — the figures below are from #1 one"
    )


def test_long_bar_sources_are_elided_with_the_full_text_in_the_tooltip(hud, qtbot):
    panel, clock = hud
    long_source = "op gap — torch.profiler CPU ops, 8-step window (sampled), " + "a very long explanation " * 6
    m = GenerationMetrics(decode_tok_s=50.0, kernel_gap_pct=38.0, kernel_gap_source=long_source)
    panel.begin_generation("g", EngineOptions())
    panel.end_generation(m, EngineOptions(), "g")
    panel.show()
    wait_exposed(qtbot, panel)
    _, _, _, source = panel.bars._rows["kernel_gap_pct"]
    assert source.text() == long_source == panel.bars.values()["kernel_gap_pct"]["source"]
    shown = source.shown_text()
    assert shown.endswith("…") and long_source.startswith(shown[:-1]) and len(shown) < len(long_source)
    assert source.fontMetrics().horizontalAdvance(shown) <= source.contentsRect().width()
    assert long_source in source.toolTip()
    assert panel.bars.minimumSizeHint().width() < 400  # the source never widens the dock
    panel.resize(1400, 1000)
    qtbot.waitUntil(lambda: panel.bars.width() > 1000, timeout=3000)
    _, _, _, short = panel.bars._rows["decode_tok_s"]
    assert short.shown_text() == short.text() == "engine timing, device-synchronised"  # shown whole where it fits


# ---- the compare table -----------------------------------------------------------------------------------


def _three_generations(panel):
    opts = [
        EngineOptions(dtype="fp32", sampling="host", kv_cache="dynamic"),
        EngineOptions(dtype="fp16"),
        EngineOptions(dtype="bf16", compile=True),
    ]
    mets = [
        GenerationMetrics(
            decode_tok_s=50.0,
            ttft_ms=80.0,
            kernel_gap_pct=80.0,
            kernel_gap_source="k",
            launches_per_step=348.0,
            launches_per_step_source="kernels per step — k",
        ),
        GenerationMetrics(decode_tok_s=200.0, ttft_ms=40.0, kernel_gap_pct=40.0, kernel_gap_source="k"),
        GenerationMetrics(
            decode_tok_s=None,
            ttft_ms=20.0,
            kernel_gap_pct=None,
            unavailable={"decode_tok_s": "cancelled before the first decode step"},
        ),
    ]
    for label, o, m in zip(("naive", "half", "compiled"), opts, mets):
        panel.begin_generation(label, o)
        panel.end_generation(m, o, label)
    return opts, mets


def test_a_ratio_that_is_not_zero_is_never_shown_as_zero():
    """A gap of 0.04 % against a reference of 81 % showed "×0.00" beside "<0.1 %"."""
    from ui.hud import fmt

    assert fmt.delta(0.04 / 81 - 1) == "×<0.01" and fmt.delta(-1.0) == "×0.00"
    assert fmt.delta(3.0) == "×4.00" and fmt.delta(1233.0) == "×1,234.00" and fmt.delta(float("nan")) == "n/a"
    assert fmt.ratio(0.03, 1) == "×<0.1" and fmt.ratio(None) == "n/a"


def test_compare_table_rows_deltas_and_reference(hud, qtbot):
    panel, _ = hud
    opts, mets = _three_generations(panel)
    model = panel.compare.model
    assert model.rowCount() == 3
    cell = lambda r, key: model.data(model.index(r, COLUMN_INDEX[key]))
    assert [cell(r, "label") for r in range(3)] == ["naive", "half", "compiled"]
    assert [cell(r, "dtype") for r in range(3)] == ["fp32", "fp16", "bf16"]
    assert cell(2, "compile") == "on" and cell(0, "sampling") == "host"
    assert cell(0, "index") == "1 (ref)"  # the first generation is the reference until one is chosen
    assert model.delta(1, "decode_tok_s") == pytest.approx(3.0)
    assert cell(1, "decode_tok_s") == "200.0 tok/s  ×4.00"  # one form for every delta: the ratio
    assert model.delta(1, "ttft_ms") == pytest.approx(-0.5) and cell(1, "ttft_ms") == "40.0 ms  ×0.50"
    assert model.delta(2, "decode_tok_s") is None and cell(2, "decode_tok_s") == "n/a"
    assert (
        model.data(model.index(2, COLUMN_INDEX["decode_tok_s"]), Qt.ItemDataRole.ToolTipRole)
        == "n/a — cancelled before the first decode step"
    )
    better, _worse = delta_colors()
    assert model.data(model.index(1, COLUMN_INDEX["ttft_ms"]), Qt.ItemDataRole.ForegroundRole) == better
    # the colour's meaning in words too (a screen reader, a reader who does not tell red from green)
    said = model.data(model.index(1, COLUMN_INDEX["ttft_ms"]), Qt.ItemDataRole.AccessibleTextRole)
    assert said == "40.0 ms  ×0.50, better than the reference (lower is better)"
    assert cell(0, "launches_per_step") == "348" and cell(1, "launches_per_step") == "n/a"
    assert (
        model.data(model.index(0, COLUMN_INDEX["launches_per_step"]), Qt.ItemDataRole.ToolTipRole)
        == "kernels per step — k"
    )

    panel.show()
    panel.tabs.setCurrentIndex(1)
    panel.compare.select_rows([1])
    assert panel.compare.selected_rows() == [1]
    qtbot.mouseClick(panel.compare.reference_button, Qt.MouseButton.LeftButton)
    assert model.reference == 1
    assert model.delta(0, "decode_tok_s") == pytest.approx(-0.75) and cell(0, "decode_tok_s") == "50.0 tok/s  ×0.25"
    assert model.delta(1, "decode_tok_s") is None and cell(1, "index") == "2 (ref)"


def test_compare_rows_copy_as_shown_and_the_reference_is_the_row_the_user_is_on(hud, qtbot):
    """Ctrl+C in the table copied the one cell the user was on, not the rows selected; "Use as reference" with
    several rows selected took the lowest-numbered one, not the row the user was on."""
    from PySide6.QtGui import QGuiApplication

    panel, _ = hud
    _three_generations(panel)
    table, model = panel.compare, panel.compare.model
    panel.show()
    panel.tabs.setCurrentIndex(1)
    table.view.sortByColumn(COLUMN_INDEX["index"], Qt.SortOrder.DescendingOrder)  # 3, 2, 1 on screen
    table.select_rows([1, 2])
    table.view.selectionModel().setCurrentIndex(
        table.proxy.mapFromSource(model.index(2, 0)), table.view.selectionModel().SelectionFlag.NoUpdate
    )
    qtbot.mouseClick(table.reference_button, Qt.MouseButton.LeftButton)
    assert model.reference == 2
    QGuiApplication.clipboard().clear()
    table.view.setFocus()
    qtbot.keyClick(table.view, Qt.Key.Key_C, Qt.KeyboardModifier.ControlModifier)
    lines = QGuiApplication.clipboard().text().splitlines()
    header = [model.headerData(c, Qt.Orientation.Horizontal) for c in range(model.columnCount())]
    assert lines[0].split("\t") == header
    shown = lambda r: [" ".join(str(model.index(r, c).data() or "").split()) for c in range(model.columnCount())]
    assert [line.split("\t") for line in lines[1:]] == [shown(2), shown(1)]  # in the table's order, as shown
    assert lines[1].split("\t")[1] == "compiled" and lines[2].split("\t")[1] == "half"


def test_in_a_short_dock_the_compare_buttons_are_in_view(hud, qtbot):
    """The tabs took the height of the tallest page (the Live plots): in a dock shorter than that, the Compare
    table stretched to it and its buttons sat below the visible part, reached only by scrolling the table away."""
    from ui.main_window import FitScrollArea

    panel, _ = hud
    _three_generations(panel)
    area = FitScrollArea(panel)
    qtbot.addWidget(area)
    live_needs = panel.minimumSizeHint().height()
    area.resize(520, live_needs - 150)
    area.show()
    panel.tabs.setCurrentIndex(1)

    def in_view(button) -> bool:
        top_left = button.mapTo(area.viewport(), button.rect().topLeft())
        return area.viewport().rect().contains(top_left) and top_left.y() + button.height() <= area.viewport().height()

    buttons = [panel.compare.buttons.itemAt(i).widget() for i in range(panel.compare.buttons.count())]
    buttons = [b for b in buttons if b is not None]  # Use as reference, the two exports, Clear history
    assert len(buttons) == 4 and buttons[0] is panel.compare.reference_button
    qtbot.waitUntil(lambda: all(in_view(b) for b in buttons), timeout=2000)
    assert area.verticalScrollBar().value() == 0
    panel.tabs.setCurrentIndex(0)  # the plots take their height again: scrolled, not squeezed
    qtbot.waitUntil(lambda: panel.height() >= live_needs, timeout=2000)
    area.takeWidget()  # the panel is the fixture's to close


@pytest.mark.parametrize("width", [430, 300])
def test_the_ladder_s_notes_are_below_the_chart_whole_in_a_short_dock(hud, qtbot, tmp_path, width):
    """The notes under the ladder chart asked for one line's height: in a dock shorter than the chart and its
    notes they were drawn over the gap chart and their last lines were cut off, in the tab and in its PNG."""
    from ui.main_window import FitScrollArea

    panel, _ = hud
    area = FitScrollArea(panel)
    qtbot.addWidget(area)
    area.resize(width, 500)
    area.show()
    panel.tabs.setCurrentIndex(2)
    panel.set_ladder_results(ladder_rows(gpu=False))
    ladder = panel.ladder

    def laid_out() -> bool:
        chart, notes = ladder.chart.geometry(), ladder.notes.geometry()
        whole = notes.height() >= ladder.notes.heightForWidth(notes.width())
        return notes.top() > chart.bottom() and whole and ladder.figure.geometry().bottom() <= ladder.height()

    qtbot.waitUntil(laid_out, timeout=2000)
    assert ladder.notes.text().startswith("(1) ") and ladder.notes.text().count("\n") >= 1
    area.takeWidget()  # the panel is the fixture's to close


def test_compare_table_sorts_on_values_with_na_last(hud):
    panel, _ = hud
    _three_generations(panel)
    panel.begin_generation("fast", EngineOptions())
    panel.end_generation(GenerationMetrics(decode_tok_s=1000.0), EngineOptions(dtype="fp16"), "fast")
    proxy, view = panel.compare.proxy, panel.compare.view
    labels = lambda: [proxy.data(proxy.index(r, COLUMN_INDEX["label"])) for r in range(proxy.rowCount())]

    view.sortByColumn(COLUMN_INDEX["decode_tok_s"], Qt.SortOrder.DescendingOrder)
    assert labels() == ["fast", "half", "naive", "compiled"]
    view.sortByColumn(COLUMN_INDEX["decode_tok_s"], Qt.SortOrder.AscendingOrder)
    assert labels() == ["naive", "half", "fast", "compiled"]
    view.sortByColumn(COLUMN_INDEX["dtype"], Qt.SortOrder.AscendingOrder)
    assert labels()[0] == "compiled"  # bf16 < fp16 < fp32
    view.sortByColumn(COLUMN_INDEX["index"], Qt.SortOrder.DescendingOrder)
    assert labels() == ["fast", "compiled", "half", "naive"]


# ---- exports ---------------------------------------------------------------------------------------------


def with_reasons(metrics: dict) -> dict:
    """`metrics` as the compare exports write them: each figure left null says why."""
    why = {f.key: "not measured in this generation" for f in GENERATION_FIGURES if metrics.get(f.key, 0) is None}
    return {**metrics, "unavailable": {**why, **metrics["unavailable"]}}


def test_compare_exports_equal_what_was_fed(hud, tmp_path):
    panel, _ = hud
    opts, mets = _three_generations(panel)
    doc = json.loads(panel.export_compare_json(tmp_path / "c.json").read_text())
    assert [g["label"] for g in doc["generations"]] == ["naive", "half", "compiled"]
    assert [g["options"] for g in doc["generations"]] == [o.to_dict() for o in opts]
    assert [g["metrics"] for g in doc["generations"]] == [with_reasons(m.to_dict()) for m in mets]
    assert [g["reference"] for g in doc["generations"]] == [True, False, False]

    with open(panel.export_compare_csv(tmp_path / "c.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["label"] for r in rows] == ["naive", "half", "compiled"]
    assert [r["dtype"] for r in rows] == ["fp32", "fp16", "bf16"]
    assert [float(r["decode_tok_s"]) if r["decode_tok_s"] else None for r in rows] == [m.decode_tok_s for m in mets]
    assert (
        rows[2]["kernel_gap_pct"] == ""
        and json.loads(rows[2]["unavailable"]) == with_reasons(mets[2].to_dict())["unavailable"]
    )
    # every figure's source, as in the JSON: decode tok/s has no column of its own for it
    assert [json.loads(r["sources"]) for r in rows] == [m.to_dict()["sources"] for m in mets]
    assert all(json.loads(r["sources"]).get("decode_tok_s") for r in rows if r["decode_tok_s"])


def test_compare_rows_name_their_model_and_a_ladder_its_own(hud, tmp_path):
    panel, _ = hud
    panel.model_name = "SmolLM2-135M"
    panel.begin_generation("chat", EngineOptions(device="cpu"))
    panel.end_generation(GenerationMetrics(decode_tok_s=20.0), EngineOptions(device="cpu"), "chat")
    panel.ladder.run_button.click()  # the ladder measures the model loaded now...
    panel.model_name = "tiny"  # ...even when another loads before its results come
    panel.begin_generation("chat", EngineOptions(device="cpu"))
    panel.end_generation(GenerationMetrics(decode_tok_s=900.0), EngineOptions(device="cpu"), "chat")
    panel.set_ladder_results(ladder_rows(gpu=False)[:1])
    model = panel.compare.model
    assert [(r.label, r.model) for r in model.rows] == [
        ("chat", "SmolLM2-135M"),
        ("chat", "tiny"),
        ("ladder · Naive", "SmolLM2-135M"),
    ]
    shown = [model.data(model.index(i, COLUMN_INDEX["model"])) for i in range(3)]
    assert shown == ["SmolLM2-135M", "tiny", "SmolLM2-135M"]
    # the row of another model than the reference's says its deltas compare models; a row of the same says nothing
    tips = [model.data(model.index(i, COLUMN_INDEX["model"]), Qt.ItemDataRole.ToolTipRole) for i in range(3)]
    assert tips == [None, "tiny: not the reference row's model (SmolLM2-135M), so its deltas compare models", None]
    tok_s = [model.data(model.index(i, COLUMN_INDEX["decode_tok_s"]), Qt.ItemDataRole.ToolTipRole) for i in (1, 2)]
    assert tok_s[0].endswith("\nthe delta is against SmolLM2-135M, another model (the reference row)")
    assert "another model" not in tok_s[1]
    panel.compare.model.add(CompareRow(9, "kept from before", EngineOptions(device="cpu"), GenerationMetrics()))
    assert model.data(model.index(3, COLUMN_INDEX["model"])) == "n/a"
    tip = model.data(model.index(3, COLUMN_INDEX["model"]), Qt.ItemDataRole.ToolTipRole)
    assert tip == "n/a — this row was kept before rows named their model"
    # the draft settings of a generation that did not draft are not its settings
    drafts = [model.data(model.index(i, COLUMN_INDEX[k])) for i in range(4) for k in ("draft_tokens", "draft_model")]
    assert drafts == ["—"] * 8
    assert model.data(model.index(0, COLUMN_INDEX["draft_model"]), Qt.ItemDataRole.ToolTipRole) == (
        "not used: speculation off"
    )
    spec = EngineOptions(device="cpu", speculation="draft", draft_tokens=4, draft_model="/m/small.gguf")
    model.add(CompareRow(10, "drafting", spec, GenerationMetrics(), "big"))
    assert [model.data(model.index(4, COLUMN_INDEX[k])) for k in ("draft_tokens", "draft_model")] == ["4", "small.gguf"]
    with open(panel.export_compare_csv(tmp_path / "c.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["model"] for r in rows] == ["SmolLM2-135M", "tiny", "SmolLM2-135M", "", "big"]
    # the empty one says why, as the table's tooltip does (the cell was empty with no reason)
    assert [r["model_unavailable"] for r in rows] == ["", "", "", "this row was kept before rows named their model", ""]
    # and so does every figure left empty: the row added with no figures has each one "not measured"
    assert json.loads(rows[4]["unavailable"])["decode_tok_s"] == "not measured in this generation"
    doc = json.loads(panel.export_compare_json(tmp_path / "c.json").read_text())
    for g in doc["generations"]:
        for key, value in g["metrics"].items():
            if key in {f.key for f in GENERATION_FIGURES} and value is None:
                assert g["metrics"]["unavailable"].get(key), (g["label"], key)


def test_a_remote_row_compares_by_the_client_s_timings(qtbot):
    from ui.hud.compare_table import CompareModel

    model = CompareModel()
    local = GenerationMetrics()
    local.put("ttft_ms", 100.0)
    remote = GenerationMetrics()
    remote.put("http_ttft_ms", 50.0)
    remote.mark_na("ttft_ms", "the model runs on a remote server")
    model.add(CompareRow(1, "here", EngineOptions(device="cpu"), local, "a"))
    model.add(CompareRow(2, "there", EngineOptions(), remote, "b"))
    cell = model.index(1, COLUMN_INDEX["ttft_ms"])
    assert model.data(cell) == "50.0 ms (HTTP)  ×0.50"
    assert model.data(cell, Qt.ItemDataRole.ToolTipRole) == (
        "client-side timing over HTTP\nthe delta is against a, another model (the reference row)"
    )


def test_a_remote_row_shows_and_exports_its_options_as_the_server_s(hud, tmp_path):
    panel, _ = hud
    remote = EngineOptions(device="remote", candidates=2)
    panel.begin_generation("remote server", remote)
    panel.end_generation(GenerationMetrics(new_tokens_total=4), remote, "remote server")
    model = panel.compare.model
    shown = {k: model.data(model.index(0, COLUMN_INDEX[k])) for k in ("device", "kv_cache", "compile", "candidates")}
    assert shown == {"device": "remote", "kv_cache": "server's", "compile": "server's", "candidates": "2"}
    tip = model.data(model.index(0, COLUMN_INDEX["kv_cache"]), Qt.ItemDataRole.ToolTipRole)
    assert tip == "set by the remote server, which does not say: KV cache n/a here"
    assert panel.bars.header.text().endswith("remote · set by the server · 2 candidates")
    # Every option left empty in the CSV (null in the JSON) says why, as the table's tooltip does: the CSV's were
    # empty with no reason. A local row's draft model, none, says it is not used.
    local = EngineOptions(device="cpu")
    panel.begin_generation("here", local)
    panel.end_generation(GenerationMetrics(new_tokens_total=4), local, "here")
    server_s = "set by the remote server, which does not say"
    why = {k: server_s for k in local.to_dict() if k not in ("device", "candidates")}
    doc = json.loads(panel.export_compare_json(tmp_path / "c.json").read_text())["generations"]
    options = doc[0]["options"]
    assert options["device"] == "remote" and options["candidates"] == 2 and options["kv_cache"] is None
    assert doc[0]["options_unavailable"] == why
    assert doc[1]["options_unavailable"] == {"draft_model": "not used: speculation off"}
    with open(panel.export_compare_csv(tmp_path / "c.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert (rows[0]["device"], rows[0]["kv_cache"], rows[0]["compile"]) == ("remote", "", "")
    assert json.loads(rows[0]["options_unavailable"]) == why
    assert json.loads(rows[1]["options_unavailable"]) == {"draft_model": "not used: speculation off"}
    for row in rows:
        empty = {k for k in local.to_dict() if row[k] == ""}
        assert empty == set(json.loads(row["options_unavailable"]))


def test_a_row_whose_drafting_did_not_run_says_why_its_draft_settings_are_not_used(hud, tmp_path):
    """Drafting asked for and refused (several candidates, a draft model that cannot load): the draft-model and
    draft-tokens cells said "not used: speculation off" and the exports the same, as if none had been asked for.
    They give the reason the row's figures keep, live, exported and read back from the store; a row kept before
    the figures said why reads as before."""
    import sqlite3

    from app.store import ChatStore, CompareHistory
    from engine.speculative import SPECULATION_FIGURES, speculation_off

    panel, _ = hud
    model = panel.compare.model
    several = (
        "speculation verifies the drafts of one answer; several candidates would accept different numbers of tokens "
        "per step"
    )
    missing = "the draft model could not be loaded: model not found: /m/small.gguf"
    ran = EngineOptions(device="cpu", kv_cache="static", candidates=2)
    for options, why in [(ran, several), (replace(ran, candidates=1, draft_model="/m/small.gguf"), missing)]:
        m = GenerationMetrics(new_tokens_total=4)
        speculation_off(m, why)
        panel.begin_generation("refused", options)
        panel.end_generation(m, options, "refused", {"speculation": why})
    kept = GenerationMetrics(new_tokens_total=4)
    speculation_off(kept)  # not asked for, or kept before the figures said why
    panel.end_generation(kept, ran, "plain")

    def tips(row: int) -> list[str]:
        return [model.data(model.index(row, COLUMN_INDEX[k]), Qt.ItemDataRole.ToolTipRole) for k in DRAFTS]

    DRAFTS = ("draft_tokens", "draft_model")
    expected = [
        [f"not used: speculation off: {several}"] * 2,
        [f"not used: speculation off: {missing}"] * 2,
        ["not used: speculation off"] * 2,
    ]
    assert [tips(i) for i in range(3)] == expected
    assert [model.data(model.index(i, COLUMN_INDEX["draft_model"])) for i in range(3)] == ["—"] * 3
    # the Speculation cell's "off" says why where drafting was asked for
    speculation = [model.index(i, COLUMN_INDEX["speculation"]) for i in range(3)]
    assert [model.data(i) for i in speculation] == ["off"] * 3
    assert [model.data(i, Qt.ItemDataRole.ToolTipRole) for i in speculation] == [
        f"speculation off: {several}",
        f"speculation off: {missing}",
        None,
    ]
    doc = json.loads(panel.export_compare_json(tmp_path / "c.json").read_text())["generations"]
    assert [g["options_unavailable"] for g in doc] == [
        {"draft_model": expected[0][0]},
        {},
        {"draft_model": expected[2][0]},
    ]
    with open(panel.export_compare_csv(tmp_path / "c.csv"), newline="") as f:
        assert json.loads(next(csv.DictReader(f))["options_unavailable"]) == {"draft_model": expected[0][0]}
    # kept with the chats and read back in the next run, as the main window restores them; a row stored before
    # the figures said why has a bare "speculation off" in its metrics
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path) as store:
        for r in model.rows:
            CompareHistory(store).add(r.index, r.label, r.options, r.metrics, r.model)
    older = sqlite3.connect(path)
    stored = json.loads(older.execute("SELECT metrics_json FROM compare_rows WHERE id = 1").fetchone()[0])
    stored["unavailable"].update(dict.fromkeys(SPECULATION_FIGURES, "speculation off"))
    older.execute("UPDATE compare_rows SET metrics_json = ? WHERE id = 1", (json.dumps(stored),))
    older.commit()
    older.close()
    model.clear()
    with ChatStore(path) as store:
        rows = CompareHistory(store).rows()
    panel.restore_compare(CompareRow(r.index, r.label, r.options, r.metrics, r.model) for r in rows)
    assert [tips(i) for i in range(3)] == [expected[2], expected[1], expected[2]]


def test_series_exports_equal_what_was_fed(hud, tmp_path):
    panel, clock = hud
    panel.begin_generation("g", EngineOptions(device="cpu"))
    recs = steps(1000.0, 40, 20.0)
    stream = samples(1000.0, 1001.0, 10.0, {"gpu_util_pct": None, "sm_activity_pct": None}, cpu_sources())
    # the generation's first sample says why the monitor leaves series empty (they were null without a reason)
    stream[0] = replace(stream[0], unavailable={"power_w": CPU_REASON, "sm_clock_mhz": CPU_REASON})
    panel.add_steps(recs)
    panel.add_samples(stream)
    clock.t = 1001.5
    m = metrics_for(recs, GPU_RUNGS[0], gpu=False)
    m.put("dram_bw_util_pct", 36.2, "DRAM bandwidth — estimate: bytes a step over the measured read bandwidth")
    panel.end_generation(m, EngineOptions(device="cpu"), "g")

    doc = json.loads(panel.export_series_json(tmp_path / "s.json").read_text())
    assert doc["t0"] == 1000.0
    assert [(s["t"], s["tokens_total"], s["step_ms"], s["profiled"]) for s in doc["steps"]] == [
        (r.t, r.tokens_total, r.step_ms, r.profiled) for r in recs
    ]
    for field in ("gpu_util_pct", "sm_activity_pct", "cpu_util_pct", "process_rss_bytes"):
        assert [s[field] for s in doc["samples"]] == [getattr(s, field) for s in stream]
    assert doc["sources"]["cpu_util_pct"] == "CPU util — process CPU time (time.process_time)"
    assert doc["unavailable"]["gpu_util_pct"] == CPU_REASON
    assert doc["unavailable"]["power_w"] == doc["unavailable"]["sm_clock_mhz"] == CPU_REASON
    assert doc["generations"][0]["label"] == "g" and doc["generations"][0]["t_end"] == recs[-1].t
    (estimate,) = doc["estimates"]

    with open(panel.export_series_csv(tmp_path / "s.csv"), newline="") as f:
        source, unavailable, *rows = list(csv.DictReader(f))
    # first each column's source and why a series has no values, as in the JSON (the CSV had neither)
    assert (source["kind"], unavailable["kind"]) == ("source", "unavailable")
    assert (source["t"], source["t_rel"]) == ("time.perf_counter() seconds", "seconds since the first record")
    assert source["cpu_util_pct"] == doc["sources"]["cpu_util_pct"] and source["step_ms"] == "engine step timings"
    assert unavailable["gpu_util_pct"] == unavailable["power_w"] == CPU_REASON and unavailable["cpu_util_pct"] == ""
    measured = [c for c in list(rows[0])[4:-1] if any(r[c] for r in rows if r["kind"] != "estimate")]
    assert measured and [c for c in measured if not source[c]] == []  # every number names its source (an estimate
    # row its own, below)
    step_rows = [r for r in rows if r["kind"] == "step"]
    sample_rows = [r for r in rows if r["kind"] == "sample"]
    assert [float(r["t"]) for r in rows] == sorted(float(r["t"]) for r in rows)
    assert [(float(r["t"]), int(r["tokens_total"]), float(r["step_ms"])) for r in step_rows] == [
        (r.t, r.tokens_total, r.step_ms) for r in recs
    ]
    assert [float(r["cpu_util_pct"]) for r in sample_rows] == [s.cpu_util_pct for s in stream]
    assert all(r["gpu_util_pct"] == "" for r in sample_rows)
    assert [int(r["process_rss_bytes"]) for r in sample_rows] == [s.process_rss_bytes for s in stream]
    # the DRAM estimate the HUD draws as a level: a row at each end of the time it describes
    levels = [(float(r["t"]), float(r["dram_bw_util_pct"])) for r in rows if r["kind"] == "estimate"]
    assert levels == [(estimate["t_start"], 36.2), (estimate["t_end"], 36.2)]
    assert {r["estimate_source"] for r in rows if r["kind"] == "estimate"} == {estimate["source"]}
    assert {r["estimate_source"] for r in rows if r["kind"] != "estimate"} == {""}


def test_png_exports_are_written(hud, qtbot, tmp_path):
    panel, clock = hud
    feed_gpu_session(panel, clock, n_steps=40)
    assert not panel.ladder_png.isEnabled()  # before a run the chart is empty (and was saved upside down)
    with pytest.raises(ValueError, match="the ladder has not run yet"):
        panel.export_ladder_png(tmp_path / "empty.png")
    panel.set_ladder_results(ladder_rows())
    assert panel.ladder_png.isEnabled()
    show_and_paint(qtbot, panel)
    for path in (panel.export_plots_png(tmp_path / "live.png"), panel.export_ladder_png(tmp_path / "ladder.png")):
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
        image = QImage(str(path))
        assert not image.isNull() and image.width() > 100 and image.height() > 100

    # The plots themselves, drawn again at the size asked for: the curves in their colours, no window controls.
    image = QImage(str(panel.export_plots_png(tmp_path / "big.png", 1200, 900)))
    assert (image.width(), image.height()) == (1200, 900)
    colors = plot_colors(image)
    assert {"#4e9af1", "#56b6c2", "#4cbf73"} <= colors  # tokens/s, step latency, GPU util
    assert image.pixelColor(2, 2) == panel.live.palette().color(QPalette.ColorRole.Base)  # no combo box corner
    with pytest.raises(ValueError, match="the image width must be 400 to 8000 pixels, got 50"):
        panel.export_plots_png(tmp_path / "tiny.png", 50, 400)
    # Narrower than a title with its source: the titles wrap, and the plots still fill the image to its foot
    # (a title on one line widened the layout, and the image was drawn scaled down with its lower part blank).
    image = QImage(str(panel.export_plots_png(tmp_path / "narrow.png", 400, 900)))
    background = image.pixelColor(2, 2)
    drawn = [y for y in range(900) if any(image.pixelColor(x, y) != background for x in range(0, 400, 2))]
    assert drawn[-1] > 860, drawn[-1]

    import html

    from PySide6.QtGui import QFont, QFontMetrics

    from ui.hud.export import _wrapped

    long = "source — " + "x" * 300  # one word longer than the line (a path, a URL): broken, not widening
    lines = html.unescape(_wrapped(long, 9, 200)).split("<br>")
    font = QFont()
    font.setPointSizeF(9)
    assert len(lines) > 2 and all(QFontMetrics(font).horizontalAdvance(line) <= 200 for line in lines)
    assert "".join(lines).replace(" ", "") == long.replace(" ", "")  # nothing cut

    # The buttons ask for a path, then write there.
    buttons = {b.text(): b for b in panel.findChildren(type(panel.compare.reference_button))}
    for text, name in (
        ("Series CSV…", "gapless-series.csv"),
        ("Export JSON…", "gapless-compare.json"),
        ("Plots PNG…", "gapless-live.png"),
    ):
        buttons[text].click()
        assert (tmp_path / name).stat().st_size > 0
    assert [name for _, name in panel.asked] == [
        "gapless-series.csv",
        "gapless-compare.json",
        f"{max(panel.live.width(), 800)}x{max(panel.live.height(), 600)}",
        "gapless-live.png",
    ]
    assert QImage(str(tmp_path / "gapless-live.png")).size().toTuple() == (900, 700)  # the size chosen


def plot_colors(image: QImage) -> set[str]:
    """The series colours (ui/hud/series_view.PLOTS) drawn somewhere in the image, antialiasing allowed for."""
    from ui.hud.series_view import PLOTS

    rgb = image.convertToFormat(QImage.Format.Format_RGB888)
    pixels = np.frombuffer(rgb.constBits(), np.uint8).reshape(rgb.height(), rgb.bytesPerLine())
    pixels = pixels[:, : 3 * rgb.width()].reshape(-1, 3).astype(int)
    found = set()
    for color in {p.color for p in PLOTS}:
        want = np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)])
        if (np.abs(pixels - want).max(axis=1) <= 24).any():
            found.add(color)
    return found


# ---- the ladder ------------------------------------------------------------------------------------------


def test_ladder_run_progress_cancel_and_chart(hud, qtbot):
    panel, _ = hud
    panel.show()
    panel.tabs.setCurrentIndex(2)
    ladder = panel.ladder
    assert ladder.run_button.isEnabled() and not ladder.cancel_button.isEnabled()
    with qtbot.waitSignal(panel.runLadderRequested, timeout=1000):
        qtbot.mouseClick(ladder.run_button, Qt.MouseButton.LeftButton)
    assert not ladder.run_button.isEnabled() and ladder.cancel_button.isEnabled() and ladder.progress.isVisible()

    panel.set_ladder_progress(2, 7, "+ device sampling")
    assert (ladder.progress.value(), ladder.progress.maximum()) == (2, 7)
    assert ladder.progress.format() == "2/7 — + device sampling"
    with qtbot.waitSignal(panel.cancelLadderRequested, timeout=1000):
        qtbot.mouseClick(ladder.cancel_button, Qt.MouseButton.LeftButton)

    rows = ladder_rows(gpu=False)  # CUDA graph and candidates are skipped on a CPU
    left_out = "without compile and CUDA graph (compile off for this bench)"
    rows[3] = replace(rows[3], notes=(left_out,))  # what a rung ran without is said beside it, as in the bench
    panel.set_ladder_results(rows)
    assert ladder.run_button.isEnabled() and not ladder.cancel_button.isEnabled() and not ladder.progress.isVisible()
    drawn = ladder.bar_values()
    ran = [(i, r) for i, r in enumerate(rows) if r.skipped is None]
    assert [(float(y), float(w)) for y, w in drawn["tok_s"]] == [(i, r.decode_tok_s) for i, r in ran]
    assert [(float(y), float(w)) for y, w in drawn["gap_pct"]] == [(i, r.kernel_gap_pct) for i, r in ran]
    texts = drawn["texts"]
    # skipped rungs are marked in the chart and say why in full under it, a shared reason once
    assert texts.count("skipped (2)") == 2 and not ladder.notes.isHidden()
    # and on a CPU which rungs ran in which dtype, as the bench says
    assert ladder.notes.text() == f"(1) {left_out}\n(2) CUDA graphs need a CUDA device\n{CPU_DTYPE_NOTE}"
    assert texts[0] == f"{rows[0].decode_tok_s:,.2f}  ×1.0"
    speedup = rows[3].decode_tok_s / rows[0].decode_tok_s
    assert texts[6] == f"{rows[3].decode_tok_s:,.2f}  ×{speedup:.1f} (1)"
    assert "5 presets ran, 2 skipped (reasons under the chart)" in ladder.status.text()
    # Every rung that ran is also a row of the compare table.
    labels = [r.label for r in panel.compare.model.rows]
    assert labels == [f"ladder · {r.label}" for _, r in ran]

    panel.set_ladder_failed("model unloaded")
    assert ladder.status.text() == "Ladder failed: model unloaded" and ladder.run_button.isEnabled()

    # Stopped after its first rung: the progress says so, and the summary tells the rungs not run from skipped ones.
    panel.set_ladder_progress(2, 7, "cancelled")
    assert ladder.status.text() == "Ladder cancelled" and ladder.progress.format() == "2/7 — cancelled"
    stopped = [rows[0], *(replace(r, skipped=LadderRow.NOT_RUN, metrics=None) for r in rows[1:3]), rows[5]]
    panel.set_ladder_results(stopped)
    assert ladder.status.text().startswith("1 preset ran, 1 skipped (reasons under the chart), 2 not run (the ladder")
    assert ladder.bar_values()["texts"][2:] == ["not run (1)", "", "not run (1)", "", "skipped (2)", ""]
    assert ladder.notes.text() == f"(1) cancelled before it ran\n(2) CUDA graphs need a CUDA device\n{CPU_DTYPE_NOTE}"


def test_a_rung_that_ran_without_a_figure_counts_as_ran_and_says_why(hud):
    """A rung whose answer ended at its first token (no decode step) or before the traced window was counted as
    skipped, and drew a bare "n/a": the reason was only in the Compare tab's tooltip."""
    panel, _ = hud
    rows = ladder_rows(gpu=False)[:3]
    no_decode = "no decode step ran: the answer ended at its first token"
    no_trace = "the answer ended before the traced window (decode steps 8-15)"
    metrics = {"new_tokens_total": 1, "unavailable": {"decode_tok_s": no_decode, "kernel_gap_pct": no_trace}}
    rows[1] = replace(rows[1], metrics=metrics)
    panel.set_ladder_results(rows)
    ladder = panel.ladder
    assert ladder.status.text().startswith("3 presets ran. Best: ")  # none skipped
    texts = ladder.bar_values()["texts"]
    assert texts[2:4] == ["n/a (1)", "n/a (2)"]
    assert ladder.notes.text().startswith(f"(1) {no_decode}\n(2) {no_trace}\n")
    assert texts[0].endswith("×1.0") and texts[4].startswith(f"{rows[2].decode_tok_s:,.2f}  ×")


@pytest.fixture
def large_font(qapp):
    """The application's font at 16 pt, as a user's larger system font makes it; restored afterwards."""
    before = qapp.font()
    font = QFont(before)
    font.setPointSizeF(16.0)
    qapp.setFont(font)
    yield font
    qapp.setFont(before)


def drawn_tick_texts(axis) -> list[str]:
    """The tick labels the axis draws (it leaves out any that would stick out of its own width)."""
    picture = QPicture()
    painter = QPainter(picture)
    try:
        return [text for _, _, text in axis.generateDrawSpecs(painter)[2]]
    finally:
        painter.end()


def test_ladder_row_labels_are_drawn_in_a_large_font(qtbot, large_font):
    """With a 16 pt font the ladder's axes were sized for 7 px a character: "+ half precision", "+ static KV
    cache" and most other preset names were left out, so the bars had no names."""
    from ui.hud.ladder_chart import LadderChart

    chart = LadderChart()
    qtbot.addWidget(chart)
    chart.resize(560, 700)
    chart.show()
    rows = ladder_rows()
    chart.set_results(rows)
    qtbot.wait(10)
    for plot in (chart.tok_plot, chart.gap_plot):
        assert drawn_tick_texts(plot.getAxis("left")) == [r.label for r in rows]


def test_live_plot_axes_keep_their_tick_labels_in_a_large_font(qtbot, large_font):
    """With a 16 pt font the plots' left axes stayed 48 px wide: the tokens/s axis (0 to 5000) drew no
    label at all, so its curve had no scale."""
    from ui.hud.series_view import PLOTS, SeriesView

    view = SeriesView(next(p for p in PLOTS if p.key == "tokens_per_s"))
    qtbot.addWidget(view)
    view.resize(520, 240)
    view.show()
    view.set_measured(True, None)
    x = np.linspace(0.0, 10.0, 200)
    view.set_data(x, np.full_like(x, 2093.0), None, 0.0, 10.0)
    view.plot.setXRange(0.0, 10.0, padding=0)
    qtbot.wait(10)
    assert drawn_tick_texts(view.plot.getAxis("left")) == ["2000", "4000"]  # the 0-5000 range, every 2000


def test_ladder_chart_keeps_a_long_source_within_a_narrow_dock(qtbot):
    from PySide6.QtCore import QSizeF

    from ui.hud.ladder_chart import LadderChart

    chart = LadderChart()
    qtbot.addWidget(chart)
    chart.resize(360, 700)
    chart.show()
    long = "op gap — torch.profiler CPU ops, 8-step window (sampled), decode thread only"
    rows = [
        replace(r, metrics=None if r.metrics is None else dict(r.metrics, kernel_gap_source=long))
        for r in ladder_rows(gpu=False)
    ]
    chart.set_results(rows)
    qtbot.wait(50)
    layout = chart.chart.ci
    needed = layout.effectiveSizeHint(Qt.SizeHint.MinimumSize, QSizeF(-1, -1)).width()
    assert needed <= chart.chart.width()  # the plots, bars and labels stay inside the visible chart
    tok_title, gap_title = chart.shown_titles()
    assert gap_title.startswith("Gap % — op gap") and gap_title.endswith("…")
    assert "decode thread only" in chart.chart.toolTip()  # the whole source, on hover
    chart.resize(1400, 700)
    qtbot.wait(50)
    assert chart.shown_titles()[1].endswith("decode thread only")


def test_full_synthetic_session_lengths_and_last_values(hud, qtbot):
    panel, clock = hud
    feed_gpu_session(panel, clock, n_steps=40)
    lengths, last = panel.series_lengths(), panel.last_values()
    n_steps = sum(40 * (1 if r.step_ms > 1 else 8) for r in GPU_RUNGS)
    assert lengths["steps"] == lengths["step_ms"] == n_steps
    assert lengths["samples"] == lengths["gpu_util_pct"] == lengths["sm_activity_pct"] > 0
    assert lengths["tokens_per_s"] == n_steps - 3 * (1 + 8 + 1)  # first, traced and first-after per generation
    assert last["gpu_util_pct"] is not None and last["tokens_per_s"] == pytest.approx(
        panel.series.values("tokens_per_s")[-1]
    )
    assert panel.compare.model.rowCount() == 3


def test_hud_follows_the_application_palette(hud, qapp):
    from ui.theme import DARK, LIGHT, ThemeManager

    panel, _ = hud
    theme = ThemeManager(qapp, "light")  # as a window switches it: the palette and the style sheet
    for choice, colors in (("dark", DARK), ("light", LIGHT)):
        theme.set_choice(choice)
        qapp.processEvents()  # palette changes reach widgets as posted events
        background = panel.live.view("tokens_per_s").plot_widget.backgroundBrush().color().name()
        assert background == colors.base
        assert panel.ladder.chart.backgroundBrush().color().name() == colors.base


def test_hud_fed_by_a_real_generation_on_a_tiny_model(hud, qtbot, tiny_llama, tmp_path):
    from engine.engine import Engine
    from engine.types import SamplingParams

    panel, clock = hud
    engine = Engine.load(str(tiny_llama), EngineOptions(device="cpu"))
    try:
        events = []

        def on_event(e):
            events.append(e)
            if isinstance(e, StepRecord):
                panel.add_steps([e])
            elif isinstance(e, MonitorSample):
                panel.add_samples([e])

        clock.t = time.perf_counter()
        panel.begin_generation("tiny", engine.options)
        result = engine.generate(
            [{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_new_tokens=48), on_event=on_event
        )
    finally:
        engine.close()
    clock.t = time.perf_counter()
    panel.end_generation(result.metrics, result.options, "tiny")
    records = [e for e in events if isinstance(e, StepRecord)]
    readings = [e for e in events if isinstance(e, MonitorSample)]
    assert records

    lengths = panel.series_lengths()
    assert lengths["steps"] == len(records) and lengths["samples"] == len(readings)
    assert lengths["gpu_util_pct"] == 0 and panel.last_values()["gpu_util_pct"] is None
    show_and_paint(qtbot, panel)
    reason = result.metrics.unavailable["gpu_util_pct"]
    assert panel.live.view("gpu_util_pct").na_label.text() == f"n/a — {reason}"
    # Records come in batches as timings reach the host; on a fast tiny model one batch may span the whole
    # traced window or more, so either curve may be empty. Each shows exactly its own records' peak.
    step_view = panel.live.view("step_ms")
    for curve, traced in ((step_view.curve, False), (step_view.profiled_curve, True)):
        _, y = curve_xy(curve)
        shown = y[np.isfinite(y)]
        wanted = [r.step_ms for r in records if r.profiled == traced]
        assert (shown.max() if shown.size else None) == (max(wanted) if wanted else None)
    if readings:
        assert panel.live.view("cpu_util_pct").label_text == "CPU (this process) — process CPU time (time.process_time)"

    row = panel.compare.model.rows[-1]
    assert row.metrics is result.metrics and row.options == result.options
    assert panel.bars.values()["kernel_gap_pct"]["source"] == (
        result.metrics.kernel_gap_source or f"n/a — {result.metrics.unavailable['kernel_gap_pct']}"
    )
    doc = json.loads(panel.export_series_json(tmp_path / "real.json").read_text())
    assert [(s["t"], s["tokens_total"], s["step_ms"]) for s in doc["steps"]] == [
        (r.t, r.tokens_total, r.step_ms) for r in records
    ]


def test_the_empty_ladder_tab_says_what_run_ladder_does(qtbot):
    from ui.hud.ladder_chart import LadderChart

    chart = LadderChart()
    qtbot.addWidget(chart)
    chart.show()
    assert not chart.figure.isVisible()  # no empty axes before a run
    assert chart.status.isVisible() and "every preset" in chart.status.text() and "Run ladder" in chart.status.text()
    chart.set_results(ladder_rows(gpu=False))
    assert chart.figure.isVisible()


def test_compare_columns_fit_the_deltas_a_new_row_adds(hud, qtbot):
    panel, _ = hud
    panel.show()
    panel.tabs.setCurrentIndex(1)
    qtbot.waitExposed(panel)
    view = panel.compare.view
    panel.end_generation(GenerationMetrics(decode_tok_s=11.3), EngineOptions(device="cpu"), "first")
    qtbot.wait(50)  # the table laid out with one row, as on screen between two answers
    panel.end_generation(GenerationMetrics(decode_tok_s=133.8), EngineOptions(device="cpu"), "second")
    qtbot.wait(50)
    col = COLUMN_INDEX["decode_tok_s"]
    assert panel.compare.model.data(panel.compare.model.index(1, col)) == "133.8 tok/s  ×11.84"
    assert view.horizontalHeader().sectionSize(col) >= view.sizeHintForColumn(col)  # the delta is not cut off


def test_an_export_that_fails_on_its_way_leaves_the_file_it_would_replace(qtbot, tmp_path):
    """A row whose label the encoding refuses (a lone surrogate, valid JSON in a recording) failed after the
    header was written: the user's earlier export was left as that header alone."""
    panel = HudPanel()
    qtbot.addWidget(panel)
    panel.compare.model.add(CompareRow(1, "ok", EngineOptions(device="cpu"), GenerationMetrics()))
    panel.compare.model.add(CompareRow(2, "bad \ud800", EngineOptions(device="cpu"), GenerationMetrics()))
    earlier = tmp_path / "c.csv"
    earlier.write_text("the user's earlier export\n")
    kept = earlier.read_bytes()
    with pytest.raises(UnicodeEncodeError):
        panel.export_compare_csv(earlier)
    assert earlier.read_bytes() == kept and sorted(p.name for p in tmp_path.iterdir()) == ["c.csv"]


def test_an_export_the_disk_cannot_take_or_with_no_folder_says_why_and_leaves_nothing_behind(
    hud, qtbot, tmp_path, monkeypatch
):
    """The PNGs were written by Qt straight to the chosen name: a disk that filled on the way left the user's earlier
    image as a truncated PNG, said as "could not write PNG to <path>" with no reason, and a folder that does not
    exist read the same. The CSV and JSON named the temporary file beside the one chosen ("No such file or
    directory: '<folder>/.c.csv.gjq9n8j1'"). Each export is now written whole or not at all, and says what, where
    and why."""
    panel, clock = hud
    feed_gpu_session(panel, clock, n_steps=40)
    panel.set_ladder_results(ladder_rows())
    show_and_paint(qtbot, panel)
    folder = tmp_path / "exports é ✓"  # a name of any script
    folder.mkdir()
    exports = {
        "the plots": lambda path: panel.export_plots_png(path, 800, 600),
        "the ladder chart": panel.export_ladder_png,
        "the time series": panel.export_series_csv,
        "the compare table": panel.export_compare_json,
    }
    earlier = folder / "earlier ü.png"
    earlier.write_bytes(b"the user's earlier export\n")
    with monkeypatch.context() as m:
        fill_the_disk(m)
        for what, write in exports.items():
            with pytest.raises(OSError) as caught:
                write(earlier)
            assert str(caught.value) == f"cannot write {what} to {earlier}: No space left on device"
            assert earlier.read_bytes() == b"the user's earlier export\n"
            assert [p.name for p in folder.iterdir()] == ["earlier ü.png"]  # no half file, no temporary one

    missing = tmp_path / "no such folder" / "x.png"
    for what, write in exports.items():
        with pytest.raises(OSError) as caught:
            write(missing)
        assert str(caught.value) == f"cannot write {what} to {missing}: the folder {missing.parent} does not exist"
    assert not missing.parent.exists()

    names = ("plots ✓.png", "ladder ✓.png", "series ✓.csv", "compare ✓.json")
    for write, name in zip(exports.values(), names):  # written whole, under the name chosen
        write(folder / name)
    assert QImage(str(folder / "plots ✓.png")).size().toTuple() == (800, 600)
    assert not QImage(str(folder / "ladder ✓.png")).isNull()
    assert (folder / "series ✓.csv").read_text().startswith("kind,t,t_rel,")
    assert len(json.loads((folder / "compare ✓.json").read_text())["generations"]) == len(panel.compare.model.rows)
    link = folder / "link.png"
    link.symlink_to(earlier)
    panel.export_ladder_png(link)  # written through the link, which stays
    assert link.is_symlink() and earlier.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The buttons say it in a message box.
    warned: list[str] = []
    monkeypatch.setattr("ui.hud.panel.QMessageBox.warning", lambda _parent, _title, text: warned.append(text))
    panel._save_dialog = lambda _parent, _caption, name, _filter: str(tmp_path / "no such folder" / name)
    panel._ask_ladder_png()
    panel._ask_series_csv()
    where = tmp_path / "no such folder"
    assert warned == [
        f"Cannot write the ladder chart to {where / 'gapless-ladder.png'}: the folder {where} does not exist",
        f"Cannot write the time series to {where / 'gapless-series.csv'}: the folder {where} does not exist",
    ]


def test_ladder_speedup_text_fits_beside_the_longest_bar_in_a_large_font(qtbot, large_font):
    """The tok/s axis reached 1.45 × the longest bar whatever the text beside it: at 16 pt "×166.0" was cut at the
    chart's right edge."""
    from ui.hud.ladder_chart import LadderChart

    chart = LadderChart()
    qtbot.addWidget(chart)
    chart.resize(560, 700)
    chart.show()
    chart.set_results(ladder_rows())
    qtbot.wait(10)
    view = chart.tok_plot.vb.sceneBoundingRect()
    for plot, text in chart._texts:
        if plot is chart.tok_plot:
            drawn = text.mapRectToScene(text.boundingRect())
            assert drawn.right() <= view.right() + 0.5, text.toPlainText()


def test_plots_png_keeps_its_tick_labels_in_a_large_font(hud, qtbot, tmp_path, large_font, monkeypatch):
    """The exported plots' left axes were 56 px whatever the font: at 16 pt the tokens/s plot had no scale."""
    import pyqtgraph as pg
    from pyqtgraph.exporters import ImageExporter

    panel, clock = hud
    feed_gpu_session(panel, clock, n_steps=40)
    show_and_paint(qtbot, panel)
    drawn: list[list[str]] = []
    real = ImageExporter.export

    def look_then_export(self, *args, **kwargs):
        for item in self.item.items:
            if isinstance(item, pg.PlotItem):
                drawn.append(drawn_tick_texts(item.getAxis("left")))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ImageExporter, "export", look_then_export)
    panel.export_plots_png(tmp_path / "large.png", 1200, 900)
    assert drawn and all(drawn), drawn  # every plot's scale has its numbers


AT_200_PERCENT = """
import json, sys
import numpy as np
from hud_streams import ManualClock, feed_gpu_session
from PySide6.QtGui import QColor, QImage
from PySide6.QtWidgets import QApplication

app = QApplication([])
from ui.hud import HudPanel
from ui.hud.export import save_plots
from ui.hud.series_view import PLOTS, SeriesView

color = QColor(PLOTS[0].color)


def thickness(image, x):  # in pixels: how much of the curve's colour column x holds around the line
    bg = image.pixelColor(x, 2).getRgb()[:3]
    k = max(range(3), key=lambda i: abs(color.getRgb()[i] - bg[i]))  # the channel the curve changes most
    cover = [(image.pixelColor(x, y).getRgb()[k] - bg[k]) / (color.getRgb()[k] - bg[k]) for y in range(image.height())]
    at = max(range(len(cover)), key=cover.__getitem__)
    return round(sum(c for c in cover[at - 4 : at + 5] if c > 0.2), 1)


clock = ManualClock(1000.0)
panel = HudPanel(clock=clock)
panel.resize(520, 1000)
feed_gpu_session(panel, clock, n_steps=40)
panel.show()
for _ in range(50):
    app.processEvents()
panel.live.paint(force=True)
views = panel.live.views.values()
widths = {
    "curves": sorted({c.opts["pen"].widthF() for v in views for c in (v.curve, v.estimate_curve, v.profiled_curve) if c}),
    "axes": sorted({v.plot.getAxis(a).pen().widthF() for v in views for a in ("left", "bottom")}),
    "boundaries": sorted({line.pen.widthF() for v in views for line in v.lines if line.isVisible()}),
    "ladder_axes": sorted({p.getAxis("left").pen().widthF() for p in (panel.ladder.tok_plot, panel.ladder.gap_plot)}),
}
flat = SeriesView(PLOTS[0])  # a level line: its thickness is the rows it covers
flat.resize(400, 200)
flat.set_measured(True, None)
flat.show()
flat.set_data(np.array([0.0, 10.0]), np.array([50.0, 50.0]), None, 0.0, 10.0)
flat.plot.setXRange(0, 10, padding=0)
flat.plot.setYRange(0, 100, padding=0)
for _ in range(20):
    app.processEvents()
shown = flat.plot_widget.grab().toImage()
out = sys.argv[1]
save_plots(out, [flat], 800, 400, QColor("white"), QColor("black"))
saved = QImage(out)
print(json.dumps({
    "dpr": shown.devicePixelRatio(), "widths": widths,
    "shown": thickness(shown, shown.width() * 3 // 4), "saved": thickness(saved, saved.width() * 3 // 4),
}))
"""


def test_plot_lines_are_as_wide_as_the_screen_s_scale(tmp_path):
    """Qt draws a cosmetic pen's width in device pixels: at a scale of 200 % the curves, axes, grid and generation
    lines were one device pixel, half as thick as at 100 % beside text twice the size (the grid all but gone).
    The exported PNG keeps the lines of a screen at 100 %: its size is in the image's own pixels."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    ui_tests = Path(__file__).parent
    root = ui_tests.parent.parent
    env = {
        **os.environ,
        "QT_QPA_PLATFORM": "offscreen",
        "QT_SCALE_FACTOR": "2",
        "PYTHONPATH": os.pathsep.join((str(root), str(ui_tests), str(root / "tests"))),
    }
    script = tmp_path / "at_200.py"
    script.write_text(AT_200_PERCENT, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "plots.png")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["dpr"] == 2.0
    assert got["widths"] == {"curves": [2.0], "axes": [2.0], "boundaries": [2.0], "ladder_axes": [2.0]}, got
    assert got["shown"] == 2.0, got  # one pixel of the plot's size, two of the screen's
    assert got["saved"] == 1.0, got


def test_generation_marks_read_on_the_plots_in_both_themes(hud, qtbot, qapp):
    """Each generation's "#N" over the plots was a fixed grey, 3.3:1 on the light theme's white (text needs 4.5:1),
    and a mark drawn before a theme change kept the old theme's colour."""
    from test_widgets import _contrast

    from ui.theme import DARK, LIGHT, ThemeManager

    panel, clock = hud
    theme = ThemeManager(qapp, "dark")  # as a window switches it: the palette and the style sheet
    feed_gpu_session(panel, clock, n_steps=40)
    show_and_paint(qtbot, panel)
    for choice, colors in (("light", LIGHT), ("dark", DARK)):
        theme.set_choice(choice)
        qapp.processEvents()  # palette changes reach widgets as posted events
        panel.live.paint(force=True)
        marks = [line for line in panel.live.view("tokens_per_s").lines if line.isVisible()]
        labelled = [line for line in marks if line.label.format]
        assert labelled, "no generation is marked"
        for line in marks:
            assert line.pen.color().name() == line.label.color.name()
            assert _contrast(line.label.color.name(), colors.base) >= 4.5, (colors.base, line.label.color.name())


def test_a_name_typed_without_a_suffix_is_exported_with_its_dialogs_suffix(qtbot, tmp_path):
    """The save dialogs set no default suffix: "series" typed in the CSV dialog was written as "series", with no
    ".csv", and a "series.csv" already there was written over without the dialog asking."""
    from dialog_driver import DialogDriver

    clock = ManualClock(1000.0)
    panel = HudPanel(clock=clock, size_dialog=lambda _parent, _w, _h: (800, 600))
    panel.resize(520, 1000)
    qtbot.addWidget(panel)
    feed_gpu_session(panel, clock, n_steps=40)
    panel.set_ladder_results(ladder_rows())
    show_and_paint(qtbot, panel)
    panel.last_folder = str(tmp_path)
    asks = {
        "series": panel._ask_series_csv,
        "series-doc": panel._ask_series_json,
        "compare": panel._ask_compare_csv,
        "compare-doc": panel._ask_compare_json,
        "plots": panel._ask_plots_png,
        "ladder": panel._ask_ladder_png,
    }
    for name, ask in asks.items():
        driver = DialogDriver().choose_file(tmp_path / name).start()
        ask()
        assert driver.done and driver.answered[0].folder == str(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "compare-doc.json",
        "compare.csv",
        "ladder.png",
        "plots.png",
        "series-doc.json",
        "series.csv",
    ]
    assert (tmp_path / "series.csv").read_text().startswith("kind,t,t_rel,")
    assert json.loads((tmp_path / "compare-doc.json").read_text())["generations"]
    assert QImage(str(tmp_path / "plots.png")).size().toTuple() == (800, 600)

    # The file of the name with its suffix is the one the dialog asks about replacing.
    (tmp_path / "series.csv").write_text("the user's earlier export\n")
    driver = DialogDriver().choose_file(tmp_path / "series").click("No").choose_file(None).start()
    panel._ask_series_csv()  # No, then Cancel
    assert driver.done and "series.csv already exists" in driver.answered[1].text
    assert (tmp_path / "series.csv").read_text() == "the user's earlier export\n"
