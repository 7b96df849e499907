"""The Server panel: start and stop the OpenAI-compatible API on the loaded model, where it listens, how many
requests it served, and its last error."""

from __future__ import annotations

import secrets
from typing import Any, Optional

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication, QKeyEvent
from PySide6.QtWidgets import (
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from ui.parts import error_label


class ServerPanel(QWidget):
    startRequested = Signal(str, int, str)  # host, port, API key ("" for none)
    stopRequested = Signal()

    def __init__(self, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.host = QLineEdit("127.0.0.1", self)
        self.host.setToolTip("127.0.0.1 keeps the API on this machine; any other address needs an API key")
        self.port = QSpinBox(self)
        self.port.setRange(1, 65535)
        self.port.setValue(8080)
        self.api_key = QLineEdit(self)
        self.api_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.api_key.setPlaceholderText("none (loopback only)")
        # a key typed blind could not be read back, nor copied out of the field for the clients
        self.show_key = QPushButton("Show", self)
        self.show_key.setCheckable(True)
        self.show_key.setToolTip("Show the API key")
        self.show_key.toggled.connect(self._show_key)
        self.new_key = QPushButton("Generate", self)
        self.new_key.setToolTip("A new random API key")
        self.new_key.clicked.connect(self.generate_key)
        self.copy_key = QPushButton("Copy", self)
        self.copy_key.setToolTip("Copy the API key, for the clients")
        self.copy_key.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.api_key.text().strip()))
        self.button = QPushButton("Start server", self)
        self.button.clicked.connect(self._clicked)
        self.address = QLabel("Not running", self)
        self.address.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.counts = QLabel("", self)
        for label in (self.address, self.counts):  # a long line widened the docks, narrowing the conversation
            label.setWordWrap(True)
        self.error = error_label(self, selectable=True)
        form = QFormLayout()
        form.addRow("Host", self.host)
        form.addRow("Port", self.port)
        key_row = QHBoxLayout()
        key_row.addWidget(self.api_key, 1)
        for button in (self.show_key, self.new_key, self.copy_key):
            key_row.addWidget(button)
        key_label = QLabel("API key", self)
        key_label.setBuddy(self.api_key)  # a row of a field and buttons gets no buddy of its own: unnamed
        form.addRow(key_label, key_row)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(self.button)
        lay.addWidget(self.address)
        lay.addWidget(self.counts)
        lay.addWidget(self.error)
        lay.addStretch(1)
        self.running = False
        self.set_stats(None)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        """Enter in Host, Port or API key starts the server, as a dialog's default button would: a docked panel has
        none, and the fields pass Enter on to it (it did nothing). While the server runs the fields are off."""
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not self.running and self.button.isEnabled():
            self._clicked()
            return
        super().keyPressEvent(event)

    def _show_key(self, shown: bool) -> None:
        self.api_key.setEchoMode(QLineEdit.EchoMode.Normal if shown else QLineEdit.EchoMode.Password)
        self.show_key.setText("Hide" if shown else "Show")

    def generate_key(self) -> None:
        self.api_key.setText(f"sk-{secrets.token_urlsafe(24)}")

    def _clicked(self) -> None:
        if self.running:
            self.stopRequested.emit()
        else:
            self.error.hide()
            # a pasted key loses the spaces and line end around it, as in the remote model dialog (it was refused)
            self.startRequested.emit(self.host.text().strip(), self.port.value(), self.api_key.text().strip())

    def set_running(self, url: Optional[str], reachable: Optional[str] = None) -> None:
        """`reachable`: for a server on every address (0.0.0.0, ::), one its clients can use."""
        self.running = url is not None
        self.button.setText("Stop server" if self.running else "Start server")
        for w in (self.host, self.port, self.api_key, self.new_key):
            w.setEnabled(not self.running)
        text = f"Listening at {url}" if url else "Not running"
        if url and reachable:  # 0.0.0.0 is no address a client can ask
            text += f" — on every address of this machine, e.g. {reachable}"
        self.address.setText(text)

    def set_stats(self, stats: Optional[dict[str, Any]]) -> None:
        if not stats:
            self.counts.setText("Requests served: 0")
            return
        self.counts.setText(
            f"Requests served: {stats['served']} · cancelled {stats['cancelled']} · refused busy {stats['rejected']}"
            f" · failed {stats['failed']} · now {stats['running']} running, {stats['waiting']} waiting"
        )
        if stats.get("last_error"):
            self.set_error(f"Last error: {stats['last_error']}")

    def set_error(self, message: str) -> None:
        self.error.setText(message)
        self.error.show()
