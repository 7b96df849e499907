"""The window as a new user meets it, on a tiny random model: what it shows is what is in force (precision,
candidates' own figures, errors that still hold), and a right-click never shows another chat's messages."""

from __future__ import annotations

import pytest
from dialog_driver import DialogDriver
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QMenu
from test_main_window import TIMEOUT_MS, close_app, open_app, send

from engine.types import SamplingParams, options_as_run


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
    driver = DialogDriver().click("OK").start()  # the error box, as the user closes it
    with qtbot.waitSignal(app.controller.loadFailed, timeout=TIMEOUT_MS):
        w.load_model(str(empty))
    qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
    assert w.model_panel.error.isVisibleTo(w) and "no-weights" in w.model_panel.error.text()
    assert w.model_panel.status.text() == f"Still using {app.controller.info.name}"
    send(qtbot, app, "still here")
    assert not w.model_panel.error.isVisibleTo(w)
    assert w.model_panel.status.text() == "Ready"


def shown_texts(view) -> list[str]:
    """The message bodies painted in the conversation now: its visible message widgets, top to bottom."""
    from ui.message import MessageWidget

    widgets = [m for m in view.widget().findChildren(MessageWidget) if m.isVisible()]
    return [m.body.text for m in sorted(widgets, key=lambda m: m.y())]


def test_right_clicking_another_chat_leaves_the_open_one_on_screen(qtbot, tmp_path):
    from dialog_driver import right_click

    gui = open_app(qtbot, tmp_path / "data")
    try:
        w, store = gui.window, gui.store
        chats = {}
        for title in ("first", "second"):
            chat = store.create_chat(title, "", None)
            user = store.add_message(chat.id, "user", f"{title} question", None)
            store.add_message(chat.id, "assistant", f"{title} answer", user.id)
            chats[title] = chat.id
        w.refresh_chats()
        w.chat_list.list.setCurrentRow(w.chat_list.chat_ids().index(chats["first"]))
        qtbot.waitUntil(lambda: shown_texts(w.chat_view) == ["first question", "first answer"], timeout=TIMEOUT_MS)

        seen: list = []
        driver = DialogDriver().look(QMenu, lambda _menu: seen.append((w.flow.chat_id, shown_texts(w.chat_view))))
        driver.start()
        row = w.chat_list.list.item(w.chat_list.chat_ids().index(chats["second"]))
        right_click(w.chat_list.list.viewport(), w.chat_list.list.visualItemRect(row).center())
        qtbot.waitUntil(lambda: driver.done, timeout=TIMEOUT_MS)
        assert seen == [(chats["first"], ["first question", "first answer"])]  # while the menu is up
        qtbot.wait(50)
        assert w.flow.chat_id == chats["first"] and w.chat_list.current_id() == chats["first"]
        assert shown_texts(w.chat_view) == ["first question", "first answer"]
        qtbot.mouseClick(
            w.chat_list.list.viewport(), Qt.MouseButton.LeftButton, pos=w.chat_list.list.visualItemRect(row).center()
        )  # a left click opens it
        assert w.flow.chat_id == chats["second"]
        qtbot.waitUntil(lambda: shown_texts(w.chat_view) == ["second question", "second answer"], timeout=TIMEOUT_MS)
    finally:
        close_app(gui)


def test_candidates_finish_one_by_one_and_the_chosen_one_shows_its_own_tokens(qtbot, app):
    w = app.window
    with qtbot.waitSignal(app.controller.reconfigured, timeout=TIMEOUT_MS):
        w.toggles.candidates.setValue(3)
    w.flow.default_sampling = SamplingParams(temperature=1.0, max_new_tokens=120, seed=11)
    first = send(qtbot, app, "hello")
    # A stop string that candidate 0 says early and the others never say: it ends long before them.
    text0, others = first.texts[0], first.texts[1:]
    stop = next(
        text0[i : i + 4]
        for i in range(1, len(text0) // 3)
        if text0[i : i + 4].strip()
        and text0[i : i + 4] not in text0[: i + 3]
        and all(text0[i : i + 4] not in t for t in others)
    )
    w.new_chat()
    w.flow.default_sampling = SamplingParams(temperature=1.0, max_new_tokens=120, seed=11, stop=(stop,))

    seen = []

    def on_ended(_rid, ended):
        tabs = w.chat_view.candidate_tabs()
        seen.append((dict(ended), [s.text() for s in tabs.stats]))

    app.controller.rowsFinished.connect(on_ended)  # after the window's own slot: it sees what the user sees
    result = send(qtbot, app, "hello")
    assert result.finish_reasons[0] == "stop" and result.finish_reasons[1:] == ["length", "length"]
    first_ended, shown = seen[0]
    assert first_ended == {0: "stop"}
    assert shown[0] == "Finished: stop string · waiting for the other candidates…"
    assert shown[1:] == ["generating…", "generating…"]
    assert sorted(k for ended, _ in seen for k in ended) == [0, 1, 2]

    tabs = w.chat_view.candidate_tabs()
    assert tabs.stats[0].text().endswith(" · stop string") and tabs.stats[1].text().endswith(" · token limit")
    assert [s.text().split(" · ")[0] for s in tabs.stats] == [
        f"{n} of {result.metrics.new_tokens_total} tokens in the batch" for n in result.metrics.new_tokens
    ]
    assert w.status.text().startswith("3 candidates: pick one")
    tabs.copy_buttons[2].click()  # a candidate's text without choosing it
    assert QGuiApplication.clipboard().text() == result.texts[2] and w.flow.awaiting_choice()
    tabs.use_buttons[0].click()
    assert w.status.text() == ""
    footer = w.chat_view.messages()[-1].stats_label.text()
    own, total = result.metrics.new_tokens[0], result.metrics.new_tokens_total
    assert own < total and footer.startswith(f"{own} of {total} tokens in the batch")


def test_greedy_candidates_say_they_are_one_answer_and_still_ask_for_a_choice(qtbot, app):
    """Candidates at temperature 0 are the same answer in every tab: three copies came without a word, and the
    status line asked which to keep."""
    w = app.window
    with qtbot.waitSignal(app.controller.reconfigured, timeout=TIMEOUT_MS):
        w.toggles.candidates.setValue(3)
    w.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=8, seed=1)
    result = send(qtbot, app, "hello")
    assert result.token_ids == [result.token_ids[0]] * 3
    status = w.status.text()
    assert status.startswith("the 3 candidates are one answer 3 times: greedy decoding (temperature 0)"), status
    assert status.endswith(" · 3 candidates: pick one with “Use this answer” to continue from it"), status
    w.chat_view.candidate_tabs().use_buttons[1].click()
    assert w.status.text() == ""


def test_the_stats_line_says_why_an_answer_ended_also_after_a_restart(qtbot, tmp_path, tiny_factory):
    small = tiny_factory("llama", max_position_embeddings=48)  # a 48-token context
    gui = open_app(qtbot, tmp_path / "data", small)
    try:
        w = gui.window
        w.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=6, seed=0)
        result = send(qtbot, gui, "hello")
        assert result.finish_reasons == ["length"]
        assert w.chat_view.messages()[-1].stats_label.text().endswith(" · token limit")
        w.flow.set_chat_settings("", SamplingParams(temperature=0.0, max_new_tokens=200, seed=0))
        result = send(qtbot, gui, "and more")  # fewer than 200 tokens fit in what is left of the context
        assert result.finish_reasons == ["length"] and result.metrics.new_tokens_total < 200
        assert any("by the 48-token context" in n for n in result.notices)
        assert w.chat_view.messages()[-1].stats_label.text().endswith(" · context full")
        chat_id = w.flow.chat_id
    finally:
        close_app(gui)
    gui = open_app(qtbot, tmp_path / "data")
    try:
        w = gui.window
        w.chat_list.list.setCurrentRow(w.chat_list.chat_ids().index(chat_id))
        lines = [m.stats_label.text() for m in w.chat_view.messages() if m.item.role == "assistant"]
        assert [line.rsplit(" · ", 1)[1] for line in lines] == ["token limit", "context full"]
        assert "Finished: context full" in w.chat_view.messages()[-1].stats_label.toolTip()
    finally:
        close_app(gui)


def test_the_static_kv_cache_preset_is_named_for_what_it_does(qtbot, app):
    preset = app.window.toggles.preset
    labels = {preset.itemData(i): preset.itemText(i) for i in range(preset.count())}
    assert labels["first-fixes"] == "+ static KV cache"  # the key scripts use stays
    assert all(text == "Naive" or text == "Custom" or text.startswith("+ ") for text in labels.values())


def test_what_cannot_run_here_is_unavailable_from_the_start_with_the_reason_in_view(qtbot, app):
    w, t = app.window, app.window.toggles
    # Right after the load, before anything was clicked: this CPU-only machine runs no CUDA graph.
    assert not t.cuda_graph.isEnabled() and not t.cuda_graph.isChecked()
    reason = t.reasons["cuda_graph"]
    assert reason.isVisibleTo(w) and "CUDA graphs need a CUDA device" in reason.text()
    cuda = t.device.findData("cuda")
    assert not t.device.model().item(cuda).isEnabled()
    assert t.reasons["device"].isVisibleTo(w) and "CUDA is not available" in t.reasons["device"].text()
    assert not t.reasons["compile"].isVisibleTo(w) and t.compile.isEnabled()  # compile runs on a CPU
    labels = {t.preset.itemData(i): i for i in range(t.preset.count())}
    assert not t.preset.model().item(labels["cuda-graph"]).isEnabled()
    assert "CUDA" in t.preset.model().item(labels["cuda-graph"]).toolTip()
    assert t.preset.model().item(labels["candidates"]).isEnabled()  # candidates run on a CPU, without the graph

    # On a CPU the candidates preset is what the ladder runs there: no compile, so nothing to ask first
    with qtbot.waitSignal(app.controller.reconfigured, timeout=TIMEOUT_MS):
        t.preset.setCurrentIndex(labels["candidates"])
        t.preset.activated.emit(labels["candidates"])
    assert t.options.candidates > 1 and not t.options.cuda_graph and not t.options.compile
    assert app.controller.options == t.options
    assert t.preset.currentData() == "candidates"
    assert not t.cuda_graph.isEnabled() and t.reasons["cuda_graph"].isVisibleTo(w)


def long_chat(store) -> int:
    chat = store.create_chat("long", "", None)
    parent = None
    for i in range(4):
        user = store.add_message(chat.id, "user", f"question {i} " + "with many words " * 40, parent)
        answer = store.add_message(
            chat.id, "assistant", f"answer {i} " + "a long reply that has to wrap " * 40, user.id
        )
        parent = answer.id
    return chat.id


def assert_fits(w) -> None:
    """Nothing of the conversation is cut off: each message and its buttons lie inside the visible column."""
    from PySide6.QtCore import QPoint
    from PySide6.QtWidgets import QToolButton

    view = w.chat_view
    port = view.viewport()
    assert view.widget().width() <= port.width()
    assert not view.horizontalScrollBar().isVisible()
    for m in view.messages():
        right = m.mapTo(port, QPoint(m.width(), 0)).x()
        assert right <= port.width(), (right, port.width())
        for b in m.findChildren(QToolButton):
            if b.isVisible():
                assert b.mapTo(port, QPoint(b.width(), 0)).x() <= port.width()
        assert m.body.width() <= port.width()


@pytest.fixture
def wide(monkeypatch):
    """The window opens at its full first size, as on a screen wider than it (the test platform's is 800x800)."""
    import ui.main_window

    monkeypatch.setattr(ui.main_window, "first_size", lambda _free: ui.main_window.FIRST_SIZE)


@pytest.mark.parametrize("size", [(1000, 700), (800, 600)])
def test_a_narrow_window_wraps_the_conversation_and_wide_again_gives_the_panels_back(qtbot, tmp_path, size, wide):
    from ui.main_window import CENTER_MIN_WIDTH, DOCK_MIN_WIDTH, LEFT_MIN_WIDTH

    gui = open_app(qtbot, tmp_path / "data")
    try:
        w = gui.window
        chat = long_chat(gui.store)
        w.refresh_chats()
        w.chat_list.list.setCurrentRow(w.chat_list.chat_ids().index(chat))
        wide_dock = w.options_dock.width()
        w.resize(*size)
        qtbot.waitUntil(lambda: w.width() == size[0] and w.height() == size[1], timeout=TIMEOUT_MS)
        # the long conversation scrolls instead (once rendered and the docks fitted to the new width)
        qtbot.waitUntil(lambda: w.chat_view.verticalScrollBar().isVisible(), timeout=TIMEOUT_MS)
        qtbot.wait(100)
        assert_fits(w)
        left, center = w.splitter.sizes()
        assert left >= LEFT_MIN_WIDTH and center >= CENTER_MIN_WIDTH
        assert w.options_dock.width() >= DOCK_MIN_WIDTH and w.hud_dock.width() >= DOCK_MIN_WIDTH
        # the optimizations take one column where two would not fit the dock: nothing scrolls sideways
        scroll = w.options_dock.widget()
        qtbot.waitUntil(lambda: not scroll.horizontalScrollBar().isVisible(), timeout=TIMEOUT_MS)
        assert w.toggles.width() <= scroll.viewport().width()
        assert w.toggles.columns == 1 or size[0] > 800  # at 800 px the dock is far narrower than two columns
        text_height = w.chat_view.messages()[1].body.height()
        w.resize(1440, 900)
        qtbot.waitUntil(lambda: abs(w.options_dock.width() - wide_dock) <= 8, timeout=TIMEOUT_MS)
        qtbot.waitUntil(lambda: w.toggles.columns == 2, timeout=TIMEOUT_MS)  # two again, where they fit
        assert_fits(w)
        assert w.chat_view.messages()[1].body.height() < text_height  # wider lines, fewer of them
    finally:
        close_app(gui)


@pytest.mark.parametrize("share", [0.5, 0.3])
def test_the_window_fits_a_short_screen(qtbot, tmp_path, monkeypatch, share):
    """The Optimizations dock was as tall as all its options, whatever the screen: a laptop at 150 % (600 px of
    height) or a large font made the window's least height more than the screen's. The options now take at most
    a share of the screen's height and scroll down the rest."""
    import ui.main_window as main_window

    monkeypatch.setattr(main_window, "FIT_SCREEN_SHARE", share)
    gui = open_app(qtbot, tmp_path / "data")
    try:
        w = gui.window
        screen = w.screen().availableGeometry().height()
        scroll = w.options_dock.widget()
        scroll.resize(scroll.width(), scroll.height() + 1)  # fitted again under this share
        qtbot.waitUntil(lambda: scroll.minimumHeight() <= share * screen, timeout=TIMEOUT_MS)
        assert w.minimumSizeHint().height() <= screen
        taller = w.toggles.height() > scroll.minimumHeight()
        wanted = Qt.ScrollBarPolicy.ScrollBarAsNeeded if taller else Qt.ScrollBarPolicy.ScrollBarAlwaysOff
        assert scroll.verticalScrollBarPolicy() == wanted and (taller or share == 0.5)
        assert w.toggles.width() <= scroll.viewport().width()  # nothing hidden sideways
    finally:
        close_app(gui)


def test_saved_splitter_sizes_that_no_longer_fit_are_dropped(qtbot, tmp_path, wide):
    import json

    from ui.main_window import fitting_sizes

    assert fitting_sizes([300, 600], [180, 280], 930) == [300, 600]
    assert fitting_sizes([900, 1200], [180, 280], 930) is None
    assert fitting_sizes([100, 800], [180, 280], 930) is None and fitting_sizes("x", [180, 280], 930) is None
    data = tmp_path / "data"
    for saved, kept in (([900, 1200], False), ([300, 500], True)):
        gui = open_app(qtbot, data)
        settings_file = gui.paths.settings_file
        close_app(gui)
        doc = json.loads(settings_file.read_text())
        doc["splitter_sizes"] = {"main": saved}
        doc["window_geometry"] = doc["window_state"] = None  # the window opens at its own size, whatever the screen
        settings_file.write_text(json.dumps(doc))
        gui = open_app(qtbot, data)
        try:
            w = gui.window
            qtbot.waitUntil(lambda w=w: w._splitter_fitted, timeout=TIMEOUT_MS)
            sizes = w.splitter.sizes()
            assert (sizes[0] == saved[0]) is kept
            assert sum(sizes) <= w.splitter.width() and sizes[0] >= 180 and sizes[1] >= 280
        finally:
            close_app(gui)


def test_the_hud_and_the_stats_tooltip_say_what_limits_the_answer(qtbot, app):
    from engine.diagnosis import diagnose

    w = app.window
    w.flow.default_sampling = SamplingParams(temperature=0.0, max_new_tokens=24, seed=0)
    result = send(qtbot, app, "hello")
    m, o = result.metrics.to_dict(), options_as_run(result.options, result.unavailable, result.limits)
    d = diagnose(m, o, "cpu")
    assert m["kernel_gap_pct"] is not None, m["unavailable"]  # the traced window measured the op gap
    assert d.verdict.startswith("CPU") and d.evidence and d.next_step
    label = app.hud.bars.diagnosis
    assert label.isVisibleTo(app.hud) and label.text() == f"Limit: {d.line}"
    assert d.evidence[0] in label.toolTip()
    tip = w.chat_view.messages()[-1].stats_label.toolTip()
    assert f"Diagnosis: {d.line}" in tip and f"  from {d.evidence[0]}" in tip


def test_turning_compile_on_on_a_cpu_says_first_that_it_takes_minutes(qtbot, app):
    t = app.window.toggles
    sent = []
    t.optionsChanged.connect(sent.append)
    driver = DialogDriver().click("Cancel").start()
    t.compile.click()
    assert driver.done and "takes minutes" in driver.answered[0].text
    assert sent == [] and not t.compile.isChecked() and not t.options.compile
    driver = DialogDriver().click("Compile anyway").start()
    with qtbot.waitSignal(app.controller.reconfigured, timeout=TIMEOUT_MS):
        t.compile.click()
    assert driver.done and sent[-1].compile and t.compile.isChecked()
    assert app.controller.options.compile


def test_a_window_sized_before_it_is_shown_gives_its_panels_their_share(qtbot, tmp_path):
    """Sized to 1440 x 900 before it first shows (a saved size, or a script's), the window's right panels take
    their share of that width, not of the size it was built at: nothing in them is cut off at the right."""
    from app.gui import build
    from app.paths import AppPaths
    from ui.main_window import DOCK_SHARE

    gui = build(AppPaths.resolve(tmp_path / "data"), "light")
    w = gui.window
    try:
        w.resize(1440, 900)
        w.show()
        qtbot.waitUntil(lambda: abs(w.options_dock.width() - DOCK_SHARE * 1440) <= 12, timeout=TIMEOUT_MS)
    finally:
        close_app(gui)


def test_a_taller_window_gives_its_height_to_the_hud(qtbot, tmp_path):
    """The optimizations keep what they need; the performance HUD takes the rest, however the window was sized
    before (a shrink and a grow used to leave the extra height to the optimizations, and the HUD smaller)."""
    gui = open_app(qtbot, tmp_path / "data")
    w = gui.window
    try:
        for size in [(1400, 900), (1000, 700), (1440, 1000)]:
            w.resize(*size)
            qtbot.waitUntil(lambda size=size: (w.width(), w.height()) == size, timeout=TIMEOUT_MS)
            # what they need at the width they get (one column of controls in a narrow dock is taller)
            qtbot.waitUntil(
                lambda: w.options_dock.height() <= w.options_dock.minimumSizeHint().height() + 16, timeout=TIMEOUT_MS
            )
        qtbot.waitUntil(lambda: w.hud_dock.height() > 600, timeout=TIMEOUT_MS)
    finally:
        close_app(gui)


def test_hiding_a_panel_gives_its_height_back_to_the_hud(qtbot, tmp_path):
    """View > Server shown and hidden again left its height to the optimizations, a blank gap under them."""
    gui = open_app(qtbot, tmp_path / "data")
    w = gui.window
    try:
        w.resize(1400, 875)
        qtbot.waitUntil(lambda: (w.width(), w.height()) == (1400, 875), timeout=TIMEOUT_MS)
        fitted = lambda: w.options_dock.height() <= w.options_dock.minimumSizeHint().height() + 16  # noqa: E731
        qtbot.waitUntil(fitted, timeout=TIMEOUT_MS)
        for dock in (w.server_dock, w.server_dock, w.hud_dock, w.hud_dock, w.server_dock):
            dock.toggleViewAction().trigger()
            qtbot.wait(50)
            if w.hud_dock.isVisible():  # the optimizations alone fill the column
                qtbot.waitUntil(fitted, timeout=TIMEOUT_MS)
    finally:
        close_app(gui)


def test_the_smallest_window_cuts_off_none_of_the_model_panel_s_figures(qtbot, tmp_path, tiny_llama):
    """The left column's least width was a fixed 220 px, which overrode what its contents need: at the smallest
    window the model panel's figures were cut off ("15.121 ms/to", the name "SmolLM2-135")."""
    from dataclasses import replace

    gui = open_app(qtbot, tmp_path / "data", tiny_llama)
    try:
        w, panel = gui.window, gui.window.model_panel
        panel.set_info(replace(panel.info, name="SmolLM2-135M-Instruct.Q4_1", memory_floor_ms=15.121))
        w.resize(300, 300)  # as small as the window goes
        qtbot.wait(100)
        assert panel.values["floor"].text() == "15.121 ms/token"
        for key, value in panel.values.items():
            assert value.width() >= value.minimumSizeHint().width(), key
    finally:
        close_app(gui)


def test_a_long_address_or_message_in_the_model_panel_does_not_widen_the_window(qtbot, tmp_path, tiny_llama):
    """The left column is as wide as the model panel's figures need, not as its longest line: a remote model's
    address ("https://my-resource.openai.azure.com/openai/deployments/gpt-4o-mini/v1" made the window's least
    width 1,140 px), a file name being loaded, or a path in a load error took the window wider, past the screen
    for a long one."""
    from dataclasses import replace

    gui = open_app(qtbot, tmp_path / "data", tiny_llama)
    try:
        w, panel = gui.window, gui.window.model_panel
        left = w._panes[0]
        panel.set_info(replace(panel.info, memory_floor_ms=15.121))
        qtbot.wait(50)
        least = left.minimumSizeHint().width()
        long_url = "https://my-resource.openai.azure.com/openai/deployments/gpt-4o-mini-2024-07-18-long/v1"
        panel.set_info(replace(panel.info, device=long_url, backend="remote", memory_floor_ms=15.121))
        panel.set_loading("/home/someone/models/qwen2.5_coder_32b_instruct_q4_k_m_imatrix_calibrated_v2.gguf")
        qtbot.wait(50)
        assert left.minimumSizeHint().width() == least
        path = "/home/someone/models/bartowski/Meta-Llama-3.1-8B-Instruct-GGUF/Meta_Llama_3.1_8B_Instruct_Q4_K_M.gguf"
        panel.set_failed(path, f"cannot read {path}: [Errno 13] Permission denied")
        qtbot.wait(50)
        assert left.minimumSizeHint().width() == least
        w.resize(300, 300)  # as small as the window goes: the figures are still whole
        qtbot.wait(100)
        assert w.width() < 1000
        floor = panel.values["floor"]
        assert floor.text() == "15.121 ms/token" and floor.width() >= floor.minimumSizeHint().width()
    finally:
        close_app(gui)


def test_a_wrapped_model_name_keeps_every_line_in_a_short_window(qtbot, tmp_path, tiny_llama):
    """The grid gave the wrapping name one line's height once the left column was short (a short window, or any
    window at a scale of 200 %): "SmolLM2-135M-Instruct.Q4_1" showed as "SmolLM2-135M-", or "Q4_1" as "Q4 1"."""
    from dataclasses import replace

    gui = open_app(qtbot, tmp_path / "data", tiny_llama)
    try:
        w, panel = gui.window, gui.window.model_panel
        panel.set_info(replace(panel.info, name="SmolLM2-135M-Instruct.Q4_1"))
        name, family = panel.values["name"], panel.values["family"]
        for size in ((1366, 768), (900, 450), (300, 300)):
            w.resize(*size)
            qtbot.wait(100)
            need = name.heightForWidth(name.width())
            assert need >= 2 * name.fontMetrics().height() - 2, size  # it wraps at this width
            assert name.height() >= need, (size, name.height(), need)
            assert family.geometry().top() >= name.geometry().bottom(), size  # and the next row starts below it
    finally:
        close_app(gui)
