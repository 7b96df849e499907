"""Past generations of this session side by side: the options each used and what they measured, sortable, with
the change of every figure against a reference row the user picks (the first generation until then).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QSortFilterProxyModel, Qt
from PySide6.QtGui import QAction, QColor, QFont, QGuiApplication, QKeyEvent, QKeySequence, QPalette
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from engine import figures
from engine.types import EngineOptions, GenerationMetrics, model_file_name, server_decides
from ui.hud import fmt

SORT_ROLE = Qt.ItemDataRole.UserRole + 1
SERVER_SET = "server's"  # an option of a remote server's answer: its own setting, not known here
# Why a row has no model name, and a figure neither measured nor said to be n/a (the exports say the same)
NO_MODEL = "this row was kept before rows named their model"
NOT_MEASURED = "not measured in this generation"
# Better and worse, for a light and a dark background: 4.5:1 or more against the theme's base either way.
DELTA_COLORS = {"light": (QColor("#1a7f37"), QColor("#b3261e")), "dark": (QColor("#5cc77a"), QColor("#f2857b"))}


def delta_colors() -> tuple[QColor, QColor]:
    """(better, worse) for the application's palette: the table's cells are drawn on its base colour."""
    dark = QGuiApplication.palette().color(QPalette.ColorRole.Base).lightness() < 128
    return DELTA_COLORS["dark" if dark else "light"]


@dataclass
class CompareRow:
    index: int  # generation number in this session
    label: str
    options: EngineOptions
    metrics: GenerationMetrics
    model: str = ""  # the model's name ("": a row kept before rows named their model)


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    kind: str  # "index", "label", "summary", "option" or "metric"
    format: Callable[[Any], str] = str
    better: int = 0  # +1 higher is better, -1 lower is better, 0 neither
    source_field: Optional[str] = None
    tip: str = ""


def metric_column(key: str) -> Column:
    """A column for a registered figure (engine/figures.py): title, unit, direction and source from there."""
    s = figures.spec(key)
    return Column(key, s.label, "metric", lambda v: fmt.figure_value(s, v), s.better, s.source_field, s.tip)


def idle_drafts(options: EngineOptions, metrics: GenerationMetrics) -> str:
    """Why a row's draft settings say nothing: speculation off, with the reason where drafting was asked for and
    did not run (a refused draft model, several candidates: its figures keep it), or n-gram drafting, which has no
    draft model."""
    refused = figures.speculation_refused(metrics)
    if options.speculation == "off" and refused is not None:
        return f"not used: {figures.SPECULATION_OFF}: {refused}"
    return f"not used: speculation {options.speculation}"


def _on_off(v: Any) -> str:
    return "on" if v else "off"


COLUMNS = (
    Column("index", "#", "index"),
    Column("label", "Generation", "label"),
    Column("model", "Model", "model", tip="the model that made the answer"),
    *(
        metric_column(k)
        for k in (
            "decode_tok_s",
            "prefill_tok_s",
            "ttft_ms",
            "compile_seconds",
            "step_ms_p50",
            "step_ms_p99",
            "kernel_gap_pct",
            "launches_per_step",
            "sm_activity_pct",
            "gpu_util_pct",
            "dram_bw_util_pct",
            "peak_memory_bytes",
            "tokens_per_step",
            "acceptance_rate",
            "paused_steps",
            "new_tokens_total",
            "prompt_tokens",
        )
    ),
    Column("options", "Options", "summary", tip="the options the generation ran with; one column each follows"),
    Column("device", "Device", "option"),
    Column("dtype", "Dtype", "option"),
    Column("kv_cache", "KV cache", "option"),
    Column("sampling", "Sampling", "option"),
    Column("compile", "Compile", "option", _on_off),
    Column("cuda_graph", "CUDA graph", "option", _on_off),
    Column("candidates", "Candidates", "option"),
    Column("speculation", "Speculation", "option"),
    Column("draft_tokens", "Drafts", "option", lambda v: str(v) if v else "auto"),
    Column("draft_model", "Draft model", "option", lambda v: model_file_name(v) if v else "none"),
)
COLUMN_INDEX = {c.key: i for i, c in enumerate(COLUMNS)}


class CompareModel(QAbstractTableModel):
    """Rows of CompareRow; the reference row is the base of the deltas shown beside each figure."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.rows: list[CompareRow] = []
        self.reference: Optional[int] = None  # row number in self.rows

    def add(self, row: CompareRow) -> None:
        n = len(self.rows)
        self.beginInsertRows(QModelIndex(), n, n)
        self.rows.append(row)
        self.endInsertRows()
        if self.reference is None:
            self.set_reference(n)

    def set_reference(self, row: Optional[int]) -> None:
        if row is not None and not 0 <= row < len(self.rows):
            raise IndexError(f"no row {row} in the compare table ({len(self.rows)} rows)")
        self.reference = row
        if self.rows:
            self.dataChanged.emit(self.index(0, 0), self.index(len(self.rows) - 1, len(COLUMNS) - 1))

    def clear(self) -> None:
        self.beginResetModel()
        self.rows.clear()
        self.reference = None
        self.endResetModel()

    def value(self, row: int, key: str) -> Any:
        r = self.rows[row]
        col = COLUMNS[COLUMN_INDEX[key]]
        if col.kind == "index":
            return r.index
        if col.kind == "label":
            return r.label
        if col.kind == "model":
            return r.model or None
        if col.kind == "summary":
            return fmt.options_summary(r.options)
        if col.kind == "option":
            if server_decides(r.options) and key not in ("device", "candidates"):
                return SERVER_SET
            if key in ("draft_tokens", "draft_model") and r.options.speculation == "off":
                return None  # no drafts: the draft settings say nothing
            if key == "draft_model" and r.options.speculation != "draft":
                return None
            return getattr(r.options, key)
        return figures.shown(r.metrics, key).value  # a remote answer's timings: the client's, over HTTP

    def delta(self, row: int, key: str) -> Optional[float]:
        """(value − reference) / reference for a metric; None for the reference row itself or where n/a."""
        if COLUMNS[COLUMN_INDEX[key]].kind != "metric" or self.reference is None or row == self.reference:
            return None
        v, ref = self.value(row, key), self.value(self.reference, key)
        if v is None or ref is None or ref == 0:
            return None
        return (float(v) - float(ref)) / abs(float(ref))

    def _verdict(self, row: int, col) -> str:
        """What a delta's colour says: "better than the reference (higher is better)", "worse …", or "" where
        it has no colour (no delta, a column without a direction, a change under 2 %)."""
        d = self.delta(row, col.key)
        if d is None or not col.better or abs(d) < 0.02:
            return ""
        way = "higher is better" if col.better > 0 else "lower is better"
        return f"{'better' if d * col.better > 0 else 'worse'} than the reference ({way})"

    def _other_model(self, row: int) -> str:
        """The reference row's model where it is not this row's (both named), else ""."""
        if self.reference is None or row == self.reference:
            return ""
        mine, ref = self.rows[row].model, self.rows[self.reference].model
        return ref if mine and ref and mine != ref else ""

    # ---- QAbstractTableModel ---------------------------------------------------------------------------

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if orientation != Qt.Orientation.Horizontal or not 0 <= section < len(COLUMNS):
            return None
        col = COLUMNS[section]
        if role == Qt.ItemDataRole.DisplayRole:
            return col.title
        if role == Qt.ItemDataRole.ToolTipRole:
            direction = {1: "higher is better", -1: "lower is better"}.get(col.better, "")
            return "; ".join(p for p in (col.tip, direction) if p) or None
        return None

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        row, col = index.row(), COLUMNS[index.column()]
        v = self.value(row, col.key)
        if role == Qt.ItemDataRole.DisplayRole:
            if v is None and col.kind == "option":
                return "—"  # a setting this generation did not use
            if v is SERVER_SET:
                return v
            text = col.format(v) if v is not None else fmt.NA
            if col.kind == "metric" and v is not None:
                text += figures.over_http(figures.shown(self.rows[row].metrics, col.key), col.key)
            if col.kind == "index" and row == self.reference:
                return f"{text} (ref)"
            d = self.delta(row, col.key)
            return f"{text}  {fmt.delta(d)}" if d is not None else text
        if role == SORT_ROLE:
            return None if v is SERVER_SET else v
        if role == Qt.ItemDataRole.ToolTipRole and v is SERVER_SET:
            return f"set by the remote server, which does not say: {col.title} n/a here"
        if role == Qt.ItemDataRole.ToolTipRole and col.kind == "option" and v is None:
            return idle_drafts(self.rows[row].options, self.rows[row].metrics)
        if role == Qt.ItemDataRole.ToolTipRole and col.key == "speculation" and v == "off":
            refused = figures.speculation_refused(self.rows[row].metrics)
            return f"{figures.SPECULATION_OFF}: {refused}" if refused is not None else None
        if role == Qt.ItemDataRole.ToolTipRole and col.kind == "model" and v is None:
            return f"{fmt.NA} — {NO_MODEL}"
        if role == Qt.ItemDataRole.ToolTipRole and col.kind in ("index", "label"):
            return fmt.options_summary(self.rows[row].options)
        if role == Qt.ItemDataRole.ToolTipRole and col.kind == "model" and (other := self._other_model(row)):
            return f"{v}: not the reference row's model ({other}), so its deltas compare models"
        if role == Qt.ItemDataRole.ToolTipRole and col.kind == "metric":
            fig = figures.shown(self.rows[row].metrics, col.key)
            if v is None:
                return f"{fmt.NA} — {fig.reason or NOT_MEASURED}"
            source = fig.source or "source not reported"
            other = self._other_model(row)
            if other and self.delta(row, col.key) is not None:
                source += f"\nthe delta is against {other}, another model (the reference row)"
            return source
        if role == Qt.ItemDataRole.ForegroundRole:
            d = self.delta(row, col.key)
            if d is not None and col.better and abs(d) >= 0.02:
                better, worse = delta_colors()
                return better if d * col.better > 0 else worse
            return None
        if role == Qt.ItemDataRole.AccessibleTextRole:  # the colour's meaning in words, for a screen reader
            shown, said = self.data(index), self._verdict(row, col)
            return f"{shown}, {said}" if said else shown
        if role == Qt.ItemDataRole.FontRole and row == self.reference:
            font = QFont()
            font.setBold(True)
            return font
        if role == Qt.ItemDataRole.TextAlignmentRole and col.kind in ("metric", "index"):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None


class CompareProxy(QSortFilterProxyModel):
    """Sorts on raw values; a figure that is n/a sorts last in either direction."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setSortRole(SORT_ROLE)

    def lessThan(self, left, right) -> bool:
        a, b = left.data(SORT_ROLE), right.data(SORT_ROLE)
        if a is None or b is None:
            # Descending order places `left` first when lessThan(right, left); answer so None ends up last both ways.
            if a is None and b is None:
                return False
            ascending = self.sortOrder() == Qt.SortOrder.AscendingOrder
            return ascending if b is None else not ascending
        if isinstance(a, str) or isinstance(b, str):
            return str(a) < str(b)
        return float(a) < float(b)


class _RowsView(QTableView):
    """A table view whose Copy key runs `copy` (the view itself copied the one cell the user was on)."""

    copy: Optional[Callable[[], None]] = None

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.matches(QKeySequence.StandardKey.Copy) and self.copy is not None:
            self.copy()
            event.accept()
            return
        super().keyPressEvent(event)


class CompareTable(QWidget):
    """The compare table with its "use as reference" control."""

    def __init__(self, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.model = CompareModel(self)
        self.proxy = CompareProxy(self)
        self.proxy.setSourceModel(self.model)
        self.view = _RowsView()
        self.view.setAccessibleName("Runs compared")
        self.view.setModel(self.proxy)
        self.view.setSortingEnabled(True)
        self.view.sortByColumn(0, Qt.SortOrder.AscendingOrder)
        self.view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.view.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.view.setAlternatingRowColors(True)
        self.view.verticalHeader().setVisible(False)
        self.view.verticalHeader().setDefaultSectionSize(self.view.fontMetrics().height() + 8)
        self.view.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.view.doubleClicked.connect(self._reference_clicked)
        copy = QAction("Copy rows", self.view)
        copy.setShortcut(QKeySequence.StandardKey.Copy)  # shown in the menu; the view's key press runs it
        copy.setShortcutContext(Qt.ShortcutContext.WidgetShortcut)
        copy.triggered.connect(self.copy_selected)
        self.view.copy = self.copy_selected
        self.view.addAction(copy)
        self.view.setContextMenuPolicy(Qt.ContextMenuPolicy.ActionsContextMenu)
        self.reference_button = QPushButton("Use as reference")
        self.reference_button.setToolTip("Deltas in the table are against the reference row (double-click a row too)")
        self.reference_button.clicked.connect(self._use_selected_as_reference)
        self.buttons = QHBoxLayout()
        self.buttons.addWidget(self.reference_button)
        self.buttons.addStretch(1)
        hint = QLabel("Δ vs the reference row; green is better, red worse. Click a header to sort.")
        hint.setWordWrap(True)
        box = QVBoxLayout(self)
        box.setContentsMargins(0, 0, 0, 0)
        box.addWidget(self.view, 1)
        box.addWidget(hint)
        box.addLayout(self.buttons)

    def add(self, row: CompareRow) -> None:
        self.model.add(row)
        self.fit_columns()

    def fit_columns(self) -> None:
        """Columns as wide as their text now: a new row (or a new reference) adds deltas to other rows' cells,
        which the header's own fitting left cut off until the table was shown again."""
        self.view.horizontalHeader().resizeSections(QHeaderView.ResizeMode.ResizeToContents)

    def selected_rows(self) -> list[int]:
        """Selected rows as rows of the model (not of the sorted view), in ascending order."""
        rows = {self.proxy.mapToSource(i).row() for i in self.view.selectionModel().selectedRows()}
        return sorted(rows)

    def select_rows(self, rows: list[int]) -> None:
        sel = self.view.selectionModel()
        sel.clearSelection()
        for r in rows:
            index = self.proxy.mapFromSource(self.model.index(r, 0))
            sel.select(index, sel.SelectionFlag.Select | sel.SelectionFlag.Rows)

    def _reference_clicked(self, index) -> None:
        self.model.set_reference(self.proxy.mapToSource(index).row())
        self.fit_columns()

    def _use_selected_as_reference(self) -> None:
        """The row the user is on where it is among those selected (it took the lowest-numbered one of several),
        else the first selected."""
        rows = self.selected_rows()
        current = self.view.currentIndex()
        on = self.proxy.mapToSource(current).row() if current.isValid() else -1
        if rows:
            self.model.set_reference(on if on in rows else rows[0])
            self.fit_columns()

    def selected_text(self) -> str:
        """The selected rows as the table shows them and in its order, tab-separated under the column names: what
        Copy puts on the clipboard (it copied the one cell the user was on)."""
        columns = [c for c in range(self.proxy.columnCount()) if not self.view.isColumnHidden(c)]
        rows = sorted(i.row() for i in self.view.selectionModel().selectedRows())

        def cell(text: Any) -> str:
            return " ".join(str(text or "").split())  # a tab or a break in a label would split the cell

        lines = ["\t".join(cell(self.proxy.headerData(c, Qt.Orientation.Horizontal)) for c in columns)]
        lines += ["\t".join(cell(self.proxy.index(r, c).data()) for c in columns) for r in rows]
        return "\n".join(lines) + "\n" if rows else ""

    def copy_selected(self) -> None:
        text = self.selected_text()
        if text:
            QGuiApplication.clipboard().setText(text)
