"""Live plots of the current session: tokens/s, step latency, GPU util, SM activity, DRAM bandwidth, and on a
machine without GPU counters the process's CPU use and memory instead.

Data rate and paint rate are separate (as in friture): the panel pushes records into LiveSeries' rings as they
arrive; a timer here repaints at most `paint_hz` times a second, only what changed, and only while visible;
the headers (source and newest value) refresh at `label_hz`. Each curve is created once and then only fed
through setData. A series with nothing measured shows "n/a — <reason>" in place of its plot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt, QTimer
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QSizePolicy, QVBoxLayout, QWidget

from ui.hud import fmt
from ui.hud.series import ESTIMATED_SERIES, LiveSeries

TOKENS_SOURCE = "engine step records, rolling 1 s"
STEP_SOURCE = "engine step timings; traced window in orange"
PROFILED_COLOR = "#e8a33d"
BOUNDARY_COLOR = "#8a8f98"
WINDOWS = (("last 10 s", 10.0), ("last 30 s", 30.0), ("last 60 s", 60.0), ("last 5 min", 300.0), ("all held", None))


@dataclass(frozen=True)
class PlotSpec:
    name: str  # the LiveSeries series
    title: str
    format: Callable[[Optional[float]], str]
    color: str
    axis_gib: bool = False  # the data are bytes; the axis reads GiB (the data stay as fed)
    percent: bool = False  # fixed 0-100 y range
    y_top: Optional[Callable[[float], float]] = None  # y range top from the largest value shown (None: fixed)
    cpu: bool = False  # shown instead of the GPU series when the GPU is not measured
    source: Optional[str] = None  # fixed source of an engine-side series; else the samples' own labels
    idle_reason: str = "no monitor samples yet"


PLOTS = (
    PlotSpec("tokens_per_s", "Tokens/s", lambda v: fmt.number(v, "tok/s"), "#4e9af1",
             y_top=lambda m: fmt.nice_ceiling(m * 1.05), source=TOKENS_SOURCE, idle_reason="no decode steps yet"),
    PlotSpec("step_ms", "Step latency", lambda v: fmt.number(v, "ms"), "#56b6c2",
             y_top=lambda m: fmt.nice_ceiling(m * 1.05), source=STEP_SOURCE, idle_reason="no decode steps yet"),
    PlotSpec("gpu_util_pct", "GPU util", fmt.percent, "#4cbf73", percent=True),
    PlotSpec("sm_activity_pct", "SM activity", fmt.percent, "#c678dd", percent=True),
    PlotSpec("dram_bw_util_pct", "DRAM bandwidth", fmt.percent, "#e06c75", percent=True),
    # CPU use counts every core (100% = one core busy), so the range grows a core at a time.
    PlotSpec("cpu_util_pct", "CPU (this process)", fmt.percent, "#4cbf73", cpu=True,
             y_top=lambda m: max(100.0, 100.0 * math.ceil(m / 100.0))),
    PlotSpec("process_rss_bytes", "Process memory", fmt.size, "#c678dd", axis_gib=True, cpu=True,
             y_top=lambda m: fmt.nice_ceiling(m * 1.05)),
)


class SeriesView(QWidget):
    """One series: a header (title — source, newest value) over either its plot or its "n/a — reason" line."""

    def __init__(self, spec: PlotSpec, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.spec = spec
        self.label_text = spec.title
        self.na_reason: Optional[str] = None
        self.title = QLabel(spec.title)
        self.title.setTextFormat(Qt.TextFormat.RichText)
        self.title.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.value = QLabel(fmt.NA)
        self.value.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        self.na_label = QLabel()
        self.na_label.setWordWrap(True)
        self.na_label.setContentsMargins(52, 2, 4, 6)

        self.plot_widget = pg.PlotWidget()
        self.plot_widget.useOpenGL(False)
        self.plot_widget.setMinimumHeight(52)
        self.plot = self.plot_widget.getPlotItem()
        self.plot.setMenuEnabled(False)
        self.plot.setMouseEnabled(x=False, y=False)
        self.plot.hideButtons()
        self.plot.setClipToView(True)
        self.plot.setDownsampling(auto=True, mode="peak")
        self.plot.showGrid(x=False, y=True, alpha=0.15)
        self.plot.getAxis("left").setWidth(48)
        if spec.axis_gib:
            left = self.plot.getAxis("left")
            left.enableAutoSIPrefix(False)
            left.setScale(1.0 / (1 << 30))
            left.setLabel("GiB")
        self.plot.disableAutoRange()
        self.plot.setYRange(0, 100 if spec.percent else 1, padding=0.02)
        self.curve = self.plot.plot(pen=pg.mkPen(spec.color, width=1), antialias=False, connect="finite")
        self.profiled_curve = None
        self.estimate_curve = None
        if spec.name in ESTIMATED_SERIES:
            # Separate segments, a handful of points: drawn as pairs, never clipped or downsampled (either
            # could split a pair).
            self.estimate_curve = self.plot.plot(pen=pg.mkPen(spec.color, width=1, style=Qt.PenStyle.DashLine),
                                                 antialias=False, connect="pairs")
            self.estimate_curve.setClipToView(False)
            self.estimate_curve.setDownsampling(ds=1, auto=False)
        if spec.name == "step_ms":
            self.profiled_curve = self.plot.plot(pen=pg.mkPen(PROFILED_COLOR, width=1), antialias=False,
                                                 connect="finite")
        self.lines: list[pg.InfiniteLine] = []  # generation boundaries, a pool reused as they scroll by
        self._y_top = None

        header = QHBoxLayout()
        header.setContentsMargins(2, 0, 2, 0)
        header.addWidget(self.title, 1)
        header.addWidget(self.value)
        box = QVBoxLayout(self)
        box.setContentsMargins(0, 0, 0, 0)
        box.setSpacing(0)
        box.addLayout(header)
        box.addWidget(self.plot_widget, 1)
        box.addWidget(self.na_label)
        self.set_measured(False, spec.idle_reason)

    def set_measured(self, measured: bool, reason: Optional[str]) -> None:
        self.na_reason = None if measured else (reason or "not measured so far")
        self.na_label.setText(f"{fmt.NA} — {self.na_reason}" if self.na_reason else "")
        self.plot_widget.setVisible(measured)
        self.na_label.setVisible(not measured)
        # An n/a series shrinks to its two lines, leaving the height to the plots that have data.
        vertical = QSizePolicy.Policy.Expanding if measured else QSizePolicy.Policy.Maximum
        self.setSizePolicy(QSizePolicy.Policy.Preferred, vertical)

    def set_header(self, source: Optional[str], value: Optional[float]) -> None:
        self.label_text = f"{self.spec.title} — {source or fmt.NA}"
        self.title.setText(f"<b>{self.spec.title}</b> — {source or fmt.NA}")
        self.title.setToolTip(self.label_text)
        self.value.setText(self.spec.format(value))

    def set_data(self, x: np.ndarray, y: np.ndarray, profiled: Optional[np.ndarray], x_lo: float) -> None:
        shown = y[x >= x_lo]
        if self.profiled_curve is not None and profiled is not None:
            traced = profiled > 0.5
            self.profiled_curve.setData(x, np.where(traced, y, np.nan))
            y = np.where(traced, np.nan, y)
        self.curve.setData(x, y)
        if self.spec.y_top is not None:
            finite = shown[np.isfinite(shown)]
            top = self.spec.y_top(float(finite.max())) if finite.size else 1.0
            if top != self._y_top:
                self._y_top = top
                self.plot.setYRange(0, top, padding=0.02)

    def set_estimates(self, estimates, t0: float) -> None:
        """Each estimate as a dashed level over the time it describes."""
        x = np.array([[e.t_start - t0, e.t_end - t0] for e in estimates], dtype=float).ravel()
        y = np.array([[e.value, e.value] for e in estimates], dtype=float).ravel()
        self.estimate_curve.setData(x, y)

    def set_boundaries(self, spans: list[tuple[float, Optional[float], str]], pen: QColor, labelled: bool) -> None:
        needed = sum(1 if end is None else 2 for _, end, _ in spans)
        while len(self.lines) < needed:
            line = pg.InfiniteLine(angle=90, movable=False, label="" if labelled else None,
                                   labelOpts={"position": 0.97, "color": pen, "anchors": [(0, 0), (0, 0)]})
            self.plot.addItem(line, ignoreBounds=True)
            self.lines.append(line)
        i = 0
        for start, end, label in spans:
            for x, style, text in ((start, Qt.PenStyle.SolidLine, label), (end, Qt.PenStyle.DashLine, "")):
                if x is None:
                    continue
                line = self.lines[i]
                line.setPen(pg.mkPen(pen, width=1, style=style))
                line.setValue(x)
                label = getattr(line, "label", None)  # only the top plot's lines carry one
                if label is not None:
                    label.setFormat(text)
                line.show()
                i += 1
        for line in self.lines[i:]:
            line.hide()

    def boundary_values(self) -> list[float]:
        return [float(line.value()) for line in self.lines if line.isVisible()]

    def apply_palette(self, background: QColor, foreground: QColor, muted: QColor) -> None:
        self.plot_widget.setBackground(background)
        for name in ("left", "bottom"):
            axis = self.plot.getAxis(name)
            axis.setPen(pg.mkPen(muted, width=1))
            axis.setTextPen(pg.mkPen(foreground))
        self.na_label.setStyleSheet(f"color: {muted.name()};")


class LivePlots(QWidget):
    """The live plots over a LiveSeries. Call paint() / refresh_labels() to update now (both no-ops when hidden)."""

    def __init__(self, series: LiveSeries, paint_hz: float = 20.0, label_hz: float = 2.0,
                 parent: Optional[QWidget] = None):
        super().__init__(parent)
        if not 0 < paint_hz <= 30 or not 1 <= label_hz <= 4:
            raise ValueError(f"paint rate must be in (0, 30] Hz and label rate in [1, 4] Hz, got {paint_hz}, {label_hz}")
        self.series = series
        self.paint_count = 0  # paints that fed setData
        self.tick_count = 0  # paint-timer ticks
        self.window_s: Optional[float] = 60.0
        self._painted = None
        self._x_shown: Optional[tuple[float, float]] = None
        self._bounds_shown: Optional[tuple] = None
        self._boundary_pen = QColor(BOUNDARY_COLOR)

        self.window_box = QComboBox()
        for text, seconds in WINDOWS:
            self.window_box.addItem(text, seconds)
        self.window_box.setCurrentIndex(2)
        self.window_box.currentIndexChanged.connect(self._window_changed)
        # No setXLink: pyqtgraph links views by screen position, which goes wrong while some are hidden.
        # paint() gives every plot the same time range instead.
        self.views = {spec.name: SeriesView(spec) for spec in PLOTS}

        top = QHBoxLayout()
        top.setContentsMargins(2, 0, 2, 0)
        top.addWidget(QLabel("Time since the first record (s)"), 1)
        top.addWidget(self.window_box)
        box = self._box = QVBoxLayout(self)
        box.setContentsMargins(0, 0, 0, 0)
        box.setSpacing(4)
        box.addLayout(top)
        for view in self.views.values():
            box.addWidget(view, 1)

        # Both timers run only while the plots are visible (showEvent / hideEvent).
        self._paint_timer = QTimer(self)
        self._paint_timer.setInterval(math.ceil(1000.0 / paint_hz))
        self._paint_timer.timeout.connect(self._tick)
        self._label_timer = QTimer(self)
        self._label_timer.setInterval(math.ceil(1000.0 / label_hz))
        self._label_timer.timeout.connect(self.refresh_labels)
        self.apply_palette()
        self._layout_axes()

    def view(self, name: str) -> SeriesView:
        return self.views[name]

    # ---- painting --------------------------------------------------------------------------------------

    def paint(self) -> bool:
        """Feed the curves what changed since the last paint. Returns whether anything was fed."""
        if not self.isVisible():
            return False
        s = self.series
        version = (s.version, self.window_s, self.cpu_mode())
        if version == self._painted:
            return False
        self._painted = version
        xs_step, xs_sample = s.x(s.steps), s.x(s.samples)
        latest = max([float(a[-1]) for a in (xs_step, xs_sample) if a.size], default=None)
        if latest is None:
            return False
        first = float(min(a[0] for a in (xs_step, xs_sample) if a.size))
        x_lo, x_hi = self._x_range(first, latest)
        # Only the rows in the time window go to pyqtgraph (one before it, so a line enters from the edge).
        i_step = max(0, int(np.searchsorted(xs_step, x_lo)) - 1)
        i_sample = max(0, int(np.searchsorted(xs_sample, x_lo)) - 1)
        profiled = s.steps.column("profiled")[i_step:]
        for view in self.views.values():
            name = view.spec.name
            if view.isHidden():
                continue
            if view.estimate_curve is not None and s.estimates[name]:
                view.set_estimates(s.estimates[name], s.t0 or 0.0)
            ys = s.values(name)
            if not np.isfinite(ys).any():
                continue
            if name in ("tokens_per_s", "step_ms"):
                view.set_data(xs_step[i_step:], ys[i_step:], profiled if name == "step_ms" else None, x_lo)
            else:
                view.set_data(xs_sample[i_sample:], ys[i_sample:], None, x_lo)
        if (x_lo, x_hi) != self._x_shown:
            self._x_shown = (x_lo, x_hi)
            for view in self.views.values():
                view.plot.setXRange(x_lo, x_hi, padding=0.01)
        if (s.spans_version, x_lo, self.cpu_mode()) != self._bounds_shown:
            self._bounds_shown = (s.spans_version, x_lo, self.cpu_mode())
            self._paint_boundaries(x_lo)
        self.paint_count += 1
        return True

    def _x_range(self, first: float, latest: float) -> tuple[float, float]:
        """The time window shown. Its right end moves in steps of a tenth of the window, not on every paint:
        a range change makes pyqtgraph reprocess every curve, so it is kept rare."""
        span = self.window_s if self.window_s is not None else max(latest - first, 1.0)
        step = span / 10.0
        x_hi = max(first + step, math.ceil(latest / step) * step)
        x_lo = first if self.window_s is None else max(first, x_hi - span)
        return x_lo, x_hi

    def refresh_labels(self) -> None:
        """Sources, newest values and n/a states. Runs at the label rate, not the paint rate."""
        if not self.isVisible():
            return
        s = self.series
        last = s.last_values()
        cpu_mode = self.cpu_mode()
        for view in self.views.values():
            name = view.spec.name
            estimates = s.estimates.get(name)
            measured = s.measured(name) or bool(estimates)
            if s.measured(name):
                source = view.spec.source or fmt.bare_source(s.sources[name])
            elif estimates:
                source = fmt.bare_source(estimates[-1].source)
            else:
                source = None
            idle = s.steps.total == 0 if name in ("tokens_per_s", "step_ms") else s.samples.total == 0
            reason = view.spec.idle_reason if idle else (s.reasons.get(name) or "not measured so far")
            view.set_measured(measured, None if measured else reason)
            self._box.setStretchFactor(view, 1 if measured else 0)
            view.set_header(source, last.get(name))
            if view.spec.cpu:
                view.setVisible(cpu_mode)
        self._layout_axes()

    def cpu_mode(self) -> bool:
        """The process's CPU use and memory stand in for the GPU series when the GPU is not measured."""
        return not self.series.measured("gpu_util_pct")

    def _tick(self) -> None:
        self.tick_count += 1
        self.paint()

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
        shown = [v for v in self.views.values() if not v.isHidden() and not v.plot_widget.isHidden()]
        for view in self.views.values():
            if shown and view is shown[-1]:
                view.plot.showAxis("bottom")
            else:
                view.plot.hideAxis("bottom")

    def _window_changed(self, index: int) -> None:
        self.window_s = self.window_box.itemData(index)
        self.paint()

    # ---- visibility and palette ------------------------------------------------------------------------

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self._painted = self._x_shown = self._bounds_shown = None
        self.refresh_labels()
        self.paint()
        self._paint_timer.start()
        self._label_timer.start()

    def hideEvent(self, event) -> None:
        self._paint_timer.stop()
        self._label_timer.stop()
        super().hideEvent(event)

    def changeEvent(self, event) -> None:
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange:
            self.apply_palette()

    def apply_palette(self) -> None:
        pal = self.palette()
        background = pal.color(QPalette.ColorRole.Base)
        foreground = pal.color(QPalette.ColorRole.Text)
        muted = QColor(foreground)
        muted.setAlpha(150)
        self._boundary_pen = QColor(BOUNDARY_COLOR)
        for view in self.views.values():
            view.apply_palette(background, foreground, muted)
        self._painted = None
