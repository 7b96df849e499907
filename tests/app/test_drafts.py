"""Unsent messages, one per chat, kept in a file beside the settings (app/drafts.py)."""

from __future__ import annotations

import json

from saves_at_once import saves_at_once

from app.drafts import MAX_DRAFTS, Drafts


def letter_sent_from_the_other_window(path) -> tuple[Drafts, Drafts]:
    """Two windows' drafts in `path`: the first kept "a long letter" as the new chat's draft, and the second, which
    read it from the file, sent it from the new chat (which took it from the file)."""
    one = Drafts(path)
    one.put(None, "a long letter")
    assert one.save() == ""
    two = Drafts(path)
    assert two.get(None) == "a long letter"
    two.put(None, "")
    assert two.save() == ""
    return one, two


def test_two_windows_each_write_only_the_drafts_they_changed(tmp_path):
    path = tmp_path / "drafts.json"
    one, two = Drafts(path), Drafts(path)
    one.put(1, "from one")
    two.put(2, "from two")
    assert one.save() == "" and two.save() == ""  # the second read the file again: the first's draft stays
    assert Drafts(path).get(1) == "from one" and Drafts(path).get(2) == "from two"
    one.put(1, "  \n")  # only white space: forgotten
    one.save()
    assert json.loads(path.read_text())["drafts"] == {"2": "from two"}


def test_a_damaged_file_is_started_over_and_a_failed_write_is_said(tmp_path, caplog):
    path = tmp_path / "drafts.json"
    damages = (
        b"{",
        b"\xff\xfe",
        b'{"version": 9, "drafts": {"4": "a newer version\'s"}}',
        b'{"version": 1, "drafts": [1]}',
    )
    for damaged in damages:
        path.write_bytes(damaged)
        d = Drafts(path)
        assert d.get(None) == ""
        d.put(None, "new")
        assert d.save() == "" and Drafts(path).get(None) == "new"
    # each kept beside, not written over (a newer version's drafts were lost with the first save)
    assert sorted(p.read_bytes() for p in tmp_path.glob("drafts.json.unreadable-*")) == sorted(damages)
    (tmp_path / "ro").write_text("a file where the folder would be")
    d = Drafts(tmp_path / "ro" / "drafts.json")
    d.put(3, "kept in memory")
    assert d.save().startswith("cannot keep the unsent messages in ")
    assert d.get(3) == "kept in memory"


def test_drafts_to_write_back_are_kept_for_the_next_save_where_one_fails(tmp_path, monkeypatch):
    """A draft put back as it was, to be written back where another window took it from the file, was forgotten
    when that save failed before it read the file (its lock could not be taken): the next save did not write it."""
    import app.drafts

    path = tmp_path / "drafts.json"
    one, _ = letter_sent_from_the_other_window(path)
    one.put(None, "a long letter")
    locked = app.drafts.locked_beside

    def cannot_lock(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(app.drafts, "locked_beside", cannot_lock)
    assert one.save().endswith("Input/output error")
    monkeypatch.setattr(app.drafts, "locked_beside", locked)
    assert one.save() == "" and json.loads(path.read_text())["drafts"] == {"new": "a long letter"}


def test_the_oldest_drafts_go_past_the_limit_and_gone_chats_lose_theirs(tmp_path):
    path = tmp_path / "drafts.json"
    d = Drafts(path)
    for chat in range(MAX_DRAFTS + 5):
        d.put(chat, f"draft {chat}")
    d.save()
    kept = Drafts(path)
    assert kept.get(4) == "" and kept.get(5) == "draft 5" and kept.get(MAX_DRAFTS + 4) == f"draft {MAX_DRAFTS + 4}"
    kept.keep_only({5, 6})
    kept.save()
    assert set(json.loads(path.read_text())["drafts"]) == {"5", "6"}


def test_a_draft_another_window_took_from_the_file_is_written_back_by_the_window_that_still_shows_it(tmp_path):
    """Two windows on one data folder share the new chat's draft: the second sent its own message from the new
    chat, which took the draft from the file, and the first, still showing its letter there, never wrote it
    again (put as it was: nothing changed), so the letter was gone at the next start."""
    path = tmp_path / "drafts.json"
    one, two = letter_sent_from_the_other_window(path)
    assert Drafts(path).get(None) == ""
    one.put(None, "a long letter")  # the first leaves its new chat, or closes, its letter still on screen
    assert one.save() == ""
    assert Drafts(path).get(None) == "a long letter"
    # one the other window changed is its newer text, not undone
    two.put(None, "the second's own")
    two.save()
    one.put(None, "a long letter")
    one.save()
    assert Drafts(path).get(None) == "the second's own"


def test_a_draft_another_window_sent_is_not_shown_again_nor_written_back(tmp_path):
    """Both windows started with chat 5's draft; the second sent it. The first, opening chat 5 later, showed its
    stale copy, and leaving the chat wrote it back: at the next start the sent message was a draft again."""
    path = tmp_path / "drafts.json"
    first = Drafts(path)
    first.put(5, "X")
    first.save()
    one, two = Drafts(path), Drafts(path)
    assert two.get(5) == "X"
    two.put(5, "")  # sent in the second window
    two.save()
    assert one.get(5) == ""  # opened in the first: as the file has it now
    one.put(5, "")  # left without typing
    assert one.save() == ""
    assert Drafts(path).get(5) == ""
    two.put(6, "typed in the second")
    two.save()
    assert one.get(6) == "typed in the second"  # and one typed there since shows up


def test_two_windows_saving_at_the_same_moment_both_keep_their_drafts(tmp_path, monkeypatch):
    """A logout closes both windows: each read the file before the other wrote it, and the second write lost the
    first's draft (38 of 100 such closes lost one)."""
    import app.drafts

    path = tmp_path / "drafts.json"
    one, two = Drafts(path), Drafts(path)
    one.put(1, "a long message typed in chat 1")
    two.put(2, "another typed in chat 2")
    saves_at_once(monkeypatch, app.drafts, one.save, two.save)
    again = Drafts(path)
    assert (again.get(1), again.get(2)) == ("a long message typed in chat 1", "another typed in chat 2")


def test_the_chat_on_screen_opened_again_keeps_the_draft_another_window_took(tmp_path):
    """New chat (Ctrl+N) while the new chat is on screen, after another window sent its draft: the draft was put
    back as it was, then read again from the file, which no longer had it, and the text on screen was emptied
    and lost."""
    path = tmp_path / "drafts.json"
    one, _ = letter_sent_from_the_other_window(path)
    one.put(None, "a long letter")  # the switch keeps what the composer shows, then opens the same chat
    assert one.get(None) == "a long letter"
    assert one.save() == "" and json.loads(path.read_text())["drafts"] == {"new": "a long letter"}


def test_a_file_that_cannot_be_read_for_a_moment_takes_no_draft_away(tmp_path, monkeypatch):
    """A read that failed (another window replacing the file, on Windows) was taken as a file without the draft:
    the window's own saved draft was dropped from memory, and not written again."""
    from pathlib import Path

    path = tmp_path / "drafts.json"
    d = Drafts(path)
    d.put(5, "a long reply, typed and kept")
    assert d.save() == ""
    read_bytes = Path.read_bytes

    def busy(self):
        if self == path:
            raise PermissionError(13, "The process cannot access the file")
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", busy)
    assert d.get(5) == "a long reply, typed and kept"
    monkeypatch.undo()
    path.write_text('{"version": 2, "drafts": {}}')  # a newer version's file: not read, and no draft taken away
    assert d.get(5) == "a long reply, typed and kept"
