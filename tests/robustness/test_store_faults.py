"""The chat store under faults: a killed process, damaged or newer databases, read-only and full disks,
a second process writing at the same time. Each keeps what was saved and says what happened."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from chat_threads import streaming_answer

from app.store import SCHEMA_VERSION, ChatStore, StoreError, StreamSaver

ROOT = Path(__file__).resolve().parents[2]


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


STREAMER = r"""
import sys, time
from app.store import ChatStore, StreamSaver
store = ChatStore(sys.argv[1])
chat = store.create_chat("crash")
user = store.add_message(chat.id, "user", "tell me a long story", None)
answer = store.add_message(chat.id, "assistant", "", user.id, status="streaming")
saver = StreamSaver(store, answer.id, min_interval_s=0.5)
print("ready", chat.id, answer.id, flush=True)
i = 0
while True:
    saver.append(f"w{i} ")
    print(i, time.monotonic(), flush=True)
    i += 1
    time.sleep(0.02)
"""


def start_streamer(db: Path) -> tuple[subprocess.Popen, int, int]:
    """A child process streaming an answer into `db` until killed: (process, chat id, answer id)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STREAMER, str(db)], stdout=subprocess.PIPE, text=True, env=child_env()
    )
    _, chat_id, answer_id = proc.stdout.readline().split()
    return proc, chat_id, answer_id


def test_kill_mid_answer_loses_at_most_about_a_second(tmp_path):
    db = tmp_path / "chats.sqlite3"
    proc, chat_id, answer_id = start_streamer(db)
    try:
        appended: list[tuple[int, float]] = []
        while not appended or appended[-1][1] - appended[0][1] < 2.0:  # stream for 2 s of the child's clock
            line = proc.stdout.readline()
            assert line, "the streaming process ended early"
            i, t = line.split()
            appended.append((int(i), float(t)))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    with ChatStore(db) as store:
        m = store.get_message(answer_id)
        assert m.status == "stopped"  # recovered on open
        words = m.content.split()
        assert m.content == "".join(f"w{i} " for i in range(len(words)))  # an exact prefix of what streamed
        last_t = appended[-1][1]
        must_have = max(i for i, t in appended if t <= last_t - 1.0)
        assert len(words) > must_have, (len(words), must_have)
        assert [x.content for x in store.thread(chat_id)] == ["tell me a long story", m.content]


def test_newer_database_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path) as s:
        s.create_chat("from the future")
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    before = sha(path)
    listing = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(StoreError, match=rf"newer version of Gapless \(schema {SCHEMA_VERSION + 1}.*left untouched"):
        ChatStore(path)
    assert sha(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing


def test_file_that_is_not_a_database_is_moved_aside(tmp_path):
    path = tmp_path / "chats.sqlite3"
    junk = b"this is not SQLite at all\n" * 200
    path.write_bytes(junk)
    with ChatStore(path) as s:
        assert len(s.notices) == 1 and "damaged" in s.notices[0]
        aside = [p for p in tmp_path.iterdir() if p.name.startswith("chats.sqlite3.corrupt-")]
        assert len(aside) == 1 and aside[0].read_bytes() == junk
        assert aside[0].name in s.notices[0]
        assert s.list_chats() == [] and s.create_chat("fresh").title == "fresh"


def test_damaged_pages_are_detected_and_moved_aside(tmp_path):
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path) as s:
        chat = s.create_chat()
        parent = None
        for i in range(400):
            parent = s.add_message(chat.id, "user", f"message {i} " + "x" * 200, parent).id
    assert not path.with_name(path.name + "-wal").exists()  # checkpointed on close
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 8 * page
    for p in range(2, len(data) // page - 1, 2):  # scribble over every other b-tree page header
        data[p * page : p * page + 64] = b"\xa5" * 64
    path.write_bytes(bytes(data))
    with ChatStore(path) as s:
        assert s.notices and "damaged" in s.notices[0]
        assert s.count_messages() == 0
    assert len(list(tmp_path.glob("chats.sqlite3.corrupt-*"))) == 1


def _as_nobody(fn) -> tuple[int, str]:
    """Run fn() in a forked child with the uid of `nobody` (root ignores file permissions). -> (code, text)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        signal.alarm(60)  # a child stuck on a lock inherited from another thread dies instead of hanging the suite
        code, text = 0, ""
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            text = fn()
        except StoreError as exc:
            code, text = 1, str(exc)
        except BaseException as exc:
            code, text = 2, f"{type(exc).__name__}: {exc}"
        os.write(w, text.encode())
        os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode()


@pytest.fixture
def shared_tmp():
    """A temporary folder the unprivileged child can reach (pytest's tmp_path is private to root)."""
    d = Path(tempfile.mkdtemp(prefix="gapless-ro-"))
    os.chmod(d, 0o755)
    yield d
    for p in sorted(d.rglob("*"), reverse=True):
        p.chmod(0o755) if p.is_dir() else None
    subprocess.run(["rm", "-rf", str(d)], check=True)


def test_read_only_folder_without_database_is_a_clear_error(shared_tmp):
    folder = shared_tmp / "data"
    folder.mkdir()
    os.chmod(folder, 0o555)
    code, text = _as_nobody(lambda: repr(ChatStore(folder / "chats.sqlite3").list_chats()))
    assert code == 1, text
    assert text.startswith(f"cannot open the chat database {folder / 'chats.sqlite3'}")
    assert f"the folder {folder} is not writable" in text


def test_read_only_folder_keeps_the_existing_chats(shared_tmp):
    folder = shared_tmp / "data"
    folder.mkdir()
    path = folder / "chats.sqlite3"
    with ChatStore(path) as s:
        s.add_message(s.create_chat("precious").id, "user", "keep me", None)
    before = sha(path)
    os.chmod(path, 0o444)
    os.chmod(folder, 0o555)
    code, text = _as_nobody(lambda: json.dumps([c.title for c in ChatStore(path).list_chats()]))
    assert code == 1, text
    assert "cannot open the chat database" in text and "not writable" in text
    assert sha(path) == before
    os.chmod(folder, 0o755)
    with ChatStore(path) as s:
        assert [m.content for m in s.thread(s.list_chats()[0].id)] == ["keep me"]


def test_full_disk_write_fails_clearly_and_keeps_saved_data(tmp_path):
    path = tmp_path / "chats.sqlite3"
    s = ChatStore(path)
    chat, _, a = streaming_answer(s, "saved before the disk filled")
    pages = s._db.execute("PRAGMA page_count").fetchone()[0]
    s._db.execute(f"PRAGMA max_page_count = {pages + 1}")  # the file cannot grow: SQLITE_FULL, as on a full disk
    with pytest.raises(StoreError, match="cannot save the message in the chat database: database or disk is full"):
        s.add_message(chat.id, "user", "y" * 100_000, a.id)
    saver = StreamSaver(s, a.id, min_interval_s=0.0)
    saver.append("z" * 100_000)  # an intermediate save fails quietly, the text stays in memory
    assert isinstance(saver.last_error, StoreError) and len(saver.text) == 100_000
    with pytest.raises(StoreError, match="database or disk is full"):
        saver.finish("done")
    assert [m.content for m in s.thread(chat.id)] == ["saved before the disk filled", ""]
    s.close()
    with ChatStore(path) as again:
        assert [m.content for m in again.thread(chat.id)] == ["saved before the disk filled", ""]
        assert again.get_message(a.id).status == "stopped"


WRITER = r"""
import sys
from app.store import ChatStore
store = ChatStore(sys.argv[1])
chat = int(sys.argv[2])
parent = None
for i in range(int(sys.argv[3])):
    parent = store.add_message(chat, "user", f"child {i}", parent).id
    if i % 10 == 0:
        store.list_chats("child")
store.close()
"""


def test_second_process_writing_concurrently(tmp_path):
    path = tmp_path / "chats.sqlite3"
    store = ChatStore(path)
    theirs = store.create_chat("theirs")
    ours = store.create_chat("ours")
    n = 150
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(theirs.id), str(n)],
        env=child_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    parent = None
    deadline = time.monotonic() + 120
    i = 0
    while proc.poll() is None or i < n:
        if i < n:
            parent = store.add_message(ours.id, "user", f"parent {i}", parent).id
            i += 1
        else:
            time.sleep(0.01)
        assert time.monotonic() < deadline
    assert proc.returncode == 0, proc.stderr.read()
    # A third opener (like a restarted app) sees both threads whole.
    with ChatStore(path) as third:
        assert [m.content for m in third.thread(theirs.id)] == [f"child {k}" for k in range(n)]
        assert [m.content for m in third.thread(ours.id)] == [f"parent {k}" for k in range(n)]
        assert third.count_messages() == 2 * n
    store.close()
    assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def _scribble_index(path: Path, index: str) -> None:
    """Overwrite the cells of one index's root page, leaving the tables' pages as they were."""
    db = sqlite3.connect(path)
    root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (index,)).fetchone()[0]
    page = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    data = bytearray(path.read_bytes())
    start = (root - 1) * page
    data[start + 200 : start + 500] = b"\xa5" * 300
    path.write_bytes(bytes(data))


def test_damaged_index_is_rebuilt_and_every_chat_kept(tmp_path):
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path) as s:
        chats = [s.create_chat(f"chat {c}") for c in range(2)]
        for chat in chats:
            parent = None
            for i in range(60):
                parent = s.add_message(chat.id, "user", f"{chat.title} message {i}", parent).id
    _scribble_index(path, "messages_by_chat")
    assert sqlite3.connect(path).execute("PRAGMA quick_check").fetchone()[0] != "ok"
    with ChatStore(path) as s:
        assert len(s.notices) == 1 and "indexes were rebuilt and every chat kept" in s.notices[0], s.notices
        assert "\n" not in s.notices[0] and "***" not in s.notices[0] and len(s.notices[0]) < 500  # one line
        assert sorted(c.title for c in s.list_chats()) == ["chat 0", "chat 1"]
        for chat in chats:
            assert [m.content for m in s.thread(chat.id)] == [f"{chat.title} message {i}" for i in range(60)]
        assert s.count_messages() == 120
    aside = [p for p in tmp_path.glob("chats.sqlite3.corrupt-*") if not p.name.endswith(("-wal", "-shm"))]
    assert len(aside) == 1 and aside[0].name in s.notices[0]  # the damaged file itself is kept
    assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_live_answer_in_another_process_is_not_marked_cut_off(tmp_path):
    db = tmp_path / "chats.sqlite3"
    proc, chat_id, answer_id = start_streamer(db)
    try:
        for _ in range(30):  # past the first save
            assert proc.stdout.readline(), "the streaming process ended early"
        with ChatStore(db) as reader:  # e.g. `gapless chats list` while the app answers
            m = reader.get_message(answer_id)
            assert m.status == "streaming" and m.metrics is None
        with ChatStore(db) as reader:
            assert reader.get_message(answer_id).status == "streaming"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    with ChatStore(db) as after_crash:  # its process is gone: now it was cut off
        m = after_crash.get_message(answer_id)
        assert m.status == "stopped" and m.metrics["finish_reason"] == "interrupted"


def test_a_busy_database_opens_for_reading(tmp_path):
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path) as s:
        s.add_message(s.create_chat("readable").id, "user", "hello", None)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        with ChatStore(path, busy_timeout_ms=200) as s:
            assert [c.title for c in s.list_chats()] == ["readable"]
    finally:
        other.execute("ROLLBACK")
        other.close()


def test_a_database_that_cannot_open_on_a_full_disk_says_the_disk_is_full(tmp_path, monkeypatch):
    import shutil

    def io_error(self):  # what SQLite says when it cannot create its write-ahead log
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(ChatStore, "_connect_checked", io_error)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(StoreError, match=r"disk I/O error; the disk holding .* is full \(4,096 bytes free\)$"):
        ChatStore(tmp_path / "chats.sqlite3")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**8, 9 * 10**8))
    with pytest.raises(StoreError) as err:
        ChatStore(tmp_path / "chats.sqlite3")
    assert str(err.value).endswith(": disk I/O error")  # room on the disk: not called full


def test_a_busy_database_with_an_answer_to_recover_still_opens_for_reading(tmp_path):
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path) as s:
        chat, _, answer = streaming_answer(s, "cut off")
    db = sqlite3.connect(path)
    db.execute("UPDATE messages SET owner = NULL WHERE id = ?", (answer.id,))  # as a crash leaves it
    db.commit()
    db.close()
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock past the busy timeout
    try:
        with ChatStore(path, busy_timeout_ms=200) as s:
            assert [m.content for m in s.thread(chat.id)] == ["cut off", ""]
            assert s.get_message(answer.id).status == "streaming"  # shown as it was saved
            assert len(s.notices) == 1 and s.notices[0].startswith("1 answer(s) cut off when Gapless last closed")
    finally:
        other.execute("ROLLBACK")
        other.close()
    with ChatStore(path) as s:  # the next open recovers it
        assert s.get_message(answer.id).status == "stopped" and s.notices == []
