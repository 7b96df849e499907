"""The Server panel: start and stop the OpenAI-compatible API on the loaded model, where it listens, how many
requests it served, and its last error."""

from __future__ import annotations

from typing import Any, Optional

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QFormLayout, QLabel, QLineEdit, QPushButton, QSpinBox, QVBoxLayout, QWidget

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
        self.button = QPushButton("Start server", self)
        self.button.clicked.connect(self._clicked)
        self.address = QLabel("Not running", self)
        self.address.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.counts = QLabel("", self)
        self.error = error_label(self, selectable=True)
        form = QFormLayout()
        form.addRow("Host", self.host)
        form.addRow("Port", self.port)
        form.addRow("API key", self.api_key)
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

    def _clicked(self) -> None:
        if self.running:
            self.stopRequested.emit()
        else:
            self.error.hide()
            # a pasted key loses the spaces and line end around it, as in the remote model dialog (it was refused)
            self.startRequested.emit(self.host.text().strip(), self.port.value(), self.api_key.text().strip())

    def set_running(self, url: Optional[str]) -> None:
        self.running = url is not None
        self.button.setText("Stop server" if self.running else "Start server")
        for w in (self.host, self.port, self.api_key):
            w.setEnabled(not self.running)
        self.address.setText(f"Listening at {url}" if url else "Not running")

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
