"""The desktop app started on damaged state, as `gapless gui` starts it (app.gui.run_gui, its own event loop):
a corrupt settings file or chat database is moved aside with a notice and the app opens and answers; a newer
database stops the start with a message and is left untouched; a model that fails to load at start leaves the
app usable; a second instance on the same data folder corrupts nothing."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator, Optional

import pytest
from PySide6.QtCore import QEvent, QTimer
from PySide6.QtWidgets import QApplication, QMessageBox
from worker_gate import hold_after_first_batch

from app.gui import build, run_gui
from app.paths import AppPaths
from app.settings import SettingsStore
from app.store import SCHEMA_VERSION, ChatStore
from engine.types import EngineOptions, SamplingParams
from ui.main_window import MainWindow

TIMEOUT_S = 120
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, seed=0)

Script = Callable[[MainWindow], Iterator[Callable[[], bool]]]


@pytest.fixture
def paths(tmp_path) -> AppPaths:
    return AppPaths.resolve(tmp_path / "gapless").ensure()


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def notices_shown(win: MainWindow) -> list[str]:
    return [b.text() for b in win.findChildren(QMessageBox) if b.isVisible()]


def run_app(paths: AppPaths, model: Optional[str], script: Script) -> tuple[int, dict]:
    """Run the app as `gapless gui --model MODEL` does, driving its window from a timer inside the app's own
    event loop: `script(window)` yields conditions, each waited for in turn; then the window is closed."""
    state: dict = {"error": None, "script": None, "waiting": None, "notices": []}
    deadline = time.monotonic() + TIMEOUT_S
    timer = QTimer()
    timer.setInterval(20)

    def window() -> Optional[MainWindow]:
        return next((w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible()), None)

    def finish(win: Optional[MainWindow]) -> None:
        timer.stop()
        if win is not None:
            for box in win.findChildren(QMessageBox):
                box.done(0)
            win.close()
            win.deleteLater()
        QApplication.quit()

    def tick() -> None:
        win = window()
        try:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the app did not reach the expected state in {TIMEOUT_S} s")
            if win is None:
                return
            if state["script"] is None:
                state["notices"] = notices_shown(win)  # what the user sees first, before anything happens
                state["script"] = script(win)
                state["waiting"] = next(state["script"])
            while state["waiting"]():
                state["waiting"] = next(state["script"])
        except StopIteration:
            finish(win)
        except Exception as exc:  # reported by the test after the loop has ended
            state["error"] = exc
            finish(win)

    timer.timeout.connect(tick)
    timer.start()
    args = SimpleNamespace(smoke_test=False, theme="light", model=model)
    try:
        code = run_gui(args, paths)
    finally:
        timer.stop()
        # Closing the last window and quit() each post a Quit event; the one left over would end the next
        # event loop of this test process at once.
        QApplication.removePostedEvents(QApplication.instance(), QEvent.Type.Quit)
    if state["error"] is not None:
        raise state["error"]
    return code, state


def send_and_wait(win: MainWindow, text: str) -> Iterator[Callable[[], bool]]:
    """Type `text`, press Send, wait for the answer to be saved."""
    win.flow.default_sampling = GREEDY
    yield lambda: win.composer.send_button.isEnabled()
    win.composer.set_text(text)
    win.composer.send_button.click()
    yield lambda: win.flow.generating
    yield lambda: not win.flow.generating


def answered(paths: AppPaths, question: str) -> list[tuple[str, str, str]]:
    with ChatStore(paths.database) as store:
        for chat in store.list_chats():
            thread = store.thread(chat.id)
            if thread and thread[0].content == question:
                return [(m.role, m.status, m.content) for m in thread]
    return []


# ---- a corrupt settings file ------------------------------------------------------------------------------


def test_corrupt_settings_at_start_are_moved_aside_and_defaults_used(qapp, paths, tiny_llama):
    damaged = b'{"version": 1, "theme": "dark", "engine_options": {"kv_cache": "stat'  # cut off mid-write
    paths.settings_file.write_bytes(damaged)
    seen: dict = {}

    def script(win):
        seen["options"] = win.toggles.options
        yield lambda: win.controller.info is not None
        yield from send_and_wait(win, "hello after a bad settings file")

    code, state = run_app(paths, str(tiny_llama), script)
    assert code == 0
    [notice] = state["notices"]
    [aside] = list(paths.config.glob("settings.json.corrupt-*"))
    column = damaged.index(b'"stat') + 1
    assert notice == (
        f"The settings file {paths.settings_file} could not be used: it is not valid JSON: "
        f"Unterminated string starting at (line 1, column {column}). It was kept as {aside.name} "
        "and default settings are used."
    )
    assert aside.read_bytes() == damaged
    assert seen["options"] == EngineOptions()
    roles = answered(paths, "hello after a bad settings file")
    assert [(r, s) for r, s, _ in roles] == [("user", "done"), ("assistant", "done")] and roles[1][2]
    saved, notices = SettingsStore(paths.settings_file).load()  # the app wrote a good file on the way out
    assert notices == [] and saved.last_model == str(tiny_llama)


# ---- a corrupt chat database ------------------------------------------------------------------------------


def test_corrupt_database_at_start_is_moved_aside_and_a_new_one_used(qapp, paths, tiny_llama):
    damaged = b"SQLite format 3\x00" + bytes(range(256)) * 64  # a header, then garbage
    paths.database.write_bytes(damaged)

    def script(win):
        yield lambda: win.controller.info is not None
        assert win.chat_list.chat_ids() == []
        yield from send_and_wait(win, "hello after a bad database")

    code, state = run_app(paths, str(tiny_llama), script)
    assert code == 0
    [aside] = list(paths.data.glob("chats.sqlite3.corrupt-*"))
    assert aside.read_bytes() == damaged
    [notice] = state["notices"]
    assert notice.startswith("The chat database was damaged (")
    assert notice.endswith(f"). It was kept as {aside.name} and a new, empty one was created.")
    roles = answered(paths, "hello after a bad database")
    assert [(r, s) for r, s, _ in roles] == [("user", "done"), ("assistant", "done")]
    assert sqlite3.connect(paths.database).execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_newer_database_stops_the_start_with_a_message_and_is_untouched(qapp, paths, tiny_llama, capsys):
    with ChatStore(paths.database) as store:
        store.create_chat("from a later version")
    db = sqlite3.connect(paths.database)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    before = sha(paths.database)
    shown: list[tuple[str, str]] = []

    def dismiss():  # QMessageBox.critical runs its own loop; answer it as the user would
        for box in QApplication.topLevelWidgets():
            if isinstance(box, QMessageBox) and box.isVisible():
                shown.append((box.windowTitle(), box.text()))
                box.done(0)

    timer = QTimer()
    timer.timeout.connect(dismiss)
    timer.start(20)
    try:
        code = run_gui(SimpleNamespace(smoke_test=False, theme="light", model=str(tiny_llama)), paths)
    finally:
        timer.stop()
    assert code == 2
    message = (
        f"the chat database {paths.database} was written by a newer version of Gapless (schema "
        f"{SCHEMA_VERSION + 1}, this version reads up to {SCHEMA_VERSION}); it was left untouched"
    )
    assert shown == [("Gapless cannot start", message)]
    assert capsys.readouterr().err.strip().splitlines() == [f"gapless: error: {message}"]
    assert sha(paths.database) == before
    assert not any(isinstance(w, MainWindow) and w.isVisible() for w in QApplication.topLevelWidgets())


# ---- a model that fails to load at start --------------------------------------------------------------------


def test_first_model_fails_to_load_and_the_app_stays_usable(qapp, paths, tiny_llama, tmp_path):
    broken = tmp_path / "half-copied"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_llama / "config.json").read_text())  # no weights
    seen: dict = {}

    def script(win):
        yield lambda: bool(notices_shown(win))
        seen["box"] = notices_shown(win)
        seen["panel"] = win.model_panel.error.text()
        seen["send"] = win.composer.send_button.isEnabled()
        seen["why"] = win.composer.send_button.toolTip()
        for box in win.findChildren(QMessageBox):
            box.done(0)
        win.load_model(str(tiny_llama))  # the user opens another model
        yield lambda: win.controller.info is not None
        yield from send_and_wait(win, "hello after a failed load")

    code, _ = run_app(paths, str(broken), script)
    assert code == 0
    [box] = seen["box"]
    assert box.startswith(f"Could not load {broken}:\n") and "still loaded" not in box
    assert "weights" in box.lower() or "safetensors" in box.lower(), box
    assert seen["panel"].startswith("Could not load ")
    assert seen["send"] is False and seen["why"] == "No model loaded: open one in the model panel (bottom left)"
    roles = answered(paths, "hello after a failed load")
    assert [(r, s) for r, s, _ in roles] == [("user", "done"), ("assistant", "done")]


# ---- a second instance on the same data folder ---------------------------------------------------------------


def test_two_instances_stream_into_the_same_database(qtbot, paths, tiny_llama, monkeypatch):
    apps = [build(paths, "light") for _ in range(2)]
    try:
        for gui in apps:
            gui.window.show()
            with qtbot.waitSignal(gui.controller.loaded, timeout=TIMEOUT_S * 1000):
                gui.window.load_model(str(tiny_llama))
            gui.window.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=120, seed=0)
        spans: list[list[list[float]]] = [[], []]  # per instance: [started, finished] of each answer
        # The first worker to send text waits there until both answers have started, so the first round overlaps
        # however the two threads are scheduled; the other rounds run free.
        release = hold_after_first_batch(monkeypatch)

        def started(i: int) -> None:
            spans[i].append([time.monotonic()])
            if all(spans):
                release.set()

        for i, gui in enumerate(apps):
            gui.controller.generationStarted.connect(lambda *_, i=i: started(i))
            gui.controller.generationFinished.connect(lambda *_, i=i: spans[i][-1].append(time.monotonic()))
        for round_ in range(3):  # both answer at the same time, three times over
            for i, gui in enumerate(apps):
                assert gui.window.flow.send(f"instance {i} round {round_}")
            qtbot.waitUntil(lambda: not any(g.window.flow.generating for g in apps), timeout=TIMEOUT_S * 1000)
        assert any(a[0] < b[1] and b[0] < a[1] for a, b in zip(*spans)), f"the answers never overlapped: {spans}"
        chat_ids = [gui.window.flow.chat_id for gui in apps]
        threads = [[(m.role, m.status, m.content) for m in gui.store.thread(cid)] for gui, cid in zip(apps, chat_ids)]
    finally:
        stopped = []
        for gui in apps:
            gui.window.close()
            stopped.append(gui.close())
    # each engine worker stopped in time: the first one's close of its model did not wait for the GUI thread,
    # which was waiting for it (it hung until the close's timeout and the worker kept running)
    assert stopped == [True, True]
    assert chat_ids[0] != chat_ids[1]
    with ChatStore(paths.database) as third:  # a restart sees both conversations whole
        for i, cid in enumerate(chat_ids):
            thread = [(m.role, m.status, m.content) for m in third.thread(cid)]
            assert thread == threads[i]
            assert [c for r, _, c in thread if r == "user"] == [f"instance {i} round {r}" for r in range(3)]
            assert [s for _, s, _ in thread] == ["done"] * 6
            assert all(c for r, _, c in thread if r == "assistant")
    assert sqlite3.connect(paths.database).execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert json.loads(paths.settings_file.read_text())["last_model"] == str(tiny_llama)


def test_a_model_named_relative_to_where_the_app_started_is_kept_absolute(qapp, paths, tiny_llama, monkeypatch):
    """`gapless gui --model ./model` in a terminal, then the app from the desktop menu: the model it reopens is the
    same one, not a path relative to another folder."""
    monkeypatch.chdir(tiny_llama.parent)

    def script(win: MainWindow) -> Iterator[Callable[[], bool]]:
        yield lambda: win.controller.info is not None

    code, _ = run_app(paths, tiny_llama.name, script)
    assert code == 0
    saved, _ = SettingsStore(paths.settings_file).load()
    assert saved.last_model == str(tiny_llama) and os.path.isabs(saved.last_model)
