"""ChatFlow (app/chat_flow.py) on a real chat store and a fake engine controller: what is stored and emitted for
sends, streams, stops, failures, stale events, branches and candidates, without a window or an engine."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QObject, Signal

from app.chat_flow import ELSEWHERE, ChatFlow, title_from
from app.store import ChatStore
from engine.types import EngineOptions, GenerationMetrics, GenerationResult, SamplingParams

SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=8, seed=1)


class FakeController(QObject):
    """The controller's face as ChatFlow sees it: generate() returns a request id, events come as signals."""

    generationStarted = Signal(int, object)
    textBatch = Signal(int, object)
    rowsFinished = Signal(int, object)
    generationFinished = Signal(int, object)
    generationFailed = Signal(int, str)

    def __init__(self):
        super().__init__()
        self.asked: list[list[dict]] = []
        self.cancels = 0
        self.info = None

    def generate(self, messages, sampling, raw=False, overflow="rolling") -> int:
        self.asked.append(messages)
        return len(self.asked)

    def cancel(self) -> None:
        self.cancels += 1

    # what the worker would send for request `rid`
    def run(self, rid: int, texts: list[str], reasons: list[str], options: EngineOptions = EngineOptions()) -> None:
        self.generationStarted.emit(rid, options)
        self.textBatch.emit(rid, {i: t for i, t in enumerate(texts)})
        metrics = GenerationMetrics(new_tokens=[len(t) for t in texts], new_tokens_total=sum(map(len, texts)))
        self.generationFinished.emit(
            rid, GenerationResult(texts, [[1] * len(t) for t in texts], reasons, metrics, options, {}, 1)
        )


@pytest.fixture
def flow(tmp_path, qapp):
    store = ChatStore(tmp_path / "chats.sqlite3")
    ctl = FakeController()
    f = ChatFlow(store, ctl, SAMPLING)
    yield f, store, ctl
    store.close()


def signals(f: ChatFlow, *names: str) -> dict[str, list]:
    heard: dict[str, list] = {n: [] for n in names}
    for n in names:
        getattr(f, n).connect(lambda *a, n=n: heard[n].append(a))
    return heard


def test_a_first_message_makes_a_chat_and_its_answer_is_stored(flow):
    f, store, ctl = flow
    heard = signals(f, "chatOpened", "streamStarted", "streamDelta", "streamFinished", "generatingChanged")
    assert f.send("Why is the sky blue?")
    chat = store.get_chat(f.chat_id)
    assert chat.title == title_from("Why is the sky blue?")
    assert ctl.asked == [[{"role": "user", "content": "Why is the sky blue?"}]]
    ctl.run(1, ["Rayleigh scattering."], ["eos"])
    user, answer = store.thread(f.chat_id)
    assert (user.role, answer.role, answer.content, answer.status) == (
        "user",
        "assistant",
        "Rayleigh scattering.",
        "done",
    )
    assert answer.parent_id == user.id and answer.metrics["new_tokens_total"] == len("Rayleigh scattering.")
    assert heard["streamDelta"] == [({0: "Rayleigh scattering."},)]
    assert heard["streamFinished"][0][0].content == "Rayleigh scattering."
    assert heard["generatingChanged"] == [(True,), (False,)] and not f.generating


def test_a_stopped_answer_keeps_its_text_and_says_stopped(flow):
    f, store, ctl = flow
    f.send("count")
    f.stop()
    assert ctl.cancels == 1
    ctl.run(1, ["1 2 3"], ["cancelled"])
    answer = store.thread(f.chat_id)[-1]
    assert (answer.content, answer.status) == ("1 2 3", "stopped")


def test_a_failure_keeps_text_written_before_it_and_drops_an_empty_answer(flow):
    f, store, ctl = flow
    failed = signals(f, "failed")["failed"]
    f.send("first")
    ctl.generationStarted.emit(1, EngineOptions())
    ctl.generationFailed.emit(1, "out of device memory")
    assert [m.role for m in store.thread(f.chat_id)] == ["user"]  # nothing to keep
    assert failed == [("The answer failed: out of device memory",)]
    f.send("second")
    ctl.generationStarted.emit(2, EngineOptions())
    ctl.textBatch.emit(2, {0: "partial"})
    ctl.generationFailed.emit(2, "engine error")
    answer = store.thread(f.chat_id)[-1]
    assert (answer.content, answer.status) == ("partial", "error")
    # its figures say why they are n/a (the stats tooltip was ten bare "n/a")
    assert answer.metrics["unavailable"]["decode_tok_s"] == "the answer failed: engine error"


def test_events_of_an_earlier_request_never_land_in_the_current_answer(flow):
    f, store, ctl = flow
    f.send("one")
    ctl.run(1, ["first answer"], ["eos"])
    f.send("two")
    deltas = signals(f, "streamDelta")["streamDelta"]
    ctl.generationStarted.emit(2, EngineOptions())
    ctl.textBatch.emit(1, {0: " late text of request 1"})  # a batch that arrives after its answer ended
    ctl.textBatch.emit(2, {0: "second answer"})
    ctl.run(1, ["stale"], ["eos"])  # a whole stale generation is ignored too
    ctl.generationFinished.emit(
        2, GenerationResult(["second answer"], [[1]], ["eos"], GenerationMetrics(), EngineOptions(), {}, 1)
    )
    assert deltas == [({0: "second answer"},)]  # on screen, only the current answer's text
    contents = [m.content for m in store.thread(f.chat_id)]
    assert contents == ["one", "first answer", "two", "second answer"]


def test_regenerate_and_edit_make_siblings_and_the_prompt_skips_empty_answers(flow):
    f, store, ctl = flow
    f.send("question")
    ctl.run(1, ["answer A"], ["eos"])
    first = store.thread(f.chat_id)[-1]
    f.regenerate(first.id)
    ctl.run(2, ["answer B"], ["eos"])
    assert [s.content for s in store.siblings(first.id)] == ["answer A", "answer B"]
    assert ctl.asked[1] == [{"role": "user", "content": "question"}]
    user = store.thread(f.chat_id)[0]
    f.edit(user.id, "question, edited")
    ctl.generationStarted.emit(3, EngineOptions())
    ctl.generationFailed.emit(3, "no")  # an answer that failed empty is dropped
    assert [s.content for s in store.siblings(user.id)] == ["question", "question, edited"]
    f.set_chat_settings("Be brief.", SAMPLING)
    f.send("more")
    assert ctl.asked[-1][0] == {"role": "system", "content": "Be brief."}
    assert all(m["content"] for m in ctl.asked[-1])


def test_candidates_wait_for_a_choice_and_the_chosen_one_continues_the_chat(flow):
    f, store, ctl = flow
    done = signals(f, "candidatesFinished")["candidatesFinished"]
    f.send("name a colour")
    ctl.run(1, ["red", "green", "blue"], ["eos", "eos", "length"], EngineOptions(candidates=3))
    assert len(done) == 1 and f.awaiting_choice()
    answers = store.siblings(store.thread(f.chat_id)[-1].id)
    assert [(a.content, a.candidate_index) for a in answers] == [("red", 0), ("green", 1), ("blue", 2)]
    f.choose_candidate(1)
    assert not f.awaiting_choice()
    assert store.thread(f.chat_id)[-1].content == "green"
    f.send("why?")
    assert ctl.asked[-1][-2:] == [{"role": "assistant", "content": "green"}, {"role": "user", "content": "why?"}]


def test_the_context_is_counted_from_the_candidate_on_screen(flow):
    """The meter counted the first candidate's branch whichever tab was shown; sending continues from the shown one."""
    f, store, ctl = flow
    f.send("name a colour")
    ctl.run(1, ["red", "a much longer green", "blue"], ["eos", "eos", "eos"], EngineOptions(candidates=3))
    for shown, answer in ((None, "red"), (0, "red"), (1, "a much longer green"), (2, "blue"), (7, "red")):
        assert f.draft_messages("why?", shown)[-2:] == [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "why?"},
        ]


def test_a_question_left_unanswered_is_not_asked_again_with_the_next(flow):
    f, store, ctl = flow
    failed = signals(f, "failed")["failed"]
    noticed = signals(f, "noticed")["noticed"]
    f.send("first")
    ctl.run(1, ["first answer"], ["eos"])
    f.send("a question refused as too long")
    ctl.generationFailed.emit(2, "the conversation takes 9,000 tokens, more than the 6,144 ...")
    f.send("stopped while it was read")
    ctl.generationStarted.emit(3, EngineOptions())
    ctl.run(3, [""], ["cancelled"])
    assert len(failed) == 1
    roles = [m.role for m in store.thread(f.chat_id)]
    assert roles == ["user", "assistant", "user", "user"]  # both questions stay on screen
    assert f.draft_messages("next") == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "next"},
    ]
    one = (
        "an earlier question was never answered (refused, failed or stopped while read) and is not sent with this "
        "one; it stays in the chat"
    )
    assert noticed == [(one,)]  # at "stopped while it was read": the refused one before it
    f.send("next")
    assert ctl.asked[-1] == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "next"},
    ]
    # said, not done silently (a pasted document stopped while it was read was left out of the next question)
    assert noticed[1:] == [
        (
            "2 earlier questions were never answered (refused, failed or stopped while read) and are not sent with "
            "this one; they stay in the chat",
        )
    ]
    ctl.run(4, ["the next answer"], ["eos"])
    f.send("and then")  # an answered question stays in the conversation
    assert len(noticed) == 2  # the two left out before "next" were said then, not again at each question
    assert [m["content"] for m in ctl.asked[-1]] == ["first", "first answer", "next", "the next answer", "and then"]
    # while its answer streams, the question being answered is counted with a new draft
    ctl.generationStarted.emit(5, EngineOptions())
    ctl.textBatch.emit(5, {0: "partial"})
    draft = [m["content"] for m in f.draft_messages("a draft")]
    assert draft == ["first", "first answer", "next", "the next answer", "and then", "a draft"]


def test_an_answer_that_ended_empty_is_an_answer(flow):
    """The model's end of turn (or a stop string) at once is an empty answer, done: the question before it was left
    out of the next prompt and the user told it was never answered."""
    f, store, ctl = flow
    noticed = signals(f, "noticed")["noticed"]
    f.send("hello")
    ctl.run(1, [""], ["eos"])
    assert [(m.role, m.content, m.status) for m in store.thread(f.chat_id)][-1] == ("assistant", "", "done")
    f.send("are you there?")
    assert ctl.asked[-1] == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "are you there?"},
    ]
    assert noticed == []


def test_a_chat_whose_stored_sampling_is_damaged_says_so_and_answers_with_the_defaults(flow):
    """A stored sampling that no longer validates made Send store the question and raise in a Qt slot: no answer,
    no message, and the question asked again on every retry."""
    import sqlite3

    f, store, ctl = flow
    chat = store.create_chat("old", sampling=SamplingParams(temperature=0.5))
    db = sqlite3.connect(store.path)
    db.execute("UPDATE chats SET sampling_json = ? WHERE id = ?", ('{"temperature": -1}', chat.id))
    db.commit()
    db.close()
    heard = signals(f, "failed")
    f.open_chat(chat.id)
    assert len(heard["failed"]) == 1
    assert heard["failed"][0][0].startswith("This chat's sampling settings (temperature")
    assert heard["failed"][0][0].endswith("it uses the defaults until they are set again in Chat settings")
    assert f.sampling() == SAMPLING
    assert f.send("hello") and ctl.asked == [[{"role": "user", "content": "hello"}]]
    ctl.run(1, ["hi"], ["eos"])
    assert [m.content for m in store.thread(chat.id)] == ["hello", "hi"]


def test_an_answer_s_options_are_kept_resolved_from_its_start(flow):
    """An answer cut off by a crash keeps the options stored at its start: "auto" device and dtype named no preset
    ("custom"); they are stored as the loaded model resolved them."""
    from types import SimpleNamespace

    from ui.stats import options_label

    f, store, ctl = flow
    ctl.info = SimpleNamespace(device="cpu", dtype="fp32", name="m")
    f.send("hello")
    ctl.generationStarted.emit(1, EngineOptions())
    streaming = store.thread(f.chat_id)[-1]
    assert streaming.status == "streaming"
    assert (streaming.options["device"], streaming.options["dtype"]) == ("cpu", "fp32")
    assert options_label(streaming.options) == "+ static KV cache"


def test_a_first_message_refused_as_too_long_leaves_no_chat_behind(flow):
    """The chat was made, titled with the refused text, before the message was refused: it stayed in the list
    empty, and the next message went into it under that title."""
    from app.store import MAX_TEXT_CHARS

    f, store, ctl = flow
    heard = signals(f, "failed")
    secret = "Secret plan: " + "x" * MAX_TEXT_CHARS
    assert not f.send(secret)
    assert heard["failed"] and "4,194,304" in heard["failed"][0][0]
    assert store.list_chats() == [] and f.chat_id is None and ctl.asked == []
    assert f.send("hello")
    assert [c.title for c in store.list_chats()] == [title_from("hello")]


def test_a_message_of_only_nul_characters_is_not_sent(flow):
    """The prompt drops NULs: a message of them and spaces made a chat with an invisible title, then failed as
    "empty prompt", the blank chat left in the list."""
    f, store, ctl = flow
    assert not f.send("\x00\x00 \x00\n")
    assert store.list_chats() == [] and ctl.asked == []
    assert f.send("a\x00b")  # NULs inside words are kept, as before
    assert ctl.asked == [[{"role": "user", "content": "a\x00b"}]]
    ctl.run(1, ["answer"], ["eos"])
    question = store.thread(f.chat_id)[0]
    # an edit to nothing but NULs and spaces was stored as a new branch and then failed as "empty prompt"
    assert not f.edit(question.id, "\x00 \x00\n")
    assert [m.content for m in store.siblings(question.id)] == ["a\x00b"] and len(ctl.asked) == 1


def test_a_long_first_message_s_title_is_cut_between_characters_as_seen():
    """The title was cut at the 47th code point: a flag, a person at a laptop (three code points) or a letter and
    its accent split there, the title ending in a lone regional letter, a joiner or an "e" without its accent."""
    assert title_from("🇫🇷" * 30) == "🇫🇷" * 23 + "…"
    assert title_from("Plan: " + "👩\u200d💻" * 20) == "Plan: " + "👩\u200d💻" * 13 + "…"
    assert title_from("a" * 46 + "e\u0301tude") == "a" * 46 + "…"
    assert title_from("x" * 100) == "x" * 47 + "…" and title_from("Why is the sky blue?") == "Why is the sky blue?"
    assert title_from("e" + "\u0301" * 100) == ("e" + "\u0301" * 100)[:47] + "…"  # one character: cut inside it


def test_a_long_branch_is_shown_with_a_fixed_number_of_queries_and_the_same_branch_positions(flow, monkeypatch):
    """Each message's place among its siblings was a query of its own: a chat of 3,000 messages took 0.2 s of the
    GUI thread to open, edit, regenerate or switch branch."""
    from chat_threads import chain

    f, store, _ctl = flow

    def reads_to_show(n: int) -> tuple[int, list]:
        chat = store.create_chat()
        msgs = chain(store, chat.id, *(f"m{i}" for i in range(n)))
        store.add_message(chat.id, "user", "another first question", None)  # a branch at the root
        store.add_message(chat.id, "user", "an edit", msgs[-2].parent_id)  # and one near the end
        store.set_active_leaf(chat.id, msgs[-1].id)
        f.chat_id = chat.id
        calls = []
        real = store._read
        monkeypatch.setattr(store, "_read", lambda *a: calls.append(a) or real(*a))
        items = f.items()
        monkeypatch.setattr(store, "_read", real)
        return len(calls), items

    few, _ = reads_to_show(6)
    many, items = reads_to_show(300)
    assert many == few <= 3
    for item in items:  # what siblings() says, one message at a time
        sibs = [s.id for s in store.siblings(item.id)]
        assert (item.sibling_index, item.sibling_count) == (sibs.index(item.id), len(sibs))
    assert [(i.sibling_index, i.sibling_count) for i in (items[0], items[-2])] == [(0, 2), (0, 2)]


class ListedChats:
    """The chat list as the window shows it: the store's (id, title, updated) read again at each chatsChanged."""

    def __init__(self, f: ChatFlow, store: ChatStore):
        self.store = store
        self.shown = store.chat_titles()
        self.needless: list[list] = []  # lists read again with nothing changed
        f.chatsChanged.connect(self._read)

    def _read(self) -> None:
        now = self.store.chat_titles()
        if now == self.shown:
            self.needless.append(now)
        self.shown = now

    def stale(self) -> bool:
        return self.shown != self.store.chat_titles()


def two_answered_chats(f, ctl):
    """Two chats of one answered message each, the older made first: (older, newer) ids."""
    f.send("older")
    ctl.run(1, ["older answer"], ["eos"])
    older = f.chat_id
    f.new_chat()
    f.send("newer")
    ctl.run(2, ["newer answer"], ["eos"])
    return older, f.chat_id


def test_the_chat_list_is_read_again_whenever_a_chat_s_title_order_or_age_changes_and_only_then(flow):
    """OK in Chat settings, an edit, a regenerated answer that failed or was stopped before its first token, a batch
    of candidates and an answer that ended in a chat no longer on screen all moved their chat up (or changed its
    age) in the store without chatsChanged: the list kept the old order until something else read it again. A
    rename or a deletion the store refused read the list again for nothing."""
    f, store, ctl = flow
    listed = ListedChats(f, store)
    older, newer = two_answered_chats(f, ctl)
    assert not listed.stale() and [c[0] for c in listed.shown] == [newer, older]

    f.open_chat(older)
    f.set_chat_settings("Be brief.", SAMPLING)  # OK in Chat settings
    assert not listed.stale() and listed.shown[0][0] == older

    f.open_chat(newer)
    f.edit(store.thread(newer)[0].id, "newer, edited")
    assert not listed.stale() and listed.shown[0][0] == newer
    ctl.generationStarted.emit(3, EngineOptions())
    ctl.generationFailed.emit(3, "out of device memory")  # the empty answer is dropped
    assert not listed.stale()

    f.open_chat(older)
    f.regenerate(store.thread(older)[-1].id)
    ctl.generationStarted.emit(4, EngineOptions())
    assert not listed.stale() and listed.shown[0][0] == older
    ctl.run(4, [""], ["cancelled"])  # stopped while the prompt was read: the answer is removed
    assert not listed.stale()

    f.open_chat(newer)
    f.send("name two colours")
    ctl.run(5, ["red", "blue"], ["eos", "eos"], EngineOptions(candidates=2))
    assert f.awaiting_choice() and not listed.stale()

    f.open_chat(older)
    f.send("one more")
    f.open_chat(newer)  # the answer ends while another chat is on screen
    ctl.run(6, ["one more answer"], ["eos"])
    assert not listed.stale() and listed.shown[0][0] == older

    f.rename_chat(newer, "x" * 1001)  # refused: a title is at most 1,000 characters
    answer = store.thread(older)[-1]
    with ChatStore(store.path) as elsewhere:  # the command line deletes it first
        elsewhere.delete_message(answer.id)
    f.open_chat(older)
    f.delete_message(answer.id)  # said once, and the list read once
    assert listed.needless == [] and not listed.stale()


def fill_the_disk(store: ChatStore) -> None:
    """The database file cannot grow: SQLITE_FULL on the next write that needs a page, as on a full disk."""
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages + 1}")


def test_a_first_message_a_full_disk_cannot_take_leaves_no_empty_chat(flow):
    """The chat was made, then its first message did not fit on the disk: an empty chat titled with the message
    stayed in the list (and in a chat made by Chat settings, its title was changed to the message's), though
    nothing of the message was kept."""
    f, store, ctl = flow
    listed = ListedChats(f, store)
    heard = signals(f, "failed", "chatOpened")
    fill_the_disk(store)
    long = "y" * 100_000  # the chat's row fits in the page left, the message does not
    full = ("cannot save the message in the chat database: database or disk is full",)

    assert not f.send(long)
    assert heard["failed"] == [full] and heard["chatOpened"] == []
    assert store.chat_titles() == [] and f.chat_id is None and ctl.asked == []
    assert not listed.stale()

    f.set_chat_settings("Be brief.", SAMPLING)  # made by Chat settings, as "New chat", before its first message
    made = f.chat_id
    assert not f.send(long)
    assert [c[1] for c in store.chat_titles()] == ["New chat"] and store.thread(made) == []
    assert store.get_chat(made).system_prompt == "Be brief." and not listed.stale()

    store._db.execute("PRAGMA max_page_count = 1073741823")  # room again
    assert f.send("hello")
    ctl.run(1, ["hi"], ["eos"])
    fill_the_disk(store)
    assert not f.send(long)  # a later message: nothing stored, the chat as it was
    assert [m.content for m in store.thread(made)] == ["hello", "hi"]
    assert [c[1] for c in store.chat_titles()] == ["hello"] and not listed.stale()
    assert heard["failed"] == [full] * 3 and len(ctl.asked) == 1


def test_chat_settings_of_a_new_chat_are_stored_whole_or_not_at_all(flow):
    """Chat settings on a new chat made the chat, then gave it its overflow policy in a second write: where that
    write failed, the chat stayed with the default policy, and the chat was opened and listed after the error."""
    f, store, ctl = flow
    listed = ListedChats(f, store)
    heard = signals(f, "failed", "chatOpened")
    store._db.execute(  # any change of a stored chat fails, as a disk error would fail the second write
        "CREATE TEMP TRIGGER no_update BEFORE UPDATE ON chats BEGIN SELECT RAISE(ABORT, 'disk I/O error'); END"
    )
    f.set_chat_settings("Be brief.", SAMPLING, "stop")
    made = f.chat_id
    assert heard["failed"] == [] and heard["chatOpened"] == [(made,)] and not listed.stale()
    chat = store.get_chat(made)
    assert (chat.title, chat.system_prompt, chat.overflow_policy) == ("New chat", "Be brief.", "stop")
    assert chat.sampling == SAMPLING.to_dict()

    store._db.execute("DROP TRIGGER no_update")
    f.new_chat()
    heard["chatOpened"].clear()
    fill_the_disk(store)
    f.set_chat_settings("Be long." * 100_000, SAMPLING, "truncate-middle")  # the chat's row does not fit
    assert heard["failed"] == [("cannot create a chat in the chat database: database or disk is full",)]
    assert heard["chatOpened"] == [] and f.chat_id is None
    assert [c[0] for c in store.chat_titles()] == [made] and not listed.stale()


def test_a_rename_to_the_title_the_chat_has_leaves_it_where_it_is_in_the_list(flow):
    """F2 (or Rename…) then OK with the title as it was: the store counted it as a change, so the chat came first in
    the list with its age "just now", though nothing in it changed (as OK in Chat settings did before)."""
    f, store, ctl = flow
    older, newer = two_answered_chats(f, ctl)
    listed = ListedChats(f, store)
    before = store.get_chat(older)

    f.rename_chat(older, before.title)  # OK in the rename box, nothing typed
    assert store.get_chat(older).updated == before.updated
    assert [c[0] for c in store.chat_titles()] == [newer, older]
    assert listed.needless == [] and not listed.stale()

    f.rename_chat(older, "Renamed")
    renamed = store.get_chat(older)
    assert renamed.title == "Renamed" and renamed.updated > before.updated
    assert [c[0] for c in listed.shown] == [older, newer] and listed.needless == [] and not listed.stale()


def test_a_rename_and_chat_settings_are_saved_without_reading_the_chat_first(flow, monkeypatch):
    """A rename and OK in Chat settings read the chat before they wrote (to tell whether anything changed): a read
    the store refused (a disk error) said "cannot read the chat" and dropped the rename, and ended the settings'
    call in "AttributeError: 'bool' object has no attribute 'updated'" once they were saved. The store's write now
    says whether it changed the chat; the chat is not read at all."""
    from app.store import StoreError

    f, store, ctl = flow
    older, newer = two_answered_chats(f, ctl)
    listed = ListedChats(f, store)
    failed = signals(f, "failed")["failed"]
    reads = []

    def unreadable(chat_id):
        reads.append(chat_id)
        raise StoreError("cannot read the chat: disk I/O error")

    monkeypatch.setattr(store, "get_chat", unreadable)
    f.rename_chat(older, "Renamed")
    assert [c[:2] for c in listed.shown] == [(older, "Renamed"), (newer, "newer")]
    f.rename_chat(older, "Renamed")  # the title it has: nothing changed, the list is not read again
    f.set_chat_settings("Be brief.", SAMPLING, "stop")  # the chat on screen: newer
    assert [c[0] for c in listed.shown] == [newer, older]
    f.set_chat_settings("Be brief.", SAMPLING, "stop")  # as they are
    monkeypatch.undo()
    assert reads == [] and failed == [] and listed.needless == [] and not listed.stale()
    chat = store.get_chat(newer)
    assert (chat.system_prompt, chat.overflow_policy) == ("Be brief.", "stop")


def test_an_answer_with_a_figure_that_is_not_finite_is_saved_with_why(flow):
    """A figure that came out NaN or infinite (as the command line's and the server's JSON allow for): the store
    refused the answer's figures ("ValueError: Out of range float values are not JSON compliant" in the slot), the
    answer stayed empty and "streaming", and the window stayed generating: no message could be sent after it."""
    f, store, ctl = flow
    f.send("hi")
    ctl.generationStarted.emit(1, EngineOptions())
    ctl.textBatch.emit(1, {0: "hello"})
    metrics = GenerationMetrics(new_tokens=[5], new_tokens_total=5)
    metrics.ttft_ms, metrics.decode_tok_s = float("nan"), float("inf")
    ctl.generationFinished.emit(1, GenerationResult(["hello"], [[1] * 5], ["eos"], metrics, EngineOptions(), {}, 1))
    answer = store.thread(f.chat_id)[-1]
    assert (answer.content, answer.status, f.generating) == ("hello", "done", False)
    assert answer.metrics["ttft_ms"] is None and answer.metrics["decode_tok_s"] is None
    assert answer.metrics["unavailable"]["ttft_ms"] == "came out as nan, not a finite number"
    assert answer.metrics["unavailable"]["decode_tok_s"] == "came out as inf, not a finite number"
    assert answer.metrics["new_tokens_total"] == 5
    assert f.send("and then?")  # the next message goes out


def test_an_answer_saved_but_not_read_back_ends_on_screen_and_in_the_list(flow, monkeypatch):
    """The answer was saved, then reading it back to show it failed (a disk error): the user saw the store's bare
    "cannot read the chat database" with no word of the answer, the answer stayed "generating…" on screen with
    nothing to regenerate or delete it by, and the chat list kept the chat's age from before the answer."""
    from app.store import StoreError

    f, store, ctl = flow
    older, newer = two_answered_chats(f, ctl)
    f.open_chat(older)
    assert f.send("and why at sunset?")
    ctl.generationStarted.emit(3, EngineOptions())
    ctl.textBatch.emit(3, {0: "longer path"})
    listed = ListedChats(f, store)
    heard = signals(f, "failed", "streamFinished", "threadChanged")

    def unreadable(_message_id):
        raise StoreError("cannot read the chat database: disk I/O error")

    monkeypatch.setattr(store, "get_message", unreadable)
    metrics = GenerationMetrics(new_tokens=[11], new_tokens_total=11)
    metrics.ttft_ms = float("nan")
    ctl.generationFinished.emit(
        3, GenerationResult(["longer path, more red"], [[1] * 11], ["eos"], metrics, EngineOptions(), {}, 1)
    )
    monkeypatch.undo()

    saved = store.thread(older)[-1]
    assert (saved.content, saved.status, f.generating) == ("longer path, more red", "done", False)
    assert heard["failed"] == [
        ("The answer is saved, but it cannot be read back to show it: cannot read the chat database: disk I/O error",)
    ]
    [(item,)] = heard["streamFinished"]
    assert (item.id, item.role, item.content, item.finish_reason) == (saved.id, "assistant", saved.content, "eos")
    assert item.metrics == saved.metrics and item.metrics["ttft_ms"] is None  # as stored: n/a with the reason
    assert heard["threadChanged"] == [] and not listed.stale() and [c[0] for c in listed.shown] == [older, newer]


def _two_versions(f: ChatFlow, store: ChatStore, ctl: FakeController) -> tuple[int, int]:
    """A chat whose question was edited once, both answered; the edited branch is on screen. (first answer,
    edited answer)"""
    f.send("question")
    ctl.run(1, ["answer one"], ["eos"])
    first_answer = store.thread(f.chat_id)[-1].id
    f.edit(store.thread(f.chat_id)[0].id, "question, edited")
    ctl.run(2, ["answer two"], ["eos"])
    return first_answer, store.thread(f.chat_id)[-1].id


def test_a_message_sent_goes_under_the_branch_on_screen_when_another_window_chose_another(flow):
    """Two windows on one chat share its stored active leaf: a send went under the branch the other window
    showed last, and appeared on screen under one it was not part of."""
    f, store, ctl = flow
    first_answer, edited_answer = _two_versions(f, store, ctl)
    other = ChatFlow(store, FakeController(), SAMPLING)
    other.open_chat(f.chat_id)
    question = store.get_message(edited_answer).parent_id
    other.step_sibling(question, -1)  # the other window goes back to the first version
    assert store.get_chat(f.chat_id).active_leaf_id == first_answer
    assert f.draft_messages("more")[:-1] == [
        {"role": "user", "content": "question, edited"},
        {"role": "assistant", "content": "answer two"},
    ]
    appended = signals(f, "messageAppended")["messageAppended"]
    assert f.send("more")
    sent = store.thread(f.chat_id)[-1]
    assert (sent.content, sent.parent_id) == ("more", edited_answer)
    assert [item.id for (item,) in appended] == [sent.id]
    assert ctl.asked[-1] == [
        {"role": "user", "content": "question, edited"},
        {"role": "assistant", "content": "answer two"},
        {"role": "user", "content": "more"},
    ]
    ctl.run(3, ["and more"], ["eos"])
    assert [m.content for m in store.thread(f.chat_id)] == ["question, edited", "answer two", "more", "and more"]


def test_a_send_under_a_message_deleted_elsewhere_keeps_the_draft_and_shows_the_chat_as_it_is(flow):
    f, store, ctl = flow
    first_answer, edited_answer = _two_versions(f, store, ctl)
    other = ChatFlow(store, FakeController(), SAMPLING)
    other.open_chat(f.chat_id)
    other.delete_message(store.get_message(edited_answer).parent_id)  # the edited branch, from the other window
    heard = signals(f, "failed", "threadChanged")
    # the context meter counts the chat as stored until the view is (it raised "message 4 is not in chat 1")
    assert [m["content"] for m in f.draft_messages("more")] == ["question", "answer one", "more"]
    assert not f.send("more")  # the composer keeps the draft
    assert [m.content for m in store.thread(f.chat_id)] == ["question", "answer one"]
    assert len(ctl.asked) == 2
    assert heard["failed"] == [
        (f"A message of this chat was deleted elsewhere ({ELSEWHERE}); it is shown as it is now",)
    ]
    assert [[i.content for i in items] for (items,) in heard["threadChanged"]] == [["question", "answer one"]]
    assert f.send("more")  # sent again: under the branch now on screen
    assert store.thread(f.chat_id)[-1].parent_id == first_answer
