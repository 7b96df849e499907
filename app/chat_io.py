"""A chat as a file: JSON (every branch and each answer's figures; our own format, read back by `import_chat`) and
Markdown (for people). An imported file is validated whole before anything is written, then stored as a new chat
in one transaction: a bad or hostile file is refused with the reason and leaves the store as it was.

JSON format (version 1):
    {"format": "gapless-chat", "version": 1, "exported": <unix time>,
     "chat": {"title", "created", "updated", "system_prompt", "sampling": {...} | null, "active_leaf": id | null,
              "overflow_policy": "rolling" | "truncate-middle" | "stop" | null (null: the app's default)},
     "messages": [{"id", "parent": id | null, "role", "content", "status", "created", "updated",
                   "options": {...} | null, "metrics": {...} | null, "candidate_group": n | null,
                   "candidate_index": n | null, "model_name": str | null}, ...]}
Message ids are the file's own (1..N, parents before children); the store gives new ones on import.
"""

from __future__ import annotations

import json
import re
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from app.markdown_blocks import read_blocks
from app.store import MAX_TEXT_CHARS, MAX_TITLE_CHARS, ROLES, ChatStore, Message, StoreError
from app.thinking import split_thinking, thinking_as_quote
from engine import figures
from engine.errors import GaplessError, OptionsError
from engine.figures import metrics_problem
from engine.paths import write_whole
from engine.types import FINISH_WORDS, OVERFLOW_POLICIES, SamplingParams, describe_options, stored_options_problem

FORMAT = "gapless-chat"
VERSION = 1
MAX_FILE_BYTES = 1 << 30  # a chat the app wrote may hold messages of up to MAX_TEXT_CHARS each
MAX_MESSAGES = 100_000
MAX_FIGURES_BYTES = 64 << 10  # one message's options or metrics object, as JSON
MAX_DEPTH = 8  # nesting inside an options or metrics object
IMPORT_STATUSES = ("done", "stopped", "error")


class ChatFileError(GaplessError):
    """The file cannot be imported (or written); the message says why. Nothing in the store changed."""


@dataclass(frozen=True)
class ImportedChat:
    """A validated file, ready to be stored."""

    title: str
    created: float
    updated: float
    system_prompt: str
    sampling: Optional[dict]
    overflow_policy: Optional[str]
    active_leaf: Optional[int]  # index into messages
    messages: list[dict]  # parent: index into messages (earlier) or None; candidate_group: the file's number


# ---- export -------------------------------------------------------------------------------------------


def chat_document(store: ChatStore, chat_id: int) -> dict:
    """The chat with every branch, as the JSON document (ids renumbered 1..N in the store's order)."""
    chat = store.get_chat(chat_id)
    messages = store.all_messages(chat_id)
    local = {m.id: i for i, m in enumerate(messages, start=1)}
    groups: dict[int, int] = {}
    out = []
    for m in messages:
        group = None
        if m.candidate_group is not None:
            group = groups.setdefault(m.candidate_group, len(groups) + 1)
        out.append(
            {
                "id": local[m.id],
                "parent": local.get(m.parent_id) if m.parent_id is not None else None,
                "role": m.role,
                "content": m.content,
                "status": "stopped" if m.status == "streaming" else m.status,
                "created": m.created,
                "updated": m.updated,
                "options": m.options,
                "metrics": m.metrics,
                "candidate_group": group,
                "candidate_index": m.candidate_index,
                "model_name": m.model_name,
            }
        )
    return {
        "format": FORMAT,
        "version": VERSION,
        "exported": time.time(),
        "chat": {
            "title": chat.title,
            "created": chat.created,
            "updated": chat.updated,
            "system_prompt": chat.system_prompt,
            "sampling": chat.sampling,
            "overflow_policy": chat.overflow_policy,
            "active_leaf": local.get(chat.active_leaf_id) if chat.active_leaf_id is not None else None,
        },
        "messages": out,
    }


# A file name's most bytes (UTF-8) on the common file systems is 255; the rest is room for " (2)" and the like.
EXPORT_NAME_BYTES = 200


def export_name(title: str, suffix: str) -> str:
    """The file name an export of the chat `title` suggests: its letters, digits, spaces, - and _ (any other
    character "_"), cut to whole characters within EXPORT_NAME_BYTES (a renamed title of 86 CJK characters
    was a name too long to be written), then `suffix`."""
    name = "".join(ch if ch.isalnum() or ch in " -_" else "_" for ch in title).strip()
    name = name.encode("utf-8")[: EXPORT_NAME_BYTES - len(suffix.encode("utf-8"))].decode("utf-8", "ignore")
    return (name.rstrip() or "chat") + suffix


def export_json(store: ChatStore, chat_id: int) -> str:
    return json.dumps(chat_document(store, chat_id), ensure_ascii=False, indent=1, allow_nan=False) + "\n"


def export_markdown(store: ChatStore, chat_id: int) -> str:
    """Every branch, depth first from each root, the active branch's messages marked; each answer's figures."""
    chat = store.get_chat(chat_id)
    messages = store.all_messages(chat_id)
    active = {m.id for m in store.thread(chat_id)} if chat.active_leaf_id is not None else set()
    children: dict[Optional[int], list[Message]] = {}
    for m in messages:
        children.setdefault(m.parent_id, []).append(m)
    number = {m.id: i for i, m in enumerate(messages, start=1)}
    lines = [f"# {chat.title}", ""]
    if chat.system_prompt.strip():
        lines += ["**System prompt**", "", _quote(chat.system_prompt), ""]
    branched = any(len(v) > 1 for v in children.values())
    if branched:
        lines += [
            "Messages on the branch on screen are marked ★; the others are alternatives (edits, regenerated "
            "answers, candidates).",
            "",
        ]
    stack = list(reversed(children.get(None, [])))
    previous: Optional[int] = None
    while stack:
        m = stack.pop()
        sibs = children.get(m.parent_id, [])
        head = f"### #{number[m.id]} · {m.role.capitalize()}"
        if m.role == "assistant" and m.model_name:
            head += f" ({' '.join(m.model_name.split())})"  # one line whatever the file's metadata said
        if len(sibs) > 1:
            head += f" · branch {sibs.index(m) + 1} of {len(sibs)}"
        if branched and m.id in active:
            head += " ★"
        lines += [head, ""]
        if m.parent_id is not None and m.parent_id != previous:
            lines += [f"*in reply to #{number[m.parent_id]}*", ""]
        text = _answer_as_exported(m.content) if m.role == "assistant" else _as_exported(m.content) or "*(empty)*"
        lines += [text, ""]
        if m.role == "assistant" and (m.metrics or m.options):
            lines += [f"<sub>{_figures_line(m)}</sub>", ""]
        previous = m.id
        stack.extend(reversed(children.get(m.id, [])))
    if any(m.role == "assistant" and m.metrics for m in messages):
        lines += [
            "<sub>Figures: tokens by the engine's count, TTFT and tok/s by its own timings (device-synchronised), "
            "as stored with each answer.</sub>",
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"


def _figures_line(m: Message) -> str:
    """An answer's stored figures in a few words; a missing one is n/a with its reason (the one stored with it, or
    that the chat does not have it). A remote server's answer shows the client's timings over HTTP; a candidate
    its own token count in the batch's, whose speed it shares. (The store refused figures that are not numbers.)"""
    metrics = m.metrics or {}
    stored = metrics.get("unavailable")
    unavailable: dict[str, Any] = stored if isinstance(stored, dict) else {}
    per = metrics.get("new_tokens") or []
    own = figures.candidate_tokens(metrics, m.candidate_index)
    batch = own is not None
    parts, reasons = [], []
    for key, digits in (("new_tokens_total", 0), ("ttft_ms", 0), ("decode_tok_s", 1)):
        fig = figures.shown(metrics, key)
        how = figures.over_http(fig, key)
        if fig.value is None:
            reasons.append(unavailable.get(key) or "not recorded with this answer")
            text = f"n/a ({reasons[-1]})"
        elif key == "new_tokens_total" and batch:
            text = f"{own:,} of {figures.rounded(fig.value, 0)}"
        else:
            text = figures.rounded(fig.value, digits)
        if key == "new_tokens_total":
            one = fig.value == 1  # "1 token", "1 of 1 token in the batch"
            parts.append(f"{text} token{'' if one else 's'}" + (" in the batch" if batch else ""))
        elif key == "ttft_ms":
            parts.append(f"TTFT{how} {text} ms")
        else:
            parts.append(f"{text} tok/s{how}" + (f" (all {len(per)} candidates)" if batch else ""))
    if len(reasons) == len(parts) and len(set(reasons)) == 1:  # one reason for all: said once
        parts = [f"figures n/a ({reasons[0]})"]
    if metrics.get("prompt_reused_tokens"):
        parts.append(f"{metrics['prompt_reused_tokens']} of {metrics.get('prompt_tokens')} prompt tokens reused")
    if metrics.get("prompt_cut"):
        parts.append(f"context full: {metrics['prompt_cut']}")
    if m.options:
        parts.append(describe_options(m.options))
    if m.status == "stopped":
        parts.append(FINISH_WORDS["interrupted" if metrics.get("finish_reason") == "interrupted" else "cancelled"])
    return " · ".join(parts)


_TURN_HEADING = re.compile(r"^( {0,3}#{1,6}[ \t]+#\d+ · )")


def _as_exported(content: str) -> str:
    """A message's text as the Markdown file holds it: a code block it leaves open (an answer stopped inside one)
    is closed, so it does not take every later turn into it; an HTML block it leaves open ("<script>" or "<!--"
    at the start of a line, never closed) is shown as text, for the same reason; and a line that reads as this
    file's own turn heading ("### #5 · User") is escaped, so an answer cannot make up a turn. Blocks are found as
    a Markdown reader finds them (app.markdown_blocks): a fence inside an HTML block (```` ``` ```` in a
    "<pre>…</pre>") is the block's text, and one inside a list item or a block quote is the item's or the quote's."""
    lines = content.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # a lone CR ends a line in Markdown too
    blocks = read_blocks(lines, _TURN_HEADING)
    for i in blocks.unclosed_html:
        lines[i] = re.sub(r"^( {0,3})<", r"\1\\<", lines[i])
    lines = [_TURN_HEADING.sub(r"\\\1", line) if heading else line for line, heading in zip(lines, blocks.heading)]
    if blocks.closing is not None:
        lines.append(blocks.closing)
    return "\n".join(lines)


def _answer_as_exported(content: str) -> str:
    """An answer as the Markdown file holds it (_as_exported), its thinking before it in a quote headed
    "Thinking" (app.thinking): the tags were raw HTML to a Markdown reader, which drops tags it does not know, and
    the thinking read as the start of the answer."""
    if not content:
        return "*(empty)*"
    thinking = split_thinking(content)
    text = thinking_as_quote(content, _as_exported)
    if thinking is not None and not thinking.answer.strip():
        text += "\n\n*(no answer after it)*"
    return text


def _quote(text: str) -> str:
    return "\n".join("> " + line for line in text.splitlines())


def write_text(path: Path, text: str) -> None:
    """Write atomically (engine.paths.write_whole): a failed write leaves no half file at `path`. Owner-only, as
    a chat is private."""
    from engine.errors import OutputPathError
    from engine.paths import output_file

    try:
        target = output_file(path, "the chat")  # through a link; a folder, a device or a pipe is refused
    except OutputPathError as exc:
        raise ChatFileError(str(exc)) from None
    try:
        write_whole(target, text, mode=0o600)
    except OSError as exc:
        raise ChatFileError(f"cannot write {path}: {exc.strerror or exc}") from exc


# ---- import -------------------------------------------------------------------------------------------


def read_chat_file(path: Path) -> ImportedChat:
    path = Path(path)
    try:
        st = path.stat()
        if stat.S_ISDIR(st.st_mode):
            raise ChatFileError(f"cannot read {path}: it is a folder")
        if not stat.S_ISREG(st.st_mode):  # a FIFO with no writer waited forever, /dev/zero was read to 1 GiB
            raise ChatFileError(f"cannot read {path}: it is not a regular file")
        size = st.st_size
        if size > MAX_FILE_BYTES:
            raise ChatFileError(
                f"{path.name} is {size / 2**20:.0f} MiB; a chat file may be at most {MAX_FILE_BYTES >> 20} MiB"
            )
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ChatFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return parse_chat(data)


def parse_chat(data: bytes) -> ImportedChat:
    """The chat in `data`, validated whole; ChatFileError says what is wrong."""
    if len(data) > MAX_FILE_BYTES:
        raise ChatFileError(f"the file is larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8-sig")  # a byte order mark, as Windows editors write one, is not content
    except UnicodeDecodeError as exc:
        raise ChatFileError(f"not a Gapless chat file: not UTF-8 text (byte {exc.start})") from None
    try:
        doc = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise ChatFileError(
            f"not a Gapless chat file: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise ChatFileError("not a Gapless chat file: JSON nested too deeply") from None
    except ValueError:  # a number of more digits than Python converts (sys.get_int_max_str_digits)
        raise ChatFileError(
            f"not a Gapless chat file: it holds a number of more than {sys.get_int_max_str_digits()} digits"
        ) from None
    return validate(doc)


def _no_constant(name: str) -> Any:
    raise ChatFileError(f"not a Gapless chat file: {name} is not a number JSON allows")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ChatFileError(f"not a Gapless chat file: the key {k!r} appears twice in one object")
        out[k] = v
    return out


def _fail(where: str, what: str) -> ChatFileError:
    return ChatFileError(f"{where}: {what}")


def _obj(v: Any, where: str, keys: set[str], required: set[str]) -> dict:
    if not isinstance(v, dict):
        raise _fail(where, f"must be an object, got {_kind(v)}")
    unknown = sorted(set(v) - keys)
    if unknown:
        raise _fail(where, f"unknown field(s) {', '.join(unknown)}")
    missing = sorted(required - set(v))
    if missing:
        raise _fail(where, f"missing field(s) {', '.join(missing)}")
    return v


def _kind(v: Any) -> str:
    return (
        "null"
        if v is None
        else {
            bool: "true/false",
            int: "a number",
            float: "a number",
            str: "text",
            list: "a list",
            dict: "an object",
        }.get(type(v), type(v).__name__)
    )


def _text(v: Any, where: str, limit: int) -> str:
    if not isinstance(v, str):
        raise _fail(where, f"must be text, got {_kind(v)}")
    if len(v) > limit:
        raise _fail(where, f"is {len(v):,} characters long; at most {limit:,} are allowed")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise _fail(where, "contains an invalid character (a lone surrogate)") from None
    return v


def _time(v: Any, where: str) -> float:
    # compared as it is (NaN and infinity fail too): math.isfinite of an integer no float holds raised
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e11:
        raise _fail(where, f"must be a unix time in seconds, got {v!r}"[:200])
    return float(v)


def _index(v: Any, where: str) -> Optional[int]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 2**62:
        raise _fail(where, f"must be a whole number >= 0 or null, got {v!r}"[:200])
    return v


def _id(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 2**62:
        raise _fail(where, f"must be a whole number >= 0, got {v!r}"[:200])
    return v


def _figures(v: Any, where: str, problem: Callable[[dict], Optional[str]]) -> Optional[dict]:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _fail(where, f"must be an object or null, got {_kind(v)}")
    if _deeper_than(v, MAX_DEPTH):
        raise _fail(where, f"is nested deeper than {MAX_DEPTH} levels")
    why = problem(v)
    if why:
        raise _fail(where, why)
    size = len(json.dumps(v, ensure_ascii=False))
    if size > MAX_FIGURES_BYTES:
        raise _fail(where, f"is {size:,} bytes as JSON; at most {MAX_FIGURES_BYTES:,} are allowed")
    try:
        json.dumps(v, allow_nan=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        raise _fail(where, "contains a value that cannot be stored (a lone surrogate)") from None
    return v


def _deeper_than(v: Any, limit: int) -> bool:
    """Whether objects and lists nest in `v` more than `limit` levels; without recursion, so a value nested as
    deep as JSON's reader allows (about a thousand levels) is measured, not a RecursionError."""
    level: list[tuple[Any, int]] = [(v, 0)]
    while level:
        x, depth = level.pop()
        if isinstance(x, (dict, list)):
            if depth >= limit:
                return True
            level.extend((y, depth + 1) for y in (x.values() if isinstance(x, dict) else x))
    return False


_LINE_BREAKS = re.compile("[\r\n\v\f\x1c\x1d\x1e\x85\u2028\u2029]+")  # where str.splitlines breaks a line
CHAT_KEYS = {"title", "created", "updated", "system_prompt", "sampling", "active_leaf", "overflow_policy"}
MESSAGE_KEYS = {
    "id",
    "parent",
    "role",
    "content",
    "status",
    "created",
    "updated",
    "options",
    "metrics",
    "candidate_group",
    "candidate_index",
    "model_name",
}


def validate(doc: Any) -> ImportedChat:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ChatFileError('not a Gapless chat file (no "format": "gapless-chat" at the top)')
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ChatFileError(f"the chat file has no valid version number (got {version!r})"[:200])
    if version > VERSION:
        raise ChatFileError(
            f"the chat file is version {version}, written by a newer Gapless; this one reads "
            f"version {VERSION} and older"
        )
    if version < 1:
        raise ChatFileError(f"the chat file's version {version} is not one Gapless ever wrote")
    _obj(doc, "the file", {"format", "version", "exported", "chat", "messages"}, {"chat", "messages"})
    if "exported" in doc:
        _time(doc["exported"], "exported")
    chat = _obj(doc["chat"], "chat", CHAT_KEYS, {"title"})
    # one line, as the app's titles, ends trimmed as a rename trims them; the spaces inside stay as stored
    title = _LINE_BREAKS.sub(" ", _text(chat["title"], "chat.title", MAX_TITLE_CHARS)).strip()
    now = time.time()
    created = _time(chat.get("created", now), "chat.created")
    updated = _time(chat.get("updated", created), "chat.updated")
    system = _text(chat.get("system_prompt", ""), "chat.system_prompt", MAX_TEXT_CHARS)
    sampling = chat.get("sampling")
    if sampling is not None:
        if not isinstance(sampling, dict):
            raise _fail("chat.sampling", f"must be an object or null, got {_kind(sampling)}")
        try:
            sampling = SamplingParams.from_dict(sampling).to_dict()
        except (OptionsError, TypeError) as exc:
            raise _fail("chat.sampling", str(exc)) from None
    overflow = chat.get("overflow_policy")
    if overflow is not None and overflow not in OVERFLOW_POLICIES:
        raise _fail(
            "chat.overflow_policy", f"must be one of {', '.join(OVERFLOW_POLICIES)} or null, got {overflow!r}"[:200]
        )
    raw = doc["messages"]
    if not isinstance(raw, list):
        raise _fail("messages", f"must be a list, got {_kind(raw)}")
    if len(raw) > MAX_MESSAGES:
        raise _fail("messages", f"{len(raw):,} messages; at most {MAX_MESSAGES:,} are allowed")
    position: dict[int, int] = {}  # file id -> index
    group_parent: dict[int, Optional[int]] = {}
    group_indexes: dict[int, set[int]] = {}
    messages = []
    for i, m in enumerate(raw):
        where = f"message {i + 1}"
        _obj(m, where, MESSAGE_KEYS, {"id", "role", "content"})
        mid = _id(m["id"], f"{where}: id")
        if mid in position:
            raise _fail(where, f"id {mid} is used by message {position[mid] + 1} too")
        parent = _index(m.get("parent"), f"{where}: parent")
        if parent is not None and parent not in position:
            raise _fail(where, f"its parent {parent} is not an earlier message of the file")
        role = m["role"]
        if role not in ROLES:
            raise _fail(where, f"role must be one of {', '.join(ROLES)}, got {role!r}"[:200])
        status = m.get("status", "done")
        if status not in IMPORT_STATUSES:
            raise _fail(where, f"status must be one of {', '.join(IMPORT_STATUSES)}, got {status!r}"[:200])
        m_created = _time(m.get("created", created), f"{where}: created")
        group = _index(m.get("candidate_group"), f"{where}: candidate_group")
        index = _index(m.get("candidate_index"), f"{where}: candidate_index")
        if (group is None) != (index is None):
            raise _fail(where, "candidate_group and candidate_index go together (both set or both null)")
        parent_at = position.get(parent) if parent is not None else None
        if group is not None:
            if role != "assistant":
                raise _fail(where, "only answers can be candidates")
            if group_parent.setdefault(group, parent_at) != parent_at:
                raise _fail(where, f"candidate group {group} holds answers to different messages")
            if index is None or index in group_indexes.setdefault(group, set()):
                raise _fail(where, f"candidate {index} appears twice in group {group}")
            group_indexes[group].add(index)
        model = m.get("model_name")
        messages.append(
            {
                "parent": parent_at,
                "role": role,
                "content": _text(m["content"], f"{where}: content", MAX_TEXT_CHARS),
                "status": status,
                "created": m_created,
                "updated": _time(m.get("updated", m_created), f"{where}: updated"),
                "options": _figures(m.get("options"), f"{where}: options", stored_options_problem),
                "metrics": _figures(m.get("metrics"), f"{where}: metrics", metrics_problem),
                "candidate_group": group,
                "candidate_index": index,
                "model_name": None if model is None else _text(model, f"{where}: model_name", MAX_TITLE_CHARS),
            }
        )
        position[mid] = i
    leaf = _index(chat.get("active_leaf"), "chat.active_leaf")
    if leaf is not None and leaf not in position:
        raise _fail("chat.active_leaf", f"names message {leaf}, which the file does not have")
    if leaf is None and messages:
        raise _fail("chat.active_leaf", "is null, but the chat has messages")
    return ImportedChat(
        title, created, updated, system, sampling, overflow, position.get(leaf) if leaf is not None else None, messages
    )


def import_chat(store: ChatStore, path: Path) -> int:
    """Store the chat in the file at `path` as a new chat; its id. Refused whole (ChatFileError) or stored whole."""
    return store_chat(store, read_chat_file(path))


def store_chat(store: ChatStore, chat: ImportedChat) -> int:
    """Store a chat read whole (read_chat_file, parse_chat) as a new chat; its id."""
    try:
        return store.import_chat(chat)
    except StoreError as exc:
        raise ChatFileError(f"the chat could not be stored: {exc}") from exc
