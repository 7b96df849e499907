"""One live series in the HUD: a header (title — source, newest value) over either its plot or its
"n/a — reason" line, and what each series is (PlotSpec, PLOTS).

Cheap to repaint by construction: the curves are PlotCurveItems fed already-decimated data (no clipping or
downsampling left to pyqtgraph), the axes (and the grid the left axis draws) are cached as pixmaps so a curve
update does not replay their text, and the y range moves only in steps, at the label rate.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont, QFontMetrics, QPainter
from PySide6.QtWidgets import QGraphicsItem, QHBoxLayout, QLabel, QSizePolicy, QWidget

from ui.hud import fmt
from ui.hud.bars import ElidedLabel
from ui.hud.decimate import peak_decimate
from ui.hud.series import ESTIMATED_SERIES
from ui.parts import tight_column
from ui.theme import line_pen

TOKENS_SOURCE = "engine step records, rolling 1 s"
STEP_SOURCE = "engine step timings; traced window in orange"
TOKENS_PER_STEP_SOURCE = "engine step records: tokens kept / decode steps, each row while it runs"
PROFILED_COLOR = "#e8a33d"
LEFT_AXIS_PX = 48  # the least width of a plot's left axis; a larger font widens it (left_axis_px)
WIDE_VALUES = (88_888.0, 8_888.8, 888.88, 1_023.9 * (1 << 20), 999.9 * (1 << 30))  # the value label's width fits these


@dataclass(frozen=True)
class PlotSpec(fmt.ShownFigure):
    """A registered figure drawn live; its key names the LiveSeries series."""

    y_top: Optional[Callable[[float], float]] = None  # y range top from the largest value shown (None: fixed)
    cpu: bool = False  # shown instead of the GPU series when the GPU is not measured
    source: Optional[str] = None  # the source of an engine-side series; else the samples' own labels
    idle_reason: str = "no monitor samples yet"

    @property
    def axis_gib(self) -> bool:  # the data are bytes; the axis reads GiB (the data stay as fed)
        return self.figure.unit == "bytes"

    @property
    def from_steps(self) -> bool:
        """Drawn from the step records (else from the monitor samples)."""
        return "step" in self.figure.scopes


def _headroom(m: float) -> float:
    """A y range top a little above the largest value, on a round number."""
    return fmt.nice_ceiling(m * 1.05)


def _step_plot(name: str, color: str, source: str, y_top: Callable[[float], float] = _headroom) -> PlotSpec:
    """A series the engine's step records feed: idle until the first decode step."""
    return PlotSpec(name, color, y_top=y_top, source=source, idle_reason="no decode steps yet")


PLOTS = (
    _step_plot("tokens_per_s", "#4e9af1", TOKENS_SOURCE),
    _step_plot("step_ms", "#56b6c2", STEP_SOURCE),
    # Speculative decoding makes one step give several tokens; without it the line stays at 1.
    _step_plot("tokens_per_step", "#d19a66", TOKENS_PER_STEP_SOURCE, y_top=lambda m: max(2.0, _headroom(m))),
    PlotSpec("gpu_util_pct", "#4cbf73"),
    PlotSpec("sm_activity_pct", "#c678dd"),
    # An estimate from counted bytes over a peak bandwidth can pass 100 % (figures.OVER_100): the range grows.
    PlotSpec("dram_bw_util_pct", "#e06c75", y_top=lambda m: max(100.0, _headroom(m))),
    # CPU use counts every core (100% = one core busy), so the range grows a core at a time.
    PlotSpec("cpu_util_pct", "#4cbf73", cpu=True, y_top=lambda m: max(100.0, 100.0 * math.ceil(m / 100.0))),
    PlotSpec("process_rss_bytes", "#c678dd", cpu=True, y_top=_headroom),
)


def left_axis_px() -> int:
    """The width of a plot's left axis: room for a five-digit tick label ("20000") in the font the axis draws
    with (the application's), beside the tick (5 px) and its gap (5 px). pyqtgraph leaves out a label that does
    not fit, so a fixed width lost every label of the tokens/s axis to a 16 pt font."""
    return max(LEFT_AXIS_PX, QFontMetrics(QFont()).horizontalAdvance("88888") + 10)


class MeteredPlotWidget(pg.PlotWidget):
    """A PlotWidget that reports the time each of its paint events takes, so the paint rate can be budgeted."""

    def __init__(self, on_paint: Callable[[float], None], clock: Callable[[], float] = time.thread_time):
        super().__init__()
        self.setFocusPolicy(Qt.FocusPolicy.NoFocus)  # nothing in a plot answers a key: not a Tab stop
        self._on_paint = on_paint
        self._clock = clock

    def paintEvent(self, event) -> None:
        start = self._clock()
        super().paintEvent(event)
        self._on_paint(self._clock() - start)


class TitleLabel(ElidedLabel):
    """A plot's header: the title in bold, then " — source", which ends in "…" where it does not fit; text()
    and the tooltip keep the whole line. Like any ElidedLabel it takes no width of its own."""

    def __init__(self, title: str, parent: Optional[QWidget] = None):
        super().__init__(title, parent)
        self.title = title
        self.source = ""

    def set_source(self, source: str) -> None:
        self.source = source
        self.setText(f"{self.title} — {source}")
        self.setToolTip(self.text())

    def _bold(self) -> QFont:
        font = QFont(self.font())
        font.setBold(True)
        return font

    def shown_source(self) -> str:
        """The part after the title drawn at the current width."""
        if not self.source:
            return ""
        room = self.contentsRect().width() - QFontMetrics(self._bold()).horizontalAdvance(self.title)
        return self.fontMetrics().elidedText(f" — {self.source}", Qt.TextElideMode.ElideRight, max(0, room))

    def paintEvent(self, event) -> None:
        p = QPainter(self)
        rect = self.contentsRect()
        flags = int(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
        p.setPen(self.palette().color(self.foregroundRole()))
        p.setFont(self._bold())
        p.drawText(rect, flags, self.title)
        rect.setLeft(rect.left() + QFontMetrics(self._bold()).horizontalAdvance(self.title))
        p.setFont(self.font())
        p.drawText(rect, flags, self.shown_source())
        p.end()


class SeriesView(QWidget):
    """One series: a header (title — source, newest value) over either its plot or its "n/a — reason" line.
    `on_paint` hears the duration of each of the plot's paint events (seconds, from `clock`)."""

    def __init__(
        self,
        spec: PlotSpec,
        on_paint: Callable[[float], None] = lambda s: None,
        clock: Callable[[], float] = time.thread_time,
        parent: Optional[QWidget] = None,
    ):
        super().__init__(parent)
        self.spec = spec
        self.na_reason: Optional[str] = None
        self.fed_key: Optional[tuple] = None  # time range and width the curves were last fed for (LivePlots decides)
        self.fed_version: Optional[int] = None  # the ring's version then
        self.fed_at = 0.0  # and when
        self.estimates_key: Optional[int] = None
        self._source: Optional[str] = ""  # no header set yet
        self._measured: Optional[tuple] = None
        self._shown_max: Optional[float] = None  # largest value drawn right of the window's left edge
        self._estimate_spans = np.empty((0, 3))  # each estimate's start, end (plot x) and level
        self._window: Optional[tuple[float, float]] = None  # the time range last drawn
        self._data_max: Optional[float] = None  # the largest value of the curves last drawn in it
        self._y_top: Optional[float] = None
        self.title = TitleLabel(spec.title)
        self.value = QLabel(fmt.NA)
        self.value.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        # A fixed size: a label whose text changes at the label rate would otherwise ask its window for a new
        # layout each time, and in a dock that repaints the whole HUD.
        widest = max(self.value.fontMetrics().horizontalAdvance(spec.format(v)) for v in WIDE_VALUES)
        self.value.setFixedSize(widest + 8, self.value.sizeHint().height())
        self.na_label = QLabel()
        self.na_label.setWordWrap(True)
        self.axis_px = left_axis_px()
        self.na_label.setContentsMargins(self.axis_px + 4, 2, 4, 6)

        self.plot_widget = MeteredPlotWidget(on_paint, clock)
        self.plot_widget.useOpenGL(False)
        self.plot_widget.setMinimumHeight(52)
        self.plot = self.plot_widget.getPlotItem()
        self.plot.setMenuEnabled(False)
        self.plot.setMouseEnabled(x=False, y=False)
        self.plot.hideButtons()
        self.plot.showGrid(x=False, y=True, alpha=0.15)
        left = self.plot.getAxis("left")
        left.setWidth(self.axis_px)
        if spec.axis_gib:
            left.enableAutoSIPrefix(False)
            left.setScale(1.0 / (1 << 30))
            left.setLabel("GiB")
        for name in ("left", "bottom"):
            # Redrawn only when their range changes; a curve update repaints a pixmap, not the tick text.
            self.plot.getAxis(name).setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
        self.plot.disableAutoRange()
        self.plot.setYRange(0, 100 if spec.figure.unit == "%" else 1, padding=0.02)
        # Their pens are set with the axes' (apply_palette), at the screen's scale.
        self.curve = self._curve("finite")
        self.profiled_curve = None
        self.estimate_curve = None
        if spec.key in ESTIMATED_SERIES:
            self.estimate_curve = self._curve("pairs")  # separate segments, a handful of points, drawn as pairs
        if spec.key == "step_ms":
            self.profiled_curve = self._curve("finite")
        self.lines: list[pg.InfiniteLine] = []  # generation boundaries, a pool reused as they scroll by

        header = QHBoxLayout()
        header.setContentsMargins(2, 0, 2, 0)
        header.addWidget(self.title, 1)
        header.addWidget(self.value)
        tight_column(self, header, (self.plot_widget, 1), self.na_label)
        self.set_measured(False, spec.idle_reason)

    def _curve(self, connect: str) -> pg.PlotCurveItem:
        curve = pg.PlotCurveItem(pen=line_pen(self.spec.color, self), antialias=False, connect=connect)
        self.plot.addItem(curve)
        return curve

    @property
    def plotted(self) -> bool:
        """Whether the plot is on screen (not hidden as a CPU series, not replaced by its n/a line)."""
        return not self.isHidden() and not self.plot_widget.isHidden()

    def columns(self) -> int:
        """Pixel columns the data area spans: the most points worth drawing is two per column."""
        width = int(self.plot.vb.width())
        return width if width > 0 else max(1, self.plot_widget.width() - self.axis_px)

    def set_measured(self, measured: bool, reason: Optional[str]) -> None:
        state = (measured, reason)
        if state == self._measured:
            return  # re-applying the same state would still relayout the whole column of plots
        self._measured = state
        self.na_reason = None if measured else (reason or "not measured so far")
        self.na_label.setText(f"{fmt.NA} — {self.na_reason}" if self.na_reason else "")
        self.plot_widget.setVisible(measured)
        self.na_label.setVisible(not measured)
        # An n/a series shrinks to its two lines, leaving the height to the plots that have data.
        vertical = QSizePolicy.Policy.Expanding if measured else QSizePolicy.Policy.Maximum
        self.setSizePolicy(QSizePolicy.Policy.Preferred, vertical)

    @property
    def label_text(self) -> str:
        """The header as one line of text: "title — source" once a source is set."""
        return self.title.text()

    def set_header(self, source: Optional[str], value: Optional[float]) -> None:
        if source != self._source:
            self._source = source
            self.title.set_source(source or fmt.NA)
        self.value.setText(self.spec.format(value))

    def set_data(self, x: np.ndarray, y: np.ndarray, profiled: Optional[np.ndarray], x_lo: float, x_hi: float) -> None:
        """Draws y over x (sorted; rows before x_lo only let the line enter from the edge), decimated to the
        plot's pixel columns; with `profiled`, the traced rows go to the orange curve instead."""
        if not np.isfinite(y).any():
            x = y = np.empty(0)  # nothing measured in the window: nothing drawn, not even zeros
        columns = self.columns()
        shown = []
        if self.profiled_curve is not None and profiled is not None:
            traced = profiled > 0.5
            if traced.any():
                tx, ty = peak_decimate(x, np.where(traced, y, np.nan), x_lo, x_hi, columns)
                self.profiled_curve.setData(tx, ty)
                shown.append(ty[tx >= x_lo])
                y = np.where(traced, np.nan, y)
            elif self.profiled_curve.xData is not None and self.profiled_curve.xData.size:
                self.profiled_curve.setData(np.empty(0), np.empty(0))  # the traced window left the view
        dx, dy = peak_decimate(x, y, x_lo, x_hi, columns)
        self.curve.setData(dx, dy)
        shown.append(dy[dx >= x_lo])
        # The decimated curves keep every extreme, so their largest value is the data's.
        top = max((float(np.fmax.reduce(a)) for a in shown if a.size), default=math.nan)
        self._window, self._data_max = (x_lo, x_hi), top if math.isfinite(top) else None
        self._shown_max = self._larger(self._data_max, self._estimates_max())
        if self._y_top is None:
            self.fit_y()  # the first data: no waiting for the label timer

    def fit_y(self) -> None:
        """Moves the y range top (in 1-2-5 steps) to fit what is shown; fixed ranges stay."""
        if self.spec.y_top is None or self._shown_max is None:
            return
        top = self.spec.y_top(self._shown_max)
        if top != self._y_top:
            self._y_top = top
            self.plot.setYRange(0, top, padding=0.02)

    def set_estimates(self, estimates, t0: float) -> None:
        """Each estimate as a dashed level over the time it describes."""
        if self.estimate_curve is None:
            raise ValueError(f"the {self.spec.key} plot draws no estimates")
        self._estimate_spans = np.array(
            [[e.t_start - t0, e.t_end - t0, e.value] for e in estimates], dtype=float
        ).reshape(-1, 3)
        # each level a segment of its own (the curve's "pairs"): start and end at its value
        self.estimate_curve.setData(self._estimate_spans[:, :2].ravel(), np.repeat(self._estimate_spans[:, 2], 2))
        self._shown_max = self._larger(self._data_max, self._estimates_max())
        self.fit_y()

    def _estimates_max(self) -> Optional[float]:
        """The highest estimate level over the time range last drawn (all of them before any was): one that has
        left it kept the range stretched (a 250 % level long ago laid the 10 % ones in view flat on the bottom)."""
        spans = self._estimate_spans
        if self._window is not None:
            x_lo, x_hi = self._window
            spans = spans[(spans[:, 1] >= x_lo) & (spans[:, 0] <= x_hi)]
        return float(spans[:, 2].max()) if spans.size else None

    @staticmethod
    def _larger(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return b if a is None else a if b is None else max(a, b)

    def set_boundaries(self, spans: list[tuple[float, Optional[float], str]], pen: QColor, labelled: bool) -> None:
        needed = sum(1 if end is None else 2 for _, end, _ in spans)
        while len(self.lines) < needed:
            line = pg.InfiniteLine(
                angle=90,
                movable=False,
                label="" if labelled else None,
                labelOpts={"position": 0.97, "color": pen, "anchors": [(0, 0), (0, 0)]},
            )
            self.plot.addItem(line, ignoreBounds=True)
            self.lines.append(line)
        i = 0
        for start, end, label in spans:
            for x, style, text in ((start, Qt.PenStyle.SolidLine, label), (end, Qt.PenStyle.DashLine, "")):
                if x is None:
                    continue
                line = self.lines[i]
                line.setPen(line_pen(pen, self, style=style))
                line.setValue(x)
                line_label = getattr(line, "label", None)  # only the top plot's lines carry one
                if line_label is not None:
                    line_label.setFormat(text)
                    line_label.setColor(pen)  # a line of the pool made before a theme change
                line.show()
                i += 1
        for line in self.lines[i:]:
            line.hide()

    def boundary_values(self) -> list[float]:
        return [float(line.value()) for line in self.lines if line.isVisible()]

    def apply_palette(self, background: QColor, foreground: QColor, muted: QColor) -> None:
        """The colours, and the lines' widths at the screen's scale (called again when either changes)."""
        self.plot_widget.setBackground(background)
        for name in ("left", "bottom"):
            axis = self.plot.getAxis(name)
            axis.setPen(line_pen(muted, self))  # its grid lines too
            axis.setTextPen(pg.mkPen(foreground))
        self.curve.setPen(line_pen(self.spec.color, self))
        if self.estimate_curve is not None:
            self.estimate_curve.setPen(line_pen(self.spec.color, self, style=Qt.PenStyle.DashLine))
        if self.profiled_curve is not None:
            self.profiled_curve.setPen(line_pen(PROFILED_COLOR, self))
        self.na_label.setStyleSheet(f"color: {muted.name()};")
