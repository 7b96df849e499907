"""The chat list: search, new chat, and the chats newest first (rename and delete from the context menu; from the
keyboard Delete, Shift+F10 or the menu key for the menu, and the window's F2)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, cast

from PySide6.QtCore import QEvent, QPoint, Qt, QTimer, Signal
from PySide6.QtGui import QContextMenuEvent, QFocusEvent, QKeyEvent, QMouseEvent
from PySide6.QtWidgets import (
    QFrame,
    QInputDialog,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from ui.dialogs import confirm

SEARCH_DELAY_MS = 200  # search once typing pauses, not on every key


@dataclass(frozen=True)
class ChatEntry:
    id: int
    title: str
    updated: float  # unix time


def age(updated: float, now: Optional[float] = None) -> str:
    seconds = max(0.0, (now or time.time()) - updated)
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h ago"
    return time.strftime("%Y-%m-%d", time.localtime(updated))


class _ChatItem(QListWidgetItem):
    """A chat's row. Its tooltip says how long ago the chat changed as of when it is shown: the list is read again
    only when chats change, and an age worked out then ("just now") stayed for as long as the window ran."""

    def __init__(self, chat: ChatEntry):
        super().__init__(chat.title or "Untitled")
        self.setData(Qt.ItemDataRole.UserRole, chat.id)
        self._title = chat.title
        self._updated = chat.updated

    def data(self, role: int) -> object:
        if role == Qt.ItemDataRole.ToolTipRole:
            return f"{self._title}\nlast change: {age(self._updated)}"
        return super().data(role)


class _ChatListWidget(QListWidget):
    """A right-click opens the menu of the chat under the pointer without opening that chat: the open one
    stays current and on screen. From the keyboard, the current chat's: Delete deletes it (asked first), Shift+F10
    or the menu key opens its menu; F2 renames it (the window's Chat menu)."""

    deletePressed = Signal()
    menuPressed = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        mods = event.modifiers() & ~Qt.KeyboardModifier.KeypadModifier
        if self.currentItem() is not None:
            if event.key() == Qt.Key.Key_Delete and mods == Qt.KeyboardModifier.NoModifier:
                event.accept()
                self.deletePressed.emit()
                return
            if event.key() == Qt.Key.Key_F10 and mods == Qt.KeyboardModifier.ShiftModifier:
                event.accept()
                self.menuPressed.emit()
                return
        super().keyPressEvent(event)

    def event(self, event: QEvent) -> bool:
        """The menu key opens the current chat's menu, as Shift+F10 does, and none where no chat is chosen: Qt
        places a keyboard menu at the middle of a list with no current row, which opened the menu of the chat that
        happened to be there."""
        if event.type() == QEvent.Type.ContextMenu and (
            cast(QContextMenuEvent, event).reason() == QContextMenuEvent.Reason.Keyboard
        ):
            event.accept()
            if self.currentItem() is not None:
                self.menuPressed.emit()
            return True
        return super().event(event)

    def focusInEvent(self, event: QFocusEvent) -> None:
        """With no chat chosen (a new chat on screen), the focus arriving leaves none chosen: Qt made the first
        row current, which opened the newest chat as Tab passed through the list on its way to "Chat settings…"
        (whose settings then went to that chat, and the draft with Enter). Down chooses the first row."""
        if self.currentItem() is not None:
            super().focusInEvent(event)
            return
        blocked = self.blockSignals(True)
        try:
            super().focusInEvent(event)
            self.selectionModel().clearCurrentIndex()
        finally:
            self.blockSignals(blocked)

    def mousePressEvent(self, event: QMouseEvent) -> None:
        if event.button() == Qt.MouseButton.RightButton:
            event.accept()
            return
        super().mousePressEvent(event)


class ChatList(QFrame):
    chatSelected = Signal(int)
    chatClicked = Signal(int)  # picked with the mouse: the window gives the keyboard to the composer
    newChatRequested = Signal()
    renameRequested = Signal(int, str)
    deleteRequested = Signal(int)
    searchChanged = Signal(str)

    def __init__(self, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.setObjectName("chatListPanel")
        self.new_button = QPushButton("New chat", self)
        self.new_button.setObjectName("primaryButton")
        self.new_button.setToolTip("Start a new chat (Ctrl+N)")
        self.new_button.clicked.connect(self.newChatRequested)
        self.search = QLineEdit(self)
        self.search.setObjectName("chatSearch")
        self.search.setPlaceholderText("Search chats (Ctrl+F)")
        self.search.setClearButtonEnabled(True)
        self.search.setAccessibleName("Search chats")
        self._search_timer = QTimer(  # type: ignore[call-arg]  # the stubs omit the signal keywords Qt takes
            self,
            singleShot=True,
            interval=SEARCH_DELAY_MS,
            timeout=lambda: self.searchChanged.emit(self.search.text().strip()),
        )
        self.search.textChanged.connect(lambda _t: self._search_timer.start())
        self.search.returnPressed.connect(self._search_now)
        self.list = _ChatListWidget(self)
        self.list.setObjectName("chatList")
        self.list.setAccessibleName("Chats")
        self.list.setAccessibleDescription("F2 renames the chat, Delete deletes it, Shift+F10 opens its menu")
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.deletePressed.connect(self._delete_current)
        self.list.menuPressed.connect(self._current_menu)
        self.list.currentItemChanged.connect(self._current_changed)
        # a chat clicked, then typing: the letters went to the list's type-ahead, which opened another chat
        self.list.itemClicked.connect(lambda item: self.chatClicked.emit(item.data(Qt.ItemDataRole.UserRole)))
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setUniformItemSizes(True)  # one line each: laid out without measuring every title of thousands
        lay = QVBoxLayout(self)
        lay.setContentsMargins(10, 10, 10, 10)
        lay.setSpacing(8)
        lay.addWidget(self.new_button)
        lay.addWidget(self.search)
        lay.addWidget(self.list, 1)
        self._quiet = False
        self._items: dict[int, QListWidgetItem] = {}  # by chat id

    def set_chats(self, chats: list[ChatEntry], current: Optional[int] = None) -> None:
        """Show `chats` (already filtered and sorted), keeping `current` selected without re-emitting it."""
        self._quiet = True
        bar = self.list.verticalScrollBar()
        scrolled = bar.value()  # where the user scrolled to: a refresh (an answer ending) jumped back to the top
        try:
            self.list.clear()
            self._items = {}
            for c in chats:
                item = _ChatItem(c)
                self.list.addItem(item)
                self._items[c.id] = item
                if c.id == current:
                    self.list.setCurrentItem(item)
            self.list.doItemsLayout()  # the scroll bar's range, now: cleared, it could not go past 0
            bar.setValue(scrolled)
        finally:
            self._quiet = False

    def select(self, chat_id: Optional[int]) -> None:
        """Show `chat_id` as the current chat (none where it is None or not listed) without re-emitting it or
        listing the chats again (that took ~0.2 s of every switch between chats of a list of 5,000)."""
        item = self._items.get(chat_id) if chat_id is not None else None
        if item is self.list.currentItem():
            return
        self._quiet = True
        try:
            if item is None:
                self.list.setCurrentRow(-1)
            else:
                self.list.setCurrentItem(item)
        finally:
            self._quiet = False

    def chat_ids(self) -> list[int]:
        return [self.list.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.list.count())]

    def current_id(self) -> Optional[int]:
        item = self.list.currentItem()
        return None if item is None else item.data(Qt.ItemDataRole.UserRole)

    def focus_search(self) -> None:
        self.search.setFocus()
        self.search.selectAll()

    def _search_now(self) -> None:
        self._search_timer.stop()
        self.searchChanged.emit(self.search.text().strip())

    def _current_changed(self, item: Optional[QListWidgetItem], _prev) -> None:
        if item is not None and not self._quiet:
            self.chatSelected.emit(item.data(Qt.ItemDataRole.UserRole))

    def _menu(self, pos: QPoint) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        chat_id = item.data(Qt.ItemDataRole.UserRole)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self.ask_rename(chat_id))
        menu.addAction("Delete…", lambda: self.ask_delete(chat_id))
        menu.exec(self.list.viewport().mapToGlobal(pos))

    def _delete_current(self) -> None:
        chat_id = self.current_id()
        if chat_id is not None:
            self.ask_delete(chat_id)

    def _current_menu(self) -> None:
        item = self.list.currentItem()
        if item is not None:
            self._menu(self.list.visualItemRect(item).center())

    def _title(self, chat_id: int) -> str:
        for i in range(self.list.count()):
            if self.list.item(i).data(Qt.ItemDataRole.UserRole) == chat_id:
                return self.list.item(i).text()
        return ""

    def ask_rename(self, chat_id: int, title: Optional[str] = None) -> None:
        """`title`: the one to start from where the list does not show the chat (a search hides it)."""
        shown = self._title(chat_id) or title or ""
        title, ok = QInputDialog.getText(self, "Rename chat", "Title:", QLineEdit.EchoMode.Normal, shown)
        # one line, as a title made from a first message is: a pasted one kept its breaks
        title = " ".join(title.split())
        if ok and title:
            self.renameRequested.emit(chat_id, title)

    def ask_delete(self, chat_id: int, title: Optional[str] = None) -> None:
        if confirm(
            self,
            "Delete chat",
            f"Delete “{self._title(chat_id) or title or ''}” and all its messages? This cannot be undone.",
            "Delete",
        ):
            self.deleteRequested.emit(chat_id)
