"""The conversation logic between the chat store and the engine controller: send, stream, stop, regenerate,
edit-and-resend (a branch), candidates, branch switching. It holds no widgets; the window shows what it emits.

Every answer is saved while it streams (app.store.StreamSaver): a stop keeps the partial text, a crash loses at
most about a second of it. Events of a generation are matched to it by request id, so a late batch from a
stopped answer can never land in the next one.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional

from PySide6.QtCore import QObject, QTextBoundaryFinder, QTimer, Signal

from app.store import (
    NEW_CANDIDATE_GROUP,
    ChatStore,
    Message,
    NotFound,
    StoreError,
    StreamSaver,
    check_message,
    figures_lost,
)
from engine import figures
from engine.errors import one_line
from engine.types import DEVICES, DTYPES, EngineOptions, GenerationResult, SamplingParams, blank, options_as_run

if TYPE_CHECKING:
    from app.worker import EngineController

log = logging.getLogger(__name__)

TITLE_CHARS = 48
SAVE_TICK_MS = 1000  # also save when tokens stall (a long prefill, a slow first compile)


UNTITLED = "New chat"  # a chat's title until its first message names it


def title_from(text: str) -> str:
    """A chat's title from its first message: one line, cut to TITLE_CHARS with "…", between two characters as they
    are seen (a flag, an emoji of several, a letter and its accent are never cut apart)."""
    line = " ".join(text.strip().split())
    if len(line) <= TITLE_CHARS:
        return line
    units = line.encode("utf-16-le")  # Qt counts in UTF-16 code units
    finder = QTextBoundaryFinder(QTextBoundaryFinder.BoundaryType.Grapheme, line)
    finder.setPosition(len(line[: TITLE_CHARS - 1].encode("utf-16-le")) // 2)
    if not finder.isAtBoundary():
        finder.toPreviousBoundary()
    if finder.position() <= 0:  # one character of more than TITLE_CHARS (a letter under a pile of accents)
        return line[: TITLE_CHARS - 1] + "…"
    return units[: 2 * finder.position()].decode("utf-16-le").rstrip() + "…"


def finish_reasons(result: GenerationResult, max_new_tokens: int) -> list[str]:
    """The engine's finish reasons, with "context" for a token limit reached below the `max_new_tokens` asked
    for (the engine then had less room left in the context than that)."""
    per = result.metrics.new_tokens or []
    return [
        "context" if r == "length" and i < len(per) and per[i] < max_new_tokens else r
        for i, r in enumerate(result.finish_reasons)
    ]


def spoken(
    thread: list[Message], skip: frozenset[int] | set[int] = frozenset(), then: Optional[str] = None
) -> list[dict]:
    """The branch as the model is asked it (`then`: a question to add after it). Left out: answers that say
    nothing (failed before their first token) or are in `skip` (still streaming), and a question that was never
    answered (refused as too long, failed, or stopped while it was read) and was followed by another: sent
    again, it would have the next prompt refused the same way, and two user turns in a row break the
    templates that want the roles to alternate (Gemma's)."""
    kept = _said(thread, skip)
    unanswered = _unanswered(kept, then is not None)
    turns = [
        {"role": m.role, "content": m.content}
        for m in kept
        if m.id not in unanswered and not (m.role == "assistant" and m.id in skip)
    ]
    if then is not None:
        turns.append({"role": "user", "content": then})
    return turns


def _said(thread: list[Message], streaming: frozenset[int] | set[int] = frozenset()) -> list[Message]:
    """The branch without the answers that say nothing (failed before their first token), but those `streaming`.
    An answer that ended empty (the model's end of turn, or a stop string, at once) is an answer: the question
    before it was left out of the next prompt as never answered, and the user told so."""
    return [
        m
        for m in thread
        if not (m.role == "assistant" and not m.content and m.status != "done" and m.id not in streaming)
    ]


def _unanswered(kept: list[Message], then: bool) -> set[int]:
    """The questions of `kept` (answers that say nothing left out) followed by another question: none answered
    them (the one streaming now counts as an answer). `then`: a question follows the last."""
    unanswered = {m.id for m, after in zip(kept, kept[1:]) if m.role == after.role == "user"}
    if then and kept and kept[-1].role == "user":  # the draft follows a question left unanswered
        unanswered.add(kept[-1].id)
    return unanswered


def left_out(thread: list[Message]) -> str:
    """What spoken() leaves out of the branch to its last question, said for the user where the question just
    before it is one ("" where nothing, or where those left out are older: said when they were)."""
    kept = _said(thread)
    n = len(_unanswered(kept, False))
    if not n or len(kept) < 2 or kept[-2].role != "user":
        return ""
    if n == 1:
        return (
            "an earlier question was never answered (refused, failed or stopped while read) and is not sent with "
            "this one; it stays in the chat"
        )
    return (
        f"{n} earlier questions were never answered (refused, failed or stopped while read) and are not sent with "
        "this one; they stay in the chat"
    )


MADE, GONE = "made", "gone"  # ChatFlow.opened_because


@dataclass
class MessageItem:
    """What the conversation view shows of one stored message."""

    id: Optional[int]
    role: str  # "user" | "assistant" | "system"
    content: str
    sibling_index: int = 0  # position among the messages sharing its parent (branches, candidates)
    sibling_count: int = 1
    metrics: Optional[dict[str, Any]] = None
    options: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None
    device: Optional[str] = None  # where the answer was generated ("cpu", "cuda"), for the gap's name
    author: str = ""  # the model's name over an answer
    candidate: Optional[int] = None  # its index in a batch of candidates (whose figures are the batch's)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Answer:
    """The generation in flight: where its messages go once the engine says how many candidates it runs."""

    request_id: int
    chat_id: int
    parent_id: int  # the user message it answers
    model_name: Optional[str]
    message_ids: list[int] = field(default_factory=list)
    savers: list[StreamSaver] = field(default_factory=list)
    candidates: int = 1
    discarded: bool = False  # its chat was deleted: nothing more is saved
    max_new_tokens: int = 0  # what was asked for: a token limit reached below it was the context's
    listed: bool = True  # the chat list was read after its question was stored (not for a regenerated answer)


def resolved(options: Any, info: Any) -> Any:
    """`options` with "auto" device and dtype as the loaded model (`info`) resolved them: "auto" names no preset.
    An answer's own options replace them when it ends; one cut off by a crash keeps these."""
    if not isinstance(options, EngineOptions) or info is None:
        return options
    allowed = {"device": DEVICES, "dtype": DTYPES}
    fill = {
        k: getattr(info, k) for k, ok in allowed.items() if getattr(options, k) == "auto" and getattr(info, k) in ok
    }
    return options.with_(**fill) if fill else options


ELSEWHERE = "another Gapless window or the command line"  # what can change the database under the window


class ChatFlow(QObject):
    chatsChanged = Signal()  # titles, order or membership of the chat list changed
    chatOpened = Signal(object)  # chat id or None
    threadChanged = Signal(object)  # [MessageItem] of the open chat's active branch
    messageAppended = Signal(object)  # MessageItem added at the end of the branch on screen
    streamStarted = Signal(object, int)  # MessageItem of the answer, candidate count
    streamDelta = Signal(object)  # {candidate: text}
    streamRowsFinished = Signal(object)  # {candidate: finish reason} of candidates that ended (others go on)
    streamFinished = Signal(object)  # MessageItem (one candidate)
    candidatesFinished = Signal(object)  # GenerationResult (N candidates, awaiting a choice)
    generatingChanged = Signal(bool)
    failed = Signal(str)  # a message for the user
    noticed = Signal(str)  # what the user is told of a question asked (for the status bar)

    def __init__(
        self,
        store: ChatStore,
        controller: EngineController,
        default_sampling: SamplingParams,
        parent: Optional[QObject] = None,
    ):
        super().__init__(parent)
        self.store = store
        self.controller = controller
        self.default_sampling = default_sampling
        self.default_overflow = "rolling"  # for chats without their own policy (the settings' choice)
        self.default_system_prompt = ""  # of a new chat (the settings' choice)
        self.chat_id: Optional[int] = None
        self.answer: Optional[_Answer] = None
        self.last_finish_reasons: list[str] = []  # of the last result, "context" where the context cut it short
        self._candidate_ids: list[int] = []  # the last batch of candidates, until one is chosen
        self._mending = False  # showing what another window or the command line changed (_changed_elsewhere)
        # Why chatOpened is being emitted, for what goes with the chat (the composer's draft): MADE, the new chat
        # became this one (its first message, or Chat settings before one); GONE, the chat on screen was deleted
        # elsewhere; "" otherwise
        self.opened_because = ""
        # The last message on screen: a message sent goes under it. Another window on the same chat moves the
        # stored active leaf to the branch it shows; this one still shows (and answers under) its own.
        self._shown_leaf: Optional[int] = None
        self.threadChanged.connect(lambda items: self._note_leaf(items[-1] if items else None))
        self.messageAppended.connect(self._note_leaf)
        self.streamFinished.connect(self._note_leaf)
        controller.generationStarted.connect(self._on_started)
        controller.textBatch.connect(self._on_text)
        controller.rowsFinished.connect(self._on_rows_finished)
        controller.generationFinished.connect(self._on_finished)
        controller.generationFailed.connect(self._on_failed)
        self._save_timer = QTimer(self)
        self._save_timer.setInterval(SAVE_TICK_MS)
        self._save_timer.timeout.connect(self._flush_savers)

    # ---- chats ---------------------------------------------------------------------------------------

    @property
    def generating(self) -> bool:
        return self.answer is not None

    def open_chat(self, chat_id: Optional[int]) -> None:
        self.chat_id = chat_id
        self._candidate_ids = []  # candidates left on screen in another chat are no longer there to choose from
        self.chatOpened.emit(chat_id)
        self.reload()
        chat = self._guard(lambda: self.store.get_chat(chat_id)) if chat_id is not None else None
        if chat and chat.damaged:
            self.failed.emit(f"This chat's {chat.damaged.removeprefix('its ')} in Chat settings")

    @contextlib.contextmanager
    def _opening(self, because: str) -> Iterator[None]:
        """chatOpened emitted within it says why (opened_because)."""
        self.opened_because = because
        try:
            yield
        finally:
            self.opened_because = ""

    def new_chat(self) -> None:
        """Start an empty chat; it is stored when its first message is sent."""
        self.open_chat(None)

    def rename_chat(self, chat_id: int, title: str) -> None:
        if self._guard(lambda: self.store.rename_chat(chat_id, title), chat_id):  # the title as it was: no change
            self.chatsChanged.emit()

    def delete_chat(self, chat_id: int) -> None:
        """Delete the chat; an answer it is being given stops, thrown away. Where the store refuses (another
        window holding the database, a full disk) the chat stays and its answer goes on: its saves and the
        stop run on this thread, after the delete, so none of them falls between."""
        if self._guard(lambda: self.store.delete_chat(chat_id), chat_id) is False:
            return
        if self.answer is not None and self.answer.chat_id == chat_id:
            self.answer.discarded = True
            self.stop()
        self.chatsChanged.emit()
        if chat_id == self.chat_id:
            self.open_chat(None)

    def sampling(self, chat_id: Optional[int] = None) -> SamplingParams:
        chat_id = chat_id if chat_id is not None else self.chat_id
        if chat_id is None:
            return self.default_sampling
        chat = self._guard(lambda: self.store.get_chat(chat_id))
        return SamplingParams.from_dict(chat.sampling) if chat and chat.sampling else self.default_sampling

    def overflow_policy(self, chat_id: Optional[int] = None) -> str:
        """The policy answers of this chat are fitted to the context with: its own, else the default."""
        chat_id = chat_id if chat_id is not None else self.chat_id
        chat = self._guard(lambda: self.store.get_chat(chat_id)) if chat_id is not None else None
        return (chat.overflow_policy if chat else None) or self.default_overflow

    def chat_overflow_policy(self) -> Optional[str]:
        """The chat's own policy; None when it follows the default."""
        chat_id = self.chat_id
        chat = self._guard(lambda: self.store.get_chat(chat_id)) if chat_id is not None else None
        return chat.overflow_policy if chat else None

    def system_prompt(self) -> str:
        chat_id = self.chat_id
        chat = self._guard(lambda: self.store.get_chat(chat_id)) if chat_id is not None else None
        return chat.system_prompt if chat else self.default_system_prompt

    def set_chat_settings(self, system_prompt: str, sampling: SamplingParams, overflow_policy: str = "") -> None:
        """overflow_policy "" follows the default."""
        if self.chat_id is None:
            # One transaction: the chat with every setting, or none (a failed second write left it made with the
            # default policy, and opened after the error)
            chat = self._guard(lambda: self.store.create_chat(UNTITLED, system_prompt, sampling, overflow_policy))
            if not chat:
                return
            self.chat_id = chat.id
            self.chatsChanged.emit()
            with self._opening(MADE):
                self.chatOpened.emit(chat.id)
            return
        chat_id = self.chat_id
        if self._guard(
            lambda: self.store.update_chat(
                chat_id, system_prompt=system_prompt, sampling=sampling, overflow_policy=overflow_policy
            )
        ):
            self.chatsChanged.emit()  # the chat changed: it comes first in the list

    # ---- the visible branch --------------------------------------------------------------------------

    def items(self, leaf_id: Optional[int] = None) -> list[MessageItem]:
        """The visible branch (to the active leaf, or to `leaf_id`), without the answer now streaming."""
        if self.chat_id is None:
            return []
        streaming = set(self.answer.message_ids) if self.answer and self.answer.chat_id == self.chat_id else set()
        thread = self.store.thread(self.chat_id, leaf_id)
        positions = self.store.branch_positions(self.chat_id)  # one query for the whole branch, not one per message
        return [
            self._item(m, *positions.get(m.id, (0, 1)))
            for m in thread
            if m.id not in streaming  # shown by the live stream instead
        ]

    def _item(self, m: Message, index: int, count: int) -> MessageItem:
        device = (m.options or {}).get("device")
        return MessageItem(
            id=m.id,
            role=m.role,
            content=m.content,
            sibling_index=index,
            sibling_count=count,
            metrics=m.metrics,
            options=m.options,
            finish_reason=(m.metrics or {}).get("finish_reason")
            or {"stopped": "cancelled", "error": "error"}.get(m.status),
            device=device,
            author=m.model_name or "",
            candidate=m.candidate_index,
        )

    def reload(self) -> None:
        a = self.answer
        if a is not None and a.chat_id == self.chat_id and not a.message_ids:
            # asked, not yet begun (the engine busy with the server's answer): the branch to the question it
            # answers; a regenerate's old answer is still the stored leaf until the new one is stored
            self.threadChanged.emit(self._guard(lambda: self.items(a.parent_id)) or [])
        else:
            self.threadChanged.emit(self._guard(self.items) or [])
        if a is not None and a.chat_id == self.chat_id and a.savers:
            self.streamStarted.emit(MessageItem(None, "assistant", "", author=a.model_name or ""), a.candidates)
            self.streamDelta.emit({i: s.text for i, s in enumerate(a.savers)})

    def step_sibling(self, message_id: int, step: int) -> None:
        sibs = self._guard(lambda: self.store.siblings(message_id))
        if not sibs:
            return
        ids = [s.id for s in sibs]
        target = ids.index(message_id) + step
        if 0 <= target < len(ids) and self.chat_id is not None:
            self._guard(lambda: self.store.set_active_leaf(self.chat_id, ids[target]))
            self._candidate_ids = []  # the thread shown again has no candidates on screen to choose from
            self.reload()

    def delete_message(self, message_id: int) -> None:
        deleted = self._guard(lambda: self.store.delete_message(message_id)) is not False
        self._candidate_ids = []
        if deleted:  # else it was said (and a message deleted elsewhere listed the chats again)
            self.chatsChanged.emit()
        self.reload()

    # ---- sending -------------------------------------------------------------------------------------

    def send(self, text: str) -> bool:
        """Add `text` as a user message at the end of the visible branch and ask for an answer."""
        if self.generating or blank(text):
            return False
        if not self._guard(lambda: check_message(text)):  # refused before a chat is made, or named, after it
            return False
        leaf: Optional[int] = None
        if self.chat_id is None:  # the chat is made with its first message: one the store refuses leaves none
            user = self._guard(
                lambda: self.store.start_chat(title_from(text), self.default_system_prompt, self.default_sampling, text)
            )
            if not user:
                return False
            self.chat_id = user.chat_id
            with self._opening(MADE):
                self.chatOpened.emit(user.chat_id)
        else:
            chat = self._guard(lambda: self.store.get_chat(self.chat_id))  # gone, if another window deleted it
            if not chat:
                return False
            leaf = chat.active_leaf_id if self._candidate_ids or self._shown_leaf is None else self._shown_leaf
            if leaf != chat.active_leaf_id and not self._on_screen_still(leaf):
                return False
            # a chat made by Chat settings before its first message is named by it, or keeps its name
            title = title_from(text) if leaf is None and chat.title == UNTITLED else None
            user = self._guard(lambda: self.store.add_message(chat.id, "user", text, leaf, title=title))
            if not user:
                return False
        self.chatsChanged.emit()
        if self._candidate_ids or leaf is None:
            self.reload()  # candidates on screen, or a new chat: the view is rebuilt from the store
        else:
            # The message goes under the branch's last one, which is what the view shows: append it rather
            # than render the whole conversation again (that took ~0.8 s at 200 messages).
            self.messageAppended.emit(self._item(user, 0, 1))
        return self._ask(user)

    def edit(self, user_message_id: int, text: str) -> bool:
        """Resend an edited user message as a new branch beside the old one (which stays reachable); an edit that
        says nothing (white space, NUL characters) is refused as a message sent is."""
        if self.generating or blank(text):
            return False
        old = self._guard(lambda: self.store.get_message(user_message_id))
        if not old:
            return False
        user = self._guard(lambda: self.store.add_message(old.chat_id, "user", text, old.parent_id))
        if not user:
            return False
        self.chatsChanged.emit()  # the chat changed: it comes first in the list
        self.reload()
        return self._ask(user)

    def regenerate(self, assistant_message_id: int) -> bool:
        """A new answer to the same user message, beside the old one."""
        if self.generating:
            return False
        old = self._guard(lambda: self.store.get_message(assistant_message_id))
        if not old or old.parent_id is None:
            return False
        question = self._guard(lambda: self.store.get_message(old.parent_id))
        if not question:
            return False
        # Show the branch up to the question; the new answer becomes the active leaf once it is stored.
        self.threadChanged.emit(self._guard(lambda: self.items(old.parent_id)) or [])
        return self._ask(question, listed=False)

    def stop(self) -> None:
        if self.answer is not None:
            self.controller.cancel()

    def awaiting_choice(self) -> bool:
        """A batch of candidates is shown and none has been chosen yet."""
        return bool(self._candidate_ids)

    def choose_candidate(self, index: int) -> None:
        """Continue the chat from candidate `index` of the last batch; the others stay as siblings."""
        ids = self._candidate_ids
        if 0 <= index < len(ids) and self.chat_id is not None:
            self._guard(lambda: self.store.set_active_leaf(self.chat_id, ids[index]))
            self._candidate_ids = []
            self.reload()

    def prompt_messages(self, upto: Message) -> list[dict]:
        """The engine's messages for an answer to `upto`: the chat's system prompt, then the branch."""
        out: list[dict] = []
        system = self.store.get_chat(upto.chat_id).system_prompt
        if system.strip():
            out.append({"role": "system", "content": system})
        return out + spoken(self.store.thread(upto.chat_id, upto.id))

    def draft_messages(self, draft: str, candidate: Optional[int] = None) -> list[dict]:
        """The engine's messages if `draft` were sent now: the system prompt, the branch on screen, the draft.
        `candidate`: the tab shown while candidates wait for a choice (sending continues from it)."""
        out: list[dict] = []
        if self.chat_id is None and self.default_system_prompt.strip():
            out.append({"role": "system", "content": self.default_system_prompt})
        if self.chat_id is not None:
            chat = self.store.get_chat(self.chat_id)
            if chat.system_prompt.strip():
                out.append({"role": "system", "content": chat.system_prompt})
            streaming = set(self.answer.message_ids) if self.answer is not None else set()
            ids = self._candidate_ids
            if candidate is not None and 0 <= candidate < len(ids):
                leaf: Optional[int] = ids[candidate]
            else:  # the branch on screen; while an answer streams, to it (the stored active leaf)
                leaf = None if self.generating or ids else self._shown_leaf
            try:
                thread = self.store.thread(self.chat_id, leaf) if chat.active_leaf_id is not None else []
            except StoreError:  # the message on screen was deleted elsewhere: the chat as stored (a send says so)
                if leaf is None or leaf != self._shown_leaf:
                    raise
                thread = self.store.thread(self.chat_id)
            return out + spoken(thread, streaming, then=draft)
        out.append({"role": "user", "content": draft})
        return out

    def _ask(self, user: Message, listed: bool = True) -> bool:
        """Ask for an answer to `user`; `listed`: the chat list was read after `user` was stored (else it is read
        once the answer is stored, which moves the chat up)."""
        try:
            messages = self.prompt_messages(user)
            sampling = self.sampling(user.chat_id)
            overflow = self.overflow_policy(user.chat_id)
            skipped = left_out(self.store.thread(user.chat_id, user.id))
        except StoreError as exc:
            self.failed.emit(str(exc))
            return False
        if user.chat_id != self.chat_id:  # it went meanwhile (deleted elsewhere: a new chat is open)
            return False
        info = getattr(self.controller, "info", None)
        request_id = self.controller.generate(messages, sampling, overflow=overflow)
        self.answer = _Answer(
            request_id,
            user.chat_id,
            user.id,
            info.name if info is not None else None,
            max_new_tokens=sampling.max_new_tokens,
            listed=listed,
        )
        self._candidate_ids = []
        self.generatingChanged.emit(True)
        if skipped:
            self.noticed.emit(skipped)
        return True

    # ---- engine events -------------------------------------------------------------------------------

    def _on_started(self, request_id: int, options: Any) -> None:
        a = self.answer
        if a is None or a.request_id != request_id or a.discarded:
            return
        n = max(1, int(getattr(options, "candidates", 1)))
        a.candidates = n
        options = resolved(options, getattr(self.controller, "info", None))  # kept if the app ends first
        group = NEW_CANDIDATE_GROUP if n > 1 else None
        try:
            for i in range(n):
                m = self.store.add_message(
                    a.chat_id,
                    "assistant",
                    "",
                    a.parent_id,
                    status="streaming",
                    options=options,
                    candidate_group=group,
                    candidate_index=i if n > 1 else None,
                    model_name=a.model_name,
                )
                group = m.candidate_group  # the number the first one took
                a.message_ids.append(m.id)
                a.savers.append(StreamSaver(self.store, m.id))
        except StoreError as exc:
            self.failed.emit(f"The answer cannot be saved: {exc}")
            self.controller.cancel()
            return
        self._save_timer.start()
        if not a.listed:
            a.listed = True
            self.chatsChanged.emit()
        if a.chat_id == self.chat_id:
            self.streamStarted.emit(MessageItem(None, "assistant", "", author=a.model_name or ""), n)

    def _on_text(self, request_id: int, deltas: dict) -> None:
        a = self.answer
        if a is None or a.request_id != request_id or not a.savers:
            return
        if a.discarded:
            return
        for i, delta in deltas.items():
            if 0 <= i < len(a.savers):
                a.savers[i].append(delta)
        if a.chat_id == self.chat_id:
            self.streamDelta.emit(deltas)

    def _on_rows_finished(self, request_id: int, ended: dict) -> None:
        a = self.answer
        if a is not None and a.request_id == request_id and not a.discarded and a.chat_id == self.chat_id:
            self.streamRowsFinished.emit(ended)

    def _on_finished(self, request_id: int, result: GenerationResult) -> None:
        a = self.answer
        if a is None or a.request_id != request_id:
            return
        if a.discarded:
            self._end()
            return
        if all(r == "cancelled" for r in result.finish_reasons) and not any(result.texts):
            # Stopped while the prompt was read: there is no answer to keep, only the question.
            try:
                for message_id in a.message_ids:
                    self.store.delete_message(message_id)
            except StoreError as exc:
                self.failed.emit(f"The stopped answer could not be removed: {exc}")
            self._end()
            self.chatsChanged.emit()
            if a.chat_id == self.chat_id:
                self.reload()
            return
        options = options_as_run(result.options, result.unavailable, result.limits)  # as the JSON has them
        metrics = result.metrics.to_dict()
        ran = len(result.texts)
        shown_as_candidates = a.candidates > 1
        if a.candidates > 1 and 0 < ran < len(a.savers):
            # The engine ran fewer candidates than asked (out of device memory): the answers it did not make
            # are not kept as empty ones a user could pick.
            try:
                for message_id in a.message_ids[ran:]:
                    self.store.delete_message(message_id)
            except StoreError as exc:
                self.failed.emit(f"The answer could not be saved: {exc}")
            del a.message_ids[ran:], a.savers[ran:]
            a.candidates = ran
        reasons = finish_reasons(result, a.max_new_tokens)
        self.last_finish_reasons = reasons
        saved = True
        try:
            for i, saver in enumerate(a.savers):
                reason = reasons[i] if i < len(reasons) else "cancelled"
                text = result.texts[i] if i < len(result.texts) else None
                saver.finish(
                    "stopped" if reason == "cancelled" else "done",
                    metrics={**metrics, "finish_reason": reason},
                    options=options,
                    text=text,
                )
        except NotFound:  # its chat was deleted elsewhere meanwhile
            self._end()
            self._changed_elsewhere(a.chat_id, answer=True)
            return
        except StoreError as exc:
            saved = False
            self.failed.emit(f"The answer could not be saved: {exc}")
        self._end()
        if a.chat_id != self.chat_id or not a.message_ids:
            self.chatsChanged.emit()  # the answer changed its chat, on screen or not
            return
        if a.candidates > 1:
            self._candidate_ids = list(a.message_ids)
            self.candidatesFinished.emit(result)
            self.chatsChanged.emit()
            return
        if shown_as_candidates:
            # One candidate of several ran (out of device memory): the answer is an answer, shown from the store
            # in place of the candidates' tabs (they stayed "generating…", nothing to pick, the answer unshown)
            self.reload()
            self.chatsChanged.emit()
            return
        try:
            m = self.store.get_message(a.message_ids[0])
            sibs = [s.id for s in self.store.siblings(m.id)]
        except NotFound:  # deleted elsewhere since it was saved
            self._changed_elsewhere()
            return
        except StoreError as exc:
            # Not read back (a disk error): shown as it was saved, or as it came where the save failed too (said
            # above), so it does not stay "generating…"; its place among other versions shows once it is read.
            log.error("chat store: %s", exc)
            if saved:
                self.failed.emit(f"The answer is saved, but it cannot be read back to show it: {exc}")
            reason = reasons[0] if reasons else "cancelled"
            item = MessageItem(
                a.message_ids[0],
                "assistant",
                a.savers[0].text,
                metrics=figures.finite({**metrics, "finish_reason": reason}),
                options=options,
                finish_reason=reason,
                device=options.get("device") if isinstance(options, dict) else None,
                author=a.model_name or "",
            )
            self.streamFinished.emit(item)
            self.chatsChanged.emit()
            return
        if m.id not in sibs:  # deleted elsewhere between the two reads
            self._changed_elsewhere()
            return
        self.streamFinished.emit(self._item(m, sibs.index(m.id), len(sibs)))
        self.chatsChanged.emit()

    def _on_failed(self, request_id: int, message: str) -> None:
        a = self.answer
        if a is None or a.request_id != request_id:
            return
        for saver in [] if a.discarded else a.savers:
            try:
                if saver.text:  # kept as written before the failure, its figures n/a with the reason
                    saver.finish("error", figures_lost(f"the answer failed: {one_line(message)}"))
                else:
                    self.store.delete_message(saver.message_id)  # nothing to keep
            except StoreError as exc:
                log.error("cannot save the failed answer %d: %s", saver.message_id, exc)
        self._end()
        self.failed.emit(f"The answer failed: {message}")
        if not a.discarded:  # what was written was kept or removed: its chat changed
            self.chatsChanged.emit()
        if a.chat_id == self.chat_id:
            self.reload()

    def _changed_elsewhere(self, chat_id: Optional[int] = None, answer: bool = False) -> None:
        """What was on screen (or `chat_id`, an answer's chat) was deleted by another window or the command line
        (they share the database): the chat is shown as it is now, or a new chat opens where it is gone. Said
        once, however many calls find it."""
        if self._mending:
            return
        self._mending = True
        try:
            if chat_id is not None and chat_id != self.chat_id:  # not the chat on screen (one in the list)
                self.failed.emit(
                    f"That chat or its message was deleted elsewhere ({ELSEWHERE})"
                    + ("; the answer is not kept" if answer else "")
                )
                self.chatsChanged.emit()
                return
            chat_id = self.chat_id
            try:
                gone = chat_id is not None and self.store.get_chat(chat_id) is None
            except NotFound:
                gone = True
            except StoreError:
                gone = False
            if gone:
                self.failed.emit(f"This chat was deleted elsewhere ({ELSEWHERE}); a new chat is open")
                with self._opening(GONE):
                    self.open_chat(None)
            else:
                self.failed.emit(
                    f"A message of this chat was deleted elsewhere ({ELSEWHERE}); it is shown as it is now"
                )
                self.reload()
            self.chatsChanged.emit()
        finally:
            self._mending = False

    def _end(self) -> None:
        self._save_timer.stop()
        self.answer = None
        self.generatingChanged.emit(False)

    def _flush_savers(self) -> None:
        a = self.answer
        if a is not None and not a.discarded:
            for s in a.savers:
                s.flush()
            if any(isinstance(s.last_error, NotFound) for s in a.savers):  # deleted elsewhere: stop writing into it
                a.discarded = True
                self.controller.cancel()
                self._changed_elsewhere(a.chat_id, answer=True)

    def _on_screen_still(self, message_id: Optional[int]) -> bool:
        """Whether the message on screen is still stored in the chat on screen; where another window or the
        command line deleted it, the chat is shown as it is now (and False)."""
        if message_id is None:
            return True
        m = self._guard(lambda: self.store.get_message(message_id))  # deleted: shown as it is now (_guard)
        if m and m.chat_id != self.chat_id:  # its id taken by a message of another chat since
            self._changed_elsewhere()
            return False
        return bool(m)

    def _note_leaf(self, item: Optional[MessageItem]) -> None:
        self._shown_leaf = item.id if item is not None else None

    def answering_chat(self) -> Optional[int]:
        """The chat the running answer is written into; None while none runs."""
        return self.answer.chat_id if self.answer is not None else None

    def _guard(self, fn, chat_id: Optional[int] = None):
        """Run a store call about `chat_id` (default: the chat on screen); a StoreError becomes a message for
        the user (and a falsy result)."""
        try:
            return fn()
        except NotFound as exc:
            log.info("chat store: %s", exc)
            self._changed_elsewhere(chat_id)
            return False
        except StoreError as exc:
            log.error("chat store: %s", exc)
            self.failed.emit(str(exc))
            return False
