"""The chat store: CRUD, branches, candidates, search, cascades, crash recovery of streaming answers."""

from __future__ import annotations

import logging
import sqlite3
import sys

import pytest
from chat_threads import chain, streaming_answer

from app.store import (
    MIGRATIONS,
    NEW_CANDIDATE_GROUP,
    SCHEMA_VERSION,
    ChatStore,
    CompareHistory,
    NotFound,
    StoreError,
    StreamSaver,
)
from engine.types import EngineOptions, GenerationMetrics, SamplingParams


@pytest.fixture
def store(tmp_path):
    s = ChatStore(tmp_path / "chats.sqlite3")
    yield s
    s.close()


def texts(messages):
    return [m.content for m in messages]


def test_fresh_database_is_wal_at_current_schema(tmp_path):
    path = tmp_path / "chats.sqlite3"
    ChatStore(path).close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    cols = {r[1] for r in db.execute("PRAGMA table_info(messages)")}
    assert {"candidate_group", "candidate_index", "metrics_json", "options_json", "model_name", "status"} <= cols
    db.close()


def test_unversioned_empty_database_is_migrated(tmp_path):
    path = tmp_path / "old.sqlite3"
    sqlite3.connect(path).close()  # an empty file at user_version 0
    with ChatStore(path) as s:
        assert s.create_chat("x").title == "x"
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_chat_crud_and_order(store):
    a = store.create_chat("first", system_prompt="be brief", sampling=SamplingParams(temperature=0.0, seed=3))
    b = store.create_chat()
    assert b.title == "New chat" and b.system_prompt == "" and b.sampling is None
    assert a.sampling["seed"] == 3 and a.sampling["temperature"] == 0.0 and a.sampling["stop"] == []
    assert SamplingParams.from_dict(a.sampling) == SamplingParams(temperature=0.0, seed=3)
    assert [c.id for c in store.list_chats()] == [b.id, a.id]
    assert store.rename_chat(a.id, "renamed") is True
    assert [c.title for c in store.list_chats()] == ["renamed", "New chat"]  # touched chats come first
    assert store.update_chat(b.id, system_prompt="sys", sampling={"temperature": 1.5}) is True
    c = store.get_chat(b.id)
    assert (c.system_prompt, c.sampling) == ("sys", {"temperature": 1.5})
    assert [c.id for c in store.list_chats()] == [b.id, a.id]
    touched = store.get_chat(a.id).updated
    assert store.rename_chat(a.id, "renamed") is False  # the same title: not a change
    assert store.get_chat(a.id).updated == touched  # not touched, nor moved up
    assert [c.id for c in store.list_chats()] == [b.id, a.id]
    store.rename_chat(a.id, "renamed again")
    assert store.update_chat(b.id, system_prompt="sys", sampling={"temperature": 1.5}, overflow_policy="") is False
    assert (
        store.get_chat(b.id).updated == c.updated
    )  # nothing changed: the chat is not counted as touched, nor moved up
    assert [c.id for c in store.list_chats()] == [a.id, b.id]
    assert store.update_chat(b.id, overflow_policy="stop") is True and store.get_chat(b.id).updated > c.updated
    assert [c.id for c in store.list_chats()] == [b.id, a.id]
    store.delete_chat(a.id)
    assert [c.id for c in store.list_chats()] == [b.id]
    with pytest.raises(StoreError, match="no chat with id"):
        store.get_chat(a.id)
    with pytest.raises(StoreError, match="no chat with id"):
        store.rename_chat(a.id, "gone")


def test_messages_thread_and_metadata(store):
    chat = store.create_chat()
    u = store.add_message(chat.id, "user", "Hello 👋 مرحبا 你好", None)
    a = store.add_message(
        chat.id, "assistant", "", u.id, status="streaming", model_name="tiny", options={"dtype": "fp32"}
    )
    store.update_message(a.id, content="Hi there", status="done", metrics={"decode_tok_s": None, "new_tokens": [2]})
    got = store.get_message(a.id)
    assert (got.content, got.status, got.model_name) == ("Hi there", "done", "tiny")
    assert got.options == {"dtype": "fp32"} and got.metrics == {"decode_tok_s": None, "new_tokens": [2]}
    assert texts(store.thread(chat.id)) == ["Hello 👋 مرحبا 你好", "Hi there"]
    assert store.get_chat(chat.id).active_leaf_id == a.id
    assert store.count_messages(chat.id) == 2 and store.count_messages() == 2
    with pytest.raises(StoreError, match="unknown message status"):
        store.update_message(a.id, status="finished")
    with pytest.raises(StoreError, match="unknown message role"):
        store.add_message(chat.id, "robot", "x", None)
    other = store.create_chat()
    with pytest.raises(StoreError, match=f"message {u.id} is not in chat {other.id}"):
        store.add_message(other.id, "user", "x", u.id)


def test_nul_character_survives(store):
    chat = store.create_chat()
    m = store.add_message(chat.id, "user", "a\x00b", None)
    assert store.get_message(m.id).content == "a\x00b"


def test_edit_and_resend_creates_a_branch_and_both_stay_reachable(store):
    chat = store.create_chat()
    u1, a1, u2, a2 = chain(store, chat.id, "q1", "a1", "q2", "a2")
    # Edit q2 and resend: a sibling of u2 under the same parent.
    u2b = store.add_message(chat.id, "user", "q2 edited", a1.id)
    a2b = store.add_message(chat.id, "assistant", "a2 edited", u2b.id)
    assert texts(store.thread(chat.id)) == ["q1", "a1", "q2 edited", "a2 edited"]
    assert [m.id for m in store.siblings(u2.id)] == [u2.id, u2b.id]
    assert [m.id for m in store.children(a1.id)] == [u2.id, u2b.id]
    # Back to the old branch: choosing u2 follows its newest descendants to a2.
    assert store.set_active_leaf(chat.id, u2.id) == a2.id
    assert texts(store.thread(chat.id)) == ["q1", "a1", "q2", "a2"]
    assert texts(store.thread(chat.id, a2b.id)) == ["q1", "a1", "q2 edited", "a2 edited"]
    # Editing the very first message branches at the root.
    r2 = store.add_message(chat.id, "user", "q1 again", None)
    assert [m.id for m in store.siblings(u1.id)] == [u1.id, r2.id]
    assert texts(store.thread(chat.id)) == ["q1 again"]
    # back to u1: down the branch shown last under it (q2's, gone back to above), not the newest (q2 edited's)
    assert store.set_active_leaf(chat.id, u1.id) == a2.id
    with pytest.raises(StoreError, match="is not in chat"):
        store.set_active_leaf(store.create_chat().id, u1.id)


def test_two_windows_starting_candidates_in_one_chat_get_groups_of_their_own(store, tmp_path):
    """The group was numbered before the transaction that wrote it: two windows starting candidates in one chat at
    once both took group 1, and the chat's export was refused on import ("candidate group 1 holds answers to
    different messages")."""
    from app.chat_io import export_json, parse_chat

    other = ChatStore(tmp_path / "chats.sqlite3")  # the second window's
    chat = store.create_chat()
    q1 = store.add_message(chat.id, "user", "q1", None)
    q2 = other.add_message(chat.id, "user", "q2", None)
    firsts = [
        s.add_message(chat.id, "assistant", "a", q.id, candidate_group=NEW_CANDIDATE_GROUP, candidate_index=0)
        for s, q in ((store, q1), (other, q2))
    ]
    for s, first, q in zip((store, other), firsts, (q1, q2)):
        s.add_message(chat.id, "assistant", "b", q.id, candidate_group=first.candidate_group, candidate_index=1)
    assert sorted(m.candidate_group for m in firsts) == [1, 2]
    assert parse_chat(export_json(store, chat.id).encode()).messages  # its export reads back
    other.close()


def test_candidates_share_a_group_and_one_is_chosen(store):
    chat = store.create_chat()
    u = store.add_message(chat.id, "user", "q", None)
    first = store.add_message(
        chat.id, "assistant", "answer 0", u.id, candidate_group=NEW_CANDIDATE_GROUP, candidate_index=0
    )
    group = first.candidate_group
    cands = [first] + [
        store.add_message(chat.id, "assistant", f"answer {i}", u.id, candidate_group=group, candidate_index=i)
        for i in (1, 2)
    ]
    other = store.add_message(chat.id, "assistant", "x", u.id, candidate_group=NEW_CANDIDATE_GROUP, candidate_index=0)
    assert (group, other.candidate_group) == (1, 2)
    store.delete_message(other.id)
    # The first candidate is on screen until another is picked.
    assert texts(store.thread(chat.id)) == ["q", "answer 0"]
    sibs = store.siblings(cands[1].id)
    assert [(m.candidate_group, m.candidate_index) for m in sibs] == [(group, 0), (group, 1), (group, 2)]
    store.set_active_leaf(chat.id, cands[2].id)
    follow = store.add_message(chat.id, "user", "next", cands[2].id)
    assert texts(store.thread(chat.id)) == ["q", "answer 2", "next"]
    assert store.thread(chat.id)[-1].id == follow.id


def test_search_titles_and_content(store):
    a = store.create_chat("Cooking")
    b = store.create_chat("Physics")
    c = store.create_chat("Misc")
    store.add_message(b.id, "user", "What is the KERNEL gap?", None)
    store.add_message(c.id, "user", "100% sure_thing", None)
    assert [x.id for x in store.list_chats("cook")] == [a.id]
    assert [x.id for x in store.list_chats("kernel")] == [b.id]
    assert [x.id for x in store.list_chats("%")] == [c.id]  # wildcards are literal
    assert [x.id for x in store.list_chats("_")] == [c.id]
    assert store.list_chats("nothing like this") == []


def test_stopping_a_search_as_the_store_closes_raises_nothing(store):
    """A search is stopped from another thread (a newer one typed, the window closing) by reading the search's
    connection without the lock that search holds; the store closing that connection between the read and the stop
    raised "Cannot operate on a closed database" in the thread that stopped it."""
    assert store.search_titles("x") == []
    store._search_db.close()  # closed after interrupt_search read it, before it stopped it
    store.interrupt_search()
    store._search_db = None
    store.close()
    store.interrupt_search()  # and after close, nothing to stop


def test_search_folds_the_case_of_every_script(store):
    """Search folded ASCII letters alone (SQLite's LIKE): "ÉTÉ" did not find "été", nor "STRASSE" "Straße", nor
    "ПРИВЕТ" "привет"; a search of ASCII text finds it where a letter folds to it (ß, ﬁ, the Kelvin sign), and text
    after a NUL is searched too."""
    ete = store.create_chat("Holidays")
    store.add_message(ete.id, "user", "Où étiez-vous cet été ?", None)
    street = store.create_chat("Straße")
    greek = store.create_chat("Greek")
    store.add_message(greek.id, "assistant", "ΣΟΦΊΑ means wisdom", None)
    russian = store.create_chat("Russian")
    store.add_message(russian.id, "user", "Привет, мир", None)
    signs = store.create_chat("Signs")
    store.add_message(signs.id, "assistant", "It melts at 300 \u212a. The \ufb01le is here.", None)
    nul = store.create_chat("Nul")
    store.add_message(nul.id, "user", "a\x00b then KERNEL", None)
    store.add_message(nul.id, "user", "é\x00 then CUDA", None)

    def found(search: str) -> list[int]:
        return [c.id for c in store.list_chats(search)]

    assert found("ÉTÉ") == found("été") == [ete.id]
    assert found("STRASSE") == found("straße") == found("STRAẞE") == [street.id]
    assert found("σοφία") == found("ΣΟΦΙΑ".lower().replace("ι", "ί")) == [greek.id]
    assert found("ПРИВЕТ") == [russian.id]
    assert found("300 k") == found("FILE IS") == [signs.id]
    assert found("kernel") == found("cuda") == [nul.id]
    assert found("wisdom") == [greek.id] and found("Où") == [ete.id]
    assert found("été!") == [] and found("strassen") == []


def test_a_message_written_as_invalid_utf8_by_another_program_does_not_end_every_search(store, tmp_path):
    """The folding search read every non-ASCII message as text: one holding bytes that are not UTF-8 (written by
    another program) made each search that reached it fail, where LIKE had searched past it."""
    import sqlite3

    bad = store.create_chat("Damaged")
    store.add_message(bad.id, "user", "placeholder", None)
    good = store.create_chat("Été")
    store.add_message(good.id, "user", "Où étiez-vous ?", None)
    with sqlite3.connect(tmp_path / "chats.sqlite3") as db:
        db.execute(
            "UPDATE messages SET content = CAST(X'c3a9e9ff20554e49434f4445' AS TEXT) WHERE chat_id = ?", (bad.id,)
        )
    assert [c.id for c in store.list_chats("ÉTIEZ")] == [good.id]
    assert [c.id for c in store.list_chats("UNICODE")] == [bad.id]  # found where its bytes can be read
    assert [c.id for c in store.list_chats("É")] == [good.id, bad.id]  # the readable "é" before the bad bytes


def test_text_another_program_stored_as_bad_utf8_or_bytes_reads_with_replacement_and_hides_no_chat(store, tmp_path):
    """One title that was not UTF-8 failed the whole query: the chat list was empty (in the app and `chats list`);
    a message's bad bytes made its chat impossible to open or export; a title stored as bytes (a BLOB) stopped the
    app at its start."""
    import sqlite3

    chats = [store.create_chat(f"Chat {n}") for n in range(3)]
    for chat in chats:
        store.add_message(chat.id, "user", "hello", None)
    with sqlite3.connect(tmp_path / "chats.sqlite3") as db:
        db.execute("UPDATE chats SET title = CAST(X'43686174ff' AS TEXT) WHERE id = ?", (chats[0].id,))
        db.execute("UPDATE chats SET title = X'426c6f62', system_prompt = X'ff' WHERE id = ?", (chats[1].id,))
        db.execute("UPDATE chats SET updated = 'yesterday' WHERE id = ?", (chats[2].id,))
        db.execute("UPDATE messages SET content = CAST(X'68e9ff' AS TEXT) WHERE chat_id = ?", (chats[0].id,))
        db.execute(
            "UPDATE messages SET content = X'6f6b', model_name = X'74696e79ff' WHERE chat_id = ?", (chats[1].id,)
        )
    listed = {c.id: c for c in store.list_chats()}
    assert [listed[c.id].title for c in chats] == ["Chat\ufffd", "Blob", "Chat 2"]
    assert listed[chats[1].id].system_prompt == "\ufffd" and listed[chats[2].id].updated == 0.0
    assert [m.content for m in store.thread(chats[0].id)] == ["h\ufffd\ufffd"]
    assert [(m.content, m.model_name) for m in store.thread(chats[1].id)] == [("ok", "tiny\ufffd")]
    from app.chat_io import export_json, export_markdown

    for chat in chats:  # each exports (a model name stored as bytes failed both exports with a TypeError)
        assert export_markdown(store, chat.id) and export_json(store, chat.id)


def test_the_letters_that_fold_to_ascii_are_all_known_to_the_search():
    """A message of other scripts is folded for a search of ASCII text only where it holds one of these letters."""
    from app.store import _FOLDS_TO_ASCII, _folded

    letters = [chr(c) for c in range(128, sys.maxunicode + 1)]
    folds_to_ascii = {c for c in letters if any(x.isascii() for x in _folded(c))}
    assert {"ß", "\u037e", "\u212a"} <= folds_to_ascii  # the Greek question mark is ";", the Kelvin sign "k"
    assert {c for c in letters if _FOLDS_TO_ASCII.match(c)} == folds_to_ascii


def test_search_finds_text_however_its_accents_are_written(store):
    """A letter and its accent can be stored as one character ("é", as most keyboards type it) or as two ("e" and a
    combining accent, as some programs and models write it): a search found only the form it was typed in, and a
    search of "cafe" found "cafe\u0301" (an "e" followed by an accent) but not "café"."""
    one = store.create_chat("One character")
    store.add_message(one.id, "user", "Un caf\u00e9 \u00e0 No\u00ebl, \u1e9b\u0323", None)
    two = store.create_chat("Two characters")
    store.add_message(two.id, "assistant", "UN CAFE\u0301 A\u0300 NOE\u0308L, \u017f\u0323\u0307", None)
    title = store.create_chat("Cafe\u0301s")  # a title is searched the same way

    def found(search: str) -> list[int]:
        listed = [c.id for c in store.list_chats(search)]
        assert [c[0] for c in store.search_titles(search)] == listed  # the chat list's search, off the GUI thread
        return listed

    for typed in ("café", "cafe\u0301", "CAFÉ", "CAFE\u0301"):
        assert found(typed) == [title.id, two.id, one.id], ascii(typed)
    for typed in ("Noël", "noe\u0308l", "À NOËL", "a\u0300 noe\u0308l"):
        assert found(typed) == [two.id, one.id], ascii(typed)
    assert found("cafés") == found("CAFE\u0301S") == [title.id]
    assert found("\u1e69") == found("s\u0323\u0307") == [two.id, one.id]  # ṩ: one letter, two accents
    assert found("cafe") == found("noel") == found("a noel") == []  # an accent is part of its letter
    assert found("un caf") == [two.id, one.id]  # the text before it is found in both


def test_delete_message_cascades_and_fixes_the_active_leaf(store):
    chat = store.create_chat()
    u1, a1 = chain(store, chat.id, "q1", "a1")
    a1b = store.add_message(chat.id, "assistant", "a1 regenerated", u1.id)
    chain(store, chat.id, "q2", "a2", parent=a1b.id)
    store.delete_message(a1b.id)  # with q2 and a2 below it
    assert store.count_messages(chat.id) == 2
    assert texts(store.thread(chat.id)) == ["q1", "a1"]  # the remaining branch
    store.delete_message(a1.id)
    assert texts(store.thread(chat.id)) == ["q1"]
    store.delete_message(u1.id)
    assert store.get_chat(chat.id).active_leaf_id is None and store.thread(chat.id) == []
    with pytest.raises(StoreError, match="no message with id"):
        store.delete_message(a1.id)


def test_delete_inactive_branch_keeps_the_active_one(store):
    chat = store.create_chat()
    u1 = store.add_message(chat.id, "user", "q1", None)
    old = store.add_message(chat.id, "assistant", "old", u1.id)
    new = store.add_message(chat.id, "assistant", "new", u1.id)
    store.delete_message(old.id)
    assert store.get_chat(chat.id).active_leaf_id == new.id


def test_delete_chat_cascades_to_messages(store):
    keep = store.create_chat()
    store.add_message(keep.id, "user", "keep me", None)
    chat = store.create_chat()
    u = store.add_message(chat.id, "user", "q", None)
    store.add_message(chat.id, "assistant", "a", u.id)
    store.delete_chat(chat.id)
    assert store.count_messages() == 1 and texts(store.thread(keep.id)) == ["keep me"]


def test_streaming_answer_becomes_stopped_on_reopen(tmp_path):
    path = tmp_path / "c.sqlite3"
    s = ChatStore(path)
    _, _, a = streaming_answer(s, "q")
    saver = StreamSaver(s, a.id, min_interval_s=0.0)
    saver.append("partial ")
    saver.append("answer")
    s._db.close()  # the process dies: no finish, no orderly close
    s._db = None
    with ChatStore(path) as again:
        m = again.get_message(a.id)
        assert (m.content, m.status) == ("partial answer", "stopped")
        # not the user's stop: the stats line says the app closed, and why the figures are n/a
        assert m.metrics["finish_reason"] == "interrupted"
        assert m.metrics["unavailable"]["decode_tok_s"].startswith("the app closed before this answer ended")
    from ui.stats import format_stats

    line, tip = format_stats(m.metrics, m.options, "cpu", m.metrics["finish_reason"])
    assert "cut off: the app closed mid-answer" in line and "stopped by you" not in line


def test_stream_saver_writes_at_most_every_interval(store):
    chat = store.create_chat()
    a = store.add_message(chat.id, "assistant", "", None, status="streaming")
    now = [0.0]
    saver = StreamSaver(store, a.id, min_interval_s=0.5, clock=lambda: now[0])
    saver.append("a")
    now[0] = 0.3
    saver.append("b")
    assert store.get_message(a.id).content == ""  # nothing written before 0.5 s
    now[0] = 0.6
    saver.append("c")
    assert store.get_message(a.id).content == "abc"
    now[0] = 0.9
    saver.append("d")
    assert store.get_message(a.id).content == "abc"
    saver.finish("stopped", metrics={"new_tokens": [4]}, options={"dtype": "fp32"})
    m = store.get_message(a.id)
    assert (m.content, m.status, m.metrics, m.options) == ("abcd", "stopped", {"new_tokens": [4]}, {"dtype": "fp32"})
    with pytest.raises(StoreError, match="already finished"):
        saver.append("e")


def test_an_answer_holding_half_characters_is_saved_whole_with_replacement_characters(store):
    chat = store.create_chat()
    q = store.add_message(chat.id, "user", "emoji \ud83d\ude00 then a half \ud83d", None)
    assert store.get_message(q.id).content == "emoji \U0001f600 then a half \ufffd"
    a = store.add_message(chat.id, "assistant", "", q.id, status="streaming")
    saver = StreamSaver(store, a.id, min_interval_s=0.0)
    saver.append("Hi \ud83d")  # saved at once: each save takes the text so far, the half included
    saver.append("\ude00 there")
    saver.finish("done")
    assert store.get_message(a.id).content == "Hi \U0001f600 there"


def test_a_title_that_is_not_whole_characters_is_a_store_error(store):
    chat = store.create_chat()
    with pytest.raises(StoreError, match="cannot rename the chat in the chat database: .*surrogates not allowed"):
        store.rename_chat(chat.id, "half \ud83d")
    assert store.get_chat(chat.id).title == chat.title


def test_two_instances_share_the_database(tmp_path):
    path = tmp_path / "c.sqlite3"
    one, two = ChatStore(path), ChatStore(path)
    chat = one.create_chat("shared")
    parent = None
    for i in range(50):
        writer = one if i % 2 == 0 else two
        parent = writer.add_message(chat.id, "user", f"m{i}", parent).id
    assert texts(two.thread(chat.id)) == [f"m{i}" for i in range(50)]
    assert one.count_messages() == 50
    one.close()
    two.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_closed_store_says_so(tmp_path):
    s = ChatStore(tmp_path / "c.sqlite3")
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.list_chats()


# ---- the compare history ------------------------------------------------------------------------------------


def metrics(tok_s: float) -> GenerationMetrics:
    m = GenerationMetrics(new_tokens_total=12, prompt_tokens=30)
    m.put("decode_tok_s", tok_s, "engine timing, device-synchronised")
    m.mark_na("gpu_util_pct", "the model runs on the CPU, not on a GPU")
    return m


def test_a_schema_2_database_gains_the_compare_history_and_keeps_its_chats(tmp_path):
    path = tmp_path / "v2.sqlite3"
    db = sqlite3.connect(path)
    for step in (1, 2):
        for statement in MIGRATIONS[step]:
            db.execute(statement)
    db.execute("INSERT INTO chats (title, created, updated) VALUES ('kept', 1, 1)")
    db.execute("PRAGMA user_version = 2")
    db.commit()
    db.close()
    with ChatStore(path) as s:
        assert [c.title for c in s.list_chats()] == ["kept"]
        history = CompareHistory(s)
        assert history.rows() == []
        history.add(1, "eager", EngineOptions(device="cpu"), metrics(20.0))
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 6


def test_an_id_is_never_given_again_after_its_chat_or_message_is_deleted(tmp_path):
    """A rowid table gave the newest chat's id, and the newest message's, to the next one made: a second window
    still holding the deleted chat's id sent its messages into the new chat, its Stop deleted the new chat's
    answer, and a delete from its stale chat list deleted the new chat."""
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path) as window_a, ChatStore(path) as window_b:
        old = window_a.create_chat("medical")
        question = window_a.add_message(old.id, "user", "q", None)
        answer = window_a.add_message(old.id, "assistant", "", question.id, status="streaming")
        window_b.delete_chat(old.id)
        new = window_b.create_chat("taxes")
        asked = window_b.add_message(new.id, "user", "q2", None)
        answered = window_b.add_message(new.id, "assistant", "a2", asked.id)
        assert new.id != old.id and {asked.id, answered.id}.isdisjoint({question.id, answer.id})
        with pytest.raises(NotFound):  # window A's stale ids find nothing of window B's
            window_a.get_chat(old.id)
        with pytest.raises(NotFound):
            window_a.delete_message(answer.id)
        with pytest.raises(NotFound):  # a stale list's delete deletes nothing else
            window_a.delete_chat(old.id)
        assert [m.content for m in window_b.thread(new.id)] == ["q2", "a2"]
    with ChatStore(path) as reopened:  # nor after a restart
        reopened.delete_chat(new.id)
        assert reopened.create_chat("next").id > new.id


def test_a_schema_4_database_keeps_every_chat_message_and_branch_when_its_ids_stop_being_reused(tmp_path):
    path = tmp_path / "v4.sqlite3"
    db = sqlite3.connect(path)
    for step in (1, 2, 3, 4):
        for statement in MIGRATIONS[step]:
            db.execute(statement)
    db.execute("PRAGMA user_version = 4")
    db.executescript(
        """
        INSERT INTO chats VALUES (3, 'branched', 1, 2, 'be brief', '{"temperature": 0.5}', 12, 'rolling');
        INSERT INTO chats VALUES (7, 'second', 1, 3, '', NULL, NULL, NULL);
        INSERT INTO messages VALUES (10, 3, NULL, 'user', 'q', 'done', 1, 1, NULL, NULL, NULL, NULL, NULL, NULL);
        INSERT INTO messages VALUES (11, 3, 10, 'assistant', 'a1', 'stopped', 1, 1, '{}', '{}', 5, 0, 'm', NULL);
        INSERT INTO messages VALUES (12, 3, 10, 'assistant', 'a2', 'done', 1, 1, NULL, NULL, 5, 1, 'm', NULL);
        """
    )
    db.commit()
    db.close()
    with ChatStore(path) as s:
        assert [(c.id, c.title) for c in s.list_chats()] == [(7, "second"), (3, "branched")]
        chat = s.get_chat(3)
        assert (chat.system_prompt, chat.active_leaf_id) == ("be brief", 12)
        assert [(m.id, m.content, m.status) for m in s.thread(3)] == [(10, "q", "done"), (12, "a2", "done")]
        assert [m.content for m in s.thread(3, 11)] == ["q", "a1"]
        s.delete_chat(7)
        assert s.create_chat("after").id == 8  # past the largest id the old table had
        s.delete_chat(3)  # foreign keys still cascade
    db = sqlite3.connect(path)
    assert db.execute("SELECT count(*) FROM messages").fetchone()[0] == 0
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_compare_rows_round_trip_and_clear(tmp_path):
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path) as s:
        h = CompareHistory(s)
        h.add(1, "eager", EngineOptions(device="cpu", kv_cache="dynamic"), metrics(20.0))
        h.add(2, "+ static KV", EngineOptions(device="cpu", kv_cache="static"), metrics(31.5), "SmolLM2-135M")
    with ChatStore(path) as s:  # another run
        rows = CompareHistory(s).rows()
        assert [(r.index, r.label, r.options.kv_cache, r.model) for r in rows] == [
            (1, "eager", "dynamic", ""),
            (2, "+ static KV", "static", "SmolLM2-135M"),
        ]
        assert rows[1].metrics == metrics(31.5)
        assert rows[0].metrics.figure("gpu_util_pct").reason == "the model runs on the CPU, not on a GPU"
        assert CompareHistory(s).clear() == 2 and CompareHistory(s).rows() == []


@pytest.mark.parametrize(
    "values, reason",
    [
        ((0, "x", "{}", "{}"), "its generation number is 0, not a positive integer"),
        ((1, "x", "{not json", "{}"), "Expecting property name"),
        ((1, "x", '{"kv_cache": "floppy"}', "{}"), "kv_cache"),
        ((1, "x", '{"warp_drive": true}', "{}"), "warp_drive"),
        ((1, "x", "{}", '{"decode_tok_s": "fast"}'), 'its figure decode_tok_s is "fast", not a number'),
        ((1, "x", "{}", '{"unavailable": {"ttft_ms": 3}}'), "its n/a reasons are not an object of texts"),
        ((1, "x", "[]", "{}"), "not JSON objects"),
        ((1, "x", "{}", "{}", b"\x00"), "its model is b'\\x00', not text"),
    ],
)
def test_a_bad_compare_row_is_refused_with_its_reason_and_the_others_load(tmp_path, caplog, values, reason):
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path) as s:
        CompareHistory(s).add(1, "good", EngineOptions(device="cpu"), metrics(20.0))
    db = sqlite3.connect(path)
    db.execute(
        "INSERT INTO compare_rows (created, generation, label, options_json, metrics_json, model) "
        "VALUES (1, ?, ?, ?, ?, ?)",
        values if len(values) == 5 else (*values, None),
    )
    db.commit()
    db.close()
    with caplog.at_level(logging.ERROR, logger="app.store"), ChatStore(path) as s:
        rows = CompareHistory(s).rows()
    assert [r.label for r in rows] == ["good"]
    refused = [r.getMessage() for r in caplog.records if "compare row 2 refused" in r.getMessage()]
    assert len(refused) == 1 and reason in refused[0]


def test_a_message_whose_stored_figures_are_damaged_is_still_read(tmp_path):
    path = tmp_path / "c.sqlite3"
    with ChatStore(path) as s:
        chat = s.create_chat()
        m = s.add_message(chat.id, "assistant", "kept", None, metrics={"ttft_ms": 1.0}, options={"dtype": "fp32"})
    db = sqlite3.connect(path)
    db.execute("UPDATE messages SET metrics_json = '{bad', options_json = '[1]' WHERE id = ?", (m.id,))
    db.execute(
        "INSERT INTO messages (chat_id, role, content, created, updated, metrics_json) VALUES (?, ?, ?, 1, 1, ?)",
        (chat.id, "assistant", "figures not numbers", '{"ttft_ms": "fast"}'),
    )
    db.commit()
    db.close()
    with ChatStore(path) as s:
        got = s.get_message(m.id)
        assert (got.content, got.metrics, got.options) == ("kept", None, None)
        other = next(x for x in s.all_messages(chat.id) if x.content == "figures not numbers")
        assert other.metrics is None  # as an import would refuse them, so the export leaves them out
        assert [x.content for x in s.thread(chat.id)] == ["kept"]


def test_a_chat_deeper_than_sqlite_cascades_go_is_deleted_whole_and_in_part(store):
    """A chat of 40,000 messages in one branch (an imported log): deleting it, or a message near its start,
    failed with SQLite's "too many levels of trigger recursion" (each level of the chain cascaded into the next,
    and SQLite stops at 1,000), and an id list that long is over SQLite's variable limit."""
    from app.chat_io import ImportedChat

    messages = [
        dict(
            role="user" if i % 2 == 0 else "assistant",
            content=f"m{i}",
            parent=i - 1 if i else None,
            status="done",
            created=1.0,
            updated=1.0,
            options=None,
            metrics=None,
            candidate_group=None,
            candidate_index=None,
            model_name=None,
        )
        for i in range(40_000)
    ]
    long = ImportedChat("long", 1.0, 1.0, "", None, None, len(messages) - 1, messages)
    chats = [store.get_chat(store.import_chat(long)) for _ in range(2)]
    keep = store.create_chat()
    store.add_message(keep.id, "user", "keep me", None)
    first, second = store.thread(chats[0].id)[:2]
    store.delete_message(second.id)
    assert texts(store.thread(chats[0].id)) == ["m0"] and store.count_messages(chats[0].id) == 1
    store.delete_chat(chats[1].id)
    assert store.count_messages(chats[1].id) == 0 and [c.id for c in store.list_chats()].count(chats[1].id) == 0
    assert texts(store.thread(keep.id)) == ["keep me"] and store.count_messages() == 2


@pytest.mark.parametrize(
    "sampling_json, overflow, said",
    [
        ("{bad", None, "its sampling settings (Expecting property name"),
        ("[1]", None, "its sampling settings (not an object)"),
        ('{"temperature": -1}', None, "its sampling settings (temperature"),
        ('{"min_p": 0.1}', None, "its sampling settings (unknown sampling parameter(s): min_p"),
        (None, "sideways", "its overflow policy ('sideways' is none of"),
    ],
)
def test_a_chat_with_damaged_settings_still_lists_opens_and_exports(store, sampling_json, overflow, said):
    """One chat's damaged sampling_json made every list of chats fail (the app could not start, `gapless chats
    list` failed): it reads as the defaults, saying what was dropped."""
    from app.chat_io import chat_document

    good = store.create_chat("good", sampling=SamplingParams(temperature=0.3))
    bad = store.create_chat("bad")
    store.add_message(bad.id, "user", "still here", None)
    db = sqlite3.connect(store.path)
    db.execute(
        "UPDATE chats SET sampling_json = ?, overflow_policy = ? WHERE id = ?", (sampling_json, overflow, bad.id)
    )
    db.commit()
    db.close()
    assert {c.title for c in store.list_chats()} == {"good", "bad"}
    read = store.get_chat(bad.id)
    assert read.sampling is None and read.overflow_policy is None
    assert read.damaged.startswith(said) and read.damaged.endswith("it uses the defaults until they are set again")
    assert store.get_chat(good.id).sampling["temperature"] == 0.3 and not store.get_chat(good.id).damaged
    assert [m["content"] for m in chat_document(store, bad.id)["messages"]] == ["still here"]
    store.update_chat(bad.id, sampling=SamplingParams(temperature=0.5), overflow_policy="stop")  # set again
    assert not store.get_chat(bad.id).damaged


def test_what_a_chat_holds_is_what_an_import_takes(store, tmp_path):
    """A message of 4.3 M characters (a pasted log) or a title of 1,500 was stored and exported, and the app's
    own import refused the file: the store refuses them, and a chat at the limits exports and imports whole."""
    from app.chat_io import export_json, import_chat, write_text
    from app.store import MAX_TEXT_CHARS, MAX_TITLE_CHARS

    with pytest.raises(StoreError, match=r"the message is 4,194,305 characters long; at most 4,194,304 are allowed"):
        store.add_message(store.create_chat().id, "user", "x" * (MAX_TEXT_CHARS + 1), None)
    with pytest.raises(StoreError, match="the title is 1,001 characters long; at most 1,000"):
        store.create_chat("t" * (MAX_TITLE_CHARS + 1))
    chat = store.create_chat("t" * MAX_TITLE_CHARS, system_prompt="s" * MAX_TEXT_CHARS)
    with pytest.raises(StoreError, match="the title is"):
        store.rename_chat(chat.id, "t" * (MAX_TITLE_CHARS + 1))
    with pytest.raises(StoreError, match="the system prompt is"):
        store.update_chat(chat.id, system_prompt="s" * (MAX_TEXT_CHARS + 1))
    parent = None
    for i in range(20):  # 80 M characters: more than the 64 MiB an import once took
        parent = store.add_message(
            chat.id, "user" if i % 2 == 0 else "assistant", str(i % 10) * MAX_TEXT_CHARS, parent
        ).id
    path = tmp_path / "big.json"
    write_text(path, export_json(store, chat.id))
    again = store.get_chat(import_chat(store, path))
    assert again.title == chat.title and again.system_prompt == chat.system_prompt
    assert [m.content for m in store.thread(again.id)] == [m.content for m in store.thread(chat.id)]
