"""Answering the app's real dialogs as a user would: the app makes its own QMessageBox / QFileDialog /
QInputDialog / QMenu calls with the installed PySide6's enums, and a timer in the event loop the dialog runs
finds it once it is on screen and clicks its real button (or picks a file, types a title). Nothing replaces
the call, so a wrong enum name or a dialog that never opens fails the test.

Each answered dialog records where the app opened it: the functions of ui/ and app/ on the Python stack
while the dialog's own event loop runs (a blocking exec(), a static getOpenFileName, a menu's exec()).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from PySide6.QtCore import QPoint, Qt, QTimer
from PySide6.QtTest import QTest
from PySide6.QtWidgets import (
    QAbstractButton,
    QApplication,
    QFileDialog,
    QInputDialog,
    QLineEdit,
    QMenu,
    QMessageBox,
    QWidget,
)

ROOT = Path(__file__).resolve().parents[2]
POLL_MS = 20
MAX_POLLS = 1500  # 30 s: a dialog that never opens stops the polling; the test then fails on `answered`


def app_sites() -> list[tuple[str, str]]:
    """(path relative to the repository, function qualname) of the ui/ and app/ frames on the stack now."""
    out = []
    frame = sys._getframe()
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in ("ui", "app"):
            out.append((path.relative_to(ROOT).as_posix(), frame.f_code.co_qualname))
        frame = frame.f_back
    return out


@dataclass
class Answered:
    kind: str  # the dialog's class name
    title: str
    text: str
    sites: list[tuple[str, str]]  # where the app opened it (see app_sites)
    buttons: list[str] = field(default_factory=list)  # a message box's button texts, as shown
    folder: str = ""  # the folder a file dialog opened in


def _shown(kind: type, stale: set[int]) -> Optional[QWidget]:
    if kind is QMenu:
        popup = QApplication.activePopupWidget()
        return popup if isinstance(popup, QMenu) and popup.isVisible() else None
    for w in QApplication.topLevelWidgets():
        if isinstance(w, kind) and w.isVisible() and id(w) not in stale:
            return w
    return None


class DialogDriver:
    """A queue of answers, each for the next dialog of its kind, given in the order the dialogs open.

    Each answer polls with its own timer, started when the one before it has acted (Qt never re-enters a
    timer's slot, and the next dialog may open inside the previous answer's click)."""

    def __init__(self) -> None:
        self.answered: list[Answered] = []
        self._steps: list[tuple[type, Callable[[QWidget], None]]] = []
        self._timers: list[QTimer] = []
        self._expected = 0
        self._stale: set[int] = set()  # dialogs already on screen at start(): not the ones to answer

    # ---- answers -----------------------------------------------------------------------------------

    def click(self, button: str) -> "DialogDriver":
        """A QMessageBox: click the button showing `button` (its text, mnemonic ampersands aside)."""

        def act(box: QWidget) -> None:
            assert isinstance(box, QMessageBox)
            matches = [b for b in box.buttons() if b.text().replace("&", "") == button]
            assert matches, f"no {button!r} button in the message box; it shows {self.answered[-1].buttons}"
            matches[0].click()

        return self._add(QMessageBox, act)

    def type_text(self, text: str, accept: bool = True) -> "DialogDriver":
        """A QInputDialog: type `text` and press OK (or Cancel)."""

        def act(dialog: QWidget) -> None:
            assert isinstance(dialog, QInputDialog)
            dialog.setTextValue(text)
            dialog.accept() if accept else dialog.reject()

        return self._add(QInputDialog, act)

    def choose_file(self, path: Optional[Path]) -> "DialogDriver":
        """A QFileDialog: choose `path` (a file, or in a directory dialog the folder), or Cancel when None."""

        def act(dialog: QWidget) -> None:
            assert isinstance(dialog, QFileDialog)
            if path is None:
                dialog.reject()
            elif dialog.fileMode() == QFileDialog.FileMode.Directory:
                dialog.setDirectory(str(path))
                dialog.accept()
            else:  # typed into the file name box, as a user does (selectFile can lose to the suggested name)
                edit = dialog.findChild(QLineEdit, "fileNameEdit")
                assert edit is not None, "a widget-based file dialog has a file name box"
                edit.setText(str(path))
                dialog.accept()

        return self._add(QFileDialog, act)

    def menu(self, action: str) -> "DialogDriver":
        """A context menu: click the entry showing `action`."""

        def act(menu: QWidget) -> None:
            assert isinstance(menu, QMenu)
            found = [a for a in menu.actions() if a.text() == action]
            assert found, f"no {action!r} in the menu: {[a.text() for a in menu.actions()]}"
            QTest.mouseClick(
                menu, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, menu.actionGeometry(found[0]).center()
            )

        return self._add(QMenu, act)

    def keys(self, kind: type, text: str = "", *keys: Qt.Key) -> "DialogDriver":
        """A dialog or menu of `kind` answered from the keyboard alone: `text` typed, then each of `keys` pressed,
        into whichever widget has the focus as each key goes (the dialog's own where none has it; a menu takes
        the keys itself, as a popup grabs the keyboard)."""

        def act(w: QWidget) -> None:
            if not isinstance(w, QMenu) and not w.isActiveWindow():  # the keys would go to the window behind it
                QTimer.singleShot(POLL_MS, lambda: act(w))
                return

            def target() -> QWidget:
                return w if isinstance(w, QMenu) else QApplication.focusWidget() or w

            QTest.keyClicks(target(), text)
            for key in keys:
                QTest.keyClick(target(), key)

        return self._add(kind, act)

    def look(self, kind: type, check: Callable[[QWidget], None], close: bool = True) -> "DialogDriver":
        """Run `check` while a dialog or menu of `kind` is on screen, then close it (Esc for a menu)."""

        def act(w: QWidget) -> None:
            try:
                check(w)
            finally:
                if close:
                    if isinstance(w, QMenu):
                        QTest.keyClick(w, Qt.Key.Key_Escape)
                    else:
                        w.close()

        return self._add(kind, act)

    # ---- running -----------------------------------------------------------------------------------

    def start(self) -> "DialogDriver":
        """Start polling for the first answer's dialog; call before the action that opens it."""
        self._stale = {id(w) for w in QApplication.topLevelWidgets() if w.isVisible()}
        self._next()
        return self

    @property
    def done(self) -> bool:
        """Every answer given has met its dialog (and acted on it, unless the action opened the next one)."""
        return len(self.answered) == self._expected > 0

    def stop(self) -> None:
        for t in self._timers:
            t.stop()
        self._steps.clear()

    def _add(self, kind: type, act: Callable[[QWidget], None]) -> "DialogDriver":
        self._steps.append((kind, act))
        self._expected = len(self.answered) + len(self._steps)
        return self

    def _next(self) -> None:
        if not self._steps:
            return
        kind, act = self._steps.pop(0)
        timer = QTimer()
        timer.setInterval(POLL_MS)
        polls = [0]

        def poll() -> None:
            polls[0] += 1
            w = _shown(kind, self._stale)
            if w is None:
                if polls[0] >= MAX_POLLS:
                    timer.stop()
                return
            timer.stop()
            buttons = (
                [b.text().replace("&", "") for b in w.findChildren(QAbstractButton)]
                if isinstance(w, QMessageBox)
                else []
            )
            text = w.text() if isinstance(w, QMessageBox) else w.labelText() if isinstance(w, QInputDialog) else ""
            folder = w.directory().absolutePath() if isinstance(w, QFileDialog) else ""
            self.answered.append(Answered(type(w).__name__, w.windowTitle(), text, app_sites(), buttons, folder))
            self._next()  # the next dialog may open inside this answer's click
            act(w)

        timer.timeout.connect(poll)
        timer.start()
        self._timers.append(timer)


def right_click(widget: QWidget, pos: QPoint) -> None:
    """A right-button press and release at `pos`, and the context-menu event a desktop sends with them."""
    from PySide6.QtGui import QContextMenuEvent

    QTest.mousePress(widget, Qt.MouseButton.RightButton, Qt.KeyboardModifier.NoModifier, pos)
    QTest.mouseRelease(widget, Qt.MouseButton.RightButton, Qt.KeyboardModifier.NoModifier, pos)
    event = QContextMenuEvent(QContextMenuEvent.Reason.Mouse, pos, widget.mapToGlobal(pos))
    QApplication.sendEvent(widget, event)
