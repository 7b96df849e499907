"""The main window with the real engine on a tiny random model: streaming into the view and the database,
reopening, stop, edit-and-resend branches, option changes recorded per answer, candidates, a failed load."""

from __future__ import annotations

import json

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QPushButton
from worker_gate import on_first_batch

from app.gui import build
from app.paths import AppPaths
from app.store import ChatStore
from engine import figures
from engine.types import SamplingParams, options_as_run
from ui.main_window import DOCK_SHARE

TIMEOUT_MS = 120_000


def open_app(qtbot, data_dir, model=None, theme="light"):
    gui = build(AppPaths.resolve(data_dir), theme)
    gui.window.show()
    if model is not None:
        with qtbot.waitSignal(gui.controller.loaded, timeout=TIMEOUT_MS):
            gui.window.load_model(str(model))
    # Greedy and short: the same answer every run, so tests can compare texts token for token.
    gui.window.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=24, seed=0)
    return gui


def close_app(gui):
    gui.window.close()
    gui.close()


def send(qtbot, gui, text):
    """Type into the composer, press Enter, wait for the answer; return the GenerationResult."""
    w = gui.window
    w.composer.edit.setFocus()
    w.composer.set_text(text)
    with qtbot.waitSignal(gui.controller.generationFinished, timeout=TIMEOUT_MS) as blocker:
        qtbot.keyClick(w.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
    return blocker.args[1]


def batches_text(batches, candidate=0):
    return "".join(b.get(candidate, "") for b in batches)


def test_a_send_the_store_refuses_keeps_the_draft(qtbot, app):
    from app.store import StoreError

    w = app.window
    errors = []
    w.flow.failed.connect(errors.append)

    def locked(*a, **k):
        raise StoreError("database is locked")

    real = app.store.add_message, app.store.start_chat
    app.store.add_message = app.store.start_chat = locked
    try:
        w.composer.set_text("a long question I typed")
        w.composer.send_button.click()
        assert errors == ["database is locked"] and not w.flow.generating
        assert w.composer.text() == "a long question I typed"  # nothing lost
        assert w.chat_list.chat_ids() == [] and app.store.chat_titles() == []  # and no empty chat left behind
    finally:
        app.store.add_message, app.store.start_chat = real
    send(qtbot, app, "a long question I typed")  # once the store takes it, the box empties
    assert w.composer.text() == ""


def test_an_edit_the_store_refuses_keeps_its_text(qtbot, app):
    """The editor closed as Send was pressed: where the store then refused the edit, its text was gone."""
    from app.store import StoreError

    w = app.window
    errors = []
    w.flow.failed.connect(errors.append)
    send(qtbot, app, "hello world")
    question = w.chat_view.messages()[0]
    question.start_edit()
    question.editor_text.setPlainText("an edit I typed with care")

    def locked(*a, **k):
        raise StoreError("database is locked")

    real = app.store.add_message
    app.store.add_message = locked
    try:
        question._edit_send.click()
        assert errors == ["database is locked"] and not w.flow.generating
        assert question._editor is not None and question.editor_text.toPlainText() == "an edit I typed with care"
    finally:
        app.store.add_message = real
    with qtbot.waitSignal(app.controller.generationFinished, timeout=TIMEOUT_MS):
        question._edit_send.click()  # once the store takes it, the conversation shows the new branch
    qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
    shown = w.chat_view.messages()[0]
    assert shown.body.text == "an edit I typed with care" and shown._editor is None and shown.body.isVisible()


def test_reply_streams_into_view_and_database(qtbot, app):
    w, store = app.window, app.store
    batches = []
    app.controller.textBatch.connect(lambda rid, b: batches.append(b))
    result = send(qtbot, app, "hello world")

    answer = result.texts[0]
    assert answer and batches, "the answer arrived in text batches"
    assert batches_text(batches) == answer  # streamed text is exactly the final text
    chat_id = w.flow.chat_id
    thread = store.thread(chat_id)
    assert [(m.role, m.status) for m in thread] == [("user", "done"), ("assistant", "done")]
    assert thread[0].content == "hello world"
    assert thread[1].content == answer
    assert thread[1].options == options_as_run(result.options, result.unavailable, result.limits)  # as in the JSON
    assert thread[1].metrics["new_tokens_total"] == result.metrics.new_tokens_total
    assert thread[1].model_name == app.controller.info.name

    shown = w.chat_view.messages()
    assert [m.item.role for m in shown] == ["user", "assistant"]
    assert shown[1].body.text == answer
    stats = shown[1].stats_label.text()
    assert f"{result.metrics.new_tokens_total} tokens" in stats
    tok_s = result.metrics.decode_tok_s
    assert (f"{figures.rounded(tok_s, 1)} tok/s" if tok_s is not None else "n/a tok/s") in stats  # 1,234.5
    assert "op gap" in stats  # on the CPU the profiler window measures the gap between aten ops
    assert w.chat_list.chat_ids() == [chat_id]
    assert w.chat_title.text() == "hello world"


def test_reopening_the_window_shows_the_chat(qtbot, data_dir, tiny_llama):
    gui = open_app(qtbot, data_dir, tiny_llama)
    result = send(qtbot, gui, "Paris is the capital")
    chat_id = gui.window.flow.chat_id
    close_app(gui)

    gui = open_app(qtbot, data_dir)  # no model: history does not need one
    try:
        w = gui.window
        assert w.chat_list.chat_ids() == [chat_id]
        w.chat_list.list.setCurrentRow(0)
        texts = [(m.item.role, m.body.text) for m in w.chat_view.messages()]
        assert texts == [("user", "Paris is the capital"), ("assistant", result.texts[0])]
        assert "tokens" in w.chat_view.messages()[1].stats_label.text()  # the stats line stays
    finally:
        close_app(gui)


def test_closing_the_app_mid_answer_keeps_it_as_stopped_with_its_figures(qtbot, data_dir, tiny_llama, monkeypatch):
    """The worker's last word (the stopped answer's result) was never delivered before the chat store closed:
    the answer was kept as a crash's, "cut off: the app closed mid-answer", its figures n/a."""
    from worker_gate import hold_after_first_batch

    gui = open_app(qtbot, data_dir, tiny_llama)
    w = gui.window
    w.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=200, seed=0)
    release = hold_after_first_batch(monkeypatch)
    closed: list[bool] = []

    def close_now(_rid, _batch):  # as Ctrl+Q does while the answer streams
        if not closed:
            closed.append(True)
            w.close()
            release.set()
            gui.close()

    gui.controller.textBatch.connect(close_now)
    w.composer.set_text("tell me a story")
    qtbot.keyClick(w.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: bool(closed), timeout=TIMEOUT_MS)
    store = ChatStore(gui.paths.database)
    try:
        chat_id = store.list_chats()[0].id
        answer = store.thread(chat_id)[-1]
        assert answer.role == "assistant" and answer.status == "stopped" and answer.content
        assert answer.metrics["finish_reason"] == "cancelled" and answer.metrics["new_tokens_total"] > 0
    finally:
        store.close()


def edit_and_send(qtbot, gui, index: int, text: str) -> None:
    """Edit message `index` on screen to `text`, send it, and wait for its answer."""
    w = gui.window
    question = w.chat_view.messages()[index]
    question.start_edit()
    question.editor_text.setPlainText(text)
    with qtbot.waitSignal(gui.controller.generationFinished, timeout=TIMEOUT_MS):
        question._edit_send.click()
    qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)


def send_and_stop(qtbot, gui, text, stop, monkeypatch):
    """Send `text` with room for a long answer, and call stop() when its first text arrives (the worker held there
    until it has run, so the answer is still running); the result."""
    gui.window.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=200, seed=0)
    stopped = on_first_batch(gui.controller, stop, monkeypatch)
    result = send(qtbot, gui, text)
    assert stopped
    return result


def test_stop_keeps_the_partial_answer(qtbot, app, monkeypatch):
    w = app.window
    result = send_and_stop(qtbot, app, "hello world the quick brown fox", w.composer.stop_button.click, monkeypatch)
    assert result.finish_reasons == ["cancelled"]
    assert 0 < result.metrics.new_tokens_total < 200
    m = app.store.thread(w.flow.chat_id)[-1]
    assert m.status == "stopped"
    assert m.content == result.texts[0] != ""
    shown = w.chat_view.messages()[-1]
    assert shown.body.text == result.texts[0]
    assert "stopped" in shown.stats_label.text()
    # its compare row (and the table's exports) say it was cut short: its figures are of the part that ran
    assert w.hud.compare.model.rows[-1].label.endswith(" (stopped by you)")


def test_an_answer_s_notice_goes_with_its_chat(qtbot, app):
    """ "removed 1 NUL character from the prompt" stayed in the status line of a new chat."""
    w = app.window
    result = send(qtbot, app, "hello\x00 world")
    assert result.notices and w.status.text() == " · ".join(result.notices)
    w.flow.new_chat()
    assert w.status.text() == ""


def test_escape_stops_an_answer(qtbot, app, monkeypatch):
    def escape():  # from wherever the focus is in the window
        qtbot.keyClick(app.window.composer.edit, Qt.Key.Key_Escape)

    result = send_and_stop(qtbot, app, "def main", escape, monkeypatch)
    assert result.finish_reasons == ["cancelled"]


def test_edit_and_resend_makes_a_branch_and_both_are_reachable(qtbot, app):
    w, store = app.window, app.store
    first = send(qtbot, app, "hello world")
    user_widget = w.chat_view.messages()[0]
    user_widget.start_edit()
    user_widget.editor_text.setPlainText("the quick brown fox")
    with qtbot.waitSignal(app.controller.generationFinished, timeout=TIMEOUT_MS) as blocker:
        [b for b in user_widget.findChildren(QPushButton) if b.text() == "Send"][0].click()
    qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
    second = blocker.args[1]

    chat_id = w.flow.chat_id
    roots = store.siblings(store.thread(chat_id)[0].id)
    assert [m.content for m in roots] == ["hello world", "the quick brown fox"]
    shown = w.chat_view.messages()
    assert [m.body.text for m in shown] == ["the quick brown fox", second.texts[0]]
    assert shown[0].branch_label.text() == "2/2" and shown[0].branch_label.isVisibleTo(w)

    shown[0].prev_button.click()  # back to the first branch: its own answer comes with it
    shown = w.chat_view.messages()
    assert [m.body.text for m in shown] == ["hello world", first.texts[0]]
    assert shown[0].branch_label.text() == "1/2"
    shown[0].next_button.click()
    assert [m.body.text for m in w.chat_view.messages()] == ["the quick brown fox", second.texts[0]]


def test_regenerate_keeps_the_old_answer_as_a_sibling(qtbot, app):
    w, store = app.window, app.store
    w.flow.default_sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=None)
    send(qtbot, app, "hello")
    old = w.chat_view.messages()[1].item.id
    with qtbot.waitSignal(app.controller.generationFinished, timeout=TIMEOUT_MS):
        w.chat_view.messages()[1].regen_button.click()
    qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
    new = w.chat_view.messages()[1].item
    assert new.id != old
    assert [m.id for m in store.siblings(new.id)] == [old, new.id]
    assert w.chat_view.messages()[1].branch_label.text() == "2/2"


def test_regenerate_and_a_branch_switch_rebuild_only_the_end_of_the_chat(qtbot, app):
    """The messages before the one that changes keep their widgets (a 300-turn chat took seconds to regenerate when
    every widget was built again); what is shown equals the stored branch."""
    w, store = app.window, app.store
    w.flow.default_sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=None)
    for text in ("one", "two", "three"):
        send(qtbot, app, text)
    before = w.chat_view.messages()
    with qtbot.waitSignal(app.controller.generationFinished, timeout=TIMEOUT_MS):
        before[-1].regen_button.click()
    qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
    after = w.chat_view.messages()
    assert after[:5] == before[:5] and after[5] is not before[5]  # the two turns and the question stay
    shown = lambda: [(m.item.id, m.body.text) for m in w.chat_view.messages()]  # noqa: E731
    assert shown() == [(m.id, m.content) for m in store.thread(w.flow.chat_id)]
    after[5].prev_button.click()  # back to the first answer: only it changes
    assert w.chat_view.messages()[:5] == before[:5] and w.chat_view.messages()[5].branch_label.text() == "1/2"
    assert shown() == [(m.id, m.content) for m in store.thread(w.flow.chat_id)]


def test_an_option_change_is_recorded_on_the_next_answer(qtbot, app):
    w, store = app.window, app.store
    send(qtbot, app, "hello")
    t = w.toggles
    with qtbot.waitSignal(app.controller.reconfigured, timeout=TIMEOUT_MS):
        t.kv_cache.setCurrentIndex(t.kv_cache.findData("dynamic"))
        t.kv_cache.activated.emit(t.kv_cache.currentIndex())
    with qtbot.waitSignal(app.controller.reconfigured, timeout=TIMEOUT_MS):
        t.sampling.setCurrentIndex(t.sampling.findData("host"))
        t.sampling.activated.emit(t.sampling.currentIndex())
    assert app.settings.engine_options["kv_cache"] == "dynamic"
    send(qtbot, app, "world")

    answers = [m for m in store.thread(w.flow.chat_id) if m.role == "assistant"]
    assert [(a.options["kv_cache"], a.options["sampling"]) for a in answers] == [
        ("static", "device"),
        ("dynamic", "host"),
    ]
    assert "dynamic KV" in w.chat_view.messages()[-1].stats_label.toolTip()


def test_unavailable_option_is_turned_off_with_its_reason(qtbot, app):
    t = app.window.toggles
    with qtbot.waitSignal(app.controller.reconfigured, timeout=TIMEOUT_MS):
        t.cuda_graph.setChecked(True)  # this machine has no CUDA
    qtbot.waitUntil(lambda: not t.cuda_graph.isChecked(), timeout=TIMEOUT_MS)
    assert not t.cuda_graph.isEnabled()
    assert "CUDA" in t.cuda_graph.toolTip() and t.cuda_graph.toolTip().startswith("Unavailable:")


def test_candidates_stream_as_tabs_and_the_chosen_one_continues(qtbot, app, monkeypatch):
    w, store = app.window, app.store
    w.flow.default_sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    t = w.toggles
    with qtbot.waitSignal(app.controller.reconfigured, timeout=TIMEOUT_MS):
        t.candidates.setValue(3)
    result = send(qtbot, app, "hello")
    tabs = w.chat_view.candidate_tabs()
    assert tabs is not None and tabs.tabs.count() == 3
    assert [b.text for b in tabs.bodies] == result.texts
    assert all(b.isEnabled() for b in tabs.use_buttons)
    counted = []  # the context meter counts from the tab on screen, which a reply continues from
    original = w.flow.draft_messages
    monkeypatch.setattr(w.flow, "draft_messages", lambda draft, shown=None: counted.append(shown) or [])
    tabs.tabs.setCurrentIndex(1)
    qtbot.waitUntil(lambda: bool(counted), timeout=TIMEOUT_MS)
    assert counted[-1] == 1
    monkeypatch.setattr(w.flow, "draft_messages", original)

    tabs.use_buttons[2].click()
    thread = store.thread(w.flow.chat_id)
    assert thread[-1].content == result.texts[2] and thread[-1].candidate_index == 2
    siblings = store.siblings(thread[-1].id)
    assert [s.candidate_index for s in siblings] == [0, 1, 2]
    assert len({s.candidate_group for s in siblings}) == 1
    last = w.chat_view.messages()[-1]
    assert last.body.text == result.texts[2] and last.branch_label.text() == "3/3"


def test_an_edit_open_above_the_candidates_keeps_its_text_when_one_is_picked(qtbot, app):
    """Picking a candidate (or replying) built the whole chat again: an edit being typed in an earlier message
    was gone."""
    w = app.window
    send(qtbot, app, "first question")
    with qtbot.waitSignal(app.controller.reconfigured, timeout=TIMEOUT_MS):
        w.toggles.candidates.setValue(2)
    w.flow.default_sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)
    send(qtbot, app, "second question")
    first = w.chat_view.messages()[0]
    first.start_edit()
    first.editor_text.setPlainText("a careful rewrite of my first question")
    w.chat_view.candidate_tabs().use_buttons[1].click()
    assert w.chat_view.candidate_tabs() is None and w.chat_view.messages()[0] is first
    assert first.editor_text.toPlainText() == "a careful rewrite of my first question"
    assert w.chat_view.messages()[-1].item.candidate == 1


def test_the_pick_notice_goes_with_the_candidates(qtbot, app):
    w = app.window
    w.flow.default_sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=5)
    with qtbot.waitSignal(app.controller.reconfigured, timeout=TIMEOUT_MS):
        w.toggles.candidates.setValue(2)
    send(qtbot, app, "pick")
    assert w.flow.awaiting_choice() and "pick one" in w.status.text()
    w.flow.delete_message(w.chat_view.messages()[0].item.id)  # the question, and the candidates with it
    assert not w.flow.awaiting_choice() and "pick one" not in w.status.text()


def test_replying_without_a_choice_continues_from_the_candidate_on_screen(qtbot, app):
    w, store = app.window, app.store
    w.flow.default_sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    with qtbot.waitSignal(app.controller.reconfigured, timeout=TIMEOUT_MS):
        w.toggles.candidates.setValue(3)
    result = send(qtbot, app, "hello")
    w.chat_view.candidate_tabs().tabs.setCurrentIndex(2)
    with qtbot.waitSignal(app.controller.reconfigured, timeout=TIMEOUT_MS):
        w.toggles.candidates.setValue(1)
    send(qtbot, app, "and then?")
    thread = store.thread(w.flow.chat_id)
    assert [m.role for m in thread] == ["user", "assistant", "user", "assistant"]
    assert thread[1].content == result.texts[2] and thread[1].candidate_index == 2


def test_a_failed_load_leaves_the_app_usable(qtbot, app, tmp_path):
    w = app.window
    loaded = app.controller.info.name
    empty = tmp_path / "no-weights"
    empty.mkdir()
    with qtbot.waitSignal(app.controller.loadFailed, timeout=TIMEOUT_MS) as blocker:
        w.load_model(str(empty))
    message = blocker.args[1]
    assert message
    assert w.model_panel.error.isVisibleTo(w) and message in w.model_panel.error.text()
    assert app.controller.info.name == loaded
    assert w.model_panel.values["name"].text() == loaded
    assert w.composer.send_button.isEnabled()
    result = send(qtbot, app, "still here")
    assert app.store.thread(w.flow.chat_id)[-1].content == result.texts[0]


def test_chat_list_rename_search_delete(qtbot, app):
    w, store = app.window, app.store
    send(qtbot, app, "hello world")
    first = w.flow.chat_id
    w.new_chat()
    assert w.chat_view.messages() == []
    send(qtbot, app, "Paris question")
    second = w.flow.chat_id
    assert w.chat_list.chat_ids() == [second, first]

    w.chat_list.renameRequested.emit(first, "Greetings")
    assert store.get_chat(first).title == "Greetings"
    with qtbot.waitSignal(w.chatsFound, timeout=5000):  # the search runs off the GUI thread
        w.chat_list.search.setText("greet")
    assert w.chat_list.chat_ids() == [first]
    w.chat_list.renameRequested.emit(second, "Capitals")  # the open chat, hidden by the search: its title shows
    assert w.chat_title.text() == "Capitals"
    with qtbot.waitSignal(w.chat_list.searchChanged, timeout=5000):
        w.chat_list.search.setText("")
    w.chat_list.deleteRequested.emit(second)
    assert [c.id for c in store.list_chats()] == [first]
    assert w.flow.chat_id is None and w.chat_view.messages() == []


def test_deleting_a_message_counts_what_goes_on_other_branches_too(qtbot, app):
    from dialog_driver import DialogDriver

    w, store = app.window, app.store
    send(qtbot, app, "one")
    send(qtbot, app, "two")
    edit_and_send(qtbot, app, 2, "two edited")
    driver = DialogDriver().click("Cancel").start()
    w.chat_view.messages()[1].delete_button.click()  # the first answer: both versions of "two" hang below it
    assert driver.done and driver.answered[0].text == (
        "Delete this message and the 2 after it, with 2 more in other versions below it? This cannot be undone."
    )
    assert store.subtree_size(w.chat_view.messages()[1].item.id) == 5


def test_delete_message_removes_it_and_what_follows(qtbot, app):
    w, store = app.window, app.store
    send(qtbot, app, "one")
    send(qtbot, app, "two")
    assert len(w.chat_view.messages()) == 4
    from dialog_driver import DialogDriver

    driver = DialogDriver().click("Cancel").start()  # asked first: Cancel keeps it
    w.chat_view.messages()[2].delete_button.click()
    assert driver.done and driver.answered[0].text == "Delete this message and the 1 after it? This cannot be undone."
    assert len(w.chat_view.messages()) == 4 and len(store.thread(w.flow.chat_id)) == 4
    driver = DialogDriver().click("Delete").start()
    w.chat_view.messages()[2].delete_button.click()
    assert driver.done
    assert [m.content for m in store.thread(w.flow.chat_id)][:1] == ["one"]
    assert len(w.chat_view.messages()) == 2


def test_a_chat_made_by_its_settings_is_named_by_its_first_message(qtbot, app):
    w = app.window
    w.new_chat()
    w.flow.set_chat_settings("Be brief.", w.flow.sampling())
    assert w.chat_title.text() == "New chat"
    send(qtbot, app, "What is the capital of France")
    assert w.chat_title.text() == "What is the capital of France"
    assert app.store.get_chat(w.flow.chat_id).title == "What is the capital of France"


def test_the_edit_box_sends_with_ctrl_enter_and_gives_up_with_esc(qtbot, app):
    w = app.window
    send(qtbot, app, "hello")
    question = w.chat_view.messages()[0]
    question.start_edit()
    qtbot.keyClick(question.editor_text, Qt.Key.Key_Escape)
    assert question._editor is None and question.body.isVisible() and not w.flow.generating
    question.start_edit()
    question.editor_text.setPlainText("hello again")
    qtbot.keyClick(question.editor_text, Qt.Key.Key_Return)  # a new line, not a send
    typed = question.editor_text.toPlainText()
    assert not w.flow.generating and typed.count("\n") == 1
    with qtbot.waitSignal(app.controller.generationFinished, timeout=TIMEOUT_MS):
        qtbot.keyClick(question.editor_text, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
    assert app.store.thread(w.flow.chat_id)[0].content == typed  # the new version, as typed (as the composer sends)


def test_the_keyboard_focus_stays_where_the_user_types(qtbot, app):
    """Send hid itself holding the focus, which Qt passed down the chain to "Chat settings…": the next message's
    first space opened that dialog. Tab typed tab characters instead of moving on, and a cancelled edit left no
    widget with the focus."""
    from PySide6.QtWidgets import QApplication

    w = app.window
    w.activateWindow()
    qtbot.waitUntil(w.isActiveWindow, timeout=TIMEOUT_MS)
    assert QApplication.focusWidget() is w.composer.edit  # where the user starts typing
    w.composer.set_text("hello")
    qtbot.keyClick(w.composer.edit, Qt.Key.Key_Tab)  # Tab moves on to Send...
    assert w.composer.text() == "hello" and QApplication.focusWidget() is w.composer.send_button
    with qtbot.waitSignal(app.controller.generationFinished, timeout=TIMEOUT_MS):
        qtbot.keyClick(w.composer.send_button, Qt.Key.Key_Space)  # ...and Space sends
    qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
    assert QApplication.focusWidget() is w.composer.edit
    w.composer.set_text("again")
    with qtbot.waitSignal(app.controller.generationFinished, timeout=TIMEOUT_MS):
        qtbot.mouseClick(w.composer.send_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
    qtbot.keyClicks(QApplication.focusWidget(), "next question")
    assert w.composer.text() == "next question" and QApplication.activeModalWidget() is None
    question = w.chat_view.messages()[0]
    question.start_edit()
    qtbot.keyClick(question.editor_text, Qt.Key.Key_Escape)
    assert QApplication.focusWidget() in (question.edit_button, question.more_button)
    names = {name: w.toggles.controls[name].accessibleName() for name in ("device", "candidates", "draft_tokens")}
    assert names == {"device": "Device", "candidates": "Candidates", "draft_tokens": "Drafts"}
    assert question.more_button.accessibleName() == "More actions"


def test_tab_reads_the_window_in_order_and_skips_what_takes_no_keys(qtbot, app):
    """Qt's Tab order is the order widgets were made: every message came after the panels and the HUD (made
    as the chat grows), a long chat's earlier messages after its later ones, and the six plots and the two docks'
    scroll areas were stops where a key does nothing."""
    from PySide6.QtWidgets import QApplication
    from test_long_chat_view import chat

    from ui.hud.series_view import MeteredPlotWidget
    from ui.main_window import FitScrollArea

    w = app.window
    send(qtbot, app, "hello")
    w.activateWindow()
    qtbot.waitUntil(w.isActiveWindow, timeout=TIMEOUT_MS)
    question, answer = (m.body._widgets[0] for m in w.chat_view.messages())
    qtbot.waitUntil(answer.isVisible, timeout=TIMEOUT_MS)  # a widget laid out at the answer's end shows queued
    w.composer.edit.setFocus()
    qtbot.keyClick(w.composer.edit, Qt.Key.Key_Backtab)  # Shift+Tab from the composer: the answer above it
    assert w.chat_view.messages()[-1].isAncestorOf(QApplication.focusWidget())
    stops = w.tab_stops()
    while QApplication.focusWidget() is not question:  # up through the answer's actions to the question
        at = stops.index(QApplication.focusWidget())
        qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_Backtab)
        assert QApplication.focusWidget() is stops[at - 1] and w.chat_view.isAncestorOf(stops[at - 1])
    assert stops.index(w.chat_list.search) < stops.index(w.chat_settings_button) < stops.index(w.chat_view)
    assert stops.index(w.chat_view) < stops.index(question) < stops.index(answer) < stops.index(w.composer.edit)
    assert stops.index(w.composer.send_button) + 1 == stops.index(w.model_panel.open_file_button)
    assert not [s for s in stops if isinstance(s, (FitScrollArea, MeteredPlotWidget))]
    w.chat_view.set_messages(chat(60))
    w.chat_view.show_earlier(20)  # built after the last forty, shown above them
    QApplication.processEvents()
    read = [m for s in w.tab_stops() for m in w.chat_view.messages() if m.isAncestorOf(s)]
    assert [m.item.id for m in dict.fromkeys(read)] == list(range(60))


def test_another_chat_opened_while_an_answer_runs_says_where_it_runs(qtbot, tmp_path, tiny_llama, monkeypatch):
    """Enter in a new chat during an answer did nothing and said nothing ("Enter to send" still), and Stop, shown
    there, stopped an answer that was not on screen."""
    from worker_gate import hold_after_first_batch

    gui = open_app(qtbot, tmp_path / "data", tiny_llama)
    try:
        w = gui.window
        w.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=60, seed=0)
        release = hold_after_first_batch(monkeypatch)
        assert not w.stop_action.isEnabled()  # nothing to stop
        w.composer.set_text("Tell me about owls")
        with qtbot.waitSignal(gui.controller.textBatch, timeout=TIMEOUT_MS):
            qtbot.keyClick(w.composer.edit, Qt.Key.Key_Return)
        w.new_chat()
        assert w.stop_action.isEnabled()
        assert w.composer.hint.text().startswith("Answering in “Tell me about owls”: Esc stops it")
        assert w.composer.stop_button.toolTip() == "Stop the answer in “Tell me about owls”"
        w.flow.rename_chat(w.flow.answering_chat(), "Owls")  # renamed from the list: the composer follows
        assert w.composer.hint.text().startswith("Answering in “Owls”: Esc stops it")
        assert w.composer.stop_button.toolTip() == "Stop the answer in “Owls”"
        w.flow.open_chat(w.flow.answering_chat())  # back in the chat it runs in: the keys again
        assert "to send" in w.composer.hint.text()
        release.set()
        qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
        assert "to send" in w.composer.hint.text() and not w.stop_action.isEnabled()
    finally:
        close_app(gui)


def test_a_chat_deleted_elsewhere_while_an_answer_streams_into_it(qtbot, tmp_path, tiny_llama, monkeypatch):
    """Another window on the same data folder deleted the chat mid-answer: every save failed, a traceback ended
    the answer, the view stayed on "generating…" and the next send failed with "no chat with id 1"."""
    from worker_gate import hold_after_first_batch

    from app.store import ChatStore

    gui = open_app(qtbot, tmp_path / "data", tiny_llama)
    try:
        w = gui.window
        w.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=60, seed=0)
        release = hold_after_first_batch(monkeypatch)
        told: list[str] = []
        w.flow.failed.connect(told.append)
        deleted: list[int] = []

        def other_window_deletes(_rid, _batch):
            if not deleted:
                other = ChatStore(gui.paths.database)
                deleted.append(other.list_chats()[0].id)
                other.delete_chat(deleted[0])
                other.close()
                release.set()

        gui.controller.textBatch.connect(other_window_deletes)
        w.composer.set_text("tell me a story")
        qtbot.keyClick(w.composer.edit, Qt.Key.Key_Return)
        qtbot.waitUntil(lambda: bool(deleted) and not w.flow.generating, timeout=TIMEOUT_MS)
        assert told == [
            "This chat was deleted elsewhere (another Gapless window or the command line); a new chat is open"
        ]
        assert w.flow.chat_id is None and w.chat_view._stream is None and w.chat_list.chat_ids() == []
        send(qtbot, gui, "next question")  # and the app answers again
        assert [m.role for m in gui.store.thread(w.flow.chat_id)] == ["user", "assistant"]
    finally:
        close_app(gui)


def test_clicks_on_a_chat_deleted_elsewhere_say_so(qtbot, app):
    """Regenerate, Edit, the branch arrows and Chat settings on a chat another window deleted raised an uncaught
    StoreError each, and the user was told nothing."""
    from app.store import ChatStore

    w = app.window
    send(qtbot, app, "hello")
    question, answer = [m.item for m in w.chat_view.messages()]
    gone = w.flow.chat_id
    other = ChatStore(app.paths.database)
    other.delete_chat(gone)
    other.close()
    told: list[str] = []
    w.flow.failed.connect(told.append)
    w.chat_view.regenerateRequested.emit(answer.id)  # (an uncaught error in a slot fails the test)
    assert told == ["This chat was deleted elsewhere (another Gapless window or the command line); a new chat is open"]
    assert w.flow.chat_id is None and not w.flow.generating
    for click in (
        lambda: w.chat_view.editSubmitted.emit(question.id, "hello again"),
        lambda: w.chat_view.siblingRequested.emit(answer.id, 1),
    ):
        told.clear()
        click()
        assert told and "deleted elsewhere" in told[0] and not w.flow.generating
    send(qtbot, app, "a chat of its own")  # renaming the gone one from the list says so, and leaves this one be
    shown = w.flow.chat_id
    told.clear()
    w.flow.rename_chat(shown + 100, "renamed")  # an id no chat has (SQLite gives a deleted last id out again)
    assert told == ["That chat or its message was deleted elsewhere (another Gapless window or the command line)"]
    assert w.flow.chat_id == shown and len(w.chat_view.messages()) == 2


def test_the_ladder_cannot_start_while_another_model_loads(qtbot, app, tmp_path):
    """Run ladder clicked during a load ran on the new model and credited every row, saved, to the old one."""
    from tiny_models import make_tiny_model

    w, ladder = app.window, app.window.hud.ladder
    other = make_tiny_model(tmp_path / "other-model", "qwen2")
    assert ladder.run_button.isEnabled()
    with qtbot.waitSignal(app.controller.loaded, timeout=TIMEOUT_MS):
        w.load_model(str(other))
        assert not ladder.run_button.isEnabled() and ladder.run_button.toolTip().startswith("Loading ")
    qtbot.waitUntil(ladder.run_button.isEnabled, timeout=TIMEOUT_MS)


def test_a_second_model_opened_during_a_load_leaves_the_first_as_the_last_model(qtbot, tmp_path, tiny_llama):
    """The first model to finish loading was saved under the second one's name: when the second then failed,
    the next start opened it again, failed, and had no model."""
    from app.registry import RecentModels, source_key
    from app.settings import SettingsStore

    broken = tmp_path / "not-a-model"
    broken.mkdir()
    gui = open_app(qtbot, tmp_path / "data")
    w, c = gui.window, gui.controller
    failed: list[str] = []
    c.loadFailed.connect(lambda source, _message: failed.append(source))
    c.loadStarted.connect(lambda source: source == str(tiny_llama) and w.load_model(str(broken)))
    try:
        w.load_model(str(tiny_llama))
        qtbot.waitUntil(lambda: bool(failed), timeout=TIMEOUT_MS)
        assert failed == [str(broken)] and c.info.name == tiny_llama.name and w._loading is None
    finally:
        close_app(gui)
    settings, _ = SettingsStore(gui.paths.settings_file).load()
    assert settings.last_model == source_key(str(tiny_llama))
    assert [e.source for e in RecentModels(gui.paths.config).entries()] == [source_key(str(tiny_llama))]


def test_the_model_panel_says_loading_until_the_last_model_asked_for_is_in(qtbot, tmp_path, tiny_llama, tiny_factory):
    """A model opened while another loaded: the first one in set the panel to Ready, its buttons on and its progress
    bar gone, while the second was still loading."""
    other = tiny_factory("qwen2")
    gui = open_app(qtbot, tmp_path / "data")
    w, panel = gui.window, gui.window.model_panel
    seen: list[tuple[str, bool, bool]] = []
    gui.controller.loaded.connect(
        lambda info, _u: seen.append(
            (panel.status.text(), panel.open_file_button.isEnabled(), panel.progress.isVisible())
        )
    )
    try:
        w.load_model(str(tiny_llama))
        w.load_model(str(other))
        qtbot.waitUntil(lambda: len(seen) == 2, timeout=TIMEOUT_MS)
        assert seen[0] == (f"Loading {other.name}…", False, True)
        assert seen[1] == ("Ready", True, False)
    finally:
        close_app(gui)


def test_a_failed_load_with_another_asked_for_after_it_stays_said_in_the_panel(qtbot, app, tmp_path, tiny_factory):
    """Two models asked for in a row, the first failing: the panel showed only the second's progress, the first's
    failure hidden as the second began (only a message box had said it)."""
    other = tiny_factory("qwen2")
    empty = tmp_path / "no-weights"
    empty.mkdir()
    w, panel = app.window, app.window.model_panel
    at_failure: list[tuple[str, str, bool]] = []
    app.controller.loadFailed.connect(
        lambda _s, _m: at_failure.append((panel.error.text(), panel.status.text(), panel.progress.isVisible()))
    )
    with qtbot.waitSignal(app.controller.loaded, timeout=TIMEOUT_MS):
        w.load_model(str(empty))
        w.load_model(str(other))
    ((error, status, progress),) = at_failure
    assert error.startswith(f"Could not load {empty.name}: ") and panel.error.isVisibleTo(w)
    assert status == f"Loading {other.name}…" and progress  # the second's progress goes on
    assert panel.error.text() == error and panel.error.isVisibleTo(w)  # still said once the second is in
    assert panel.status.text() == "Ready" and panel.values["name"].text() == app.controller.info.name
    send(qtbot, app, "hello")  # once the model in use has answered, the failure no longer holds
    assert not panel.error.isVisibleTo(w)
    w.load_model(str(empty))  # asked for anew: only this failure is said
    qtbot.waitUntil(lambda: w._loading is None, timeout=TIMEOUT_MS)
    assert panel.error.text() == error


def test_a_long_chat_title_ends_in_an_ellipsis_and_is_whole_in_its_tooltip(qtbot, tmp_path):
    """A chat renamed (or imported) with a title longer than the header was cut off mid-word, with nothing saying
    there was more, nor anywhere to read the rest."""
    gui = open_app(qtbot, tmp_path / "data")
    w = gui.window
    try:
        title = "Планирование путешествия по Японии и Корее весной: 東京、ソウル、釜山 " * 3
        chat = gui.store.create_chat(title.strip())
        w.resize(1200, 800)
        w.flow.open_chat(chat.id)
        qtbot.waitUntil(lambda: w.chat_title.text() == title.strip())
        assert w.chat_title.toolTip() == title.strip()
        shown = w.chat_title.shown_text()
        assert shown.endswith("…") and title.startswith(shown[:-1])
        header = w._header.contentsRect()
        assert header.contains(w.chat_settings_button.geometry())  # the button beside it is whole
        w.flow.rename_chat(chat.id, "Короткое")
        assert w.chat_title.shown_text() == "Короткое" == w.chat_title.toolTip()
    finally:
        close_app(gui)


def test_ok_in_chat_settings_moves_the_chat_to_the_top_of_the_list(qtbot, tmp_path):
    """The store counts the chat as changed (the list is newest first): the list kept it where it was, with the age
    it had, until another chat changed. OK with nothing changed leaves it where it is (it came first)."""
    gui = open_app(qtbot, tmp_path / "data")
    w = gui.window
    try:
        older = gui.store.create_chat("older")
        newer = gui.store.create_chat("newer")
        w.refresh_chats()
        w.flow.open_chat(older.id)
        assert w.chat_list.chat_ids() == [newer.id, older.id]
        w.open_chat_settings()
        w._chat_settings_dialog.system_prompt.setPlainText("Answer briefly.")
        w._chat_settings_dialog.accept()
        assert [c[0] for c in gui.store.chat_titles()] == [older.id, newer.id]
        assert w.chat_list.chat_ids() == [older.id, newer.id] and w.chat_list.current_id() == older.id
        gui.store.rename_chat(newer.id, "newer, touched")
        w.refresh_chats()
        w.open_chat_settings()
        w._chat_settings_dialog.accept()  # nothing changed: the chat stays where it is (it came first)
        assert [c[0] for c in gui.store.chat_titles()] == [newer.id, older.id]
        assert w.chat_list.chat_ids() == [newer.id, older.id] and w.chat_list.current_id() == older.id
    finally:
        close_app(gui)


def test_chat_settings_apply_to_the_next_answer(qtbot, app):
    w, store = app.window, app.store
    send(qtbot, app, "hello")
    w.open_chat_settings()
    dialog = w._chat_settings_dialog
    dialog.system_prompt.setPlainText("Answer briefly.")
    dialog.max_new_tokens.setValue(5)
    dialog.temperature.setValue(0.0)
    dialog.accept()
    chat = store.get_chat(w.flow.chat_id)
    assert chat.system_prompt == "Answer briefly."
    assert chat.sampling["max_new_tokens"] == 5
    result = send(qtbot, app, "again")
    assert result.metrics.new_tokens_total <= 5
    assert w.flow.prompt_messages(store.thread(w.flow.chat_id)[-2])[0] == {
        "role": "system",
        "content": "Answer briefly.",
    }


def test_a_loaded_model_is_offered_again(qtbot, app, tiny_llama, data_dir):
    from app.registry import RecentModels

    paths = AppPaths.resolve(data_dir)
    assert [e.path for e in RecentModels(paths.config).entries()] == [str(tiny_llama.resolve())]
    labels = [a.text() for a in app.window.model_panel.recent_button.menu().actions()]
    assert labels[0].startswith("Default model: ")
    assert app.controller.info.name in labels
    assert app.settings.last_model == str(tiny_llama)


def test_a_recent_model_can_be_removed_from_the_list_and_the_list_cleared(
    qtbot, app, tiny_llama, tiny_factory, data_dir
):
    """A recent model whose file was deleted (its entry greyed out) or that is not wanted any more stayed on the
    Models menu for good: nothing in the window took it off."""
    from app.registry import RecentModels

    other = tiny_factory("qwen2")
    w, panel = app.window, app.window.model_panel
    with qtbot.waitSignal(app.controller.loaded, timeout=TIMEOUT_MS):
        w.load_model(str(other))
    recent = RecentModels(AppPaths.resolve(data_dir).config)
    first, second = str(tiny_llama.resolve()), str(other.resolve())
    assert [e.path for e in recent.entries()] == [second, first]

    def forget_actions():
        return [a for a in panel.forget_menu.actions() if not a.isSeparator()]

    assert panel.forget_menu.menuAction() in panel.recent_button.menu().actions()
    names = [a.text() for a in forget_actions()]
    assert names[:-1] == [e.name for e in recent.entries()] and names[-1] == "Clear Recent"
    forget_actions()[1].trigger()  # the model opened first
    assert [e.path for e in recent.entries()] == [second]  # kept in the file, for the next start
    assert [a.toolTip() for a in panel.recent_button.menu().actions() if a.toolTip() in (first, second)] == [second]
    assert len(forget_actions()) == 2
    assert app.controller.info is not None  # the model open stays open
    forget_actions()[-1].trigger()  # Clear Recent
    assert recent.entries() == []
    assert panel.forget_menu.menuAction() not in panel.recent_button.menu().actions()  # nothing left to remove
    assert [a.text() for a in panel.recent_button.menu().actions()][0].startswith("Default model: ")


def test_deleting_the_chat_that_is_answering_stops_quietly(qtbot, app, monkeypatch):
    w, c = app.window, app.controller
    w.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=200, seed=0)
    errors = []
    w.flow.failed.connect(errors.append)
    deleted = on_first_batch(c, lambda: w.flow.delete_chat(w.flow.chat_id), monkeypatch)
    result = send(qtbot, app, "hello world")
    assert deleted and result.finish_reasons == ["cancelled"]
    assert errors == []
    assert app.store.list_chats() == [] and app.store.count_messages() == 0
    assert w.chat_view.messages() == []


def test_a_delete_the_store_refuses_leaves_the_answer_going_and_kept(qtbot, app, monkeypatch):
    """Delete of the chat being answered, refused by the store (another window holds the database): the answer
    was thrown away first, so its text was never saved and its bubble said "generating…" for good; the chat
    stays, and so does its answer, whole."""
    from app.store import StoreError

    w, c = app.window, app.controller
    w.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=12, seed=0)
    errors = []
    w.flow.failed.connect(errors.append)

    def refused(chat_id):
        raise StoreError("cannot delete the chat in the chat database: database is locked")

    def delete_refused() -> None:
        with monkeypatch.context() as m:
            m.setattr(app.store, "delete_chat", refused)
            w.flow.delete_chat(w.flow.chat_id)

    deleted = on_first_batch(c, delete_refused, monkeypatch)
    result = send(qtbot, app, "hello world")
    assert deleted and result.finish_reasons != ["cancelled"]
    assert errors == ["cannot delete the chat in the chat database: database is locked"]
    stored = app.store.thread(w.flow.chat_id)
    assert [(m.role, m.status, m.content) for m in stored] == [
        ("user", "done", "hello world"),
        ("assistant", "done", result.texts[0]),
    ]
    shown = w.chat_view.messages()[-1]
    assert (shown.item.role, shown.item.content) == ("assistant", result.texts[0])
    assert w.chat_view._stream is None and "generating" not in shown.stats_label.text()


def test_a_precision_change_shows_its_progress_and_applies_next(qtbot, app):
    w, t = app.window, app.window.toggles
    seen = []
    app.controller.progress.connect(lambda p: seen.append((p.message, t.note.text(), t.progress.isVisibleTo(w))))
    with qtbot.waitSignal(app.controller.reconfigured, timeout=TIMEOUT_MS):
        t.dtype.setCurrentIndex(t.dtype.findData("bf16"))
        t.dtype.activated.emit(t.dtype.currentIndex())
    assert seen, "re-placing the weights reports progress"
    assert all(note == message and visible for message, note, visible in seen)
    assert t.note.text() == "Ready: the next answer uses these options."
    result = send(qtbot, app, "hello")
    assert result.options.dtype == "bf16"
    assert app.store.thread(w.flow.chat_id)[-1].options["dtype"] == "bf16"


def test_window_settings_persist(qtbot, data_dir):
    gui = open_app(qtbot, data_dir)
    gui.window.set_send_with("ctrl+enter")
    gui.window.set_theme("dark")
    close_app(gui)
    gui = open_app(qtbot, data_dir, theme=None)  # no --theme: the saved choice
    try:
        assert gui.window.composer.edit.send_with == "ctrl+enter"
        assert gui.theme.scheme == "dark"
        assert gui.settings.window_state is not None
    finally:
        close_app(gui)


def test_the_width_the_user_gave_the_panels_is_theirs_at_the_next_start(qtbot, data_dir):
    """The panels' share of the window's width was never saved: each start gave them the default again."""
    gui = open_app(qtbot, data_dir)
    w = gui.window
    w.resize(1300, 850)
    qtbot.waitUntil(lambda: w.options_dock.width() == round(DOCK_SHARE * 1300), timeout=TIMEOUT_MS)
    w.resizeDocks([w.options_dock], [300], Qt.Orientation.Horizontal)  # as a drag of the panels' edge
    qtbot.waitUntil(lambda: w.options_dock.width() == 300, timeout=TIMEOUT_MS)
    close_app(gui)
    gui = open_app(qtbot, data_dir)
    try:
        w = gui.window
        w.resize(1300, 850)
        qtbot.waitUntil(lambda: abs(w.options_dock.width() - 300) <= 1, timeout=TIMEOUT_MS)
        w.resize(2600, 850)  # and they keep their share of a wider window
        qtbot.waitUntil(lambda: abs(w.options_dock.width() - 600) <= 2, timeout=TIMEOUT_MS)
    finally:
        close_app(gui)


def _choose(qtbot, w, combo, value) -> None:
    """An entry picked from a dropdown of the Optimizations panel, and the engine's reply waited for."""
    i = combo.findData(value)
    combo.setCurrentIndex(i)
    combo.activated.emit(i)
    qtbot.waitUntil(lambda: w._requested is None, timeout=TIMEOUT_MS)


def test_options_the_engine_refused_are_neither_shown_nor_kept(qtbot, tmp_path, tiny_llama, monkeypatch):
    """A precision the engine could not switch to (out of memory, say) stayed shown in the panel, was sent again
    with every later change (each refused in turn), and was saved: the next start opened with it."""
    from engine.engine import Engine

    data = tmp_path / "data"
    gui = open_app(qtbot, data, tiny_llama)
    real = Engine._build_model

    def no_room(self, progress):
        if self.dtype != "fp32":
            raise RuntimeError("out of memory")
        return real(self, progress)

    monkeypatch.setattr(Engine, "_build_model", no_room)
    try:
        w = gui.window
        with qtbot.waitSignal(gui.controller.reconfigureFailed, timeout=TIMEOUT_MS):
            _choose(qtbot, w, w.toggles.dtype, "bf16")
        assert w.toggles.dtype.currentData() == "auto" and w.toggles.options == gui.controller.options
        assert w.toggles.note.text().startswith("Not applied:") and "out of memory" in w.toggles.note.text()
        assert gui.settings.engine_options["dtype"] == "auto"
        with qtbot.waitSignal(gui.controller.reconfigured, timeout=TIMEOUT_MS):
            w.toggles.prefix_reuse.setChecked(not w.toggles.prefix_reuse.isChecked())  # another change applies
        assert w.toggles.note.text().startswith("Ready")
    finally:
        close_app(gui)
    assert json.loads((data / "config" / "settings.json").read_text())["engine_options"]["dtype"] == "auto"


def test_a_preset_forgets_what_the_engine_said_of_the_options_it_replaced(qtbot, app):
    """ngram refused beside several candidates stayed refused (its entry and the '+ speculation' preset
    disabled) after a preset of one candidate had removed the cause."""
    w, t = app.window, app.window.toggles
    _choose(qtbot, w, t.preset, "candidates")
    _choose(qtbot, w, t.speculation, "ngram")
    assert t.options.speculation == "off" and t.options.candidates > 1  # refused, with the reason said
    _choose(qtbot, w, t.preset, "naive")
    ngram = t.speculation.model().item(t.speculation.findData("ngram"))
    preset = t.preset.model().item(t.preset.findData("speculation"))
    assert ngram.isEnabled() and preset.isEnabled(), (ngram.toolTip(), preset.toolTip())
    _choose(qtbot, w, t.preset, "speculation")
    assert t.options.speculation == "ngram" and t.preset.currentData() == "speculation"


def test_keyboard_new_chat_and_search(qtbot, app):
    w = app.window
    send(qtbot, app, "hello")
    assert w.chat_view.messages()
    w.activateWindow()
    qtbot.keyClick(w.composer.edit, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert w.flow.chat_id is None and w.chat_view.messages() == []
    qtbot.keyClick(w.composer.edit, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    assert w.chat_list.search.hasFocus()


def test_a_failure_while_building_the_window_stops_the_engine_thread(qapp, tmp_path, monkeypatch):
    """Without this, Qt aborts the process ('QThread destroyed while still running') instead of reporting.
    (qapp: build() themes the application before it fails; the fixture sets the look back for later tests.)"""
    import app.gui as gui_mod
    import ui.main_window as mw
    from app.paths import AppPaths
    from app.worker import EngineController

    stopped = []
    real = EngineController.shutdown

    def spy(self, *a, **k):
        stopped.append(True)
        return real(self, *a, **k)

    def broken(*a, **k):
        raise RuntimeError("window construction failed")

    monkeypatch.setattr(EngineController, "shutdown", spy)
    monkeypatch.setattr(mw, "MainWindow", broken)
    gui_mod.qt_application()
    with pytest.raises(RuntimeError, match="window construction failed"):
        gui_mod.build(AppPaths.resolve(tmp_path))
    assert stopped == [True]


def test_chat_waits_while_the_ladder_runs(qtbot, app):
    w = app.window
    assert w.composer.send_button.isEnabled()
    with qtbot.waitSignal(app.controller.ladderFinished, timeout=TIMEOUT_MS):
        w.run_ladder()
        assert not w.composer.send_button.isEnabled()
        assert "ladder is running" in w.composer.hint.text()
    qtbot.waitUntil(lambda: w.composer.send_button.isEnabled(), timeout=TIMEOUT_MS)


def test_the_ladder_cannot_start_while_an_answer_runs(qtbot, app):
    """Run ladder stayed enabled while an answer streamed: the ladder queued behind it, and the composer said at
    once that the ladder was running while the answer still ran."""
    w, ladder = app.window, app.window.hud.ladder
    seen: list[tuple[bool, str]] = []
    w.flow.streamDelta.connect(lambda _d: seen or seen.append((ladder.run_button.isEnabled(), ladder.blocked)))
    w.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=8, seed=0)
    send(qtbot, app, "hello")
    assert seen == [(False, "An answer is being generated: run the ladder once it ends")]
    assert ladder.run_button.isEnabled() and ladder.blocked == ""


def test_fewer_candidates_than_asked_leave_no_empty_answers(qtbot, app, memory_for_two_candidates):
    """Out of device memory, the engine runs fewer candidates than asked: only those it made are kept and shown."""
    w, store = app.window, app.store
    w.flow.default_sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    with qtbot.waitSignal(app.controller.reconfigured, timeout=TIMEOUT_MS):
        w.toggles.candidates.setValue(4)
    result = send(qtbot, app, "hello")
    assert len(result.texts) == 2
    tabs = w.chat_view.candidate_tabs()
    assert tabs.tabs.count() == 2 and [b.text for b in tabs.bodies] == result.texts
    answers = store.siblings(store.thread(w.flow.chat_id)[-1].id)
    assert [m.content for m in answers] == result.texts and all(m.status == "done" for m in answers)


def test_one_candidate_of_several_run_is_shown_as_the_answer(qtbot, app, memory_for_one_candidate):
    """Out of device memory for any batch, the engine ran one of two candidates: the candidates' tabs stayed, one
    "generating…" for good, nothing to pick, and the answer (saved) was never shown; a follow-up hid it."""
    w, store = app.window, app.store
    w.flow.default_sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    with qtbot.waitSignal(app.controller.reconfigured, timeout=TIMEOUT_MS):
        w.toggles.candidates.setValue(2)
    result = send(qtbot, app, "hello")
    assert len(result.texts) == 1 and "ran 1" in " ".join(result.notices)
    assert w.chat_view.candidate_tabs() is None and not w.flow.awaiting_choice()
    assert "out of device memory with 2 candidates: ran 1" in w.status.text()
    shown = [(m.item.role, m.body.text) for m in w.chat_view.messages()]
    assert shown == [("user", "hello"), ("assistant", result.texts[0])]
    send(qtbot, app, "and then?")
    assert [m.item.role for m in w.chat_view.messages()] == ["user", "assistant", "user", "assistant"]
    assert [m.content for m in store.thread(w.flow.chat_id)][:3] == ["hello", result.texts[0], "and then?"]


def test_an_edit_being_typed_is_kept_while_another_chat_is_open(qtbot, app):
    """An edit open in a message was closed, its text gone, when another chat was opened (the composer's draft
    came back); an edit sent is not opened again on the message it replaced."""
    w = app.window
    w.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=4, seed=0)
    send(qtbot, app, "first chat")
    a = w.flow.chat_id
    w.new_chat()
    send(qtbot, app, "second chat")
    b = w.flow.chat_id
    w.chat_list.chatSelected.emit(a)
    w.chat_view.messages()[0].start_edit()
    w.chat_view.messages()[0].editor_text.setPlainText("a careful rewrite, not sent yet")
    w.chat_list.chatSelected.emit(b)
    assert all(m.edit_in_progress() is None for m in w.chat_view.messages())
    w.chat_list.chatSelected.emit(a)
    question = w.chat_view.messages()[0]
    assert question.edit_in_progress() == "a careful rewrite, not sent yet"
    with qtbot.waitSignal(app.controller.generationFinished, timeout=TIMEOUT_MS):
        question._edit_send.click()
    qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
    assert [m.body.text for m in w.chat_view.messages()][0] == "a careful rewrite, not sent yet"
    w.chat_view.messages()[0].siblingRequested.emit(w.chat_view.messages()[0].item.id, -1)  # the first version
    assert [m.body.text for m in w.chat_view.messages()][0] == "first chat"
    assert all(m.edit_in_progress() is None for m in w.chat_view.messages())


def test_a_reply_to_a_replaced_option_choice_does_not_undo_the_newer_one(qtbot, app):
    """Compile with the dynamic cache (unavailable), then the static cache, both sent before the first reply:
    the panel ends on the second choice, compile on and usable. (Queued back to back, the worker applies only
    the second; the first's reply, where it was applied before the second came, is played here as it would
    arrive: first.)"""
    w = app.window
    base = app.controller.options
    first = base.with_(kv_cache="dynamic", compile=True)
    second = base.with_(kv_cache="static", compile=True)
    replies = []
    app.controller.reconfigured.connect(lambda o, u: replies.append((o, u)))
    w.toggles.set_options(second)  # what the panel shows after the user's two clicks
    w._options_chosen(first)
    w._options_chosen(second)
    w._reconfigured(first, {"compile": "compile needs the static KV cache (shapes change every step otherwise)"})
    qtbot.waitUntil(lambda: any(o == second for o, _ in replies), timeout=TIMEOUT_MS)
    qtbot.wait(300)  # a panel that undid the choice would send another
    assert [o for o, _ in replies] in ([second], [first, second])
    assert w.toggles.options == second and w.toggles.compile.isChecked() and w.toggles.compile.isEnabled()
    assert app.controller.options == second and w.settings.engine_options == second.to_dict()


def test_a_reply_to_a_replaced_choice_does_not_pin_its_limits_on_the_newer_one(qtbot, app):
    """Limits follow the device in force: the reply to an earlier choice (say device cpu, whose fused kernels never
    run) must not take the fused kernels away from the newer choice still on its way; that one's reply brings
    its own limits."""
    w, c = app.window, app.controller
    earlier = c.options.with_(kernels="torch")
    newer = c.options.with_(kernels="fused")
    sent = []
    w.toggles.optionsChanged.connect(sent.append)
    w.toggles.set_options(newer)  # what the panel shows after the user's clicks
    w._requested = newer
    c.limits = {("kernels", "fused"): "the fused kernels are Triton GPU kernels and this runs on the CPU"}
    w._reconfigured(earlier, {})  # the earlier choice's reply
    assert sent == [] and w.toggles.options.kernels == "fused"
    c.limits = {}
    w._reconfigured(newer, {})  # the newer choice's own reply, with its own limits
    assert sent == [] and w.toggles.options == newer and w._requested is None


def test_an_answer_whose_draft_model_read_was_stopped_leaves_drafting_on(qtbot, app):
    """Stop pressed while an answer read its draft model: the answer's "the draft model's read was stopped" was
    pinned on the option as a refusal, so the panel turned drafting off, greyed out the Draft entry and asked the
    engine to stop drafting, where the next answer would have read the model."""
    from engine.types import DRAFT_READ_STOPPED, GenerationMetrics, GenerationResult

    w, t = app.window, app.window.toggles
    ran = t.options.with_(speculation="draft", draft_model="/models/draft.gguf", draft_tokens=4)
    t.set_options(ran)
    sent: list = []
    t.optionsChanged.connect(sent.append)
    w._generation_started(0, ran)
    why = {"speculation": DRAFT_READ_STOPPED}
    result = GenerationResult([""], [[]], ["cancelled"], GenerationMetrics(), ran.with_(speculation="off"), why, None)
    w._generation_finished(0, result)
    assert sent == [] and t.options == ran and t._why("speculation", "draft") is None


def test_an_answer_s_reasons_are_not_pinned_on_options_chosen_while_it_ran(qtbot, app):
    """The answer ran with ngram speculation and 2 candidates (refused together); meanwhile the panel went to
    speculation off and 1 candidate. The reason is not the new choice's: the panel keeps it, every entry enabled.
    Without a change in between, the refused value is marked and replaced as before."""
    from engine.types import GenerationMetrics, GenerationResult

    w, t = app.window, app.window.toggles
    ran = t.options.with_(speculation="ngram", candidates=2)
    why = {"speculation": "speculation verifies the drafts of one answer: not with several candidates"}

    def finished(options):
        result = GenerationResult([""], [[]], ["eos"], GenerationMetrics(), options, dict(why), None)
        w._generation_finished(0, result)

    w._generation_started(0, ran)
    now = t.options.with_(speculation="off", candidates=1)
    t.set_options(now)
    finished(ran.with_(speculation="off"))
    assert t.options == now and t._why("speculation", "off") is None and t._why("speculation", "ngram") is None
    t.set_options(ran)
    w._generation_started(1, ran)
    finished(ran.with_(speculation="off"))
    assert t._why("speculation", "ngram") == why["speculation"] and t.options.speculation != "ngram"


def test_chat_waits_from_the_moment_another_model_is_chosen(qtbot, app, tiny_llama):
    w = app.window
    send(qtbot, app, "hello")
    question, answer = w.chat_view.messages()
    assert w.composer.send_button.isEnabled() and answer.regen_button.isEnabled()
    with qtbot.waitSignal(app.controller.loaded, timeout=TIMEOUT_MS):
        w.load_model(str(tiny_llama))
        assert not w.composer.send_button.isEnabled()  # before the worker has even started the load
        # Edit and Regenerate ask the model too: the answer would be credited to the model being replaced
        assert not answer.regen_button.isEnabled() and not question.edit_button.isEnabled()
        assert question.delete_button.isEnabled()  # deleting needs no model
    qtbot.waitUntil(lambda: w.composer.send_button.isEnabled(), timeout=TIMEOUT_MS)
    assert answer.regen_button.isEnabled() and question.edit_button.isEnabled()


def test_a_reply_appends_to_the_conversation_without_rebuilding_it(qtbot, app):
    w = app.window
    send(qtbot, app, "hello")
    first = w.chat_view.messages()[:2]
    rebuilt = []
    w.flow.threadChanged.connect(rebuilt.append)
    result = send(qtbot, app, "and again")
    views = w.chat_view.messages()
    assert rebuilt == [] and views[:2] == first  # the earlier messages' widgets were kept
    assert [v.body.text for v in views[2:]] == ["and again", result.texts[0]]
    assert [m.content for m in app.store.thread(w.flow.chat_id)][2:] == ["and again", result.texts[0]]


def test_the_first_window_fits_the_screen(qtbot, data_dir):
    """With no saved geometry the window opens at 1440x900 where the screen has room, and within a smaller
    screen's free area (with room for the window manager's frame) where it has not: a 1366x768 laptop's, or the
    test platform's 800x800."""
    from PySide6.QtCore import QSize

    from ui.main_window import FIRST_SIZE, first_size

    assert first_size(QSize(2560, 1400)) == FIRST_SIZE == QSize(1440, 900)
    assert first_size(QSize(1366, 740)) == QSize(1334, 676)
    gui = open_app(qtbot, data_dir)
    try:
        w = gui.window
        free = w.screen().availableGeometry()
        assert free.width() < 1440 and w.width() <= free.width() and w.height() <= free.height()
    finally:
        close_app(gui)


def test_the_chat_search_runs_off_the_gui_thread_and_only_the_newest_search_is_shown(qtbot, data_dir):
    """A search folds every message of other scripts in Python (~0.2 s over 5,000): run on the GUI thread, it held
    the window at each letter typed. A search overtaken by the next letter is stopped, or its result dropped."""
    import threading

    from chat_threads import chain

    gui = open_app(qtbot, data_dir)
    w, store = gui.window, gui.store
    try:
        ids = {}
        for title, text in (("a", "привет мир"), ("b", "ПРИВЕТСТВИЕ"), ("c", "пока")):
            ids[title] = store.create_chat(title).id
            chain(store, ids[title], text)
        w.refresh_chats()
        threads, release = [], threading.Event()
        real = store.search_titles

        def search_titles(search):
            threads.append((search, threading.get_ident()))
            if search == "при":  # the older search is slow: its result comes after the newer one's
                assert release.wait(10)
            return real(search)

        store.search_titles = search_titles
        with qtbot.waitSignal(w.chat_list.searchChanged, timeout=5000):
            w.chat_list.search.setText("при")
        qtbot.waitUntil(lambda: len(threads) == 1, timeout=5000)
        assert threads[0][1] != threading.get_ident()  # not on the GUI thread, which goes on
        with qtbot.waitSignal(w.chatsFound, timeout=5000) as found:
            w.chat_list.search.setText("ПРИВЕТС")
            w.chat_list.search.returnPressed.emit()  # searched at once, while the first still runs
            release.set()
        assert found.args == ["ПРИВЕТС"] and w.chat_list.chat_ids() == [ids["b"]]
        for _ in range(20):  # the older search's result, if any came, is dropped
            qtbot.wait(10)
        assert w.chat_list.chat_ids() == [ids["b"]]
        assert [s for s, _t in threads] == ["при", "ПРИВЕТС"]
        w.chat_list.search.setText("")
        w.chat_list._search_now()
        assert w.chat_list.chat_ids() == [ids["c"], ids["b"], ids["a"]]  # all, at once
    finally:
        store.search_titles = real
        close_app(gui)


def _three_chats(store) -> list[int]:
    """Three chats of one question each, oldest first."""
    from chat_threads import chain

    ids = []
    for i in range(3):
        ids.append(store.create_chat(f"chat {i}").id)
        chain(store, ids[-1], f"question {i}")
    return ids


def test_switching_chats_moves_the_selection_without_listing_the_chats_again(qtbot, data_dir):
    """Each switch read and built the whole list again: ~0.2 s of the GUI thread in a list of 5,000 chats."""

    gui = open_app(qtbot, data_dir)
    w, store = gui.window, gui.store
    try:
        ids = _three_chats(store)
        w.refresh_chats()
        listed = []
        real = w.chat_list.set_chats
        w.chat_list.set_chats = lambda *a: listed.append(a) or real(*a)
        for chat_id in (ids[0], ids[2], ids[1]):
            w.chat_list.list.setCurrentRow(w.chat_list.chat_ids().index(chat_id))
            assert w.flow.chat_id == chat_id and w.chat_title.text() == store.get_chat(chat_id).title
            assert w.chat_list.current_id() == chat_id
        w.new_chat()
        assert w.chat_list.current_id() is None and w.chat_list.list.currentItem() is None
        w.flow.open_chat(ids[0])  # opened another way than from the list: the list follows
        assert w.chat_list.current_id() == ids[0]
        assert listed == []
        w.flow.rename_chat(ids[1], "renamed")  # a change to the list lists them again
        assert len(listed) == 1 and w.chat_list.chat_ids()[0] == ids[1] and w.chat_list.current_id() == ids[0]
    finally:
        close_app(gui)


def test_switching_chats_lists_what_another_window_changed_meanwhile(qtbot, data_dir):
    """Another window or `gapless chats import` on the same data folder made, renamed or deleted chats: switching
    chats listed them again, until switching stopped reading the list; they never showed until this window changed
    a chat itself, and a chat deleted elsewhere stayed listed."""

    gui = open_app(qtbot, data_dir)
    w, store = gui.window, gui.store
    try:
        ids = _three_chats(store)
        w.refresh_chats()
        other = ChatStore(gui.paths.database)
        try:
            made = other.create_chat("made elsewhere").id
            other.delete_chat(ids[2])
        finally:
            other.close()
        w.chat_list.list.setCurrentRow(w.chat_list.chat_ids().index(ids[0]))
        assert w.flow.chat_id == ids[0]
        assert w.chat_list.chat_ids() == [made, ids[1], ids[0]] and w.chat_list.current_id() == ids[0]
        listed = []
        real = w.chat_list.set_chats
        w.chat_list.set_chats = lambda *a: listed.append(a) or real(*a)
        w.chat_list.list.setCurrentRow(w.chat_list.chat_ids().index(ids[1]))  # nothing changed since: not read
        assert w.flow.chat_id == ids[1] and w.chat_list.current_id() == ids[1] and listed == []
    finally:
        close_app(gui)


# ---- which branch a chat shows -----------------------------------------------------------------------------


def _shown(w) -> list[tuple[str, str, str]]:
    """Each message on screen: its role, its text, and its "n/m" where it has siblings."""
    return [
        (m.item.role, m.body.text, m.branch_label.text() if m.item.sibling_count > 1 else "")
        for m in w.chat_view.messages()
    ]


def test_a_chosen_candidate_and_what_followed_come_back_after_an_edit_above(qtbot, tmp_path, tiny_llama):
    """Back to the first version of an edited question, the chat went down the newest answer under it, an
    unchosen candidate with nothing after it: the chosen one and the follow-up looked lost."""
    gui = open_app(qtbot, tmp_path / "data", tiny_llama)
    try:
        w = gui.window
        w.flow.default_sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
        with qtbot.waitSignal(gui.controller.reconfigured, timeout=TIMEOUT_MS):
            w.toggles.candidates.setValue(3)
        send(qtbot, gui, "hello")
        w.chat_view.candidate_tabs().use_buttons[0].click()
        with qtbot.waitSignal(gui.controller.reconfigured, timeout=TIMEOUT_MS):
            w.toggles.candidates.setValue(1)
        send(qtbot, gui, "my follow-up question")
        before = _shown(w)
        edit_and_send(qtbot, gui, 0, "hello again")
        w.chat_view.messages()[0].prev_button.click()
        assert _shown(w) == [(before[0][0], before[0][1], "1/2"), *before[1:]]
        assert before[1][2] == "1/3" and before[2][1] == "my follow-up question"
    finally:
        close_app(gui)


def test_a_regenerate_stopped_before_its_first_word_leaves_the_version_looked_at(
    qtbot, tmp_path, tiny_llama, monkeypatch
):
    """Regenerating version 1 of an answer and stopping at once (while it waited for the engine): the chat jumped
    to version 2 and what followed it, and the engine still wrote one token, kept as a version "3/3"."""
    import threading

    from app.worker import EngineWorker

    gui = open_app(qtbot, tmp_path / "data", tiny_llama)
    try:
        w = gui.window
        w.flow.default_sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=None)
        send(qtbot, gui, "hello")
        with qtbot.waitSignal(gui.controller.generationFinished, timeout=TIMEOUT_MS):
            w.chat_view.messages()[1].regen_button.click()
        qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
        send(qtbot, gui, "follow-up under version 2")
        w.chat_view.messages()[1].prev_button.click()  # back to version 1
        looked_at = _shown(w)
        assert looked_at[1][2] == "1/2" and len(looked_at) == 2
        gate = threading.Event()
        real = EngineWorker._generate

        def late(self, cmd):
            gate.wait(30)
            real(self, cmd)

        monkeypatch.setattr(EngineWorker, "_generate", late)
        w.chat_view.messages()[1].regen_button.click()
        w.composer.stop_button.click()
        with qtbot.waitSignal(gui.controller.generationFinished, timeout=TIMEOUT_MS) as finished:
            gate.set()
        qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
        assert finished.args[1].token_ids == [[]]
        assert _shown(w) == looked_at
        assert [m.content for m in gui.store.thread(w.flow.chat_id)] == [t for _, t, _ in looked_at]
    finally:
        close_app(gui)


def test_a_regenerate_waiting_for_the_engine_shows_its_branch_after_a_visit_to_another_chat(
    qtbot, tmp_path, tiny_llama, monkeypatch
):
    """The engine busy (the app's server answering a client): back from another chat, the old answer's whole
    branch was shown with the new answer under it, and the next message went under what the store held."""
    import threading

    from app.worker import Call

    gui = open_app(qtbot, tmp_path / "data", tiny_llama)
    try:
        w, c = gui.window, gui.controller
        w.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=6, seed=0)
        send(qtbot, gui, "hello world")
        send(qtbot, gui, "the quick brown fox")
        chat = w.flow.chat_id
        w.new_chat()
        send(qtbot, gui, "Paris")
        other = w.flow.chat_id
        w.chat_list.chatSelected.emit(chat)
        busy, release = threading.Event(), threading.Event()
        c.worker.commands.put(Call(lambda _engine: (busy.set(), release.wait(60)), threading.Event()))
        assert busy.wait(60)
        w.chat_view.messages()[1].regen_button.click()  # a new first answer
        w.chat_list.chatSelected.emit(other)
        w.chat_list.chatSelected.emit(chat)
        assert [t for _, t, _ in _shown(w)] == ["hello world"]  # the question, its new answer to come
        with qtbot.waitSignal(c.generationFinished, timeout=TIMEOUT_MS):
            release.set()
        qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
        assert [(r, t) for r, t, _ in _shown(w)] == [(m.role, m.content) for m in gui.store.thread(chat)]
        assert len(_shown(w)) == 2
    finally:
        close_app(gui)


# ---- where the keyboard focus goes --------------------------------------------------------------------------


def _long_chat(store, n: int) -> int:
    chat = store.create_chat("Long", "", None)
    parent = None
    for i in range(n):
        m = store.add_message(chat.id, "user" if i % 2 == 0 else "assistant", f"message {i} " + "word " * 30, parent)
        parent = m.id
    return chat.id


@pytest.fixture
def active_app(qtbot, tmp_path, tiny_llama):
    gui = open_app(qtbot, tmp_path / "data", tiny_llama)
    gui.window.resize(1440, 900)
    gui.window.activateWindow()
    qtbot.waitUntil(gui.window.isActiveWindow)
    yield gui
    close_app(gui)


@pytest.mark.parametrize("how", ["mouse", "keys"])
def test_an_edit_of_a_long_chat_s_last_question_keeps_every_message_shown(qtbot, active_app, how):
    """Hiding the editor that held the focus let Qt tab on to "Show earlier messages", which scrolled to the top
    and built 40 messages while the view was being cleared: 40 messages went from the view (not the store)."""
    from PySide6.QtWidgets import QApplication

    gui = active_app
    w = gui.window
    w.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=4, seed=0)
    chat = _long_chat(gui.store, 100)
    w.refresh_chats()
    w.flow.open_chat(chat)
    qtbot.wait(200)  # laid out and scrolled to its end, as the user sees it
    question = w.chat_view.messages()[-2]
    assert question.item.role == "user"
    if how == "mouse":
        qtbot.mouseClick(question.edit_button, Qt.MouseButton.LeftButton)
    else:
        question.edit_button.setFocus()
        qtbot.keyClick(question.edit_button, Qt.Key.Key_Space)
    question.editor_text.setPlainText("an edited question")
    with qtbot.waitSignal(gui.controller.generationFinished, timeout=TIMEOUT_MS):
        if how == "mouse":
            qtbot.mouseClick(question._edit_send, Qt.MouseButton.LeftButton)
        else:
            qtbot.keyClick(question.editor_text, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
    assert [i.id for i in w.chat_view.items()] == [m.id for m in gui.store.thread(chat)]
    assert len(w.chat_view.items()) == 100 and QApplication.focusWidget() is w.composer.edit


def test_a_message_s_buttons_leave_the_keyboard_to_the_composer(qtbot, active_app):
    """A click on Copy left the focus in the conversation (what was typed next went nowhere); ‹ pressed from the
    keyboard, or a delete confirmed, threw it to the first message's Copy or to New chat."""
    from PySide6.QtWidgets import QApplication

    gui = active_app
    w = gui.window
    w.flow.default_sampling = SamplingParams(temperature=1.0, max_new_tokens=4, seed=None)
    send(qtbot, gui, "hello")
    w.composer.edit.setFocus()
    qtbot.mouseClick(w.chat_view.messages()[-1].copy_button, Qt.MouseButton.LeftButton)
    qtbot.keyClicks(QApplication.focusWidget(), "thanks")
    assert w.composer.edit.toPlainText() == "thanks"
    w.composer.edit.clear()
    with qtbot.waitSignal(gui.controller.generationFinished, timeout=TIMEOUT_MS):
        w.chat_view.messages()[1].regen_button.click()
    qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
    previous = w.chat_view.messages()[1].prev_button
    previous.setFocus()
    qtbot.keyClick(previous, Qt.Key.Key_Space)
    assert w.chat_view.messages()[1].branch_label.text() == "1/2"
    assert QApplication.focusWidget() is w.composer.edit


def test_a_chat_picked_with_the_mouse_gives_the_keyboard_to_the_composer(qtbot, tmp_path):
    """Typing after a click on a chat went to the list's type-ahead, which opened another chat ("hello" opened
    "Holiday plans")."""
    from PySide6.QtWidgets import QApplication
    from test_dialogs import add_chat, chat_row_pos

    gui = open_app(qtbot, tmp_path / "data")
    try:
        w = gui.window
        w.activateWindow()
        qtbot.waitUntil(w.isActiveWindow)
        apples = add_chat(gui.store, "Apples", "one")
        add_chat(gui.store, "Holiday plans", "two")
        w.refresh_chats()
        qtbot.mouseClick(w.chat_list.list.viewport(), Qt.MouseButton.LeftButton, pos=chat_row_pos(w.chat_list, apples))
        qtbot.keyClicks(QApplication.focusWidget(), "hello")
        assert w.flow.chat_id == apples and w.composer.edit.toPlainText() == "hello"
    finally:
        close_app(gui)


def test_shift_enter_in_a_tall_draft_shows_the_new_line(qtbot, tmp_path):
    gui = open_app(qtbot, tmp_path / "data")
    try:
        edit = gui.window.composer.edit
        edit.setFocus()
        hidden = []
        for i in range(25):
            qtbot.keyClicks(edit, f"line {i}")
            qtbot.keyClick(edit, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
            if not edit.viewport().rect().contains(edit.cursorRect()):
                hidden.append(i)
        assert edit.toPlainText().count("\n") == 25 and hidden == []
    finally:
        close_app(gui)


def test_a_load_started_from_a_model_button_gives_the_keyboard_to_the_composer(qtbot, tmp_path):
    """Disabling the focused button passed the focus on to the Preset list, where an arrow key changed the
    optimizations (and asked about compiling on the CPU)."""
    from PySide6.QtWidgets import QApplication

    gui = open_app(qtbot, tmp_path / "data")
    try:
        w = gui.window
        w.activateWindow()
        qtbot.waitUntil(w.isActiveWindow)
        w.model_panel.recent_button.setFocus()
        options = w.toggles.options
        w.model_panel.set_loading("default")
        assert QApplication.focusWidget() is w.composer.edit
        qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_Down)
        assert w.toggles.options == options
    finally:
        close_app(gui)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_choice_made_while_a_model_loads_is_kept_where_the_model_refuses_another_option(
    qtbot, app, tiny_factory, family
):
    """Candidates set to 2 while a model that refuses the static cache (gpt2: the transformers fallback) loaded:
    the panel showed 2, then the answer ran with 1 while the settings said 2, and only the cache was said."""
    w, c, t = app.window, app.controller, app.window.toggles
    with qtbot.waitSignal(c.loaded, timeout=TIMEOUT_MS):
        w.load_model(str(tiny_factory(family)))
        t.candidates.setValue(2)  # the user's change while the model loads
    qtbot.waitUntil(lambda: not c.busy and w._requested is None, timeout=TIMEOUT_MS)
    r = send(qtbot, app, "hi")
    assert r.options.candidates == 2 and t.options.candidates == 2
    assert w.settings.engine_options["candidates"] == 2
    assert (r.options.kv_cache == "static") is (family == "llama")


def test_each_chat_keeps_its_own_draft_and_drafts_outlive_a_restart(qtbot, data_dir, tiny_llama):
    """The one composer carried what was typed in a chat into the next one opened, where Enter sent it there, and
    a message typed and not sent was lost at the next start without a word. Each chat keeps its draft, the new
    chat too; a sent message is no draft; a deleted chat's draft goes with it."""
    gui = open_app(qtbot, data_dir, model=tiny_llama)
    w, store = gui.window, gui.store
    a = store.create_chat("A", "", None).id
    store.add_message(a, "user", "garden", None)
    b = store.create_chat("B", "", None).id
    store.add_message(b, "user", "taxes", None)
    gone = store.create_chat("C", "", None).id
    store.add_message(gone, "user", "old", None)
    w.refresh_chats()
    try:
        w.composer.set_text("fresh thought")  # in the new chat the window starts on
        w.flow.open_chat(a)
        assert w.composer.text() == ""
        w.composer.set_text("for A: plant the tomatoes in May")
        w.flow.open_chat(b)
        assert w.composer.text() == ""
        w.composer.set_text("for B")
        w.flow.open_chat(gone)
        w.composer.set_text("lost with its chat")
        w.flow.open_chat(a)
        assert w.composer.text() == "for A: plant the tomatoes in May"
        w.flow.open_chat(gone)
        assert w.composer.text() == "lost with its chat"
        w.flow.delete_chat(gone)  # opens the new chat
        assert w.composer.text() == "fresh thought"
        w.flow.open_chat(b)
        assert w.composer.text() == "for B"
        w.composer.set_text("")
        send(qtbot, gui, "sent, not a draft")
        assert w.composer.text() == ""
    finally:
        close_app(gui)
    gui = open_app(qtbot, data_dir, model=tiny_llama)
    w = gui.window
    try:
        assert w.composer.text() == "fresh thought"
        w.flow.open_chat(a)
        assert w.composer.text() == "for A: plant the tomatoes in May"
        w.flow.open_chat(b)
        assert w.composer.text() == ""
        assert json.loads((AppPaths.resolve(data_dir).config / "drafts.json").read_text())["drafts"] == {
            "new": "fresh thought",
            str(a): "for A: plant the tomatoes in May",
        }
        w.composer.set_text("typed in the new chat")
        w.flow.new_chat()
        send(qtbot, gui, "a first message")  # the new chat it makes takes the message, and no draft
        assert w.composer.text() == ""
        w.flow.new_chat()
        assert w.composer.text() == ""
    finally:
        close_app(gui)


def listed_chat(w, title: str) -> int:
    """A chat of one question, made in the store (as another window would) and listed; its id."""
    chat_id = w.store.create_chat(title, "", None).id
    w.store.add_message(chat_id, "user", "hi", None)
    w.refresh_chats()
    return chat_id


def test_text_typed_in_the_new_chat_stays_when_chat_settings_make_it_a_chat(qtbot, data_dir, tiny_llama):
    """Chat settings → OK on the new chat makes the chat: the text typed in it went away as the new chat's draft,
    to come back in the next new chat, where Enter sent it to another chat."""
    gui = open_app(qtbot, data_dir, model=tiny_llama)
    w = gui.window
    try:
        w.composer.set_text("my long message for this chat")
        w.open_chat_settings()
        w._chat_settings_dialog.accept()
        assert w.flow.chat_id is not None and w.composer.text() == "my long message for this chat"
        w.flow.new_chat()
        assert w.composer.text() == ""
        w.flow.open_chat(gui.store.list_chats()[0].id)
        assert w.composer.text() == "my long message for this chat"
    finally:
        close_app(gui)


def test_a_send_into_a_chat_deleted_elsewhere_keeps_both_drafts(qtbot, data_dir, tiny_llama):
    """A reply typed in a chat another window deleted, then sent: the new chat opened took it as its first
    message's chat would, and the new chat's own draft was erased, then written over with the reply."""
    gui = open_app(qtbot, data_dir, model=tiny_llama)
    w, store = gui.window, gui.store
    try:
        x = listed_chat(w, "X")
        w.composer.set_text("the new chat's draft")
        w.flow.open_chat(x)
        w.composer.set_text("reply typed in X")
        store.delete_chat(x)  # another window
        w.composer.edit.setFocus()
        qtbot.keyClick(w.composer.edit, Qt.Key.Key_Return)
        assert w.flow.chat_id is None and "deleted elsewhere" in w.status.text()
        assert w.composer.text() == "the new chat's draft\n\nreply typed in X"  # neither lost
    finally:
        close_app(gui)


def test_what_is_typed_is_kept_once_typing_pauses(qtbot, data_dir, tiny_llama):
    """Drafts were written only at a switch of chat or a close: a kill, a crash or a logout that did not wait
    lost what was typed."""
    gui = open_app(qtbot, data_dir, model=tiny_llama)
    w = gui.window
    path = AppPaths.resolve(data_dir).config / "drafts.json"
    try:
        w._draft_timer.setInterval(50)
        qtbot.keyClicks(w.composer.edit, "typed, not sent")
        qtbot.waitUntil(lambda: path.exists() and "typed, not sent" in path.read_text(), timeout=TIMEOUT_MS)
        assert json.loads(path.read_text())["drafts"] == {"new": "typed, not sent"}
    finally:
        close_app(gui)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_closes_the_window_as_its_close_button_does(qtbot, name):
    """SIGTERM (kill, a logout) ended the app at once, its draft and settings lost; Ctrl+C printed a
    KeyboardInterrupt traceback and the app went on. A signal asked to be ignored (nohup) stays ignored."""
    import os
    import signal

    from PySide6.QtWidgets import QWidget

    from app.gui import closed_by_signals

    number = getattr(signal, name)
    before = signal.getsignal(number)
    window = QWidget()
    qtbot.addWidget(window)
    window.show()
    try:
        signal.signal(number, signal.SIG_DFL)
        with closed_by_signals(window):
            os.kill(os.getpid(), number)
            qtbot.waitUntil(lambda: not window.isVisible(), timeout=TIMEOUT_MS)
        assert signal.getsignal(number) == signal.SIG_DFL  # put back as it was
        window.show()
        signal.signal(number, signal.SIG_IGN)
        with closed_by_signals(window):
            os.kill(os.getpid(), number)
            qtbot.wait(400)
            assert window.isVisible()
    finally:
        signal.signal(number, before)


def test_a_draft_is_kept_when_the_store_cannot_say_whether_its_chat_is_still_there(qtbot, data_dir, tiny_llama):
    """Another window holding the database as a chat was left: the draft was taken for one of a deleted chat and
    dropped, gone from the composer too."""
    from app.store import StoreError

    gui = open_app(qtbot, data_dir, model=tiny_llama)
    w, store = gui.window, gui.store
    try:
        a = listed_chat(w, "A")
        w.flow.open_chat(a)
        w.composer.set_text("typed in A")
        real = store.get_chat

        def locked(chat_id):
            raise StoreError("database is locked")

        store.get_chat = locked
        try:
            w._switch_draft(None)  # as opening the new chat does
        finally:
            store.get_chat = real
        w.flow.new_chat()
        w.flow.open_chat(a)
        assert w.composer.text() == "typed in A"
    finally:
        close_app(gui)
