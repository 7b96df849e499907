"""Text from outside the program is shown as text, never read as HTML.

A model's answer, an imported chat, a GGUF's metadata, a server's error: Qt renders a label's or a tooltip's text
as HTML whenever it looks like HTML (Qt::mightBeRichText), and HTML can draw a fake button, or an image that
Qt reads from any local path (a FIFO or /dev/zero hangs or ends the app). So every label is plain text, and every
tooltip is shown as plain text, wherever its text came from. The application-wide filter does this for widgets
and item views alike, so a label added later is covered without anyone remembering to.
"""

from __future__ import annotations

from typing import Optional

from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtGui import QHelpEvent
from PySide6.QtGui import Qt as GuiQt  # the namespace with convertFromPlainText
from PySide6.QtWidgets import QAbstractItemView, QApplication, QLabel, QToolTip, QWidget


def tooltip_of(widget: QWidget, event: QHelpEvent) -> str:
    """The tooltip `widget` would show at the event's position: an item view's item's, a widget's own place's
    (`tooltip_at`, e.g. the link under the pointer), or its tooltip."""
    view = widget.parent()
    if isinstance(view, QAbstractItemView) and view.viewport() is widget:
        tip = view.indexAt(event.pos()).data(Qt.ItemDataRole.ToolTipRole)
        return tip if isinstance(tip, str) else ""
    at = getattr(widget, "tooltip_at", None)
    if at is not None:
        return at(event.pos())
    return widget.toolTip()


class PlainTextGuard(QObject):
    """Makes every QLabel plain text as it is first shown, and shows every tooltip as plain text."""

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        kind = event.type()
        if kind == QEvent.Type.Polish and isinstance(obj, QLabel):
            if obj.textFormat() == Qt.TextFormat.AutoText:
                obj.setTextFormat(Qt.TextFormat.PlainText)
        elif kind == QEvent.Type.ToolTip and isinstance(obj, QWidget) and isinstance(event, QHelpEvent):
            tip = tooltip_of(obj, event)
            if tip:
                QToolTip.showText(event.globalPos(), GuiQt.convertFromPlainText(tip), obj)
            else:
                QToolTip.hideText()
            return True
        return False


_guard: Optional[PlainTextGuard] = None


def install(app: QApplication) -> None:
    """Once per application (installing it again does nothing)."""
    global _guard
    if _guard is None:
        _guard = PlainTextGuard(app)
        app.installEventFilter(_guard)
