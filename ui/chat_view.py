"""The conversation: a scrolling column of messages, with one answer (or N candidates) streaming at the bottom.

Streaming touches only the last message: each text batch is appended to it (see ui.markdown.SegmentsView for
the plain-append / timed-render split); the rest of the conversation is built once per chat or branch switch.
"""

from __future__ import annotations

from typing import Optional

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QFrame, QLabel, QScrollArea, QSizePolicy, QVBoxLayout, QWidget

from app.chat_flow import MessageItem
from ui.message import CandidateTabs, MessageWidget
from ui.theme import LIGHT, Colors

EMPTY_HINT = (
    "<h3>Start a conversation</h3>"
    "<p>Type below and press the send key. Ctrl+N starts a new chat, Ctrl+F searches your chats, Esc stops an answer.</p>"
    "<p>On the right: the decode optimizations (each change applies to the next answer) and the performance HUD, "
    "which shows where the time goes while the model answers. The model is at the bottom left.</p>"
)


class ChatView(QScrollArea):
    editSubmitted = Signal(object, str)  # user message id, new text
    regenerateRequested = Signal(object)  # assistant message id
    deleteRequested = Signal(object)
    siblingRequested = Signal(object, int)  # message id, -1 | +1
    candidateChosen = Signal(int)  # candidate index of the streamed batch

    def __init__(self, colors: Colors = LIGHT, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        # The column follows the view's width and wraps; only below its narrowest does it scroll sideways.
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self._colors = colors
        self._container = QWidget()
        self._container.setObjectName("chatContainer")
        self._column = QVBoxLayout(self._container)
        self._column.setContentsMargins(12, 16, 12, 16)
        self._column.setSpacing(10)
        self._empty = QLabel(EMPTY_HINT, self._container)
        self._empty.setObjectName("emptyHint")
        self._empty.setWordWrap(True)
        self._empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self._empty.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Expanding)
        self._column.addWidget(self._empty)
        self._column.addStretch(1)
        self.setWidget(self._container)

        self._widgets: list[MessageWidget] = []
        self._stream: Optional[MessageWidget] = None
        self._candidates: Optional[CandidateTabs] = None
        self._busy = False
        self._can_answer = True
        self._stick = True  # follow the bottom while the user has not scrolled up
        bar = self.verticalScrollBar()
        bar.valueChanged.connect(self._on_scrolled)
        bar.rangeChanged.connect(self._on_range)

    # ---- whole conversation ----------------------------------------------------------------------------

    def set_messages(self, items: list[MessageItem]) -> None:
        """Show `items`. The messages already shown as they are stay (a regenerate, an edit or a branch switch
        changes the end of a chat; building all of a 300-turn chat's widgets again took seconds)."""
        keep = 0
        if self._stream is None and self._candidates is None:
            for w, item in zip(self._widgets, items):
                if w.item != item:
                    break
                keep += 1
        self._clear(keep)
        for item in items[keep:]:
            self._add(MessageWidget(item, self._colors, self._container))
        self._empty.setVisible(not items)
        self._stick = True

    def messages(self) -> list[MessageWidget]:
        return list(self._widgets)

    def items(self) -> list[MessageItem]:
        return [w.item for w in self._widgets]

    def _clear(self, keep: int = 0) -> None:
        """Remove the messages after the first `keep`."""
        for w in self._widgets[keep:]:
            self._column.removeWidget(w)
            w.hide()  # deleted later, maybe after a nested event loop (a menu) has painted the new chat
            w.deleteLater()
        self._widgets = self._widgets[:keep]
        self._stream = None
        self._drop_candidates()

    def _add(self, w: MessageWidget) -> None:
        w.editSubmitted.connect(self.editSubmitted)
        w.regenerateRequested.connect(self.regenerateRequested)
        w.deleteRequested.connect(self.deleteRequested)
        w.siblingRequested.connect(self.siblingRequested)
        w.set_busy(self._busy)
        w.set_can_answer(self._can_answer)
        self._column.insertWidget(self._column.count() - 1, w)  # above the stretch
        self._widgets.append(w)
        self._empty.hide()

    def add_message(self, item: MessageItem) -> MessageWidget:
        w = MessageWidget(item, self._colors, self._container)
        self._add(w)
        self._stick = True
        return w

    def set_busy(self, busy: bool) -> None:
        self._busy = busy
        for w in self._widgets:
            w.set_busy(busy)

    def set_can_answer(self, can: bool) -> None:
        """Whether a model is ready for the messages' Edit and Regenerate (MessageWidget.set_can_answer)."""
        if can == self._can_answer:
            return
        self._can_answer = can
        for w in self._widgets:
            w.set_can_answer(can)

    # ---- streaming -------------------------------------------------------------------------------------

    def begin_stream(self, item: MessageItem, candidates: int = 1) -> None:
        """Add the answer that is about to stream (one message, or a tab per candidate)."""
        self._drop_candidates()
        self._stick = True
        if candidates <= 1:
            item.extra["streaming"] = True
            self._stream = self.add_message(item)
        else:
            self._stream = None
            self._candidates = CandidateTabs(candidates, item.author, self._colors, self._container)
            self._candidates.chosen.connect(self.candidateChosen)
            self._column.insertWidget(self._column.count() - 1, self._candidates)
            self._empty.hide()

    def append_stream(self, deltas: dict[int, str]) -> None:
        if self._stream is not None:
            delta = deltas.get(0)
            if delta:
                if not self._stream.body.text:  # the first text: what stood there (the prompt being read) is done
                    self._stream.stats_label.setText("generating…")
                self._stream.body.append(delta)
        elif self._candidates is not None:
            self._candidates.append(deltas)

    def rows_finished(self, ended: dict[int, str]) -> None:
        if self._candidates is not None:
            self._candidates.mark_ended(ended)

    def set_stream_status(self, text: str) -> None:
        """A line under the answer before its text arrives (e.g. how much of the prompt has been read)."""
        if self._stream is not None and not self._stream.body.text:
            self._stream.stats_label.setText(text)

    def streaming_text(self, candidate: int = 0) -> str:
        if self._stream is not None:
            return self._stream.body.text
        if self._candidates is not None:
            return self._candidates.bodies[candidate].text
        return ""

    def finish_stream(self, item: MessageItem) -> None:
        """The single streamed answer is done: show its final text, id, branch position and stats."""
        w = self._stream
        self._stream = None
        if w is None:
            return
        item.extra.pop("streaming", None)
        w.item = item
        if w.body.text != item.content:
            w.body.set_text(item.content)
        w.body.flush()
        w.refresh()

    def candidate_tabs(self) -> Optional[CandidateTabs]:
        return self._candidates

    def _drop_candidates(self) -> None:
        if self._candidates is not None:
            self._column.removeWidget(self._candidates)
            self._candidates.hide()
            self._candidates.deleteLater()
            self._candidates = None

    # ---- look and scrolling ----------------------------------------------------------------------------

    def set_colors(self, colors: Colors) -> None:
        self._colors = colors
        for w in self._widgets:
            w.set_colors(colors)
        if self._candidates is not None:
            self._candidates.set_colors(colors)

    def _on_scrolled(self, value: int) -> None:
        self._stick = value >= self.verticalScrollBar().maximum() - 8

    def _on_range(self, _lo: int, hi: int) -> None:
        if self._stick:
            self.verticalScrollBar().setValue(hi)
