"""Live plots of the current session: tokens/s, step latency, tokens per step, GPU util, SM activity, DRAM bandwidth,
and on a machine without GPU counters the process's CPU use and memory instead.

Data rate and paint rate are separate (as in friture): the panel pushes records into LiveSeries' rings as they
arrive; a timer here repaints only while visible, only the curves whose data or time range changed, with only
the rows in the time window, decimated to the plot's pixel columns. The timer's rate adapts (PaintRate) so
painting keeps to a small share of the GUI thread. The headers (source and newest value) and the y ranges
refresh at `label_hz`. Each curve is created once and then only fed through setData. A series with nothing
measured shows "n/a — <reason>" in place of its plot.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Optional

import numpy as np
from PySide6.QtCore import QTimer
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from ui.hud import fmt
from ui.hud.paint_rate import PaintRate, budget_for
from ui.hud.ring import RingTable
from ui.hud.series import LiveSeries
from ui.hud.series_view import PLOTS, SeriesView
from ui.theme import PaletteFollower, muted_text

MIN_SPAN_S = 0.01  # the shortest span "all held" shows: a GPU's answer can take a fraction of a second
WINDOWS = (("last 10 s", 10.0), ("last 30 s", 30.0), ("last 60 s", 60.0), ("last 5 min", 300.0), ("all held", None))


class LivePlots(PaletteFollower):
    """The live plots over a LiveSeries. Call paint() / refresh_labels() to update now (both no-ops when hidden).

    `paint_hz` is the top paint rate; the timer slows down to `min_paint_hz` when a frame (feeding the curves
    and the paint events that follow) would otherwise take more than `paint_budget` of the GUI thread's time
    (by default a small share of the machine's cores, see paint_rate.budget_for).
    `clock` measures that cost (CPU time of the calling thread); `now` is the time a curve was last fed at
    (seconds, like the series' clock)."""

    def __init__(
        self,
        series: LiveSeries,
        paint_hz: float = 20.0,
        label_hz: float = 2.0,
        min_paint_hz: float = 2.0,
        paint_budget: Optional[float] = None,
        clock: Callable[[], float] = time.thread_time,
        now: Callable[[], float] = time.perf_counter,
        parent: Optional[QWidget] = None,
    ):
        super().__init__(parent)
        if not 0 < paint_hz <= 30 or not 1 <= label_hz <= 4:
            raise ValueError(
                f"paint rate must be in (0, 30] Hz and label rate in [1, 4] Hz, got {paint_hz}, {label_hz}"
            )
        self.series = series
        budget = budget_for(os.cpu_count()) if paint_budget is None else paint_budget
        self.rate = PaintRate(max_hz=paint_hz, min_hz=min_paint_hz, budget=budget)
        self._clock = clock
        self._now = now
        self.paint_count = 0  # paints that fed setData
        self.tick_count = 0  # paint-timer ticks
        self.window_s: Optional[float] = 60.0
        self._x_shown: Optional[tuple[float, float]] = None
        self._bounds_shown: Optional[tuple] = None
        self._layout_shown: Optional[tuple] = None
        self._boundary_pen = QColor()  # the generation boundaries and their "#N" (apply_palette)

        self.window_box = QComboBox()
        for text, seconds in WINDOWS:
            self.window_box.addItem(text, seconds)
        self.window_box.setCurrentIndex(2)
        self.window_box.setAccessibleName("Time shown")
        self.window_box.currentIndexChanged.connect(self._window_changed)
        # No setXLink: pyqtgraph links views by screen position, which goes wrong while some are hidden.
        # paint() gives every plot the same time range instead.
        self.views = {spec.key: SeriesView(spec, self.rate.add_render, clock) for spec in PLOTS}

        top = QHBoxLayout()
        top.setContentsMargins(2, 0, 2, 0)
        top.addWidget(QLabel("Time since the first record (s)"), 1)
        top.addWidget(self.window_box)
        box = self._box = QVBoxLayout(self)
        box.setContentsMargins(0, 0, 0, 0)
        box.setSpacing(4)
        box.addLayout(top)
        # What the rings dropped in a long session (hidden while they hold everything added).
        self.dropped_note = QLabel()
        self.dropped_note.setWordWrap(True)
        self.dropped_note.setVisible(False)
        box.addWidget(self.dropped_note)
        for view in self.views.values():
            box.addWidget(view, 1)

        # Both timers run only while the plots are visible (showEvent / hideEvent).
        self._paint_timer = QTimer(self)
        self._paint_timer.setInterval(self.rate.interval_ms)
        self._paint_timer.timeout.connect(self._tick)
        self._label_timer = QTimer(self)
        self._label_timer.setInterval(math.ceil(1000.0 / label_hz))
        self._label_timer.timeout.connect(self.refresh_labels)
        self.apply_palette()
        self._layout_axes()

    def view(self, name: str) -> SeriesView:
        return self.views[name]

    # ---- painting --------------------------------------------------------------------------------------

    def paint(self, force: bool = False) -> bool:
        """Feed the curves whose time range or width changed, and those whose data changed once the time axis
        has moved on by a pixel column since they were last fed (sooner, little could be seen: the newest
        column just grows), or at once with `force`. Returns whether any curve was fed."""
        if not self.isVisible():
            return False
        s = self.series
        now = self._now()
        t0 = s.t0
        # A held row always has its time, so first/last are None only for an empty ring (left out here).
        spans = [(ring.first("t"), ring.last("t")) for ring in (s.steps, s.samples) if len(ring)]
        ends = [(a, b) for a, b in spans if a is not None and b is not None]
        if t0 is None or not ends:
            return False
        # from the start of the generation the first record belongs to (its "#N" mark is drawn there)
        first = min(a for a, _ in ends)
        first = max((g.t_start for g in s.generations if g.t_start <= first), default=first)
        x_lo, x_hi = self._x_range(first - t0, max(b for _, b in ends) - t0)
        windows: dict[int, tuple[int, np.ndarray]] = {}  # ring -> (first row read, x), read once per paint

        def window(ring: RingTable) -> tuple[int, np.ndarray]:
            # Only the rows in the time window are read (one before it, so a line enters from the edge).
            if id(ring) not in windows:
                start = max(0, ring.search("t", x_lo + t0) - 1)
                windows[id(ring)] = (start, ring.column("t", start) - t0)
            return windows[id(ring)]

        fed = False
        for view in self.views.values():
            if not view.plotted:
                continue  # fed when it shows: its key is left as it was
            name = view.spec.key
            if view.estimate_curve is not None and view.estimates_key != s.spans_version:
                view.estimates_key = s.spans_version
                if s.estimates[name]:
                    view.set_estimates(s.estimates[name], t0)
                    fed = True
            ring = s.steps if view.spec.from_steps else s.samples
            key = (x_lo, x_hi, view.columns())
            if key == view.fed_key and (
                ring.version == view.fed_version or (not force and now - view.fed_at < (x_hi - x_lo) / key[2])
            ):
                continue
            view.fed_key, view.fed_version, view.fed_at = key, ring.version, now
            start, x = window(ring)
            profiled = ring.column("profiled", start) if name == "step_ms" else None
            view.set_data(x, ring.column(name, start), profiled, x_lo, x_hi)
            fed = True
        if (x_lo, x_hi) != self._x_shown:
            self._x_shown = (x_lo, x_hi)
            for view in self.views.values():
                view.plot.setXRange(x_lo, x_hi, padding=0.01)
        bounds = (s.spans_version, x_lo, self.cpu_mode())
        if bounds != self._bounds_shown:
            self._bounds_shown = bounds
            self._paint_boundaries(x_lo)
            fed = True
        if fed:
            self.paint_count += 1
        return fed

    def _x_range(self, first: float, latest: float) -> tuple[float, float]:
        """The time window shown. Its right end moves in steps of a tenth of the window, not on every paint:
        a range change repaints the axes and re-feeds every curve, so it is kept rare. Showing all that is held,
        the span grows in tenths of its 1-2-5 magnitude, for the same reason."""
        if self.window_s is None:
            held = max(latest - first, MIN_SPAN_S)
            step = fmt.nice_ceiling(held) / 10.0
            return first, first + math.ceil(held / step) * step
        step = self.window_s / 10.0
        x_hi = max(first + step, math.ceil(latest / step) * step)
        return max(first, x_hi - self.window_s), x_hi

    def refresh_labels(self) -> None:
        """Sources, newest values, n/a states and y ranges. Runs at the label rate, not the paint rate."""
        if not self.isVisible():
            return
        s = self.series
        last = s.header_values()
        cpu_mode = self.cpu_mode()
        for view in self.views.values():
            name = view.spec.key
            estimates = s.estimates.get(name)
            live = s.measured(name)
            measured = live or bool(estimates)
            current = None if live or not estimates else s.current_estimate(name)
            if live and last.get(name) is None and s.answer_reasons.get(name):  # none for the last answer: why
                source = f"{fmt.NA} for this answer: {s.answer_reasons[name]}"
            elif live:
                source = view.spec.source or fmt.bare_source(s.sources[name])
            elif current is not None:
                source = fmt.bare_source(current.source)
            elif estimates:  # an earlier answer's estimate is plotted; this one has none (yet, or with its reason)
                why = s.answer_reasons.get(name) or s.reasons.get(name)
                source = f"{fmt.NA} for this answer: {why}" if why else f"{fmt.NA} for this answer so far"
            else:
                source = None
            idle = s.steps.total == 0 if view.spec.from_steps else s.samples.total == 0
            # Why the last generation could not measure it, when known, even if no sample came in at all.
            reason = s.reasons.get(name) or (view.spec.idle_reason if idle else "not measured so far")
            view.set_measured(measured, None if measured else reason)
            view.set_header(source, last.get(name))
            view.fit_y()
        note = s.dropped_text()
        if note != self.dropped_note.text():
            self.dropped_note.setText(note)
            self.dropped_note.setVisible(bool(note))
        self._apply_layout(cpu_mode)

    def _apply_layout(self, cpu_mode: bool) -> None:
        """Which plots show and how the height is shared; applied only when it changes, as any change
        relayouts the whole column."""
        state = (cpu_mode, tuple(v.na_reason is None for v in self.views.values()))
        if state == self._layout_shown:
            return
        self._layout_shown = state
        for view in self.views.values():
            self._box.setStretchFactor(view, 1 if view.na_reason is None else 0)
            if view.spec.cpu:
                view.setVisible(cpu_mode)
        self._layout_axes()

    def cpu_mode(self) -> bool:
        """The process's CPU use and memory stand in for the GPU series when the GPU is not measured."""
        return not self.series.measured("gpu_util_pct")

    def _tick(self) -> None:
        self.tick_count += 1
        start = self._clock()
        fed = self.paint()
        interval = self.rate.frame(self._clock() - start, fed)
        if interval != self._paint_timer.interval():
            self._paint_timer.setInterval(interval)

    def _paint_boundaries(self, x_lo: float) -> None:
        t0 = self.series.t0 or 0.0
        spans = []
        for g in self.series.generations:
            end = None if g.t_end is None else g.t_end - t0
            if (end if end is not None else math.inf) >= x_lo:
                spans.append((g.t_start - t0, end, f"#{g.index}"))
        for i, view in enumerate(self.views.values()):
            view.set_boundaries(spans, self._boundary_pen, labelled=(i == 0))

    def _layout_axes(self) -> None:
        """Only the lowest visible plot carries the time axis."""
        shown = [v for v in self.views.values() if v.plotted]
        for view in self.views.values():
            if shown and view is shown[-1]:
                view.plot.showAxis("bottom")
            else:
                view.plot.hideAxis("bottom")

    def show_all_held(self) -> None:
        """The window spans all that is held (a replayed generation of a fraction of a second fills the width)."""
        self.window_box.setCurrentIndex(self.window_box.findData(None))

    def _window_changed(self, index: int) -> None:
        self.window_s = self.window_box.itemData(index)
        self.paint()

    # ---- visibility and palette ------------------------------------------------------------------------

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.refresh_labels()  # then only what changed while hidden is fed
        self.paint()
        self._paint_timer.start()
        self._label_timer.start()

    def hideEvent(self, event) -> None:
        self._paint_timer.stop()
        self._label_timer.stop()
        super().hideEvent(event)

    def apply_palette(self) -> None:
        pal = self.palette()
        background = pal.color(QPalette.ColorRole.Base)
        foreground = pal.color(QPalette.ColorRole.Text)
        muted = muted_text(pal)
        # the theme's secondary text, as the "#N" of each generation is text: a fixed grey was 3.3:1 on the light
        # theme's white
        self._boundary_pen = pal.color(QPalette.ColorRole.PlaceholderText)
        for view in self.views.values():
            view.apply_palette(background, foreground, muted)
        self._bounds_shown = None  # the generation boundaries are drawn again at the next paint
