"""Exports of the HUD: the compare table and the time series as CSV and JSON, the plots as PNG.

What is written is what the HUD holds: numbers unrounded (CSV cells round-trip through float()), a figure that
was not measured is an empty CSV cell and a JSON null, and the JSON carries the source of every series. The
plots are drawn again at the size asked for through pyqtgraph's image exporter.
"""

from __future__ import annotations

import csv
import html
import io
import json
from dataclasses import fields
from pathlib import Path
from typing import Any, Sequence, Union

from PySide6.QtCore import QBuffer, QByteArray, QIODevice
from PySide6.QtGui import QColor, QImage, QImageWriter, QPen
from PySide6.QtWidgets import QWidget

from engine.errors import OutputPathError
from engine.figures import GENERATION_FIGURES
from engine.paths import output_file, write_whole
from engine.types import EngineOptions, GenerationMetrics, server_decides
from ui.hud import fmt
from ui.hud.compare_table import NO_MODEL, NOT_MEASURED, CompareModel, idle_drafts
from ui.hud.series import SAMPLE_FIELDS, STEP_COLUMNS, LiveSeries
from ui.hud.series_view import PLOTS, SeriesView, left_axis_px

PathLike = Union[str, Path]
OPTION_FIELDS = tuple(f.name for f in fields(EngineOptions))
METRIC_FIELDS = tuple(f.name for f in fields(GenerationMetrics))
STEP_FIELDS = STEP_COLUMNS[2:]  # the step records' values: tokens so far, every per-step figure, traced or not
# estimate_source: where an estimate row's figure comes from (the other rows' sources are the "source" row's)
SERIES_CSV_COLUMNS = ("kind", "t", "t_rel", "generation") + STEP_FIELDS + SAMPLE_FIELDS + ("estimate_source",)
CLOCK = "time.perf_counter() seconds"


def compare_records(model: CompareModel) -> list[dict]:
    """Each row's record; an empty model name and every figure left null say why (model_unavailable, and the
    metrics' unavailable), as the table's n/a cells do (the exports gave an empty cell with no reason)."""
    records = []
    for i, r in enumerate(model.rows):
        metrics = r.metrics.to_dict()
        why = dict(metrics.get("unavailable") or {})
        for f in GENERATION_FIGURES:
            if metrics.get(f.key) is None and f.key in metrics:
                why.setdefault(f.key, NOT_MEASURED)
        metrics["unavailable"] = why
        records.append(
            {
                "index": r.index,
                "label": r.label,
                "model": r.model,
                "model_unavailable": None if r.model else NO_MODEL,
                "reference": i == model.reference,
                "options": known_options(r.options),
                "options_unavailable": options_unavailable(r.options, r.metrics),
                "metrics": metrics,
            }
        )
    return records


def known_options(options: EngineOptions) -> dict:
    """The options as a dict; a remote server's answer's are null but its device and candidate count (the
    server's own settings are not known here)."""
    d = options.to_dict()
    if server_decides(options):
        d = {k: v if k in ("device", "candidates") else None for k, v in d.items()}
    return d


def options_unavailable(options: EngineOptions, metrics: GenerationMetrics) -> dict[str, str]:
    """Why each option the exports leave empty (null, or "" for no draft model) is so, as the compare table's
    tooltips say it: a remote server's own settings are not known here, and a draft model is not used where
    speculation is off (with why, where drafting was asked for and did not run) or drafts by n-gram."""
    why = {}
    for key, value in known_options(options).items():
        if value is None:
            why[key] = "set by the remote server, which does not say"
        elif key == "draft_model" and value == "":
            why[key] = idle_drafts(options, metrics)
    return why


def write_compare_json(path: PathLike, model: CompareModel) -> Path:
    return _write_json(path, {"generations": compare_records(model)}, "the compare table")


def write_compare_csv(path: PathLike, model: CompareModel) -> Path:
    """One row a generation: its options, under "options_unavailable" why each option left empty is (a remote
    server's: its cells were empty with no reason), its figures, and under "sources" each figure's source (a
    figure whose source the registry names, e.g. decode tok/s, has no *_source column of its own), as in the JSON
    export."""
    header = (
        ["index", "label", "model", "model_unavailable", "reference"]
        + list(OPTION_FIELDS)
        + ["options_unavailable"]
        + list(METRIC_FIELDS)
        + ["sources"]
    )
    rows = []
    for rec in compare_records(model):
        rows.append(
            [rec["index"], rec["label"], rec["model"], rec["model_unavailable"], rec["reference"]]
            + [rec["options"][k] for k in OPTION_FIELDS]
            + [rec["options_unavailable"]]
            + [rec["metrics"][k] for k in METRIC_FIELDS]
            + [rec["metrics"]["sources"]]
        )
    return _write_csv(path, header, rows, "the compare table")


def series_document(series: LiveSeries) -> dict:
    t0 = series.t0
    return {
        "clock": f"{CLOCK}; t_rel is seconds since t0",
        "t0": t0,
        "sources": {
            **series.sources,
            **{p.key: p.source for p in PLOTS if p.from_steps and p.source},
            "tokens_per_s": f"engine step records, rolling {series.rate_window_s:g} s, traced window left out",
            "step_ms": "engine step timings",
        },
        "unavailable": dict(series.reasons),
        "generations": [
            {
                "index": g.index,
                "label": g.label,
                "options": known_options(g.options),
                "t_start": g.t_start,
                "t_end": g.t_end,
            }
            for g in series.generations
        ],
        # The oldest records the live rings overwrote, not in "steps" / "samples" (0 when all are held).
        "dropped": series.dropped(),
        "steps": series.step_rows(),
        "samples": series.sample_rows(),
        # Per-generation figures drawn where the monitor had no live reading (e.g. SM activity without GPM).
        "estimates": series.estimate_rows(),
    }


def write_series_json(path: PathLike, series: LiveSeries) -> Path:
    return _write_json(path, series_document(series), "the time series")


def write_series_csv(path: PathLike, series: LiveSeries) -> Path:
    """Steps, samples and estimates in one table ordered by time; `kind` says which, the other kinds' cells are
    empty. An estimate (a generation's figure standing for a series the monitor did not measure, drawn as a
    level) is two rows, at the start and at the end of the time it describes, with its source. Two rows come
    first, as in the JSON: "source", each column's source (the clock's for t), and "unavailable", why a series
    has no values (its cells were empty with no reason, and no number named its source)."""
    doc = series_document(series)
    sources = {
        "t": CLOCK,
        "t_rel": "seconds since the first record",
        **{k: "engine step records" for k in STEP_FIELDS},
        **doc["sources"],
    }
    estimates = [
        (
            "estimate",
            {
                "t": t,
                "t_rel": t - (series.t0 or 0.0),
                "generation": e["generation"],
                e["series"]: e["value"],
                "estimate_source": e["source"],
            },
        )
        for e in doc["estimates"]
        for t in (e["t_start"], e["t_end"])
    ]
    merged = [("step", r) for r in doc["steps"]] + [("sample", r) for r in doc["samples"]] + estimates
    merged.sort(key=lambda kr: kr[1]["t"])
    merged[:0] = [("source", sources), ("unavailable", doc["unavailable"])]
    rows = [[kind] + [r.get(c) for c in SERIES_CSV_COLUMNS[1:]] for kind, r in merged]
    return _write_csv(path, list(SERIES_CSV_COLUMNS), rows, "the time series")


# A plots image's width and height; below 400 px the plots with their axes do not fit.
MIN_IMAGE_PX, MAX_IMAGE_PX = 400, 8000


def save_plots(
    path: PathLike, views: Sequence[SeriesView], width: int, height: int, background: QColor, foreground: QColor
) -> Path:
    """The plotted series drawn again through pyqtgraph's ImageExporter as a `width` × `height` PNG (its SVG
    exporter fails on the paths this Qt writes): one plot per series on screen, titled with its header (title — source, newest
    value), with the curves as the HUD draws them and the same time range; no controls around them."""
    import pyqtgraph as pg
    from pyqtgraph.exporters import ImageExporter
    from PySide6.QtCore import Qt

    path = Path(path)
    for name, px in (("width", width), ("height", height)):
        if not MIN_IMAGE_PX <= px <= MAX_IMAGE_PX:
            raise ValueError(f"the image {name} must be {MIN_IMAGE_PX} to {MAX_IMAGE_PX} pixels, got {px}")
    shown = [v for v in views if v.plotted]
    if not shown:
        raise OSError("no series has anything to plot yet")
    figure = pg.GraphicsLayoutWidget()
    figure.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen, True)  # laid out at its size, never on screen
    try:
        figure.setBackground(background)
        figure.ci.setContentsMargins(6, 6, 12, 6)
        axis_px = left_axis_px()  # as the HUD's plots: a large font's tick labels are left out of a narrower axis
        marks = {  # each generation's "#N" at its start, from the plot that carries them (the HUD's top one)
            float(line.value()): line.label.format
            for v in views
            for line in v.lines
            if line.isVisible() and getattr(line, "label", None) is not None and line.label.format
        }
        for i, view in enumerate(shown):
            plot = figure.addPlot(row=i, col=0)
            title = f"{view.label_text} · {view.value.text()}"
            # room for the title: the image less the left axis, the margins and the label's own padding
            plot.setTitle(
                _wrapped(title, TITLE_PT, width - axis_px - 62), color=foreground.name(), size=f"{TITLE_PT}pt"
            )
            for item in view.plot.items:
                if isinstance(item, pg.PlotCurveItem) and item.xData is not None and len(item.xData):
                    # each curve joined as drawn: an estimate's levels are separate segments ("pairs")
                    connect = item.opts.get("connect", "finite")
                    # as wide in the image's pixels as on a screen at 100 % (the HUD's are as wide as its scale)
                    pen = QPen(item.opts["pen"])
                    pen.setWidthF(pen.widthF() / view.devicePixelRatioF())
                    plot.addItem(pg.PlotCurveItem(item.xData, item.yData, pen=pen, connect=connect))
            # the generations' boundaries and their "#N" marks, as the HUD draws them (the image could not tell
            # which answer a stretch of a curve belonged to)
            for line in view.lines:
                if not line.isVisible():
                    continue
                text = marks.get(float(line.value())) if i == 0 else None  # the marks on the top plot, as on screen
                mark = pg.InfiniteLine(
                    pos=line.value(),
                    angle=90,
                    pen=line.pen,
                    label=text or None,
                    labelOpts={"position": 0.97, "color": foreground, "anchors": [(0, 0), (0, 0)]},
                )
                plot.addItem(mark, ignoreBounds=True)
            (x_lo, x_hi), (y_lo, y_hi) = view.plot.viewRange()
            plot.setXRange(x_lo, x_hi, padding=0)
            plot.setYRange(y_lo, y_hi, padding=0)
            plot.showGrid(x=False, y=True, alpha=0.15)
            left = plot.getAxis("left")
            left.setWidth(axis_px + 8)  # and the axis' unit label
            if view.spec.axis_gib:
                left.enableAutoSIPrefix(False)
                left.setScale(1.0 / (1 << 30))
            left.setLabel(view.spec.figure.unit if not view.spec.axis_gib else "GiB", color=foreground.name())
            for axis in ("left", "bottom"):
                plot.getAxis(axis).setTextPen(pg.mkPen(foreground))
            if i < len(shown) - 1:
                plot.hideAxis("bottom")
            else:
                plot.setLabel("bottom", "Time since the first record (s)", color=foreground.name())
        missing = [f"{v.spec.title}: {fmt.NA} — {v.na_reason}" for v in views if not v.plotted and v.na_reason]
        if missing:  # the series the HUD shows as n/a, with why, where they were left out without a word
            figure.addLabel(
                _wrapped(" · ".join(missing), TITLE_PT, width - 40),
                row=len(shown),
                col=0,
                color=foreground.name(),
                size=f"{TITLE_PT}pt",
            )
        figure.resize(width, height)
        figure.show()  # offscreen: sends the resize that lays the plots out at the image's size
        figure.ci.layout.activate()
        exporter = ImageExporter(figure.ci)
        exporter.parameters().param("width").setValue(width, blockSignal=exporter.widthChanged)
        exporter.parameters().param("height").setValue(height, blockSignal=exporter.heightChanged)
        exporter.parameters()["background"] = background
        image = exporter.export(toBytes=True)
        if image is None or image.isNull():
            raise ExportError(f"cannot write the plots to {path}: they could not be drawn")
        data = _png(image, f"the plots to {path}")
    finally:
        figure.close()
        figure.deleteLater()
    return _write(path, data, "the plots")


TITLE_PT = 9  # the exported plots' titles


def _wrapped(text: str, points: float, width: int) -> str:
    """`text` as the HTML of a plot title broken into lines of at most `width` pixels. A title is its figure's
    name and source and is not cut; as one line, a long source widened the layout past the image, which was then
    drawn scaled down with its lower part left blank."""
    from PySide6.QtGui import QFont, QFontMetrics

    font = QFont()
    font.setPointSizeF(points)
    metrics = QFontMetrics(font)

    def pieces(word: str) -> list[str]:  # a word wider than the line (a path, a URL) is broken where it must be
        out = [""]
        for ch in word:
            if out[-1] and metrics.horizontalAdvance(out[-1] + ch) > width:
                out.append("")
            out[-1] += ch
        return out

    lines: list[str] = []
    for word in text.split(" "):
        for i, piece in enumerate(pieces(word)):
            if i == 0 and lines and metrics.horizontalAdvance(f"{lines[-1]} {piece}") <= width:
                lines[-1] = f"{lines[-1]} {piece}"
            else:
                lines.append(piece)
    return "<br>".join(html.escape(line) for line in lines)


def save_png(path: PathLike, widget: QWidget, what: str) -> Path:
    """The widget as it is drawn now, as a PNG file: `what` it shows names it in an error."""
    return save_image(path, widget, what, "PNG")


def save_image(path: PathLike, widget: QWidget, what: str, image_format: str) -> Path:
    """The widget as it is drawn now, as an image file in `image_format` (one QImageWriter writes), written whole
    or not at all: `what` it shows names it in an error."""
    path = Path(path)
    pixmap = widget.grab()
    if pixmap.isNull():
        raise ExportError(f"cannot write {what} to {path}: it could not be drawn (zero size?)")
    return _write(path, _encoded(pixmap.toImage(), f"{what} to {path}", image_format), what)


class ExportError(OSError):
    """An export that was not written, its message saying what, where and why ("cannot write the time series to
    <path>: the folder <folder> does not exist")."""


def _png(image: QImage, what: str) -> bytes:
    return _encoded(image, what, "PNG")


def _encoded(image: QImage, what: str, image_format: str) -> bytes:
    """`image` encoded in `image_format`, in memory: written to the file whole (_write), a disk that fills on the
    way leaves no half image under the user's name."""
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    writer = QImageWriter(buffer, image_format.encode("ascii", "replace"))
    if not writer.write(image):
        raise ExportError(
            f"cannot write {what}: the image could not be encoded as {image_format} ({writer.errorString()})"
        )
    buffer.close()
    return bytes(data.data())


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, (list, dict)):
        return json.dumps(v, sort_keys=True)
    return v


def _write_csv(path: PathLike, header: list[str], rows: list[list[Any]], what: str) -> Path:
    text = io.StringIO(newline="")
    w = csv.writer(text)
    w.writerow(header)
    for row in rows:
        w.writerow([_cell(v) for v in row])
    return _write(path, text.getvalue(), what)


def _write_json(path: PathLike, doc: dict, what: str) -> Path:
    # allow_nan=False: a NaN reaching here would be a bug (not-measured values are None), so fail loudly.
    return _write(path, json.dumps(doc, indent=2, allow_nan=False) + "\n", what)


def _write(path: PathLike, data: Union[str, bytes], what: str) -> Path:
    """Whole or not at all: an export that failed on its way (a full disk, text the encoding refuses) left the
    file it replaced as a header and nothing else, and a PNG a truncated image. A link is written through and
    kept; a folder, a device, a folder that does not exist are refused with `what` and the path (the error named
    the temporary file beside it)."""
    path = Path(path)
    try:
        target = output_file(path, what)
    except OutputPathError as exc:
        raise ExportError(str(exc)) from None
    try:
        write_whole(target, data)
    except OSError as exc:
        raise ExportError(f"cannot write {what} to {path}: {exc.strerror or exc}") from exc
    return path
