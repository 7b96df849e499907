"""The window as a new user meets it, on a tiny random model: what it shows is what is in force (precision,
candidates' own figures, errors that still hold), and a right-click never shows another chat's messages."""
from __future__ import annotations

import pytest

from test_main_window import TIMEOUT_MS, close_app, open_app, send


@pytest.fixture(autouse=True)
def _restore_app_look(qapp):
    sheet, palette, style = qapp.styleSheet(), qapp.palette(), qapp.style().name()
    yield
    qapp.setStyleSheet(sheet)
    qapp.setPalette(palette)
    qapp.setStyle(style)


@pytest.fixture
def app(qtbot, tmp_path, tiny_llama):
    gui = open_app(qtbot, tmp_path / "data", tiny_llama)
    yield gui
    close_app(gui)


def choose(qtbot, gui, combo, value) -> None:
    """Pick `value` in one of the toggles' combo boxes as a user does, and wait for the engine to take it."""
    with qtbot.waitSignal(gui.controller.reconfigured, timeout=TIMEOUT_MS):
        combo.setCurrentIndex(combo.findData(value))
        combo.activated.emit(combo.currentIndex())


def test_the_precision_shown_is_the_one_in_force(qtbot, app):
    w = app.window
    assert w.model_panel.values["dtype"].text() == "fp32"
    choose(qtbot, app, w.toggles.dtype, "bf16")
    assert w.model_panel.values["dtype"].text() == "bf16"
    assert w.model_status.text().endswith("· cpu · bf16")
    result = send(qtbot, app, "hello")
    assert result.options.dtype == "bf16"
    assert w.model_panel.values["dtype"].text() == "bf16"
    choose(qtbot, app, w.toggles.dtype, "auto")  # auto on a CPU is fp32 again
    assert w.model_panel.values["dtype"].text() == "fp32" and w.model_status.text().endswith("· cpu · fp32")


def test_a_load_error_clears_once_the_model_in_use_answers(qtbot, app, tmp_path):
    w = app.window
    empty = tmp_path / "no-weights"
    empty.mkdir()
    with qtbot.waitSignal(app.controller.loadFailed, timeout=TIMEOUT_MS):
        w.load_model(str(empty))
    assert w.model_panel.error.isVisibleTo(w) and "no-weights" in w.model_panel.error.text()
    assert w.model_panel.status.text() == f"Still using {app.controller.info.name}"
    send(qtbot, app, "still here")
    assert not w.model_panel.error.isVisibleTo(w)
    assert w.model_panel.status.text() == "Ready"
