"""The figures of the last generation as numbers and small bars: kernel/op gap, TTFT, decode and prefill tok/s,
p50/p99 step latency, peak memory. Each row names its source (cut to the dock's width with "…", in full in the
tooltip); a figure the engine did not measure is "n/a" with its reason in the tooltip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPalette, QPen
from PySide6.QtWidgets import QGridLayout, QLabel, QSizePolicy, QVBoxLayout, QWidget

from engine import figures
from engine.diagnosis import Diagnosis
from engine.errors import one_line
from engine.types import EngineOptions, GenerationMetrics
from ui.hud import fmt
from ui.theme import PaletteFollower, muted_text


@dataclass(frozen=True)
class BarRow(fmt.ShownFigure):
    """A registered figure shown as a bar."""

    scale_group: Optional[str] = None  # rows sharing one bar scale (p50 and p99)

    @property
    def percent(self) -> bool:  # bar scale 0-100 rather than the session's largest
        return self.figure.unit == "%"


BAR_ROWS = (
    BarRow("kernel_gap_pct", "#e06c75"),
    BarRow("ttft_ms", "#e8a33d"),
    BarRow("decode_tok_s", "#4e9af1"),
    BarRow("prefill_tok_s", "#56b6c2"),
    BarRow("step_ms_p50", "#4cbf73", scale_group="step"),
    BarRow("step_ms_p99", "#4cbf73", scale_group="step"),
    BarRow("peak_memory_bytes", "#c678dd"),
)


def _count(n: Optional[int]) -> str:
    return fmt.NA if n is None else str(n)


class MiniBar(QWidget):
    """A thin horizontal bar; no fill at all when the figure is n/a."""

    def __init__(self, color: str, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.color = QColor(color)
        self.fraction: Optional[float] = None
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumWidth(40)

    def sizeHint(self) -> QSize:
        return QSize(90, 10)

    def set_fraction(self, fraction: Optional[float]) -> None:
        self.fraction = None if fraction is None else min(1.0, max(0.0, fraction))
        self.update()

    def paintEvent(self, event) -> None:
        p = QPainter(self)
        track = QColor(self.palette().color(QPalette.ColorRole.Text))
        track.setAlpha(40)
        r = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        if self.fraction is None:
            pen = QPen(track, 1, Qt.PenStyle.DashLine)
            p.setPen(pen)
            p.drawRect(r)
        else:
            p.fillRect(r, track)
            p.fillRect(QRectF(r.left(), r.top(), r.width() * self.fraction, r.height()), self.color)
        p.end()


class ElidedLabel(QLabel):
    """A one-line label that shows as much of its text as fits, ending in "…"; text() stays the full text.
    It takes no width of its own, so a long source never widens the dock."""

    def __init__(self, text: str = "", parent: Optional[QWidget] = None):
        super().__init__(text, parent)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)

    def minimumSizeHint(self) -> QSize:
        return QSize(0, super().minimumSizeHint().height())

    def shown_text(self) -> str:
        """What is drawn at the current width."""
        return self.fontMetrics().elidedText(self.text(), Qt.TextElideMode.ElideRight, self.contentsRect().width())

    def paintEvent(self, event) -> None:
        p = QPainter(self)
        self.style().drawItemText(
            p,
            self.contentsRect(),
            int(self.alignment()),
            self.palette(),
            self.isEnabled(),
            self.shown_text(),
            self.foregroundRole(),
        )
        p.end()


# of a generation's label (the model's name, a recording's) in the header, on one line: a model name of 250
# characters without a break made the HUD 1,630 px wide, and one of 200,000 (a recording's) held the window 104 s
LABEL_CHARS = 80


class BarStrip(PaletteFollower):
    """Numbers and bars of one generation. Bars of unbounded figures are relative to the session's largest."""

    def __init__(self, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.header = QLabel("No generation yet")
        self.header.setWordWrap(True)
        self._largest: dict[str, float] = {}
        self._shown: Optional[str] = None  # the generation whose figures are shown
        self._rows: dict[str, tuple[QLabel, MiniBar, QLabel, QLabel]] = {}
        grid = QGridLayout()
        grid.setContentsMargins(2, 0, 2, 0)
        grid.setHorizontalSpacing(8)
        grid.setVerticalSpacing(2)
        for i, row in enumerate(BAR_ROWS):
            name, bar, value, source = QLabel(row.title), MiniBar(row.color), QLabel(fmt.NA), ElidedLabel()
            value.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            for col, w in enumerate((name, value, bar, source)):
                grid.addWidget(w, i, col)
            self._rows[row.key] = (name, bar, value, source)
        grid.setColumnStretch(2, 2)
        grid.setColumnStretch(3, 3)
        # What limits the shown generation, in words (engine.diagnosis); the figures behind it in the tooltip.
        self.diagnosis = QLabel("")
        self.diagnosis.setObjectName("diagnosis")
        self.diagnosis.setWordWrap(True)
        self.diagnosis.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.diagnosis.hide()
        box = QVBoxLayout(self)
        box.setContentsMargins(0, 0, 0, 0)
        box.addWidget(self.header)
        box.addWidget(self.diagnosis)
        box.addLayout(grid)
        self.apply_palette()

    def set_running(self, label: str) -> None:
        label = one_line(label, LABEL_CHARS)
        shown = self._shown is not None
        self.header.setText(
            f"Running: {label} — "
            + ("the figures below are from the previous generation" if shown else "its figures show when it ends")
        )

    def set_failed(self, message: str) -> None:
        """The running generation failed: it has no figures, so those shown stay, named as another's."""
        self.header.setText(
            f"The last generation failed: {message}"
            + (f" — the figures below are from {self._shown}" if self._shown is not None else "")
        )

    def set_metrics(self, metrics: GenerationMetrics, options: EngineOptions, label: str, d: Diagnosis) -> None:
        """The figures of a finished generation, and what limited it (engine.diagnosis)."""
        self._shown = label = one_line(label, LABEL_CHARS)
        n = metrics.new_tokens_total
        self.header.setText(f"{label} · {_count(n)} new token{'' if n == 1 else 's'} · {fmt.options_summary(options)}")
        self.diagnosis.setText(f"Limit: {d.line}")
        self.diagnosis.setToolTip(
            "\n".join(
                ["From: " + "; ".join(d.evidence) if d.evidence else "From: no figures"]
                + ([f"Missing: {'; '.join(d.missing)}"] if d.missing else [])
            )
        )
        self.diagnosis.show()
        for row in BAR_ROWS:
            v = figures.shown(metrics, row.key).value
            if v is not None:
                group = row.scale_group or row.key
                self._largest[group] = max(self._largest.get(group, 0.0), float(v))
        for row in BAR_ROWS:
            name, bar, value, source = self._rows[row.key]
            fig = figures.shown(metrics, row.key)
            v, src = fig.value, fig.source
            name.setText(fig.spec.label)
            value.setText(row.format(v))
            if v is None:
                reason = fig.reason or "not measured in this generation"
                source.setText(f"{fmt.NA} — {reason}")
                bar.set_fraction(None)
                tip = f"{fig.spec.label}: {fmt.NA} — {reason}"
            else:
                source.setText(src or "source not reported")
                largest = 100.0 if row.percent else self._largest.get(row.scale_group or row.key, 0.0)
                bar.set_fraction(float(v) / largest if largest > 0 else 0.0)
                scale = (
                    "bar: 0–100%" if row.percent else f"bar: share of this session's largest ({row.format(largest)})"
                )
                tip = f"{fig.spec.label}: {row.format(v)} — {src or 'source not reported'}\n{scale}"
            for w in (name, bar, value, source):
                w.setToolTip(tip)

    def values(self) -> dict[str, dict]:
        """What each row shows: text, source line and bar fraction (None when n/a)."""
        return {
            key: {"text": value.text(), "source": source.text(), "fraction": bar.fraction}
            for key, (_, bar, value, source) in self._rows.items()
        }

    def apply_palette(self) -> None:
        muted = muted_text(self.palette())
        for _, _, _, source in self._rows.values():
            source.setStyleSheet(f"color: rgba({muted.red()},{muted.green()},{muted.blue()},{muted.alpha()});")
