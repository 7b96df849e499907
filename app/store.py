"""The chat store: chats and their message trees in one SQLite file (WAL), safe against crashes and a second app.

Messages form a tree through `parent_id`: editing a user message and resending adds a sibling under the same
parent (a branch); N candidates of one answer are assistant siblings sharing a `candidate_group`. A chat
remembers the leaf of the branch on screen (`active_leaf_id`); `thread()` is the root-to-leaf path.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import sqlite3
import sys
import threading
import time
import unicodedata
import uuid
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from engine import figures
from engine.errors import GaplessError, OptionsError, one_line
from engine.types import EngineOptions, GenerationMetrics, whole_text

log = logging.getLogger(__name__)

STATUSES = ("done", "streaming", "stopped", "error")
ROLES = ("system", "user", "assistant")
BUSY_TIMEOUT_MS = 5000
FULL_DISK_BYTES = 1 << 20  # less free than this where the database cannot open: the disk is called full
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26

# What a chat may hold, so that every chat can be exported and imported again (app.chat_io reads up to these).
MAX_TEXT_CHARS = 4 << 20  # one message's content or the system prompt: no model's context takes more
MAX_TITLE_CHARS = 1000


def check_message(text: str) -> bool:
    """True where `text` can be stored as a message; else StoreError says why (what add_message would raise)."""
    _check_length(text, "the message", MAX_TEXT_CHARS)
    return True


def _check_fields(role: str, status: str, content: str) -> None:
    if role not in ROLES:
        raise StoreError(f"unknown message role {role!r}")
    if status not in STATUSES:
        raise StoreError(f"unknown message status {status!r}")
    _check_length(content, "the message", MAX_TEXT_CHARS)


def _check_length(text: str, what: str, limit: int) -> None:
    if len(text) > limit:
        raise StoreError(f"{what} is {len(text):,} characters long; at most {limit:,} are allowed")


_CHAT_COLUMNS_V5 = "id, title, created, updated, system_prompt, sampling_json, active_leaf_id, overflow_policy"
_MESSAGE_COLUMNS_V5 = (
    "id, chat_id, parent_id, role, content, status, created, updated, options_json, metrics_json, "
    "candidate_group, candidate_index, model_name, owner"
)

# MIGRATIONS[v] takes a database from schema v-1 to v. Never edit a shipped step; append a new one.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE chats (
            id INTEGER PRIMARY KEY,
            title TEXT NOT NULL,
            created REAL NOT NULL,
            updated REAL NOT NULL,
            system_prompt TEXT NOT NULL DEFAULT '',
            sampling_json TEXT,
            active_leaf_id INTEGER
        )""",
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
            parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL DEFAULT '',
            status TEXT NOT NULL DEFAULT 'done' CHECK (status IN ('done', 'streaming', 'stopped', 'error')),
            created REAL NOT NULL,
            updated REAL NOT NULL,
            options_json TEXT,
            metrics_json TEXT,
            candidate_group INTEGER,
            candidate_index INTEGER,
            model_name TEXT
        )""",
        "CREATE INDEX messages_by_chat ON messages(chat_id, id)",
        "CREATE INDEX messages_by_parent ON messages(parent_id, id)",
        "CREATE INDEX chats_by_updated ON chats(updated DESC, id DESC)",
    ),
    # NULL: the default policy from the settings
    2: ("ALTER TABLE chats ADD COLUMN overflow_policy TEXT",),
    # The HUD's compare table, kept across restarts until cleared: one row per generation measured.
    3: (
        """CREATE TABLE compare_rows (
            id INTEGER PRIMARY KEY,
            created REAL NOT NULL,
            generation INTEGER NOT NULL,
            label TEXT NOT NULL,
            options_json TEXT NOT NULL,
            metrics_json TEXT NOT NULL
        )""",
    ),
    # Who is writing an answer still streaming ("host|pid|store"), so that opening the database in a second
    # process (a second window, `gapless chats`) does not mark a live answer as cut off by a crash.
    4: (
        "ALTER TABLE messages ADD COLUMN owner TEXT",
        # The model a compare row's generation ran on (NULL: kept before rows named it).
        "ALTER TABLE compare_rows ADD COLUMN model TEXT",
    ),
    # Ids never come back: a rowid table gave the newest chat's (or message's) id to the next one made after it
    # was deleted, so a second window still holding the old id wrote into, stopped or deleted the new one.
    # SQLite cannot add AUTOINCREMENT to a table: both are made again (with foreign keys off, see _migrate).
    5: (
        """CREATE TABLE chats_v5 (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            title TEXT NOT NULL,
            created REAL NOT NULL,
            updated REAL NOT NULL,
            system_prompt TEXT NOT NULL DEFAULT '',
            sampling_json TEXT,
            active_leaf_id INTEGER,
            overflow_policy TEXT
        )""",
        f"INSERT INTO chats_v5 ({_CHAT_COLUMNS_V5}) SELECT {_CHAT_COLUMNS_V5} FROM chats",
        """CREATE TABLE messages_v5 (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
            parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL DEFAULT '',
            status TEXT NOT NULL DEFAULT 'done' CHECK (status IN ('done', 'streaming', 'stopped', 'error')),
            created REAL NOT NULL,
            updated REAL NOT NULL,
            options_json TEXT,
            metrics_json TEXT,
            candidate_group INTEGER,
            candidate_index INTEGER,
            model_name TEXT,
            owner TEXT
        )""",
        f"INSERT INTO messages_v5 ({_MESSAGE_COLUMNS_V5}) SELECT {_MESSAGE_COLUMNS_V5} FROM messages",
        "DROP TABLE messages",
        "DROP TABLE chats",
        "ALTER TABLE chats_v5 RENAME TO chats",
        "ALTER TABLE messages_v5 RENAME TO messages",
        "CREATE INDEX messages_by_chat ON messages(chat_id, id)",
        "CREATE INDEX messages_by_parent ON messages(parent_id, id)",
        "CREATE INDEX chats_by_updated ON chats(updated DESC, id DESC)",
    ),
    # When each message was last on the branch shown: where branches part, the chat goes down the one the user
    # was on last (a candidate chosen, a version gone back to), not the newest (NULL: never shown since).
    6: ("ALTER TABLE messages ADD COLUMN shown REAL",),
}
SCHEMA_VERSION = max(MIGRATIONS)


# What an answer cut off by a crash is stored with: its finish reason, and why its figures are n/a.
KEPT_FIGURES = ("new_tokens_total", "ttft_ms", "prefill_tok_s", "decode_tok_s", "step_ms_p50", "step_ms_p99")


def figures_lost(why: str) -> dict:
    """The figures of an answer kept without them (cut off by a crash, failed partway): each n/a with `why`."""
    return {"unavailable": dict.fromkeys(KEPT_FIGURES, why)}


INTERRUPTED_METRICS = {
    "finish_reason": "interrupted",
    **figures_lost("the app closed before this answer ended, so its figures were not kept"),
}


class StoreError(GaplessError):
    """The chat database cannot be opened or written; the message says why, in one line."""


class NotFound(StoreError):
    """The chat or message asked for is not in the database (deleted, e.g. by another window or the CLI)."""


@dataclass(frozen=True)
class Chat:
    id: int
    title: str
    created: float  # unix time
    updated: float
    system_prompt: str
    sampling: Optional[dict]  # SamplingParams.to_dict(), None = the app's defaults
    active_leaf_id: Optional[int]
    overflow_policy: Optional[str] = None  # engine.types.OVERFLOW_POLICIES; None = the settings' default
    damaged: str = ""  # what of its stored settings could not be read (it uses the defaults instead)


@dataclass(frozen=True)
class Message:
    id: int
    chat_id: int
    parent_id: Optional[int]
    role: str
    content: str
    status: str  # done | streaming | stopped | error
    created: float
    updated: float
    options: Optional[dict]  # EngineOptions.to_dict() of the generation
    metrics: Optional[dict]  # GenerationMetrics.to_dict()
    candidate_group: Optional[int]
    candidate_index: Optional[int]
    model_name: Optional[str]


# The candidate group of the first of an answer's N candidates: a number not used yet, taken in the transaction
# that writes the message (taken before it, two windows starting candidates in one chat at once could both take
# the same, and the chat's export was refused on import: "candidate group 1 holds answers to different messages").
NEW_CANDIDATE_GROUP = -1

_MESSAGE_COLUMNS = (
    "id, chat_id, parent_id, role, content, status, created, updated, options_json, metrics_json, "
    "candidate_group, candidate_index, model_name"
)
# of messages branching at one point: the one shown last, else the newest
_SHOWN_FIRST = "ORDER BY shown IS NULL, shown DESC, id DESC LIMIT 1"
_SHOWN_CHILD = f"SELECT id FROM messages WHERE parent_id = ? {_SHOWN_FIRST}"
_SHOWN_FIRST_MESSAGE = f"SELECT id FROM messages WHERE chat_id = ? AND parent_id IS NULL {_SHOWN_FIRST}"
# a branch's messages, from its leaf up, marked shown at a time
_MARK_SHOWN = (
    "WITH RECURSIVE branch(id) AS (SELECT ? UNION ALL SELECT m.parent_id FROM messages m JOIN branch ON m.id = "
    "branch.id WHERE m.parent_id IS NOT NULL) UPDATE messages SET shown = ? WHERE id IN (SELECT id FROM branch)"
)
_CHAT_COLUMNS = "id, title, created, updated, system_prompt, sampling_json, active_leaf_id, overflow_policy"


def _loads(text: Optional[str]) -> Optional[dict]:
    return None if text is None else json.loads(text)


def _dumps(value: Any) -> Optional[str]:
    """`value` as stored: strict JSON, a figure that came out NaN or infinite null with why (figures.finite); the
    store refused the whole answer for one, which was left empty and "streaming"."""
    if value is None:
        return None
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    return figures.strict_json(value, ensure_ascii=False)


def _text(value: Any) -> str:
    """A stored text as text: one another program stored as bytes (a BLOB) is read as UTF-8, its bad bytes as
    U+FFFD, as the connection reads a TEXT value that is not UTF-8 (_connection); none as ""."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return _utf8_or_replaced(bytes(value))
    return "" if value is None else str(value)


def _time(value: Any) -> float:
    """A stored time (unix seconds); one that is not a number reads as 0 (the oldest)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _utf8_or_replaced(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _message(row: tuple) -> Message:
    return Message(
        row[0],
        row[1],
        row[2],
        row[3],
        _text(row[4]),
        row[5],
        _time(row[6]),
        _time(row[7]),
        _kept_figures(row[8], "options", row[0]),
        _kept_figures(row[9], "metrics", row[0]),
        row[10],
        row[11],
        None if row[12] is None else _text(row[12]),
    )


def _kept_figures(text: Optional[str], what: str, message_id: int) -> Optional[dict]:
    """A message's stored options or figures; a damaged object (not JSON, not an object) reads as none, so the
    message itself is still shown and exported."""
    try:
        value = _loads(text)
        if value is not None and not isinstance(value, dict):
            raise ValueError("they are not an object")
        problem = figures.metrics_problem(value) if value is not None and what == "metrics" else None
    except ValueError as exc:
        problem = str(exc)
    if problem:  # shown without them, and exported without them (an import would refuse them)
        log.error("chat database: message %d: its %s are damaged (%s); shown without them", message_id, what, problem)
        return None
    return value


def _inserted_id(cur: sqlite3.Cursor) -> int:
    """The id of the row the INSERT on `cur` just added (typed Optional by sqlite3: None before any INSERT)."""
    if cur.lastrowid is None:
        raise StoreError("the database did not report the id of the row it just added")
    return cur.lastrowid


def _chat(row: tuple) -> Chat:
    """A stored chat; damaged settings (not JSON, values out of range, a parameter this version does not know)
    read as the defaults and are said in `damaged`, so the chat still opens, answers and exports."""
    from engine.types import OVERFLOW_POLICIES, SamplingParams

    problems = []
    try:
        sampling = _loads(row[5])
        if sampling is not None:
            if not isinstance(sampling, dict):
                raise ValueError("not an object")
            SamplingParams.from_dict(sampling)
    except (ValueError, TypeError, RecursionError, OptionsError) as exc:
        problems.append(f"its sampling settings ({one_line(exc)})")
        sampling = None
    overflow = row[7]
    if overflow is not None and overflow not in OVERFLOW_POLICIES:
        problems.append(f"its overflow policy ({overflow!r} is none of {', '.join(OVERFLOW_POLICIES)})")
        overflow = None
    damaged = ""
    if problems:
        damaged = f"{' and '.join(problems)} could not be read; it uses the defaults until they are set again"
        log.error("chat database: chat %d: %s", row[0], damaged)
    return Chat(row[0], _text(row[1]), _time(row[2]), _time(row[3]), _text(row[4]), sampling, row[6], overflow, damaged)


def _is_corruption(exc: sqlite3.DatabaseError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and (code & 0xFF) in (_SQLITE_CORRUPT, _SQLITE_NOTADB)


def _check_overflow(policy: Optional[str]) -> None:
    """A chat's overflow policy as given to the store: None (unchanged), "" (the default) or a known one."""
    from engine.types import OVERFLOW_POLICIES

    if policy not in (None, "", *OVERFLOW_POLICIES):
        raise StoreError(f"unknown overflow policy {policy!r}")


def aside_name(path: Path, tag: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = path.with_name(f"{path.name}.{tag}-{stamp}")
    n = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.{tag}-{stamp}-{n}")
        n += 1
    return candidate


def move_aside(path: Path, tag: str = "corrupt") -> Path:
    """Rename `path` (and its SQLite -wal/-shm companions) to `<name>.<tag>-<timestamp>`; return the new path."""
    target = aside_name(path, tag)
    os.replace(path, target)
    for suffix in ("-wal", "-shm"):
        companion = path.with_name(path.name + suffix)
        if companion.exists():
            os.replace(companion, target.with_name(target.name + suffix))
    return target


# ---- who writes an answer still streaming --------------------------------------------------------------

_HOST = socket.gethostname()
_OPEN_STORES: weakref.WeakValueDictionary[str, ChatStore] = weakref.WeakValueDictionary()  # this process's


def _pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine. An id reused by another process reads as alive:
    its answer is then recovered by an open after that process ends."""
    if pid <= 0:
        return False
    if sys.platform == "win32":
        import ctypes
        from ctypes import wintypes

        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
        kernel32.OpenProcess.restype = wintypes.HANDLE
        handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
        if not handle:
            return ctypes.get_last_error() == 5  # ERROR_ACCESS_DENIED: another user's process, alive
        try:
            code = ctypes.c_ulong()
            return bool(kernel32.GetExitCodeProcess(handle, ctypes.byref(code))) and code.value == 259  # STILL_ACTIVE
        finally:
            kernel32.CloseHandle(handle)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _owner_alive(owner: Optional[str]) -> bool:
    """Whether the store that began a streaming answer ("host|pid|store") may still be writing it."""
    if not owner:
        return False  # no owner kept (an older version wrote it): only a crash leaves it streaming
    host, _, rest = owner.partition("|")
    pid_text, _, _ = rest.partition("|")
    if host != _HOST:
        return True  # another machine's process cannot be checked from here
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    if pid == os.getpid():
        store = _OPEN_STORES.get(owner)
        return store is not None and store._db is not None
    return _pid_alive(pid)


def _first_line(text: str, limit: int = 200) -> str:
    """SQLite's first finding of a (possibly many-line) report, for a one-line notice."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("***")]
    line = lines[0] if lines else text.strip()
    return line if len(line) <= limit else line[: limit - 1] + "…"


# a message and all below it (every branch)
_SUBTREE = (
    "WITH RECURSIVE sub(id) AS (SELECT ? UNION ALL SELECT m.id FROM messages m JOIN sub ON m.parent_id = sub.id) "
    "SELECT id FROM sub"
)


def _folded(text: str) -> str:
    """`text` as the search compares it: case folded in every script ("ÉTÉ" finds "été", "STRASSE" "straße", "ΣΟΦΊΑ"
    "σοφία", "ПРИВЕТ" "привет"), in one normal form (NFC: "é" typed finds an "e" stored with a combining accent, and
    the reverse). SQLite's LIKE folds ASCII letters alone."""
    if text.isascii():
        return text.lower()  # the same, in a tenth of the time
    return unicodedata.normalize("NFC", unicodedata.normalize("NFD", text).casefold())  # Unicode's caseless match


# The characters whose folding holds an ASCII letter or sign ("ß" is "ss", "ﬁ" is "fi", the Kelvin sign is "k", the
# Greek question mark ";"): a search of ASCII text has a match in a message of other scripts that LIKE does not see
# only through one of these.
_FOLDS_TO_ASCII = re.compile("[\u00df\u0130\u0149\u017f\u037e\u1e9a\u1e9e\u1fef\u212a\ufb00-\ufb06]")


def _holds(raw: Optional[bytes], needle: str, liked: int) -> bool:
    """Whether the text stored as `raw` (its UTF-8 bytes), of other characters than ASCII, holds `needle` (folded)
    once folded (SQL's gapless_holds); `liked`: whether LIKE found it in the text as stored. Bytes that are not UTF-8
    (written by another program) are read as U+FFFD: as text, they failed every search that reached them."""
    if raw is None:
        return False
    text = raw.decode("utf-8", "replace")
    if not liked and needle.isascii() and _FOLDS_TO_ASCII.search(text) is None and "\0" not in text:
        return False  # what LIKE said (it stops at a NUL): the text's ASCII letters are the only ones folding to it
    # What LIKE found may be gone once normalised: an "e" stored before a combining accent is "é" (as typed).
    return needle in _folded(text)


def _holds_clause(column: str) -> str:
    """SQL for: `column` holds the search (?1 folded, ?2 as a LIKE pattern). LIKE answers for ASCII text, in C; only
    other text goes to Python, and there is folded only where LIKE can be wrong."""
    return (
        f"(CASE WHEN length({column}) = length(CAST({column} AS BLOB)) THEN {column} LIKE ?2 ESCAPE '\\' "
        f"ELSE gapless_holds(CAST({column} AS BLOB), ?1, {column} LIKE ?2 ESCAPE '\\') END)"
    )


def _chats_query(columns: str, search: str) -> tuple[str, tuple]:
    """SQL and parameters for `columns` of the chats `search` finds (all for ""), newest first."""
    if not search:
        return f"SELECT {columns} FROM chats ORDER BY updated DESC, id DESC", ()
    needle = _folded(search)
    like = "%" + needle.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    return (
        f"SELECT {columns} FROM chats WHERE {_holds_clause('title')} OR EXISTS "
        f"(SELECT 1 FROM messages m WHERE m.chat_id = chats.id AND {_holds_clause('m.content')}) "
        "ORDER BY updated DESC, id DESC",
        (needle, like),
    )


class ChatStore:
    """All access to the chat database. Thread-safe (one connection behind a lock); several processes may
    open the same file (WAL, busy timeout). Failures raise StoreError with the reason; nothing saved is lost."""

    def __init__(self, path: Path, busy_timeout_ms: int = BUSY_TIMEOUT_MS):
        self.path = Path(path)
        self.notices: list[str] = []  # for the user: the database was repaired, moved aside, ...
        self._lock = threading.RLock()
        self._busy_timeout_ms = busy_timeout_ms
        self._last_shown = 0.0  # the last time messages were marked shown (_shown_now)
        self.owner = f"{_HOST}|{os.getpid()}|{uuid.uuid4().hex[:12]}"  # kept on the answers it streams
        self._db: Optional[sqlite3.Connection] = self._open()
        self._search_db: Optional[sqlite3.Connection] = None  # search_titles' own, made when first searched
        self._search_lock = threading.Lock()
        _OPEN_STORES[self.owner] = self
        self._recover_streaming()

    # ---- opening -------------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the data folder {self.path.parent}: {exc.strerror or exc}") from exc
        damaged_index = False
        try:
            return self._connect_checked()
        except sqlite3.DatabaseError as exc:
            if not _is_corruption(exc):
                raise self._open_error(exc) from exc
            reason = _first_line(str(exc))
        except _Damaged as exc:
            reason, damaged_index = str(exc), True
        try:
            aside = move_aside(self.path)
        except OSError as exc:
            raise StoreError(
                f"the chat database {self.path} is damaged ({reason}) and cannot be moved aside: {exc.strerror or exc}"
            ) from exc
        log.error("chat database %s is damaged (%s); moved to %s", self.path, reason, aside)
        if damaged_index:
            repaired = self._repaired_copy(aside)
            if repaired is not None:
                self.notices.append(
                    f"The chat database was damaged ({reason}); its indexes were rebuilt and every chat kept. "
                    f"The damaged file was kept as {aside.name}."
                )
                return repaired
        self.notices.append(
            f"The chat database was damaged ({reason}). It was kept as {aside.name} and a new, empty one was created."
        )
        try:
            return self._connect_checked()
        except sqlite3.DatabaseError as exc:
            raise self._open_error(exc) from exc

    def _repaired_copy(self, damaged: Path) -> Optional[sqlite3.Connection]:
        """A copy of the damaged file at self.path with its indexes rebuilt, when that passes the integrity check
        (damage confined to the indexes, whose rows are rebuilt from the tables); else None and no copy left."""
        try:
            for suffix in ("", "-wal"):
                source = damaged.with_name(damaged.name + suffix)
                if source.exists():
                    shutil.copyfile(source, self.path.with_name(self.path.name + suffix))
            db = sqlite3.connect(self.path, isolation_level=None)
            try:
                db.execute("REINDEX")
            finally:
                db.close()
            connection = self._connect_checked()
        except (OSError, sqlite3.Error, _Damaged) as exc:
            log.error("chat database %s: rebuilding its indexes did not repair it: %s", damaged, exc)
            for suffix in ("", "-wal", "-shm"):
                self.path.with_name(self.path.name + suffix).unlink(missing_ok=True)
            return None
        log.warning("chat database %s: indexes rebuilt from %s", self.path, damaged)
        return connection

    def _connection(self) -> sqlite3.Connection:
        """A new connection to the database, with the search's folding function (gapless_holds)."""
        db = sqlite3.connect(
            self.path, timeout=self._busy_timeout_ms / 1000, isolation_level=None, check_same_thread=False
        )
        db.create_function("gapless_holds", 3, _holds, deterministic=True)
        # a text that is not UTF-8 (written by another program) failed the whole query it was read in: one such
        # title left the chat list empty; read with its bad bytes as U+FFFD, as the search reads it (_holds)
        db.text_factory = _utf8_or_replaced
        return db

    def _connect_checked(self) -> sqlite3.Connection:
        db = self._connection()
        try:
            db.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
            # Read the version before anything writes: a newer database is left exactly as it is.
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"the chat database {self.path} was written by a newer version of Gapless (schema {version}, "
                    f"this version reads up to {SCHEMA_VERSION}); it was left untouched"
                )
            check = db.execute("PRAGMA quick_check").fetchall()
            if check != [("ok",)]:
                raise _Damaged("integrity check failed: " + _first_line(str(check[0][0])))
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                log.warning("chat database %s: journal mode %s instead of WAL", self.path, mode)
            db.execute("PRAGMA synchronous = NORMAL")
            db.execute("PRAGMA foreign_keys = ON")
            self._migrate(db, version)
        except BaseException:
            db.close()
            raise
        return db

    def _migrate(self, db: sqlite3.Connection, version: int) -> None:
        if version == SCHEMA_VERSION:
            return
        # A step may make a table again: with foreign keys on, dropping the old chats would delete every message.
        # The pragma is a no-op inside a transaction, so it is set around it, and the keys are checked before
        # the step commits.
        db.execute("PRAGMA foreign_keys = OFF")
        db.execute("BEGIN IMMEDIATE")
        try:
            # Another process may have migrated between our read and the lock.
            version = db.execute("PRAGMA user_version").fetchone()[0]
            for step in range(version + 1, SCHEMA_VERSION + 1):
                for statement in MIGRATIONS[step]:
                    db.execute(statement)
                log.info("chat database %s migrated to schema %d", self.path, step)
            broken = db.execute("PRAGMA foreign_key_check").fetchall()
            if broken:  # kept as they were (a row whose parent is gone), but said
                log.warning("chat database %s: %d rows refer to rows that are gone", self.path, len(broken))
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        finally:
            db.execute("PRAGMA foreign_keys = ON")

    def _open_error(self, exc: sqlite3.Error) -> StoreError:
        folder = self.path.parent
        hint = f"; the folder {folder} is not writable" if not os.access(folder, os.W_OK) else ""
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            free = None
        if free is not None and free < FULL_DISK_BYTES:  # SQLite says only "disk I/O error" when it cannot grow
            hint += f"; the disk holding {folder} is full ({free:,} bytes free)"
        return StoreError(f"cannot open the chat database {self.path}: {exc}{hint}")

    def _recover_streaming(self) -> None:
        """Answers left 'streaming' by a crash become 'stopped', their partial text kept, with the finish reason
        "interrupted" (not the user's stop) and why their figures are n/a. An answer another running process is
        still writing is left to it, and nothing is written when there is nothing to recover (a read-only or
        busy database still opens for reading)."""
        rows = self._read("SELECT id, owner FROM messages WHERE status = 'streaming'")
        interrupted = json.dumps(INTERRUPTED_METRICS)
        cut = [(interrupted, message_id) for message_id, owner in rows if not _owner_alive(owner)]
        if not cut:
            return
        try:
            with self._write("recover interrupted answers") as db:
                n = db.executemany(  # rowcount: the rows changed, summed over the ids
                    "UPDATE messages SET status = 'stopped', owner = NULL, metrics_json = COALESCE(metrics_json, ?) "
                    "WHERE status = 'streaming' AND id = ?",
                    cut,
                ).rowcount
        except StoreError as exc:  # read-only, or busy past the timeout: the chats still open for reading
            log.error("%s", exc)
            self.notices.append(
                f"{len(cut)} answer(s) cut off when Gapless last closed could not be marked so ({exc}); "
                "they are shown as they were saved."
            )
            return
        if n:
            log.info("chat database %s: %d interrupted answer(s) marked stopped", self.path, n)

    # ---- transactions --------------------------------------------------------------------------------

    @contextmanager
    def _write(self, what: str) -> Iterator[sqlite3.Connection]:
        """One write transaction. BEGIN IMMEDIATE takes the write lock up front, so a busy second process is
        waited for (busy timeout) instead of failing half-way."""
        with self._lock:
            db = self._conn()
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreError(f"cannot {what} in the chat database: {exc}") from exc
            try:
                yield db
                db.execute("COMMIT")
            except BaseException as exc:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise StoreError(f"cannot {what} in the chat database: {exc}") from exc
                if isinstance(exc, UnicodeEncodeError):  # text that is not whole characters: SQLite takes UTF-8
                    raise StoreError(f"cannot {what} in the chat database: {one_line(str(exc))}") from exc
                raise

    def _read(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            try:
                return self._conn().execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"cannot read the chat database: {exc}") from exc

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError("the chat database is closed")
        return self._db

    def close(self) -> None:
        self.interrupt_search()
        with self._lock, self._search_lock:
            if self._search_db is not None:
                self._search_db.close()
                self._search_db = None
            if self._db is not None:
                self._db.close()
                self._db = None

    def __enter__(self) -> "ChatStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- chats ---------------------------------------------------------------------------------------

    def create_chat(
        self, title: str = "New chat", system_prompt: str = "", sampling: Any = None, overflow_policy: str = ""
    ) -> Chat:
        """A new chat with its settings, in one transaction; overflow_policy "" follows the settings' default."""
        _check_length(title, "the title", MAX_TITLE_CHARS)
        _check_length(system_prompt, "the system prompt", MAX_TEXT_CHARS)
        _check_overflow(overflow_policy)
        with self._write("create a chat") as db:
            chat_id = self._insert_chat(db, title, system_prompt, sampling, overflow_policy)
        return self.get_chat(chat_id)

    def start_chat(self, title: str, system_prompt: str, sampling: Any, first_message: str) -> Message:
        """A new chat with its first user message, in one transaction: a message the store cannot take (a full
        disk) leaves no empty chat behind."""
        _check_length(title, "the title", MAX_TITLE_CHARS)
        _check_length(system_prompt, "the system prompt", MAX_TEXT_CHARS)
        _check_fields("user", "done", first_message)
        with self._write("save the message") as db:
            chat_id = self._insert_chat(db, title, system_prompt, sampling)
            message_id = self._insert_message(db, chat_id, "user", first_message, None, "done")
        return self.get_message(message_id)

    @staticmethod
    def _insert_chat(
        db: sqlite3.Connection, title: str, system_prompt: str, sampling: Any, overflow_policy: str = ""
    ) -> int:
        now = time.time()
        cur = db.execute(
            "INSERT INTO chats (title, created, updated, system_prompt, sampling_json, overflow_policy) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (title, now, now, system_prompt, _dumps(sampling), overflow_policy or None),
        )
        return _inserted_id(cur)

    def get_chat(self, chat_id: int) -> Chat:
        rows = self._read(f"SELECT {_CHAT_COLUMNS} FROM chats WHERE id = ?", (chat_id,))
        if not rows:
            raise NotFound(f"no chat with id {chat_id}")
        return _chat(rows[0])

    def list_chats(self, search: str = "") -> list[Chat]:
        """Newest first. `search` matches titles and message text, case-insensitively in every script (folded)."""
        return [_chat(r) for r in self._chats(_CHAT_COLUMNS, search)]

    def chat_titles(self, search: str = "") -> list[tuple[int, str, float]]:
        """(id, title, updated) of the chats list_chats(search) gives, in its order: what the chat list shows,
        without reading each chat's settings (5,000 chats took 90 ms, now 10)."""
        return [(r[0], r[1], r[2]) for r in self._chats("id, title, updated", search)]

    def search_titles(self, search: str) -> list[tuple[int, str, float]]:
        """chat_titles(search) on a connection of its own, for a search run off the GUI thread: the store's other
        calls do not wait for it (a search of 5,000 messages of other scripts takes ~0.2 s), and
        interrupt_search() stops it."""
        with self._search_lock:
            if self._db is None:
                raise StoreError("the chat database is closed")
            try:
                if self._search_db is None:
                    self._search_db = self._connection()
                rows = self._search_db.execute(*_chats_query("id, title, updated", search)).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"cannot read the chat database: {exc}") from exc
        return [(r[0], r[1], r[2]) for r in rows]

    def interrupt_search(self) -> None:
        """Stop the search_titles() running now, if any (it raises StoreError)."""
        db = self._search_db  # read without the lock, which the search running now holds
        if db is None:
            return
        try:
            db.interrupt()
        except sqlite3.ProgrammingError:
            pass  # closed by close() since it was read: no search is running on it

    def data_version(self) -> int:
        """A number that changes when another connection commits to the database (another window, `gapless
        chats`); this store's own writes leave it as it is (SQLite's PRAGMA data_version)."""
        return int(self._read("PRAGMA data_version")[0][0])

    def _chats(self, columns: str, search: str) -> list[tuple]:
        return self._read(*_chats_query(columns, search))

    def rename_chat(self, chat_id: int, title: str) -> bool:
        """Whether the title changed; the chat's updated time moves only then (as update_chat's)."""
        _check_length(title, "the title", MAX_TITLE_CHARS)
        with self._write("rename the chat") as db:
            self._require_chat(db, chat_id)
            return (
                db.execute(
                    "UPDATE chats SET title = ?, updated = ? WHERE id = ? AND title IS NOT ?",
                    (title, time.time(), chat_id, title),
                ).rowcount
                > 0
            )

    def update_chat(
        self,
        chat_id: int,
        system_prompt: Optional[str] = None,
        sampling: Any = None,
        overflow_policy: Optional[str] = None,
    ) -> bool:
        """Change what is given (None: unchanged); overflow_policy "" means the settings' default again. Whether a
        value changed; the chat's updated time moves only then."""
        _check_overflow(overflow_policy)
        if system_prompt is not None:
            _check_length(system_prompt, "the system prompt", MAX_TEXT_CHARS)
        with self._write("update the chat") as db:
            self._require_chat(db, chat_id)
            given: list[tuple[str, Optional[str]]] = []
            if overflow_policy is not None:
                given.append(("overflow_policy", overflow_policy or None))
            if system_prompt is not None:
                given.append(("system_prompt", system_prompt))
            if sampling is not None:
                given.append(("sampling_json", _dumps(sampling)))
            changed = 0  # a chat is "updated" (and comes first in the list) only when something in it changed
            for column, value in given:
                changed += db.execute(
                    f"UPDATE chats SET {column} = ? WHERE id = ? AND {column} IS NOT ?", (value, chat_id, value)
                ).rowcount
            if changed:
                db.execute("UPDATE chats SET updated = ? WHERE id = ?", (time.time(), chat_id))
        return changed > 0

    def delete_chat(self, chat_id: int) -> None:
        with self._write("delete the chat") as db:
            self._require_chat(db, chat_id)
            db.execute("UPDATE messages SET parent_id = NULL WHERE chat_id = ?", (chat_id,))  # see _delete
            db.execute("DELETE FROM messages WHERE chat_id = ?", (chat_id,))
            db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    @staticmethod
    def _require_chat(db: sqlite3.Connection, chat_id: int) -> None:
        if db.execute("SELECT 1 FROM chats WHERE id = ?", (chat_id,)).fetchone() is None:
            raise NotFound(f"no chat with id {chat_id}")

    # ---- messages ------------------------------------------------------------------------------------

    def add_message(
        self,
        chat_id: int,
        role: str,
        content: str,
        parent_id: Optional[int],
        status: str = "done",
        options: Any = None,
        metrics: Any = None,
        candidate_group: Optional[int] = None,
        candidate_index: Optional[int] = None,
        model_name: Optional[str] = None,
        title: Optional[str] = None,
    ) -> Message:
        """Add a message under `parent_id` (None: a first message). It becomes the chat's active leaf, except
        candidates after the first (index > 0), which stay alternatives until chosen with set_active_leaf.
        `title`: the chat's new title, set in the same transaction (a chat named by its first message keeps its
        name when that message cannot be saved)."""
        content = whole_text(content)
        _check_fields(role, status, content)
        if title is not None:
            _check_length(title, "the title", MAX_TITLE_CHARS)
        with self._write("save the message") as db:
            message_id = self._insert_message(
                db,
                chat_id,
                role,
                content,
                parent_id,
                status,
                options,
                metrics,
                candidate_group,
                candidate_index,
                model_name,
            )
            if title is not None:
                db.execute("UPDATE chats SET title = ? WHERE id = ?", (title, chat_id))
        return self.get_message(message_id)

    def _insert_message(
        self,
        db: sqlite3.Connection,
        chat_id: int,
        role: str,
        content: str,
        parent_id: Optional[int],
        status: str,
        options: Any = None,
        metrics: Any = None,
        candidate_group: Optional[int] = None,
        candidate_index: Optional[int] = None,
        model_name: Optional[str] = None,
    ) -> int:
        """Insert a message checked by _check_fields, inside the caller's transaction; its id. A
        `candidate_group` of NEW_CANDIDATE_GROUP is a group number no message has yet."""
        now = time.time()
        if candidate_group == NEW_CANDIDATE_GROUP:  # numbered in the transaction that writes it
            candidate_group = db.execute("SELECT COALESCE(MAX(candidate_group), 0) + 1 FROM messages").fetchone()[0]
        self._require_chat(db, chat_id)
        if parent_id is not None:
            row = db.execute("SELECT chat_id FROM messages WHERE id = ?", (parent_id,)).fetchone()
            if row is None or row[0] != chat_id:
                raise StoreError(f"message {parent_id} is not in chat {chat_id}")
        cur = db.execute(
            f"INSERT INTO messages ({_MESSAGE_COLUMNS}, owner) VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                chat_id,
                parent_id,
                role,
                content,
                status,
                now,
                now,
                _dumps(options),
                _dumps(metrics),
                candidate_group,
                candidate_index,
                model_name,
                self.owner if status == "streaming" else None,
            ),
        )
        message_id = _inserted_id(cur)
        if not candidate_index:  # under the branch shown (its path is marked shown already): it alone is new
            db.execute("UPDATE messages SET shown = ? WHERE id = ?", (self._shown_now(), message_id))
            db.execute("UPDATE chats SET active_leaf_id = ?, updated = ? WHERE id = ?", (message_id, now, chat_id))
        else:
            db.execute("UPDATE chats SET updated = ? WHERE id = ?", (now, chat_id))
        return message_id

    def get_message(self, message_id: int) -> Message:
        rows = self._read(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE id = ?", (message_id,))
        if not rows:
            raise NotFound(f"no message with id {message_id}")
        return _message(rows[0])

    def update_message(
        self,
        message_id: int,
        content: Optional[str] = None,
        status: Optional[str] = None,
        options: Any = None,
        metrics: Any = None,
    ) -> None:
        if status is not None and status not in STATUSES:
            raise StoreError(f"unknown message status {status!r}")
        sets: list[str] = ["updated = ?"]
        params: list[Any] = [time.time()]
        for column, value in (
            ("content", None if content is None else whole_text(content)),
            ("status", status),
            ("options_json", _dumps(options)),
            ("metrics_json", _dumps(metrics)),
        ):
            if value is not None:
                sets.append(f"{column} = ?")
                params.append(value)
        if status is not None:
            sets.append("owner = ?")
            params.append(self.owner if status == "streaming" else None)
        with self._write("save the message") as db:
            row = db.execute("SELECT chat_id FROM messages WHERE id = ?", (message_id,)).fetchone()
            if row is None:
                raise NotFound(f"no message with id {message_id}")
            db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*params, message_id))
            db.execute("UPDATE chats SET updated = ? WHERE id = ?", (params[0], row[0]))

    def subtree_size(self, message_id: int) -> int:
        """The message and every message below it, on every branch: what delete_message removes."""
        return len(self._read(_SUBTREE, (message_id,)))

    def delete_message(self, message_id: int) -> None:
        """Delete a message and everything below it. If the active branch went with it, the chat switches to
        the newest remaining branch under the deleted message's parent (or the newest first message)."""
        with self._write("delete the message") as db:
            row = db.execute("SELECT chat_id, parent_id FROM messages WHERE id = ?", (message_id,)).fetchone()
            if row is None:
                raise NotFound(f"no message with id {message_id}")
            chat_id, parent_id = row
            doomed = [r[0] for r in db.execute(_SUBTREE, (message_id,))]
            active = db.execute("SELECT active_leaf_id FROM chats WHERE id = ?", (chat_id,)).fetchone()[0]
            self._delete(db, doomed)
            if active is None or active in doomed:
                self._show(db, chat_id, self._newest_leaf(db, chat_id, parent_id))
            db.execute("UPDATE chats SET updated = ? WHERE id = ?", (time.time(), chat_id))

    @staticmethod
    def _delete(db: sqlite3.Connection, ids: list[int]) -> None:
        """Delete messages that go with their parents. Detached first: each level of a chain cascading into the
        next stops at SQLite's 1,000 levels of trigger recursion, and a chat of thousands of messages in one
        branch could not be deleted."""
        db.executemany("UPDATE messages SET parent_id = NULL WHERE id = ?", ((i,) for i in ids))
        db.executemany("DELETE FROM messages WHERE id = ?", ((i,) for i in ids))

    def thread(self, chat_id: int, leaf_id: Optional[int] = None) -> list[Message]:
        """The messages from the root to `leaf_id` (default: the chat's active leaf), oldest first."""
        if leaf_id is None:
            leaf_id = self.get_chat(chat_id).active_leaf_id
            if leaf_id is None:
                return []
        rows = self._read(
            f"WITH RECURSIVE path(id, parent_id, depth) AS ("
            f" SELECT id, parent_id, 0 FROM messages WHERE id = ? AND chat_id = ?"
            f" UNION ALL SELECT m.id, m.parent_id, path.depth + 1 FROM messages m JOIN path ON m.id = path.parent_id)"
            f" SELECT {', '.join('m.' + c.strip() for c in _MESSAGE_COLUMNS.split(','))}"
            f" FROM path JOIN messages m ON m.id = path.id ORDER BY path.depth DESC",
            (leaf_id, chat_id),
        )
        if not rows:
            raise StoreError(f"message {leaf_id} is not in chat {chat_id}")
        return [_message(r) for r in rows]

    def children(self, message_id: int) -> list[Message]:
        rows = self._read(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE parent_id = ? ORDER BY id", (message_id,))
        return [_message(r) for r in rows]

    def siblings(self, message_id: int) -> list[Message]:
        """All messages sharing this one's parent (itself included), oldest first: the branches at this point."""
        m = self.get_message(message_id)
        if m.parent_id is None:
            rows = self._read(
                f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE chat_id = ? AND parent_id IS NULL ORDER BY id",
                (m.chat_id,),
            )
        else:
            rows = self._read(
                f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE parent_id = ? ORDER BY id", (m.parent_id,)
            )
        return [_message(r) for r in rows]

    def branch_positions(self, chat_id: int) -> dict[int, tuple[int, int]]:
        """Each message of the chat: (its index among its siblings, how many there are), as siblings() counts them,
        in one query (a query per message took ~0.2 s to show a chat of 3,000 messages)."""
        by_parent: dict[Optional[int], list[int]] = {}
        for message_id, parent_id in self._read(
            "SELECT id, parent_id FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,)
        ):
            by_parent.setdefault(parent_id, []).append(message_id)
        return {m: (i, len(ids)) for ids in by_parent.values() for i, m in enumerate(ids)}

    def set_active_leaf(self, chat_id: int, leaf_id: int) -> int:
        """Show the branch through `leaf_id`: from it down to a leaf, at each branch point the child shown last
        (the newest where none was shown). Returns that leaf."""
        with self._write("switch the branch") as db:
            row = db.execute("SELECT chat_id FROM messages WHERE id = ?", (leaf_id,)).fetchone()
            if row is None or row[0] != chat_id:
                raise StoreError(f"message {leaf_id} is not in chat {chat_id}")
            leaf = self._descend(db, leaf_id)
            self._show(db, chat_id, leaf)
        return leaf

    def _show(self, db: sqlite3.Connection, chat_id: int, leaf: Optional[int]) -> None:
        """Make the branch ending at `leaf` the one shown, and mark its messages shown now."""
        db.execute("UPDATE chats SET active_leaf_id = ? WHERE id = ?", (leaf, chat_id))
        if leaf is not None:
            db.execute(_MARK_SHOWN, (leaf, self._shown_now()))

    def _shown_now(self) -> float:
        """The time to mark messages shown with: later than every mark before it from this store, however close
        (a clock that ticks every 15 ms would tie two quick switches, and the older would win)."""
        self._last_shown = max(time.time(), self._last_shown + 1e-6)
        return self._last_shown

    @staticmethod
    def _descend(db: sqlite3.Connection, message_id: int) -> int:
        while True:
            row = db.execute(_SHOWN_CHILD, (message_id,)).fetchone()
            if row is None:
                return message_id
            message_id = row[0]

    def _newest_leaf(self, db: sqlite3.Connection, chat_id: int, parent_id: Optional[int]) -> Optional[int]:
        if parent_id is not None:
            return self._descend(db, parent_id)
        row = db.execute(_SHOWN_FIRST_MESSAGE, (chat_id,)).fetchone()
        return None if row is None else self._descend(db, row[0])

    def all_messages(self, chat_id: int) -> list[Message]:
        """Every message of the chat, every branch, oldest first (a parent always before its children)."""
        self.get_chat(chat_id)
        return [
            _message(r)
            for r in self._read(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,))
        ]

    def import_chat(self, chat: Any) -> int:
        """Store a validated chat file (app.chat_io.ImportedChat) as a new chat, in one transaction; its id.
        Message parents are indexes of earlier messages; candidate groups get numbers no message uses yet."""
        with self._write("import the chat") as db:
            cur = db.execute(
                "INSERT INTO chats (title, created, updated, system_prompt, sampling_json, overflow_policy) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (
                    chat.title,
                    chat.created,
                    chat.updated,
                    chat.system_prompt,
                    _dumps(chat.sampling),
                    chat.overflow_policy,
                ),
            )
            chat_id = _inserted_id(cur)
            next_group = db.execute("SELECT COALESCE(MAX(candidate_group), 0) + 1 FROM messages").fetchone()[0]
            groups: dict[int, int] = {}
            ids: list[int] = []
            for m in chat.messages:
                group = None
                if m["candidate_group"] is not None:
                    group = groups.setdefault(m["candidate_group"], next_group + len(groups))
                parent = ids[m["parent"]] if m["parent"] is not None else None
                cur = db.execute(
                    f"INSERT INTO messages ({_MESSAGE_COLUMNS}) VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        chat_id,
                        parent,
                        m["role"],
                        m["content"],
                        m["status"],
                        m["created"],
                        m["updated"],
                        _dumps(m["options"]),
                        _dumps(m["metrics"]),
                        group,
                        m["candidate_index"],
                        m["model_name"],
                    ),
                )
                ids.append(_inserted_id(cur))
            if chat.active_leaf is not None:
                self._show(db, chat_id, ids[chat.active_leaf])
        return chat_id

    def newest_chat_id(self) -> int:
        """The highest chat id in the database (0 where there is none)."""
        return int(self._read("SELECT COALESCE(MAX(id), 0) FROM chats")[0][0])

    def chats_after(self, chat_id: int) -> list[Chat]:
        """The chats whose ids are above `chat_id` (those made since it was the newest), oldest first."""
        return [_chat(r) for r in self._read(f"SELECT {_CHAT_COLUMNS} FROM chats WHERE id > ? ORDER BY id", (chat_id,))]

    def count_messages(self, chat_id: Optional[int] = None) -> int:
        if chat_id is None:
            return self._read("SELECT COUNT(*) FROM messages")[0][0]
        return self._read("SELECT COUNT(*) FROM messages WHERE chat_id = ?", (chat_id,))[0][0]


@dataclass(frozen=True)
class CompareRecord:
    """A row of the HUD's compare table as stored: a generation's number, label, options and figures."""

    id: int
    created: float  # unix time
    index: int  # the generation's number in the HUD
    label: str
    options: EngineOptions
    metrics: GenerationMetrics
    model: str = ""  # the model's name ("" where it was not kept)


class CompareHistory:
    """The compare table's rows in the chat database: kept across restarts, cleared on request. A stored row
    that is not a valid row (hand-edited, written by a broken version) is refused with its reason in the log,
    and the others load."""

    def __init__(self, store: ChatStore):
        self.store = store

    def add(self, index: int, label: str, options: EngineOptions, metrics: GenerationMetrics, model: str = "") -> int:
        with self.store._write("keep the compare row") as db:
            cur = db.execute(
                "INSERT INTO compare_rows (created, generation, label, options_json, metrics_json, model) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (time.time(), index, label, _dumps(options), _dumps(metrics), model or None),
            )
            return int(cur.lastrowid or 0)

    def last_index(self) -> int:
        """The highest generation number kept (0 where none): another window on this data folder numbers its
        generations too, and each takes the next after the other's."""
        rows = self.store._read("SELECT MAX(generation) FROM compare_rows WHERE typeof(generation) = 'integer'")
        return max(0, int(rows[0][0] or 0))

    def rows(self) -> list[CompareRecord]:
        out = []
        sql = "SELECT id, created, generation, label, options_json, metrics_json, model FROM compare_rows ORDER BY id"
        for row in self.store._read(sql):
            try:
                out.append(_compare_record(row))
            except (ValueError, TypeError, OptionsError) as exc:
                log.error("chat database %s: compare row %s refused: %s", self.store.path, row[0], exc)
        return out

    def clear(self) -> int:
        with self.store._write("clear the compare history") as db:
            return db.execute("DELETE FROM compare_rows").rowcount


def _compare_record(row: tuple) -> CompareRecord:
    """A stored compare row, checked: ValueError (or OptionsError) with the reason when it is not one."""
    rid, created, index, label, options_json, metrics_json, model = row
    if isinstance(index, bool) or not isinstance(index, int) or index < 1:
        raise ValueError(f"its generation number is {index!r}, not a positive integer")
    if not isinstance(label, str):
        raise ValueError(f"its label is {label!r}, not text")
    if not isinstance(model, (str, type(None))):
        raise ValueError(f"its model is {model!r}, not text")
    options, metrics = json.loads(options_json), json.loads(metrics_json)
    if not isinstance(options, dict) or not isinstance(metrics, dict):
        raise ValueError("its options or metrics are not JSON objects")
    problem = figures.metrics_problem(metrics)
    if problem:
        raise ValueError(problem)
    return CompareRecord(
        rid, created, index, label, EngineOptions.from_dict(options), GenerationMetrics.from_dict(metrics), model or ""
    )


class _Damaged(Exception):
    """Raised inside ChatStore._open when the integrity check fails; never leaves the module."""


class StreamSaver:
    """Saves an answer while it streams: the whole text so far is written at most every `min_interval_s`
    and at finish, so a killed process loses at most about a second of it.

    A failed intermediate write does not interrupt the stream: the text stays in memory, the error is kept in
    `last_error` and logged once, and the next write retries. `finish` raises StoreError if the final write fails.
    """

    def __init__(self, store: ChatStore, message_id: int, min_interval_s: float = 0.5, clock=time.monotonic):
        self.store = store
        self.message_id = message_id
        self.min_interval_s = min_interval_s
        self._clock = clock
        self.text = store.get_message(message_id).content
        self._saved_len = len(self.text)
        self._last_write = clock()
        self.last_error: Optional[StoreError] = None
        self.finished = False

    def append(self, text: str) -> None:
        if self.finished:
            raise StoreError(f"message {self.message_id} was already finished")
        self.text += text
        if self._clock() - self._last_write >= self.min_interval_s:
            self.flush()

    def flush(self) -> None:
        """Write the text now if any of it is unsaved (also useful from a timer when tokens stall)."""
        if len(self.text) == self._saved_len:
            return
        self._last_write = self._clock()
        try:
            self.store.update_message(self.message_id, content=self.text)
        except StoreError as exc:
            if self.last_error is None:
                log.error("cannot save the streaming answer %d: %s", self.message_id, exc)
            self.last_error = exc
            return
        self._saved_len = len(self.text)

    def finish(self, status: str, metrics: Any = None, options: Any = None, text: Optional[str] = None) -> None:
        """Write the final text (`text` replaces the streamed one when given), status and figures."""
        if text is not None:
            self.text = text
        self.store.update_message(self.message_id, content=self.text, status=status, metrics=metrics, options=options)
        self._saved_len = len(self.text)
        self.finished = True
