"""The Optimizations panel's draft model: chosen with a file dialog (speculation then drafts with it), the engine's
refusal of it shown under it, another choice tried afresh, and "None" turning draft speculation off."""

from __future__ import annotations

from PySide6.QtGui import QStandardItemModel
from PySide6.QtWidgets import QFileDialog
from toggles_driver import pick, toggles_panel

from engine.types import EngineOptions


def draft_entry_enabled(panel) -> bool:
    combo = panel.speculation
    model = combo.model()
    assert isinstance(model, QStandardItemModel)
    return model.item(combo.findData("draft")).isEnabled()


def test_a_draft_model_is_chosen_refused_with_the_reason_and_chosen_again(qtbot, tmp_path, monkeypatch):
    panel, emitted = toggles_panel(qtbot, EngineOptions(device="cpu"))
    assert panel.draft_model.text().startswith("None") and not panel.no_draft_action.isEnabled()
    first, second = tmp_path / "mismatch.gguf", tmp_path / "models" / "draft.gguf"
    chosen = iter([str(first), str(second)])
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (next(chosen), "GGUF models (*.gguf)"))
    file_action = panel.draft_model.menu().actions()[0]
    assert file_action.text() == "GGUF file…"

    file_action.trigger()
    asked = emitted[-1]
    assert (asked.speculation, asked.draft_model) == ("draft", str(first))
    assert panel.draft_model.text() == "mismatch.gguf" and panel.draft_model.toolTip() == str(first)
    assert panel.last_folder == str(tmp_path)  # the next dialog starts there

    why = "the draft model's vocabulary has 365 entries and the target's 320"
    panel.set_applied(asked, {"speculation": why})
    assert panel.options.speculation == "off" and emitted[-1].speculation == "off"  # what runs is shown
    assert panel.options.draft_model == str(first)  # kept, with why it does not draft
    assert not panel.draft_reason.isHidden() and panel.draft_reason.text() == f"Not drafting: {why}"
    assert not draft_entry_enabled(panel)

    file_action.trigger()  # another model: tried afresh
    assert (emitted[-1].speculation, emitted[-1].draft_model) == ("draft", str(second))
    assert draft_entry_enabled(panel) and panel.draft_reason.isHidden()
    panel.set_applied(emitted[-1], {})
    assert panel.options.speculation == "draft" and panel.draft_model.text() == "draft.gguf"

    panel.no_draft_action.trigger()
    assert (emitted[-1].speculation, emitted[-1].draft_model) == ("off", "")
    assert panel.draft_model.text().startswith("None") and not panel.no_draft_action.isEnabled()


def test_a_cancelled_file_dialog_changes_nothing(qtbot, monkeypatch):
    panel, emitted = toggles_panel(qtbot, EngineOptions(device="cpu", speculation="ngram"))
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: ("", ""))
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: "")
    for action in panel.draft_model.menu().actions()[:2]:
        action.trigger()
    assert emitted == [] and panel.options.speculation == "ngram" and panel.options.draft_model == ""


def test_draft_picked_without_a_draft_model_says_why_it_was_not_applied(qtbot):
    """The engine refuses draft speculation with no draft model: the panel goes back to what runs and its note says
    why, not 'Ready' with the reason only in a disabled entry's tooltip."""
    panel, emitted = toggles_panel(qtbot, EngineOptions(device="cpu"))
    panel.speculation.setCurrentIndex(panel.speculation.findData("draft"))
    panel.speculation.activated.emit(panel.speculation.currentIndex())
    asked = emitted[-1]
    assert asked.speculation == "draft" and asked.draft_model == ""
    why = "no draft model chosen (the Draft model control, or --draft-model PATH)"
    panel.set_applied(asked, {"speculation": why})
    assert panel.options.speculation == "off" and emitted[-1].speculation == "off"  # the replacement, sent in turn
    assert panel.note.text() == f"Not applied: speculation draft: {why}"
    panel.set_applied(emitted[-1], {})  # its reply: ready, and still saying what was refused
    assert panel.note.text() == f"Ready: the next answer uses these options. Not applied: speculation draft: {why}"
    panel.kv_cache.setCurrentIndex(panel.kv_cache.findData("dynamic"))  # the user's next choice
    panel.kv_cache.activated.emit(panel.kv_cache.currentIndex())
    panel.set_applied(emitted[-1], {})
    assert panel.note.text() == "Ready: the next answer uses these options."


def test_a_model_that_refuses_the_draft_does_not_turn_drafting_off_for_the_next(qtbot, tmp_path, tiny_factory):
    """Opening a model of another vocabulary refused the draft model, rightly; the panel's replacement (speculation
    off) was saved as the user's choice, so the model the draft was chosen for no longer drafted when opened again."""
    from test_main_window import TIMEOUT_MS, close_app, open_app

    target = tiny_factory("llama")
    draft = tiny_factory("llama", seed=1, num_hidden_layers=1)
    other = tiny_factory("llama", vocab_size=300)
    gui = open_app(qtbot, tmp_path / "data", target)
    w = gui.window
    try:
        with qtbot.waitSignal(gui.controller.reconfigured, timeout=TIMEOUT_MS):
            w.toggles.set_draft_model(str(draft))
        saved = lambda: {k: w.settings.engine_options[k] for k in ("speculation", "draft_model")}  # noqa: E731
        assert saved() == {"speculation": "draft", "draft_model": str(draft)}
        with qtbot.waitSignal(gui.controller.loaded, timeout=TIMEOUT_MS):
            w.load_model(str(other))
        qtbot.waitUntil(lambda: w.toggles.options.speculation == "off", timeout=TIMEOUT_MS)
        assert "vocabulary" in w.toggles.draft_reason.text()  # refused here, and said
        qtbot.wait(200)  # the replacement's own reply
        assert saved() == {"speculation": "draft", "draft_model": str(draft)}  # the user's choice, kept
        with qtbot.waitSignal(gui.controller.reconfigured, timeout=TIMEOUT_MS):  # another option chosen here
            pick(w.toggles.sampling, "host")
        assert saved() == {"speculation": "draft", "draft_model": str(draft)}  # still the user's, not the stand-in
        assert w.settings.engine_options["sampling"] == "host"
        with qtbot.waitSignal(gui.controller.loaded, timeout=TIMEOUT_MS):
            w.load_model(str(target))
        qtbot.waitUntil(lambda: w.toggles.options.speculation == "draft", timeout=TIMEOUT_MS)
    finally:
        close_app(gui)
