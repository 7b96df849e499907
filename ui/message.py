"""One message of the conversation: header with actions and branch navigation, body, and the stats line."""

from __future__ import annotations

from typing import Optional

from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtGui import QGuiApplication, QKeyEvent
from PySide6.QtWidgets import (
    QApplication,
    QFrame,
    QHBoxLayout,
    QLabel,
    QMenu,
    QPushButton,
    QTabWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.chat_flow import MessageItem
from engine.types import blank
from ui.hud.bars import ElidedLabel
from ui.markdown import SegmentsView
from ui.parts import TypingBox
from ui.stats import finish_words, format_stats
from ui.theme import Colors


def _action(text: str, tip: str, parent: QWidget, name: Optional[str] = None) -> QToolButton:
    """A message's action button; `name` is what a screen reader says where the text is a sign ("‹")."""
    b = QToolButton(parent)
    b.setText(text)
    b.setToolTip(tip)
    b.setAccessibleName(name or text)
    b.setObjectName("msgAction")
    b.setAutoRaise(True)
    b.setCursor(Qt.CursorShape.PointingHandCursor)
    return b


HEADER_GAP = 8  # between the role and the branch position


class MessageWidget(QFrame):
    copyRequested = Signal(object)  # message id
    editSubmitted = Signal(object, str)  # message id, new text
    regenerateRequested = Signal(object)
    deleteRequested = Signal(object)
    siblingRequested = Signal(object, int)  # message id, -1 | +1

    def __init__(self, item: MessageItem, colors: Colors, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.item = item
        self._colors = colors
        self.setObjectName(
            "userMessage"
            if item.role == "user"
            else "assistantMessage"
            if item.role == "assistant"
            else "systemMessage"
        )
        self.setFrameShape(QFrame.Shape.NoFrame)

        header = QHBoxLayout()
        header.setContentsMargins(0, 0, 0, 0)
        header.setSpacing(2)
        who = {"user": "You", "system": "System prompt"}.get(item.role, item.author or "Assistant")
        self.role_label = ElidedLabel(who, self)  # a long model name never widens the conversation
        self.role_label.setObjectName("roleLabel")
        self.role_label.setToolTip(who)
        header.addWidget(self.role_label, 1)
        header.addSpacing(HEADER_GAP)

        self.prev_button = _action("‹", "Previous version", self, "Previous version")
        self.branch_label = QLabel(self)
        self.branch_label.setObjectName("branchLabel")
        self.next_button = _action("›", "Next version", self, "Next version")
        self.prev_button.clicked.connect(lambda: self.siblingRequested.emit(self.item.id, -1))
        self.next_button.clicked.connect(lambda: self.siblingRequested.emit(self.item.id, +1))
        for w in (self.prev_button, self.branch_label, self.next_button):
            header.addWidget(w)
        header.addStretch(1)

        self.copy_button = _action("Copy", "Copy the message text", self)
        self.copy_button.clicked.connect(self.copy)
        header.addWidget(self.copy_button)
        self.edit_button = self.regen_button = None
        if item.role == "user":
            self.edit_button = _action("Edit", "Edit and send again (the current answer stays as a branch)", self)
            self.edit_button.clicked.connect(lambda: self.start_edit())  # not clicked(checked) as the text
            header.addWidget(self.edit_button)
        if item.role == "assistant":
            self.regen_button = _action("Regenerate", "Answer again (this answer stays as a branch)", self)
            self.regen_button.clicked.connect(lambda: self.regenerateRequested.emit(self.item.id))
            header.addWidget(self.regen_button)
        self.delete_button = _action("Delete", "Delete this message and everything after it", self)
        self.delete_button.clicked.connect(lambda: self.deleteRequested.emit(self.item.id))
        header.addWidget(self.delete_button)
        # Where the conversation is too narrow for the row of actions (an 800 x 600 window with the side panels
        # open), they fold into one "⋯" menu; they never widen the conversation (each may shrink to nothing).
        self.more_button = _action("⋯", "Copy, edit, regenerate or delete", self, "More actions")
        self.more_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        menu = QMenu(self.more_button)
        for b in self._actions():
            act = menu.addAction(b.text())
            act.triggered.connect(b.click)
        menu.aboutToShow.connect(lambda: self._sync_menu(menu))
        self.more_button.setMenu(menu)
        self.more_button.hide()
        header.addWidget(self.more_button)
        shrinking: list[QWidget] = [self.prev_button, self.branch_label, self.next_button, *self._actions()]
        for widget in shrinking:
            widget.setMinimumWidth(1)
        self._header = header

        body_name = {"user": "Your message", "system": "System prompt"}.get(item.role, "Answer")
        self.body = SegmentsView(item.content, colors, self, body_name, thinking=item.role == "assistant")
        self.stats_label = QLabel(self)
        self.stats_label.setObjectName("statsLine")
        self.stats_label.setWordWrap(True)  # a narrow window wraps the line instead of widening the column
        self.stats_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self._editor: Optional[QWidget] = None
        self._edit_send: Optional[QPushButton] = None
        self._sent_edit: Optional[str] = None
        self._busy = False
        self._can_answer = True  # a model is ready to answer (not loading, not running the ladder)

        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(8, 8, 8, 8)
        self._layout.setSpacing(4)
        self._layout.addLayout(header)
        self._layout.addWidget(self.body)
        self._layout.addWidget(self.stats_label)
        # ...but the message is never narrower than its folded header: squeezed below it in a layout pass, a code
        # block would size itself for a sliver of width
        branch = self.branch_label.fontMetrics().horizontalAdvance("99/99")
        nav = self.prev_button.sizeHint().width() + branch + self.next_button.sizeHint().width()
        self.setMinimumWidth(self._header_room([]) + nav + self.more_button.sizeHint().width())
        self.refresh()

    def _header_room(self, parts: list[QWidget]) -> int:
        """The width the header takes with `parts` beside the role, which keeps room for a short name."""
        m = self._layout.contentsMargins()
        role = self.role_label.fontMetrics().horizontalAdvance("Assistant")
        return (
            role + HEADER_GAP + m.left() + m.right() + sum(w.sizeHint().width() + self._header.spacing() for w in parts)
        )

    def refresh(self) -> None:
        """Show the current item's branch position and stats."""
        item = self.item
        many = item.sibling_count > 1
        for w in (self.prev_button, self.branch_label, self.next_button):
            w.setVisible(many)
        self.branch_label.setText(f"{item.sibling_index + 1}/{item.sibling_count}")
        if item.role == "assistant":
            if item.metrics is None and item.finish_reason is None:
                self.stats_label.setText("generating…" if item.extra.get("streaming") else "n/a")
                self.stats_label.setToolTip(
                    "" if item.extra.get("streaming") else "No metrics were stored for this answer"
                )
            else:
                line, tip = format_stats(item.metrics, item.options, item.device, item.finish_reason, item.candidate)
                self.stats_label.setText(line)
                self.stats_label.setToolTip(tip)
        self.stats_label.setVisible(item.role == "assistant")
        editable = item.id is not None and not item.extra.get("streaming") and not self._busy
        for b in (self.edit_button, self.regen_button):
            if b is not None:
                b.setEnabled(editable and self._can_answer)  # each asks the model for an answer
        self.delete_button.setEnabled(editable)
        if self._edit_send is not None:
            self._edit_send.setEnabled(not self._busy and self._can_answer)
        self.prev_button.setEnabled(not self._busy and item.sibling_index > 0)
        self.next_button.setEnabled(not self._busy and item.sibling_index < item.sibling_count - 1)
        self.copy_button.setEnabled(bool(self.body.text))
        self._fit_header()

    def _actions(self) -> list[QToolButton]:
        return [b for b in (self.copy_button, self.edit_button, self.regen_button, self.delete_button) if b is not None]

    def _sync_menu(self, menu: QMenu) -> None:
        for act, b in zip(menu.actions(), self._actions()):
            act.setEnabled(b.isEnabled())

    def _fit_header(self) -> None:
        """The actions in a row where the message is wide enough for them and the branch position, else in the
        "⋯" menu."""
        nav = (self.prev_button, self.branch_label, self.next_button) if self.item.sibling_count > 1 else ()
        fold = self.width() < self._header_room([*nav, *self._actions()])
        for b in self._actions():
            b.setVisible(not fold)
        self.more_button.setVisible(fold)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit_header()

    def set_busy(self, busy: bool) -> None:
        """While an answer streams, nothing that changes the conversation is offered; copying still is."""
        self._busy = busy
        self.refresh()

    def set_can_answer(self, can: bool) -> None:
        """Whether a model is ready for Edit and Regenerate, which ask it for an answer: not while one loads or the
        ladder runs (the answer would be credited to the wrong model), nor with none loaded."""
        self._can_answer = can
        self.refresh()

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.body.text)
        self.copyRequested.emit(self.item.id)

    def start_edit(self, typed: Optional[str] = None, focus: bool = True) -> None:
        """Open the editor on the message's text, or on `typed` (an edit left open when the message was last
        shown)."""
        if self._editor is not None:
            return
        editor = QWidget(self)
        lay = QVBoxLayout(editor)
        lay.setContentsMargins(0, 0, 0, 0)
        text = _EditBox(editor)
        text.setObjectName("editText")
        text.setTabChangesFocus(True)
        text.setAccessibleName("Edited message")
        text.setPlainText(self.body.text if typed is None else typed)
        text.setMinimumHeight(80)
        row = QHBoxLayout()
        row.addStretch(1)
        cancel = QPushButton("Cancel", editor)
        send = QPushButton("Send", editor)
        send.setObjectName("primaryButton")
        send.setToolTip("Ctrl+Enter sends · Esc cancels")
        send.setEnabled(not self._busy and self._can_answer)
        row.addWidget(cancel)
        row.addWidget(send)
        lay.addWidget(text)
        lay.addLayout(row)
        cancel.clicked.connect(self.cancel_edit)
        send.clicked.connect(lambda: self._submit_edit(text.toPlainText()))
        text.submit.connect(send.click)  # a disabled button ignores it
        text.cancel.connect(self.cancel_edit)
        self._editor, self._edit_send = editor, send
        self.editor_text = text
        self.body.hide()
        self._layout.insertWidget(2, editor)
        if focus:
            text.setFocus()

    def edit_in_progress(self) -> Optional[str]:
        """The text of the edit open here, None where none is, or where it has been sent (it is being stored)."""
        if self._editor is None:
            return None
        typed = self.editor_text.toPlainText()
        return None if typed == self._sent_edit else typed

    def cancel_edit(self) -> None:
        if self._editor is not None:
            focus = QApplication.focusWidget()
            had_focus = focus is not None and self._editor.isAncestorOf(focus)
            self._editor.deleteLater()
            self._editor = self._edit_send = None
            self.body.show()
            if had_focus:  # not lost with the editor: back to the button that opened it (or the menu it folds into)
                edit = self.edit_button
                (edit if edit is not None and edit.isVisible() else self.more_button).setFocus()

    def _submit_edit(self, text: str) -> None:
        """The editor stays open until the edit is stored (the conversation is then shown again from this
        message on, in a new widget): an edit the store refuses (a locked or full disk) keeps its text."""
        if blank(text) or self._busy or not self._can_answer:
            return
        self._sent_edit = text
        self.editSubmitted.emit(self.item.id, text)

    def set_colors(self, colors: Colors) -> None:
        self._colors = colors
        self.body.set_colors(colors)


class _EditBox(TypingBox):
    """The text of a message being edited: Enter is a new line, Ctrl+Enter sends it, Esc gives up."""

    submit = Signal()
    cancel = Signal()

    def event(self, event: QEvent) -> bool:
        # Esc here gives up the edit; the window's Esc (stop the answer) must not take it first
        if event.type() == QEvent.Type.ShortcutOverride and isinstance(event, QKeyEvent):
            if event.key() == Qt.Key.Key_Escape:
                event.accept()
                return True
        return super().event(event)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        ctrl = bool(event.modifiers() & Qt.KeyboardModifier.ControlModifier)
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and ctrl:
            self.submit.emit()
        elif event.key() == Qt.Key.Key_Escape:
            self.cancel.emit()
        else:
            super().keyPressEvent(event)


class CandidateTabs(QFrame):
    """N answers to the same prompt, one tab each, streaming side by side; "Use this answer" picks one."""

    chosen = Signal(int)  # candidate index

    def __init__(self, n: int, author: str, colors: Colors, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.setObjectName("assistantMessage")
        self.tabs = QTabWidget(self)
        self.tabs.setObjectName("candidateTabs")
        self.bodies: list[SegmentsView] = []
        self.stats: list[QLabel] = []
        self.use_buttons: list[QPushButton] = []
        self.copy_buttons: list[QToolButton] = []
        for i in range(n):
            page = QWidget()
            lay = QVBoxLayout(page)
            lay.setContentsMargins(6, 6, 6, 6)
            body = SegmentsView("", colors, page, f"Candidate {i + 1}", thinking=True)
            stats = QLabel("generating…", page)
            stats.setObjectName("statsLine")
            stats.setWordWrap(True)
            use = QPushButton("Use this answer", page)
            use.setObjectName("primaryButton")
            use.setToolTip("Continue the chat from this answer; the others stay as alternatives (‹ › above it)")
            use.setEnabled(False)
            use.clicked.connect(lambda _=False, i=i: self.chosen.emit(i))
            # its text without choosing it (a choice ends the others' tabs), as a message's Copy gives its own
            copy = _action("Copy", f"Copy candidate {i + 1}'s text", page)
            copy.clicked.connect(lambda _=False, body=body: QGuiApplication.clipboard().setText(body.text))
            row = QHBoxLayout()
            row.addWidget(stats, 1)
            row.addWidget(copy, 0, Qt.AlignmentFlag.AlignBottom)
            row.addWidget(use, 0, Qt.AlignmentFlag.AlignBottom)
            lay.addWidget(body)
            lay.addLayout(row)
            self.tabs.addTab(page, f"Candidate {i + 1}")
            self.bodies.append(body)
            self.stats.append(stats)
            self.use_buttons.append(use)
            self.copy_buttons.append(copy)
        self._author = author
        title = QLabel(self._title_text(n), self)
        title.setObjectName("roleLabel")
        self.title = title
        lay = QVBoxLayout(self)
        lay.setContentsMargins(12, 8, 12, 8)
        lay.addWidget(title)
        lay.addWidget(self.tabs)

    def _title_text(self, n: int) -> str:
        return f"{self._author or 'Assistant'} — {n} candidates"

    def append(self, deltas: dict[int, str]) -> None:
        for i, delta in deltas.items():
            if 0 <= i < len(self.bodies):
                self.bodies[i].append(delta)

    def mark_ended(self, ended: dict[int, str]) -> None:
        """Candidates that are done while others still run say why they ended; their figures come with the batch's."""
        for i, reason in ended.items():
            if 0 <= i < len(self.stats):
                self.stats[i].setText(f"Finished: {finish_words(reason)} · waiting for the other candidates…")

    def finish(
        self,
        texts: list[str],
        metrics: Optional[dict],
        options: Optional[dict],
        device: Optional[str],
        finish_reasons: list[str],
        can_choose: bool,
    ) -> None:
        if 0 < len(texts) < len(self.bodies):  # the engine made fewer than asked (out of device memory)
            for i in range(len(self.bodies) - 1, len(texts) - 1, -1):
                self.tabs.removeTab(i)
            del self.bodies[len(texts) :], self.stats[len(texts) :], self.use_buttons[len(texts) :]
            del self.copy_buttons[len(texts) :]
            self.title.setText(self._title_text(len(texts)))
        for i, body in enumerate(self.bodies):
            if i < len(texts):
                body.set_text(texts[i])
            body.flush()
            line, tip = format_stats(
                metrics, options, device, finish_reasons[i] if i < len(finish_reasons) else None, i
            )
            self.stats[i].setText(line)
            self.stats[i].setToolTip(tip)
            self.use_buttons[i].setEnabled(can_choose)

    def set_colors(self, colors: Colors) -> None:
        for b in self.bodies:
            b.set_colors(colors)
