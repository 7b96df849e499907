"""Open a remote model: an OpenAI-compatible server's base URL (vLLM, llama.cpp's server, Ollama, another
Gapless), the model's name there, its API key and how long to wait for it."""

from __future__ import annotations

from typing import Optional

from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QVBoxLayout,
    QWidget,
)

from engine.types import api_key_problem, remote_address_problem
from ui.parts import error_label

EXAMPLES = (
    "vLLM: http://host:8000/v1 · llama.cpp server: http://host:8080/v1 · Ollama: http://host:11434/v1 · "
    "gapless serve: http://host:8080/v1"
)


class RemoteDialog(QDialog):
    def __init__(self, parent: Optional[QWidget] = None, base_url: str = "", model: str = "", timeout_s: float = 60.0):
        super().__init__(parent)
        self.setWindowTitle("Open a remote model")
        self.base_url = QLineEdit(base_url, self)
        self.base_url.setPlaceholderText("http://127.0.0.1:8000/v1")
        self.model = QLineEdit(model, self)
        self.model.setPlaceholderText("the model's name on the server (GET /v1/models lists them)")
        self.api_key = QLineEdit(self)
        self.api_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.api_key.setPlaceholderText("kept in the OS keyring, or an owner-only file; empty: keep the stored one")
        self.timeout = QDoubleSpinBox(self)
        self.timeout.setRange(1.0, 3600.0)
        self.timeout.setDecimals(0)
        self.timeout.setSuffix(" s")
        self.timeout.setValue(timeout_s)
        self.timeout.setToolTip("how long to wait to connect, and for each next piece of the answer")
        hint = QLabel(EXAMPLES, self)
        hint.setWordWrap(True)
        hint.setObjectName("notice")
        self.error = error_label(self)
        form = QFormLayout()
        form.addRow("&Server URL", self.base_url)  # Alt+letter moves to the field; O and C are OK's and Cancel's
        form.addRow("&Model", self.model)
        form.addRow("API &key", self.api_key)
        form.addRow("&Timeout", self.timeout)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel, self)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(hint)
        lay.addWidget(self.error)
        lay.addWidget(buttons)
        # wide enough for the longest placeholder: it says what to enter where
        widest = max(self.fontMetrics().horizontalAdvance(w.placeholderText()) for w in (self.model, self.api_key))
        self.api_key.setMinimumWidth(widest + 24)
        self.model.setMinimumWidth(widest + 24)

    def problem(self) -> str:
        """What is wrong with the fields, in the engine's words (engine.types), or ""."""
        why = remote_address_problem(self.base_url.text().strip())
        model = self.model.text().strip()
        if not why and (not model or "#" in model or "|" in model):
            why = "give the model's name as the server lists it (without '#' or '|')"
        key = self.api_key.text().strip()
        if not why and key:
            why = api_key_problem(key)
        return why[0].upper() + why[1:] if why else ""

    def accept(self) -> None:
        why = self.problem()
        if why:
            self.error.setText(why)
            self.error.show()
            return
        super().accept()

    def values(self) -> tuple[str, str, str, float]:
        """(base URL, model, API key or "", timeout in seconds)."""
        return (
            self.base_url.text().strip().rstrip("/"),
            self.model.text().strip(),
            self.api_key.text().strip(),
            float(self.timeout.value()),
        )
