"""Every dialog the app opens, opened by the app's own code with the installed PySide6's real enums and answered
with the dialog's real buttons (tests/ui/dialog_driver.py); a scan of ui/ and app/ fails on a dialog call site
that no test here reaches."""

from __future__ import annotations

import ast
import errno
import json
import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from dialog_driver import ROOT, DialogDriver, right_click
from PySide6.QtWidgets import QApplication, QDialogButtonBox, QFileDialog, QMessageBox

from app.gui import build
from app.paths import AppPaths

TIMEOUT_MS = 60_000
DIALOG_CLASSES = {
    "QMessageBox",
    "QFileDialog",
    "QInputDialog",
    "QColorDialog",
    "QFontDialog",
    "QProgressDialog",
    "QErrorMessage",
    "QDialogButtonBox",
}

FAILED_OPEN = "test_a_failed_open_shows_an_error_box_that_its_ok_button_closes"
# Each function of ui/ and app/ that makes a dialog, and the test below that opens it and clicks it.
DIALOG_SITES = {
    ("ui/dialogs.py", "confirm"): "test_delete_from_the_chat_menu_asks_and_deletes",
    ("ui/dialogs.py", "show_error"): FAILED_OPEN,
    ("ui/dialogs.py", "show_info"): "test_help_lists_the_shortcuts_and_says_what_gapless_is",
    ("ui/dialogs.py", "SamplingDialog.__init__"): "test_chat_settings_restore_defaults_and_ok",
    ("ui/preferences.py", "PreferencesDialog.choose_folder"): "test_preferences_apply_at_once_and_are_kept",
    ("ui/chat_list.py", "ChatList.ask_rename"): "test_rename_from_the_chat_menu",
    ("ui/dialogs.py", "choose_model"): FAILED_OPEN,  # the model panel's and the draft model's file dialogs
    ("ui/model_panel.py", "ModelPanel._choose_models_folder"): "test_choosing_a_models_folder_lists_it",
    ("ui/dialogs.py", "ask_save_file"): "test_hud_export_asks_where_and_writes_there",
    ("ui/hud/panel.py", "HudPanel._ask"): "test_hud_export_that_cannot_write_says_so",
    ("ui/hud/panel.py", "ImageSizeDialog.__init__"): "test_plots_png_asks_the_size_then_where",
    ("app/gui.py", "run_gui"): "test_a_chat_database_that_cannot_open_says_so_at_start",
    ("ui/main_window.py", "MainWindow.import_chat"): "test_a_chat_exported_to_a_file_imports_again",
    ("ui/remote_dialog.py", "RemoteDialog.__init__"): "test_the_remote_model_dialog_cancels_with_its_button",
    ("ui/dialogs.py", "show_error_and_wait"): "test_settings_the_disk_cannot_take_on_close_are_said_before_it_closes",
}


@pytest.fixture
def gui(qtbot, tmp_path):
    g = build(AppPaths.resolve(tmp_path / "data"), "light")
    g.window.show()
    qtbot.waitExposed(g.window)
    yield g
    g.window.close()
    g.close()


@pytest.fixture
def driver():
    d = DialogDriver()
    yield d
    d.stop()


def add_chat(store, title: str, text: str) -> int:
    chat = store.create_chat(title, "", None)
    store.add_message(chat.id, "user", text, None)
    return chat.id


def chat_row_pos(chat_list, chat_id: int):
    row = chat_list.chat_ids().index(chat_id)
    return chat_list.list.visualItemRect(chat_list.list.item(row)).center()


def menu_action(window, menu_title: str, action: str):
    menu = next(a.menu() for a in window.menuBar().actions() if a.text().replace("&", "") == menu_title)
    return next(a for a in menu.actions() if a.text().replace("&", "") == action)  # the text without its mnemonic


# ---- the scan -------------------------------------------------------------------------------------------


def _dialog_calls(node: ast.AST, scope: list[str], rel: str, found: set[tuple[str, str]]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _dialog_calls(child, scope + [child.name, "<locals>"], rel, found)
            continue
        if isinstance(child, ast.ClassDef):
            _dialog_calls(child, scope + [child.name], rel, found)
            continue
        if isinstance(child, ast.Call):
            f = child.func
            name = (
                f.id
                if isinstance(f, ast.Name)
                else (f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None)
            )
            if name in DIALOG_CLASSES:
                found.add((rel, ".".join(scope[:-1] if scope and scope[-1] == "<locals>" else scope) or "<module>"))
        _dialog_calls(child, scope, rel, found)


def dialog_call_sites() -> set[tuple[str, str]]:
    """(file, enclosing function) of every call to a dialog class or one of its static functions in ui/, app/."""
    found: set[tuple[str, str]] = set()
    for path in sorted([*(ROOT / "ui").rglob("*.py"), *(ROOT / "app").rglob("*.py")]):
        _dialog_calls(ast.parse(path.read_text(encoding="utf-8")), [], path.relative_to(ROOT).as_posix(), found)
    return found


def test_every_dialog_call_site_has_a_test_that_clicks_it():
    sites = dialog_call_sites()
    assert ("ui/dialogs.py", "confirm") in sites  # the scan sees what it must
    missing = sorted(sites - DIALOG_SITES.keys())
    assert not missing, f"dialog calls without a test in {Path(__file__).name}: {missing}"
    stale = sorted(DIALOG_SITES.keys() - sites)
    assert not stale, f"DIALOG_SITES names call sites that are gone: {stale}"
    tests = {name for name, value in globals().items() if name.startswith("test_") and callable(value)}
    assert set(DIALOG_SITES.values()) <= tests


# ---- the chat list's menu ---------------------------------------------------------------------------------


def test_delete_from_the_chat_menu_asks_and_deletes(qtbot, gui, driver):
    w, store = gui.window, gui.store
    keep = add_chat(store, "Keep me", "first")
    doomed = add_chat(store, "Delete me", "second")
    w.refresh_chats()

    driver.menu("Delete…").click("Cancel").start()  # Cancel keeps it
    right_click(w.chat_list.list.viewport(), chat_row_pos(w.chat_list, doomed))
    qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
    box = driver.answered[1]
    assert box.kind == "QMessageBox" and box.title == "Delete chat" and "“Delete me”" in box.text
    assert {"Delete", "Cancel"} <= set(box.buttons)
    assert ("ui/dialogs.py", "confirm") in box.sites and ("ui/chat_list.py", "ChatList.ask_delete") in box.sites
    assert {c.id for c in store.list_chats()} == {keep, doomed}

    driver.menu("Delete…").click("Delete").start()
    right_click(w.chat_list.list.viewport(), chat_row_pos(w.chat_list, doomed))
    qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
    qtbot.waitUntil(lambda: w.chat_list.chat_ids() == [keep], timeout=TIMEOUT_MS)
    assert [c.id for c in store.list_chats()] == [keep]
    assert store.thread(keep)[0].content == "first"


def test_rename_from_the_chat_menu(qtbot, gui, driver):
    w, store = gui.window, gui.store
    chat = add_chat(store, "Old title", "hello")
    w.refresh_chats()
    driver.menu("Rename…").type_text("  New title ").start()
    right_click(w.chat_list.list.viewport(), chat_row_pos(w.chat_list, chat))
    qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
    assert ("ui/chat_list.py", "ChatList.ask_rename") in driver.answered[1].sites
    assert driver.answered[1].text == "Title:"
    assert store.get_chat(chat).title == "New title"
    qtbot.waitUntil(lambda: w.chat_list.list.item(0).text() == "New title", timeout=TIMEOUT_MS)


def test_chats_are_opened_renamed_and_deleted_from_the_keyboard(qtbot, gui, driver):
    """Renaming or deleting a chat took a right-click: the chat list's menu was the only way, and the keyboard had
    none to it (no key, no menu entry; most laptops have no menu key)."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QInputDialog, QMenu

    w, store = gui.window, gui.store
    keep = add_chat(store, "Keep me", "first")
    old = add_chat(store, "Old title", "second")
    w.refresh_chats()
    w.activateWindow()
    qtbot.waitUntil(w.isActiveWindow, timeout=TIMEOUT_MS)
    chats = w.chat_list.list
    w.flow.open_chat(old)
    chats.setFocus()
    assert w.chat_list.current_id() == old and w.chat_title.text() == "Old title"

    driver.keys(QInputDialog, "New title", Qt.Key.Key_Return).start()  # typed over the title shown, selected
    qtbot.keyClick(chats, Qt.Key.Key_F2)
    qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
    assert driver.answered[0].title == "Rename chat"
    qtbot.waitUntil(lambda: store.get_chat(old).title == "New title", timeout=TIMEOUT_MS)
    assert chats.item(0).text() == "New title" and w.chat_title.text() == "New title"

    driver = DialogDriver().keys(QMessageBox, "", Qt.Key.Key_Return).start()  # Enter: Cancel, the default
    qtbot.keyClick(chats, Qt.Key.Key_Delete)
    qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
    assert driver.answered[0].text.startswith("Delete “New title” and all its messages?")
    assert {c.id for c in store.list_chats()} == {keep, old}

    # Shift+F10: the chat's menu, its second entry chosen with the arrows; then Tab to Delete and Space
    driver = DialogDriver().keys(QMenu, "", Qt.Key.Key_Down, Qt.Key.Key_Down, Qt.Key.Key_Return)
    driver.keys(QMessageBox, "", Qt.Key.Key_Tab, Qt.Key.Key_Space).start()
    qtbot.keyClick(chats, Qt.Key.Key_F10, Qt.KeyboardModifier.ShiftModifier)
    qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
    qtbot.waitUntil(lambda: [c.id for c in store.list_chats()] == [keep], timeout=TIMEOUT_MS)
    assert w.chat_list.chat_ids() == [keep] and w.flow.chat_id is None
    assert w.focusWidget() is chats  # where the keys go once the window is active again
    qtbot.keyClick(chats, Qt.Key.Key_Down)
    assert w.flow.chat_id == keep and store.thread(keep)[0].content == "first"
    driver = DialogDriver().keys(QMessageBox, "", Qt.Key.Key_Escape).start()  # Esc: Cancel, the chat stays
    qtbot.keyClick(chats, Qt.Key.Key_Delete)
    qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
    assert [c.id for c in store.list_chats()] == [keep]

    # the Chat menu: the open chat's entries, F2 shown and working from the composer too
    rename = menu_action(w, "Chat", "Rename chat…")
    assert rename.shortcut().toString() == "F2" and menu_action(w, "Chat", "Delete chat…").isEnabled()
    driver = DialogDriver().keys(QInputDialog, "Kept", Qt.Key.Key_Return).start()
    w.activateWindow()  # as a desktop does once the box closes (the offscreen platform leaves none active)
    qtbot.waitUntil(w.isActiveWindow, timeout=TIMEOUT_MS)
    w.composer.edit.setFocus()
    qtbot.keyClick(w.composer.edit, Qt.Key.Key_F2)
    qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
    qtbot.waitUntil(lambda: store.get_chat(keep).title == "Kept", timeout=TIMEOUT_MS)
    w.new_chat()  # not stored yet: nothing to rename or delete
    assert not rename.isEnabled() and not menu_action(w, "Chat", "Delete chat…").isEnabled()


def test_tab_through_the_chat_list_leaves_a_new_chat_open(qtbot, gui):
    """The focus arriving in the chat list opened the newest chat: Tab from the search on to "Chat settings…"
    in a new chat put that chat on screen, and its settings (and the draft, with Enter) went to it."""
    from PySide6.QtCore import Qt

    w, store = gui.window, gui.store
    older = add_chat(store, "Older", "first")
    newest = add_chat(store, "Newest", "second")
    w.refresh_chats()
    w.new_chat()
    w.composer.set_text("a draft for a new chat")
    w.activateWindow()
    qtbot.waitUntil(w.isActiveWindow, timeout=TIMEOUT_MS)
    w.chat_list.search.setFocus()
    qtbot.keyClick(w.chat_list.search, Qt.Key.Key_Tab)
    assert QApplication.focusWidget() is w.chat_list.list
    assert w.flow.chat_id is None and w.chat_list.current_id() is None and w.chat_view.items() == []
    qtbot.keyClick(w.chat_list.list, Qt.Key.Key_Tab)
    assert QApplication.focusWidget() is w.chat_settings_button and w.flow.chat_id is None
    assert w.composer.text() == "a draft for a new chat"
    qtbot.keyClick(w.chat_settings_button, Qt.Key.Key_Backtab)  # back in the list: Down chooses the newest
    assert w.flow.chat_id is None
    qtbot.keyClick(w.chat_list.list, Qt.Key.Key_Down)
    assert w.flow.chat_id == newest and w.chat_title.text() == "Newest"
    qtbot.keyClick(w.chat_list.list, Qt.Key.Key_Down)
    assert w.flow.chat_id == older and [m.content for m in w.chat_view.items()] == ["first"]
    qtbot.keyClick(w.chat_list.list, Qt.Key.Key_Tab)  # a chat chosen stays chosen as the focus comes and goes
    qtbot.keyClick(w.chat_settings_button, Qt.Key.Key_Backtab)
    assert w.flow.chat_id == older and w.chat_list.current_id() == older


def test_every_tab_stop_of_the_window_is_named_for_a_screen_reader(qtbot, gui):
    """Each stop Tab visits in the window, with a chat open (a question, an answer with code) and every panel and
    HUD tab shown, has a name a screen reader reads: the conversation, each message's text, a code block's text and
    the compare table were unnamed. A dropdown is named by its accessible name or label: on Linux Qt's interface
    gives its value as its name and leaves the label to a relation."""
    from PySide6.QtGui import QAccessible
    from PySide6.QtWidgets import QComboBox, QLabel

    w, store = gui.window, gui.store
    chat = store.create_chat("Named", "", None)
    question = store.add_message(chat.id, "user", "hello", None)
    store.add_message(chat.id, "assistant", "Hi **there**\n\n```python\nx = 1\n```\n\nDone.", question.id)
    w.refresh_chats()
    w.flow.open_chat(chat.id)
    for dock in (w.options_dock, w.hud_dock, w.server_dock):
        dock.show()
    shown = lambda: [m.body.text[:5] for m in w.chat_view.messages() if m.isVisible()]  # noqa: E731
    qtbot.waitUntil(lambda: shown() == ["hello", "Hi **"], timeout=TIMEOUT_MS)
    names: dict[str, str] = {}
    for tab in range(w.hud.tabs.count()):
        w.hud.tabs.setCurrentIndex(tab)
        for stop in w.tab_stops():
            if isinstance(stop, QComboBox):
                labels = [lb.text() for lb in w.findChildren(QLabel) if lb.buddy() is stop]
                name = stop.accessibleName() or " ".join(labels)
            else:
                name = QAccessible.queryAccessibleInterface(stop).text(QAccessible.Text.Name)
            names[f"{type(stop).__name__} {stop.objectName()} {name}"] = name
    assert [k for k, name in names.items() if not name.strip()] == []
    for expected in ("ChatView chatView Conversation", "ProseView prose Your message", "ProseView prose Answer"):
        assert expected in names
    assert "_CodeEdit codeText python code" in names and "_RowsView  Runs compared" in names


def _mnemonic(text: str) -> str:
    """The Alt+letter of a label or menu entry ("&Temperature": "t"), "" where it has none."""
    at = text.replace("&&", "").find("&")
    return text.replace("&&", "")[at + 1].lower() if at >= 0 else ""


def test_the_dialogs_fields_and_the_menus_entries_have_an_alt_letter_each_used_once(qtbot, gui):
    """The labels of Chat settings, Preferences and the remote model dialog, and the entries of every menu (the
    View menu's themes, send keys and docks last), had no Alt+letter. Each now has one, none used twice in a dialog
    or a menu (nor O or C in a dialog: GNOME and KDE give them to OK and Cancel), and in a dialog Alt+letter moves
    to the label's field."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QAbstractButton, QLabel

    from app.settings import CHAT_DEFAULTS
    from ui.dialogs import ChatSettingsDialog
    from ui.preferences import Preferences, PreferencesDialog
    from ui.remote_dialog import RemoteDialog

    w = gui.window
    for bar_action in w.menuBar().actions():
        menu = bar_action.menu()
        for m in (menu, *(a.menu() for a in menu.actions() if a.menu() is not None)):
            entries = [a.text() for a in m.actions() if not a.isSeparator()]
            letters = [_mnemonic(t) for t in entries if _mnemonic(t)]
            assert len(set(letters)) == len(letters), entries
            assert [t for t in entries if not _mnemonic(t)] == [], m.title()
    view = next(a.menu() for a in w.menuBar().actions() if a.text() == "&View")
    assert [a.text() for a in view.actions() if not a.isSeparator()] == [
        "Follow the &system theme",
        "&Light theme",
        "&Dark theme",
        "Send with &Enter",
        "Send with &Ctrl+Enter",
        "&Optimizations",
        "&Performance",
        "Se&rver",
    ]
    assert (w.options_dock.windowTitle(), w.hud_dock.windowTitle()) == ("Optimizations", "Performance")  # no "&"

    prefs = Preferences("light", "enter", CHAT_DEFAULTS, "", "rolling", None)
    for dialog in (ChatSettingsDialog("", CHAT_DEFAULTS), PreferencesDialog(prefs), RemoteDialog()):
        qtbot.addWidget(dialog)
        dialog.show()
        dialog.activateWindow()
        qtbot.waitUntil(dialog.isActiveWindow, timeout=TIMEOUT_MS)
        labels = [lb for lb in dialog.findChildren(QLabel) if lb.buddy() is not None]
        assert [lb.text() for lb in dialog.findChildren(QLabel) if _mnemonic(lb.text()) and lb.buddy() is None] == []
        assert [lb.text() for lb in labels if not _mnemonic(lb.text())] == [], type(dialog).__name__
        buttons = [_mnemonic(b.text()) for b in dialog.findChildren(QAbstractButton) if _mnemonic(b.text())]
        letters = [_mnemonic(lb.text()) for lb in labels] + buttons + ["o", "c"]
        assert len(set(letters)) == len(letters), (type(dialog).__name__, letters)
        for lb in labels:
            qtbot.keyClick(dialog, Qt.Key(ord(_mnemonic(lb.text()).upper())), Qt.KeyboardModifier.AltModifier)
            assert QApplication.focusWidget() is lb.buddy(), lb.text()
        dialog.close()


# ---- the model panel --------------------------------------------------------------------------------------


def test_a_remote_model_that_fails_to_open_is_named_by_its_address_and_model(qtbot, gui, driver):
    """The box named it in its stored form, "remote:http://127.0.0.1:9/v1#tiny|timeout=2"."""
    source = "remote:http://127.0.0.1:9/v1#tiny|timeout=2"  # port 9: nothing listens
    driver.click("OK").start()
    with qtbot.waitSignal(gui.controller.loadFailed, timeout=TIMEOUT_MS):
        gui.window.load_model(source)
    qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
    box = driver.answered[0]
    assert box.title == "Model not loaded"
    assert box.text.startswith("Could not load http://127.0.0.1:9/v1 · tiny:\n"), box.text


def test_a_failed_open_shows_an_error_box_that_its_ok_button_closes(qtbot, gui, driver, tmp_path):
    w = gui.window
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    driver.choose_file(bad).click("OK").start()
    with qtbot.waitSignal(gui.controller.loadFailed, timeout=TIMEOUT_MS) as failed:
        menu_action(w, "File", "Open GGUF…").trigger()
    assert failed.args[0] == str(bad)
    assert ("ui/model_panel.py", "ModelPanel.open_file_dialog") in driver.answered[0].sites
    qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
    box = driver.answered[1]
    assert box.title == "Model not loaded" and str(bad) in box.text and failed.args[1] in box.text
    qtbot.waitUntil(
        lambda: not [x for x in QApplication.topLevelWidgets() if isinstance(x, QMessageBox) and x.isVisible()],
        timeout=TIMEOUT_MS,
    )


def test_a_dialog_closed_does_not_stay_a_child_of_the_window(qtbot, gui, driver, tmp_path):
    """A dialog given the window as its parent stayed its child once closed (Qt frees a child with its parent):
    one more Preferences, chat settings, message box or save dialog each time one was opened, every one of them
    re-polished on each change of theme, a save dialog's file system model still watching its folder."""
    from PySide6.QtCore import QCoreApplication, QEvent
    from PySide6.QtWidgets import QDialog

    from ui.dialogs import ask_save_file, confirm

    w = gui.window

    def dialogs() -> int:
        QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
        return len(w.findChildren(QDialog))

    def shown_box() -> QMessageBox:
        qtbot.waitUntil(lambda: any(isinstance(x, QMessageBox) and x.isVisible() for x in w.findChildren(QDialog)))
        return next(x for x in w.findChildren(QMessageBox) if x.isVisible())

    before = dialogs()
    for _ in range(2):
        menu_action(w, "File", "Preferences…").trigger()
        qtbot.waitUntil(w._preferences_dialog.isVisible, timeout=TIMEOUT_MS)
        w._preferences_dialog.reject()
        menu_action(w, "Chat", "Chat settings…").trigger()
        qtbot.waitUntil(w._chat_settings_dialog.isVisible, timeout=TIMEOUT_MS)
        w._chat_settings_dialog.reject()
        w.show_shortcuts()
        shown_box().reject()
        w._failed("a message the user reads and closes")
        shown_box().accept()
        driver.click("Cancel").start()
        assert not confirm(w, "Delete chat", "Delete it?", "Delete")
        driver.choose_file(None).start()
        assert ask_save_file(w, "Export", str(tmp_path / "series.csv"), "CSV (*.csv)") == ""
        assert driver.done
    assert dialogs() == before


def test_settings_the_disk_cannot_take_on_close_are_said_before_it_closes(qtbot, gui, driver, monkeypatch, caplog):
    """A save that failed on close was said in the status bar of the window closing: nobody saw it, and what was
    saved only on close (the optimization choices, the window's size and place) was gone at the next start."""
    w = gui.window
    path = gui.paths.settings_file
    before = path.read_bytes() if path.exists() else None

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("app.settings.write_whole", full)
    driver.click("OK").start()
    with caplog.at_level(logging.ERROR, logger="ui.main_window"):
        w.close()
    assert driver.done
    [box] = driver.answered
    assert box.title == "Settings not saved" and box.buttons == ["OK"]
    assert box.text == (
        f"Cannot save the settings to {path}: No space left on device.\n\nWhat changed since they were last "
        "saved (the optimization choices, the window's size and place) will not be there at the next start."
    )
    assert ("ui/main_window.py", "MainWindow.closeEvent") in box.sites  # shown while the window was still there
    assert not w.isVisible()  # and it closed after OK
    assert [r.getMessage() for r in caplog.records if r.name == "ui.main_window"] == [
        f"cannot save the settings to {path}: No space left on device"
    ]
    assert (path.read_bytes() if path.exists() else None) == before  # the file as it was
    monkeypatch.undo()  # the fixture closes the window again


def test_a_newer_version_s_settings_saved_meanwhile_are_kept_aside_on_close(qtbot, gui, driver):
    """A newer Gapless on the same data folder saved its settings while this window was open: closing this one
    wrote its older settings over them, with no copy."""
    path = gui.paths.settings_file
    newer = json.dumps({"version": 2, "theme": "sepia"})
    path.write_text(newer)
    driver.click("OK").start()
    gui.window.close()
    assert driver.done
    [box] = driver.answered
    [kept] = [p.name for p in path.parent.glob("settings.json.newer-*")]
    assert box.title == "Settings file kept aside" and box.text == (
        f"The settings file {path} could not be used: it was written by a newer version of Gapless (settings "
        f"version 2, this version reads up to 1). It was kept as {kept} and the settings of this window were saved "
        "in its place."
    )
    assert (path.parent / kept).read_text() == newer and json.loads(path.read_text())["version"] == 1


def test_open_folder_dialog_loads_the_chosen_folder(qtbot, gui, driver, tiny_llama):
    w = gui.window
    driver.choose_file(tiny_llama).start()
    with qtbot.waitSignal(gui.controller.loaded, timeout=TIMEOUT_MS):
        w.model_panel.open_folder_button.click()
    assert ("ui/model_panel.py", "ModelPanel.open_folder_dialog") in driver.answered[0].sites
    assert gui.controller.info.source == str(tiny_llama)


def test_a_draft_model_is_chosen_in_its_dialogs(qtbot, gui, driver, tmp_path, tiny_llama):
    toggles = gui.window.toggles
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    file_action, folder_action = toggles.draft_model.menu().actions()[:2]
    driver.choose_file(draft).start()
    file_action.trigger()
    assert ("ui/toggles.py", "TogglesPanel._choose_draft") in driver.answered[0].sites
    assert (toggles.options.speculation, toggles.options.draft_model) == ("draft", str(draft))
    driver = DialogDriver().choose_file(tiny_llama).start()
    folder_action.trigger()
    assert ("ui/toggles.py", "TogglesPanel._choose_draft") in driver.answered[0].sites
    assert toggles.options.draft_model == str(tiny_llama) and toggles.draft_model.text() == tiny_llama.name


def test_choosing_a_models_folder_lists_it(qtbot, gui, driver, tmp_path):
    w = gui.window
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "one.gguf").write_bytes(b"GGUF")
    driver.choose_file(folder).start()
    choose = next(a for a in w.model_panel.recent_button.menu().actions() if a.text() == "Choose a models folder…")
    choose.trigger()
    qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
    assert ("ui/model_panel.py", "ModelPanel._choose_models_folder") in driver.answered[0].sites
    assert gui.settings.models_folder == str(folder)
    saved = json.loads(gui.paths.settings_file.read_text())
    assert saved["models_folder"] == str(folder)
    texts = [a.text() for a in w.model_panel.recent_button.menu().actions()]
    assert f"In {folder}" in texts


def test_a_dropdown_stepped_to_just_before_the_window_closes_is_kept(qtbot, gui):
    """An entry stepped to with an arrow key applies once the steps pause: closed before that, the window saved
    the settings without it, and the app opened again with the precision before."""
    from PySide6.QtCore import Qt

    w = gui.window
    w.activateWindow()
    qtbot.waitUntil(w.isActiveWindow, timeout=TIMEOUT_MS)
    w.toggles.settle.setInterval(600_000)  # closed before the steps "pause"
    w.toggles.dtype.setFocus()
    qtbot.keyClick(w.toggles.dtype, Qt.Key.Key_Down)
    assert w.toggles.dtype.currentData() == "fp32" and w.toggles.options.dtype == "auto"
    w.close()
    assert json.loads(gui.paths.settings_file.read_text())["engine_options"]["dtype"] == "fp32"


# ---- chat settings ----------------------------------------------------------------------------------------


def test_chat_settings_restore_defaults_and_ok(qtbot, gui):
    from ui.dialogs import CHAT_DEFAULTS

    w, store = gui.window, gui.store
    chat = add_chat(store, "A chat", "hi")
    w.refresh_chats()
    w.chat_list.list.setCurrentRow(0)
    menu_action(w, "Chat", "Chat settings…").trigger()
    dialog = w._chat_settings_dialog
    qtbot.waitUntil(dialog.isVisible, timeout=TIMEOUT_MS)
    box = dialog.findChild(QDialogButtonBox)
    dialog.temperature.setValue(2.5)
    box.button(QDialogButtonBox.StandardButton.RestoreDefaults).click()
    assert dialog.temperature.value() == CHAT_DEFAULTS.temperature
    dialog.system_prompt.setPlainText("Be brief.")
    box.button(QDialogButtonBox.StandardButton.Ok).click()
    assert not dialog.isVisible()
    saved = store.get_chat(chat)
    assert saved.system_prompt == "Be brief." and saved.sampling["temperature"] == CHAT_DEFAULTS.temperature


# ---- preferences -------------------------------------------------------------------------------------------


def test_preferences_apply_at_once_and_are_kept(qtbot, tmp_path):
    from dataclasses import replace

    from ui.dialogs import CHAT_DEFAULTS

    data = tmp_path / "data"
    paths = AppPaths.resolve(data)
    paths.ensure()
    last = tmp_path / "last used"
    models = last / "models"
    models.mkdir(parents=True)
    paths.settings_file.write_text(json.dumps({"last_folder": str(last)}))
    g = build(paths)
    w = g.window
    w.show()
    qtbot.waitExposed(w)
    try:
        action = menu_action(w, "File", "Preferences…")
        assert not action.shortcut().isEmpty()
        action.trigger()
        dialog = w._preferences_dialog
        qtbot.waitUntil(dialog.isVisible, timeout=TIMEOUT_MS)
        ok = dialog.buttons.button(QDialogButtonBox.StandardButton.Ok)

        # A folder that does not exist is refused with the reason; the dialog stays open.
        dialog.models_folder.setText(str(tmp_path / "nowhere"))
        ok.click()
        assert dialog.isVisible() and dialog.error.isVisible()
        assert dialog.error.text() == (
            f"The models folder {tmp_path / 'nowhere'} does not exist: choose an existing folder, "
            "or leave it empty for none."
        )
        dialog.models_folder.clear()
        driver = DialogDriver().choose_file(models).start()
        dialog.choose_button.click()
        assert driver.done and Path(driver.answered[0].folder) == last  # the picker starts in the last folder
        assert ("ui/preferences.py", "PreferencesDialog.choose_folder") in driver.answered[0].sites
        assert dialog.models_folder.text() == str(models)

        dialog.theme.setCurrentIndex(dialog.theme.findData("dark"))
        dialog.send_with.setCurrentIndex(dialog.send_with.findData("ctrl+enter"))
        dialog.overflow.setCurrentIndex(dialog.overflow.findData("stop"))
        dialog.temperature.setValue(0.0)
        dialog.top_k.setValue(7)
        dialog.max_new_tokens.setValue(64)
        dialog.system_prompt.setPlainText("Answer in French.")
        ok.click()
        assert not dialog.isVisible()

        # In force at once: the theme, the send key, the menus' marks, the new chat's defaults.
        assert g.theme.choice == "dark" and w.theme_actions["dark"].isChecked()
        assert w.composer.edit.send_with == "ctrl+enter" and w.send_actions["ctrl+enter"].isChecked()
        assert w.overflow_actions["stop"].isChecked() and w.flow.overflow_policy() == "stop"
        want = replace(CHAT_DEFAULTS, temperature=0.0, top_k=7, max_new_tokens=64)
        assert w.flow.sampling() == want
        assert w.flow.draft_messages("hi")[0] == {"role": "system", "content": "Answer in French."}
        assert w.catalog.folder == str(models)
    finally:
        w.close()
        g.close()

    saved = json.loads(paths.settings_file.read_text())
    assert (saved["theme"], saved["send_with"], saved["overflow_policy"]) == ("dark", "ctrl+enter", "stop")
    assert saved["system_prompt"] == "Answer in French." and saved["models_folder"] == str(models)
    assert saved["sampling_saved"] is True  # kept as saved at the next start, whatever the values

    g = build(paths)  # kept across a restart
    try:
        w = g.window
        assert g.theme.choice == "dark" and w.composer.edit.send_with == "ctrl+enter"
        assert w.flow.sampling() == want and w.flow.system_prompt() == "Answer in French."
        assert w.flow.overflow_policy() == "stop"
        assert w.flow.draft_messages("hi")[0] == {"role": "system", "content": "Answer in French."}
        w.show()
        qtbot.waitExposed(w)
        menu_action(w, "File", "Preferences…").trigger()
        dialog = w._preferences_dialog
        qtbot.waitUntil(dialog.isVisible, timeout=TIMEOUT_MS)
        assert dialog.temperature.value() == 0.0 and dialog.models_folder.text() == str(models)
        dialog.buttons.button(QDialogButtonBox.StandardButton.Cancel).click()
        assert not dialog.isVisible()
    finally:
        g.window.close()
        g.close()


# ---- the HUD's exports ------------------------------------------------------------------------------------


def _hud_button(hud, text: str):
    from PySide6.QtWidgets import QPushButton

    return next(b for b in hud.findChildren(QPushButton) if b.text() == text)


def test_hud_export_asks_where_and_writes_there(qtbot, gui, driver, tmp_path):
    target = tmp_path / "out" / "series.json"
    target.parent.mkdir()
    driver.choose_file(target).start()
    _hud_button(gui.hud, "Series JSON…").click()
    assert driver.done
    assert {("ui/hud/panel.py", "ask_save_path"), ("ui/dialogs.py", "ask_save_file")} <= set(driver.answered[0].sites)
    assert driver.answered[0].title == "Export time series"
    assert set(json.loads(target.read_text())) >= {"sources", "steps", "samples"}


def test_hud_export_that_cannot_write_says_so(qtbot, gui, driver, tmp_path):
    target = tmp_path / "no such folder" / "compare.csv"
    driver.choose_file(target).click("OK").start()
    _hud_button(gui.hud, "Export CSV…").click()
    assert driver.done
    box = driver.answered[1]
    assert ("ui/hud/panel.py", "HudPanel._ask") in box.sites
    assert box.title == "Export compare table"
    assert box.text == f"Cannot write the compare table to {target}: the folder {target.parent} does not exist"
    assert not target.exists()


def test_plots_png_asks_the_size_then_where(qtbot, gui, driver, tmp_path):
    from PySide6.QtGui import QImage

    from engine.types import EngineOptions, GenerationMetrics, StepRecord
    from ui.hud.panel import ImageSizeDialog

    hud = gui.hud
    hud.begin_generation("eager", EngineOptions(device="cpu"))
    hud.add_steps(
        StepRecord(t=hud._clock() + i * 0.01, step=i, tokens_total=i, step_ms=9.0, tokens_per_step=1.0)
        for i in range(1, 40)
    )
    hud.end_generation(GenerationMetrics(), EngineOptions(device="cpu"), "eager")

    def size(dialog):
        assert dialog.windowTitle() == "Plots image size"
        dialog.width_box.setValue(640)
        dialog.height_box.setValue(480)
        dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Ok).click()

    target = tmp_path / "plots.png"
    driver.look(ImageSizeDialog, size, close=False).choose_file(target).start()
    _hud_button(hud, "Plots PNG…").click()
    assert driver.done
    assert ("ui/hud/panel.py", "ask_image_size") in driver.answered[0].sites
    assert driver.answered[1].title == "Save plots"
    assert QImage(str(target)).size().toTuple() == (640, 480)

    driver = DialogDriver().look(ImageSizeDialog, lambda d: d.reject(), close=False).start()
    _hud_button(hud, "Plots PNG…").click()  # Cancel: no save dialog follows
    assert driver.done and len(driver.answered) == 1


# ---- start-up ---------------------------------------------------------------------------------------------


def test_a_chat_database_that_cannot_open_says_so_at_start(qtbot, tmp_path, driver, capsys):
    from app.gui import EXIT_USER_ERROR, run_gui

    paths = AppPaths.resolve(tmp_path / "data")
    paths.ensure()
    paths.database.mkdir()  # a folder where the database file should be
    driver.click("OK").start()
    code = run_gui(SimpleNamespace(smoke_test=False, theme="light", model=None), paths)
    assert code == EXIT_USER_ERROR
    box = driver.answered[0]
    assert ("app/gui.py", "run_gui") in box.sites and box.title == "Gapless cannot start"
    assert str(paths.database) in box.text
    assert "gapless: error:" in capsys.readouterr().err


def test_a_data_folder_that_cannot_be_made_says_so_at_start(qtbot, tmp_path, driver, capsys):
    """--data-dir naming a file (or a folder the user cannot write): the app stopped with a line on stderr only,
    which nobody sees who started it from a launcher."""
    from app.gui import EXIT_USER_ERROR, run_gui

    (tmp_path / "not a folder").write_text("kept")
    paths = AppPaths.resolve(tmp_path / "not a folder" / "data")
    driver.click("OK").start()
    code = run_gui(SimpleNamespace(smoke_test=False, theme="light", model=None), paths)
    assert code == EXIT_USER_ERROR
    box = driver.answered[0]
    assert box.title == "Gapless cannot start"
    assert box.text.startswith(f"cannot use {tmp_path / 'not a folder'}") and "as a folder of the app's" in box.text
    assert "gapless: error: cannot use" in capsys.readouterr().err
    assert (tmp_path / "not a folder").read_text() == "kept"


def test_an_answer_stopped_as_the_app_quits_that_the_store_refuses_is_said_once_it_has_closed(
    qtbot, tmp_path, tiny_llama, driver, capsys, monkeypatch
):
    """The window closed mid-answer: the stopped answer's last result comes once the app's loop has returned, as
    the engine stops (GuiApp.close). A save the store refused then opened a non-blocking box on the hidden window,
    with no event loop left to show it: the user never learned that the stopped answer was not saved."""
    from worker_gate import hold_after_first_batch

    import app.gui
    from app.store import StoreError
    from engine.types import SamplingParams

    real_build = app.gui.build
    release = hold_after_first_batch(monkeypatch)
    refused: list[int] = []
    closed: list[bool] = []

    def build_and_answer(*a, **k):
        gui = real_build(*a, **k)
        w, real_update = gui.window, gui.store.update_message

        def update_message(message_id, **fields):  # the last save, with the answer's status, is refused
            if "status" in fields:
                refused.append(message_id)
                raise StoreError("disk I/O error")
            return real_update(message_id, **fields)

        def send(*_loaded):
            w.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=200, seed=0)
            w.composer.set_text("tell me a story")
            w.composer.send_button.click()

        def close_now(_rid, _batch):  # as Ctrl+Q does while the answer streams
            if not closed:
                closed.append(True)
                w.close()
                release.set()

        monkeypatch.setattr(gui.store, "update_message", update_message)
        gui.controller.loaded.connect(send)
        gui.controller.textBatch.connect(close_now)
        return gui

    monkeypatch.setattr(app.gui, "build", build_and_answer)
    driver.click("OK").start()
    paths = AppPaths.resolve(tmp_path / "data")
    code = app.gui.run_gui(SimpleNamespace(smoke_test=False, theme="light", model=str(tiny_llama)), paths)
    assert code == 0 and closed and len(refused) == 1
    said = "The answer could not be saved: disk I/O error"
    assert [(b.title, b.text) for b in driver.answered] == [("Gapless", said)]
    assert ("app/gui.py", "run_gui") in driver.answered[0].sites
    assert f"gapless: {said}" in capsys.readouterr().err.splitlines()


# ---- help and folders ------------------------------------------------------------------------------------


def test_help_lists_the_shortcuts_and_says_what_gapless_is(qtbot, gui, driver):
    from app import __version__

    w = gui.window
    driver.click("Close").start()
    menu_action(w, "Help", "Keyboard shortcuts").trigger()
    qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
    text = driver.answered[0].text
    assert driver.answered[0].title == "Keyboard shortcuts"
    for line in ("Ctrl+N\tNew chat", "Esc\tStop the answer", "Ctrl+F\tSearch chats", "Enter\tSend the message"):
        assert line in text
    driver = DialogDriver().click("Close").start()
    menu_action(w, "Help", "About Gapless").trigger()
    qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
    assert driver.answered[0].title == "About Gapless" and f"Gapless {__version__}" in driver.answered[0].text
    assert not [x for x in QApplication.topLevelWidgets() if isinstance(x, QMessageBox) and x.isVisible()]


def test_file_dialogs_start_in_the_last_folder_used(qtbot, gui, driver, tmp_path):
    w = gui.window
    folder = tmp_path / "my models"
    folder.mkdir()
    bad = folder / "broken.gguf"
    bad.write_bytes(b"not a gguf")
    driver.choose_file(bad).click("OK").start()
    with qtbot.waitSignal(gui.controller.loadFailed, timeout=TIMEOUT_MS):
        w.model_panel.open_file_button.click()
    qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
    assert gui.settings.last_folder == str(folder)
    assert json.loads(gui.paths.settings_file.read_text())["last_folder"] == str(folder)  # kept for the next run
    driver = DialogDriver().choose_file(None).start()  # the HUD's save dialog, cancelled
    _hud_button(gui.hud, "Series CSV…").click()
    assert driver.done and Path(driver.answered[0].folder) == folder
    driver = DialogDriver().choose_file(None).start()
    w.model_panel.open_folder_button.click()
    assert driver.done and Path(driver.answered[0].folder) == folder
    driver = DialogDriver().choose_file(None).start()  # the draft model's, cancelled
    w.toggles.draft_model.menu().actions()[0].trigger()
    assert driver.done and Path(driver.answered[0].folder) == folder
    driver = DialogDriver().choose_file(None).start()  # a chat's import (it opened where the app was started)
    w.import_chat()
    assert driver.done and Path(driver.answered[0].folder) == folder


# ---- chat files and remote models ------------------------------------------------------------------------


def test_a_chat_exported_to_a_file_imports_again(qtbot, gui, driver, tmp_path):
    w, store = gui.window, gui.store
    chat = add_chat(store, "To keep", "the question")
    w.refresh_chats()
    w.chat_list.list.setCurrentRow(w.chat_list.chat_ids().index(chat))
    target = tmp_path / "kept.json"
    driver.choose_file(target).start()
    w.export_chat(False)
    assert driver.done and ("ui/main_window.py", "MainWindow.export_chat") in driver.answered[0].sites
    assert target.exists() and "the question" in target.read_text()
    driver = DialogDriver().choose_file(target).start()
    w.import_chat()
    assert driver.done and ("ui/main_window.py", "MainWindow.import_chat") in driver.answered[0].sites
    assert len(store.list_chats()) == 2 and w.flow.chat_id != chat
    assert [m.content for m in store.thread(w.flow.chat_id)] == ["the question"]
    assert gui.settings.last_folder == str(tmp_path)  # the next file dialog starts there


def test_a_chat_exported_under_a_name_typed_without_a_suffix_gets_its_format_s(qtbot, gui, driver, tmp_path):
    """ "notes" typed in the Markdown export dialog: the chat was written to a file named "notes", and a "notes.md"
    already there was never asked about."""
    w, store = gui.window, gui.store
    chat = add_chat(store, "To keep", "the question")
    w.refresh_chats()
    w.chat_list.list.setCurrentRow(w.chat_list.chat_ids().index(chat))
    folder = tmp_path / "exports"
    folder.mkdir()
    driver.choose_file(folder / "notes").start()
    w.export_chat(True)
    assert driver.done and ("ui/main_window.py", "MainWindow.export_chat") in driver.answered[0].sites
    assert sorted(p.name for p in folder.iterdir()) == ["notes.md"]
    assert "the question" in (folder / "notes.md").read_text(encoding="utf-8")
    (folder / "notes.json").write_text("mine")  # the name with the JSON suffix is the one asked about
    driver = DialogDriver().choose_file(folder / "notes").click("No").choose_file(None).start()
    w.export_chat(False)  # No, then Cancel
    assert driver.done and "notes.json already exists" in driver.answered[1].text
    assert (folder / "notes.json").read_text() == "mine"


def test_a_chat_with_a_long_title_in_any_script_exports_under_the_name_suggested(qtbot, gui, tmp_path):
    """A renamed title of 120 CJK characters (360 bytes): the name the dialog suggests is written (it was longer
    than a file name may be, "File name too long")."""
    w, store = gui.window, gui.store
    title = "長い題名の会話" * 17 + "終"
    chat = add_chat(store, title, "the question")
    gui.settings.last_folder = str(tmp_path)
    w.refresh_chats()
    w.chat_list.list.setCurrentRow(w.chat_list.chat_ids().index(chat))
    driver = DialogDriver().look(QFileDialog, lambda dialog: dialog.accept(), close=False).start()
    w.export_chat(True)
    assert driver.done
    [written] = list(tmp_path.glob("*.md"))
    assert len(written.name.encode()) <= 255 and written.name.startswith("長い題名の会話") and written.suffix == ".md"
    assert "the question" in written.read_text(encoding="utf-8")
    assert not [b for b in QApplication.topLevelWidgets() if isinstance(b, QMessageBox) and b.isVisible()]


def test_the_remote_model_dialog_cancels_with_its_button(qtbot, gui):
    from ui.remote_dialog import RemoteDialog

    asked = []
    gui.window.model_panel.remoteRequested.connect(lambda *a: asked.append(a))

    def cancel(dialog):
        assert dialog.windowTitle() == "Open a remote model"
        dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Cancel).click()

    driver = DialogDriver().look(RemoteDialog, cancel, close=False).start()
    gui.window.model_panel.open_remote_dialog()
    assert driver.done and ("ui/model_panel.py", "ModelPanel.open_remote_dialog") in driver.answered[0].sites
    assert asked == []


def test_the_remote_model_dialog_opens_again_with_what_was_asked(qtbot):
    """A remote model refused (a wrong API key, a server down): the dialog opened empty again, and the address,
    the model's name and the timeout had to be typed anew. The key is never shown again."""
    from ui.model_panel import ModelPanel
    from ui.remote_dialog import RemoteDialog

    panel = ModelPanel()
    qtbot.addWidget(panel)
    asked, shown = [], []
    panel.remoteRequested.connect(lambda *a: asked.append(a))

    def fill(dialog):
        dialog.base_url.setText("http://10.0.0.2:8000/v1/")
        dialog.model.setText("llama3")
        dialog.api_key.setText("sk-wrong")
        dialog.timeout.setValue(30)
        dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Ok).click()

    def look(dialog):
        shown.append((dialog.base_url.text(), dialog.model.text(), dialog.api_key.text(), dialog.timeout.value()))
        dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Cancel).click()

    driver = DialogDriver().look(RemoteDialog, fill, close=False).look(RemoteDialog, look, close=False).start()
    panel.open_remote_dialog()
    panel.open_remote_dialog()
    assert driver.done
    assert asked == [("http://10.0.0.2:8000/v1", "llama3", "sk-wrong", 30.0)]
    assert shown == [("http://10.0.0.2:8000/v1", "llama3", "", 30.0)]


def test_a_models_folder_typed_relative_is_kept_absolute(qtbot, tmp_path, monkeypatch):
    from engine.types import SamplingParams
    from ui.preferences import Preferences, PreferencesDialog

    monkeypatch.chdir(tmp_path)
    dialog = PreferencesDialog(Preferences("system", "enter", SamplingParams(), "", "rolling", None))
    qtbot.addWidget(dialog)
    for name in ("models", "default", "remote:models", "weights.safetensors"):  # not model sources: folders
        (tmp_path / name).mkdir()
        dialog.models_folder.setText(name)
        assert dialog.problem() is None
        assert dialog.preferences().models_folder == str(tmp_path / name)  # the same wherever the app starts


def test_a_saved_models_folder_that_is_gone_does_not_block_other_preferences(qtbot, tmp_path):
    """The models folder on a drive not plugged in: changing the theme was refused until the folder was cleared,
    and the setting lost with it. Left as it was, it is kept; typed anew, it is checked."""
    from engine.types import SamplingParams
    from ui.preferences import Preferences, PreferencesDialog

    gone = str(tmp_path / "usb" / "models")
    dialog = PreferencesDialog(Preferences("system", "enter", SamplingParams(), "", "rolling", gone))
    qtbot.addWidget(dialog)
    dialog.theme.setCurrentIndex(dialog.theme.findData("dark"))
    dialog.buttons.button(QDialogButtonBox.StandardButton.Ok).click()
    assert dialog.result() == dialog.DialogCode.Accepted
    assert dialog.preferences().theme == "dark" and dialog.preferences().models_folder == gone
    dialog.models_folder.setText(str(tmp_path / "elsewhere"))
    assert "does not exist" in dialog.problem()


def test_a_models_folder_that_is_gone_is_said_to_be_away(qtbot, tmp_path, monkeypatch):
    """Its section in the Models menu said "no models found", as for an empty folder. A folder under "~" (the
    settings may say so; the scan reads it as the home's) is there."""
    from app.registry import default_model_entry
    from ui.model_panel import ModelPanel

    monkeypatch.setenv("HOME", str(tmp_path))
    panel = ModelPanel()
    qtbot.addWidget(panel)
    for folder, said in (
        (tmp_path, "no models found"),
        (tmp_path / "usb", "folder not found"),
        ("~", "no models found"),
    ):
        panel.set_models(default_model_entry(), [], [], str(folder))
        texts = [a.text() for a in panel.recent_button.menu().actions()]
        assert said in texts and texts.index(said) == texts.index(f"In {folder}") + 1


def test_a_model_or_folder_named_with_an_ampersand_shows_it_in_the_models_menu(qtbot, tmp_path):
    """Qt reads "&" in a menu entry as the mark of the next letter's Alt key: a recent "Q&A.gguf" was listed as
    "QA.gguf" with the A underlined (and Alt+A in the menu opened it), a folder "R&D" as "In RD"."""
    from PySide6.QtGui import QKeySequence

    from app.registry import ModelEntry, default_model_entry
    from ui.model_panel import ModelPanel

    panel = ModelPanel()
    qtbot.addWidget(panel)
    folder = tmp_path / "R&D"
    folder.mkdir()
    recent = ModelEntry(str(folder / "Q&A.gguf"), "Q&A.gguf", "gguf", str(folder / "Q&A.gguf"), False, note="missing")
    scanned = ModelEntry(str(folder / "A&B.gguf"), "A&B.gguf", "gguf", str(folder / "A&B.gguf"), True)
    panel.set_models(default_model_entry(), [recent], [scanned], str(folder))
    menu = panel.recent_button.menu()
    texts = [a.text() for a in menu.actions()] + [a.text() for a in panel.forget_menu.actions()]
    for shown in ("Q&A.gguf (missing)", "A&B.gguf", f"In {folder}"):
        entries = [t for t in texts if t.replace("&&", "&") == shown]
        assert entries, (shown, texts)
        assert all(QKeySequence.mnemonic(t).isEmpty() for t in entries)  # no letter taken for an Alt key


def test_a_theme_given_for_this_run_is_not_saved_by_preferences_left_as_they_were(qtbot, tmp_path):
    paths = AppPaths.resolve(tmp_path / "data")
    paths.ensure()
    paths.settings_file.write_text(json.dumps({"theme": "light"}))
    g = build(paths, theme_choice="dark")  # gapless gui --theme dark
    try:
        w = g.window
        w.apply_preferences(w.current_preferences())  # OK without touching the theme
        assert g.theme.choice == "dark" and json.loads(paths.settings_file.read_text())["theme"] == "light"
        chosen = replace(w.current_preferences(), theme="system")
        w.apply_preferences(chosen)  # a theme chosen in the dialog is the user's own
        assert g.theme.choice == "system" and json.loads(paths.settings_file.read_text())["theme"] == "system"
    finally:
        g.window.close()
        g.close()
