"""Driving the Optimizations panel as a user does: a choice in a combo box, and the options the panel emits."""

from __future__ import annotations

from engine.types import EngineOptions
from ui.toggles import TogglesPanel


def toggles_panel(qtbot, options: EngineOptions) -> tuple[TogglesPanel, list[EngineOptions]]:
    """A panel showing `options`, and the list every options change it emits is appended to."""
    panel = TogglesPanel(options)
    qtbot.addWidget(panel)
    emitted: list[EngineOptions] = []
    panel.optionsChanged.connect(emitted.append)
    return panel, emitted


def pick(combo, value) -> None:
    """Choose the entry whose data is `value`, as a click on it does (activated is a user's choice only)."""
    combo.setCurrentIndex(combo.findData(value))
    combo.activated.emit(combo.currentIndex())
