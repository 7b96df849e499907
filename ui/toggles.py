"""Optimization toggles and presets. A change applies to the next answer (the running one is never touched);
recompile / recapture progress shows here. Options this machine or model cannot honour are disabled, with the
reason as the tooltip."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Callable, Optional, cast

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QFocusEvent, QKeyEvent, QStandardItemModel, QWheelEvent
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QGridLayout,
    QLabel,
    QMenu,
    QProgressBar,
    QSizePolicy,
    QSpinBox,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine.types import (
    DEVICES,
    DTYPES,
    KERNELS,
    KV_MODES,
    MAX_CANDIDATES,
    MAX_DRAFT_TOKENS,
    PRESET_LABELS,
    PRESETS,
    SAMPLING_MODES,
    SPECULATION_MODES,
    WEIGHT_FORMATS,
    EngineOptions,
    Progress,
    model_file_name,
    preset_options,
)
from ui.dialogs import choose_model, confirm
from ui.progress import show_progress
from ui.stats import preset_name

CUSTOM = "custom"
# A dropdown stepped with the arrow keys, a letter or the wheel passes over entries on the way to the one wanted:
# the value it stops at applies once the steps pause this long, or at once on Enter or when the focus leaves.
STEP_SETTLE_MS = 600
COMPILE_ON_CPU = (
    "torch.compile on a CPU takes minutes: the first answer with it waits while the decode step compiles, once for "
    "each context size the answer reaches (a cold compile cost about 33 s a step shape on 2 cores in "
    "docs/benchmarks.md, and over 2 minutes on a loaded machine). Later answers reuse it. The time shows as "
    '"+ compile N s" beside TTFT.\n\nOn a CPU it gains little (19.6 against 17.9 tok/s there).'
)
# The option each preset adds to the rung before it: the preset cannot run where that option cannot.
DEFINING_OPTION: dict[str, Optional[str]] = {
    "naive": None,
    "half": "dtype",
    "device-sampling": "sampling",
    "first-fixes": "kv_cache",
    "compile": "compile",
    "cuda-graph": "cuda_graph",
    "fused": "kernels",
    "int8": "weights",
    "candidates": "candidates",
    "speculation": "speculation",
}
# (preset name, current options, device type "cpu" | "cuda") -> the preset's options on that device
PresetResolver = Callable[[str, EngineOptions, str], EngineOptions]


def _as_defined(name: str, base: EngineOptions, _device_type: str) -> EngineOptions:
    return preset_options(name, base)


TIPS = {
    "device": "auto: CUDA when this machine has it, else the CPU",
    "dtype": "Weight and activation precision. fp32 moves twice the bytes of fp16/bf16 per token.",
    "kv_cache": "static: preallocated cache written in place · dynamic: torch.cat every step · none: re-run the whole prefix",
    "sampling": "device: the next token is sampled on the device, no host sync · host: .item() on every token",
    "compile": "torch.compile the decode step: fewer, fused kernels (a first compile takes a while)",
    "cuda_graph": "Capture the decode step once and replay it per token: no launch gaps between kernels",
    "candidates": "Answers to the same prompt decoded as one batch: each weight read serves all of them",
    "kernels": "torch: the model's modules (compiled with torch.compile when on) · fused: Triton kernels, about five per "
    "layer, on the static KV cache",
    "weights": "native: the linears in the chosen precision · int8: weight-only, one scale per output channel "
    "(half the bytes of fp16) · int4: weight-only, a scale and zero per 32 inputs (a quarter)",
    "speculation": (
        "Speculative decoding: drafts looked up in the prompt and answer (ngram) or made by a smaller model "
        "(draft) are verified in one step; the answer is the one plain decoding gives"
    ),
    "draft_tokens": "Drafts verified per step; auto lengthens them while they are accepted and pauses them when not",
    "profile_window": "Trace a few decode steps of each answer to measure the kernel (or op) gap; those steps are left out of tok/s",
    "prefix_reuse": "Keep the KV cache between answers: the part of the next prompt it already holds is not computed again",
}


class StepCombo(QComboBox):
    """A dropdown that tells a step of the closed box (an arrow key, Home or End, a typed letter, the wheel: each
    emits `activated` for the entry it passes) from a choice in its list, and says when the user is done stepping
    (Enter, or the focus leaving for anything but the box's own list)."""

    settled = Signal()

    def __init__(self, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.stepping = False  # True while a key or the wheel moves the closed box (its `activated` is a step)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        self.stepping = True
        try:
            super().keyPressEvent(event)
        finally:
            self.stepping = False
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            self.settled.emit()

    def wheelEvent(self, event: QWheelEvent) -> None:
        self.stepping = True
        try:
            super().wheelEvent(event)
        finally:
            self.stepping = False

    def focusOutEvent(self, event: QFocusEvent) -> None:
        super().focusOutEvent(event)
        if event.reason() != Qt.FocusReason.PopupFocusReason:  # its own list opening is still choosing
            self.settled.emit()


class StepSpin(QSpinBox):
    """A number box that tells the user's steps and typing (an arrow key or button, held or not, Page Up/Down, the
    wheel, a digit typed: each emits `valueChanged` for the number it passes) from a value set by the program, and
    says when the user is done (Enter, or the focus leaving for anything but its own menu)."""

    settled = Signal()

    def __init__(self, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.stepping = False  # True while a step or a key changes the number (its `valueChanged` is a step)

    def stepBy(self, steps: int) -> None:  # the arrows, held or not, Page Up/Down and the wheel come here
        stepping, self.stepping = self.stepping, True
        try:
            super().stepBy(steps)
        finally:
            self.stepping = stepping

    def keyPressEvent(self, event: QKeyEvent) -> None:
        stepping, self.stepping = self.stepping, True
        try:
            super().keyPressEvent(event)
        finally:
            self.stepping = stepping
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            self.settled.emit()

    def focusOutEvent(self, event: QFocusEvent) -> None:
        super().focusOutEvent(event)
        if event.reason() != Qt.FocusReason.PopupFocusReason:  # its own context menu opening is still editing
            self.settled.emit()

    def shown(self, value: int) -> str:
        """`value` as the box writes it ("auto" for a special value)."""
        if value == self.minimum() and self.specialValueText():
            return self.specialValueText()
        return self.textFromValue(value) + self.suffix()


def _combo(values: tuple[str, ...], parent: QWidget) -> StepCombo:
    c = StepCombo(parent)
    for v in values:
        c.addItem(v, v)
    return c


class TogglesPanel(QWidget):
    optionsChanged = Signal(object)  # EngineOptions
    folderUsed = Signal(str)  # the folder the draft model's file dialog was left in (the next one starts there)
    columnsChanged = Signal(int)  # the controls now lie in one or two columns (the panel's height changed)

    def __init__(
        self,
        options: EngineOptions = EngineOptions(),
        preset_resolver: Optional[PresetResolver] = None,
        parent: Optional[QWidget] = None,
    ):
        super().__init__(parent)
        self.setObjectName("togglesPanel")
        self.preset = StepCombo(self)
        self.preset.addItem("Custom", CUSTOM)
        for name in PRESETS:
            self.preset.addItem(PRESET_LABELS[name], name)
        self.preset.setToolTip("The ladder of fixes, from the naive loop to batched candidates")
        self.device = _combo(DEVICES, self)
        self.dtype = _combo(DTYPES, self)
        self.kv_cache = _combo(KV_MODES, self)
        self.sampling = _combo(SAMPLING_MODES, self)
        # Sized to a few characters, not the longest preset name, so the dock can be narrow; the list shows all.
        self.preset.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.preset.setMinimumContentsLength(8)
        self.compile = QCheckBox("torch.compile", self)
        self.cuda_graph = QCheckBox("CUDA graph", self)
        self.candidates = StepSpin(self)
        self.candidates.setRange(1, MAX_CANDIDATES)
        self.profile_window = QCheckBox("Measure the gap", self)
        self.weights = _combo(WEIGHT_FORMATS, self)
        self.kernels = _combo(KERNELS, self)
        self.speculation = _combo(SPECULATION_MODES, self)
        self.draft_tokens = StepSpin(self)
        self.draft_tokens.setRange(0, MAX_DRAFT_TOKENS)
        self.draft_tokens.setSpecialValueText("auto")
        self.prefix_reuse = QCheckBox("Reuse the prompt's cache", self)
        # The draft model is a path, chosen with a file dialog: not one of the value controls below.
        self.draft_model = QToolButton(self)
        self.draft_model.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        self.draft_model.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.draft_model.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        draft_menu = QMenu(self.draft_model)
        draft_menu.addAction("GGUF file…", lambda: self._choose_draft(folder=False))
        draft_menu.addAction("Model folder…", lambda: self._choose_draft(folder=True))
        self.no_draft_action = draft_menu.addAction("None", lambda: self.set_draft_model(""))
        self.draft_model.setMenu(draft_menu)
        self.draft_reason = QLabel(self)
        self.draft_reason.setObjectName("unavailableReason")
        self.draft_reason.setWordWrap(True)
        self.draft_reason.hide()
        self.last_folder = ""  # where the draft model's file dialog starts ("" = Qt's choice)
        self.controls: dict[str, QComboBox | QCheckBox | QSpinBox] = {
            "device": self.device,
            "dtype": self.dtype,
            "kv_cache": self.kv_cache,
            "sampling": self.sampling,
            "compile": self.compile,
            "cuda_graph": self.cuda_graph,
            "candidates": self.candidates,
            "profile_window": self.profile_window,
            "weights": self.weights,
            "kernels": self.kernels,
            "speculation": self.speculation,
            "draft_tokens": self.draft_tokens,
            "prefix_reuse": self.prefix_reuse,
        }
        self.note = QLabel("Changes apply to the next answer.", self)
        self.note.setObjectName("notice")
        self.note.setWordWrap(True)
        self.progress = QProgressBar(self)
        self.progress.setMaximumHeight(6)
        self.progress.setTextVisible(False)
        self.progress.hide()

        self.grid = QGridLayout()
        self.grid.setHorizontalSpacing(8)
        self.grid.setVerticalSpacing(4)
        # Each control (by option name) with its label (None: a check box, which names itself) and, under it, why
        # a value of it cannot run here (hidden while everything can); two to a row where the panel is wide
        # enough, else one.
        self._pairs: tuple[tuple[tuple[Optional[str], str], ...], ...] = (
            (("Device", "device"), ("Precision", "dtype")),
            (("KV cache", "kv_cache"), ("Sampling", "sampling")),
            (("Candidates", "candidates"), (None, "compile")),
            ((None, "profile_window"), (None, "cuda_graph")),
            (("Weights", "weights"), ("Kernels", "kernels")),
            (("Speculation", "speculation"), ("Drafts", "draft_tokens")),
            ((None, "prefix_reuse"),),
        )
        self.labels: dict[str, QLabel] = {"preset": QLabel("Preset", self), "draft_model": QLabel("Draft model", self)}
        self.reasons: dict[str, QLabel] = {}
        for pairs in self._pairs:
            for label, name in pairs:
                if label is not None:
                    self.labels[name] = QLabel(label, self)
                reason = QLabel(self)
                reason.setObjectName("unavailableReason")
                reason.setWordWrap(True)
                reason.hide()
                self.reasons[name] = reason
        for name, caption in self.labels.items():  # read aloud by name, not by the value shown
            control = {"preset": self.preset, "draft_model": self.draft_model}.get(name) or self.controls[name]
            caption.setBuddy(control)
            control.setAccessibleName(caption.text())
        self.columns = 0
        self._place(2)
        lay = QVBoxLayout(self)
        lay.addLayout(self.grid)
        lay.addWidget(self.note)
        lay.addWidget(self.progress)
        lay.addStretch(1)
        self._two_column_width = self.minimumSizeHint().width()  # narrower than this, one column

        self._options = options
        self._known: dict[tuple[str, object], str] = {}  # (option, value) -> why the engine cannot honour it
        self._refusal = ""  # what the engine last refused of the user's choice, said until the user chooses again
        self.replacing = False  # True while the panel replaces a value the engine refused (optionsChanged fires)
        self.replaced: dict[str, object] = {}  # option -> the user's value the panel shows another in place of
        self._limits: dict[tuple[str, object], str] = {}  # the same, for what this machine and model never run
        self._resolve_preset: PresetResolver = preset_resolver or _as_defined
        self._resolved: dict[str, str] = {}  # what "auto" device and dtype mean for the loaded model
        self._quiet = False
        # the dropdown ("preset" or an option) or number box stepped to a value not applied yet
        self._stepped: Optional[str] = None
        self._pending = ""  # what the notice says of a number stepped to, until it applies
        self._note_before_steps: Optional[str] = None  # the note that notice stands in for
        self.settle = QTimer(  # type: ignore[call-arg]  # the stubs omit the signal keywords Qt takes
            self, singleShot=True, interval=STEP_SETTLE_MS, timeout=self.apply_stepped
        )
        self.set_options(options)
        for name, w in (("preset", self.preset), *self.controls.items()):
            if isinstance(w, StepCombo):
                w.activated.connect(lambda _i, name=name: self._activated(name))
                w.settled.connect(self.apply_stepped)
            elif isinstance(w, QCheckBox):
                w.toggled.connect(lambda _b, name=name: self._edited(name))
            elif isinstance(w, StepSpin):
                w.valueChanged.connect(lambda _v, name=name: self._spun(name))
                w.settled.connect(self.apply_stepped)

    @property
    def options(self) -> EngineOptions:
        return self._options

    # ---- layout ----------------------------------------------------------------------------------------

    def fit_width(self, width: int) -> None:
        """Lay the controls out for `width` (the dock's): two to a row where that fits, one where it does not,
        so a narrow window shows every control and reason instead of scrolling sideways."""
        if self.columns == 2:  # as the style and fonts in force now make it
            self._two_column_width = self.minimumSizeHint().width()
        columns = 2 if width >= self._two_column_width else 1
        if columns != self.columns:
            self._place(columns)

    def _place(self, columns: int) -> None:
        grid = self.grid
        while grid.count():
            grid.takeAt(0)  # the widgets stay, to be placed again
        span = 2 * columns - 1  # a full-width control: past its label, to the last column
        grid.addWidget(self.labels["preset"], 0, 0)
        grid.addWidget(self.preset, 0, 1, 1, span)
        row = 1
        lines = self._pairs if columns == 2 else tuple((pair,) for pairs in self._pairs for pair in pairs)
        for line in lines:
            for col, (label, name) in enumerate(line):
                w = self.controls[name]
                if label is None:
                    grid.addWidget(w, row, 2 * col, 1, 2)
                else:
                    grid.addWidget(self.labels[name], row, 2 * col)
                    grid.addWidget(w, row, 2 * col + 1)
                grid.addWidget(self.reasons[name], row + 1, 2 * col, 1, 2)
            row += 2
        grid.addWidget(self.labels["draft_model"], row, 0)
        grid.addWidget(self.draft_model, row, 1, 1, span)
        grid.addWidget(self.draft_reason, row + 1, 0, 1, span + 1)
        grid.setColumnStretch(1, 1)
        grid.setColumnStretch(3, 1 if columns == 2 else 0)
        changed = self.columns != 0
        self.columns = columns
        if changed:
            self.columnsChanged.emit(columns)

    def set_resolved(self, device: str, dtype: str) -> None:
        """What "auto" resolves to for the loaded model, so the preset in use can be named."""
        self._resolved = {"device": device, "dtype": dtype}
        self.set_options(self._options)

    def _device_type(self) -> str:
        device = self._options.device
        return device if device != "auto" else self._resolved.get("device", "cpu")

    def set_options(self, options: EngineOptions) -> None:
        """Show `options` without emitting a change (e.g. what the engine now runs with)."""
        self._quiet = True
        try:
            self._options = options
            for name, w in self.controls.items():
                if isinstance(w, QComboBox):
                    if name != self._stepped:  # the entry a user stepped to stays shown until it applies
                        w.setCurrentIndex(max(0, w.findData(getattr(options, name))))
                elif isinstance(w, QCheckBox):
                    w.setChecked(getattr(options, name))
                elif name != self._stepped:  # as a dropdown's: the number stepped to stays until it applies
                    w.setValue(getattr(options, name))
            if self._stepped != "preset":
                self._show_preset()
            self._apply_tooltips()
        finally:
            self._quiet = False

    # ---- the draft model -----------------------------------------------------------------------------

    def _choose_draft(self, folder: bool) -> None:
        kind = "a Hugging Face folder" if folder else "a smaller model"
        path = choose_model(self, f"Draft model: {kind} with the same tokenizer", self.last_folder, folder=folder)
        if path:
            self.last_folder = str(Path(path).parent)
            self.folderUsed.emit(self.last_folder)
            self.set_draft_model(path)

    def set_draft_model(self, path: str) -> None:
        """Draft with the model at `path` (speculation switched to draft), or with none ("": a draft speculation
        goes off). What the engine said of drafting with the previous one is forgotten."""
        self._known = {k: v for k, v in self._known.items() if k[0] != "speculation"}
        self._refusal = ""
        if path:
            options = self._options.with_(draft_model=path, speculation="draft")
        else:
            off = self._options.speculation == "draft"
            options = self._options.with_(draft_model="", speculation="off" if off else self._options.speculation)
        self._change(options)
        self._apply_tooltips()

    def _show_draft_model(self) -> None:
        path = self._options.draft_model
        self.draft_model.setText(model_file_name(path) if path else "None: choose one to draft with")
        self.draft_model.setToolTip(
            path or "A smaller model with the same tokenizer drafts tokens that this one verifies in one step"
        )
        self.no_draft_action.setEnabled(bool(path))
        why = self._known.get(("speculation", "draft")) if path else None
        self.draft_reason.setText(f"Not drafting: {why}" if why else "")
        self.draft_reason.setVisible(bool(why))

    def set_limits(self, limits: dict[tuple[str, object], str]) -> None:
        """What this machine and model can never run, whatever else is chosen ({(option, value): reason}): shown
        unavailable from the start, with the reason under the control; a value in use is replaced."""
        self._limits = dict(limits)
        self._apply_tooltips()
        self._replace_refused()

    def _replace_refused(self) -> None:
        """The value in use, where this model or machine cannot take it, replaced by one that works, for this
        model alone: `replacing` says so while optionsChanged fires (the user's own choice stays saved)."""
        fixed = self._without_unavailable(self._options)
        if fixed != self._options:
            self.replacing = True
            try:
                self._change(fixed)
            finally:
                self.replacing = False

    def _why(self, name: str, value: object) -> Optional[str]:
        return self._limits.get((name, value)) or self._known.get((name, value))

    def set_unavailable(self, unavailable: dict[str, str]) -> None:
        """The engine's reasons for options it cannot honour ({option: reason}, for the options as they are now).

        The value in use is remembered as unavailable (a disabled combo entry, a disabled switch with the reason
        as its tooltip) and replaced by one that works, so the panel never shows an option that is not in force.
        """
        refused = []
        for name, reason in unavailable.items():
            if name in self.controls:
                value = getattr(self._options, name)
                self._known[(name, value)] = reason
                what = name.replace("_", " ")
                refused.append(f"{what}: {reason}" if isinstance(value, bool) else f"{what} {value}: {reason}")
        self._apply_tooltips()
        self._replace_refused()
        if refused:  # said where the user looks, not only in a disabled entry's tooltip
            self._refusal = "Not applied: " + "; ".join(refused)
            self.note.setText(self._refusal)

    def _without_unavailable(self, options: EngineOptions) -> EngineOptions:
        changes = {}
        for name, value in {**self._limits, **self._known}:
            if getattr(options, name) != value:
                continue
            w = self.controls[name]
            if isinstance(w, QComboBox):
                usable = [w.itemData(i) for i in range(w.count()) if self._why(name, w.itemData(i)) is None]
                if usable:
                    changes[name] = usable[0]
            elif isinstance(value, bool):
                changes[name] = not value
        return options.with_(**changes) if changes else options

    def _apply_tooltips(self) -> None:
        for name, w in self.controls.items():
            shown: list[str] = []  # the reasons written under the control
            if isinstance(w, QComboBox):
                model = w.model()
                for i in range(w.count()):
                    why = self._why(name, w.itemData(i))
                    item = model.item(i) if isinstance(model, QStandardItemModel) else None
                    if item is not None:
                        item.setEnabled(why is None)
                        item.setToolTip(f"Unavailable: {why}" if why else "")
                    if why and (name, w.itemData(i)) in self._limits:
                        shown.append(f"{w.itemText(i)} unavailable: {why}")
                w.setToolTip(TIPS[name])
            elif isinstance(w, QCheckBox):
                why = self._why(name, True)
                w.setEnabled(why is None or w.isChecked())
                w.setToolTip(f"Unavailable: {why}" if why else TIPS[name])
                if why and (name, True) in self._limits:
                    shown.append(f"Unavailable: {why}")
            elif name == self._stepped:  # a number not applied yet: its tooltip says so (_spun)
                w.setToolTip(f"Not applied yet: {self._pending}")
            else:  # candidates, draft_tokens
                why = self._why(name, getattr(self._options, name))
                w.setToolTip(f"Unavailable: {why}" if why else TIPS[name])
            self.reasons[name].setText("\n".join(shown))
            self.reasons[name].setVisible(bool(shown))
        self._show_draft_model()
        for i in range(self.preset.count()):
            why = self._preset_unavailable(self.preset.itemData(i))
            item = cast(QStandardItemModel, self.preset.model()).item(i)  # a combo's own model: a standard one
            item.setEnabled(why is None)
            item.setToolTip(f"Unavailable: {why}" if why else "")

    def _preset_unavailable(self, name: str) -> Optional[str]:
        """A preset is unavailable when the option that defines it cannot run; others it names that cannot
        are left off when it is chosen (as the bench's ladder runs the candidates rung without CUDA graphs)."""
        if name == CUSTOM:
            return None
        opts = self._resolve_preset(name, self._options, self._device_type())
        field = DEFINING_OPTION.get(name)
        return self._why(field, getattr(opts, field)) if field else None

    def _show_preset(self) -> None:
        shown = self._options.to_dict()
        shown.update({k: v for k, v in self._resolved.items() if shown[k] == "auto"})
        name = preset_name(shown) or self._chosen_preset() or CUSTOM
        self.preset.setCurrentIndex(max(0, self.preset.findData(name)))

    def _chosen_preset(self) -> Optional[str]:
        """The preset that, chosen here, gives the options in use (less what cannot run here)."""
        for name in PRESETS:
            if self._preset_unavailable(name) is None:
                opts = self._without_unavailable(self._resolve_preset(name, self._options, self._device_type()))
                if opts == self._options:
                    return name
        return None

    def _read(self) -> EngineOptions:
        """The options the controls show: a combo box's data, a check box's state, a spin box's number."""
        shown: dict[str, object] = {}
        for name, w in self.controls.items():
            if isinstance(w, QComboBox):
                shown[name] = w.currentData()
            elif isinstance(w, QCheckBox):
                shown[name] = w.isChecked()
            else:
                shown[name] = w.value()
        return self._options.with_(**shown)

    def _activated(self, name: str) -> None:
        """A dropdown's entry was chosen: from its list at once; stepped to, once the steps pause (apply_stepped)."""
        combo = self.preset if name == "preset" else self.controls[name]
        if isinstance(combo, StepCombo) and combo.stepping:
            if self._stepped not in (None, name):
                self.apply_stepped()
            self._stepped = name
            self.settle.start()
        elif name == "preset":
            self._preset_chosen(self.preset.currentIndex())
        else:
            self._edited(name)

    def _spun(self, name: str) -> None:
        """A number box's value changed: set by the program, at once; stepped or typed by the user, once the steps
        pause (apply_stepped), so holding an arrow or typing "12" does not apply (and rebuild the engine for)
        every number on the way."""
        if self._quiet:
            return
        box = self.controls[name]
        if not (isinstance(box, StepSpin) and box.stepping):
            self._edited(name)
            return
        if self._stepped not in (None, name):
            self.apply_stepped()
        self._stepped = name
        self.settle.start()
        self._pending = (
            f"{self.labels[name].text()} {box.shown(box.value())} applies once the steps pause, or at once on "
            f"Enter; the next answer uses {box.shown(getattr(self._options, name))} until then."
        )
        if self._note_before_steps is None:
            self._note_before_steps = self.note.text()
        self.note.setText(self._pending)
        box.setToolTip(f"Not applied yet: {self._pending}")

    def apply_stepped(self) -> None:
        """Apply the entry a dropdown or the number a number box was stepped to (nothing when none waits)."""
        self.settle.stop()
        name, self._stepped = self._stepped, None
        note, self._note_before_steps = self._note_before_steps, None
        self._pending = ""
        shown = self.note.text()
        if name == "preset":
            self._preset_chosen(self.preset.currentIndex())
        elif name is not None:
            self._edited(name)
        if note is not None and self.note.text() == shown:  # stepped back to the value in force: nothing changed
            self.note.setText(note)
            self._apply_tooltips()

    def _edited(self, name: str) -> None:
        if self._quiet:
            return
        if self._stepped not in (None, name):  # a dropdown stepped to before this change applies first
            self.apply_stepped()
        if self._stepped == name:  # the box stepped to, then changed another way (paste, undo): that applies
            self._drop_pending()
        self._stepped = None
        self.settle.stop()
        self._refusal = ""
        # What the engine could not do may depend on the other options: keep only what was said of this one.
        self._known = {k: v for k, v in self._known.items() if k[0] == name}
        self._change(self._read())

    def _drop_pending(self) -> None:
        """The pending number's notice goes, the note it stood in for is back (what applies next says its own)."""
        note, self._note_before_steps = self._note_before_steps, None
        self._pending = ""
        if note is not None:
            self.note.setText(note)
        self._stepped = None
        self._apply_tooltips()

    def _preset_chosen(self, index: int) -> None:
        if self._stepped not in (None, "preset"):
            self.apply_stepped()
        self._stepped = None
        self.settle.stop()
        name = self.preset.itemData(index)
        if name == CUSTOM:
            return
        self._refusal = ""
        # What the engine could not do depended on the options a preset replaces together (ngram beside several
        # candidates): it stayed said, its entry and preset disabled, after a preset had removed its cause.
        self._known.clear()
        self._change(self._without_unavailable(self._resolve_preset(name, self._options, self._device_type())))

    def _change(self, options: EngineOptions) -> None:
        if options == self._options:
            return
        if options.compile and not self._options.compile and not self._compile_is_fast(options):
            if not confirm(self, "Compile on the CPU", COMPILE_ON_CPU, "Compile anyway"):
                self.set_options(self._options)  # the switch shows what is still in force
                self.note.setText("Compile stays off.")
                return
        changed = [f.name for f in fields(EngineOptions) if getattr(options, f.name) != getattr(self._options, f.name)]
        for name in changed:  # what this model put in place of the user's value, until the user chooses again
            if self.replacing:
                self.replaced.setdefault(name, getattr(self._options, name))
            else:
                self.replaced.pop(name, None)
        self.set_options(options)
        self.note.setText("Changes apply to the next answer.")
        self.optionsChanged.emit(options)

    def users_choice(self, options: EngineOptions) -> EngineOptions:
        """`options` with the user's own values where the panel shows what this model put in their place: what is
        kept for the next model (a later change of another option saved the replacement as the user's choice)."""
        return options.with_(**self.replaced) if self.replaced else options

    def _compile_is_fast(self, options: EngineOptions) -> bool:
        """False where a compile is known to take minutes: the loaded model runs on a CPU."""
        device = options.device if options.device != "auto" else self._resolved.get("device")
        return device != "cpu"

    # ---- engine feedback -----------------------------------------------------------------------------

    def set_progress(self, p: Progress) -> None:
        """Recompile / recapture / warm-up progress after a change."""
        show_progress(self.progress, self.note, p)

    def set_model(
        self, options: EngineOptions, unavailable: dict[str, str], limits: dict[tuple[str, object], str]
    ) -> None:
        """A new model opened with `options`: what the previous one could not do is forgotten first (a remote
        model's reasons and limits would turn the options the new one opened with back to the defaults)."""
        self._known.clear()
        self._refusal = ""
        self._limits = dict(limits)
        self.replaced.clear()  # it opened with the user's own choice
        self.set_applied(options, unavailable)

    def set_applied(self, options: EngineOptions, unavailable: dict[str, str]) -> None:
        """The engine accepted `options` for the next answer."""
        self.progress.hide()
        self.set_options(options)
        # the replacement of a refused value is applied in turn: its "Ready" keeps saying what was refused
        self.note.setText(" ".join(t for t in ("Ready: the next answer uses these options.", self._refusal) if t))
        self.set_unavailable(unavailable)
        if self._pending:  # a number stepped to since is still said, the engine's word shown once it applies
            self._note_before_steps = self.note.text()
            self.note.setText(self._pending)

    def set_failed(self, message: str, in_force: Optional[EngineOptions] = None) -> None:
        """The engine refused the options chosen; the controls show `in_force` again, the options it keeps."""
        self.progress.hide()
        if in_force is not None:
            self.set_options(in_force)
        self.note.setText(f"Not applied: {message}")
