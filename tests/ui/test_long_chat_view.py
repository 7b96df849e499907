"""A long chat opens on its last messages; the earlier ones are built on the way up, in order, the view staying
where the user reads, and every part of the window still sees the whole chat."""

from __future__ import annotations

from PySide6.QtWidgets import QApplication

from app.chat_flow import MessageItem
from ui.chat_view import EARLIER_STEP, SHOWN_AT_FIRST, ChatView


def chat(n: int, start: int = 0) -> list[MessageItem]:
    return [
        MessageItem(i, "user" if i % 2 == 0 else "assistant", f"message {i}\n\n" + "line\n" * (i % 3))
        for i in range(start, start + n)
    ]


def shown_ids(view: ChatView) -> list[int]:
    return [w.item.id for w in view.messages()]


def settle() -> None:
    for _ in range(3):
        QApplication.processEvents()


def opened(qtbot, items: list[MessageItem]) -> ChatView:
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(600, 500)
    view.show()
    view.set_messages(items)
    settle()
    return view


def test_a_long_chat_opens_on_its_last_messages_and_builds_the_earlier_ones_when_asked(qtbot):
    items = chat(3 * SHOWN_AT_FIRST + 7)
    view = opened(qtbot, items)
    assert shown_ids(view) == [m.id for m in items[-SHOWN_AT_FIRST:]]
    assert view.items() == items and view.unbuilt_count() == len(items) - SHOWN_AT_FIRST
    button = view._earlier
    assert button.isVisible()
    assert button.text() == f"Show {EARLIER_STEP} earlier messages ({len(items) - SHOWN_AT_FIRST} earlier in all)"
    bar = view.verticalScrollBar()
    assert bar.value() == bar.maximum() > 0  # at the newest message
    button.click()
    settle()
    assert shown_ids(view) == [m.id for m in items[-SHOWN_AT_FIRST - EARLIER_STEP :]]
    assert view.items() == items
    left = len(items) - SHOWN_AT_FIRST - EARLIER_STEP
    assert button.text() == f"Show {min(left, EARLIER_STEP)} earlier messages ({left} earlier in all)"
    assert view.show_earlier(10**6) == left
    settle()
    assert shown_ids(view) == [m.id for m in items] and not button.isVisible()
    assert view.show_earlier() == 0


def test_scrolling_to_the_top_builds_earlier_messages_and_the_view_stays_on_what_it_showed(qtbot):
    items = chat(SHOWN_AT_FIRST + 5)
    view = opened(qtbot, items)
    bar = view.verticalScrollBar()
    first = view.messages()[0]
    bar.setValue(bar.minimum())  # the user scrolls up to the oldest message shown
    on_screen = first.y() - bar.value()
    settle()
    assert shown_ids(view) == [m.id for m in items]
    assert bar.value() > 0 and first.y() - bar.value() == on_screen  # the new ones went in above it
    assert view.items() == items


def test_an_answer_growing_below_does_not_move_what_the_user_reads_after_earlier_messages_were_built(qtbot):
    """The view held its distance from the bottom after the earlier messages were laid out, until the user
    scrolled again: an answer streaming at the bottom then carried the text being read up, line by line."""
    items = chat(SHOWN_AT_FIRST + 11)
    view = opened(qtbot, items)
    view.begin_stream(MessageItem(9999, "assistant", ""))
    settle()
    bar = view.verticalScrollBar()
    bar.setValue(bar.minimum())  # up to the top: the earlier messages are built above
    settle()
    assert view.unbuilt_count() == 0
    read = view.messages()[5]
    on_screen = read.y() - bar.value()
    for i in range(20):
        view.append_stream({0: f"line {i}\n\n"})
        view._stream.body.flush()
        settle()
    assert "line 19" in view.streaming_text()
    assert read.y() - bar.value() == on_screen


def test_a_change_at_the_end_keeps_the_unbuilt_beginning_and_the_shown_widgets(qtbot):
    items = chat(SHOWN_AT_FIRST + 20)
    view = opened(qtbot, items)
    before = view.messages()
    regenerated = [*items[:-1], MessageItem(999, "assistant", "another answer", sibling_index=1, sibling_count=2)]
    view.set_messages(regenerated)
    after = view.messages()
    assert after[:-1] == before[:-1] and after[-1] is not before[-1]
    assert view.items() == regenerated and view.unbuilt_count() == 20
    longer = [*regenerated, *chat(2, start=1000)]  # a new question and its answer
    view.set_messages(longer)
    assert view.messages()[: len(after)] == after and view.items() == longer
    assert shown_ids(view)[-2:] == [1000, 1001]


def test_a_different_chat_or_a_change_among_the_unbuilt_messages_opens_anew(qtbot):
    items = chat(SHOWN_AT_FIRST + 20)
    view = opened(qtbot, items)
    other = chat(SHOWN_AT_FIRST + 3, start=5000)
    view.set_messages(other)
    assert view.items() == other and shown_ids(view) == [m.id for m in other[-SHOWN_AT_FIRST:]]
    edited = [*other[:2], MessageItem(7777, "user", "edited early"), *other[3:]]
    view.set_messages(edited)
    assert view.items() == edited and view.unbuilt_count() == 3
    view.set_messages(chat(3))
    assert view.unbuilt_count() == 0 and not view._earlier.isVisible() and len(view.messages()) == 3
    view.set_messages([])
    assert view.items() == [] and view.messages() == []
