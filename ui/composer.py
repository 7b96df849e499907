"""The message composer: a text field that grows with its content, Send / Stop, a line of key hints, and the
context meter (what the conversation and the draft would take of the model's context, counted by the engine).

Enter sends and Shift+Enter (or Ctrl+Enter) adds a newline, or the other way round when the send key is
"ctrl+enter" — the choice lives in the settings. Esc stops an answer anywhere in the window (main_window).
"""

from __future__ import annotations

from typing import Optional

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from engine.errors import one_line
from engine.types import ContextUse, blank
from ui.parts import TypingBox

SEND_KEYS = ("enter", "ctrl+enter")
MAX_LINES = 10
NEAR_LIMIT = 0.85  # of the prompt budget: the meter warns from here
OVER_WHAT = {
    "rolling": "the oldest messages will be dropped",
    "truncate-middle": "messages from the middle will be dropped",
}


class ComposerEdit(TypingBox):
    submit = Signal()

    def __init__(self, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.send_with = "enter"
        self.setTabChangesFocus(True)  # Tab moves on to Send and the panels (a tab character can be pasted)
        self.setAccessibleName("Message")
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.document().documentLayout().documentSizeChanged.connect(self._fit_height)
        self._fit_height()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            mods = event.modifiers()
            ctrl = bool(mods & Qt.KeyboardModifier.ControlModifier)
            shift = bool(mods & Qt.KeyboardModifier.ShiftModifier)
            send = ctrl if self.send_with == "ctrl+enter" else not (shift or ctrl)
            if send:
                self.submit.emit()
                return
            self.textCursor().insertText("\n")  # Shift/Ctrl+Enter: a newline, never a send
            self.ensureCursorVisible()  # in a draft taller than the box, the new line was below its bottom
            return
        super().keyPressEvent(event)

    def _fit_height(self, *_args) -> None:
        # A plain-text document measures its height in lines, not pixels.
        lines = max(1, min(int(self.document().size().height()), MAX_LINES))
        h = int(
            lines * self.fontMetrics().lineSpacing() + 2 * self.document().documentMargin() + 2 * self.frameWidth() + 8
        )
        self.setFixedHeight(max(h, 2 * self.fontMetrics().lineSpacing() + 20))


class Composer(QFrame):
    sendRequested = Signal(str)
    stopRequested = Signal()

    def __init__(self, send_with: str = "enter", parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.setObjectName("composer")
        self.edit = ComposerEdit(self)
        self.edit.setObjectName("composerText")
        self.edit.submit.connect(self._send)
        self.send_button = QPushButton("Send", self)
        self.send_button.setObjectName("primaryButton")
        self.send_button.clicked.connect(self._send)
        self.stop_button = QPushButton("Stop", self)
        self.stop_button.setObjectName("stopButton")
        for button in (self.send_button, self.stop_button):  # a click leaves the focus in the text
            button.setFocusPolicy(Qt.FocusPolicy.TabFocus)
        self.stop_button.setToolTip("Stop the answer (Esc); the text so far is kept")
        self.stop_button.clicked.connect(self.stopRequested)
        self.stop_button.hide()
        self.hint = QLabel(self)
        self.hint.setObjectName("composerHint")
        self.hint.setWordWrap(True)  # a narrow window wraps the key hints instead of widening the column
        self.meter = QLabel(self)
        self.meter.setObjectName("contextMeter")
        self.meter.setWordWrap(True)
        self.meter.hide()
        self.context_use: Optional[ContextUse] = None  # the last count shown

        row = QHBoxLayout()
        row.setSpacing(8)
        row.addWidget(self.edit, 1)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)
        row.addLayout(buttons)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 10, 16, 10)
        lay.setSpacing(6)
        lay.addLayout(row)
        lay.addWidget(self.meter)
        lay.addWidget(self.hint)
        self._generating = False
        self._elsewhere: Optional[str] = None  # the chat the running answer is in, where another is shown
        self._can_send = True
        self._why_not = ""
        self.set_send_with(send_with)

    def set_send_with(self, send_with: str) -> None:
        if send_with not in SEND_KEYS:
            raise ValueError(f"send key must be one of {', '.join(SEND_KEYS)}, got {send_with!r}")
        self.edit.send_with = send_with
        newline = "Shift+Enter" if send_with == "enter" else "Enter"
        self.edit.setPlaceholderText("Message the model…")
        self._hint_keys = (
            f"{'Enter' if send_with == 'enter' else 'Ctrl+Enter'} to send · {newline} for a new line · Esc stops"
        )
        self._update()

    def set_generating(self, generating: bool) -> None:
        self._generating = generating
        self._update()

    def set_can_send(self, can: bool, why_not: str = "") -> None:
        """Sending needs a loaded model; `why_not` tells the user what is missing."""
        self._can_send = can
        self._why_not = why_not
        self._update()

    def _update(self) -> None:
        # Hiding the button that has the focus would pass it down the chain (to "Chat settings…", whose button a
        # space then presses): the focus goes back to the text instead.
        had_focus = self.send_button.hasFocus() or self.stop_button.hasFocus()
        self.send_button.setVisible(not self._generating)
        self.stop_button.setVisible(self._generating)
        if had_focus:
            self.edit.setFocus(Qt.FocusReason.OtherFocusReason)
        self.send_button.setEnabled(self._can_send)
        self.send_button.setToolTip(self._why_not or "Send the message")
        elsewhere = self._elsewhere if self._generating else None
        quoted = one_line(elsewhere, TITLE_SHOWN) if elsewhere else ""
        self.stop_button.setToolTip(f"Stop the answer in “{quoted}”" if elsewhere else "Stop the answer")
        if elsewhere:  # Enter here did nothing and said nothing, and Stop stopped an answer not on screen
            self.hint.setText(f"Answering in “{quoted}”: Esc stops it; send here once it ends")
        else:
            self.hint.setText(self._why_not if (self._why_not and not self._can_send) else self._hint_keys)

    def set_answering_elsewhere(self, title: Optional[str]) -> None:
        """The title of the chat an answer runs in while another is shown; None when it is this one (or none)."""
        self._elsewhere = title
        self._update()

    def set_context(self, use: Optional[ContextUse], why_not: str = "") -> None:
        """Show a count (None: hide the meter, or say `why_not` when there is a reason)."""
        self.context_use = use
        if use is None:
            self.meter.setVisible(bool(why_not))
            self.meter.setText(f"Context: n/a ({why_not})" if why_not else "")
            self.meter.setToolTip("")
            self._set_level("ok")
            return
        share = use.tokens / use.context_length if use.context_length else 0.0
        text = f"Context: {use.tokens:,} of {use.context_length:,} tokens ({share:.0%})"
        if use.tokens > use.budget:
            level = "over"
            if use.policy == "stop":
                text += " — over the limit: the answer will be refused (this chat stops at the limit)"
            elif use.refused:
                text += f" — over the limit: the answer will be refused ({use.refused})"
            elif use.cut:  # what the policy will do to this very conversation
                text += f" — over the limit, so when sent: {use.cut}"
            else:
                text += f" — over the limit: {OVER_WHAT.get(use.policy, 'messages will be dropped')}"
        elif use.tokens >= NEAR_LIMIT * use.budget:
            level = "near"
            then = "the answer is refused" if use.policy == "stop" else "messages are dropped"
            text += f" — near the limit ({use.budget - use.tokens:,} tokens left before {then})"
        else:
            level = "ok"
        self.meter.setText(text)
        self.meter.setToolTip(
            f"The conversation and your draft as the model's chat template renders them: {use.tokens:,} tokens.\n"
            f"Room kept for the answer: {use.context_length - use.budget:,} of the {use.context_length:,}-token "
            f"context, so prompts up to {use.budget:,} tokens are sent whole.\n"
            f"When the conversation is longer: {use.policy} (Chat settings).\nSource: the engine's tokenizer."
        )
        self.meter.show()
        self._set_level(level)

    def meter_level(self) -> str:
        return str(self.meter.property("level") or "ok")

    def _set_level(self, level: str) -> None:
        if self.meter.property("level") != level:
            self.meter.setProperty("level", level)
            self.meter.style().unpolish(self.meter)
            self.meter.style().polish(self.meter)

    def text(self) -> str:
        return self.edit.toPlainText()

    def set_text(self, text: str) -> None:
        self.edit.setPlainText(text)

    def clear(self) -> None:
        self.edit.clear()

    def _send(self) -> None:
        text = self.edit.toPlainText()
        if self._generating or not self._can_send or blank(text):
            return
        self.sendRequested.emit(text)  # the receiver clears the box once the message is stored (clear())


TITLE_SHOWN = 40  # characters of a chat's title the hint quotes: a 1,000-character title took over the window
