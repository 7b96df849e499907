"""Dialogs: download / load progress (size, speed, cancel), errors, and a chat's settings (system prompt,
sampling parameters and overflow policy) on the form Preferences shares for the defaults of new chats."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Optional

from PySide6.QtCore import QLocale, Qt, Signal
from PySide6.QtGui import QIntValidator
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.settings import CHAT_DEFAULTS
from engine.errors import OptionsError
from engine.types import (
    MAX_NEW_TOKENS_LIMIT,
    OVERFLOW_LABELS,
    OVERFLOW_POLICIES,
    REPETITION_PENALTY_MIN,
    TOP_K_LIMIT,
    Progress,
    SamplingParams,
)
from ui.parts import error_label
from ui.progress import show_progress

# Sane defaults for a new chat: a little randomness, the usual nucleus/top-k cut, a light repetition penalty.


def _for_reading(box: QMessageBox) -> QMessageBox:
    """A box for reading: its message shown as written (as ui.plain_text's guard makes every label in the app),
    selectable, and freed once closed (else it stays a child of its window, one more for each message)."""
    box.setTextFormat(Qt.TextFormat.PlainText)
    box.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    return box


def show_error(parent: Optional[QWidget], title: str, message: str) -> None:
    box = QMessageBox(QMessageBox.Icon.Warning, title, message, QMessageBox.StandardButton.Ok, parent)
    _for_reading(box).open()  # never blocks the event loop: streaming and the HUD keep running behind it


def show_error_and_wait(parent: Optional[QWidget], title: str, message: str) -> None:
    """A warning read before what comes next goes on (a window about to close, whose status bar goes with it):
    returns once OK is clicked."""
    box = QMessageBox(QMessageBox.Icon.Warning, title, message, QMessageBox.StandardButton.Ok, parent)
    _for_reading(box).exec()


def show_info(parent: Optional[QWidget], title: str, message: str) -> QMessageBox:
    """A message for reading (shortcuts, about), never blocking the event loop."""
    box = QMessageBox(QMessageBox.Icon.Information, title, message, QMessageBox.StandardButton.Close, parent)
    _for_reading(box).open()
    return box


def confirm(parent: Optional[QWidget], title: str, text: str, action: str) -> bool:
    """Ask before a destructive `action` ("Delete"): True only when its button was clicked. Cancel is the
    default, so Enter or Esc keep everything."""
    box = QMessageBox(QMessageBox.Icon.Question, title, text, QMessageBox.StandardButton.Cancel, parent)
    chosen = box.addButton(action, QMessageBox.ButtonRole.DestructiveRole)
    box.setDefaultButton(QMessageBox.StandardButton.Cancel)
    try:
        box.exec()
        return box.clickedButton() is chosen
    finally:
        box.deleteLater()  # a dialog given a parent stays its child until deleted: one more each time it is asked


def choose_model(parent: Optional[QWidget], caption: str, start: str, folder: bool = False) -> str:
    """A model's path, from a file dialog (a GGUF file) or a folder dialog (a Hugging Face folder) that starts
    in `start` ("" = Qt's choice); "" when cancelled."""
    if folder:
        return QFileDialog.getExistingDirectory(parent, caption, start)
    path, _ = QFileDialog.getOpenFileName(parent, caption, start, "GGUF models (*.gguf);;All files (*)")
    return path


def ask_save_file(parent: Optional[QWidget], caption: str, start: str, file_filter: str) -> str:
    """The path to save to, from a save dialog that opens on `start` (a folder and the suggested name); "" when
    cancelled. A name typed without a suffix is given the filter's first one ("series" is "series.csv" for
    "CSV (*.csv)"), and the dialog asks before replacing the file of that name (the static dialog returned the
    name as typed: the export was written without its suffix, and a file with it was never asked about)."""
    dialog = QFileDialog(parent, caption)
    dialog.setAcceptMode(QFileDialog.AcceptMode.AcceptSave)
    dialog.setNameFilter(file_filter)
    suffix = re.search(r"\*\.([^\s;)*]+)", file_filter)
    if suffix:
        dialog.setDefaultSuffix(suffix.group(1))
    where = Path(start)
    dialog.setDirectory(str(where.parent))
    dialog.selectFile(where.name)
    try:
        if dialog.exec() != QDialog.DialogCode.Accepted:
            return ""
        chosen = dialog.selectedFiles()
        return chosen[0] if chosen else ""
    finally:
        dialog.deleteLater()  # with its file system model, which watches the folder shown


def _digits_only(validator: QIntValidator) -> QIntValidator:
    """`validator` reading plain digits, whatever the locale: it took "1,000" (or "1.000", "1 000") as a seed that
    int() then refused, and OK did nothing."""
    c = QLocale.c()
    c.setNumberOptions(QLocale.NumberOption.RejectGroupSeparator)
    validator.setLocale(c)
    return validator


def _seed(text: str) -> Optional[int]:
    """The seed field's number; None (a new seed each time) where it is empty."""
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise OptionsError(f"seed must be a whole number from 0 to {2**31 - 1:,} or empty, not {text!r}") from None


class ProgressDialog(QDialog):
    """Progress of a download or a load: what is happening, a bar, a detail line, and Cancel."""

    cancelRequested = Signal()

    def __init__(self, title: str, text: str, cancellable: bool = True, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.setWindowTitle(title)
        self.setModal(True)
        self.setMinimumWidth(440)
        self.text = QLabel(text, self)
        self.text.setWordWrap(True)
        self.bar = QProgressBar(self)
        self.bar.setRange(0, 0)
        self.detail = QLabel("", self)
        self.detail.setObjectName("notice")
        self.cancel_button = QPushButton("Cancel", self)
        self.cancel_button.clicked.connect(self._cancel)
        self.cancel_button.setVisible(cancellable)
        row = QHBoxLayout()
        row.addWidget(self.detail, 1)
        row.addWidget(self.cancel_button)
        lay = QVBoxLayout(self)
        lay.addWidget(self.text)
        lay.addWidget(self.bar)
        lay.addLayout(row)
        self.cancelled = False

    def set_progress(self, p: Progress) -> None:
        """The bar follows the fraction (busy when unknown); the line under it says what happens now —
        for a download, the bytes done of the total and the speed."""
        show_progress(self.bar, self.detail, p)

    def _cancel(self) -> None:
        self.cancelled = True
        self.cancel_button.setEnabled(False)
        self.cancel_button.setText("Cancelling…")
        self.cancelRequested.emit()

    def reject(self) -> None:  # Esc or the window's close button mean Cancel
        if self.cancel_button.isVisible() and not self.cancelled:
            self._cancel()


def stops_text(stops: tuple[str, ...]) -> str:
    """Stop strings as the field shows them: comma-separated, with a comma, a new line, a tab and a backslash
    written \\, \\n \\t \\\\ (joined and split on bare commas, "a,b" became two stops and "\\n\\n" none)."""
    return ", ".join(s.translate(_STOP_ESCAPES) for s in stops)


_STOP_ESCAPES = str.maketrans({"\\": "\\\\", ",": "\\,", "\n": "\\n", "\t": "\\t", "\r": "\\r"})
_STOP_UNESCAPES = {"n": "\n", "t": "\t", "r": "\r", ",": ",", "\\": "\\"}


def stops_from(text: str) -> tuple[str, ...]:
    """The stop strings of the field's text (stops_text's form); each stripped of the spaces typed around it."""
    stops, part, chars = [], [], iter(text)
    for c in chars:
        if c == "\\":
            nxt = next(chars, "")
            part.append("\x00" + nxt)  # an escape: kept apart from the text around it until stripped
        elif c == ",":
            stops.append(part)
            part = []
        else:
            part.append(c)
    stops.append(part)
    out = []
    for p in stops:
        raw = "".join(p).strip()
        value = re.sub("\x00(.?)", lambda m: _STOP_UNESCAPES.get(m.group(1), "\\" + m.group(1)), raw)
        if value:
            out.append(value)
    return tuple(out)


class SamplingDialog(QDialog):
    """A system prompt and sampling parameters with OK, Cancel and Restore defaults, validated by SamplingParams
    (and `problem()`) before the dialog is accepted: a chat's settings, and the defaults in Preferences.
    Subclasses add their rows to `form` around `add_sampling_rows()`, then call `finish()`."""

    def __init__(self, title: str, system_prompt: str, sampling: SamplingParams, context_length: Optional[int], parent):
        super().__init__(parent)
        self.setWindowTitle(title)
        self.setMinimumWidth(460)
        self._initial = (system_prompt, sampling)
        self.system_prompt = QPlainTextEdit(self)
        self.system_prompt.setPlaceholderText("Optional: how the model should behave in this chat")
        self.system_prompt.setMinimumHeight(90)
        self.system_prompt.setTabChangesFocus(True)  # Tab moves on to the sampling fields
        # The ranges are the engine's (SamplingParams.validate): a chat imported or set with temperature 7.5 was cut
        # to 5 by an OK that changed only its system prompt.
        self.temperature = self._fraction_box(0.0, 100.0, 0.05, "0 = greedy (always the most likely token)")
        self.top_p = self._fraction_box(
            0.01, 1.0, 0.01, "Nucleus sampling: keep the smallest set of tokens whose probability reaches p (1 = off)"
        )
        self.top_k = QSpinBox(self)
        self.top_k.setRange(0, TOP_K_LIMIT)
        self.top_k.setToolTip("Keep the k most likely tokens (0 = off)")
        self.repetition_penalty = self._fraction_box(
            REPETITION_PENALTY_MIN, 10.0, 0.05, "Above 1 discourages repeating tokens already generated (1 = off)"
        )
        self.max_new_tokens = QSpinBox(self)
        # Not bounded by the loaded model's context: the chat keeps its setting across models (a small model's
        # context cut a saved 512 to 256 whenever the dialog was accepted); the engine stops at a full context.
        self.max_new_tokens.setRange(1, MAX_NEW_TOKENS_LIMIT)
        self._context_length = context_length
        self.max_new_tokens.valueChanged.connect(self._max_tokens_tip)
        self._max_tokens_tip(self.max_new_tokens.value())
        self.seed = QLineEdit(self)
        self.seed.setValidator(_digits_only(QIntValidator(0, 2**31 - 1, self)))
        self.seed.setPlaceholderText("random")
        self.seed.setToolTip("The same seed, prompt and options give the same answer; empty = a new seed each time")
        self.stop = QLineEdit(self)
        self.stop.setPlaceholderText("comma-separated, optional")
        self.stop.setToolTip(
            "Stop the answer when one of these strings appears; comma-separated, \\n for a new line, \\, for a comma"
        )
        self._shown: Optional[SamplingParams] = None  # what _show put in the fields
        self._as_shown: dict[str, object] = {}  # the fields' values right after
        self.error = error_label(self)
        self.form = QFormLayout()
        self.buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok
            | QDialogButtonBox.StandardButton.Cancel
            | QDialogButtonBox.StandardButton.RestoreDefaults,
            self,
        )
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        self.buttons.button(QDialogButtonBox.StandardButton.RestoreDefaults).clicked.connect(self.restore_defaults)

    def _max_tokens_tip(self, value: int) -> None:
        tip = "The longest answer, in tokens"
        if self._context_length and value > self._context_length:
            tip += f"; more than this model's context ({self._context_length:,} tokens): answers stop when it is full"
        self.max_new_tokens.setToolTip(tip)

    def _fraction_box(self, low: float, high: float, step: float, tip: str) -> QDoubleSpinBox:
        """A sampling knob shown to two decimals."""
        box = QDoubleSpinBox(self)
        box.setRange(low, high)
        box.setSingleStep(step)
        box.setDecimals(2)
        box.setToolTip(tip)
        return box

    def add_sampling_rows(self, prompt_label: str = "&System prompt") -> None:
        # Alt+letter moves to a field (the label's buddy); O and C are left to OK and Cancel, which some desktops
        # (GNOME, KDE) give those letters
        self.form.addRow(prompt_label, self.system_prompt)
        self.form.addRow("&Temperature", self.temperature)
        self.form.addRow("Top-&p", self.top_p)
        self.form.addRow("Top-&k", self.top_k)
        self.form.addRow("&Repetition penalty", self.repetition_penalty)
        self.form.addRow("&Max tokens", self.max_new_tokens)
        self.form.addRow("S&eed", self.seed)
        self.form.addRow("Stop stri&ngs", self.stop)

    def finish(self) -> None:
        lay = QVBoxLayout(self)
        lay.addLayout(self.form)
        lay.addWidget(self.error)
        lay.addWidget(self.buttons)
        self.system_prompt.setPlainText(self._initial[0])
        self._show(self._initial[1])

    def restore_defaults(self) -> None:
        self._show(CHAT_DEFAULTS)

    def _show(self, s: SamplingParams) -> None:
        self.temperature.setValue(s.temperature)
        self.top_p.setValue(s.top_p)
        self.top_k.setValue(s.top_k)
        self.repetition_penalty.setValue(s.repetition_penalty)
        self.max_new_tokens.setValue(s.max_new_tokens)
        self.seed.setText("" if s.seed is None else str(s.seed))
        self.stop.setText(stops_text(s.stop))
        self._shown, self._as_shown = s, self._fields()

    def _fields(self) -> dict[str, object]:
        """What each field shows, by the SamplingParams field it sets."""
        boxes: dict[str, QSpinBox | QDoubleSpinBox] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty,
            "max_new_tokens": self.max_new_tokens,
        }
        return {**{n: b.value() for n, b in boxes.items()}, "seed": self.seed.text(), "stop": self.stop.text()}

    def sampling(self) -> SamplingParams:
        """The fields' settings; a field left as shown keeps the value it showed exactly (a box shows two
        decimals: an OK that changed only the system prompt rounded top-p 0.955 to 0.95)."""
        seed = self.seed.text().strip()
        typed = SamplingParams(
            temperature=round(self.temperature.value(), 4),
            top_p=round(self.top_p.value(), 4),
            top_k=self.top_k.value(),
            repetition_penalty=round(self.repetition_penalty.value(), 4),
            max_new_tokens=self.max_new_tokens.value(),
            seed=_seed(seed),
            stop=stops_from(self.stop.text()),
        )
        if self._shown is not None:
            untouched = [n for n, now in self._fields().items() if now == self._as_shown[n]]
            typed = replace(typed, **{n: getattr(self._shown, n) for n in untouched})
        return typed.validate()

    def values(self) -> tuple[str, SamplingParams]:
        return self.system_prompt.toPlainText().strip(), self.sampling()

    def problem(self) -> Optional[str]:
        """What else keeps the dialog from being accepted, in words; None when nothing does."""
        return None

    def accept(self) -> None:
        try:
            self.sampling()
        except OptionsError as exc:
            self._refuse(str(exc))
            return
        problem = self.problem()
        if problem is not None:
            self._refuse(problem)
            return
        super().accept()

    def _refuse(self, message: str) -> None:
        self.error.setText(message)
        self.error.show()


class ChatSettingsDialog(SamplingDialog):
    """A chat's system prompt, sampling parameters and overflow policy."""

    def __init__(
        self,
        system_prompt: str,
        sampling: SamplingParams,
        context_length: Optional[int] = None,
        parent: Optional[QWidget] = None,
        overflow_policy: Optional[str] = None,
        default_overflow: str = "rolling",
    ):
        super().__init__("Chat settings", system_prompt, sampling, context_length, parent)
        self.overflow = QComboBox(self)
        self.overflow.addItem(f"Default: {OVERFLOW_LABELS[default_overflow]}", "")
        for policy in OVERFLOW_POLICIES:
            self.overflow.addItem(OVERFLOW_LABELS[policy], policy)
        self.overflow.setCurrentIndex(max(0, self.overflow.findData(overflow_policy or "")))
        self.overflow.setToolTip("What happens when the conversation no longer fits the model's context")
        self.add_sampling_rows()
        self.form.addRow("Context &full", self.overflow)
        self.finish()

    def overflow_policy(self) -> str:
        """The chosen policy, "" for the app's default."""
        return self.overflow.currentData()
