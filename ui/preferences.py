"""Preferences: the theme, the send key, the defaults of new chats (sampling, system prompt, overflow policy) and
the models folder, in one dialog. The main window applies what it accepts at once and saves it in the settings."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from PySide6.QtWidgets import QComboBox, QFileDialog, QHBoxLayout, QLabel, QLineEdit, QPushButton, QWidget

from engine.paths import user_path
from engine.types import OVERFLOW_LABELS, OVERFLOW_POLICIES, SamplingParams
from ui.dialogs import SamplingDialog

THEME_LABELS = {"system": "Follow the system", "light": "Light", "dark": "Dark"}
SEND_LABELS = {"enter": "Enter (Shift+Enter for a new line)", "ctrl+enter": "Ctrl+Enter (Enter for a new line)"}


@dataclass(frozen=True)
class Preferences:
    theme: str  # app.settings.THEMES
    send_with: str  # app.settings.SEND_KEYS
    sampling: SamplingParams  # of new chats
    system_prompt: str  # of new chats
    overflow_policy: str  # of chats without their own
    models_folder: Optional[str]  # None: no folder is listed


def folder_problem(text: str) -> Optional[str]:
    """Why `text` cannot be the models folder; None when it can (an existing folder, or empty for none)."""
    if not text.strip():
        return None
    path = user_path(text.strip())
    if not path.exists():
        return f"The models folder {path} does not exist: choose an existing folder, or leave it empty for none."
    if not path.is_dir():
        return f"The models folder {path} is a file, not a folder."
    return None


def _combo(parent: QWidget, labels: dict[str, str], current: str) -> QComboBox:
    box = QComboBox(parent)
    for key, label in labels.items():
        box.addItem(label, key)
    box.setCurrentIndex(max(0, box.findData(current)))
    return box


class PreferencesDialog(SamplingDialog):
    def __init__(self, current: Preferences, last_folder: str = "", parent: Optional[QWidget] = None):
        super().__init__("Preferences", current.system_prompt, current.sampling, None, parent)
        self.last_folder = last_folder  # where the folder picker starts when no folder is set
        self.theme = _combo(self, THEME_LABELS, current.theme)
        self.send_with = _combo(self, SEND_LABELS, current.send_with)
        self.overflow = _combo(self, {p: OVERFLOW_LABELS[p] for p in OVERFLOW_POLICIES}, current.overflow_policy)
        self.overflow.setToolTip("For chats without a policy of their own (Chat settings gives one its own)")
        self.system_prompt.setPlaceholderText("Optional: how the model should behave in new chats")
        self._saved_folder = current.models_folder or ""
        self.models_folder = QLineEdit(self._saved_folder, self)
        self.models_folder.setPlaceholderText("none: only the default and recent models are listed")
        self.models_folder.setToolTip("GGUF files and model folders in it are listed in the model panel")
        self.choose_button = QPushButton("Choose…", self)
        self.choose_button.clicked.connect(self.choose_folder)
        folder_row = QHBoxLayout()
        folder_row.addWidget(self.models_folder, 1)
        folder_row.addWidget(self.choose_button)
        self.form.addRow("T&heme", self.theme)
        self.form.addRow("Send &with", self.send_with)
        self.add_sampling_rows("Default &system prompt")
        self.form.addRow("Context &full", self.overflow)
        folder_label = QLabel("Models fo&lder", self)
        folder_label.setBuddy(self.models_folder)  # a row of a field and a button gets no buddy of its own: unnamed
        self.form.addRow(folder_label, folder_row)
        self.finish()

    def choose_folder(self) -> None:
        start = self.models_folder.text().strip() or self.last_folder
        path = QFileDialog.getExistingDirectory(self, "A folder with GGUF files or model folders", start)
        if path:
            self.models_folder.setText(path)
            self.last_folder = str(Path(path).parent)

    def problem(self) -> Optional[str]:
        # the folder kept in the settings may be gone for now (a drive not plugged in): left as it was, it stays
        if self.models_folder.text().strip() == self._saved_folder:
            return None
        return folder_problem(self.models_folder.text())

    def preferences(self) -> Preferences:
        """What the dialog shows; valid once it has been accepted."""
        prompt, sampling = self.values()
        folder = self.models_folder.text().strip()
        return Preferences(
            self.theme.currentData(),
            self.send_with.currentData(),
            sampling,
            prompt,
            self.overflow.currentData(),
            # absolute: the same folder wherever the app starts (a folder named "default" too: not a model source)
            os.path.abspath(user_path(folder)) if folder else None,
        )
