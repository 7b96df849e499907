"""Chat messages -> prompt token ids: the model's chat template (or a plain format without one), cut to fit.

Room for the answer: a prompt that is too long is cut until `max_new_tokens` more tokens fit in the context,
but the reserve is capped at a quarter of the context. A long conversation is worth more than room for an answer
of the full requested length; the engine still stops the answer at the end of the context.

Cutting order, by overflow policy (engine.types.OVERFLOW_POLICIES):
- rolling: the oldest non-system messages go first (a leading assistant reply left without its question goes
  with it); the system prompt and the last user message stay.
- truncate-middle: whole turns after the first one go, oldest first, then the first question's answers; the
  system prompt, the first user message and the last user message stay.
- stop: nothing is cut; a prompt that does not fit is refused with a message.
Each policy drops at least the fewest messages that fit, rounded up to about a quarter of the budget's worth
(_sticky), so the cut stays put for several turns and the engine's prefix cache serves them.
If what must stay is still too long, the last user message keeps its tail. Every cut is reported in `notices`,
and what was dropped in `cut` (for the answer's stats line).

Token counts are kept per tokenizer by the digest of the text counted (_TokenCounts): a chat fitted again (the
context meter as the draft is typed, the send, a regenerate, the next turn) tokenizes only the messages, and the
rendered chat, it has not counted before; the counts are the tokenizer's own, so every fitting is unchanged.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

from engine import prompt_stop
from engine.errors import GenerationError, one_line
from engine.prompt_stop import PromptStopped
from engine.types import OVERFLOW_LABELS, OVERFLOW_POLICIES, ROLES, ContextUse

FALLBACK_LABELS = {"system": "System", "user": "User", "assistant": "Assistant"}
# Where an answer in the plain format (a model without a chat template) ends: a turn of the user or the system it
# wrote on, which was kept in the answer and read back as the assistant's words the next turn.
PLAIN_FORMAT_STOPS = tuple(f"\n\n{FALLBACK_LABELS[role]}:" for role in ("user", "system"))


def format_stops(tokenizer, raw: bool) -> tuple[str, ...]:
    """The stop strings the prompt's format adds to the user's: the plain format's turn labels."""
    return () if raw or getattr(tokenizer, "chat_template", None) else PLAIN_FORMAT_STOPS


@dataclass
class Prompt:
    ids: list[int]
    text: str  # what was tokenized (for logs and debugging)
    dropped_messages: int  # messages removed to fit
    notices: list[str] = field(default_factory=list)
    cut: str = ""  # what was dropped or cut to fit, "" when nothing was


def prompt_budget(context_length: int, max_new_tokens: int) -> int:
    """The most prompt tokens allowed: the context less room for the answer (at most a quarter of the context)."""
    return context_length - min(max(max_new_tokens, 1), context_length // 4)


def build_prompt(
    tokenizer,
    messages: list[dict],
    context_length: int,
    max_new_tokens: int,
    raw: bool = False,
    overflow: str = "rolling",
) -> Prompt:
    """Token ids for `messages` (dicts with "role" and "content"; the last from the user).

    raw=True: the last user message only, tokenized as the tokenizer does by default (its special tokens, e.g.
    BOS, included), no template: plain completion. `overflow`: what a prompt too long for the context does.
    """
    return _build(tokenizer, messages, context_length, max_new_tokens, raw, overflow, [])


def _build(
    tokenizer, messages: list[dict], context_length: int, max_new_tokens: int, raw: bool, overflow: str, full: list[int]
) -> Prompt:
    """build_prompt; `full` gets the whole conversation's tokens once they are known (measure_prompt's figure)."""
    if overflow not in OVERFLOW_POLICIES:
        raise GenerationError(f"overflow policy must be one of {', '.join(OVERFLOW_POLICIES)}, got {overflow!r}")
    if context_length < 4:
        raise GenerationError(f"the model's context ({context_length} tokens) is too short for a prompt")
    msgs, notices = _clean(messages, raw)
    budget = prompt_budget(context_length, max_new_tokens)
    if raw:
        if overflow == "stop":
            _stop_if_over(len(tokenizer(msgs[-1]["content"])["input_ids"]), budget, context_length)
        return _fit_raw(tokenizer, msgs[-1]["content"], budget, context_length, notices)
    msgs = _typed(tokenizer, msgs)
    render = _renderer(tokenizer, msgs, notices)
    whole = render.size(msgs)  # counted once (or known from an earlier fitting of the same text)
    full.append(whole)
    if overflow == "stop":
        _stop_if_over(whole, budget, context_length)
        text, ids = render(msgs)
        return Prompt(ids, text, 0, notices)
    counts = functools.cache(lambda: _content_sizes(tokenizer, msgs))  # counted once for both policies' tries
    if overflow == "truncate-middle":
        return _fit_middle_or_rolling(tokenizer, render, counts, msgs, budget, context_length, notices)
    return _fit(tokenizer, render, counts, msgs, budget, context_length, notices)


def _fit_middle_or_rolling(
    tokenizer, render: _Renderer, counts: Counts, msgs: list[dict], budget: int, context: int, notices: list[str]
) -> Prompt:
    """Truncate-middle where it can keep the first message; else the rolling window, said in a notice. It cannot
    where the first message alone leaves no room (after the turn that answered it, cut, every later one was
    refused), or where the chat template wants the roles to alternate and the fewest cut would put the first and
    the last questions side by side."""
    tried = list(notices)
    try:
        return _fit_middle(tokenizer, render, counts, msgs, budget, context, tried)
    except GenerationError as exc:
        why = one_line(exc)
    try:
        prompt = _fit(tokenizer, render, counts, msgs, budget, context, notices)
    except GenerationError:  # the fewest kept (the system prompt, the last message) do not fit: that is the why
        raise
    prompt.notices.append(f"the first message could not be kept ({why}): the oldest messages were dropped instead")
    return prompt


def measure_prompt(
    tokenizer, messages: list[dict], context_length: int, max_new_tokens: int, overflow: str = "rolling"
) -> ContextUse:
    """What `messages` would take of the context. The last user message may be empty (nothing typed yet): it is
    counted as an empty turn, and nothing is fitted."""
    budget = prompt_budget(context_length, max_new_tokens)
    last = messages[-1] if messages else {}
    empty = isinstance(last, dict) and last.get("role") == "user" and not str(last.get("content", "")).strip()
    fitted, refused = None, ""
    counted: list[int] = []  # the whole conversation's tokens, where build_prompt counted them
    if not empty:
        try:
            fitted = _build(tokenizer, messages, context_length, max_new_tokens, False, overflow, counted)
        except GenerationError as exc:
            refused = str(exc)
    if counted:  # the same messages, cleaned and rendered the same way
        tokens = counted[0]
    else:
        clean, notices = _clean([*messages[:-1], {"role": "user", "content": "."}] if empty else messages)
        if empty:
            clean[-1]["content"] = ""
        clean = _typed(tokenizer, clean)
        tokens = _renderer(tokenizer, clean, notices).size(clean)
    if empty:
        return ContextUse(tokens, tokens if tokens <= budget else None, context_length, budget, overflow)
    return ContextUse(
        tokens,
        len(fitted.ids) if fitted else None,
        context_length,
        budget,
        overflow,
        cut=fitted.cut if fitted else "",
        refused=refused,
    )


def _stop_if_over(n: int, budget: int, context: int) -> None:
    if n > budget:
        raise GenerationError(
            f"the conversation takes {n:,} tokens, more than the {budget:,} the {context:,}-token context leaves "
            f"for it with room for an answer; nothing was dropped, as this chat's overflow policy is "
            f'"{OVERFLOW_LABELS["stop"]}": start a new chat, delete or shorten earlier messages, or choose '
            f"another overflow policy"
        )


def _cut(notices: list[str], context: int, what: str) -> str:
    notices.append(f"prompt cut to fit the {context}-token context: {what}")
    return what


# ---- validation ------------------------------------------------------------------------------------------


def _clean(messages: Any, raw: bool = False) -> tuple[list[dict], list[str]]:
    """The messages as the template takes them, and notices of what was changed. A chat's last message says
    something; a plain completion may continue from whitespace alone (a newline), as other servers allow."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise GenerationError("empty prompt: no messages")
    out, nuls, bad = [], 0, 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise GenerationError(f"message {i + 1} is not a {{role, content}} object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise GenerationError(f"message {i + 1}: role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise GenerationError(f"message {i + 1}: content must be text, got {type(content).__name__}")
        nuls += content.count("\x00")
        content = content.replace("\x00", "")
        # lone surrogates (from JSON such as "\ud83d") cannot be encoded for the tokenizer
        lone = sum(1 for ch in content if "\ud800" <= ch <= "\udfff")
        if lone:
            bad += lone
            content = content.encode("utf-8", "replace").decode("utf-8")
        if role == "system" and not content.strip():
            continue  # an empty system prompt: let the template's default apply
        out.append({"role": role, "content": content})
    if not out or out[-1]["role"] != "user":
        raise GenerationError("the last message must be from the user")
    if not (out[-1]["content"] if raw else out[-1]["content"].strip()):
        raise GenerationError("empty prompt")
    notices = []
    if nuls:
        notices.append(f"removed {nuls} NUL character{'s' if nuls > 1 else ''} from the prompt")
    if bad:
        notices.append(f"replaced {bad} invalid character{'s' if bad > 1 else ''} (lone surrogates) with '?'")
    return out, notices


# ---- rendering -------------------------------------------------------------------------------------------

Render = Callable[[list[dict]], tuple[str, list[int]]]
Counts = Callable[[], list[int]]  # each message's content tokens (_content_sizes), counted on the first call

# Token counts kept per tokenizer, by the digest of the text (and how it was tokenized): a long chat is fitted
# again at every send, regenerate and context-meter update, and each time it tokenized every message and the whole
# rendered chat anew. Bounded in entries (about 100 bytes each).
KNOWN_COUNTS = 1 << 16


class _TokenCounts:
    """The token counts of texts one tokenizer has tokenized (the most recent KNOWN_COUNTS)."""

    def __init__(self, vocab: int):
        self.vocab = vocab  # the tokenizer's size when counted: tokens added since make every count stale
        self.known: "OrderedDict[bytes, int]" = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: bytes) -> Optional[int]:
        with self.lock:
            n = self.known.get(key)
            if n is not None:
                self.known.move_to_end(key)
            return n

    def put(self, key: bytes, n: int) -> None:
        with self.lock:
            self.known[key] = n
            self.known.move_to_end(key)
            while len(self.known) > KNOWN_COUNTS:
                self.known.popitem(last=False)


_counts: "weakref.WeakKeyDictionary[Any, _TokenCounts]" = weakref.WeakKeyDictionary()
_counts_lock = threading.Lock()


def _counts_of(tokenizer) -> Optional[_TokenCounts]:
    """The token counts kept for `tokenizer`; None where it cannot be a key (nothing is kept then)."""
    try:
        vocab = len(tokenizer)
        with _counts_lock:
            counts = _counts.get(tokenizer)
            if counts is None or counts.vocab != vocab:
                counts = _counts[tokenizer] = _TokenCounts(vocab)
            return counts
    except TypeError:  # not weakly referenceable, or no len()
        return None


def _key(how: bytes, text: str) -> bytes:
    return hashlib.blake2b(how + text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _count(counts: Optional[_TokenCounts], how: bytes, text: str, tokenize: Callable[[str], list]) -> int:
    """len(tokenize(text)), known from an earlier count of the same text and tokenization where there was one."""
    key = _key(how, text) if counts is not None else b""
    n = counts.get(key) if counts is not None else None
    if n is None:
        n = len(tokenize(text))
        if counts is not None:
            counts.put(key, n)
    return n


BARE, PLAIN = b"bare\0", b"plain\0"  # the two tokenizations: without the special tokens it adds, with them


def _template_ids(tokenizer, text: str) -> list[int]:
    # the template writes the special tokens (BOS included) itself: adding them again would double them
    prompt_stop.check("the conversation was tokenized")  # a stop between passes (4 MB: about 5 s each)
    return _encode(tokenizer, text, add_special_tokens=False)


def _plain_ids(tokenizer, text: str) -> list[int]:
    prompt_stop.check("the conversation was tokenized")
    return _encode(tokenizer, text, add_special_tokens=True)


# ---- special tokens typed in a message -------------------------------------------------------------------
#
# A message that holds the text of one of the model's special tokens ("<|im_end|>", pasted from a page about chat
# formats or typed in a question) was tokenized as that token: the user's turn ended there and what followed read
# as the template's own turns (a system prompt, an answer begun), the model's chat format in the user's hands. The
# messages are given to the template with each such text replaced by a mark (_typed); the rendered chat is
# tokenized with the marks put back as the text they stand for, and a special token found exactly where a mark
# was is replaced by that text's tokens as plain text. Every other token is the tokenizer's own, as before; only
# special tokens (not other added tokens, such as a reasoning model's <think>) are read so.

MARK_OPEN, MARK_CLOSE = "\ufdd0", "\ufdd1"  # Unicode noncharacters: for a program's own use
# a mark (the number of the text it stands for between the two), or a mark character alone (a stray one)
_MARK_OR_STRAY = re.compile(f"{MARK_OPEN}([0-9]+){MARK_CLOSE}|[{MARK_OPEN}{MARK_CLOSE}]")


class _Specials:
    """The texts a message's marks stand for: the tokenizer's special tokens' (longest first), then the mark
    characters themselves (a message may hold them: they are marked too, so no message makes a mark); a pattern
    that finds them; and a copy of the tokenizer that reads special tokens' texts as plain text."""

    def __init__(self, backend: Any):
        added = backend.get_added_tokens_decoder().items() if backend is not None else ()
        special = {n: a.content for n, a in added if a.special and a.content}
        self.ids = frozenset(special)
        self.by_text = {text: n for n, text in special.items()}
        self.texts: tuple[str, ...] = (
            *sorted(set(special.values()) - {MARK_OPEN, MARK_CLOSE}, key=len, reverse=True),
            MARK_OPEN,
            MARK_CLOSE,
        )
        self.index = {text: n for n, text in enumerate(self.texts)}
        self.pattern = re.compile("|".join(map(re.escape, self.texts)))
        self.by_id = special
        self.backend = backend
        self._reader: Any = None
        self._as_text: Any = None
        self._alone_after_special = True
        self._lock = threading.Lock()

    def as_text(self, text: str, special: str = "") -> list[int]:
        """The tokens of `text` where the tokenizer reads it as plain text, special tokens' texts included, after
        the `special` token (the template's, "" at the start of the text)."""
        reader = self.reader()
        with self._lock:
            if self._as_text is None:
                self._as_text = _whole_reader(self.backend)
                self._as_text.encode_special_tokens = True
                # how the tokenizer reads the text right after a special token: as a text of its own (a space put
                # before it, as SentencePiece's older tokenizers do) or as the text it goes on (Metaspace's
                # "first" scheme puts one at the start of the whole text only)
                probe = self.texts[0]
                after = reader.encode_batch([probe + "a"], add_special_tokens=False)[0].ids
                alone = self._as_text.encode_batch(["a"], add_special_tokens=False)[0].ids
                self._alone_after_special = after[1:] == alone
            as_text = self._as_text
            alone_after_special = self._alone_after_special

        def encode(*texts: str) -> list[list[int]]:  # encode_batch lets go of the GIL (the window's thread runs)
            return [e.ids for e in as_text.encode_batch(list(texts), add_special_tokens=False)]

        if not special or alone_after_special:
            return encode(text)[0]
        # read as the text a special token's text goes on, as the template's token is read (where the two merge
        # at the seam, alone)
        head, whole = encode(special, special + text)
        return whole[len(head) :] if whole[: len(head)] == head else encode(text)[0]

    def reader(self) -> Any:
        """A copy of the tokenizer that reads a text whole: the tokenizer's file may ask for truncation or padding
        (a fine-tune's tokenizer.json saved with them on), which transformers turns off only inside its own calls;
        read with them, a prompt holding a typed special token was cut to the truncation's length, unsaid."""
        with self._lock:
            if self._reader is None:
                self._reader = _whole_reader(self.backend)
            return self._reader


def _whole_reader(backend: Any) -> Any:
    """A copy of `backend` without truncation and padding."""
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


_specials_of: "weakref.WeakKeyDictionary[Any, _Specials]" = weakref.WeakKeyDictionary()


def _specials(tokenizer) -> _Specials:
    """The special tokens' texts of `tokenizer` (none where it has no `tokenizers` backend to read them from)."""
    try:
        with _counts_lock:
            found = _specials_of.get(tokenizer)
            if found is None:
                found = _specials_of[tokenizer] = _Specials(backend_of(tokenizer))
            return found
    except TypeError:  # not weakly referenceable
        return _Specials(backend_of(tokenizer))


def special_ids(tokenizer, texts: tuple[str, ...]) -> frozenset[int]:
    """The ids of the special tokens whose text is one of `texts` (a stop string such as "<|im_start|>")."""
    by_text = _specials(tokenizer).by_text
    return frozenset(by_text[t] for t in texts if t in by_text)


def special_token_ids(tokenizer) -> frozenset[int]:
    """The ids of the tokenizer's special tokens (those a decode that skips them leaves out)."""
    return _specials(tokenizer).ids


def backend_of(tokenizer) -> Any:
    """The `tokenizers.Tokenizer` under an engine.fast_tokenizer.FastTokenizer or a transformers fast tokenizer,
    or `tokenizer` where it is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tok", None) or tokenizer
    return backend if hasattr(backend, "get_added_tokens_decoder") and hasattr(backend, "encode_batch") else None


def _typed(tokenizer, msgs: list[dict]) -> list[dict]:
    """`msgs` with the text of each special token in a message replaced by its mark (the chat template's own
    special tokens are then the prompt's only ones)."""
    return [dict(m, content=_marked(tokenizer, m["content"])) for m in msgs]


def _marked(tokenizer, text: str) -> str:
    """`text` with the text of each special token, and each mark character, replaced by its mark."""
    specials = _specials(tokenizer)
    if not specials.pattern.search(text):
        return text
    return specials.pattern.sub(lambda m: f"{MARK_OPEN}{specials.index[m.group(0)]}{MARK_CLOSE}", text)


def _unmarked(tokenizer, text: str) -> str:
    """`text` with its marks (_typed) as the texts they stand for."""
    return text if MARK_OPEN not in text else _read_marks(_specials(tokenizer), text)[0]


def _read_marks(specials: _Specials, text: str) -> tuple[str, list[tuple[int, int]]]:
    """`text` with its marks as the texts they stand for (a stray mark character, left by a template that cut a
    mark, dropped), and where in it each special token's text typed in a message stands, in order."""
    pieces: list[str] = []
    typed: list[tuple[int, int]] = []
    at = last = 0
    for m in _MARK_OR_STRAY.finditer(text):  # one pass: a mark character a mark stands for is not a stray one
        said = specials.texts[int(m.group(1))] if m.group(1) else ""
        before = text[last : m.start()]
        at += len(before)
        if said and said not in (MARK_OPEN, MARK_CLOSE):  # a mark character is text as it is: no token to read
            typed.append((at, at + len(said)))
        at += len(said)
        pieces += [before, said]
        last = m.end()
    pieces.append(text[last:])
    return "".join(pieces), typed


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """The tokenizer's ids of `text`, where a mark (_typed) reads its special token's text as plain text.

    The text is tokenized as it is (the marks as the texts they stand for); the text between two special tokens
    the template wrote that holds a typed one is then read again, whole and plainly. The tokenizer reads the text
    between two special tokens as a text of its own: a SentencePiece tokenizer puts a space before each, so a
    typed "</s>" read alone gained a space before it and the text after it another; and the text before a typed
    one, kept as the first reading split it, kept a space the next text then read again ("does  </s>"), or a
    split the tokenizer never makes of that text (" <|" as " " and "<|"). A special token that takes in the white space beside it (Phi-3's <|end|>, stripped
    on its right) is a typed one where its place holds a typed text."""
    specials = _specials(tokenizer) if MARK_OPEN in text else None
    if specials is None or specials.backend is None:
        return list(tokenizer(_unmarked(tokenizer, text), add_special_tokens=add_special_tokens)["input_ids"])
    plain, typed = _read_marks(specials, text)
    encoding = specials.reader().encode_batch([plain], add_special_tokens=add_special_tokens)[0]
    tokens, spans = encoding.ids, encoding.offsets
    starts = [a for a, _ in typed]

    def typed_at(n: int) -> bool:  # a special token where a message's typed text stands
        a, b = spans[n]
        i = bisect.bisect_left(starts, a)
        return i < len(typed) and typed[i][1] <= b

    def added(n: int) -> bool:  # one the tokenizer put before or after the text (a BOS, an EOS after it)
        return spans[n] == (0, 0)

    # Only the special tokens are looked at (a 4 MB message is a million tokens). The text read again is bounded
    # by the template's special tokens and those the tokenizer adds, not by one made of the text (an <unk>).
    special_at = [n for n, t in enumerate(tokens) if t in specials.ids]
    typed_ones = [n for n in special_at if typed_at(n)]
    bounds = [
        n
        for n in special_at
        if not typed_at(n) and (added(n) or specials.by_id[tokens[n]] in plain[spans[n][0] : spans[n][1]])
    ]
    ids: list[int] = []
    done = 0  # tokens[:done] are placed
    for n in typed_ones:
        if n < done:
            continue  # read again with the typed text before it
        k = bisect.bisect_left(bounds, n)  # the bounds around the typed one
        last, end = bounds[k - 1] if k else -1, bounds[k] if k < len(bounds) else len(tokens)
        start = spans[last][1] if last >= 0 else 0
        stop = spans[end][0] if end < len(tokens) and not added(end) else len(plain)  # one added after: the end
        ids += tokens[done : last + 1]
        ids += specials.as_text(plain[start:stop], plain[slice(*spans[last])] if last >= 0 and start > 0 else "")
        done = end
    ids += tokens[done:]
    return ids


class _Renderer:
    """The render for `msgs` and the cuts of them: render(ms) -> (text, ids). `msgs` itself (the same list) is
    rendered once, as every policy starts with the whole conversation, and its tokens are counted (size) without
    tokenizing it where the same text was counted before; its ids are made only where asked for (a prompt that
    fits)."""

    def __init__(
        self, tokenizer, msgs: list[dict], text: str, render: Render, tokenize: Callable[[str], list[int]], how: bytes
    ):
        self.tokenizer, self.msgs, self.msgs_text = tokenizer, msgs, text
        self.render, self.tokenize, self.how = render, tokenize, how
        self.whole: Optional[tuple[str, list[int]]] = None
        self.whole_size: Optional[int] = None

    def __call__(self, ms: list[dict]) -> tuple[str, list[int]]:
        if ms is not self.msgs:
            return self.render(ms)
        if self.whole is None:
            self.whole = (_unmarked(self.tokenizer, self.msgs_text), self.tokenize(self.msgs_text))
            self.whole_size = len(self.whole[1])
        return self.whole

    def size(self, ms: list[dict]) -> int:
        """len(self(ms)[1])."""
        if ms is not self.msgs:
            return len(self.render(ms)[1])
        if self.whole_size is None:
            counts = _counts_of(self.tokenizer)
            self.whole_size = _count(counts, self.how, self.msgs_text, lambda t: self(ms)[1])
        return self.whole_size


def _renderer(tokenizer, msgs: list[dict], notices: list[str]) -> _Renderer:
    """The render for `msgs` and the cuts of them (_Renderer)."""
    render, text, tokenize, how = _render(tokenizer, msgs, notices)
    return _Renderer(tokenizer, msgs, text, render, tokenize, how)


def _render(tokenizer, msgs: list[dict], notices: list[str]) -> tuple[Render, str, Callable[[str], list[int]], bytes]:
    """The render of `msgs`: the chat template, merging the system prompt where the template has no system role,
    or the plain format; and the text of `msgs` itself, how it is tokenized, and a name for that tokenization.
    The template is tried on `msgs` (its text only: tokenized where needed)."""
    if not getattr(tokenizer, "chat_template", None):

        def plain_text(ms: list[dict]) -> str:
            return "\n\n".join(f"{FALLBACK_LABELS[m['role']]}: {m['content']}" for m in ms) + "\n\nAssistant:"

        def plain(ms: list[dict]) -> tuple[str, list[int]]:
            text = plain_text(ms)
            return _unmarked(tokenizer, text), _plain_ids(tokenizer, text)

        return plain, plain_text(msgs), functools.partial(_plain_ids, tokenizer), PLAIN

    import jinja2

    from engine.template_bounds import bounded_render

    def raw_text(ms: list[dict]) -> str:
        return bounded_render(lambda: tokenizer.apply_chat_template(ms, add_generation_prompt=True, tokenize=False))

    def template(ms: list[dict]) -> tuple[str, list[int]]:
        try:  # a cut conversation can break a rule the whole one kept (roles that must alternate)
            text = raw_text(ms)
        except jinja2.TemplateError as exc:
            raise GenerationError(f"the model's chat template failed: {exc}") from exc
        return _unmarked(tokenizer, text), _template_ids(tokenizer, text)

    tokenize = functools.partial(_template_ids, tokenizer)
    try:
        return template, raw_text(msgs), tokenize, BARE
    except jinja2.TemplateError as exc:
        if not any(m["role"] == "system" for m in msgs):
            raise GenerationError(f"the model's chat template failed: {exc}") from exc
        first_error = exc

    def merged(ms: list[dict]) -> tuple[str, list[int]]:
        return template(_merge_system(ms))

    try:  # templates without a system role (Gemma, early Mistral) raise on one
        text = raw_text(_merge_system(msgs))
    except jinja2.TemplateError as exc:
        raise GenerationError(f"the model's chat template failed: {first_error}") from exc
    notices.append(
        "this model's chat template has no system role: the system prompt was put before the first user message"
    )
    return merged, text, tokenize, BARE


def _merge_system(ms: list[dict]) -> list[dict]:
    system = "\n\n".join(m["content"] for m in ms if m["role"] == "system")
    rest = [dict(m) for m in ms if m["role"] != "system"]
    if system:
        first_user = next(i for i, m in enumerate(rest) if m["role"] == "user")
        rest[first_user]["content"] = f"{system}\n\n{rest[first_user]['content']}"
    return rest


# ---- fitting ---------------------------------------------------------------------------------------------


def _keep(msgs: list[dict], drop: int) -> tuple[list[dict], int]:
    """`msgs` without its `drop` oldest non-system messages (and an assistant reply left leading). -> (kept, dropped)"""
    history = [i for i, m in enumerate(msgs[:-1]) if m["role"] != "system"]
    gone = set(history[:drop])
    for i in history[drop:]:
        if msgs[i]["role"] != "assistant":
            break
        gone.add(i)
    return [m for i, m in enumerate(msgs) if i not in gone], len(gone)


Dropped = TypeVar("Dropped")


def _fewest_dropped(
    render: Render,
    budget: int,
    units: int,
    kept_after: Callable[[int], tuple[list[dict], Dropped]],
    too_long: int = 0,
) -> Optional[tuple[str, list[int], Dropped]]:
    """The prompt with the fewest of `units` dropped (fewer dropped -> longer prompt) that fits `budget`, found by
    bisection: (text, ids, what kept_after(k) says was dropped), or None when all of them dropped is still too long.
    kept_after(k) -> (the messages kept with k units dropped, what was dropped). Cuts of `too_long` units or fewer
    are known not to fit (_too_long): the bisection takes the same steps, without rendering them."""
    lo, hi, best = 1, units, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if mid <= too_long:
            lo = mid + 1
            continue
        kept, dropped = kept_after(mid)
        text, ids = render(kept)
        if len(ids) <= budget:
            best, hi = (text, ids, dropped), mid - 1
        else:
            lo = mid + 1
    return best


# A cut drops history in steps of about this share of the prompt budget (see _sticky).
CUT_STEP_SHARE = 4


def _sticky(fewest: int, sizes: list[int], step: int) -> int:
    """How many of the oldest units (messages, turns) of `sizes` tokens to drop when at least `fewest` must go:
    rounded up to where the tokens dropped reach the next multiple of `step`. Until the conversation grows past
    that mark, every turn drops the same units, so each prompt starts as the one before it did and the engine
    reads the earlier turns from its prefix cache; dropping only the fewest moved the cut by a message or two
    every turn and had the whole conversation read again for each answer."""
    marks = list(itertools.accumulate(sizes))  # marks[k - 1]: the tokens of the k oldest units
    step = max(1, step)
    mark = -(-marks[fewest - 1] // step) * step
    return next((k for k in range(fewest, len(sizes) + 1) if marks[k - 1] >= mark), fewest)


def _content_sizes(tokenizer, msgs: list[dict]) -> list[int]:
    """Each message's content tokens (a message counted before, in this chat or another, is not tokenized again)."""
    counts = _counts_of(tokenizer)
    tokenize = functools.partial(_template_ids, tokenizer)
    return [_count(counts, BARE, m["content"], tokenize) for m in msgs]


def _sizes(content: list[int], units: list[list[int]], rendered: int) -> list[int]:
    """Each unit's tokens in a prompt: its messages' `content` tokens (_content_sizes) and the template's tokens
    around each message (the `rendered` prompt's tokens beyond all content, shared out per message)."""
    framing = max(0, (rendered - sum(content)) // len(content))
    return [sum(content[i] + framing for i in u) for u in units]


# _too_long's tries: a cut estimated to leave about this many budgets' worth of the conversation, rendered to
# show that every cut of fewer units is too long; and the margin over the budget that rendered prompt must have.
TOO_LONG_BUDGETS = (2, 8, 32)
TOO_LONG_MARGIN_SHARE = 4


def _too_long(
    render: Render, budget: int, whole: int, sizes: Callable[[], list[int]], kept: Callable[[int], list[dict]]
) -> int:
    """How many of the oldest units (in the order they are dropped) _fewest_dropped may take as too few to drop
    without rendering the prompts: the most whose cut is shown too long by rendering it, 0 where none is.

    Every cut of fewer units keeps all that one keeps and more messages, so its prompt is longer still; that one's
    is rendered and must pass the budget by a margin (a quarter of it), for the tokenizer to merge differently
    where messages meet. The cut tried is the most units whose dropping leaves an estimated two budgets (then 8,
    32, where the estimate was far off): the whole prompt's tokens (`whole`) less the dropped units' sizes(). The
    bisection then renders only prompts of a few budgets: it cost the chat's whole length for each of its steps,
    rendering and tokenizing cuts that could never fit (8,000 messages took 6 to 16 s on two cores, every send
    and context-meter update). kept(k): the messages kept with k units dropped."""
    if whole < TOO_LONG_BUDGETS[0] * budget:
        return 0  # the bisection renders a few budgets at most anyway
    marks = list(itertools.accumulate(sizes()))
    tried = len(marks) + 1
    for times in TOO_LONG_BUDGETS:
        k = bisect.bisect_right(marks, whole - times * budget)  # marks[k - 1]: the tokens of the k oldest units
        if k < 1:
            return 0
        if k >= tried:
            continue
        tried = k
        try:
            _, ids = render(kept(k))
        except PromptStopped:
            raise
        except Exception:  # a render that fails proves nothing: the bisection renders every cut, as it always did
            return 0
        if len(ids) > budget + budget // TOO_LONG_MARGIN_SHARE:
            return k
    return 0


def _fit(
    tokenizer, render: _Renderer, counts: Counts, msgs: list[dict], budget: int, context: int, notices: list[str]
) -> Prompt:
    whole = render.size(msgs)
    if whole <= budget:
        text, ids = render(msgs)
        return Prompt(ids, text, 0, notices)
    history = [i for i, m in enumerate(msgs[:-1]) if m["role"] != "system"]
    sizes = functools.cache(lambda: _sizes(counts(), [[i] for i in history], whole))
    too_long = _too_long(render, budget, whole, sizes, lambda k: _keep(msgs, k)[0])
    best = _fewest_dropped(render, budget, len(history), lambda k: (_keep(msgs, k)[0], k), too_long)
    if best is not None:
        k = _sticky(best[2], sizes(), budget // CUT_STEP_SHARE)
        # The rounding never takes the newest exchange the fewest cut keeps: with long turns it dropped the whole
        # conversation (the last answer went with its question) to keep a cut that moved every turn anyway.
        newest = max((n for n, i in enumerate(history) if msgs[i]["role"] == "user"), default=0)
        k = max(best[2], min(k, newest))
        kept, dropped = _keep(msgs, k)
        t, i = render(kept) if k > best[2] else best[:2]
        what = _cut(notices, context, f"{_plural(dropped, 'oldest message')} dropped")
        return Prompt(i, t, dropped, notices, what)
    kept, dropped = _keep(msgs, len(history))
    return _cut_last(tokenizer, render, kept, dropped, budget, context, notices)


def _cut_last(
    tokenizer,
    render: Render,
    kept: list[dict],
    dropped: int,
    budget: int,
    context: int,
    notices: list[str],
    dropped_what: str = "",
    kept_what: str = "",
) -> Prompt:
    """Keep the tail of the last user message so that the prompt fits."""
    head = kept[:-1]
    system = any(m.get("role") == "system" for m in head)
    kept_what = kept_what or ("the system prompt and chat format" if system else "the chat format")
    _, frame = render([*head, {"role": "user", "content": ""}])
    room = budget - len(frame)
    if room < 1:
        raise GenerationError(
            f"{kept_what} {'take' if ' and ' in kept_what else 'takes'} {len(frame)} tokens, leaving no room for the "
            f"message in the {context}-token context"
        )
    content_ids = _template_ids(tokenizer, kept[-1]["content"])
    for _ in range(8):  # re-tokenizing a cut text can merge differently at the cut: shrink until it fits
        tail = _marked(tokenizer, tokenizer.decode(content_ids[-room:]).lstrip("\ufffd"))
        text, ids = render([*head, {"role": "user", "content": tail}])
        if len(ids) <= budget:
            # what the prompt holds of it: a character cut in half at the start is dropped from the tail (214 of
            # 216 tokens of Japanese text were said to be 216)
            held = len(ids) - len(frame)
            what = f"the last message was cut to its last {held if 0 < held <= room else room} tokens"
            if dropped:
                what = f"{dropped_what or _plural(dropped, 'oldest message') + ' dropped'} and {what}"
            _cut(notices, context, what)
            return Prompt(ids, text, dropped, notices, what)
        room -= max(len(ids) - budget, 1)
        if room < 1:
            break
    raise GenerationError(f"the message cannot be cut to fit the {context}-token context")


def _fit_middle(
    tokenizer, render: _Renderer, counts: Counts, msgs: list[dict], budget: int, context: int, notices: list[str]
) -> Prompt:
    """Drop whole turns between the first user message and the last one, oldest first, then the first
    question's answers; the system prompt and the first and last user messages stay."""
    whole = render.size(msgs)
    if whole <= budget:
        text, ids = render(msgs)
        return Prompt(ids, text, 0, notices)
    convo = [i for i, m in enumerate(msgs) if m["role"] != "system"]  # the chat's numbering: 1 = convo[0]
    first = next(i for i in convo if msgs[i]["role"] == "user")
    middle = [i for i in convo if first < i < len(msgs) - 1]
    units: list[list[int]] = []  # turns: a user message and the answers after it
    for i in middle:
        if msgs[i]["role"] == "user" or not units:
            units.append([i])
        else:
            units[-1].append(i)
    answers_last = bool(units) and msgs[units[0][0]]["role"] == "assistant"
    if answers_last:  # the first question's answers go last
        units = units[1:] + units[:1]

    def kept_after(k: int) -> tuple[list[dict], list[int]]:
        gone = sorted(i for u in units[:k] for i in u)
        out = set(gone)
        return [m for i, m in enumerate(msgs) if i not in out], gone

    sizes = functools.cache(lambda: _sizes(counts(), units, whole))
    too_long = _too_long(render, budget, whole, sizes, lambda k: kept_after(k)[0])
    best = _fewest_dropped(render, budget, len(units), lambda k: (kept_after(k)[0], k), too_long)
    if best is not None:
        k = _sticky(best[2], sizes(), budget // CUT_STEP_SHARE)
        if answers_last:  # rounding up never takes the first answers the fewest cut keeps (two questions in a row)
            k = max(best[2], min(k, len(units) - 1))
        kept, gone = kept_after(k)
        t, fitted = render(kept) if k > best[2] else best[:2]
        what = _cut(notices, context, _middle_what(gone, convo, msgs))
        return Prompt(fitted, t, len(gone), notices, what)
    kept, gone = kept_after(len(units))
    return _cut_last(
        tokenizer,
        render,
        kept,
        len(gone),
        budget,
        context,
        notices,
        dropped_what=_middle_what(gone, convo, msgs) if gone else "",
        kept_what=("the system prompt, the " if any(m["role"] == "system" for m in msgs) else "the ")
        + "first message and the chat format",
    )


def _middle_what(gone: list[int], convo: list[int], msgs: list[dict]) -> str:
    number = {i: n for n, i in enumerate(convo, 1)}
    numbers = [number[i] for i in gone]
    span = f"message {numbers[0]}" if len(numbers) == 1 else f"messages {numbers[0]}–{numbers[-1]}"
    kept = (
        "the system prompt and the first message" if any(m["role"] == "system" for m in msgs) else "the first message"
    )
    return f"{_plural(len(gone), 'message')} from the middle dropped ({span} of {len(convo)}; {kept} kept)"


def _fit_raw(tokenizer, content: str, budget: int, context: int, notices: list[str]) -> Prompt:
    ids = list(tokenizer(content)["input_ids"])
    if not ids:  # a tokenizer without BOS may make nothing of whitespace
        raise GenerationError("empty prompt: it makes no tokens")
    if len(ids) <= budget:
        return Prompt(ids, content, 0, notices)
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    lead = 0
    while lead < len(ids) and ids[lead] in specials:  # keep the tokenizer's own prefix (BOS)
        lead += 1
    kept = ids[:lead] + ids[len(ids) - (budget - lead) :]
    text = tokenizer.decode(kept[lead:]).lstrip("\ufffd")
    what = _cut(notices, context, f"kept its last {budget - lead} tokens")
    return Prompt(kept, text, 0, notices, what)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"
