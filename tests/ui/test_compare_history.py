"""The HUD's compare table is kept with the chats: rows of one run come back when the app is built again on the
same data folder, new generations are numbered after them, and Clear history (asked first) removes them for good."""

from __future__ import annotations

import sqlite3

import pytest
from dialog_driver import DialogDriver
from PySide6.QtWidgets import QPushButton

from app.gui import build
from app.paths import AppPaths
from engine.types import EngineOptions, GenerationMetrics

TIMEOUT_MS = 60_000


def metrics(tok_s: float) -> GenerationMetrics:
    m = GenerationMetrics(new_tokens_total=40, prompt_tokens=12)
    m.put("decode_tok_s", tok_s, "engine timing, device-synchronised")
    m.put("tokens_per_step", 1.0, "engine counters: tokens kept / decode steps")
    m.mark_na("gpu_util_pct", "the model runs on the CPU, not on a GPU")
    return m


@pytest.fixture
def paths(tmp_path):
    return AppPaths.resolve(tmp_path / "data")


def opened(paths, qtbot):
    g = build(paths, "light")
    g.window.show()
    qtbot.waitExposed(g.window)
    return g


def shown(g) -> list[tuple]:
    return [(r.index, r.label, r.options, r.metrics) for r in g.hud.compare.model.rows]


def test_compare_rows_come_back_after_a_restart_until_cleared(qtbot, paths):
    eager, static = EngineOptions(device="cpu"), EngineOptions(device="cpu", kv_cache="static")
    g = opened(paths, qtbot)
    try:
        g.hud.begin_generation("eager", eager)
        g.hud.end_generation(metrics(20.0), eager, "eager")
        g.hud.begin_generation("static", static)
        g.hud.end_generation(metrics(31.5), static, "+ static KV")
        before = shown(g)
        assert [r[:2] for r in before] == [(1, "eager"), (2, "+ static KV")]
    finally:
        g.window.close()
        g.close()

    g = opened(paths, qtbot)  # the app built again on the same data folder
    try:
        assert shown(g) == before
        assert g.hud.compare.model.reference == 0
        g.hud.begin_generation("again", eager)
        g.hud.end_generation(metrics(22.0), eager, "again")
        assert [r.index for r in g.hud.compare.model.rows] == [1, 2, 3]  # numbered after the kept rows

        clear = next(b for b in g.hud.findChildren(QPushButton) if b.text() == "Clear history…")
        driver = DialogDriver().click("Cancel").start()
        clear.click()
        assert driver.done and driver.answered[0].title == "Clear the compare history"
        assert "Remove the 3 rows of the compare table?" in driver.answered[0].text
        assert len(g.hud.compare.model.rows) == 3  # Cancel keeps them
        driver = DialogDriver().click("Clear").start()
        clear.click()
        assert driver.done and g.hud.compare.model.rows == []
    finally:
        g.window.close()
        g.close()

    g = opened(paths, qtbot)
    try:
        assert shown(g) == []
    finally:
        g.window.close()
        g.close()


def test_a_bad_stored_row_is_left_out_and_the_app_starts(qtbot, paths, caplog):
    g = opened(paths, qtbot)
    try:
        g.hud.end_generation(metrics(20.0), EngineOptions(device="cpu"), "good")
    finally:
        g.window.close()
        g.close()
    db = sqlite3.connect(paths.database)
    db.execute(
        "INSERT INTO compare_rows (created, generation, label, options_json, metrics_json) "
        "VALUES (1, 2, 'bad', '{}', '{\"ttft_ms\": \"slow\"}')"
    )
    db.commit()
    db.close()
    g = opened(paths, qtbot)
    try:
        assert [r.label for r in g.hud.compare.model.rows] == ["good"]
        assert any(
            'compare row 2 refused: its figure ttft_ms is "slow", not a number' in r.getMessage()
            for r in caplog.records
        )
    finally:
        g.window.close()
        g.close()


def test_two_windows_on_one_data_folder_number_their_rows_after_each_other(qtbot, paths):
    """Each window numbered its generations from its own count: both kept a #1 and a #2, and the table built
    again showed each number twice."""
    options = EngineOptions(device="cpu")
    a, b = opened(paths, qtbot), opened(paths, qtbot)
    try:
        for g, label in ((a, "a1"), (b, "b1"), (a, "a2"), (b, "b2")):
            g.hud.begin_generation(label, options)
            g.hud.end_generation(metrics(20.0), options, label)
        assert [r.index for r in a.hud.compare.model.rows] == [1, 3]
        assert [r.index for r in b.hud.compare.model.rows] == [2, 4]
    finally:
        for g in (a, b):
            g.window.close()
            g.close()
    g = opened(paths, qtbot)
    try:
        assert [(r.index, r.label) for r in g.hud.compare.model.rows] == [(1, "a1"), (2, "b1"), (3, "a2"), (4, "b2")]
    finally:
        g.window.close()
        g.close()
