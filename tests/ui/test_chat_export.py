"""Export and import through the File menu: only the file dialog's choice is replaced; the rest is the real app
(a tiny model answers, so the answer carries real figures)."""

from __future__ import annotations

import json

from PySide6.QtWidgets import QFileDialog
from test_main_window import send

from app.chat_io import chat_document


def choose(monkeypatch, path):
    monkeypatch.setattr("ui.main_window.ask_save_file", lambda *a, **k: str(path))
    monkeypatch.setattr(QFileDialog, "getOpenFileName", staticmethod(lambda *a, **k: (str(path), "")))


def test_export_then_import_through_the_menu_gives_the_same_chat(qtbot, app, tmp_path, monkeypatch):
    w = app.window
    send(qtbot, app, "hello there")
    send(qtbot, app, "and again")
    first = w.flow.chat_id
    shown = [(m.role, m.content, m.metrics) for m in w.chat_view.items()]
    path = tmp_path / "exported.json"
    choose(monkeypatch, path)
    w.export_json_action.trigger()
    assert json.loads(path.read_text(encoding="utf-8"))["format"] == "gapless-chat"
    w.import_action.trigger()
    assert w.flow.chat_id != first and f"Chat imported from {path}" in w.status.text()
    assert [(m.role, m.content, m.metrics) for m in w.chat_view.items()] == shown
    assert sorted(w.chat_list.chat_ids()) == sorted([first, w.flow.chat_id])
    assert w.chat_list.current_id() == w.flow.chat_id
    a, b = (chat_document(app.store, c) for c in (first, w.flow.chat_id))
    a.pop("exported"), b.pop("exported")
    assert a == b
    md = tmp_path / "exported.md"
    choose(monkeypatch, md)
    w.export_md_action.trigger()
    assert "and again" in md.read_text(encoding="utf-8") and "TTFT" in md.read_text(encoding="utf-8")


def test_a_bad_file_through_the_menu_is_refused_and_changes_nothing(qtbot, app, tmp_path, monkeypatch):
    w = app.window
    send(qtbot, app, "hello there")
    chats = [c.id for c in app.store.list_chats()]
    count = app.store.count_messages()
    bad = tmp_path / "bad.json"
    bad.write_text(
        '{"format": "gapless-chat", "version": 1, "chat": {"title": "x"}, "messages": [{"id": 1, '
        '"parent": 5, "role": "user", "content": "hi"}]}',
        encoding="utf-8",
    )
    choose(monkeypatch, bad)
    w.import_action.trigger()
    assert "The chat was not imported: message 1: its parent 5 is not an earlier message" in w.status.text()
    assert [c.id for c in app.store.list_chats()] == chats and app.store.count_messages() == count


def test_export_is_offered_once_the_chat_has_a_message(qtbot, app):
    """A new chat offered both exports, each then refused in an error box: "Nothing to export"."""
    w = app.window
    w.new_chat()
    assert not w.export_json_action.isEnabled() and not w.export_md_action.isEnabled()
    send(qtbot, app, "hello there")
    assert w.export_json_action.isEnabled() and w.export_md_action.isEnabled()
    w.new_chat()
    assert not w.export_json_action.isEnabled()
