"""Small pieces several views build the same way: the error line under a form, a column of panes without
margins."""

from __future__ import annotations

from typing import Union

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QLayout, QVBoxLayout, QWidget

Part = Union[QWidget, QLayout, tuple[QWidget, int]]  # a widget, a layout, or a widget with its stretch


def error_label(parent: QWidget, selectable: bool = False) -> QLabel:
    """A hidden, wrapping label styled as an error (the theme's #errorText); shown with the message when one comes."""
    label = QLabel(parent)
    label.setObjectName("errorText")
    label.setWordWrap(True)
    if selectable:  # a message worth copying into a bug report
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    label.hide()
    return label


def tight_column(parent: QWidget, *parts: Part) -> QVBoxLayout:
    """Stack the parts top to bottom on the parent, edge to edge: no margins, no spacing."""
    box = QVBoxLayout(parent)
    box.setContentsMargins(0, 0, 0, 0)
    box.setSpacing(0)
    for part in parts:
        if isinstance(part, tuple):
            box.addWidget(part[0], part[1])
        elif isinstance(part, QLayout):
            box.addLayout(part)
        else:
            box.addWidget(part)
    return box
