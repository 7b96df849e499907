"""Text from outside the program is shown as text, never read as HTML.

A model's answer, an imported chat, a GGUF's metadata, a server's error: Qt renders a label's or a tooltip's text
as HTML whenever it looks like HTML (Qt::mightBeRichText), and HTML can draw a fake button, or an image that
Qt reads from any local path (a FIFO or /dev/zero hangs or ends the app). So every label left to guess is plain
text (a label of the program's own markup says so: Qt.RichText), and every tooltip is shown as plain text,
wherever its text came from. The application-wide filter does this for widgets and item views alike, so a label
added later is covered without anyone remembering to.
"""

from __future__ import annotations

from typing import Optional

from PySide6.QtCore import QEvent, QObject, QPoint, Qt
from PySide6.QtGui import QHelpEvent
from PySide6.QtGui import Qt as GuiQt  # the namespace with convertFromPlainText
from PySide6.QtWidgets import (
    QAbstractItemView,
    QAbstractScrollArea,
    QApplication,
    QGraphicsView,
    QHeaderView,
    QLabel,
    QMenu,
    QTabBar,
    QToolTip,
    QWidget,
)


def _own_tip(widget: QWidget, pos: QPoint) -> str:
    """The tooltip `widget` itself has at `pos` (its coordinates), as Qt would find it; "" for none."""
    tip: object = None
    area = widget.parentWidget()
    if isinstance(area, QAbstractScrollArea) and area.viewport() is widget:  # a view's viewport: the view's
        if isinstance(area, QAbstractItemView):
            tip = area.indexAt(pos).data(Qt.ItemDataRole.ToolTipRole)
        elif isinstance(area, QGraphicsView):
            item = area.itemAt(pos)
            tip = item.toolTip() if item is not None else None
        elif hasattr(area, "tooltip_at"):  # e.g. the link under the pointer in an answer
            tip = area.tooltip_at(pos)
    elif isinstance(widget, QHeaderView):
        section = widget.logicalIndexAt(pos)
        model = widget.model()
        if section >= 0 and model is not None:
            tip = model.headerData(section, widget.orientation(), Qt.ItemDataRole.ToolTipRole)
    elif isinstance(widget, QTabBar):
        index = widget.tabAt(pos)
        tip = widget.tabToolTip(index) if index >= 0 else None
    elif isinstance(widget, QMenu):
        action = widget.actionAt(pos)
        if action is not None and widget.toolTipsVisible() and action.toolTip() != action.text().replace("&", ""):
            tip = action.toolTip()
    return tip if isinstance(tip, str) and tip else widget.toolTip()


def tooltip_of(widget: QWidget, pos: QPoint) -> str:
    """The tooltip shown for the pointer at `pos` over `widget`: its own, else its parents', as Qt passes an
    unanswered help event up to the parent."""
    w: Optional[QWidget] = widget
    while w is not None:
        tip = _own_tip(w, pos)
        if tip:
            return tip
        if w.isWindow():
            break
        pos = w.mapToParent(pos)
        w = w.parentWidget()
    return ""


def show_tip(global_pos: QPoint, tip: str, widget: QWidget) -> None:
    """Show `tip` as the text it is (never as HTML): escaped into HTML, which Qt's tooltip label wraps at spaces
    where a long tip needs it (a plain text tip never wraps)."""
    QToolTip.showText(global_pos, GuiQt.convertFromPlainText(tip, Qt.WhiteSpaceMode.WhiteSpaceNormal), widget)


def _is_tip_label(label: QLabel) -> bool:
    """Qt's own tooltip window, a QLabel: it shows show_tip's escaped HTML, which as plain text would show its
    tags ("<p>Copy&nbsp;this…</p>")."""
    return label.metaObject().className() == "QTipLabel"


class PlainTextGuard(QObject):
    """Makes every QLabel left to guess plain text as it is first shown, and shows tooltips as plain text."""

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        kind = event.type()
        if kind == QEvent.Type.Polish and isinstance(obj, QLabel):
            if obj.textFormat() == Qt.TextFormat.AutoText and not _is_tip_label(obj):
                obj.setTextFormat(Qt.TextFormat.PlainText)
        elif kind == QEvent.Type.ToolTip and isinstance(obj, QWidget) and isinstance(event, QHelpEvent):
            tip = tooltip_of(obj, event.pos())
            if tip:
                show_tip(event.globalPos(), tip, obj)
                return True
        return False  # nothing found: Qt's own handling (which finds nothing either, or a tip of its own making)


_guard: Optional[PlainTextGuard] = None


def install(app: QApplication) -> None:
    """Once per application (installing it again does nothing)."""
    global _guard
    if _guard is None:
        _guard = PlainTextGuard(app)
        app.installEventFilter(_guard)
