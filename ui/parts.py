"""Small pieces several views build the same way: the error line under a form, a column of panes without
margins."""

from __future__ import annotations

import re
from typing import Optional, Union

from PySide6.QtCore import QMimeData, Qt
from PySide6.QtGui import QTextDocumentFragment, QTextOption
from PySide6.QtWidgets import QApplication, QLabel, QLayout, QPlainTextEdit, QVBoxLayout, QWidget

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


LONG_WORD = 500  # characters without a break: a text with such a word is broken anywhere
_LONG_WORD = re.compile(r"\S{%d}" % LONG_WORD)


_SPACE = re.compile(r"\s")


def has_long_word(text: str) -> bool:
    """Whether `text` holds LONG_WORD characters without a break. A word that long covers a whole aligned block of
    half its length, so only the blocks without a space are searched around: the search over the whole text took
    0.34 s of a 4 MB paste of prose, the blocks 0.02 s."""
    half = LONG_WORD // 2
    for start in range(0, len(text) - half + 1, half):
        if _SPACE.search(text, start, start + half) is None:
            around = max(0, start - LONG_WORD), start + half + LONG_WORD
            if _LONG_WORD.search(text, *around) is not None:
                return True
    return False


class TypingBox(QPlainTextEdit):
    """A plain text box for the user's own writing that breaks lines anywhere once its text holds a word longer
    than a line could be: laid out at word boundaries, a pasted 200 KB hex dump held the GUI thread 3.4 s and
    800 KB 73 s (the layout grows with the square of the word); anywhere, 0.08 s. Cleared, it breaks at words
    again."""

    def __init__(self, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.textChanged.connect(self._words_again)

    def canInsertFromMimeData(self, source: QMimeData) -> bool:
        return source.hasText() or source.hasHtml()

    def insertFromMimeData(self, source: QMimeData) -> None:
        if not source.hasText() and source.hasHtml():
            # Some browsers and editors put only text/html on the clipboard; a plain text box ignores it, so the
            # paste inserted nothing. Its text is what the user meant.
            # an image is an object replacement character (U+FFFC) in the fragment's text: nothing the user sees
            text = QTextDocumentFragment.fromHtml(source.html()).toPlainText().replace("\ufffc", "")
            if has_long_word(text):
                self.setWordWrapMode(QTextOption.WrapMode.WrapAnywhere)
            self.insertPlainText(text)
            return
        if source.hasText() and has_long_word(source.text()):
            self.setWordWrapMode(QTextOption.WrapMode.WrapAnywhere)  # before the text is laid out
        super().insertFromMimeData(source)

    def setPlainText(self, text: str) -> None:
        if has_long_word(text):
            self.setWordWrapMode(QTextOption.WrapMode.WrapAnywhere)
        super().setPlainText(text)

    def _words_again(self) -> None:
        if self.document().isEmpty() and self.wordWrapMode() != QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere:
            self.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)


def shown_as_is(text: str) -> str:
    """Text of the user's (a file's name, a folder) for a menu entry or a button, where Qt reads "&" as the mark of
    the next letter's Alt key: "Q&A.gguf" showed as "QA.gguf" with the A underlined."""
    return text.replace("&", "&&")


def park_focus(holder: QWidget, going: list[QWidget]) -> bool:
    """Where one of `going` (or a widget inside one) holds the keyboard focus, the application's or, while a box
    is up, the window's: give it to `holder` before they are hidden or disabled (Qt would pass it on to the next
    Tab stop, wherever that is). Whether it did: the caller then hands the focus where the user goes on."""
    focused = QApplication.focusWidget() or holder.window().focusWidget()
    if focused is None or not any(w is focused or w.isAncestorOf(focused) for w in going):
        return False
    holder.setFocus(Qt.FocusReason.OtherFocusReason)
    return True
