"""HudPanel: the performance HUD as one widget with three tabs — Live (last generation's bars over the live
plots), Compare (past generations of this session) and Ladder (every preset on one prompt).

The main window feeds it from the worker's signals (begin_generation / add_steps / add_samples /
end_generation, set_ladder_progress / set_ladder_results) and listens to runLadderRequested and
cancelLadderRequested. All calls come on the GUI thread; none of them paints: the live plots paint on their
own timer, and only while visible.
"""

from __future__ import annotations

import time
from dataclasses import fields
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional

from PySide6.QtCore import Signal
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QMessageBox,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine.diagnosis import diagnose
from engine.paths import user_path
from engine.types import (
    EngineOptions,
    GenerationMetrics,
    LadderRow,
    Limits,
    MonitorSample,
    StepRecord,
    options_as_run,
)
from ui.dialogs import ask_save_file, confirm
from ui.hud import export
from ui.hud.bars import BarStrip
from ui.hud.compare_table import CompareRow, CompareTable
from ui.hud.ladder_chart import LadderChart
from ui.hud.live_plots import LivePlots
from ui.hud.series import LiveSeries

# (parent, caption, suggested file name, filter) -> chosen path, "" when cancelled
SaveDialog = Callable[[QWidget, str, str, str], str]
# (parent, suggested width, height) -> the image size chosen, None when cancelled
SizeDialog = Callable[[QWidget, int, int], Optional[tuple[int, int]]]


class ImageSizeDialog(QDialog):
    """The pixel size of an exported image."""

    def __init__(self, width: int, height: int, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.setWindowTitle("Plots image size")
        self.width_box, self.height_box = QSpinBox(self), QSpinBox(self)
        for box, value in ((self.width_box, width), (self.height_box, height)):
            box.setRange(export.MIN_IMAGE_PX, export.MAX_IMAGE_PX)
            box.setSuffix(" px")
            box.setValue(max(export.MIN_IMAGE_PX, min(export.MAX_IMAGE_PX, value)))
        form = QFormLayout(self)
        form.addRow("Width", self.width_box)
        form.addRow("Height", self.height_box)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel, self)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)

    def size_px(self) -> tuple[int, int]:
        return self.width_box.value(), self.height_box.value()


def ask_image_size(parent: QWidget, width: int, height: int) -> Optional[tuple[int, int]]:
    dialog = ImageSizeDialog(width, height, parent)
    try:
        return dialog.size_px() if dialog.exec() == QDialog.DialogCode.Accepted else None
    finally:
        dialog.deleteLater()


def ask_save_path(parent: QWidget, caption: str, name: str, file_filter: str) -> str:
    """The path to save to; the dialog starts in the folder last used (`parent.last_folder`), else home."""
    folder = getattr(parent, "last_folder", "") or str(user_path("~"))  # Path.home() raises where none is known
    return ask_save_file(parent, caption, str(Path(folder) / name), file_filter)


class HudPanel(QWidget):
    runLadderRequested = Signal()
    cancelLadderRequested = Signal()
    folderUsed = Signal(str)  # where an export was saved (the next save dialog starts there)
    compareRowAdded = Signal(object)  # a CompareRow of this session, to keep with the chats
    compareCleared = Signal()  # the user cleared the compare table

    def __init__(
        self,
        series: Optional[LiveSeries] = None,
        clock: Callable[[], float] = time.perf_counter,
        save_dialog: SaveDialog = ask_save_path,
        size_dialog: SizeDialog = ask_image_size,
        paint_hz: float = 20.0,
        label_hz: float = 2.0,
        parent: Optional[QWidget] = None,
    ):
        super().__init__(parent)
        self.series = series if series is not None else LiveSeries()
        self._clock = clock  # the engine's clock (perf_counter), to date generation starts
        self._save_dialog = save_dialog
        self._size_dialog = size_dialog
        self.last_folder = ""  # where save dialogs start ("" = the home folder)

        self.bars = BarStrip()
        self.live = LivePlots(self.series, paint_hz=paint_hz, label_hz=label_hz)
        self.compare = CompareTable()
        self.ladder = LadderChart()
        self.model_name = ""  # the loaded model's name, which the compare rows carry
        self._ladder_model = ""  # the model the running ladder measures (another may load before it ends)
        self.ladder.runRequested.connect(self._ladder_requested)
        self.ladder.cancelRequested.connect(self.cancelLadderRequested)

        live_tab = QWidget()
        live_box = QVBoxLayout(live_tab)
        live_box.setContentsMargins(4, 4, 4, 4)
        live_box.addWidget(self.bars)
        live_box.addWidget(self.live, 1)
        live_box.addLayout(
            self._buttons(
                (
                    ("Series CSV…", "Export the time series held as CSV", self._ask_series_csv),
                    ("Series JSON…", "Export the time series held, with sources, as JSON", self._ask_series_json),
                    (
                        "Plots PNG…",
                        "Save the plots as PNG, drawn again at a size you choose",
                        self._ask_plots_png,
                    ),
                )
            )
        )
        for text, tip, slot in (
            ("Export CSV…", "Export the compare table as CSV", self._ask_compare_csv),
            ("Export JSON…", "Export the compare table as JSON", self._ask_compare_json),
        ):
            self.compare.buttons.addWidget(_button(text, tip, slot))
        self.compare.buttons.addWidget(
            _button("Clear history…", "Remove every row; they are kept across restarts until cleared", self.ask_clear)
        )
        self.ladder_png = _button("PNG…", "Save the ladder chart as PNG", self._ask_ladder_png)
        self.ladder_png.setEnabled(False)  # nothing to save before a run
        self.ladder_png.setToolTip("Save the ladder chart as PNG (once the ladder has run)")
        self.ladder.buttons.addWidget(self.ladder_png)

        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        self.tabs.addTab(live_tab, "Live")
        self.tabs.addTab(self.compare, "Compare")
        self.tabs.addTab(self.ladder, "Ladder")
        self.tabs.currentChanged.connect(self._size_by_the_shown_tab)
        self._size_by_the_shown_tab(self.tabs.currentIndex())
        box = QVBoxLayout(self)
        box.setContentsMargins(0, 0, 0, 0)
        box.addWidget(self.tabs)

    def _size_by_the_shown_tab(self, shown: int) -> None:
        """The panel is as tall as the tab shown needs: the tabs took the height of the tallest (the Live plots),
        so the Compare table stretched to it in a scrolling dock and its buttons sat below the visible part."""
        for i in range(self.tabs.count()):
            page = self.tabs.widget(i)
            if page is None:
                continue
            policy = QSizePolicy.Policy.Preferred if i == shown else QSizePolicy.Policy.Ignored
            page.setSizePolicy(policy, policy)
            page.updateGeometry()
        self.tabs.updateGeometry()

    # ---- the main window's interface -------------------------------------------------------------------

    def begin_generation(self, label: str, options: EngineOptions) -> None:
        self.series.begin_generation(label, options, self._clock())
        self.bars.set_running(label)

    def add_steps(self, records: Iterable[StepRecord]) -> None:
        self.series.add_steps(records)

    def add_samples(self, samples: Iterable[MonitorSample]) -> None:
        self.series.add_samples(samples)

    def end_generation(
        self,
        metrics: GenerationMetrics,
        options: EngineOptions,
        label: str,
        unavailable: Optional[Mapping[str, str]] = None,
        limits: Optional[Limits] = None,
    ) -> None:
        """A generation ended with these figures, run with `options` (what ran), `unavailable` saying which of the
        options asked for this model or machine refused, and why, and `limits` the option values it never runs
        (the diagnosis advises none of them)."""
        gen = self.series.end_generation(self._clock(), metrics, options, label)
        index = gen.index if gen is not None else self.series.take_index()
        self._add_row(CompareRow(index=index, label=label, options=options, metrics=metrics, model=self.model_name))
        ran = options_as_run(options, unavailable or {}, limits)
        d = diagnose(metrics.to_dict(), ran, options.device if options.device != "auto" else None)
        self.bars.set_metrics(metrics, options, f"#{index} {label}", d)
        self.live.refresh_labels()  # why a series is n/a, as the metrics now say, shows with the bars, not later

    def generation_failed(self, message: str) -> None:
        """Closes the running generation's span; it gets no row, as it has no figures."""
        self.series.end_generation(self._clock())
        self.bars.set_failed(message)

    def _ladder_requested(self) -> None:
        self._ladder_model = self.model_name
        self.runLadderRequested.emit()

    def set_ladder_progress(self, done: int, total: int, label: str) -> None:
        self.ladder.set_progress(done, total, label)

    def set_ladder_results(self, rows: list[LadderRow]) -> None:
        """Draws the chart; every rung that ran also becomes a row of the compare table."""
        self.ladder.set_results(rows)
        self.ladder_png.setEnabled(bool(rows))
        for r in rows:
            if r.ran and r.metrics is not None:
                self._add_row(
                    CompareRow(
                        index=self.series.take_index(),
                        label=f"ladder · {r.label or r.preset}",
                        options=_options(r.options or {}),
                        metrics=GenerationMetrics.from_dict(r.metrics),
                        model=self._ladder_model,
                    )
                )

    def _add_row(self, row: CompareRow) -> None:
        self.compare.add(row)
        self.compareRowAdded.emit(row)

    def restore_compare(self, rows: Iterable[CompareRow]) -> None:
        """Rows kept from earlier runs; the generations of this one are numbered after them."""
        for row in rows:
            self.compare.add(row)
            self.series.number_after(row.index)

    def ask_clear(self) -> None:
        n = len(self.compare.model.rows)
        if n and confirm(
            self,
            "Clear the compare history",
            f"Remove the {n} row{'s' if n != 1 else ''} of the compare table? This cannot be undone.",
            "Clear",
        ):
            self.compare.model.clear()
            self.compareCleared.emit()

    def set_ladder_failed(self, message: str) -> None:
        self.ladder.set_failed(message)

    def series_lengths(self) -> dict[str, int]:
        return self.series.series_lengths()

    def last_values(self) -> dict[str, Optional[float]]:
        return self.series.last_values()

    # ---- exports (the buttons ask for a path, then call these) -----------------------------------------

    def export_compare_csv(self, path) -> Path:
        return export.write_compare_csv(path, self.compare.model)

    def export_compare_json(self, path) -> Path:
        return export.write_compare_json(path, self.compare.model)

    def export_series_csv(self, path) -> Path:
        return export.write_series_csv(path, self.series)

    def export_series_json(self, path) -> Path:
        return export.write_series_json(path, self.series)

    def export_plots_png(self, path, width: Optional[int] = None, height: Optional[int] = None) -> Path:
        """The plots on screen drawn again at width × height (by default the size they have now)."""
        self.live.paint(force=True)  # everything held, even what came in since the last paint
        self.live.refresh_labels()
        pal = self.live.palette()
        return export.save_plots(
            path,
            list(self.live.views.values()),
            width or self.live.width(),
            height or self.live.height(),
            pal.color(QPalette.ColorRole.Base),
            pal.color(QPalette.ColorRole.Text),
        )

    def export_ladder_png(self, path) -> Path:
        if not self.ladder.rows:  # the chart is empty (and upside down) before a run
            raise ValueError("the ladder has not run yet: run it first")
        return export.save_png(path, self.ladder.figure, "the ladder chart")

    def _ask(self, caption: str, name: str, file_filter: str, write: Callable[[str], Path]) -> Optional[Path]:
        path = self._save_dialog(self, caption, name, file_filter)
        if not path:
            return None
        self.last_folder = str(Path(path).parent)
        self.folderUsed.emit(self.last_folder)
        try:
            return write(path)
        except export.ExportError as e:  # says what, where and why
            QMessageBox.warning(self, caption, _sentence(str(e)))
        except (OSError, ValueError) as e:
            QMessageBox.warning(self, caption, f"Could not write {path}: {e}")
        return None

    def _ask_series_csv(self) -> None:
        self._ask("Export time series", "gapless-series.csv", "CSV (*.csv)", self.export_series_csv)

    def _ask_series_json(self) -> None:
        self._ask("Export time series", "gapless-series.json", "JSON (*.json)", self.export_series_json)

    def _ask_plots_png(self) -> None:
        size = self._size_dialog(self, max(self.live.width(), 800), max(self.live.height(), 600))
        if size is None:
            return
        self._ask(
            "Save plots",
            "gapless-live.png",
            "PNG (*.png)",
            lambda path: self.export_plots_png(path, *size),
        )

    def _ask_compare_csv(self) -> None:
        self._ask("Export compare table", "gapless-compare.csv", "CSV (*.csv)", self.export_compare_csv)

    def _ask_compare_json(self) -> None:
        self._ask("Export compare table", "gapless-compare.json", "JSON (*.json)", self.export_compare_json)

    def _ask_ladder_png(self) -> None:
        self._ask("Save ladder chart", "gapless-ladder.png", "PNG (*.png)", self.export_ladder_png)

    @staticmethod
    def _buttons(specs) -> QHBoxLayout:
        row = QHBoxLayout()
        row.addStretch(1)
        for text, tip, slot in specs:
            row.addWidget(_button(text, tip, slot))
        return row


def _options(data: dict) -> EngineOptions:
    """EngineOptions from a ladder row's options dict; keys this version does not know are left out."""
    known = {f.name for f in fields(EngineOptions)}
    return EngineOptions(**{k: v for k, v in data.items() if k in known})


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _button(text: str, tip: str, slot) -> QPushButton:
    b = QPushButton(text)
    b.setToolTip(tip)
    b.clicked.connect(slot)
    return b
