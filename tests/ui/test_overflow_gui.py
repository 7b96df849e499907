"""Overflow policies in the app: chosen per chat in Chat settings (or the default in the Chat menu), each does
what it says, and the status notice and the answer's stats line name what was dropped."""

from __future__ import annotations

from PySide6.QtWidgets import QDialogButtonBox
from test_main_window import TIMEOUT_MS, send

from app.settings import SettingsStore
from engine.prompt import build_prompt


def long_history(gui) -> int:
    """A stored chat whose history alone outgrows the tiny model's 256-token context."""
    store = gui.store
    chat = store.create_chat("Long", "You are brief.")
    parent = None
    for n in range(12):
        u = store.add_message(chat.id, "user", f"question {n}: the quick brown fox jumps over the lazy dog", parent)
        parent = store.add_message(chat.id, "assistant", f"answer {n}: hello world " * 3, u.id).id
    gui.window.refresh_chats()
    gui.window.flow.open_chat(chat.id)
    return chat.id


def choose_policy(qtbot, w, policy: str) -> None:
    w.open_chat_settings()
    dialog = w._chat_settings_dialog
    dialog.overflow.setCurrentIndex(dialog.overflow.findData(policy))
    dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Ok).click()
    qtbot.waitUntil(lambda: w.flow.chat_overflow_policy() == (policy or None), timeout=TIMEOUT_MS)


def expected_cut(gui, policy: str) -> str:
    flow, eng = gui.window.flow, gui.controller.worker.engine
    user = gui.store.thread(flow.chat_id)[-2]  # the question just answered
    prompt = build_prompt(
        eng.tokenizer, flow.prompt_messages(user), eng.context_length, flow.sampling().max_new_tokens, overflow=policy
    )
    return prompt.cut


def test_each_policy_does_what_it_says_and_names_what_it_dropped(qtbot, app):
    w = app.window
    long_history(app)
    for policy, says in (("truncate-middle", "from the middle dropped"), ("rolling", "oldest messages dropped")):
        choose_policy(qtbot, w, policy)
        result = send(qtbot, app, f"the final question ({policy}): Paris?")
        cut = expected_cut(app, policy)
        assert says in cut and result.metrics.prompt_cut == cut and result.metrics.overflow_policy == policy
        assert cut in w.status.text()  # the notice
        line = w.chat_view.messages()[-1].stats_label.text()
        assert f"context full: {cut}" in line  # the answer's stats line
    choose_policy(qtbot, w, "stop")
    before = app.store.count_messages()
    w.composer.set_text("one question too many")
    with qtbot.waitSignal(app.controller.generationFailed, timeout=TIMEOUT_MS):
        w.composer.send_button.click()
    qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
    assert "The answer failed: the conversation takes" in w.status.text()
    assert "nothing was dropped" in w.status.text()
    assert app.store.count_messages() == before + 1  # the question is kept, no empty answer


def test_the_default_policy_is_saved_and_applies_to_chats_without_their_own(qtbot, app, data_dir):
    w = app.window
    w.overflow_actions["stop"].trigger()
    assert SettingsStore(app.paths.settings_file).load()[0].overflow_policy == "stop"
    chat_id = long_history(app)
    assert w.flow.overflow_policy(chat_id) == "stop"
    with qtbot.waitSignal(app.controller.generationFailed, timeout=TIMEOUT_MS):
        w.composer.set_text("and now?")
        w.composer.send_button.click()
    choose_policy(qtbot, w, "rolling")  # the chat's own choice wins over the default
    assert w.flow.overflow_policy(chat_id) == "rolling"
    result = send(qtbot, app, "and now, rolling?")
    assert result.metrics.overflow_policy == "rolling" and "oldest messages dropped" in result.metrics.prompt_cut
    choose_policy(qtbot, w, "")  # back to the default
    assert w.flow.overflow_policy(chat_id) == "stop"
