"""The conversation: a scrolling column of messages, with one answer (or N candidates) streaming at the bottom.

Streaming touches only the last message: each text batch is appended to it (see ui.markdown.SegmentsView for
the plain-append / timed-render split); the rest of the conversation is built once per chat or branch switch.
A long chat opens on its last messages; the earlier ones are built when the user scrolls up to them (or asks).
"""

from __future__ import annotations

from typing import Optional

from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtWidgets import QFrame, QLabel, QPushButton, QScrollArea, QSizePolicy, QVBoxLayout, QWidget

from app.chat_flow import MessageItem
from ui.message import CandidateTabs, MessageWidget
from ui.parts import park_focus
from ui.theme import LIGHT, Colors

EMPTY_HINT = (
    "<h3>Start a conversation</h3>"
    "<p>Type below and press the send key. Ctrl+N starts a new chat, Ctrl+F searches your chats, Esc stops an answer.</p>"
    "<p>On the right: the decode optimizations (each change applies to the next answer) and the performance HUD, "
    "which shows where the time goes while the model answers. The model is at the bottom left.</p>"
)
# Messages built when a chat opens, and how many more each step up builds: a message's widgets cost ~2 ms (more
# with code blocks), so a 600-message chat took 1.3 s to open when all were built at once.
SHOWN_AT_FIRST = 40
EARLIER_STEP = 40


class ChatView(QScrollArea):
    editSubmitted = Signal(object, str)  # user message id, new text
    regenerateRequested = Signal(object)  # assistant message id
    deleteRequested = Signal(object)
    siblingRequested = Signal(object, int)  # message id, -1 | +1
    candidateChosen = Signal(int)  # candidate index of the streamed batch
    candidateShown = Signal(int)  # the candidate tab now on screen
    # a message holding the keyboard focus went (a branch switched, the chat shown again): the focus waits on the
    # conversation, and the window gives it to the composer
    focusReleased = Signal()

    def __init__(self, colors: Colors = LIGHT, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setAccessibleName("Conversation")  # a Tab stop of its own (it scrolls with the keys)
        # by Tab only: a click on a message's Copy or ‹ (buttons Tab reaches, not a click) left the focus in the
        # conversation, the nearest that took a click, and what was typed next went nowhere
        self.setFocusPolicy(Qt.FocusPolicy.TabFocus)
        self._clearing = False
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
        self._earlier = QPushButton(self._container)
        self._earlier.setObjectName("earlierMessages")
        self._earlier.setFlat(True)
        self._earlier.setCursor(Qt.CursorShape.PointingHandCursor)
        self._earlier.clicked.connect(lambda: self.show_earlier())
        self._earlier.hide()
        self._column.addWidget(self._earlier, 0, Qt.AlignmentFlag.AlignHCenter)
        self._empty = QLabel(EMPTY_HINT, self._container)
        self._empty.setTextFormat(Qt.TextFormat.RichText)  # the program's own markup (other labels are plain)
        self._empty.setObjectName("emptyHint")
        self._empty.setWordWrap(True)
        self._empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self._empty.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Expanding)
        self._column.addWidget(self._empty)
        self._column.addStretch(1)
        self.setWidget(self._container)

        self._widgets: list[MessageWidget] = []
        self._unbuilt: list[MessageItem] = []  # the chat's first messages, not shown until asked for
        # Edits open in messages no longer shown (another chat opened, the messages built again): their text, by
        # message id, opened again with it when the message is shown (they were closed, the text gone)
        self._edits: dict[int, str] = {}
        # The message the view holds its place on while earlier messages are laid out above it, and where it
        # was: the view moves as that message moves (what grows below it, a streaming answer, moves nothing).
        self._anchor: Optional[tuple[MessageWidget, int]] = None
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
        changes the end of a chat; building all of a 300-turn chat's widgets again took seconds); a chat that
        changes before them opens on its last SHOWN_AT_FIRST messages."""
        same = 0
        if self._stream is None:  # the messages above candidates stay too (an edit open in one, its text)
            for old, item in zip(self.items(), items):
                if old != item:
                    break
                same += 1
        unbuilt = len(self._unbuilt)
        if same >= unbuilt and same > 0:
            self._clear(same - unbuilt)
        else:
            self._clear()
            unbuilt = max(0, len(items) - SHOWN_AT_FIRST)
            self._unbuilt = list(items[:unbuilt])
        for item in items[unbuilt + len(self._widgets) :]:
            self._add(MessageWidget(item, self._colors, self._container))
        self._empty.setVisible(not items)
        self._show_earlier_button()
        self._drop_anchor()
        self._stick = True

    def show_earlier(self, count: int = EARLIER_STEP) -> int:
        """Build up to `count` of the messages before the first one shown, the view staying where it is; the
        number built."""
        take = self._unbuilt[-count:] if count > 0 else []
        if not take:
            return 0
        del self._unbuilt[len(self._unbuilt) - len(take) :]
        self._drop_anchor()
        if self._widgets:
            self._anchor = (self._widgets[0], self._widgets[0].y())
            self._widgets[0].installEventFilter(self)
        self._stick = False
        first = self._column.indexOf(self._earlier) + 1
        built = [MessageWidget(item, self._colors, self._container) for item in take]
        for i, w in enumerate(built):
            self._connect(w)
            self._column.insertWidget(first + i, w)
        self._widgets[:0] = built
        self._show_earlier_button()
        return len(built)

    def unbuilt_count(self) -> int:
        """Messages of the chat not shown yet (before the first shown)."""
        return len(self._unbuilt)

    def _show_earlier_button(self) -> None:
        n = len(self._unbuilt)
        self._earlier.setVisible(n > 0)
        if n:
            step = min(n, EARLIER_STEP)
            more = f" ({n} earlier in all)" if n > step else ""
            self._earlier.setText(f"Show {step} earlier message{'s' if step != 1 else ''}{more}")
            self._earlier.setToolTip("Scrolling to the top shows them too")

    def messages(self) -> list[MessageWidget]:
        """The messages' widgets shown (a long chat's first messages may not be built yet: unbuilt_count)."""
        return list(self._widgets)

    def items(self) -> list[MessageItem]:
        """All of the chat's messages, shown or not."""
        return self._unbuilt + [w.item for w in self._widgets]

    def _clear(self, keep: int = 0) -> None:
        """Remove the shown messages after the first `keep`."""
        self._drop_anchor()
        doomed: list[QWidget] = [*self._widgets[keep:], *([self._candidates] if self._candidates else [])]
        # hiding the focused widget had Qt tab on to "Show earlier messages", which scrolled to the top and built
        # 40 more messages in the middle of this
        released = park_focus(self, doomed)
        for w in self._widgets[keep:]:
            typed = w.edit_in_progress()
            if typed is not None and w.item.id is not None:
                self._edits[w.item.id] = typed
        self._clearing = True
        try:
            for w in self._widgets[keep:]:
                self._column.removeWidget(w)
                w.hide()  # deleted later, maybe after a nested event loop (a menu) has painted the new chat
                w.deleteLater()
            self._widgets = self._widgets[:keep]
        finally:
            self._clearing = False
        self._stream = None
        self._drop_candidates()
        if released:
            self.focusReleased.emit()

    def _connect(self, w: MessageWidget) -> None:
        w.editSubmitted.connect(self.editSubmitted)
        w.regenerateRequested.connect(self.regenerateRequested)
        w.deleteRequested.connect(self.deleteRequested)
        w.siblingRequested.connect(self.siblingRequested)
        w.set_busy(self._busy)
        w.set_can_answer(self._can_answer)
        typed = self._edits.pop(w.item.id, None) if w.item.id is not None else None
        if typed is not None:
            w.start_edit(typed, focus=False)

    def _add(self, w: MessageWidget) -> None:
        self._connect(w)
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
        self._drop_anchor()
        if candidates <= 1:
            item.extra["streaming"] = True
            self._stream = self.add_message(item)
        else:
            self._stream = None
            self._candidates = CandidateTabs(candidates, item.author, self._colors, self._container)
            self._candidates.chosen.connect(self.candidateChosen)
            self._candidates.tabs.currentChanged.connect(self.candidateShown)
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

    def _drop_anchor(self) -> None:
        if self._anchor is not None:
            self._anchor[0].removeEventFilter(self)
            self._anchor = None

    def eventFilter(self, obj, event) -> bool:
        """The anchor message moved (what was laid out above it grew): the view moves with it."""
        anchor = getattr(self, "_anchor", None)  # QScrollArea filters its widget's events from its own __init__ on
        if anchor is not None and obj is anchor[0] and event.type() == QEvent.Type.Move:
            w, y = anchor
            self._anchor = (w, w.y())
            if w.y() != y:
                bar = self.verticalScrollBar()
                bar.setValue(bar.value() + w.y() - y)
        return super().eventFilter(obj, event)

    def _on_scrolled(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._stick = value >= bar.maximum() - 8
        if value == bar.minimum() and self._unbuilt and bar.maximum() > 0 and not self._clearing:
            self.show_earlier()  # the user reached the top

    def _on_range(self, _lo: int, hi: int) -> None:
        if self._stick:
            self.verticalScrollBar().setValue(hi)
