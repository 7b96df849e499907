"""The optimization ladder: one prompt through every preset, then decode tok/s and kernel gap per preset as
horizontal bars, with the speed-up over the first rung that ran. While it runs: a progress bar and Cancel.

Rows are the dicts of the engine's run_ladder: preset, label, options, skipped (reason or None), metrics,
decode_tok_s, kernel_gap_pct, kernel_gap_source.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFont, QFontMetrics, QPalette
from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QPushButton, QVBoxLayout, QWidget

from engine.types import CPU_DTYPE_NOTE, LadderRow
from ui.hud import fmt
from ui.theme import PaletteFollower, line_pen, muted_text

TOK_COLOR = "#4e9af1"
GAP_COLOR = "#e06c75"
INSIDE_TEXT = "#10131a"  # a figure written inside a gap bar: 5.7:1 on it (white was 3.3:1), in either theme
ROW_HEIGHT = 30
TOK_AXIS_MIN_REACH = 1.45  # the tok/s axis reaches at least this × the longest bar
TOK_TEXT_MAX_SHARE = 0.7  # of the view a bar's text may take; past it (a view a few characters wide) it is cut
LABEL_SLACK_PX = 6  # beyond the widest row label's advance: its drawn box is a little wider
TITLE_PT = 9


EMPTY_TEXT = (
    "Run ladder sends the last prompt of this chat through every preset, from Naive to the fastest, "
    "one after the other, and draws each one's decode tok/s and gap here (each also becomes a row of "
    "Compare). Chat waits while it runs; Cancel stops it."
)


RUN_TIP = "Run the current prompt through every preset and compare"


class LadderChart(PaletteFollower):
    runRequested = Signal()
    cancelRequested = Signal()

    def __init__(self, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.rows: list[LadderRow] = []
        self.running = False
        self._base: Optional[LadderRow] = None  # the first rung that ran: speed-ups are against it
        self.run_button = QPushButton("Run ladder")
        self.run_button.setToolTip(RUN_TIP)
        self.blocked = ""  # why the ladder cannot start now (a model loading); "" when it can
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setVisible(False)
        self.status = QLabel(EMPTY_TEXT)
        self.status.setWordWrap(True)
        self.run_button.clicked.connect(self._run_clicked)
        self.cancel_button.clicked.connect(self.cancelRequested)

        self.chart = pg.GraphicsLayoutWidget()
        self.chart.useOpenGL(False)
        # Stacked, one row per preset in each, so long preset names fit a narrow dock.
        self.tok_plot = self.chart.addPlot(row=0, col=0)
        self.gap_plot = self.chart.addPlot(row=1, col=0)
        for plot in (self.tok_plot, self.gap_plot):
            plot.setMenuEnabled(False)
            plot.setMouseEnabled(x=False, y=False)
            plot.hideButtons()
            plot.invertY(True)
            plot.showGrid(x=True, y=False, alpha=0.15)
        self.gap_plot.setYLink(self.tok_plot)
        self.gap_plot.setXRange(0, 100, padding=0.02)
        self._titles = ["Decode tok/s", "Kernel/op gap %"]
        self.tok_bars = pg.BarGraphItem(x0=[], y=[], width=[], height=0.6, brush=TOK_COLOR, pen=None)
        self.gap_bars = pg.BarGraphItem(x0=[], y=[], width=[], height=0.6, brush=GAP_COLOR, pen=None)
        self.tok_plot.addItem(self.tok_bars)
        self.gap_plot.addItem(self.gap_bars)
        self._texts: list[tuple[pg.PlotItem, pg.TextItem]] = []
        self.tok_plot.vb.sigResized.connect(self._fit_tok_range)

        buttons = QHBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.progress, 1)
        buttons.addWidget(self.cancel_button)
        self.buttons = buttons
        box = QVBoxLayout(self)
        box.setContentsMargins(0, 0, 0, 0)
        # Why each skipped rung was skipped, in full under the chart (numbered as the chart marks them); the
        # chart and these notes are what its PNG shows.
        self.notes = QLabel()
        self.notes.setObjectName("notice")
        self.notes.setWordWrap(True)
        self.notes.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.figure = QWidget()
        figure_box = QVBoxLayout(self.figure)
        figure_box.setContentsMargins(0, 0, 0, 0)
        figure_box.addWidget(self.chart, 1)
        figure_box.addWidget(self.notes)
        box.addLayout(buttons)
        box.addWidget(self.status)
        box.addWidget(self.figure, 1)
        box.addStretch(1)  # holds the empty tab's text at the top while there is no chart
        self.figure.hide()  # empty axes before a run would say nothing (and upside down)
        self.apply_palette()

    # ---- run state -------------------------------------------------------------------------------------

    def set_running(self, running: bool) -> None:
        self.running = running
        self.run_button.setEnabled(not running and not self.blocked)
        self.cancel_button.setEnabled(running)
        self.progress.setVisible(running)

    def set_blocked(self, why: str) -> None:
        """The ladder measures the loaded model: while none is, or another one loads, it cannot start (its rows
        would be credited to the model loaded when it was asked for)."""
        self.blocked = why
        self.run_button.setEnabled(not self.running and not why)
        self.run_button.setToolTip(why or RUN_TIP)

    def set_progress(self, done: int, total: int, label: str) -> None:
        if not self.running:
            self.set_running(True)
        self.progress.setRange(0, max(1, total))
        self.progress.setValue(done)
        self.progress.setFormat(f"{done}/{total} — {label}")
        self._say(f"Ladder {label}" if label in ("done", "cancelled") else f"Running {label}…")

    def set_failed(self, message: str) -> None:
        self.set_running(False)
        self._say(f"Ladder failed: {message}")

    def set_results(self, rows: list[LadderRow]) -> None:
        self.set_running(False)
        self.rows = list(rows)
        self.figure.setVisible(bool(self.rows))
        n = len(self.rows)
        ran = [r for r in self.rows if r.ran]  # a rung that ran without a tok/s figure ran too (its reason is said)
        base = next((r for r in ran if r.decode_tok_s is not None), None)
        self._say(self._summary(base, ran))
        ys = np.arange(n, dtype=float)
        tok = np.array([_num(r.decode_tok_s) for r in self.rows], dtype=float)
        gap = np.array([_num(r.kernel_gap_pct) for r in self.rows], dtype=float)
        has_tok, has_gap = np.isfinite(tok), np.isfinite(gap)
        self.tok_bars.setOpts(x0=np.zeros(int(has_tok.sum())), y=ys[has_tok], width=tok[has_tok], height=0.6)
        self.gap_bars.setOpts(x0=np.zeros(int(has_gap.sum())), y=ys[has_gap], width=gap[has_gap], height=0.6)
        ticks = [[(float(i), r.label or r.preset) for i, r in enumerate(self.rows)]]
        for plot in (self.tok_plot, self.gap_plot):
            axis = plot.getAxis("left")
            axis.setTicks(ticks)
            # in the font the axis draws with (the application's): it leaves out a label wider than itself
            metrics = QFontMetrics(axis.style["tickFont"] or QFont())
            text = max((metrics.horizontalAdvance(label) for _, label in ticks[0]), default=0)
            axis.setWidth(text + max(0, axis.style["tickLength"]) + axis.style["tickTextOffset"][0] + LABEL_SLACK_PX)
        self.tok_plot.setYRange(-0.6, max(n, 1) - 0.4, padding=0)
        sources = sorted({s for s in (r.kernel_gap_source for r in self.rows) if s})
        self._titles = ["Decode tok/s — engine timing", f"Gap % — {'; '.join(sources) if sources else fmt.NA}"]
        self._set_titles()
        self._base = base
        self._draw_texts(base)
        self._fit_tok_range()
        self.chart.setMinimumHeight(2 * (ROW_HEIGHT * max(n, 3) + 50))

    def _fit_tok_range(self) -> None:
        """The tok/s axis reaches far enough for the text beside each bar ("1,234.5  ×166.0 (1)") to fit: that
        text is as wide in pixels whatever the axis, so a larger font or a narrower dock needs more of it (a fixed
        1.45 × the longest bar cut the text at 16 pt)."""
        tok = [_num(r.decode_tok_s, 0.0) for r in self.rows]
        top = max(tok, default=0.0) or 1.0
        view_px = self.tok_plot.vb.width()
        reach = top * TOK_AXIS_MIN_REACH
        if view_px > 0:
            texts = [t for plot, t in self._texts if plot is self.tok_plot]
            for x, t in zip(tok, texts):
                share = min(t.boundingRect().width() / view_px, TOK_TEXT_MAX_SHARE)  # of the view, in pixels
                reach = max(reach, x / (1.0 - share))
        self.tok_plot.setXRange(0, reach, padding=0)

    def bar_values(self) -> dict[str, list]:
        """What the chart draws: (row, value) of each tok/s and gap bar, and the text beside each row."""
        return {
            "tok_s": list(zip(self.tok_bars.opts["y"], self.tok_bars.opts["width"])),
            "gap_pct": list(zip(self.gap_bars.opts["y"], self.gap_bars.opts["width"])),
            "texts": [t.toPlainText() for _, t in self._texts],
        }

    def _draw_texts(self, base: Optional[LadderRow]) -> None:
        for plot, t in self._texts:
            plot.removeItem(t)
        self._texts = []
        fg = self.palette().color(QPalette.ColorRole.Text)
        reasons: list[str] = []  # the notes' numbering: a reason shared by several rungs is written once

        def numbered(why: str) -> int:
            if why not in reasons:
                reasons.append(why)
            return reasons.index(why) + 1

        for i, r in enumerate(self.rows):
            if r.skipped is not None:
                tok_text, gap_text = f"{'not run' if r.cancelled else 'skipped'} ({numbered(r.skipped)})", ""
            else:
                v, b = r.decode_tok_s, base.decode_tok_s if base is not None else None
                speedup = f"  {fmt.ratio(v / b, 1)}" if v is not None and b else ""
                # what the rung left out (e.g. compile) is said beside its figure, as the bench's table does; a
                # figure it has none of, with why (a bare "n/a" said nothing, the reason only in Compare's tip)
                tok_text = f"{self._figure_text(r, 'decode_tok_s', numbered)}{speedup}" + "".join(
                    f" ({numbered(n)})" for n in r.notes
                )
                gap_text = self._figure_text(r, "kernel_gap_pct", numbered)
            for plot, text in ((self.tok_plot, tok_text), (self.gap_plot, gap_text)):
                x = _num(r.decode_tok_s if plot is self.tok_plot else r.kernel_gap_pct, 0.0)
                inside = plot is self.gap_plot and x > 75.0  # the gap axis stops at 100: write long bars' ends inside
                item = pg.TextItem(text, color=INSIDE_TEXT if inside else fg, anchor=(1, 0.5) if inside else (0, 0.5))
                item.setPos(x, i)
                plot.addItem(item, ignoreBounds=True)
                self._texts.append((plot, item))
        lines = [f"({k}) {why}" for k, why in enumerate(reasons, start=1)]
        if any((r.options or {}).get("device") == "cpu" for r in self.rows if r.skipped is None):
            lines.append(CPU_DTYPE_NOTE)  # which rungs ran in which dtype
        self.notes.setText("\n".join(lines))
        self.notes.setVisible(bool(lines))
        self._fit_notes()

    @staticmethod
    def _figure_text(row: LadderRow, key: str, numbered: Callable[[str], int]) -> str:
        f = row.figure(key)
        if f.value is not None:
            return fmt.percent(f.value) if key == "kernel_gap_pct" else fmt.number(f.value)
        return f"{fmt.NA} ({numbered(f.reason)})" if f.reason else fmt.NA

    def _summary(self, base: Optional[LadderRow], ran: list[LadderRow]) -> str:
        if not self.rows:
            return "The ladder returned no rows."
        not_run = sum(1 for r in self.rows if r.cancelled)
        skipped = len(self.rows) - len(ran) - not_run
        text = f"{len(ran)} preset{'s' if len(ran) != 1 else ''} ran"
        if skipped:
            text += f", {skipped} skipped (reasons under the chart)"
        if not_run:
            text += f", {not_run} not run (the ladder was stopped)"
        measured = [r for r in ran if r.decode_tok_s is not None]
        if base is not None and base.decode_tok_s and len(measured) > 1:
            best = max(measured, key=lambda r: r.decode_tok_s or 0.0)
            text += (
                f". Best: {best.label} at {fmt.number(best.decode_tok_s, 'tok/s')}, "
                f"{fmt.ratio((best.decode_tok_s or 0.0) / base.decode_tok_s, 1)} over {base.label}"
            )
        return text + "."

    def _run_clicked(self) -> None:
        self.set_running(True)
        self.progress.setRange(0, 0)  # busy until the first progress report
        self._say("Starting the ladder…")
        self.runRequested.emit()

    # ---- palette ---------------------------------------------------------------------------------------

    def apply_palette(self) -> None:
        pal = self.palette()
        fg = pal.color(QPalette.ColorRole.Text)
        muted = muted_text(pal)
        self.chart.setBackground(pal.color(QPalette.ColorRole.Base))
        for plot in (self.tok_plot, self.gap_plot):
            for name in ("left", "bottom"):
                plot.getAxis(name).setPen(line_pen(muted, self))
                plot.getAxis(name).setTextPen(pg.mkPen(fg))
        self._draw_texts(self._base)
        self._set_titles()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._set_titles()
        self._fit_notes()

    def _say(self, text: str) -> None:
        self.status.setText(text)
        self._fit_notes()

    def _fit_notes(self) -> None:
        """The summary and the notes ask for the height their wrapped lines take at the width they get: a wrapped
        label asks for fewer lines' than it then takes, so in a dock shorter than the chart and its text the notes
        were drawn over the gap chart and their last lines were cut off, in the tab and in its PNG."""
        for label in (self.status, self.notes):
            width = label.width() if label.isVisible() and label.width() > 0 else self.width()
            need = max(0, label.heightForWidth(width)) if label.text() else 0
            if need != label.minimumHeight():
                label.setMinimumHeight(need)

    def shown_titles(self) -> list[str]:
        """The plot titles as drawn (cut with "…" to fit, the whole of each in the chart's tooltip)."""
        return [plot.titleLabel.text for plot in (self.tok_plot, self.gap_plot)]

    def _set_titles(self) -> None:
        """A plot title asks the layout for its whole width, so a long source would widen the plots past the
        dock's edge and cut off their right side: each title is cut to the room beside the row labels, measured
        as drawn."""
        fg = self.palette().color(QPalette.ColorRole.Text).name()
        for plot, title in zip((self.tok_plot, self.gap_plot), self._titles):
            axis = plot.getAxis("left").effectiveSizeHint(Qt.SizeHint.MinimumSize).width()  # before it is laid out
            room = self.chart.width() - axis - 24
            label = plot.titleLabel

            def fits(n: int, plot=plot, title=title, label=label, room=room) -> bool:
                plot.setTitle(title if n >= len(title) else title[:n].rstrip() + "…", size=f"{TITLE_PT}pt", color=fg)
                return label.itemRect().width() <= room

            if not fits(len(title)):
                lo, hi = 1, len(title) - 1  # the longest cut that fits (at least one character)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
                fits(lo)
        self.chart.setToolTip("\n".join(self._titles))


def _num(v, default: float = np.nan) -> float:
    return default if v is None else float(v)
