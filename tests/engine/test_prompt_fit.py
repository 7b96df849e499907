"""The cut of a long conversation (engine.prompt's rolling and truncate-middle fitting) is the same, token for
token and notice for notice, as the fitting it replaced: that rendered and tokenized the whole remaining
conversation on every step of its bisection (seconds for a chat of thousands of messages, on every send and
context-meter update). The old fitting is kept here, verbatim, as the reference; random conversations of every
shape are fitted by both."""

from __future__ import annotations

import random
import re
from typing import Callable, Optional, TypeVar

import pytest
from tiny_models import CHATML, make_tokenizer

import engine.prompt as prompt
from engine.errors import GenerationError, one_line
from engine.prompt import (
    CUT_STEP_SHARE,
    FALLBACK_LABELS,
    Prompt,
    Render,
    _clean,
    _cut,
    _cut_last,
    _fit_raw,
    _keep,
    _merge_system,
    _plural,
    _sticky,
    _stop_if_over,
    prompt_budget,
)
from engine.types import OVERFLOW_POLICIES, ContextUse

# ---- the reference: engine/prompt.py's fitting before it skipped the cuts that cannot fit (verbatim) ---------

Dropped = TypeVar("Dropped")


def old_build_prompt(
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
    render = _renderer(tokenizer, msgs, notices)
    if overflow == "stop":
        text, ids = render(msgs)
        _stop_if_over(len(ids), budget, context_length)
        return Prompt(ids, text, 0, notices)
    if overflow == "truncate-middle":
        return _fit_middle_or_rolling(tokenizer, render, msgs, budget, context_length, notices)
    return _fit(tokenizer, render, msgs, budget, context_length, notices)


def _fit_middle_or_rolling(
    tokenizer, render: Render, msgs: list[dict], budget: int, context: int, notices: list[str]
) -> Prompt:
    """Truncate-middle where it can keep the first message; else the rolling window, said in a notice. It cannot
    where the first message alone leaves no room (after the turn that answered it, cut, every later one was
    refused), or where the chat template wants the roles to alternate and the fewest cut would put the first and
    the last questions side by side."""
    tried = list(notices)
    try:
        return _fit_middle(tokenizer, render, msgs, budget, context, tried)
    except GenerationError as exc:
        why = one_line(exc)
    try:
        prompt = _fit(tokenizer, render, msgs, budget, context, notices)
    except GenerationError:  # the fewest kept (the system prompt, the last message) do not fit: that is the why
        raise
    prompt.notices.append(f"the first message could not be kept ({why}): the oldest messages were dropped instead")
    return prompt


def old_measure_prompt(
    tokenizer, messages: list[dict], context_length: int, max_new_tokens: int, overflow: str = "rolling"
) -> ContextUse:
    """What `messages` would take of the context. The last user message may be empty (nothing typed yet): it is
    counted as an empty turn, and nothing is fitted."""
    budget = prompt_budget(context_length, max_new_tokens)
    last = messages[-1] if messages else {}
    empty = isinstance(last, dict) and last.get("role") == "user" and not str(last.get("content", "")).strip()
    fitted, refused = None, ""
    if not empty:
        try:
            fitted = old_build_prompt(tokenizer, messages, context_length, max_new_tokens, overflow=overflow)
        except GenerationError as exc:
            refused = str(exc)
    clean, notices = _clean([*messages[:-1], {"role": "user", "content": "."}] if empty else messages)
    if empty:
        clean[-1]["content"] = ""
    _, full = _renderer(tokenizer, clean, notices)(clean)
    if empty:
        return ContextUse(len(full), len(full) if len(full) <= budget else None, context_length, budget, overflow)
    return ContextUse(
        len(full),
        len(fitted.ids) if fitted else None,
        context_length,
        budget,
        overflow,
        cut=fitted.cut if fitted else "",
        refused=refused,
    )


def _renderer(tokenizer, msgs: list[dict], notices: list[str]) -> Render:
    if not getattr(tokenizer, "chat_template", None):

        def plain(ms: list[dict]) -> tuple[str, list[int]]:
            text = "\n\n".join(f"{FALLBACK_LABELS[m['role']]}: {m['content']}" for m in ms) + "\n\nAssistant:"
            return text, list(tokenizer(text)["input_ids"])

        return plain

    import jinja2

    def raw(ms: list[dict]) -> tuple[str, list[int]]:
        text = tokenizer.apply_chat_template(ms, add_generation_prompt=True, tokenize=False)
        # the template writes the special tokens (BOS included) itself: adding them again would double them
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def template(ms: list[dict]) -> tuple[str, list[int]]:
        try:  # a cut conversation can break a rule the whole one kept (roles that must alternate)
            return raw(ms)
        except jinja2.TemplateError as exc:
            raise GenerationError(f"the model's chat template failed: {exc}") from exc

    try:
        raw(msgs)
        return template
    except jinja2.TemplateError as exc:
        if not any(m["role"] == "system" for m in msgs):
            raise GenerationError(f"the model's chat template failed: {exc}") from exc
        first_error = exc

    def merged(ms: list[dict]) -> tuple[str, list[int]]:
        return template(_merge_system(ms))

    try:  # templates without a system role (Gemma, early Mistral) raise on one
        raw(_merge_system(msgs))
    except jinja2.TemplateError as exc:
        raise GenerationError(f"the model's chat template failed: {first_error}") from exc
    notices.append(
        "this model's chat template has no system role: the system prompt was put before the first user message"
    )
    return merged


def _fewest_dropped(
    render: Render, budget: int, units: int, kept_after: Callable[[int], tuple[list[dict], Dropped]]
) -> Optional[tuple[str, list[int], Dropped]]:
    """The prompt with the fewest of `units` dropped (fewer dropped -> longer prompt) that fits `budget`, found by
    bisection: (text, ids, what kept_after(k) says was dropped), or None when all of them dropped is still too long.
    kept_after(k) -> (the messages kept with k units dropped, what was dropped)."""
    lo, hi, best = 1, units, None
    while lo <= hi:
        mid = (lo + hi) // 2
        kept, dropped = kept_after(mid)
        text, ids = render(kept)
        if len(ids) <= budget:
            best, hi = (text, ids, dropped), mid - 1
        else:
            lo = mid + 1
    return best


def _sizes(tokenizer, msgs: list[dict], units: list[list[int]], rendered: int) -> list[int]:
    """Each unit's tokens in a prompt: its messages' content and the template's tokens around each message (the
    `rendered` prompt's tokens beyond all content, shared out per message)."""
    content = [len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in msgs]
    framing = max(0, (rendered - sum(content)) // len(msgs))
    return [sum(content[i] + framing for i in u) for u in units]


def _fit(tokenizer, render: Render, msgs: list[dict], budget: int, context: int, notices: list[str]) -> Prompt:
    text, ids = render(msgs)
    if len(ids) <= budget:
        return Prompt(ids, text, 0, notices)
    history = [i for i, m in enumerate(msgs[:-1]) if m["role"] != "system"]
    best = _fewest_dropped(render, budget, len(history), lambda k: (_keep(msgs, k)[0], k))
    if best is not None:
        k = _sticky(best[2], _sizes(tokenizer, msgs, [[i] for i in history], len(ids)), budget // CUT_STEP_SHARE)
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


def _fit_middle(tokenizer, render: Render, msgs: list[dict], budget: int, context: int, notices: list[str]) -> Prompt:
    """Drop whole turns between the first user message and the last one, oldest first, then the first
    question's answers; the system prompt and the first and last user messages stay."""
    text, ids = render(msgs)
    if len(ids) <= budget:
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
        return [m for i, m in enumerate(msgs) if i not in set(gone)], gone

    best = _fewest_dropped(render, budget, len(units), lambda k: (kept_after(k)[0], k))
    if best is not None:
        k = _sticky(best[2], _sizes(tokenizer, msgs, units, len(ids)), budget // CUT_STEP_SHARE)
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
        # without a system prompt the refusal does not name one
        kept_what=("the system prompt, the " if any(m["role"] == "system" for m in msgs) else "the ")
        + "first message and the chat format",
    )


def _middle_what(gone: list[int], convo: list[int], msgs: list[dict]) -> str:
    numbers = [convo.index(i) + 1 for i in gone]
    span = f"message {numbers[0]}" if len(numbers) == 1 else f"messages {numbers[0]}–{numbers[-1]}"
    kept = (
        "the system prompt and the first message" if any(m["role"] == "system" for m in msgs) else "the first message"
    )
    return f"{_plural(len(gone), 'message')} from the middle dropped ({span} of {len(convo)}; {kept} kept)"


# ---- the comparison ------------------------------------------------------------------------------------------

NO_SYSTEM = (  # a template without a system role: the system prompt is merged into the first question
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ALTERNATING = (  # as Gemma's template: a user and a model turn in turn, or an error
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "<start_of_turn>{{ message['role'] }}\n{{ message['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
SHORT_ANSWERS = (  # renders far fewer tokens than the answers hold (as templates that leave out old reasoning)
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{{ message['content'][:12] }}{% else %}{{ message['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATES = {
    "chatml": CHATML,
    "plain": None,
    "no-system": NO_SYSTEM,
    "alternating": ALTERNATING,
    "short": SHORT_ANSWERS,
}

WORDS = (
    "hello world the quick brown fox jumps over lazy dog Paris is capital of France. Tokens per second, kernel "
    "gap graphs def main(): return 42 # code é 中文 🙂 ١٢٣ x"
).split()


@pytest.fixture(scope="module")
def tokenizers():
    out = {}
    for name, template in TEMPLATES.items():
        tok = make_tokenizer()
        tok.chat_template = template
        out[name] = tok
    return out


def _text(rng: random.Random, size: int) -> str:
    words = rng.choices(WORDS, k=size)
    if rng.random() < 0.2:
        words = [w + ("\n" if rng.random() < 0.1 else "") for w in words]
    return (" " if rng.random() < 0.1 else "").join(words)


def _size(rng: random.Random) -> int:
    roll = rng.random()
    return rng.randint(0, 3) if roll < 0.15 else rng.randint(100, 400) if roll > 0.97 else rng.randint(2, 30)


def _conversation(rng: random.Random, template: str) -> list[dict]:
    n = rng.choice([1, 2, 3, 5, 9, 20, 40]) if rng.random() < 0.9 else rng.randint(60, 150)
    alternate = template == "alternating" and rng.random() < 0.9
    msgs = []
    roll = rng.random()
    if roll < 0.6:
        msgs.append({"role": "system", "content": _text(rng, rng.choice([3, 10, 40]))})
    elif roll < 0.65:
        msgs.append({"role": "system", "content": _text(rng, rng.randint(150, 400))})
    elif roll < 0.7:
        msgs.append({"role": "system", "content": "  "})  # left out: the template's default applies
    role = "user" if alternate or rng.random() < 0.9 else "assistant"
    for _ in range(n - 1):
        msgs.append({"role": role, "content": _text(rng, _size(rng))})
        role = {"user": "assistant", "assistant": "user", "system": "user"}[role]
        if not alternate and rng.random() < 0.1:
            role = rng.choice(["user", "assistant", "system"])
    if msgs and msgs[-1]["role"] == "user" and alternate:
        msgs.append({"role": "assistant", "content": _text(rng, _size(rng))})
    msgs.append({"role": "user", "content": _text(rng, max(1, _size(rng)))})
    return msgs


def _outcome(fit: Callable[..., Prompt], *args, **kwargs) -> tuple:
    try:
        p = fit(*args, **kwargs)
    except GenerationError as exc:
        return ("refused", str(exc))
    return (p.ids, p.text, p.dropped_messages, p.notices, p.cut)


def _contexts(rng: random.Random, tok, msgs: list[dict]) -> list[tuple[int, int]]:
    """(context, max_new_tokens): where all fits, where a share fits, where about the last message alone fits, and
    where not even it does."""
    try:
        clean, notices = _clean(msgs)
        whole = len(prompt._renderer(tok, clean, notices)(clean)[1])
        last = len(prompt._renderer(tok, clean[-1:], [])(clean[-1:])[1])
    except GenerationError:
        whole = last = 64
    out = [(whole + rng.randint(0, 40), rng.choice([1, 16]))]
    for _ in range(2):
        out.append((max(4, int(whole * rng.uniform(0.03, 0.9))), rng.choice([1, 16, 64, 512])))
    if rng.random() < 0.7:
        out.append((max(4, last + rng.randint(-8, 40)), rng.choice([1, 8])))
    else:
        out.append((rng.randint(4, 24), rng.choice([1, 4])))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_fitting_is_the_reference_fitting_token_for_token(tokenizers, seed, monkeypatch):
    skipped = []
    real = prompt._too_long
    monkeypatch.setattr(prompt, "_too_long", lambda *a: skipped.append(real(*a)) or skipped[-1])
    rng = random.Random(seed)
    for case in range(25):
        template = rng.choice(list(TEMPLATES))
        tok, msgs = tokenizers[template], _conversation(rng, template)
        for context, max_new in _contexts(rng, tok, msgs):
            for policy in ("rolling", "truncate-middle", "stop"):
                where = f"seed {seed} case {case}: {template}, {len(msgs)} messages, context {context}, {policy}"
                args = (tok, msgs, context, max_new)
                new = _outcome(prompt.build_prompt, *args, overflow=policy)
                assert new == _outcome(old_build_prompt, *args, overflow=policy), where
                if policy != "stop":
                    new = _outcome(prompt.build_prompt, *args, raw=True, overflow=policy)
                    assert new == _outcome(old_build_prompt, *args, raw=True, overflow=policy), where
                if rng.random() < 0.7:
                    continue  # measure_prompt: in a third of the cases
                try:
                    use = prompt.measure_prompt(tok, msgs, context, max_new, overflow=policy)
                except GenerationError as exc:
                    with pytest.raises(GenerationError, match="^" + re.escape(str(exc)) + "$"):
                        old_measure_prompt(tok, msgs, context, max_new, overflow=policy)
                else:
                    assert use == old_measure_prompt(tok, msgs, context, max_new, overflow=policy), where
    assert sum(1 for k in skipped if k > 0) >= 5, skipped  # the cuts that cannot fit were skipped, and often


@pytest.mark.parametrize("policy", ["rolling", "truncate-middle"])
def test_a_long_chat_renders_only_what_can_fit(tokenizers, policy, monkeypatch):
    """Thousands of messages: the same cut as the reference, and no prompt rendered on the way is much longer than
    the budget but the whole conversation (which the context meter counts anyway)."""
    tok, rng = tokenizers["chatml"], random.Random(1)
    msgs = [{"role": "system", "content": "You are brief."}]
    msgs += [{"role": ("user", "assistant")[n % 2], "content": _text(rng, rng.randint(10, 40))} for n in range(1201)]
    context, max_new = 1024, 128
    budget = prompt_budget(context, max_new)
    rendered: list[int] = []
    real = prompt._render

    def counting(*a):
        render, *rest = real(*a)
        return (lambda ms: rendered.append(len(ms)) or render(ms), *rest)

    monkeypatch.setattr(prompt, "_render", counting)
    new = _outcome(prompt.build_prompt, tok, msgs, context, max_new, overflow=policy)
    assert new == _outcome(old_build_prompt, tok, msgs, context, max_new, overflow=policy)
    assert new[2] > 1100 and len(new[0]) <= budget
    assert rendered and max(rendered) <= 8 * budget // 20, rendered  # messages of 20 tokens or more


@pytest.mark.parametrize("policy", ["rolling", "truncate-middle"])
def test_a_long_chat_fitted_again_tokenizes_only_what_is_new(policy):
    """The context meter counts the chat as the draft is typed, the send fits the same chat, the next turn fits it
    with two more messages: a message or a whole rendered chat counted before is not tokenized again (each fitting
    of 8,000 messages tokenized all of them and the whole chat anew), and every cut is the reference's."""
    tok = make_tokenizer()  # its own: nothing counted yet
    tok.chat_template = CHATML
    rng = random.Random(2)
    msgs = [{"role": "system", "content": "You are brief."}]
    msgs += [{"role": ("user", "assistant")[n % 2], "content": _text(rng, rng.randint(10, 40))} for n in range(1201)]
    context, max_new = 1024, 128
    chars = sum(len(m["content"]) for m in msgs)
    tokenized: list[int] = []  # the characters of each text tokenized

    class Counting(type(tok)):  # type: ignore[misc]
        def __call__(self, text, *args, **kwargs):
            tokenized.append(len(text))
            return super().__call__(text, *args, **kwargs)

    tok.__class__ = Counting

    def fitted(fit, *args, **kwargs) -> tuple[object, list[int]]:
        tokenized.clear()
        return fit(*args, **kwargs), list(tokenized)

    use, counted = fitted(prompt.measure_prompt, tok, msgs, context, max_new, overflow=policy)
    assert use == old_measure_prompt(tok, msgs, context, max_new, overflow=policy)
    assert len(counted) > len(msgs) and sum(counted) > 2 * chars  # each message, and the whole chat

    sent, counted = fitted(_outcome, prompt.build_prompt, tok, msgs, context, max_new, overflow=policy)
    assert sent == _outcome(old_build_prompt, tok, msgs, context, max_new, overflow=policy)
    assert sent[2] > 1100
    assert len(counted) < 30 and sum(counted) < chars // 4, counted  # only cuts of a few budgets

    following = [*msgs, {"role": "assistant", "content": "fine"}, {"role": "user", "content": "and then?"}]
    after, counted = fitted(_outcome, prompt.build_prompt, tok, following, context, max_new, overflow=policy)
    assert after == _outcome(old_build_prompt, tok, following, context, max_new, overflow=policy)
    assert len(counted) < 30, counted  # the new chat's text once, its two new messages, and the cuts
