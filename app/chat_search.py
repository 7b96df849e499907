"""The chat list's search, off the GUI thread: each search folds the text of every message it has to look at in
Python (other scripts than Latin), ~0.2 s over 5,000 messages, which held the window at every letter typed. One
search runs at a time; a newer one stops the one running, a search asked for before its turn and overtaken is never
run, and only the newest one's result is given."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from PySide6.QtCore import QObject, Signal

from app.store import ChatStore, StoreError


class ChatSearch(QObject):
    found = Signal(int, str, object)  # serial, search, [(id, title, updated)] newest first
    failed = Signal(int, str)  # serial, a message for the user

    def __init__(self, store: ChatStore, parent: Optional[QObject] = None):
        super().__init__(parent)
        self._store = store
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chat-search")
        self._lock = threading.Lock()
        self._latest = 0
        self._closed = False

    def ask(self, search: str) -> int:
        """Search for `search`; found (or failed) comes with the returned serial unless a newer ask comes first."""
        with self._lock:
            self._latest += 1
            serial = self._latest
        self._store.interrupt_search()  # the older one running now gives way
        if not self._closed:
            self._pool.submit(self._run, serial, search)
        return serial

    def drop(self) -> None:
        """No search asked for so far is wanted any more."""
        with self._lock:
            self._latest += 1
        self._store.interrupt_search()

    def is_latest(self, serial: int) -> bool:
        return serial == self._latest

    def close(self) -> None:
        self._closed = True
        self.drop()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, serial: int, search: str) -> None:
        if not self.is_latest(serial):
            return  # overtaken before its turn
        try:
            rows = self._store.search_titles(search)
        except StoreError as exc:
            if self.is_latest(serial):  # else it was stopped for a newer one
                self.failed.emit(serial, str(exc))
            return
        if self.is_latest(serial):
            self.found.emit(serial, search, rows)
