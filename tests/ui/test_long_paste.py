"""A long paste: the answer shows how much of the conversation has been read, and Stop ends it between chunks,
keeping the question and no empty answer."""

from __future__ import annotations

import threading

from PySide6.QtCore import Qt
from test_main_window import TIMEOUT_MS, close_app, open_app

from app.worker import EngineWorker
from engine.prefix import PREFILL_CHUNK

LONG = " ".join(f"word{n % 37} the quick brown fox" for n in range(160))


def hold_at_first_reading(monkeypatch) -> threading.Event:
    """The worker waits after passing on the first "reading the conversation" progress until the test lets it
    go, so what the GUI thread does then lands while the prompt is still being read."""
    release = threading.Event()
    real = EngineWorker._on_progress
    held: list[bool] = []

    def hold(self, p):
        real(self, p)
        if p.stage == "prefill" and not held:
            held.append(True)
            release.wait(60)

    monkeypatch.setattr(EngineWorker, "_on_progress", hold)
    return release


def test_a_long_paste_shows_its_progress_and_stops(qtbot, tmp_path, tiny_factory, monkeypatch):
    gui = open_app(qtbot, tmp_path / "data", tiny_factory("llama", max_position_embeddings=2048))
    try:
        w = gui.window
        release = hold_at_first_reading(monkeypatch)
        seen: list[str] = []

        def on_progress(p):
            if p.stage == "prefill" and not seen:
                seen.append(p.message)
                seen.append(w.chat_view._stream.stats_label.text() if w.chat_view._stream else "")
                seen.append(w.status.text())
                qtbot.keyClick(w.composer.edit, Qt.Key.Key_Escape)  # the user stops it
                release.set()

        gui.controller.progress.connect(on_progress)
        w.composer.set_text(LONG)
        with qtbot.waitSignal(gui.controller.generationFinished, timeout=TIMEOUT_MS) as blocker:
            w.composer.send_button.click()
        qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
        result = blocker.args[1]
        T = result.metrics.prompt_tokens
        reading = f"reading the conversation: {PREFILL_CHUNK:,} of {T:,} tokens"
        assert seen == [reading, reading, f"{reading} · Esc stops"]
        assert result.finish_reasons == ["cancelled"] and result.texts == [""]
        assert f"stopped while reading the conversation ({PREFILL_CHUNK:,} of {T:,} tokens read)" in w.status.text()
        thread = gui.store.thread(w.flow.chat_id)
        assert [(m.role, m.content) for m in thread] == [("user", LONG)]  # the question stays, no empty answer
        assert [m.role for m in w.chat_view.items()] == ["user"]
    finally:
        close_app(gui)


def test_once_the_answer_arrives_it_no_longer_says_the_prompt_is_being_read(qtbot, tmp_path, tiny_factory):
    gui = open_app(qtbot, tmp_path / "data", tiny_factory("llama", max_position_embeddings=2048))
    try:
        w = gui.window
        seen: dict = {}

        def on_delta(_deltas):
            if "first" not in seen and w.chat_view._stream is not None:
                seen["first"] = (w.chat_view._stream.stats_label.text(), w.status.text())

        gui.window.flow.streamDelta.connect(on_delta)
        w.composer.set_text(LONG)
        with qtbot.waitSignal(gui.controller.generationFinished, timeout=TIMEOUT_MS):
            w.composer.send_button.click()
        assert seen["first"] == ("generating…", "Answering…")  # not "reading the conversation: N of N tokens"
    finally:
        close_app(gui)
