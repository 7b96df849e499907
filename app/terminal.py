"""Text from outside the program printed to a terminal: a chat's title from an imported file, a file's name from
the models folder. Their control characters are printed as escapes: an ESC sequence (\\x1b]0;…\\x07, \\x1b[2J)
in a title from someone else's chat file retitled or cleared the user's terminal, a tab split the columns of
`gapless chats list`, and a bidi control reorders what follows it on the line."""

from __future__ import annotations

import unicodedata

BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def printable(text: str) -> str:
    """`text` with each control character (C0, DEL, C1), line or paragraph separator and bidi control written as
    its Python escape (\\x1b, \\t, \\u202e); everything else as it is."""
    return "".join(_escaped(ch) if _control(ch) else ch for ch in text)


def _control(ch: str) -> bool:
    return unicodedata.category(ch) in ("Cc", "Zl", "Zp") or ch in BIDI_CONTROLS


def _escaped(ch: str) -> str:
    return ascii(ch)[1:-1]
