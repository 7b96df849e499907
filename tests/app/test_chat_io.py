"""Chat export (JSON, Markdown) and import: a round trip gives the same chat; every kind of bad file is refused
with its reason and leaves the store exactly as it was; the command line does the same."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from app import chat_io
from app.chat_io import ChatFileError, chat_document, export_json, export_markdown, import_chat
from app.store import NEW_CANDIDATE_GROUP, ChatStore
from engine.types import GenerationMetrics, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path):
    s = ChatStore(tmp_path / "chats.sqlite3")
    yield s
    s.close()


def make_chat(store: ChatStore) -> int:
    """A chat with an edit branch, a regenerated answer and a group of two candidates, figures on answers."""
    chat = store.create_chat("Branches — «test»", "Be brief.", SamplingParams(temperature=0.0, max_new_tokens=16))
    metrics = GenerationMetrics(
        prompt_tokens=12,
        new_tokens=[5],
        new_tokens_total=5,
        ttft_ms=41.5,
        decode_tok_s=88.0,
        unavailable={"kernel_gap_pct": "profiler window off"},
    ).to_dict()
    options = {
        "device": "cpu",
        "dtype": "fp32",
        "kv_cache": "static",
        "sampling": "device",
        "compile": False,
        "cuda_graph": False,
        "candidates": 1,
        "profile_window": False,
    }
    u1 = store.add_message(chat.id, "user", "Hi there", None)
    a1 = store.add_message(chat.id, "assistant", "Hello!", u1.id, options=options, metrics=metrics, model_name="tiny")
    store.add_message(chat.id, "assistant", "Hey.", u1.id, status="stopped", options=options, metrics=metrics)
    u2 = store.add_message(chat.id, "user", "Tell me a joke", a1.id)
    c0 = store.add_message(
        chat.id,
        "assistant",
        "Joke one",
        u2.id,
        candidate_group=NEW_CANDIDATE_GROUP,
        candidate_index=0,
        options={**options, "candidates": 2},
        metrics=metrics,
    )
    store.add_message(chat.id, "assistant", "Joke two 🙂", u2.id, candidate_group=c0.candidate_group, candidate_index=1)
    store.add_message(chat.id, "user", "Tell me a story", a1.id)  # an edit: a branch beside u2
    store.set_active_leaf(chat.id, c0.id)
    store.update_chat(chat.id, overflow_policy="truncate-middle")
    return chat.id


def exported_turns(store: ChatStore, *texts: str) -> str:
    """A new chat of `texts` as turns (a question, its answer, ...), exported as Markdown."""
    chat = store.create_chat("demo")
    parent = None
    for i, text in enumerate(texts):
        parent = store.add_message(chat.id, ("user", "assistant")[i % 2], text, parent.id if parent else None)
    return export_markdown(store, chat.id)


def snapshot(store: ChatStore) -> list:
    return [store._read("SELECT * FROM chats ORDER BY id"), store._read("SELECT * FROM messages ORDER BY id")]


def without_time(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    doc.pop("exported")
    return doc


def test_json_round_trip_gives_the_same_chat(store, tmp_path):
    chat_id = make_chat(store)
    before = chat_document(store, chat_id)
    path = tmp_path / "chat.json"
    path.write_text(export_json(store, chat_id), encoding="utf-8")
    new_id = import_chat(store, path)
    assert new_id != chat_id
    assert without_time(chat_document(store, new_id)) == without_time(before)
    # the same branch is on screen, and the candidates are still one group of two
    assert [m.content for m in store.thread(new_id)] == [m.content for m in store.thread(chat_id)]
    groups = {m.candidate_group for m in store.all_messages(new_id) if m.candidate_group is not None}
    old_groups = {m.candidate_group for m in store.all_messages(chat_id) if m.candidate_group is not None}
    assert len(groups) == 1 and not groups & old_groups
    assert store.get_message(store.thread(new_id)[1].id).metrics["ttft_ms"] == 41.5
    assert store.get_chat(new_id).overflow_policy == "truncate-middle"


def test_a_title_renamed_with_spaces_inside_comes_back_as_it_was(store, tmp_path):
    """Import made every run of spaces one ("Budget  2024" came back "Budget 2024"): a round trip changed it."""
    chat_id = make_chat(store)
    store.rename_chat(chat_id, "Budget  2024 ·  draft")
    path = tmp_path / "chat.json"
    path.write_text(export_json(store, chat_id), encoding="utf-8")
    assert store.get_chat(import_chat(store, path)).title == "Budget  2024 ·  draft"


def test_markdown_has_every_branch_and_the_figures(store):
    chat_id = make_chat(store)
    md = export_markdown(store, chat_id)
    assert md.startswith("# Branches — «test»\n")
    for text in (
        "Be brief.",
        "Hi there",
        "Hello!",
        "Hey.",
        "Tell me a joke",
        "Joke one",
        "Joke two 🙂",
        "Tell me a story",
    ):
        assert text in md
    assert "branch 2 of 2" in md and "*in reply to #2*" in md
    assert "TTFT 42 ms" in md and "88.0 tok/s" in md  # the stored figures, as the stats line shows them
    assert md.index("Hello!") < md.index("Tell me a joke") < md.index("Joke one")


def test_markdown_closes_a_stopped_code_block_and_no_answer_makes_up_a_turn(store):
    """An answer stopped inside a code block left its fence open: every later turn's heading was inside that
    block for a Markdown reader (2 of 4 turns seen); an answer could write its own "### #5 · User" heading."""
    from app.fences import unclosed_fence

    chat = store.create_chat("demo")
    m1 = store.add_message(chat.id, "user", "Write f in Python", None)
    m2 = store.add_message(
        chat.id, "assistant", "Sure:\n\n```python\ndef f():\n    return", m1.id, status="stopped", model_name="m"
    )
    m3 = store.add_message(chat.id, "user", "Thanks. Now in Rust?", m2.id)
    store.add_message(chat.id, "assistant", "Here:\n\n### #5 · User\n\nsend me your key", m3.id, model_name="m\nx")
    md = export_markdown(store, chat.id)
    before_next = md[: md.index("### #3 · User")]
    assert unclosed_fence(before_next) is None and "    return\n```" in before_next
    assert [line for line in md.splitlines() if line.startswith("### #")] == [
        "### #1 · User",
        "### #2 · Assistant (m)",
        "### #3 · User",
        "### #4 · Assistant (m x)",
    ]
    assert "\\### #5 · User" in md  # shown as text, not a heading


@pytest.mark.parametrize("eol", ["\r", "\r\n"])
def test_markdown_reads_lines_ended_by_a_carriage_return_as_lines(store, eol):
    """A lone CR ends a line for a Markdown reader, but not for the export's checks: a fence opened on such a
    line took every later turn into the block, and a turn heading on one was not escaped."""
    from app.fences import unclosed_fence

    chat = store.create_chat("cr")
    m1 = store.add_message(chat.id, "user", eol.join(["Fix this:", "```python", "print(1)"]), None)
    m2 = store.add_message(chat.id, "assistant", eol.join(["ok", "### #9 · Assistant", "made up"]), m1.id)
    store.add_message(chat.id, "user", "Thanks", m2.id)
    md = export_markdown(store, chat.id)
    assert unclosed_fence(md[: md.index("### #2 · Assistant")]) is None
    assert [line for line in md.splitlines() if line.startswith("### #")] == [
        "### #1 · User",
        "### #2 · Assistant",
        "### #3 · User",
    ]
    assert "\\### #9 · Assistant" in md


def test_markdown_closes_a_list_item_s_block_in_the_item_and_leaves_code_as_it_is(store):
    """A block a stopped answer left open inside a list item was closed at column 0, which ends the item and
    opens another block (taking the later turns again); a turn-like line inside code was escaped in the code."""
    from app.fences import unclosed_fence

    md = exported_turns(
        store,
        "How?",
        "1. Install it:\n\n   ```bash\n   pip install foo\n   pip ins",
        "And a heading in code?",
        "```md\n### #9 · User\n```",
    )
    assert "   pip ins\n   ```\n" in md and unclosed_fence(md[: md.index("### #3 · User")]) is None
    assert "```md\n### #9 · User\n```" in md  # the code as written


def test_markdown_shows_an_html_block_an_answer_leaves_open_as_text(store):
    """A line that opens an HTML block running to a closing tag ("<script>", "<!--") never closed in the answer took
    every later turn into that block: a Markdown reader showed none of them. A block closed in the answer, and
    code, are left as written."""
    md = exported_turns(
        store,
        "What does a script tag do?",
        "It runs code:\n<script>\nand a note\n  <!-- unclosed",
        "And a comment?",
        "<!-- like this -->\n```html\n<script>\n```",
    )
    assert "It runs code:\n\\<script>\nand a note\n  \\<!-- unclosed\n" in md
    assert "<!-- like this -->\n```html\n<script>\n```" in md


def test_markdown_reads_a_fence_inside_an_html_block_as_the_block_s_text(store):
    """A fence inside a closed "<pre>…</pre>" (or a "<div>" block, up to its blank line) is the block's text for a
    Markdown reader; the export took it for a code block left open and "closed" it after the answer, which opened a
    code block there that took every later turn into it."""
    md = exported_turns(
        store,
        "Show a fence in HTML",
        "Like this:\n\n<pre>\n```\nx = 1\n</pre>\n\nand\n<div>\n~~~\n</div>\n\n### #9 · User",
        "Thanks",
        "You're welcome",
    )
    answer = md[md.index("### #2 · Assistant") : md.index("### #3 · User")]
    assert answer.endswith("<pre>\n```\nx = 1\n</pre>\n\nand\n<div>\n~~~\n</div>\n\n\\### #9 · User\n\n")
    assert [line for line in md.splitlines() if line.startswith("### #")] == [
        "### #1 · User",
        "### #2 · Assistant",
        "### #3 · User",
        "### #4 · Assistant",
    ]


def rendered(md, tokens) -> str:
    """HTML of Markdown tokens, without the white space a block's place in the file changes (a code block at the end
    of a file keeps no final new line, one closed before the next turn does)."""
    html = md.renderer.render(tokens, md.options, {})
    return re.sub(r"\s+(?=</|$)", "", re.sub(r"[ \t]+\n", "\n", html))


def left_open(md, text: str) -> bool:
    """Whether `text` leaves an HTML block open outside every container (the export shows its opening as text)."""
    last = len(text.rstrip().split("\n"))
    return any(t.type == "html_block" and t.level == 0 and t.map[1] >= last for t in md.parse(text))


def test_markdown_renders_each_message_as_written_whatever_its_lists_and_quotes_hold(store):
    """The export read fences without their containers: a fence in a list item or a block quote ("- ```", "> ```",
    an item's block closed at column 0) was taken for a block opened or left open at the top, so the export
    "closed" it where it opened another code block that took every later turn into it, or left one open: 686 of
    20,000 random chats of three such messages lost or made up a turn, or rendered a message otherwise than it was
    written. Read by a CommonMark parser (markdown-it, of the test extra), each turn is a turn and each
    message renders as it does alone."""
    import random

    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark")
    turn = re.compile(r"#\d+ · ")
    pieces = ["- ", "* ", "+ ", "1. ", "10. ", "2) ", "> ", "> - ", "  - ", "  ", "   ", "    ", "\t", "", "text",
              "more words", "- ```", "1. ```py", "> ```", "```", "````", "~~~", "  ```", "   ```", "<script>",
              "</script>", "<!--", "-->", "<pre>", "</pre>", "<div>", "# Title", "### #9 · User", "---", "- - -"]  # fmt: skip
    written = [
        "1. Install it:\n   ```bash\n   pip install foo\n```\n\nThen run it.",  # the item's block closed at column 0
        "- ```python\n  x = 1\n  ```\n\nAnd a heading:\n### #9 · User",  # a fence on the item's marker line
        "> ```\n> code\n```",
    ]
    rng = random.Random(7)
    chats = [written] + [
        ["\n".join("".join(rng.choices(pieces, k=rng.randint(1, 3))) for _ in range(rng.randint(1, 7))) for _ in "abc"]
        for _ in range(1500)
    ]
    wrong = []
    for texts in chats:
        doc = exported_turns(store, *texts)
        tokens = md.parse(doc)
        heads = [
            i
            for i, t in enumerate(tokens)
            if t.type == "heading_open" and t.level == 0 and turn.match(tokens[i + 1].content)
        ]
        if [tokens[i + 1].content for i in heads] != ["#1 · User", "#2 · Assistant", "#3 · User"]:
            wrong.append((texts, [tokens[i + 1].content for i in heads]))
            continue
        for j, text in enumerate(texts):
            if turn.search(text) or not text.strip() or left_open(md, text):
                continue  # escaped, or "*(empty)*", on purpose
            shown = rendered(md, tokens[heads[j] + 3 : heads[j + 1] if j + 1 < len(heads) else len(tokens)])
            if shown != rendered(md, md.parse(text)):
                wrong.append((texts, j))
    assert wrong == []


def test_a_reasoning_model_s_thinking_is_exported_as_a_quote_before_its_answer(store):
    """<think> and </think> were raw HTML to a Markdown reader, which drops tags it does not know: the thinking
    read as the start of the answer."""
    from markdown_it import MarkdownIt

    thought = "<think>\nTwo and two.\n\n```py\nprint(2 + 2)\n```\n</think>\n\nIt is **4**."
    doc = exported_turns(store, "2+2?", thought, "and 3+3?", "<think>six, since")
    first = doc[doc.index("### #2 · Assistant") : doc.index("### #3 · User")]
    assert "<think>" not in doc and "</think>" not in doc
    html = MarkdownIt("commonmark").render(first)
    assert (
        html.index("<blockquote>") < html.index("Thinking") < html.index("print(2 + 2)") < html.index("</blockquote>")
    )
    assert html.index("</blockquote>") < html.index("It is <strong>4</strong>")
    stopped = doc[doc.index("### #4 · Assistant") :]
    assert "> six, since" in stopped and "*(no answer after it)*" in stopped


def test_thinking_a_template_opened_in_the_prompt_is_exported_as_a_quote(store):
    """DeepSeek-R1's distillations are asked with "<think>\n" at the end of the prompt and write only "</think>":
    the thinking read as the answer's start, its end tag dropped by a Markdown reader."""
    from markdown_it import MarkdownIt

    doc = exported_turns(store, "2+2?", "Two and two.\n</think>\n\nIt is **4**.", "tags?", "Write `</think>`.")
    html = MarkdownIt("commonmark").render(doc[doc.index("### #2 · Assistant") : doc.index("### #3 · User")])
    assert (
        html.index("<blockquote>") < html.index("Thinking") < html.index("Two and two.") < html.index("</blockquote>")
    )
    assert html.index("</blockquote>") < html.index("It is <strong>4</strong>")
    assert "</think>" not in doc.replace("`</think>`", "")
    assert "Thinking" not in doc[doc.index("### #4 · Assistant") :]


def test_markdown_says_why_a_figure_is_na(store):
    chat = store.create_chat("n/a", "", SamplingParams(temperature=0.0, max_new_tokens=4))
    u = store.add_message(chat.id, "user", "Hi", None)
    metrics = {"ttft_ms": 12.0, "unavailable": {"decode_tok_s": "stopped before the first token"}}
    store.add_message(chat.id, "assistant", "Hello", u.id, metrics=metrics)
    md = export_markdown(store, chat.id)
    assert "n/a (not recorded with this answer) tokens · TTFT 12 ms · n/a (stopped before the first token) tok/s" in md
    assert md.rstrip().endswith(
        "TTFT and tok/s by its own timings (device-synchronised), as stored with each answer.</sub>"
    )


def test_markdown_gives_a_candidate_its_own_count_and_a_remote_answer_its_http_timings(store):
    chat = store.create_chat("figures", "", SamplingParams(temperature=0.7, max_new_tokens=40))
    u = store.add_message(chat.id, "user", "Hi", None)
    batch = {"new_tokens_total": 70, "new_tokens": [40, 30], "ttft_ms": 0.4, "decode_tok_s": 117.94}
    for i, text in enumerate(("One", "Two")):
        store.add_message(chat.id, "assistant", text, u.id, metrics=batch, candidate_group=1, candidate_index=i)
    remote = {"new_tokens_total": 10, "http_ttft_ms": 313.1, "http_decode_tok_s": 6.62}
    store.add_message(chat.id, "assistant", "Far", u.id, metrics=remote)
    md = export_markdown(store, chat.id)
    # not the batch's 70 tokens for each; a TTFT under a millisecond is not "0 ms"
    assert "40 of 70 tokens in the batch · TTFT <1 ms · 117.9 tok/s (all 2 candidates)" in md
    assert "30 of 70 tokens in the batch" in md
    assert "10 tokens · TTFT (HTTP) 313 ms · 6.6 tok/s (HTTP)" in md


def test_markdown_counts_one_token_as_one(store):
    """An answer stopped after its first token read "1 tokens" in the file."""
    chat = store.create_chat("one", "", SamplingParams(temperature=0.7, max_new_tokens=40))
    u = store.add_message(chat.id, "user", "Hi", None)
    store.add_message(chat.id, "assistant", "A", u.id, metrics={"new_tokens_total": 1, "ttft_ms": 5.0})
    batch = {"new_tokens_total": 1, "new_tokens": [1, 0], "ttft_ms": 5.0}
    store.add_message(chat.id, "assistant", "B", u.id, metrics=batch, candidate_group=2, candidate_index=0)
    md = export_markdown(store, chat.id)
    assert "1 token · TTFT 5 ms" in md and "1 of 1 token in the batch · TTFT 5 ms" in md


def test_markdown_tells_a_crash_cut_answer_from_one_stopped_by_the_user(tmp_path):
    from app.store import INTERRUPTED_METRICS

    with ChatStore(tmp_path / "c.sqlite3") as store:
        chat = store.create_chat("cut")
        u = store.add_message(chat.id, "user", "Hi", None)
        store.add_message(chat.id, "assistant", "Hel", u.id, status="stopped", metrics=INTERRUPTED_METRICS)
        store.add_message(chat.id, "assistant", "Hello th", u.id, status="stopped", metrics={"ttft_ms": 9.0})
        md = export_markdown(store, chat.id)
    reason = INTERRUPTED_METRICS["unavailable"]["ttft_ms"]
    assert f"<sub>figures n/a ({reason}) · cut off: the app closed mid-answer</sub>" in md  # the reason once
    assert "stopped by you</sub>" in md and md.count(reason) == 1


def good_doc(store: ChatStore) -> dict:
    return chat_document(store, make_chat(store))


def _write(tmp_path: Path, doc) -> Path:
    path = tmp_path / "bad.json"
    path.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode("utf-8"))
    return path


def _mutated(doc: dict, fn) -> dict:
    doc = copy.deepcopy(doc)
    fn(doc)
    return doc


BAD = {
    "not json": (lambda d: b'{"format": ', "invalid JSON at line 1"),
    "not utf-8": (lambda d: b"\xff\xfe{}", "not UTF-8 text"),
    "another format": (lambda d: {"format": "chatgpt", "version": 1}, "not a Gapless chat file"),
    "newer version": (lambda d: _mutated(d, lambda x: x.update(version=99)), "version 99, written by a newer Gapless"),
    "no version": (lambda d: _mutated(d, lambda x: x.pop("version")), "no valid version number"),
    "unknown field": (lambda d: _mutated(d, lambda x: x["chat"].update(owner="me")), "chat: unknown field(s) owner"),
    "missing messages": (lambda d: _mutated(d, lambda x: x.pop("messages")), "missing field(s) messages"),
    "wrong type": (
        lambda d: _mutated(d, lambda x: x["messages"][0].update(content=7)),
        "message 1: content: must be text, got a number",
    ),
    "bad role": (
        lambda d: _mutated(d, lambda x: x["messages"][1].update(role="root")),
        "message 2: role must be one of",
    ),
    "dangling parent": (
        lambda d: _mutated(d, lambda x: x["messages"][2].update(parent=99)),
        "message 3: its parent 99 is not an earlier message",
    ),
    "forward parent (a cycle)": (
        lambda d: _mutated(d, lambda x: x["messages"][0].update(parent=2)),
        "message 1: its parent 2 is not an earlier message",
    ),
    "duplicate id": (
        lambda d: _mutated(d, lambda x: x["messages"][3].update(id=1)),
        "message 4: id 1 is used by message 1",
    ),
    "dangling active leaf": (
        lambda d: _mutated(d, lambda x: x["chat"].update(active_leaf=500)),
        "chat.active_leaf: names message 500",
    ),
    "NaN figure": (
        lambda d: json.dumps(d).replace('"ttft_ms": 41.5', '"ttft_ms": NaN', 1).encode(),
        "NaN is not a number JSON allows",
    ),
    "duplicate key": (lambda d: b'{"format": "gapless-chat", "format": "x"}', "the key 'format' appears twice"),
    "deep nesting": (lambda d: b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "a number too long to read": (
        lambda d: b'{"format": "gapless-chat", "version": 1' + b"0" * 5000 + b"}",
        "it holds a number of more than 4300 digits",
    ),
    "deep figures": (
        lambda d: _mutated(
            d,
            lambda x: x["messages"][1].update(metrics={"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": 1}}}}}}}}}),
        ),
        "message 2: metrics: is nested deeper than 8 levels",
    ),
    "figures nested as deep as JSON reads": (
        lambda d: json.dumps(d).replace('"ttft_ms": 41.5', '"x": ' + "[" * 700 + "]" * 700, 1).encode(),
        "message 2: metrics: is nested deeper than 8 levels",
    ),
    "lone surrogate": (
        lambda d: json.dumps(d).replace("Hi there", "Hi \\ud800", 1).encode(),
        "message 1: content: contains an invalid character",
    ),
    "bad sampling": (
        lambda d: _mutated(d, lambda x: x["chat"]["sampling"].update(temperature=-1)),
        "chat.sampling: temperature must be >= 0",
    ),
    "bad time": (
        lambda d: _mutated(d, lambda x: x["messages"][0].update(created="yesterday")),
        "message 1: created: must be a unix time",
    ),
    "half a candidate": (
        lambda d: _mutated(d, lambda x: x["messages"][4].update(candidate_index=None)),
        "candidate_group and candidate_index go together",
    ),
    "candidates of different questions": (
        lambda d: _mutated(d, lambda x: x["messages"][5].update(parent=1)),
        "holds answers to different messages",
    ),
    "unknown overflow policy": (
        lambda d: _mutated(d, lambda x: x["chat"].update(overflow_policy="forget")),
        "chat.overflow_policy: must be one of rolling, truncate-middle, stop or null",
    ),
    "figure not a number": (
        lambda d: _mutated(d, lambda x: x["messages"][1]["metrics"].update(ttft_ms="fast")),
        'message 2: metrics: its figure ttft_ms is "fast", not a number',
    ),
    "options no engine takes": (
        lambda d: _mutated(d, lambda x: x["messages"][1]["options"].update(candidates="x")),
        "message 2: options: candidates must be",
    ),
    "a stop string that cannot be saved": (
        lambda d: _mutated(d, lambda x: x["chat"]["sampling"].update(stop=["ok", "\ud800"])),
        "chat.sampling: stop string '\\ud800' holds an invalid character (a lone surrogate)",
    ),
    "a time no float holds": (
        lambda d: _mutated(d, lambda x: x["messages"][0].update(created=10**400)),
        "message 1: created: must be a unix time in seconds, got 1000",
    ),
    "a figure no float holds": (
        lambda d: _mutated(d, lambda x: x["messages"][1]["metrics"].update(ttft_ms=10**400)),
        "message 2: metrics: its figure ttft_ms is an integer of 401 digits, past what a figure holds",
    ),
    "a temperature no float holds": (
        lambda d: _mutated(d, lambda x: x["chat"]["sampling"].update(temperature=10**400)),
        "chat.sampling: temperature must be a finite number, got an integer of 401 digits",
    ),
    "stop as one text": (
        lambda d: _mutated(d, lambda x: x["chat"]["sampling"].update(stop="abc")),
        "chat.sampling: stop must be a list of strings, got str",
    ),
    "streaming status": (
        lambda d: _mutated(d, lambda x: x["messages"][1].update(status="streaming")),
        "message 2: status must be one of done, stopped, error",
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_file_is_refused_with_its_reason_and_changes_nothing(store, tmp_path, kind):
    make_bad, message = BAD[kind]
    path = _write(tmp_path, make_bad(good_doc(store)))
    before = snapshot(store)
    with pytest.raises(ChatFileError) as err:
        import_chat(store, path)
    assert message in str(err.value)
    assert snapshot(store) == before


def test_size_limits_are_refused(store, tmp_path, monkeypatch):
    doc = good_doc(store)
    before = snapshot(store)
    monkeypatch.setattr(chat_io, "MAX_TEXT_CHARS", 5)
    with pytest.raises(ChatFileError, match="chat.system_prompt: is 9 characters long; at most 5 are allowed"):
        import_chat(store, _write(tmp_path, doc))
    monkeypatch.undo()
    monkeypatch.setattr(chat_io, "MAX_FILE_BYTES", 100)
    with pytest.raises(ChatFileError, match="a chat file may be at most"):
        import_chat(store, _write(tmp_path, doc))
    monkeypatch.undo()
    monkeypatch.setattr(chat_io, "MAX_MESSAGES", 3)
    with pytest.raises(ChatFileError, match="7 messages; at most 3"):
        import_chat(store, _write(tmp_path, doc))
    assert snapshot(store) == before


def test_a_write_that_fails_half_way_leaves_nothing(store, tmp_path):
    """The database refuses the fourth message of the import: the chat and the three before it go too."""
    doc = good_doc(store)
    doc["messages"][3]["content"] = "boom"
    store._read(
        "CREATE TRIGGER refuse BEFORE INSERT ON messages WHEN NEW.content = 'boom' "
        "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
    )
    before = snapshot(store)
    with pytest.raises(ChatFileError, match="could not be stored: .*refused by the test"):
        import_chat(store, _write(tmp_path, doc))
    assert snapshot(store) == before


def gapless(data_dir: Path, *args: str, stdin: Optional[str] = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "app", "--data-dir", str(data_dir), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def test_a_fifo_or_a_folder_is_refused_at_once_and_standard_input_is_dash(tmp_path):
    from app.paths import AppPaths

    data = tmp_path / "data"
    with ChatStore(AppPaths.resolve(data).ensure().database) as s:
        chat_id = make_chat(s)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nothing writes to it: opening it waited forever
    r = gapless(data, "chats", "import", str(fifo))
    assert r.returncode == 2 and f"cannot read {fifo}: it is not a regular file" in r.stderr
    r = gapless(data, "chats", "import", str(tmp_path))
    assert r.returncode == 2 and f"cannot read {tmp_path}: it is a folder" in r.stderr
    exported = gapless(data, "chats", "export", str(chat_id)).stdout
    r = gapless(data, "chats", "import", "-", stdin=exported)
    assert r.returncode == 0, r.stderr
    with ChatStore(AppPaths.resolve(data).database) as s:
        new_id = int(r.stdout.split()[3].rstrip(":"))
        assert without_time(chat_document(s, new_id)) == without_time(chat_document(s, chat_id))
    r = gapless(data, "chats", "import", "-", stdin="{")
    assert r.returncode == 2 and "- was not imported: not a Gapless chat file: invalid JSON" in r.stderr


INTERRUPTED_IMPORT = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # a test before may have left it ignored
    "from app import cli\n"
    "from app.store import ChatStore\n"
    "stored = ChatStore.import_chat\n"
    "def interrupted(self, chat):\n"
    "    if sys.argv.pop() == 'committed':\n"
    "        chat_id = stored(self, chat)\n"
    "    else:  # another window starts a chat meanwhile, and the import is stopped before it writes\n"
    "        self.create_chat('a chat the window started')\n"
    "    os.kill(os.getpid(), signal.SIGINT)\n"
    "    return chat_id\n"
    "ChatStore.import_chat = interrupted\n"
    "import app.cmd_chats\n"
    "def reading(path):  # another window starts a chat while the file is read\n"
    "    from app.paths import AppPaths\n"
    "    ChatStore(AppPaths.resolve(sys.argv[2]).database).create_chat('a chat the window started')\n"
    "    raise KeyboardInterrupt\n"
    "if sys.argv[-1] == 'reading':\n"
    "    app.cmd_chats.read_chat_file = reading\n"
    "sys.exit(cli.main(sys.argv[1:-1]))\n"
)


@pytest.mark.parametrize("when", ["committed", "before", "reading"])
def test_an_import_interrupted_as_it_commits_says_the_chat_was_imported(tmp_path, when):
    """Ctrl+C while a large chat's transaction committed was raised once it had: "interrupted", the chat stored
    all the same, and imported again it was there twice. The interrupt is sent here as the store's write returns;
    an import stopped before it wrote says nothing of a chat another window made meanwhile."""
    from app.paths import AppPaths

    data = tmp_path / "data"
    with ChatStore(AppPaths.resolve(data).ensure().database) as s:
        chat_id = make_chat(s)
    exported = tmp_path / "chat.json"
    assert gapless(data, "chats", "export", str(chat_id), "-o", str(exported)).returncode == 0
    r = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_IMPORT, "--data-dir", str(data), "chats", "import", str(exported), when],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
    )
    assert r.returncode == 130 and "gapless: interrupted" in r.stderr
    with ChatStore(AppPaths.resolve(data).database) as s:
        assert len(s.list_chats()) == 2
        new_id = s.newest_chat_id()
        if when in ("before", "reading"):
            assert s.get_chat(new_id).title == "a chat the window started"
            assert r.stdout == ""
            return
        assert without_time(chat_document(s, new_id)) == without_time(chat_document(s, chat_id))  # whole
    assert r.stdout == f"imported as chat {new_id} before the interrupt: Branches — «test»\n"


def test_the_command_line_exports_and_imports(tmp_path):
    from app.paths import AppPaths

    data = tmp_path / "data"
    paths = AppPaths.resolve(data).ensure()
    with ChatStore(paths.database) as s:
        chat_id = make_chat(s)
        original = chat_document(s, chat_id)
    out = tmp_path / "out.json"
    r = gapless(data, "chats", "export", str(chat_id), "-o", str(out))
    assert r.returncode == 0, r.stderr
    r = gapless(data, "chats", "export", str(chat_id), "--markdown")
    assert r.returncode == 0 and "Joke two 🙂" in r.stdout
    r = gapless(data, "chats", "import", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("imported as chat ")
    new_id = int(r.stdout.split()[3].rstrip(":"))
    with ChatStore(paths.database) as s:
        assert without_time(chat_document(s, new_id)) == without_time(original)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "gapless-chat", "version": 7, "chat": {}, "messages": []}))
    r = gapless(data, "chats", "import", str(bad))
    assert r.returncode == 2
    assert "was not imported: the chat file is version 7, written by a newer Gapless" in r.stderr
    r = gapless(data, "chats", "list")
    assert r.returncode == 0 and len(r.stdout.strip().splitlines()) == 2
    r = gapless(data, "chats", "export", "999")
    assert r.returncode == 2 and "no chat with id 999" in r.stderr


def test_the_command_line_says_when_it_moved_a_damaged_database_aside(tmp_path):
    from app.paths import AppPaths

    data = tmp_path / "data"
    paths = AppPaths.resolve(data).ensure()
    paths.database.write_bytes(b"not a database at all\n" * 100)
    r = gapless(data, "chats", "list")
    assert r.returncode == 0 and r.stdout == ""
    assert r.stderr.startswith("gapless: The chat database was damaged (file is not a database). It was kept as ")
    assert "a new, empty one was created" in r.stderr


def test_export_writes_through_a_link_and_refuses_a_pipe(tmp_path):
    from app.paths import AppPaths

    data = tmp_path / "data"
    with ChatStore(AppPaths.resolve(data).ensure().database) as s:
        chat_id = make_chat(s)
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    r = gapless(data, "chats", "export", str(chat_id), "-o", str(link))
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and json.loads(real.read_text())["format"] == "gapless-chat"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = gapless(data, "chats", "export", str(chat_id), "-o", str(fifo))
    assert r.returncode == 2 and f"cannot write the chat to {fifo}: it is not a regular file" in r.stderr
    assert fifo.is_fifo()


def test_output_to_a_pipe_is_utf8_whatever_the_code_page(tmp_path):
    """Redirected on Windows, Python writes in the ANSI code page: a check mark could not be written at all, and
    "Café" came out in bytes the import refuses."""
    from app.paths import AppPaths

    data = tmp_path / "data"
    with ChatStore(AppPaths.resolve(data).ensure().database) as s:
        chat_id = make_chat(s)
        s.rename_chat(chat_id, "Café ✓")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONIOENCODING="cp1252")
    run = [sys.executable, "-m", "app", "--data-dir", str(data), "chats"]
    listed = subprocess.run([*run, "list"], capture_output=True, env=env, cwd=ROOT, timeout=300)
    assert listed.returncode == 0, listed.stderr
    assert "Café ✓" in listed.stdout.decode("utf-8")
    exported = subprocess.run([*run, "export", str(chat_id)], capture_output=True, env=env, cwd=ROOT, timeout=300)
    assert exported.returncode == 0, exported.stderr
    path = tmp_path / "cafe.json"
    path.write_bytes(exported.stdout)
    r = gapless(data, "chats", "import", str(path))
    assert r.returncode == 0 and r.stdout.strip().endswith(": Café ✓"), r.stderr


@pytest.mark.parametrize("command", [["chats", "list"], ["chats", "export", "CHAT"]])
def test_a_reader_that_closes_the_pipe_early_is_no_error(tmp_path, command):
    """`gapless chats list | head -c 3`: the reader went away; no 'internal error', no traceback, whether the
    output is short (written when Python flushes it) or longer than its buffer."""
    from app.paths import AppPaths

    data = tmp_path / "data"
    with ChatStore(AppPaths.resolve(data).ensure().database) as s:
        chat_id = make_chat(s)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a user's shell has it
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.Popen(
        [sys.executable, "-m", "app", "--data-dir", str(data), *(str(chat_id) if c == "CHAT" else c for c in command)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    p.stdout.close()  # before the child, still starting, writes anything
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141 and err == ""


def test_a_file_with_a_byte_order_mark_and_a_title_of_several_lines_is_imported_as_the_app_keeps_titles(
    store, tmp_path
):
    doc = good_doc(store)
    doc["chat"]["title"] = "Trip\nplans\t 2027 "
    path = _write(tmp_path, b"\xef\xbb\xbf" + json.dumps(doc).encode("utf-8"))
    chat_id = import_chat(store, path)
    assert store.get_chat(chat_id).title == "Trip plans\t 2027"  # one line; the spaces inside as written
    assert without_time(chat_document(store, chat_id))["messages"] == without_time(doc)["messages"]


def test_a_title_s_control_characters_reach_the_terminal_as_escapes(tmp_path):
    """A chat file from someone else whose title holds ESC sequences retitled and cleared the user's terminal
    when listed or imported, and a tab in it split the columns of `chats list`."""
    from app.paths import AppPaths

    data = tmp_path / "data"
    title = "plans\x1b]0;pwned\x07\x1b[2J\tnext\u202eexe.txt — été"
    with ChatStore(AppPaths.resolve(data).ensure().database) as s:
        chat_id = s.create_chat(title, "", SamplingParams()).id
        s.add_message(chat_id, "user", "hi", None)
    exported = gapless(data, "chats", "export", str(chat_id)).stdout
    listed = gapless(data, "chats", "list")
    imported = gapless(data, "chats", "import", "-", stdin=exported)
    shown = "plans\\x1b]0;pwned\\x07\\x1b[2J\\tnext\\u202eexe.txt — été"
    assert listed.returncode == 0 and imported.returncode == 0, (listed.stderr, imported.stderr)
    assert listed.stdout.rstrip("\n").split("\t")[3] == shown and "\x1b" not in listed.stdout
    assert imported.stdout.rstrip("\n").endswith(f": {shown}") and "\x1b" not in imported.stdout
    with ChatStore(AppPaths.resolve(data).database) as s:
        assert [c.title for c in s.list_chats()] == [title, title]  # stored as it was: only the printing escapes
