"""How a Progress report is shown: one place for the bar and the line beside it."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QProgressBar

from engine.types import Progress


def show_progress(bar: QProgressBar, line: QLabel, p: Progress) -> None:
    """The bar follows the fraction (busy when it is unknown); the line says what happens now."""
    line.setText(p.message or p.stage)
    if p.fraction is None:
        bar.setRange(0, 0)
    else:
        bar.setRange(0, 1000)
        bar.setValue(int(1000 * max(0.0, min(1.0, p.fraction))))
    bar.show()
