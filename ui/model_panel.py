"""The model panel: what is loaded (family, parameters, dtype, device, context, weight memory), and how to open
another one (GGUF file, Hugging Face folder, a recent model, the default). A failed load shows why here."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Optional

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtWidgets import (
    QFileDialog,
    QGridLayout,
    QGroupBox,
    QLabel,
    QMenu,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine.paths import user_path
from engine.types import ModelInfo, Progress, source_label
from ui.dialogs import choose_model
from ui.hud import fmt
from ui.hud.fmt import NA
from ui.parts import error_label, park_focus, shown_as_is
from ui.progress import show_progress


class WrappedValue(QLabel):
    """A value that wraps (a model's long file name) and asks the layout for the height of all its lines at the
    width it has: a grid gives a wrapping label no more than one line's height once the column is short (a short
    window, a scale of 200 %), and the second line was cut off ("SmolLM2-135M-" alone, "Q4_1" cut to "Q4 1")."""

    def minimumSizeHint(self) -> QSize:
        hint = super().minimumSizeHint()
        if self.wordWrap() and self.width() > 0:
            hint.setHeight(max(hint.height(), self.heightForWidth(self.width())))
        return hint

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        if event.oldSize().width() != event.size().width():
            self.updateGeometry()  # another width wraps into another number of lines


class ModelPanel(QGroupBox):
    openRequested = Signal(str)  # "default", a GGUF path or a folder
    modelsFolderChosen = Signal(str)  # a folder to scan for models
    folderUsed = Signal(str)  # the folder a file dialog was left in (the next one starts there)
    # the button holding the keyboard focus was disabled by a load: the window gives it to the composer (Qt
    # passed it to the next control, the Preset list, where an arrow key changed the optimizations)
    focusReleased = Signal()
    remoteRequested = Signal(str, str, str, float)  # base URL, model, API key ("": keep the stored one), timeout s
    forgetRequested = Signal(str)  # a recent model to take off the list (its file is left alone)
    clearRecentRequested = Signal()  # every recent model off the list

    FIELDS = (
        "name",
        "family",
        "parameters",
        "dtype",
        "device",
        "context",
        "weights",
        "per_token",
        "floor",
        "backend",
        "load",
    )

    def __init__(self, parent: Optional[QWidget] = None):
        super().__init__("Model", parent)
        grid = QGridLayout()
        grid.setHorizontalSpacing(10)
        grid.setVerticalSpacing(2)
        self.values: dict[str, QLabel] = {}
        labels = dict(
            zip(
                self.FIELDS,
                (
                    "Name",
                    "Family",
                    "Parameters",
                    "Dtype",
                    "Device",
                    "Context",
                    "Weights",
                    "Bytes/token",
                    "Memory floor",
                    "Backend",
                    "Load time",
                ),
            )
        )
        for row, key in enumerate(self.FIELDS):
            k = QLabel(labels[key], self)
            k.setObjectName("infoKey")
            v = WrappedValue(NA, self)
            v.setObjectName("infoValue")
            v.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            v.setWordWrap(key == "name")  # long file names wrap instead of widening the column
            grid.addWidget(k, row, 0, Qt.AlignmentFlag.AlignTop)
            grid.addWidget(v, row, 1)
            self.values[key] = v
        grid.setColumnStretch(1, 1)

        self.status = QLabel("No model loaded", self)
        self.status.setObjectName("notice")
        self.status.setWordWrap(True)
        self.error = error_label(self, selectable=True)
        self.progress = QProgressBar(self)
        self.progress.setTextVisible(False)
        self.progress.setMaximumHeight(6)
        self.progress.hide()
        # Texts of any length (a remote server's address, a file name being loaded, a path in a load error) take the
        # width the figures give the column, wrapping or cut there: the column's least width is what the figures
        # need (main_window.Pane), and such a line took the window wider, past the screen for a long one.
        for label in (self.values["device"], self.status, self.error):
            policy = label.sizePolicy()
            policy.setHorizontalPolicy(QSizePolicy.Policy.Ignored)
            label.setSizePolicy(policy)

        self.open_file_button = QPushButton("Open GGUF…", self)
        self.open_file_button.setToolTip("Load a .gguf model file")
        self.open_file_button.clicked.connect(self.open_file_dialog)
        self.open_folder_button = QPushButton("Folder…", self)
        self.open_folder_button.setToolTip("Load a Hugging Face model folder (config.json + *.safetensors)")
        self.open_folder_button.clicked.connect(self.open_folder_dialog)
        self.recent_button = QToolButton(self)
        self.recent_button.setText("Models")
        self.recent_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        self.recent_button.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.recent_button.setToolTip("The default model, models opened before, and those in your models folder")
        self.recent_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self._recent_menu = QMenu(self)
        self.recent_button.setMenu(self._recent_menu)
        # kept across refreshes: the models menu's clear() leaves a submenu made by addMenu(title) behind
        self.forget_menu = QMenu("Remove from Recent", self)
        self.remote_button = QPushButton("Remote…", self)
        self.remote_button.setToolTip("Chat through an OpenAI-compatible server: vLLM, llama.cpp, Ollama, Gapless")
        self.remote_button.clicked.connect(self.open_remote_dialog)
        buttons = QVBoxLayout()  # stacked, so a narrow column does not cut them off
        buttons.setSpacing(4)
        buttons.addWidget(self.open_file_button)
        buttons.addWidget(self.open_folder_button)
        buttons.addWidget(self.remote_button)

        lay = QVBoxLayout(self)
        lay.setSpacing(6)
        lay.addLayout(grid)
        lay.addWidget(self.status)
        lay.addWidget(self.progress)
        lay.addWidget(self.error)
        lay.addLayout(buttons)
        lay.addWidget(self.recent_button)
        self.info: Optional[ModelInfo] = None
        self.last_folder = ""  # where file dialogs start ("" = Qt's choice)
        # what the remote dialog was last accepted with: a retry (a wrong key, a server down) starts from it
        self._remote_asked: Optional[tuple[str, str, float]] = None

    def set_info(self, info: Optional[ModelInfo]) -> None:
        self.info = info
        if info is None:
            for v in self.values.values():
                v.setText(NA)
            return
        shown = {
            "name": info.name,
            "family": info.family,
            "parameters": fmt.count(info.parameters),
            "dtype": info.dtype,
            "device": info.device,
            "context": f"{info.context_length:,}",
            "weights": fmt.size(info.weight_bytes),
            "backend": "fast path" if info.backend == "fast" else f"{info.backend} fallback",
            "load": NA if info.load_seconds is None else f"{info.load_seconds:.2f} s",
            "per_token": fmt.size(info.bytes_per_token),
            "floor": NA if info.memory_floor_ms is None else f"{info.memory_floor_ms:.3f} ms/token",
        }
        if info.backend == "remote":  # the server says nothing of its weights; the context only sometimes
            shown.update(
                parameters=f"{NA} (remote)",
                weights=f"{NA} (remote)",
                backend="remote server",
                context=f"{info.context_length:,}" if info.context_length else f"{NA} (not reported)",
            )
        for key, text in shown.items():
            self.values[key].setText(text)
        self.values["name"].setToolTip(info.source)
        self.values["family"].setToolTip(info.architecture)
        self.values["load"].setToolTip(info.load_seconds_source or "n/a: this model was not timed as it loaded")
        self.values["per_token"].setToolTip(info.bytes_per_token_source or "n/a: not counted for this model")
        self.values["floor"].setToolTip(info.memory_floor_source or "n/a: not computed for this model")
        if info.weights != "native":
            self.values["weights"].setText(f"{fmt.size(info.weight_bytes)} ({info.weights})")
            kernel = info.weights_kernel or f"{NA} (not reported)"
            self.values["weights"].setToolTip(f"{info.weights} linears: {kernel}")
        else:
            self.values["weights"].setToolTip("")
        self.values["backend"].setToolTip(
            f"{info.backend_reason}: its options and GPU figures are the server's"
            if info.backend == "remote"
            else "Gapless's own decoder: every optimization can be switched"
            if info.backend == "fast"
            else f"transformers runs this model{f': {info.backend_reason}' if info.backend_reason else ''}; "
            "compile, CUDA graphs and the static KV cache are not available on it"
        )

    def set_loading(self, source: str, keep_error: bool = False) -> None:
        """keep_error: a model asked for before this one failed, and the panel goes on saying so (it showed only
        this one's progress, the failure left to a message box)."""
        if not keep_error:
            self.error.hide()
        self.status.setText(f"Loading {source_label(source)}…")
        self.progress.setRange(0, 0)
        self.progress.show()
        self._set_buttons(False)

    def set_progress(self, p: Progress) -> None:
        show_progress(self.progress, self.status, p)

    def set_loaded(self, info: ModelInfo, keep_error: bool = False) -> None:
        self.set_info(info)
        self.progress.hide()
        if not keep_error:
            self.error.hide()
        self.status.setText("Ready")
        self._set_buttons(True)

    def set_failed(self, source: str, message: str, keep_error: bool = False) -> None:
        """keep_error: an earlier failure of the same queue of loads stays said above this one."""
        self.progress.hide()
        self._set_buttons(True)
        said = f"Could not load {source_label(source)}: {message}"
        self.error.setText(f"{self.error.text()}\n{said}" if keep_error and self.error.isVisibleTo(self) else said)
        self.error.show()
        self.status.setText(f"Still using {self.info.name}" if self.info else "No model loaded")

    def clear_error(self) -> None:
        """A failed load no longer holds once the model in use has answered: its message goes."""
        if self.error.isVisibleTo(self) and self.info is not None:
            self.error.hide()
            self.status.setText("Ready")

    def _set_buttons(self, enabled: bool) -> None:
        buttons = (self.open_file_button, self.open_folder_button, self.remote_button, self.recent_button)
        released = not enabled and park_focus(self, list(buttons))
        for b in buttons:
            b.setEnabled(enabled)
        if released:
            self.focusReleased.emit()

    def set_models(self, default: Any, recent: list[Any], scanned: list[Any], folder: Optional[str]) -> None:
        """The models menu. Entries carry `source`, `name`, `present` and `note` (app.registry.ModelEntry)."""
        menu, forget = self._recent_menu, self.forget_menu
        menu.clear()
        forget.clear()

        def text_of(entry: Any, label: Optional[str] = None) -> str:
            text = label or entry.name
            return shown_as_is(f"{text} ({entry.note})" if entry.note else text)

        def add(entry: Any, label: Optional[str] = None) -> None:
            act = menu.addAction(text_of(entry, label), partial(self.openRequested.emit, entry.source))
            act.setToolTip(entry.path or entry.source)
            # a missing file cannot be opened; the default model can always be (it is downloaded first)
            act.setEnabled(entry.present or entry.source == "default")

        add(default, f"Default model: {default.name}")
        others = [e for e in recent if e.source != "default"]
        if others:
            menu.addSection("Recent")
            for e in others:
                add(e)
                # a file deleted, or one not wanted any more, can be taken off (a missing one too: it is disabled
                # above, and stayed on the list for good)
                act = forget.addAction(text_of(e), partial(self.forgetRequested.emit, e.source))
                act.setToolTip(e.path or e.source)
            forget.addSeparator()
            forget.addAction("Clear Recent", self.clearRecentRequested.emit)
            forget.setToolTipsVisible(True)
            menu.addMenu(forget)
        if folder:
            menu.addSection(shown_as_is(f"In {folder}"))
            for e in scanned:
                add(e)
            if not scanned:  # a folder on a drive not plugged in is kept, and said to be away
                here = user_path(folder).is_dir()  # "~/models" in the settings is scanned as the home's
                menu.addAction("no models found" if here else "folder not found").setEnabled(False)
        menu.addSeparator()
        menu.addAction("Choose a models folder…", self._choose_models_folder)
        menu.setToolTipsVisible(True)

    def _choose_models_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(
            self, "A folder with GGUF files or model folders to list here", self.last_folder
        )
        if path:
            self._used(str(Path(path).parent))
            self.modelsFolderChosen.emit(path)

    def open_file_dialog(self) -> None:
        path = choose_model(self, "Open a GGUF model", self.last_folder)
        if path:
            self._used(str(Path(path).parent))
            self.openRequested.emit(path)

    def open_remote_dialog(self) -> None:
        from ui.remote_dialog import RemoteDialog

        dialog = RemoteDialog(self, *self._remote_asked) if self._remote_asked else RemoteDialog(self)
        try:
            if dialog.exec() != RemoteDialog.DialogCode.Accepted:
                return
            base_url, model, api_key, timeout_s = dialog.values()
        finally:
            dialog.deleteLater()  # and the key typed into it
        self._remote_asked = (base_url, model, timeout_s)  # the key is never shown again
        self.remoteRequested.emit(base_url, model, api_key, timeout_s)

    def open_folder_dialog(self) -> None:
        path = choose_model(self, "Open a Hugging Face model folder", self.last_folder, folder=True)
        if path:
            self._used(str(Path(path).parent))
            self.openRequested.emit(path)

    def _used(self, folder: str) -> None:
        self.last_folder = folder
        self.folderUsed.emit(folder)
