"""Overflow policies: what a conversation longer than the context loses under each (engine.prompt), token-exact
against the chat template, and the figures the engine reports for it."""

from __future__ import annotations

import pytest
from tiny_models import CHATML, make_tokenizer

from engine.errors import GenerationError
from engine.prompt import build_prompt, prompt_budget
from engine.types import SamplingParams

SYSTEM = {"role": "system", "content": "You are brief."}


@pytest.fixture(scope="module")
def tok():
    t = make_tokenizer()
    t.chat_template = CHATML
    return t


def ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def long_chat(turns: int) -> list[dict]:
    msgs = [SYSTEM]
    for n in range(turns):
        msgs += [
            {"role": "user", "content": f"question {n}: the quick brown fox jumps over the lazy dog"},
            {"role": "assistant", "content": f"answer {n}: hello world " * 3},
        ]
    return msgs + [{"role": "user", "content": "the final question: Paris?"}]


def test_truncate_middle_keeps_the_system_prompt_and_the_first_message(tok):
    msgs = long_chat(10)
    context, max_new = len(ids(tok, msgs)) // 2, 16
    p = build_prompt(tok, msgs, context, max_new, overflow="truncate-middle")
    budget = prompt_budget(context, max_new)
    assert len(p.ids) <= budget
    n = p.dropped_messages
    assert n > 0 and n % 2 == 0
    # the first turn stays whole, then the newest turns: messages 3 .. 2 + n (the chat's numbering) are gone
    kept = [SYSTEM, msgs[1], msgs[2], *msgs[3 + n :]]
    assert p.ids == ids(tok, kept)
    # at least the fewest turns that fit, and beyond them less than a step (a quarter of the budget) and a turn
    fewest = next(k for k in range(2, len(msgs), 2) if len(ids(tok, [SYSTEM, *msgs[1:3], *msgs[3 + k :]])) <= budget)
    assert n >= fewest
    assert len(ids(tok, [SYSTEM, *msgs[1:3], *msgs[3 + fewest :]])) - len(p.ids) < budget // 4 + len(
        ids(tok, msgs[3:5])
    )
    what = (
        f"{n} messages from the middle dropped (messages 3–{2 + n} of 21; the system prompt and the first message kept)"
    )
    assert p.cut == what
    assert p.notices == [f"prompt cut to fit the {context}-token context: {what}"]
    # without a system prompt, the notice does not say one was kept
    p = build_prompt(tok, msgs[1:], context, max_new, overflow="truncate-middle")
    assert p.cut.endswith("; the first message kept)") and "system prompt" not in p.cut


def test_truncate_middle_drops_the_first_answer_last(tok):
    msgs = long_chat(3)
    # room for the system prompt, the first question and the last one only
    context = len(ids(tok, [SYSTEM, msgs[1], msgs[-1]])) + 4
    p = build_prompt(tok, msgs, context, 1, overflow="truncate-middle")
    assert p.ids == ids(tok, [SYSTEM, msgs[1], msgs[-1]])
    assert p.cut.startswith("5 messages from the middle dropped (messages 2–6 of 7;")


def test_truncate_middle_cuts_the_last_message_when_the_kept_ones_fill_the_context(tok):
    words = " ".join(f"w{n}" for n in range(400)) + " THE END"
    msgs = [
        SYSTEM,
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": words},
    ]
    p = build_prompt(tok, msgs, 128, 16, overflow="truncate-middle")
    assert p.text.startswith("<|im_start|>system\nYou are brief.<|im_end|>\n<|im_start|>user\nfirst<|im_end|>\n")
    assert p.text.endswith("THE END<|im_end|>\n<|im_start|>assistant\n") and "w0 " not in p.text
    assert p.cut.startswith(
        "1 message from the middle dropped (message 2 of 3; the system prompt and the first "
        "message kept) and the last message was cut to its last"
    )
    big_first = [SYSTEM, {"role": "user", "content": "hello world " * 200}, {"role": "user", "content": "hi"}]
    p = build_prompt(tok, big_first, 128, 16, overflow="truncate-middle")  # the first message cannot stay
    assert p.ids == build_prompt(tok, big_first, 128, 16, overflow="rolling").ids
    assert p.notices[-1].startswith("the first message could not be kept (the system prompt, the first message and")


def test_rolling_drops_the_oldest_and_says_so(tok):
    msgs = long_chat(10)
    context = len(ids(tok, msgs)) // 2
    p = build_prompt(tok, msgs, context, 16, overflow="rolling")
    assert p.ids == ids(tok, [SYSTEM, *msgs[1 + p.dropped_messages :]])
    assert p.cut == f"{p.dropped_messages} oldest messages dropped"


def test_stop_refuses_a_conversation_that_does_not_fit_and_keeps_one_that_does(tok):
    msgs = long_chat(10)
    full = len(ids(tok, msgs))
    context = full // 2
    with pytest.raises(GenerationError) as err:
        build_prompt(tok, msgs, context, 16, overflow="stop")
    budget = prompt_budget(context, 16)
    assert str(err.value).startswith(
        f"the conversation takes {full:,} tokens, more than the {budget:,} the {context:,}-token context leaves"
    )
    assert "nothing was dropped" in str(err.value) and "choose another overflow policy" in str(err.value)
    p = build_prompt(tok, msgs, full + 16, 16, overflow="stop")
    assert p.ids == ids(tok, msgs) and p.cut == "" and p.notices == []
    with pytest.raises(GenerationError, match="nothing was dropped"):
        build_prompt(tok, [{"role": "user", "content": "w " * 300}], 64, 8, raw=True, overflow="stop")


def test_an_unknown_policy_is_refused(tok):
    with pytest.raises(GenerationError, match="overflow policy must be one of rolling, truncate-middle, stop"):
        build_prompt(tok, long_chat(1), 256, 8, overflow="drop-everything")


@pytest.mark.parametrize("policy", ["rolling", "truncate-middle"])
def test_the_engine_reports_what_was_dropped(tiny_llama, policy):
    from engine.engine import Engine
    from engine.types import EngineOptions

    eng = Engine.load(str(tiny_llama), EngineOptions(device="cpu", profile_window=False))
    try:
        msgs = long_chat(12)  # longer than the tiny model's 256-token context
        r = eng.generate(msgs, SamplingParams(temperature=0.0, max_new_tokens=4), overflow=policy)
        expected = build_prompt(eng.tokenizer, msgs, eng.context_length, 4, overflow=policy)
        assert r.metrics.prompt_tokens == len(expected.ids)
        assert r.metrics.overflow_policy == policy and r.metrics.prompt_cut == expected.cut != ""
        assert f"prompt cut to fit the {eng.context_length}-token context: {expected.cut}" in r.notices
        with pytest.raises(GenerationError, match="nothing was dropped"):
            eng.generate(msgs, SamplingParams(temperature=0.0, max_new_tokens=4), overflow="stop")
    finally:
        eng.close()


@pytest.mark.parametrize("policy", ["rolling", "truncate-middle", "stop"])
def test_measure_prompt_counts_what_build_prompt_feeds(tok, policy):
    from engine.prompt import measure_prompt

    short = long_chat(1)
    use = measure_prompt(tok, short, 256, 16, overflow=policy)
    assert use.tokens == use.prompt_tokens == len(ids(tok, short)) and use.cut == "" and use.refused == ""
    msgs = long_chat(10)
    context = len(ids(tok, msgs)) // 2
    use = measure_prompt(tok, msgs, context, 16, overflow=policy)
    assert use.tokens == len(ids(tok, msgs)) and use.budget == prompt_budget(context, 16)
    if policy == "stop":
        assert use.prompt_tokens is None and "nothing was dropped" in use.refused
    else:
        fitted = build_prompt(tok, msgs, context, 16, overflow=policy)
        assert use.prompt_tokens == len(fitted.ids) and use.cut == fitted.cut != ""
    draft = measure_prompt(tok, [*short[:-1], {"role": "user", "content": ""}], 256, 16, overflow=policy)
    assert draft.tokens == len(ids(tok, [*short[:-1], {"role": "user", "content": ""}]))


ALTERNATING = (  # as Gemma's template: a user and a model turn in turn, or an error
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "<start_of_turn>{{ message['role'] }}\n{{ message['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_truncate_middle_keeps_the_turns_alternating_for_templates_that_need_it():
    """The cut is rounded up to keep the prefix cache's start for several turns, but never past the first
    question's answer that the fewest cut keeps: that would leave two questions in a row, which such templates
    refuse."""
    t = make_tokenizer()
    t.chat_template = ALTERNATING
    words = "the quick brown fox jumps over lazy dog".split()
    text = lambda n: " ".join(words[i % 8] for i in range(n))  # noqa: E731
    msgs = [{"role": r, "content": text(n)} for r, n in zip(["user", "assistant"] * 2 + ["user"], (2, 52, 21, 7, 3))]
    for context in range(300, 420, 8):
        p = build_prompt(t, msgs, context, 16, overflow="truncate-middle")
        assert len(p.ids) <= prompt_budget(context, 16)
        roles = [line.split()[0] for line in p.text.split("<start_of_turn>")[1:]]
        assert roles[:-1] == ["user", "assistant", "user"], (context, p.cut)


def test_where_nothing_fits_truncate_middle_says_what_leaves_no_room():
    """With a system prompt longer than the context and a template that wants the roles to alternate, the refusal
    said "Conversation roles must alternate": the keeping of the first message failed first, but the rolling
    window behind it failed for the real reason."""
    t = make_tokenizer()
    t.chat_template = ALTERNATING
    words = "the quick brown fox jumps over lazy dog".split()
    text = lambda n: " ".join(words[i % 8] for i in range(n))  # noqa: E731
    msgs = [{"role": "system", "content": text(100)}, {"role": "user", "content": text(10)}]
    msgs += [{"role": "assistant", "content": text(200)}, {"role": "user", "content": "and so?"}]
    for overflow in ("truncate-middle", "rolling"):
        with pytest.raises(GenerationError, match="leaving no room for the message in the 128-token context"):
            build_prompt(t, msgs, 128, 16, overflow=overflow)


def test_truncate_middle_falls_back_to_rolling_where_it_cannot_keep_the_first_message(tok):
    """Two cases where keeping the first message cannot work: a template that wants the roles to alternate when the
    fewest cut must drop the first answer (the render failed, and every answer with it), and a first message longer
    than the context (cut on its own turn, then every later turn was refused). The rolling window answers, and the
    notice says why."""
    t = make_tokenizer()
    t.chat_template = ALTERNATING
    words = "the quick brown fox jumps over lazy dog".split()
    text = lambda n: " ".join(words[i % 8] for i in range(n))  # noqa: E731
    msgs = [{"role": "user", "content": text(10)}, {"role": "assistant", "content": text(200)}]
    msgs.append({"role": "user", "content": "and so?"})
    p = build_prompt(t, msgs, 256, 16, overflow="truncate-middle")
    rolling = build_prompt(t, msgs, 256, 16, overflow="rolling")
    assert p.ids == rolling.ids and p.cut == rolling.cut
    assert p.notices[-1].startswith("the first message could not be kept (") and "alternate" in p.notices[-1]

    document = "Please summarise: " + " ".join(f"w{i}" for i in range(600))
    msgs = [SYSTEM, {"role": "user", "content": document}, {"role": "assistant", "content": "It lists words."}]
    msgs.append({"role": "user", "content": "thanks, and the main point?"})
    p = build_prompt(tok, msgs, 256, 16, overflow="truncate-middle")
    assert p.ids == build_prompt(tok, msgs, 256, 16, overflow="rolling").ids and len(p.ids) <= prompt_budget(256, 16)
    assert "leaving no room" in p.notices[-1] and "the oldest messages were dropped instead" in p.notices[-1]
