"""Code fences as CommonMark reads them, for the conversation view (ui/markdown.py) and the Markdown export.

A fence is indented at most 3 spaces; a backtick fence's info string has no backtick (```a``` b is inline code);
a closing fence is the opening's character, at least as many, and nothing after it.
"""

from __future__ import annotations

import re
from typing import Optional

FENCE = re.compile(r"^( {0,3})(`{3,}(?=[^`]*$)|~{3,})[ \t]*([^\s`]*)")
CLOSING = re.compile(r"^ {0,3}(`{3,}|~{3,})[ \t]*\r?$")  # a CRLF text's lines end in \r


def closes(line: str, fence: str) -> bool:
    """Whether `line` closes a block opened with `fence`."""
    m = CLOSING.match(line)
    return m is not None and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)


def unclosed_fence(text: str) -> Optional[str]:
    """The line that closes the code block `text` leaves open (an answer stopped inside one): the opening
    fence with its indentation (a list item's block closed at column 0 would end the item and open another
    block); None when every block is closed."""
    opening: Optional[str] = None
    for line in text.split("\n"):
        if opening is None:
            m = FENCE.match(line)
            if m:
                opening = m.group(1) + m.group(2)
        elif closes(line, opening.lstrip(" ")):
            opening = None
    return opening
