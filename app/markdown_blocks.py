"""How a CommonMark reader splits a message into blocks, as far as the Markdown export needs it: which lines are code
or raw HTML, which are headings, and what the message leaves open at its end.

Block quotes and list items are followed as containers: a fence opened in "- ```" or "> ```" is the item's or the
quote's, closed by a fence inside it or ended with it, and a line indented under an item belongs to the item. Inline
markup is not read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from app.fences import FENCE, closes

# HTML blocks that run to a closing string, not to the next blank line (CommonMark's kinds 1 to 5): its opening, its end
HTML_BLOCKS = (
    (
        re.compile(r" {0,3}<(script|pre|style|textarea)(\s|>|$)", re.I),
        re.compile(r"</(script|pre|style|textarea)>", re.I),
    ),
    (re.compile(r" {0,3}<!--"), re.compile(r"-->")),
    (re.compile(r" {0,3}<\?"), re.compile(r"\?>")),
    (re.compile(r" {0,3}<![A-Za-z]"), re.compile(r">")),
    (re.compile(r" {0,3}<!\[CDATA\["), re.compile(r"\]\]>")),
)
# HTML blocks that run to the next blank line: a block-level tag (kind 6, which may interrupt a paragraph), or a
# line of one whole tag alone (kind 7, which may not)
_BLOCK_TAGS = (
    "address|article|aside|base|basefont|blockquote|body|caption|center|col|colgroup|dd|details|dialog|dir|div|dl|"
    "dt|fieldset|figcaption|figure|footer|form|frame|frameset|h1|h2|h3|h4|h5|h6|head|header|hr|html|iframe|legend|"
    "li|link|main|menu|menuitem|nav|noframes|ol|optgroup|option|p|param|search|section|summary|table|tbody|td|"
    "tfoot|th|thead|title|tr|track|ul"
)
_HTML_TO_BLANK = re.compile(rf" {{0,3}}</?({_BLOCK_TAGS})(\s|/?>|$)", re.I)
_ATTRIBUTE = r"""\s+[A-Za-z_:][\w.:-]*(\s*=\s*([^\s"'=<>`]+|'[^']*'|"[^"]*"))?"""
_HTML_TAG_LINE = re.compile(rf" {{0,3}}(<[A-Za-z][A-Za-z0-9-]*({_ATTRIBUTE})*\s*/?>|</[A-Za-z][A-Za-z0-9-]*\s*>)\s*$")
HEADING = re.compile(r" {0,3}#{1,6}(\s|$)")
_QUOTE = re.compile(r" {0,3}> ?")
_ITEM = re.compile(r"( {0,3})([-+*]|(\d{1,9})[.)])( *)(.?)")
_BREAK = re.compile(r" {0,3}([-*_])( *\1){2,} *$")  # a thematic break
_UNDERLINE = re.compile(r" {0,3}(=+|-+) *$")  # of a setext heading


@dataclass
class _Container:
    quote: bool  # a block quote, else a list item
    width: int = 0  # a list item's content column, past its marker
    blank_start: bool = False  # a list item whose marker line held nothing (a second blank line ends it)
    has_content: bool = False


@dataclass
class Blocks:
    raw: list[bool] = field(default_factory=list)  # the line is code or raw HTML, as written
    heading: list[bool] = field(default_factory=list)  # the line is an ATX heading (in any container)
    unclosed_html: list[int] = field(default_factory=list)  # lines opening an HTML block that runs past the text
    closing: Optional[str] = None  # the line that closes the code block the text leaves open, in its containers


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _html_kind(rest: str) -> Optional[int]:
    return next((k for k, (start, _) in enumerate(HTML_BLOCKS) if start.match(rest)), None)


def read_blocks(lines: list[str], escaped: Optional[re.Pattern[str]] = None) -> Blocks:
    """How a CommonMark reader reads `lines` (one message): see Blocks. An HTML block of kinds 1 to 5 opened outside
    every container is left open when its end is on no later line: the reader takes every line after it, the
    next turns' included, into it (one inside a container ends with it). The lines opening those, and the headings
    that match `escaped`, are read as the paragraph text they are once escaped."""
    ends = [max((j for j, line in enumerate(lines) if end.search(line)), default=-1) for _, end in HTML_BLOCKS]

    def as_text(i: int, rest: str, top: bool) -> bool:
        """Whether line `i` (`rest` past its containers; `top`: in none) is read as text once escaped."""
        if HEADING.match(rest):
            return escaped is not None and escaped.match(lines[i]) is not None
        kind = _html_kind(rest)
        return kind is not None and top and ends[kind] < i

    def starts_block(i: int, rest: str, top: bool) -> bool:
        """Whether `rest` starts a block (else it is a lazy line: it continues the paragraph of a container whose
        marker or indentation it lacks). Out of the paragraph's container, a list item starts a block where it
        could not interrupt the paragraph; a line of one whole HTML tag never does."""
        if not rest.strip():
            return True
        if _indent(rest) >= 4 or as_text(i, rest, top):
            return False
        if _QUOTE.match(rest) or FENCE.match(rest) or HEADING.match(rest) or _BREAK.match(rest):
            return True
        if _html_kind(rest) is not None or _HTML_TO_BLANK.match(rest):
            return True
        m = _ITEM.match(rest)
        return m is not None and (bool(m.group(4)) or not m.group(5))  # a marker followed by a space, or alone

    out = Blocks()
    stack: list[_Container] = []
    fence: Optional[str] = None  # the innermost container's open code block: its fence, with its indentation
    html_end: Optional[re.Pattern[str]] = None  # its open HTML block's end (kinds 1 to 5)
    to_blank = False  # its open HTML block ends at a blank line (kinds 6 and 7)
    paragraph = False  # its last block is a paragraph (lazy lines continue it)
    for i, original in enumerate(lines):
        line = original.expandtabs(4)
        pos, matched = 0, 0
        for c in stack:
            rest = line[pos:]
            if c.quote:
                m = _QUOTE.match(rest)
                if m is None:
                    break
                pos += m.end()
            elif not rest.strip():
                if c.blank_start and not c.has_content:
                    break  # an item begins with at most one blank line
            elif _indent(rest) >= c.width:
                pos += c.width
            else:
                break
            matched += 1
        rest = line[pos:]
        if matched < len(stack):
            if paragraph and not (fence or html_end or to_blank) and not starts_block(i, rest, matched == 0):
                out.raw.append(False)  # a lazy line: the paragraph goes on in the containers it is in
                out.heading.append(HEADING.match(rest) is not None)  # a turn's heading, lazy once escaped
                if _html_kind(rest) is not None:
                    out.unclosed_html.append(i)  # an HTML block never closed, lazy once escaped
                continue
            del stack[matched:]
            fence, html_end, to_blank, paragraph = None, None, False, False
        elif fence is not None:
            out.raw.append(True)
            out.heading.append(False)
            if closes(rest, fence.lstrip(" ")):
                fence = None
            continue
        elif html_end is not None:
            out.raw.append(True)
            out.heading.append(False)
            if html_end.search(rest):
                html_end = None
            continue
        elif to_blank:
            to_blank = bool(rest.strip())
            out.raw.append(to_blank)
            out.heading.append(False)
            if not to_blank:
                paragraph = False
            continue
        # new containers
        while _indent(rest) < 4:
            m = _QUOTE.match(rest)
            if m:
                stack.append(_Container(quote=True))
                pos += m.end()
            else:
                item = _ITEM.match(rest)
                if item is None or (item.group(5) and not item.group(4)) or _BREAK.match(rest):
                    break
                after = rest[item.end(2) :]
                empty = not after.strip()
                if paragraph and (empty or item.group(3) not in (None, "1")):
                    break  # cannot interrupt the paragraph: its text
                spaces = len(after) - len(after.lstrip(" "))
                marker = item.end(2)
                width = marker + 1 if empty or spaces >= 5 else marker + spaces
                stack.append(_Container(quote=False, width=width, blank_start=empty))
                pos += min(width, len(rest))
            if stack[:-1]:
                stack[-2].has_content = True
            fence, html_end, to_blank, paragraph = None, None, False, False
            rest = line[pos:]
        if stack and rest.strip():
            stack[-1].has_content = True
        # the line's own block
        raw = heading = False
        if not rest.strip():
            paragraph = False
        elif _indent(rest) >= 4 and not paragraph:
            raw = True  # indented code
        elif paragraph and _indent(rest) >= 4:
            pass
        elif FENCE.match(rest):
            m = FENCE.match(rest)
            assert m is not None
            fence, raw, paragraph = m.group(1) + m.group(2), True, False
        elif (kind := _html_kind(rest)) is not None:
            if as_text(i, rest, not stack):
                out.unclosed_html.append(i)  # shown as text: the paragraph it is then
                paragraph = True
            else:
                end = HTML_BLOCKS[kind][1]
                html_end = None if end.search(rest) else end
                raw, paragraph = True, False
        elif _HTML_TO_BLANK.match(rest) or (not paragraph and _HTML_TAG_LINE.match(rest)):
            to_blank, raw, paragraph = True, True, False
        elif HEADING.match(rest):
            heading, paragraph = True, as_text(i, rest, not stack)
        elif _BREAK.match(rest) or (paragraph and _UNDERLINE.match(rest)):
            paragraph = False
        else:
            paragraph = True
        out.raw.append(raw)
        out.heading.append(heading)
    if fence is not None:
        prefix = "".join("> " if c.quote else " " * c.width for c in stack)
        out.closing = prefix + fence
    return out
