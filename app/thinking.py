"""A reasoning model's thinking before its answer ("<think>…</think>": Qwen3, DeepSeek-R1's distillations), shown in
the app and written in the Markdown export as a quote headed "Thinking", before the answer. The message keeps its
text as the model wrote it (the chat template reads the tags back: Qwen3's leaves the thinking out of the history).

A template that opens the thinking in the prompt (DeepSeek-R1's distillations and QwQ end it with "<think>\n") has
the model write only the end tag: the text before an end tag that ends its line (not in inline code nor a code
block), with no opening tag before it, is taken for that thinking, whichever model wrote the answer (which
template asked for it is not kept with a message). Until the end tag comes it reads as the answer."""

from __future__ import annotations

import re
from typing import Callable, NamedTuple, Optional

from app.fences import unclosed_fence

# the thinking opens the answer; one stopped while it thought (or still streaming) has no end tag yet
_THINKING = re.compile(r"\s*<(think|thinking|reasoning)>(.*?)(</\1>|$)\s*", re.DOTALL)
# an end tag that ends its line, not in inline code (a prompt's template opened the thinking), and the first opening tag of any kind
_END_ALONE = re.compile(r"(?<!`)</(think|thinking|reasoning)>[ \t\r]*$\s*", re.MULTILINE)
_OPENING = re.compile(r"<(think|thinking|reasoning)>")


class Thinking(NamedTuple):
    text: str  # the thinking, without its tags
    answer: str  # what follows it
    done: bool  # whether its end tag came


def split_thinking(content: str) -> Optional[Thinking]:
    """The thinking an answer opens with, and the rest; None where it opens with none."""
    m = _THINKING.match(content)
    if m is not None:
        return Thinking(m.group(2).strip(), content[m.end() :], bool(m.group(3)))
    end = _END_ALONE.search(content)
    if end is None or _OPENING.search(content, 0, end.start()) or unclosed_fence(content[: end.start()]):
        return None
    return Thinking(content[: end.start()].strip(), content[end.end() :], True)


def thinking_as_quote(content: str, block: Callable[[str], str] = lambda text: text) -> str:
    """`content` as Markdown where its thinking is a quote headed "Thinking" ("Thinking…" until it ends) before the
    answer; `block` makes each part Markdown that cannot run into the other (the export closes what it opens)."""
    parts = split_thinking(content)
    if parts is None:
        return block(content)
    if parts.done and not parts.text:  # an empty one (Qwen3 asked not to think writes "<think>\n\n</think>")
        return block(parts.answer)
    quoted = "\n".join("> " + line for line in block(parts.text).split("\n")) if parts.text else "> …"
    head = f"> **{'Thinking' if parts.done else 'Thinking…'}**\n>\n{quoted}"
    return f"{head}\n\n{block(parts.answer)}" if parts.answer.strip() else head
