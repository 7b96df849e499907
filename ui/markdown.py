"""Message bodies: markdown prose and fenced code blocks (monospace, cheap highlighting, a copy button).

A body is split into segments at code fences; prose segments render as markdown in an auto-height text view,
code segments in their own block. While an answer streams, new text is appended as plain text and the
markdown is rendered again only on a timer (a few times a second), never once per batch.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Optional

from PySide6.QtCore import QByteArray, QEvent, QPoint, QRegularExpression, QSize, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QColor,
    QDesktopServices,
    QFontDatabase,
    QGuiApplication,
    QHelpEvent,
    QImage,
    QPalette,
    QSyntaxHighlighter,
    QTextBlock,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextFormat,
    QTextOption,
)
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QSizePolicy,
    QTextBrowser,
    QToolButton,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from app.fences import FENCE, closes
from app.thinking import thinking_as_quote
from ui.parts import LONG_WORD, has_long_word
from ui.plain_text import show_tip
from ui.theme import LIGHT, Colors

MARKDOWN_FEATURES = QTextDocument.MarkdownFeature.MarkdownDialectGitHub | QTextDocument.MarkdownFeature.MarkdownNoHTML
RENDER_INTERVAL_MS = 250  # markdown of a streaming body is rendered at most 4 times a second
# ... and a render that takes long waits this many times its own time before the next one: a streamed list of
# 3,000 items took 1.3 s a render (Qt's markdown reader grows faster than the text), 4 times a second froze the
# window; this way rendering keeps at most about a fifth of the GUI thread, the text between renders shown plain
RENDER_SHARE = 4
_clock = time.perf_counter  # what a render is timed with
CODE_MAX_LINES = 28  # taller code blocks scroll inside themselves


# A prose segment whose tables have more cells than this is shown as its plain text: Qt lays a table out cell by
# cell, and 1,000 rows took 4.9 s, 199 rows of 60 columns 5.2 s
TABLE_CELLS_DRAWN = 2_000
_TABLE_ROW = re.compile(r"(?m)^ {0,3}\|.*$")


def table_cells(text: str) -> int:
    """About how many cells the tables of `text` have: each table row's cells, counted by its bars."""
    return sum(max(row.count("|") - 1, 1) for row in _TABLE_ROW.findall(text))


MAX_SEGMENTS = 100  # code blocks and prose between them, each a widget; past this the rest is one prose view


@dataclass(frozen=True)
class Segment:
    kind: str  # "prose" | "code"
    text: str
    lang: str = ""
    closed: bool = True  # False for a code block whose closing fence has not arrived (yet)


_WRITTEN_BREAK = re.compile(r"(?<=\S) {2,}\n")  # a hard break in markdown as written
# the other way to write one: a backslash at the end of a line (an odd number of them: "\\\\" is a backslash) that
# the next line's text continues; before a blank line, a list item, a heading, a quote or a fence, the block
# ends there and the backslash is text
_BACKSLASH_BREAK = re.compile(
    r"(?<=[^\s\\])((?:\\\\)*)\\\n"
    r"(?![ \t]*(?:\n|$|[-+*](?:[ \t]|$)|\d{1,9}[.)](?:[ \t]|$)|#{1,6}(?:[ \t]|$)|>|```|~~~))"
)


def _spaces_for_backslashes(prose: str) -> str:
    """Each hard break written with a backslash written with two spaces instead: the same break."""
    return _BACKSLASH_BREAK.sub(r"\1  \n", prose)


def hard_breaks(prose: str) -> str:
    """Each single line break of a prose segment kept as a line break. CommonMark joins the lines of a paragraph
    (a poem, an address, a list of steps without markers would run together), which is not how a chat model means
    them, and not how the answer looked while it streamed as plain text; two trailing spaces make a hard break.
    A break the answer wrote with a backslash stays a break (two spaces after the backslash made it a backslash
    shown at the end of the line). Fenced code has its own segments (split_markdown); the code that stays in the
    prose, an indented block or a fence inside a quote, keeps its lines as written (each took two spaces, copied
    with it)."""
    prose = _spaces_for_backslashes(prose)
    lines = prose.split("\n")
    code = _code_lines(lines)
    out = []
    for i, line in enumerate(lines):
        body = line.rstrip(" \t")
        if i + 1 < len(lines) and lines[i + 1] and body and i not in code:
            line = body + "  "
        out.append(line)
    return "\n".join(out)


_QUOTED_FENCE = re.compile(r"^ {0,3}>[ >]*(`{3,}|~{3,})")


def _code_lines(lines: list[str]) -> set[int]:
    """The lines of `lines` (a prose segment) that are code: an indented code block's (four spaces past the list
    item they are in, after a blank line or more such lines) and those inside a fenced block within a quote."""
    code: set[int] = set()
    item, blank, quoted = 0, True, ""
    for i, line in enumerate(lines):
        m = _QUOTED_FENCE.match(line)
        if quoted:
            code.add(i)
            if m and m.group(1)[0] == quoted[0] and len(m.group(1)) >= len(quoted) and not line[m.end() :].strip():
                quoted = ""
            continue
        if m:
            quoted = m.group(1)
            code.add(i)
            continue
        indent = len(line) - len(line.lstrip(" "))
        if line.strip() and indent >= item + 4 and (blank or i - 1 in code):
            code.add(i)
        elif i - 1 in code and not line.strip():
            code.add(i)  # a blank line inside the block: it may go on
        else:
            item = _item_column(line, item, blank)
        blank = not line.strip()
    return code


def split_markdown(text: str) -> list[Segment]:
    """Prose and fenced code segments, in order. An unclosed fence runs to the end of the text."""
    segments: list[Segment] = []
    prose: list[str] = []
    code: list[str] = []
    fence: Optional[str] = None
    lang = ""
    indent = 0  # the opening fence's: as many leading spaces come off each line of its code (a list item's)
    item = 0  # the content column of the list item the prose is in (0: none): a fence may sit up to 3 past it
    inside = 0  # the open fence's container column: its closing fence is indented up to 3 past it
    blank = False
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if fence is None:
            m = FENCE.match(line)
            inside = marker = 0
            if m is None and item:
                m = _item_fence(item).match(line)
                inside = item if m else 0
            if m is None:  # "- ```python": a list item that opens with a code block, once it is closed
                m, marker = _marker_fence(line, lines[i + 1 :])
                inside = marker
            if m and len(segments) + 2 >= MAX_SEGMENTS:  # the rest in one prose view (3,000 fences: 3,000 widgets)
                prose.extend(lines[i:])
                break
            if m:
                if marker:  # the item's marker stays in the prose, an item whose content is the code below it
                    # (with a no-break space: a bare "-" under a paragraph would make it a heading)
                    prose.append(line[:marker].rstrip() + " \u00a0")
                    item, blank = marker, False
                if prose:
                    segments.append(Segment("prose", "\n".join(prose)))
                    prose = []
                indent, fence, lang, code = marker + len(m.group(1)), m.group(2), m.group(3), []
            else:
                prose.append(line)
                item, blank = _item_column(line, item, blank), not line.strip()
        else:
            if closes(line[min(inside, len(line) - len(line.lstrip(" "))) :], fence):
                segments.append(Segment("code", "\n".join(code), lang, True))
                fence = None
            else:
                code.append(line[min(indent, len(line) - len(line.lstrip(" "))) :])
    if fence is not None:
        segments.append(Segment("code", "\n".join(code), lang, False))
    elif prose:
        segments.append(Segment("prose", "\n".join(prose)))
    return [s for s in segments if s.kind == "code" or s.text.strip()]


_ITEM_MARKER = re.compile(r"( *)([-+*]|\d{1,9}[.)])( +|$)")


def _item_column(line: str, item: int, after_blank: bool) -> int:
    """The content column of the list item the prose is in after `line` (0: none), from the one before it: a
    marker line opens an item (its content starts 1 to 4 spaces past the marker); a line indented less than the
    item's content, after a blank line, ends it."""
    m = _ITEM_MARKER.match(line)
    if m:
        gap = len(m.group(3))
        return len(m.group(1)) + len(m.group(2)) + (gap if 1 <= gap <= 4 else 1)
    if line.strip() and after_blank and len(line) - len(line.lstrip(" ")) < item:
        return 0
    return item


def _marker_fence(line: str, after: list[str]) -> tuple[Optional[re.Match[str]], int]:
    """The fence a list item's marker line opens ("- ```python", "1. ~~~"), matched on the text after the
    marker, and the item's content column; (None, 0) where the line is no such thing, or where no line of `after`
    closes it. Read as prose, its closing fence, indented to the item's content, opened a code block that ran to
    the end of the answer; one not closed stays prose (Qt's reader ends it with the item, as CommonMark does,
    where a block running to the end would take the list's next items and what follows it)."""
    if _ITEM_MARKER.match(line) is None:
        return None, 0
    column = _item_column(line, 0, False)
    m = FENCE.match(line[column:])
    if m is None or m.group(1):
        return None, 0
    fence = m.group(2)
    if not any(closes(a[min(column, len(a) - len(a.lstrip(" "))) :], fence) for a in after):
        return None, 0
    return m, column


_ITEM_FENCES: dict[int, re.Pattern[str]] = {}


def _item_fence(column: int) -> re.Pattern[str]:
    """FENCE inside a list item whose content starts at `column`: indented `column` to `column` + 3 spaces."""
    if column not in _ITEM_FENCES:
        _ITEM_FENCES[column] = re.compile(FENCE.pattern.replace("{0,3}", f"{{{column},{column + 3}}}", 1))
    return _ITEM_FENCES[column]


# ---- code blocks --------------------------------------------------------------------------------------

_KEYWORDS = (
    "and as assert async await break case catch class const continue def del elif else enum except export extends "
    "false False final finally fn for from func function go if impl import in interface is lambda let loop match "
    "mod mut new nil None not null or package pass pub raise return self static struct super switch this throw "
    "trait true True try type typeof use var void while with yield int float double char bool string"
).split()
_HASH_COMMENT_LANGS = {
    "python",
    "py",
    "sh",
    "bash",
    "shell",
    "zsh",
    "ruby",
    "rb",
    "yaml",
    "yml",
    "toml",
    "r",
    "perl",
    "make",
    "makefile",
    "dockerfile",
    "ini",
    "conf",
    "powershell",
    "ps1",
    "",
}


class CodeHighlighter(QSyntaxHighlighter):
    """Keywords, strings, numbers and line comments: cheap, language-agnostic, good enough to read code."""

    def __init__(self, document: QTextDocument, lang: str, colors: Colors):
        super().__init__(document)
        lang = lang.lower()
        comment = (
            r"#[^\n]*"
            if lang in _HASH_COMMENT_LANGS
            else r"//[^\n]*|--[^\n]*"
            if lang in ("sql", "lua", "haskell")
            else r"//[^\n]*"
        )
        if lang == "":
            comment = r"#[^\n]*|//[^\n]*"
        self._patterns = [
            ("syn_keyword", QRegularExpression(r"\b(" + "|".join(_KEYWORDS) + r")\b")),
            ("syn_number", QRegularExpression(r"\b(0x[0-9a-fA-F]+|\d+(\.\d+)?([eE][-+]?\d+)?)\b")),
            ("syn_string", QRegularExpression(r"\"([^\"\\]|\\.)*\"|'([^'\\]|\\.)*'|`[^`]*`")),
            ("syn_comment", QRegularExpression(comment)),
        ]
        self._formats: dict[str, QTextCharFormat] = {}
        self.set_colors(colors)

    def set_colors(self, colors: Colors) -> None:
        for name, _ in self._patterns:
            f = QTextCharFormat()
            f.setForeground(QColor(getattr(colors, name)))
            if name == "syn_comment":
                f.setFontItalic(True)
            self._formats[name] = f
        self.rehighlight()

    def highlightBlock(self, text: str) -> None:
        # Later patterns win: a keyword inside a string or comment takes the string's or comment's colour.
        for name, rx in self._patterns:
            it = rx.globalMatch(text)
            while it.hasNext():
                m = it.next()
                self.setFormat(m.capturedStart(), m.capturedLength(), self._formats[name])


# Characters that reorder how text is drawn (the "Trojan Source" trick: code that reads one way and runs
# another): a code block shows each as its name, so what is seen is what Copy copies.
_BIDI_SHOWN = {
    c: f"\u27e8U+{c:04X}\u27e9" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C)
}


def shown_code(text: str) -> str:
    return text.translate(_BIDI_SHOWN)


class _CodeEdit(QPlainTextEdit):
    def wheelEvent(self, event) -> None:
        # Without its own vertical scroll range, let the conversation scroll instead of swallowing the wheel.
        if self.verticalScrollBar().maximum() == 0 and event.angleDelta().y() != 0:
            event.ignore()
            return
        super().wheelEvent(event)


class CodeBlock(QFrame):
    """A fenced code block: a header with the language and a Copy button over read-only monospace text."""

    kind = "code"
    copied = Signal(str)

    def __init__(self, segment: Segment, colors: Colors, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.setObjectName("codeBlock")
        self.lang = segment.lang
        header = QWidget(self)
        header.setObjectName("codeHeader")
        self._lang_label = QLabel(segment.lang or "code", header)
        self._lang_label.setObjectName("codeLang")
        self.copy_button = QToolButton(header)
        self.copy_button.setText("Copy")
        self.copy_button.setObjectName("codeCopy")
        self.copy_button.setToolTip("Copy this code to the clipboard")
        self.copy_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.copy_button.clicked.connect(self.copy)
        hl = QHBoxLayout(header)
        hl.setContentsMargins(10, 2, 4, 2)
        hl.addWidget(self._lang_label)
        hl.addStretch(1)
        hl.addWidget(self.copy_button)

        self.edit = _CodeEdit(self)
        self.edit.setObjectName("codeText")
        self.edit.setAccessibleName(f"{segment.lang} code" if segment.lang else "Code")  # a Tab stop: read by name
        self.edit.setReadOnly(True)
        self.edit.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.edit.setFrameShape(QFrame.Shape.NoFrame)
        self.edit.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.edit.setTextInteractionFlags(
            Qt.TextInteractionFlag.TextSelectableByMouse | Qt.TextInteractionFlag.TextSelectableByKeyboard
        )
        font = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
        self.edit.setFont(font)
        self._source = segment.text  # what Copy copies: the view changes no-break spaces, line separators, CRs
        self.edit.setPlainText(shown_code(segment.text))
        self._highlighter = CodeHighlighter(self.edit.document(), segment.lang, colors)
        self._reset_timer = QTimer(  # type: ignore[call-arg]  # the stubs omit the signal keywords Qt takes
            self, singleShot=True, interval=1500, timeout=lambda: self.copy_button.setText("Copy")
        )

        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        lay.addWidget(header)
        lay.addWidget(self.edit)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        self.edit.document().blockCountChanged.connect(self._fit_height)
        self.edit.horizontalScrollBar().rangeChanged.connect(self._fit_height)
        self._fit_height()

    @property
    def text(self) -> str:
        """The code as the answer wrote it."""
        return self._source

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.text)
        self.copy_button.setText("Copied")
        self._reset_timer.start()
        self.copied.emit(self.text)

    def update_segment(self, segment: Segment) -> None:
        old = self.text
        if segment.text == old:
            return
        if segment.text.startswith(old):
            self.append_text(segment.text[len(old) :])
        else:
            self._source = segment.text
            self.edit.setPlainText(shown_code(segment.text))

    def append_text(self, text: str) -> None:
        self._source += text
        cursor = QTextCursor(self.edit.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(shown_code(text))

    def set_colors(self, colors: Colors) -> None:
        self._highlighter.set_colors(colors)

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self._fit_height()  # the line height is known once the block is laid out

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit_height()  # a new width may add or remove the long lines' scroll bar

    def _fit_height(self, *_args) -> None:
        lines = min(max(self.edit.document().blockCount(), 1), CODE_MAX_LINES)
        # Without wrapping a block is one line; its laid-out height includes the leading a font metric omits.
        line = (
            self.edit.blockBoundingRect(self.edit.document().firstBlock()).height()
            or self.edit.fontMetrics().lineSpacing()
        )
        margins = self.edit.contentsMargins()
        frame = margins.top() + margins.bottom() + int(self.edit.document().documentMargin() * 2) + 2
        hbar = self.edit.horizontalScrollBar()
        scroll = hbar.sizeHint().height() if hbar.maximum() > 0 else 0  # room for a long line's scroll bar
        self.edit.setFixedHeight(int(lines * line) + frame + scroll)


# ---- prose --------------------------------------------------------------------------------------------


OPENED_SCHEMES = ("http", "https", "mailto")  # what a click on an answer's link may open, in the browser


class ProseView(QTextBrowser):
    """Markdown prose whose height follows its content, so the conversation scrolls as one page.

    The text is a model's or an imported chat's: nothing in it is loaded or followed on its own. An image is
    never read (QTextBrowser would read any local path: a FIFO hangs, /dev/zero ends the app), a click opens only
    a web or mail link, in the browser (never a file, a script or another program's scheme, nor anything into
    this view), and the pointer over a link shows where it goes, as plain text."""

    kind = "prose"

    def __init__(self, text: str = "", parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.setObjectName("prose")
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setOpenLinks(False)  # anchorClicked decides
        self.anchorClicked.connect(open_link)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.document().setDocumentMargin(2)
        self.document().documentLayout().documentSizeChanged.connect(self._fit_height)
        self.source_text = ""  # the text shown: drawn as markdown, then what was appended plain since
        self._drawn = ""  # the text last drawn as markdown
        self.set_markdown(text)

    def set_markdown(self, text: str) -> None:
        self.source_text = self._drawn = text
        self._wrap_for(text)
        if "|" in text and table_cells(text) > TABLE_CELLS_DRAWN:
            self.document().setPlainText(text)
        else:
            self.document().setMarkdown(hard_breaks(text), MARKDOWN_FEATURES)
            join_item_lines(self.document(), text)  # also where every break is written (two trailing spaces)
            images_as_text(self.document())

    def recolor_links(self) -> None:
        """The links drawn in the palette's link colour now: Qt's markdown reader gives each link the colour of
        when it was read, so after a switch of theme the links on screen kept the other theme's (dark blue on the
        dark background, 3.2:1)."""
        color = self.palette().color(QPalette.ColorRole.Link)
        doc = self.document()
        cursor = QTextCursor(doc)
        recolored = QTextCharFormat()
        recolored.setForeground(color)
        block = doc.begin()
        while block.isValid():
            it = block.begin()
            while not it.atEnd():
                fragment = it.fragment()
                if fragment.isValid() and fragment.charFormat().isAnchor():
                    cursor.setPosition(fragment.position())
                    cursor.setPosition(fragment.position() + fragment.length(), QTextCursor.MoveMode.KeepAnchor)
                    cursor.mergeCharFormat(recolored)
                it += 1
            block = block.next()

    def _wrap_for(self, text: str) -> None:
        """Break anywhere where a word is longer than a line could be (a hex dump, minified code): laying out one
        300 KB word at word boundaries took 3.3 s of the GUI thread, 0.2 s this way."""
        mode = (
            QTextOption.WrapMode.WrapAnywhere
            if has_long_word(text)
            else QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere
        )
        if self.wordWrapMode() != mode:
            self.setWordWrapMode(mode)

    def update_segment(self, segment: Segment) -> None:
        # against what was drawn as markdown, not what is shown: text appended plain is drawn again as markdown
        # (else a streamed list stayed a flat paragraph, and "Hello " + "world" read "Helloworld")
        # and against what is shown: a newline appended plain before a fence belongs to no prose segment, and stayed
        # on screen as an empty list item after the answer ended
        if segment.text != self._drawn or self.source_text != self._drawn:
            self.set_markdown(segment.text)

    def append_plain(self, text: str) -> None:
        """Append without parsing markdown: the cheap path between two renders of a streaming body."""
        self.source_text += text
        if self.wordWrapMode() != QTextOption.WrapMode.WrapAnywhere:
            self._wrap_for(self.source_text[-LONG_WORD - len(text) :])  # a word the new text ends or makes
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        first, *lines = text.split("\n")
        cursor.insertText(first)
        for line in lines:  # each new line a plain block: one that joins a list renumbers and lays out all its items
            cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
            cursor.insertText(line)

    def loadResource(self, kind: int, name: "QUrl | str", /) -> Any:
        """A blank for every image an answer names; nothing else is loaded."""
        if kind == QTextDocument.ResourceType.ImageResource.value:
            blank = QImage(1, 1, QImage.Format.Format_ARGB32)
            blank.fill(Qt.GlobalColor.transparent)
            return blank
        return QByteArray()

    def tooltip_at(self, pos: QPoint) -> str:
        """Where the link under the pointer goes (its title, the model's text, is not shown: it could say anything)."""
        return self.anchorAt(pos)

    def viewportEvent(self, event: QEvent) -> bool:
        # The view's own tooltips are a link's or an image's title, as rich text: only where a link goes is shown.
        if event.type() == QEvent.Type.ToolTip and isinstance(event, QHelpEvent):
            where = self.tooltip_at(event.pos())
            if where:
                show_tip(event.globalPos(), where, self.viewport())
            else:
                QToolTip.hideText()
            return True
        return super().viewportEvent(event)

    def wheelEvent(self, event) -> None:
        event.ignore()  # never scrolls itself; the conversation does

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        width = self.viewport().width()
        if self.document().textWidth() != width:  # setTextWidth lays the whole document out again, even unchanged:
            self.document().setTextWidth(width)  # each height a streamed line added did that (a long answer's lag)
        self._fit_height()

    def sizeHint(self) -> QSize:
        return QSize(super().sizeHint().width(), self.height())

    def _fit_height(self, *_args) -> None:
        h = int(self.document().size().height()) + 2 * self.frameWidth()
        if h != self.height():
            self.setFixedHeight(max(h, 1))


def join_item_lines(document: QTextDocument, text: str) -> None:
    """Qt makes each hard line break of markdown a new block, and a new block in a list is a new item: the second
    line of "1. step" became item 2, and every item after it was numbered one too high. The lines of one item
    (`document` is `text` with hard_breaks) go back into one block, each break a line separator. Found against
    `text` read without any breaks (its own too), whose items are the real ones; where the two do not line up, it is
    left as is."""
    broken = [b for b in _blocks(document) if b.textList() is not None]
    if not broken:
        return
    plain = QTextDocument()
    # a hard break the answer wrote itself (two trailing spaces, a backslash) split the item in `text` as well
    plain.setMarkdown(_WRITTEN_BREAK.sub("\n", _spaces_for_backslashes(text)), MARKDOWN_FEATURES)
    items = [b.text() for b in _blocks(plain) if b.textList() is not None]
    joins = []  # the blocks that continue the item before them
    at = 0
    for item in items:
        if at >= len(broken) or not item.startswith(broken[at].text()):
            return
        end = len(broken[at].text())  # how much of the item its lines so far give
        at += 1
        # each next line checked where it stands in the item: building the item up line by line was quadratic
        while end != len(item) and at < len(broken) and item.startswith(" " + broken[at].text(), end):
            end += 1 + len(broken[at].text())
            joins.append(broken[at])
            at += 1
        if end != len(item):
            return
    if at != len(broken):
        return
    cursor = QTextCursor(document)
    # one change for the view: a layout and a height fit at each join took 1.1 s of every render (4 a second while
    # it streams) for a list of 150 items of two lines, 0.8 s for one item of 200 lines
    cursor.beginEditBlock()
    for block in reversed(joins):  # from the end, so the positions before stay valid
        cursor.setPosition(block.position())
        cursor.deletePreviousChar()
        cursor.insertText("\u2028")
    cursor.endEditBlock()


def _blocks(document: QTextDocument) -> list[QTextBlock]:
    out = []
    block = document.begin()
    while block.isValid():
        out.append(block)
        block = block.next()
    return out


IMAGE_TEXT = "[image: {}]"  # an answer's image, never loaded, shown by its alt text
IMAGE_NO_ALT = "[image]"


def images_as_text(document: QTextDocument) -> None:
    """Each image of a markdown document replaced by its alt text, in italics. The image is never read, and a blank
    in its place left a reader with nothing where the answer had said something."""
    spots: list[tuple[int, QTextCharFormat]] = []
    block = document.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            if fragment.charFormat().isImageFormat():
                spots.extend((fragment.position() + i, fragment.charFormat()) for i in range(fragment.length()))
            it += 1
        block = block.next()
    for position, image in reversed(spots):  # from the end, so the positions before stay valid
        alt = str(image.property(QTextFormat.Property.ImageAltText) or "").strip()
        text = IMAGE_TEXT.format(" ".join(alt.split())) if alt else IMAGE_NO_ALT
        shown = QTextCharFormat()
        shown.setFontItalic(True)
        cursor = QTextCursor(document)
        cursor.setPosition(position)
        cursor.setPosition(position + 1, QTextCursor.MoveMode.KeepAnchor)
        cursor.insertText(text, shown)


def open_link(url: QUrl) -> bool:
    """Open an answer's web or mail link in the browser; anything else is left alone. True when opened."""
    if url.scheme().lower() not in OPENED_SCHEMES or not url.isValid():
        return False
    return QDesktopServices.openUrl(url)


class SegmentsView(QWidget):
    """The body of one message: prose and code segments, updated in place as the text grows."""

    def __init__(
        self,
        text: str = "",
        colors: Colors = LIGHT,
        parent: Optional[QWidget] = None,
        name: str = "Message",
        thinking: bool = False,
    ):
        """`thinking`: an answer, whose opening thinking (a reasoning model's "<think>…</think>") is shown as a
        quote headed "Thinking" before the answer (app.thinking), where the tags were shown as text."""
        super().__init__(parent)
        self._colors = colors
        self._thinking = thinking
        self._name = name  # what a screen reader calls each piece of prose (a Tab stop), e.g. "Answer"
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.setSpacing(6)
        self._widgets: list[CodeBlock | ProseView] = []
        self._text = ""
        self._rendered = ""  # the text the widgets show as rendered markdown
        self._code_takes_text = False  # whether a streamed delta may go into the last code block as it is
        self._render_timer = QTimer(  # type: ignore[call-arg]  # the stubs omit the signal keywords Qt takes
            self, singleShot=True, interval=RENDER_INTERVAL_MS, timeout=self._render
        )
        self.render_count = 0
        self.set_text(text)

    @property
    def text(self) -> str:
        return self._text

    def set_text(self, text: str) -> None:
        self._text = text
        self._render()

    def append(self, delta: str) -> None:
        """Streaming append: plain text into the last segment now, markdown at the next timer tick."""
        if not delta:
            return
        in_sync = len(self._rendered) == len(self._text)  # nothing waits for the next render
        self._text += delta
        last = self._widgets[-1] if self._widgets else None
        fence_risk = "`" in delta or "~" in delta
        takes_plain = isinstance(last, ProseView) or self._code_takes_text
        if last is not None and in_sync and not fence_risk and takes_plain:
            if isinstance(last, ProseView):
                last.append_plain(delta)
            else:
                last.append_text(delta)
            self._rendered = self._text
        if not self._render_timer.isActive():
            self._render_timer.start()

    def flush(self) -> None:
        """Render now (end of a stream)."""
        self._render_timer.stop()
        self._render()

    def _render(self) -> None:  # not `render`: that would hide QWidget.render(target, ...)
        started = _clock()
        try:
            self._render_now()
        finally:
            took_ms = (_clock() - started) * 1e3
            self._render_timer.setInterval(max(RENDER_INTERVAL_MS, round(RENDER_SHARE * took_ms)))

    def _render_now(self) -> None:
        self.render_count += 1
        segments = split_markdown(thinking_as_quote(self._text) if self._thinking else self._text)
        keep = 0
        for seg, w in zip(segments, self._widgets):
            if w.kind != seg.kind or (isinstance(w, CodeBlock) and w.lang != seg.lang):
                break
            w.update_segment(seg)
            keep += 1
        for w in self._widgets[keep:]:
            self._layout.removeWidget(w)
            w.deleteLater()
        del self._widgets[keep:]
        for seg in segments[keep:]:
            if seg.kind == "code":
                w = CodeBlock(seg, self._colors, self)
            else:
                w = ProseView(seg.text, self)
                w.setAccessibleName(self._name)
            self._layout.addWidget(w)
            self._widgets.append(w)
        self._rendered = self._text
        # text goes straight into the last code block only while it is open and past its fence's line: what
        # follows "```" may be the language, and what follows a closing fence is the next paragraph
        last = segments[-1] if segments else None
        self._code_takes_text = (
            last is not None
            and last.kind == "code"
            and not last.closed
            and (last.text != "" or self._text.endswith("\n"))
        )

    def code_blocks(self) -> list[CodeBlock]:
        return [w for w in self._widgets if isinstance(w, CodeBlock)]

    def set_colors(self, colors: Colors) -> None:
        self._colors = colors
        for w in self._widgets:
            if isinstance(w, CodeBlock):
                w.set_colors(colors)
            elif isinstance(w, ProseView):
                w.recolor_links()
