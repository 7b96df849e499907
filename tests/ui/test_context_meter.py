"""The context meter under the composer: counted by the engine off the GUI thread as the user types, equal to
the prompt tokens the engine then feeds, and warning near and over the limit with what the policy will drop."""

from __future__ import annotations

import threading

import pytest
from PySide6.QtCore import Qt
from test_main_window import TIMEOUT_MS
from test_overflow_gui import long_history

from engine.engine import Engine
from engine.types import ContextUse


def fresh_count(qtbot, w, draft: str):
    """Type `draft` (replacing the box) and wait for the meter's count of it (counts of older text are dropped)."""
    before = w.composer.context_use
    w.composer.set_text(draft)
    qtbot.waitUntil(
        lambda: w.composer.context_use is not None and w.composer.context_use is not before, timeout=TIMEOUT_MS
    )
    return w.composer.context_use


def test_the_meter_equals_the_prompt_tokens_the_engine_feeds(qtbot, app):
    w = app.window
    for draft in ("hello there", "and a second, longer question about the quick brown fox?"):
        use = fresh_count(qtbot, w, draft)
        assert use.tokens == use.prompt_tokens and use.cut == ""
        assert w.composer.meter.text().startswith(f"Context: {use.tokens:,} of {use.context_length:,} tokens")
        assert w.composer.meter_level() == "ok" and w.composer.meter.isVisible()
        with qtbot.waitSignal(app.controller.generationFinished, timeout=TIMEOUT_MS) as blocker:
            qtbot.keyClick(w.composer.edit, Qt.Key.Key_Return)
        qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
        assert blocker.args[1].metrics.prompt_tokens == use.tokens


def test_over_the_limit_it_says_what_the_policy_will_drop_and_the_engine_agrees(qtbot, app):
    w = app.window
    long_history(app)
    use = fresh_count(qtbot, w, "the final question: Paris?")
    assert use.tokens > use.budget and use.policy == "rolling" and "oldest messages dropped" in use.cut
    assert w.composer.meter_level() == "over"
    assert w.composer.meter.text().endswith(f" — over the limit, so when sent: {use.cut}")
    with qtbot.waitSignal(app.controller.generationFinished, timeout=TIMEOUT_MS) as blocker:
        qtbot.keyClick(w.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not w.flow.generating, timeout=TIMEOUT_MS)
    m = blocker.args[1].metrics
    assert m.prompt_tokens == use.prompt_tokens and m.prompt_cut == use.cut


def test_over_the_limit_the_meter_says_what_this_policy_does_to_this_conversation(qtbot, app):
    """A single message too long under rolling is cut, nothing is dropped; a refusal under truncate-middle is not
    'this chat stops at the limit'."""
    from engine.types import ContextUse

    composer = app.window.composer
    cut = "the last message was cut to its last 216 tokens"
    composer.set_context(ContextUse(900, 216, 256, 240, "rolling", cut=cut))
    assert (
        composer.meter.text().endswith(f"over the limit, so when sent: {cut}")
        and "dropped" not in composer.meter.text()
    )
    why = "the system prompt, the first message and the chat format take 2935 tokens, leaving no room"
    composer.set_context(ContextUse(3000, None, 256, 240, "truncate-middle", refused=why))
    assert composer.meter.text().endswith(f"over the limit: the answer will be refused ({why})")
    composer.set_context(ContextUse(300, None, 256, 240, "stop", refused="this chat stops at the limit"))
    assert composer.meter.text().endswith("the answer will be refused (this chat stops at the limit)")


def test_near_the_limit_it_warns(qtbot, app):
    w = app.window
    empty = fresh_count(qtbot, w, "")
    budget = empty.budget
    words = "hello world "
    n = 1
    while True:  # the shortest draft past the warning line
        use = fresh_count(qtbot, w, words * n)
        if use.tokens >= 0.85 * budget:
            break
        n = max(n + 1, int(n * 0.85 * budget / max(use.tokens, 1)))
    if use.tokens <= budget:
        assert w.composer.meter_level() == "near"
        assert f"near the limit ({budget - use.tokens:,} tokens left" in w.composer.meter.text()
    else:
        assert w.composer.meter_level() == "over"
    use = fresh_count(qtbot, w, "short")
    assert w.composer.meter_level() == "ok"


def test_counting_runs_off_the_gui_thread_and_waits_for_typing_to_pause(qtbot, app, monkeypatch):
    w = app.window
    threads: list[threading.Thread] = []
    real = Engine.measure_prompt

    def spy(self, *a, **k):
        threads.append(threading.current_thread())
        return real(self, *a, **k)

    monkeypatch.setattr(Engine, "measure_prompt", spy)
    before = w.composer.context_use
    w.composer.edit.setFocus()
    text = "what is the capital"
    qtbot.keyClicks(w.composer.edit, text)
    qtbot.waitUntil(lambda: w.composer.context_use is not before, timeout=TIMEOUT_MS)
    assert threads and all(t is not threading.main_thread() for t in threads)
    assert len(threads) < len(text)  # one count per pause, not per key
    counted = w.composer.context_use
    expected = app.controller.worker.engine.measure_prompt(
        w.flow.draft_messages(text), w.flow.sampling().max_new_tokens
    )
    assert counted == expected


@pytest.mark.parametrize(
    "policy, then",
    [
        ("rolling", "messages are dropped"),
        ("truncate-middle", "messages are dropped"),
        ("stop", "the answer is refused"),
    ],
)
def test_near_the_limit_it_says_what_the_chats_policy_does_next(qtbot, policy, then):
    from ui.composer import Composer

    composer = Composer()
    qtbot.addWidget(composer)
    composer.set_context(ContextUse(tokens=900, prompt_tokens=900, context_length=1024, budget=960, policy=policy))
    assert composer.meter_level() == "near"
    assert (
        composer.meter.text() == f"Context: 900 of 1,024 tokens (88%) — near the limit (60 tokens left before {then})"
    )
