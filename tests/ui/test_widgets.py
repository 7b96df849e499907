"""The conversation widgets on their own: markdown splitting and streaming renders, code copy, composer keys,
the stats line, toggles and presets, chat settings validation, themes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from toggles_driver import pick, toggles_panel

from app.settings import CHAT_DEFAULTS
from engine.types import PRESETS, EngineOptions, SamplingParams, preset_options
from ui.composer import Composer
from ui.dialogs import ChatSettingsDialog
from ui.markdown import CodeBlock, ProseView, Segment, SegmentsView, split_markdown
from ui.stats import format_stats, preset_name
from ui.theme import LIGHT as LIGHT_COLORS


def test_split_markdown_prose_and_fences():
    text = "Intro\n\n```python\nx = 1\n```\nAfter\n~~~\nraw ``` inside\n~~~\n```sh\nopen"
    assert split_markdown(text) == [
        Segment("prose", "Intro\n"),
        Segment("code", "x = 1", "python"),
        Segment("prose", "After"),
        Segment("code", "raw ``` inside", ""),
        Segment("code", "open", "sh", closed=False),
    ]
    assert split_markdown("") == []


def test_fences_as_commonmark_reads_them():
    """A line opening with ```npm install``` was a fence (the rest of the answer became code and its words were
    lost); a fence indented 4 spaces inside the code closed it (prose and code swapped from there on); a list
    item's fence kept its indent in the code, so Copy gave Python an unexpected indent."""
    inline = "```npm install``` installs it.\nThen run it."
    assert split_markdown(inline) == [Segment("prose", inline)]
    doc = 'Code:\n```python\ndef f():\n    """\n    ```\n    """\n```\nDone.'
    assert split_markdown(doc) == [
        Segment("prose", "Code:"),
        Segment("code", 'def f():\n    """\n    ```\n    """', "python"),
        Segment("prose", "Done."),
    ]
    listed = "1. Build:\n   ```sh\n   make install\n     --prefix x\n   ```\n2. Run."
    assert split_markdown(listed)[1] == Segment("code", "make install\n  --prefix x", "sh")
    assert split_markdown("~~~\na\n```\n~~~") == [Segment("code", "a\n```", "")]  # the other character
    crlf = split_markdown("```py\r\nx = 1\r\n```\r\nafter the code\r\n")  # an imported or remote answer's CRLF
    assert [(seg.kind, seg.closed) for seg in crlf] == [("code", True), ("prose", True)]


def test_an_answer_of_thousands_of_code_blocks_is_a_hundred_widgets_at_most():
    """3,000 empty fences (24 KB) built 3,000 widgets, 5 s of the GUI thread; the rest is one prose view."""
    from ui.markdown import MAX_SEGMENTS

    text = "```\nx\n```\n" * 3000
    segments = split_markdown(text)
    assert len(segments) <= MAX_SEGMENTS and segments[-1].kind == "prose"
    assert sum(s.text.count("x") for s in segments) == 3000  # nothing lost


def test_a_long_word_breaks_anywhere_and_a_huge_table_is_plain_text(qtbot):
    """A 300 KB word took 3.3 s to lay out at word boundaries; a 1,000-row table 4.9 s as a table."""
    from PySide6.QtGui import QTextOption

    from ui.markdown import TABLE_CELLS_DRAWN

    view = ProseView("a normal answer")
    qtbot.addWidget(view)
    assert view.wordWrapMode() == QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere
    view.append_plain(" " + "f" * 300 + "0" * 300)
    assert view.wordWrapMode() == QTextOption.WrapMode.WrapAnywhere
    view.set_markdown("short words again")
    assert view.wordWrapMode() == QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere
    small = "| a | b |\n|---|---|\n| 1 | 2 |"
    view.set_markdown(small)
    assert view.toPlainText().count("|") == 0  # drawn as a table
    rows = TABLE_CELLS_DRAWN // 2
    big = "| a | b |\n|---|---|\n" + "\n".join(f"| {i} | {i} |" for i in range(rows))
    view.set_markdown(big)
    assert view.toPlainText() == big  # its text, as written
    wide = "|" + "|".join(f"h{c}" for c in range(60)) + "|\n|" + "---|" * 60 + "\n"
    wide += "\n".join("|" + "|".join(f"c{r}" for _ in range(60)) + "|" for r in range(40))  # 40 rows: 5.2 s at 199
    view.set_markdown(wide)
    assert view.toPlainText() == wide
    view.set_markdown(big[: big.index(f"| {TABLE_CELLS_DRAWN // 4} |")])  # half as many cells: a table
    assert view.toPlainText().count("|") == 0


def test_copy_gives_the_code_as_written_and_shows_what_reorders_it(qtbot):
    """Copy gave the view's text: no-break spaces as spaces, CRLF as LF; and right-to-left overrides drew
    `if a != "none" and a != "user"` while the second test was inside a comment in what was copied."""
    trojan = 'if access_level != "none\u202e \u2066// Check if admin\u2069 \u2066" {'
    code = "x\u00a0= 1\r\ny = 2\u2028" + trojan
    view = SegmentsView(f"```go\n{code}")  # still streaming
    qtbot.addWidget(view)
    block = view.code_blocks()[0]
    block.copy_button.click()
    assert QGuiApplication.clipboard().text() == code
    shown = block.edit.toPlainText()
    assert "\u202e" not in shown and "\u27e8U+202E\u27e9" in shown and "\u27e8U+2066\u27e9" in shown
    view.append("\nz = 3")  # streamed on: appended to what Copy copies too
    view.append("\n```")
    view.flush()
    assert view.code_blocks()[0].text == code + "\nz = 3"


def test_streaming_appends_without_rendering_every_batch(qtbot):
    view = SegmentsView("")
    qtbot.addWidget(view)
    view.show()
    text = "Here is **bold** text and code:\n```python\ndef f(x):\n    return x\n```\nDone."
    words = [text[i : i + 3] for i in range(0, len(text), 3)]
    start = view.render_count
    for w in words:
        view.append(w)
    assert view.text == text
    assert view.render_count - start <= 1  # one render was scheduled, none ran per batch
    qtbot.waitUntil(lambda: view.render_count - start >= 1, timeout=2000)
    kinds = [type(w) for w in view._widgets]
    assert kinds == [ProseView, CodeBlock, ProseView]
    code = view.code_blocks()[0]
    assert code.text == "def f(x):\n    return x"
    assert "bold" in view._widgets[0].toPlainText() and "**" not in view._widgets[0].toPlainText()


def test_text_streamed_after_a_render_is_drawn_as_markdown_too(qtbot):
    """Batches that arrive after the first render are appended plain, then drawn as markdown at the next render:
    a streamed list was left a flat paragraph with its ** marks, and "Hello " + "world" read "Helloworld"."""
    for batches, shown in (
        (["Here is a list:\n", "- **apples**\n", "- pears\n\n", "## Done"], "Here is a list:\napples\npears\nDone"),
        (["Hello ", "world"], "Hello world"),
    ):
        view = SegmentsView("")
        qtbot.addWidget(view)
        view.show()
        for b in batches:
            view.append(b)
            start = view.render_count
            qtbot.waitUntil(lambda v=view, n=start: v.render_count > n, timeout=2000)  # each batch after a render
        assert [w.toPlainText() for w in view._widgets] == [shown]
        again = SegmentsView("".join(batches))  # as the chat shows it when opened again
        qtbot.addWidget(again)
        assert again._widgets[0].toPlainText() == shown


def _shown(view: SegmentsView) -> list[tuple[str, ...]]:
    return [
        ("code", w.lang, w.text, w.edit.toPlainText()) if isinstance(w, CodeBlock) else ("prose", w.toPlainText())
        for w in view._widgets
    ]


def test_a_newline_streamed_before_a_fence_is_not_left_in_the_prose(qtbot):
    """A render that fell just before a lone "\n" token ahead of a fence: the newline was appended to the list
    plain, belonged to no prose segment, and stayed on screen as an empty item "3." after the answer ended."""
    text = "Steps:\n1. Install it\n2. Run it\n```bash\nmake\n```"
    whole = SegmentsView(text)
    view = SegmentsView("")
    qtbot.addWidget(whole)
    qtbot.addWidget(view)
    for batch in ["Steps", ":\n", "1", ".", " Install", " it", "\n", "2", ".", " Run", " it"]:
        view.append(batch)
    view.flush()  # the render timer fires here
    for batch in ["\n", "```", "bash", "\n", "make", "\n", "```"]:
        view.append(batch)
    view.flush()  # the stream's end
    assert _shown(view) == _shown(whole)
    assert view._widgets[0].toPlainText() == "Steps:\nInstall it\nRun it"


def test_text_after_a_fence_waits_for_the_render_that_places_it(qtbot):
    """Between two renders the language after "```" showed as the block's code, and the paragraph after the
    closing fence inside the block (a Copy then gave it too)."""
    view = SegmentsView("")
    qtbot.addWidget(view)
    for batch in ["Here:\n", "```"]:
        view.append(batch)
    view.flush()
    for batch in ["python", "\n", "print", "(1)", "\n"]:
        view.append(batch)
    assert [w.text for w in view.code_blocks()] == [""]  # not "python\nprint(1)\n" before the render
    view.flush()
    view.append("```")
    view.flush()
    for batch in ["\n", "That", " prints", " one."]:
        view.append(batch)
    assert view.code_blocks()[0].text == "print(1)"
    view.flush()
    assert _shown(view) == [
        ("prose", "Here:"),
        ("code", "python", "print(1)", "print(1)"),
        ("prose", "That prints one."),
    ]
    view.append("\n```sh\n")
    view.flush()
    renders = view.render_count
    for batch in ["ls", " -l", "\n", "pwd"]:  # inside an open block past its fence's line: straight in
        view.append(batch)
    assert view.code_blocks()[1].text == "ls -l\npwd" and view.render_count == renders


@pytest.mark.parametrize(
    "text, code",
    [
        (
            "1. Install:\n    ```bash\n    pip install -r requirements.txt\n    python -m build\n    ```\n2. Run it.",
            "pip install -r requirements.txt\npython -m build",
        ),
        (
            "- Python:\n  - in a file:\n       ```py\n       def f():\n           return 1\n       ```\n",
            "def f():\n    return 1",
        ),
    ],
)
def test_a_fence_indented_under_a_list_item_is_a_code_block(qtbot, text, code):
    """CommonMark puts a fence indented up to 3 past a list item's content in the item; it stayed in the prose,
    without a Copy button, each line ending in the two spaces of a hard break when copied."""
    view = SegmentsView(text)
    qtbot.addWidget(view)
    assert [w.text for w in view.code_blocks()] == [code]
    assert not any(
        "  \n" in w.toPlainText() or "```" in w.toPlainText() for w in view._widgets if isinstance(w, ProseView)
    )


@pytest.mark.parametrize(
    "text, code, after",
    [
        ("Steps:\n\n- ```python\n  print(1)\n  ```\n- Then restart the **server**.\n- Done.", "print(1)", "- Then"),
        ("1. ```bash\n   pip install x\n   ```\n2. Run it", "pip install x", "2. Run it"),
        ("- a\n  - ```py\n    code\n    ```\n- b", "code", "- b"),
        ("- ```python\nprint(1)\n```\n- next", "print(1)", "- next"),  # the code not indented, as models write it
    ],
)
def test_a_list_item_that_opens_with_a_fence_holds_the_code_and_the_list_goes_on(qtbot, text, code, after):
    """A fence on a list item's marker line ("- ```python") stayed prose, and its closing fence, indented to the
    item, opened a code block that took the rest of the answer ("- Then restart the **server**." shown as code)."""
    segments = split_markdown(text)
    assert [s.text for s in segments if s.kind == "code"] == [code]
    assert segments[-1].kind == "prose" and segments[-1].text.startswith(after)
    view = SegmentsView(text)
    qtbot.addWidget(view)
    assert [w.text for w in view.code_blocks()] == [code]


def test_a_list_item_fence_under_a_paragraph_leaves_it_a_paragraph_and_one_never_closed_stays_prose(qtbot):
    """The item's marker left in the prose was a bare "-": under "Install it:" it made the line a heading. A
    fence never closed took the list's next items and the paragraph after it as code; it stays prose, which
    Qt's reader ends with the item."""
    segments = split_markdown("Install it:\n- ```bash\n  pip install x\n  ```\n- then run it")
    view = ProseView(segments[0].text)
    qtbot.addWidget(view)
    block = view.document().begin()
    assert block.text() == "Install it:" and block.blockFormat().headingLevel() == 0
    assert block.next().textList() is not None  # the item, its content the code below it
    unclosed = "- ```python\n  print(1)\n- next item\n\nMore prose after the list."
    assert split_markdown(unclosed) == [Segment("prose", unclosed)]


def test_a_fence_indented_four_outside_a_list_is_text(qtbot):
    view = SegmentsView("Para\n\n    ```\n    indented code\n")
    qtbot.addWidget(view)
    assert view.code_blocks() == []


def test_lines_streamed_after_a_long_list_leave_the_list_as_it_is(qtbot):
    """Between renders, each streamed line joined the list above it (a new item, numbered, all items laid out
    again), and each height it added set the document's width again (the whole document laid out again): a list
    of 1,200 items took 28 s of the GUI thread to stream, 4.5 s without these (2-core CPU, offscreen)."""
    view = ProseView("".join(f"{i}. item {i}\n" for i in range(1, 41)))
    qtbot.addWidget(view)
    view.resize(500, 100)
    view.show()
    widths: list[float] = []
    document = view.document()
    set_width = document.setTextWidth
    document.setTextWidth = lambda w: (widths.append(w), set_width(w))  # type: ignore[method-assign]
    for i in range(41, 46):
        view.append_plain(f"\n{i}. item {i}")
        QGuiApplication.processEvents()
    assert widths == [] and view.height() > 100
    last = document.lastBlock()
    assert last.text() == "45. item 45" and last.textList() is None  # shown as written until the next render
    assert view.toPlainText().endswith("item 40\n41. item 41\n42. item 42\n43. item 43\n44. item 44\n45. item 45")


def test_a_render_that_takes_long_spaces_out_the_next_ones(qtbot, monkeypatch):
    import ui.markdown

    view = SegmentsView("")
    qtbot.addWidget(view)
    clock = iter([10.0, 11.5])  # a render of 1.5 s
    monkeypatch.setattr(ui.markdown, "_clock", lambda: next(clock))
    view.append("1. a long list\n")
    view.flush()
    assert view._render_timer.interval() == 4 * 1500
    clock = iter([20.0, 20.01])
    view.flush()
    assert view._render_timer.interval() == ui.markdown.RENDER_INTERVAL_MS


def test_code_block_copy_puts_the_code_on_the_clipboard(qtbot):
    view = SegmentsView("Text\n```js\nconsole.log('hi');\n```")
    qtbot.addWidget(view)
    block = view.code_blocks()[0]
    block.copy_button.click()
    assert QGuiApplication.clipboard().text() == "console.log('hi');"
    assert block.copy_button.text() == "Copied"


def test_markdown_html_is_shown_as_text(qtbot):
    view = SegmentsView("Use a <div> here")
    qtbot.addWidget(view)
    assert "<div>" in view._widgets[0].toPlainText()


def test_an_answer_s_image_is_never_read(qtbot, tmp_path, monkeypatch):
    """`![x](/path)` had the view read the file on the GUI thread as it laid the answer out: a FIFO hung the app,
    /dev/zero ended it, and any local image could draw a fake part of the window."""
    from PySide6.QtWidgets import QTextBrowser

    read: list[str] = []
    real = QTextBrowser.loadResource
    monkeypatch.setattr(
        QTextBrowser, "loadResource", lambda self, kind, url: read.append(str(url)) or real(self, kind, url)
    )
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"\x89PNG" + b"0" * 100)
    view = SegmentsView(f"A picture:\n\n![chart]({secret})\n\nand ![r](notes.txt), ![w](https://example.com/x.png)")
    qtbot.addWidget(view)
    view.resize(600, 400)
    view.show()
    qtbot.waitExposed(view)
    assert read == []
    assert "A picture:" in view.text


def test_an_answer_s_image_is_shown_by_its_alt_text(qtbot):
    """An image was drawn as a transparent pixel: where the answer showed a chart or a diagram the reader saw
    nothing, not even that something was there. Its alt text is shown instead, as plain text."""
    view = SegmentsView("Before ![a  bar chart of <b>sales</b>](chart.png) after\n\n![y](y.png)![z](z.png)")
    qtbot.addWidget(view)
    prose = view._widgets[0]
    assert prose.toPlainText() == "Before [image: a bar chart of <b>sales</b>] after\n[image: y][image: z]"
    assert "\ufffc" not in prose.toPlainText()  # no object (image) character left


@pytest.mark.parametrize(
    "url, opened",
    [
        ("https://example.com/docs", True),
        ("mailto:someone@example.com", True),
        ("file:///etc/passwd", False),
        ("/etc/passwd", False),
        ("README.md", False),
        ("javascript:alert(1)", False),
        ("vscode://file/etc/passwd", False),
        ("ms-msdt:/id PCWDiagnostic", False),
        ("smb://host/share", False),
        ("data:text/html,<b>x</b>", False),
    ],
)
def test_a_click_on_an_answer_s_link_opens_only_web_and_mail_links(qtbot, monkeypatch, url, opened):
    """Every scheme went to the desktop's handler, and a local path replaced the answer with the file's text."""
    from PySide6.QtCore import QPoint
    from PySide6.QtGui import QDesktopServices, QTextCursor

    handed: list[str] = []
    monkeypatch.setattr(QDesktopServices, "openUrl", lambda u: handed.append(u.toString()) or True)
    view = ProseView(f"see [the link]({url.replace(' ', '%20')}) here")
    qtbot.addWidget(view)
    view.resize(400, 100)
    view.show()
    qtbot.waitExposed(view)
    before = view.toPlainText()
    cursor = QTextCursor(view.document())
    cursor.setPosition(before.index("the link") + 3)
    at = view.cursorRect(cursor).center() + QPoint(0, 0)
    assert view.anchorAt(at)  # the pointer is on the link
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, pos=at)
    assert bool(handed) == opened and view.toPlainText() == before


def test_text_from_outside_is_never_drawn_as_html(qtbot):
    """A label or tooltip with an imported chat's or a model's text drew HTML: a fake "You", a fake link, a
    local image read on the GUI thread (a chat title, an answer's finish reason, a model's name, a code fence's
    language, an error quoting the bad field)."""
    from PySide6.QtCore import QEvent, QPoint
    from PySide6.QtGui import QHelpEvent
    from PySide6.QtWidgets import QApplication, QLabel, QToolTip

    from ui.plain_text import install

    install(QApplication.instance())
    html = "<b>You</b><img src='/dev/zero'>"
    label = QLabel(html)
    label.setToolTip(html)
    qtbot.addWidget(label)
    label.show()
    qtbot.waitExposed(label)
    assert label.textFormat() == Qt.TextFormat.PlainText
    QApplication.sendEvent(label, QHelpEvent(QEvent.Type.ToolTip, QPoint(2, 2), label.mapToGlobal(QPoint(2, 2))))
    assert "&lt;b&gt;You&lt;/b&gt;" in QToolTip.text()  # shown as the text it is
    QToolTip.hideText()
    block = CodeBlock(Segment("code", "x = 1", "<h1>You</h1>"), LIGHT_COLORS)
    qtbot.addWidget(block)
    block.show()
    assert block._lang_label.textFormat() == Qt.TextFormat.PlainText


def test_a_tooltip_window_shows_the_tip_s_text_not_its_markup(qtbot):
    """Every tooltip in the app read "<p>Copy this code to the clipboard</p>": the plain-text rule for labels also
    made Qt's own tooltip label show the escaped HTML it is given as text, its spaces no-break ones that never
    wrapped. What the window shows is the tip's text, markup in the tip itself included, and a long tip wraps."""
    from PySide6.QtCore import QEvent, QPoint
    from PySide6.QtGui import QHelpEvent, QTextDocument
    from PySide6.QtWidgets import QApplication, QLabel, QPushButton, QToolTip

    from ui.plain_text import install

    install(QApplication.instance())
    button = QPushButton("Copy")
    qtbot.addWidget(button)
    button.show()
    qtbot.waitExposed(button)
    for tip in ("Copy this code to the clipboard", "a <b>model</b> said & so " + "word " * 60):
        button.setToolTip(tip)
        QToolTip.hideText()
        QApplication.sendEvent(button, QHelpEvent(QEvent.Type.ToolTip, QPoint(3, 3), button.mapToGlobal(QPoint(3, 3))))
        labels = [w for w in QApplication.topLevelWidgets() if w.metaObject().className() == "QTipLabel"]
        shown = [w for w in labels if isinstance(w, QLabel) and w.isVisible()]
        assert len(shown) == 1
        label = shown[0]
        assert label.textFormat() != Qt.TextFormat.PlainText
        doc = QTextDocument()
        doc.setHtml(label.text())
        assert " ".join(doc.toPlainText().split()) == " ".join(tip.split())  # the text, no tags, no image
        assert "\xa0" not in doc.toPlainText()  # ordinary spaces: the label can wrap at them
    assert label.width() < label.fontMetrics().horizontalAdvance(tip)  # the long one wrapped
    QToolTip.hideText()


def test_every_kind_of_tooltip_still_shows_as_plain_text(qtbot):
    """The plain-text tooltips must not lose the ones Qt finds beyond a widget's own: a spin box's over its
    text, a tab's, a header section's, a menu action's, where an answer's link goes."""
    from PySide6.QtCore import QEvent, QPoint
    from PySide6.QtGui import QAction, QHelpEvent, QStandardItemModel
    from PySide6.QtWidgets import QApplication, QDoubleSpinBox, QLineEdit, QMenu, QTableView, QTabWidget, QToolTip

    from ui.plain_text import install

    install(QApplication.instance())

    def tip_over(widget, pos=None) -> str:
        pos = QPoint(3, 3) if pos is None else pos
        QToolTip.hideText()
        QApplication.sendEvent(widget, QHelpEvent(QEvent.Type.ToolTip, pos, widget.mapToGlobal(pos)))
        return QToolTip.text()

    spin = QDoubleSpinBox()
    spin.setToolTip("0 = greedy <always> the most likely token")
    tabs = QTabWidget()
    tabs.addTab(QLineEdit(), "Live")
    tabs.setTabToolTip(0, "the <b>live</b> figures")
    model = QStandardItemModel(1, 1)
    model.setHeaderData(0, Qt.Orientation.Horizontal, "higher is <better>", Qt.ItemDataRole.ToolTipRole)
    table = QTableView()
    table.setModel(model)
    menu = QMenu()
    menu.setToolTipsVisible(True)
    action = QAction("a.gguf", menu)
    action.setToolTip("/models/<a>.gguf")
    menu.addAction(action)
    prose = ProseView('see [the docs](https://example.com/x "<b>Session expired</b>") now')
    for w in (spin, tabs, table, menu, prose):
        qtbot.addWidget(w)
        w.resize(300, 120)
        w.show()
        qtbot.waitExposed(w)
    assert "&lt;always&gt;" in tip_over(spin.findChild(QLineEdit))  # from the spin box, as plain text
    assert "&lt;b&gt;live" in tip_over(tabs.tabBar(), tabs.tabBar().tabRect(0).center())
    header = table.horizontalHeader()
    assert "&lt;better&gt;" in tip_over(header.viewport(), QPoint(header.sectionViewportPosition(0) + 3, 3))
    assert "/models/&lt;a&gt;.gguf" in tip_over(menu, menu.actionGeometry(action).center())
    cursor = prose.cursorForPosition(QPoint(0, 0))
    cursor.setPosition(prose.toPlainText().index("the docs") + 2)
    at = prose.cursorRect(cursor).center()
    shown = tip_over(prose.viewport(), at)
    assert "https://example.com/x" in shown and "Session" not in shown


def test_a_rendered_answer_keeps_its_line_breaks(qtbot):
    """As it looked while streaming as plain text: a poem's lines stay lines once the markdown is rendered
    (CommonMark would join them into one paragraph); lists, tables and code render as before."""
    text = (
        "Roses are red,\nviolets are blue.\n\n- one\n- two\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n```\nx = 1\ny = 2\n```"
    )
    view = SegmentsView(text)
    qtbot.addWidget(view)
    prose, code = view._widgets[0], view._widgets[1]
    assert prose.toPlainText().startswith("Roses are red,\nviolets are blue.\none\ntwo\na\nb\n1\n2")
    assert prose.document().toMarkdown().count("|") >= 6  # still a table
    assert code.text == "x = 1\ny = 2"
    assert prose.source_text.startswith("Roses are red,\nviolets")  # what was written, for copying


def test_a_list_item_of_two_lines_stays_one_item(qtbot):
    """Each kept line break was a new block, and a new block in a list a new item: an item's second line was
    numbered as an item of its own, and the items after it one too high ("2. Run it" showed as "3.")."""
    view = SegmentsView(
        "1. Install the package\n   with pip, not conda\n2. Run it\n\n- a bullet\n  wrapped by hand\n- next"
    )
    qtbot.addWidget(view)
    doc = view._widgets[0].document()
    items = []
    block = doc.begin()
    while block.isValid():
        items.append((block.text(), block.textList().itemText(block)))
        block = block.next()
    assert items == [
        ("Install the package\u2028with pip, not conda", "1."),
        ("Run it", "2."),
        ("a bullet\u2028wrapped by hand", items[2][1]),
        ("next", items[2][1]),
    ]
    assert doc.toPlainText().startswith("Install the package\nwith pip, not conda\nRun it")  # the line still breaks


@pytest.mark.parametrize(
    "text", ["1. Install it  \n   with pip\n2. Run it", "1. Install it  \n   with pip  \n2. Run it"]
)
def test_a_list_item_with_a_hard_break_written_in_it_stays_one_item(qtbot, text):
    """A break the answer wrote itself (two trailing spaces) split the item as a plain line break did: "Run it"
    showed as item 3."""
    view = ProseView(text)
    qtbot.addWidget(view)
    doc = view.document()
    items = [(b.text(), b.textList().itemText(b)) for b in (doc.begin(), doc.begin().next())]
    assert doc.blockCount() == 2 and items == [("Install it\u2028with pip", "1."), ("Run it", "2.")]


@pytest.mark.parametrize("end", ["\\", "\\\\\\"], ids=["break", "backslash-then-break"])
def test_a_hard_break_written_with_a_backslash_breaks_the_line_and_keeps_the_item(qtbot, end):
    """A break written with a backslash ("line\\" and a new line) had two spaces put after it, which made it a
    backslash shown at the end of the line; in a list, its next line showed as an item of its own ("Run it" showed
    as item 3). A backslash that ends its block ("with pip\\" before the next item), or is written twice, is text."""
    view = ProseView(f"1. Install it{end}\n   with pip\\\n2. Run it\n\nRoses are red{end}\nviolets blue")
    qtbot.addWidget(view)
    doc = view.document()
    shown = end[:-1].replace("\\\\", "\\")  # three backslashes: one written as two, then the break
    items = [(b.text(), b.textList().itemText(b)) for b in (doc.begin(), doc.begin().next())]
    assert items == [(f"Install it{shown}\u2028with pip\\", "1."), ("Run it", "2.")]
    assert doc.toPlainText().endswith(f"Roses are red{shown}\nviolets blue")


def test_the_lines_of_a_long_list_are_joined_in_one_change(qtbot):
    """Each join of an item's lines was a change of its own, laid out and fitted in height at once: a list of 150
    items of two lines took 1.1 s of every render of the answer (4 a second while it streams)."""
    view = ProseView("")
    qtbot.addWidget(view)
    changes = []
    view.document().contentsChanged.connect(lambda: changes.append(1))
    view.set_markdown("".join(f"{i}. step {i}\n   then check it\n" for i in range(1, 151)))
    doc = view.document()
    assert doc.blockCount() == 150 and doc.lastBlock().text() == "step 150\u2028then check it"
    assert len(changes) <= 3  # the markdown set (cleared, then filled) and the joins; it was 152


@pytest.mark.parametrize(
    "send_with, key, mods, sends",
    [
        ("enter", Qt.Key.Key_Return, Qt.KeyboardModifier.NoModifier, True),
        ("enter", Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier, False),
        ("ctrl+enter", Qt.Key.Key_Return, Qt.KeyboardModifier.NoModifier, False),
        ("ctrl+enter", Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier, True),
        ("ctrl+enter", Qt.Key.Key_Enter, Qt.KeyboardModifier.ShiftModifier, False),
    ],
)
def test_composer_send_keys(qtbot, send_with, key, mods, sends):
    c = Composer(send_with)
    qtbot.addWidget(c)
    sent = []
    c.sendRequested.connect(sent.append)
    c.set_text("hello")
    c.edit.moveCursor(c.edit.textCursor().MoveOperation.End)
    qtbot.keyClick(c.edit, key, mods)
    if sends:
        assert sent == ["hello"] and c.text() == "hello"  # kept until the receiver has stored it
        c.clear()
        assert c.text() == ""
    else:
        assert sent == [] and c.text() == "hello\n"


def test_composer_does_not_send_blank_or_while_generating(qtbot):
    c = Composer()
    qtbot.addWidget(c)
    sent = []
    c.sendRequested.connect(sent.append)
    c.set_text("   ")
    c.send_button.click()
    c.set_text("\x00\x00 \x00\n")  # NULs the prompt drops: sent, it made a chat with an invisible title, then failed
    qtbot.keyClick(c.edit, Qt.Key.Key_Return)
    c.set_text("hi")
    c.set_generating(True)
    qtbot.keyClick(c.edit, Qt.Key.Key_Return)
    assert sent == []
    assert c.stop_button.isVisibleTo(c) and not c.send_button.isVisibleTo(c)
    c.set_can_send(False, "No model loaded")
    assert c.hint.text() == "No model loaded"


def test_the_hint_for_an_answer_in_another_chat_quotes_its_title_short(qtbot):
    """A 1,000-character title was quoted whole in the hint (169 px of the window's height) and the Stop tip."""
    c = Composer()
    qtbot.addWidget(c)
    c.set_generating(True)
    c.set_answering_elsewhere("Trip\nplan " + "x" * 1000)
    quoted = "Trip plan " + "x" * 29 + "…"
    assert c.hint.text() == f"Answering in “{quoted}”: Esc stops it; send here once it ends"
    assert c.stop_button.toolTip() == f"Stop the answer in “{quoted}”"


def test_stats_line_of_a_remote_answer_shows_the_client_s_timings_and_rounds_honestly():
    metrics = {"new_tokens_total": 10, "http_ttft_ms": 313.1, "http_decode_tok_s": 6.62, "unavailable": {}}
    metrics["unavailable"]["ttft_ms"] = "the model runs on a remote server; measured there, not here"
    line, tip = format_stats(metrics, None, None)
    assert line.startswith("10 tokens · TTFT (HTTP) 313 ms · 6.6 tok/s (HTTP) · ")
    assert "Time to first token (HTTP): 313 ms — source: client-side timing over HTTP" in tip
    assert "Decode (HTTP): 6.6 tok/s — source: client-side timing over HTTP" in tip
    near = {"new_tokens_total": 1000, "ttft_ms": 0.4, "decode_tok_s": 50.0, "kernel_gap_pct": 0.04}
    spec = {**near, "acceptance_rate": 0.996, "tokens_per_step": 4.9}
    line, _ = format_stats(spec, EngineOptions(speculation="ngram").to_dict(), "cuda")
    assert "TTFT <1 ms" in line and "kernel gap <0.1%" in line and ">99% accepted" in line


def test_an_answer_s_drafts_line_says_how_many_steps_drafting_paused():
    """The steps the adaptive draft length held back drafts in were not told apart from the other plain steps."""
    from engine.types import GenerationMetrics

    m = GenerationMetrics(new_tokens_total=40, new_tokens=[40], decode_steps=30, ttft_ms=12.0)
    for key, value in (("drafted_tokens", 20), ("accepted_tokens", 5), ("verify_steps", 6), ("acceptance_rate", 0.25)):
        m.put(key, value, "draft model, adaptive k")
    options = EngineOptions(device="cpu", speculation="draft").to_dict()
    drafts = [line for line in format_stats(m.to_dict(), options, "cpu")[1].splitlines() if "Drafts" in line]
    assert drafts == ["Drafts accepted: 25.0% (5 of 20 drafts, 6 verify steps) — source: draft model, adaptive k"]
    m.put("paused_steps", 19, "draft model, adaptive k")
    drafts = [line for line in format_stats(m.to_dict(), options, "cpu")[1].splitlines() if "Drafts" in line]
    assert drafts == [
        "Drafts accepted: 25.0% (5 of 20 drafts, 6 verify steps, 19 held back while drafts did not pay) — source: "
        "draft model, adaptive k"
    ]
    # and in the HUD's compare table, with its source, or why it is n/a
    from engine.speculative import speculation_off
    from ui.hud.compare_table import COLUMN_INDEX, CompareModel, CompareRow

    off = GenerationMetrics(new_tokens_total=40, new_tokens=[40], decode_steps=40)
    speculation_off(off)
    table = CompareModel()
    table.add(CompareRow(1, "drafted", EngineOptions(device="cpu", speculation="draft"), m))
    table.add(CompareRow(2, "plain", EngineOptions(device="cpu"), off))
    cells = [table.index(r, COLUMN_INDEX["paused_steps"]) for r in (0, 1)]
    assert [table.data(c) for c in cells] == ["19", "n/a"]
    tips = [table.data(c, Qt.ItemDataRole.ToolTipRole) for c in cells]
    assert "draft model, adaptive k" in tips[0] and tips[1] == "n/a — speculation off"


def test_an_answer_whose_speculation_did_not_run_says_why_under_it():
    """Drafting asked for and not run (a draft model refused): the answer's options say speculation off, and its
    stats tooltip had no drafts line at all, so the reason its figures keep was not shown there."""
    from engine.types import GenerationMetrics
    from ui.hud.compare_table import COLUMN_INDEX, CompareModel, CompareRow

    why = "speculation off: the draft model could not be loaded: model not found: /m/small.gguf"
    m = GenerationMetrics(new_tokens_total=8, new_tokens=[8], ttft_ms=12.0)
    m.mark_na("acceptance_rate", why)
    off = EngineOptions(device="cpu")
    _, tip = format_stats(m.to_dict(), off.to_dict(), "cpu")
    assert [line for line in tip.splitlines() if line.startswith("Drafts accepted")] == [
        f"Drafts accepted: n/a — {why}"
    ]
    m.mark_na("acceptance_rate", "speculation off")  # not asked for: nothing to say
    assert "Drafts accepted" not in format_stats(m.to_dict(), off.to_dict(), "cpu")[1]
    m.mark_na("acceptance_rate", why)
    table = CompareModel()
    table.add(CompareRow(1, "refused", off, m))
    cell = table.index(0, COLUMN_INDEX["acceptance_rate"])
    assert table.data(cell, Qt.ItemDataRole.ToolTipRole) == f"n/a — {why}"


def test_an_answer_whose_drafting_was_refused_says_so_on_its_stats_line():
    """Drafting asked for and not run: the line under the answer showed its drafts part only where the options had
    speculation on, so it said nothing of it; it now gives the reason's first clause, the tooltip all of it."""
    from engine.types import GenerationMetrics

    off = EngineOptions(device="cpu").to_dict()
    head = "8 tokens · TTFT 12 ms · 4.0 tok/s · custom · op gap n/a"
    several = (
        "speculation verifies the drafts of one answer; several candidates would accept different numbers of tokens "
        "per step"
    )
    for why, said in [
        (
            "the draft model could not be loaded: model not found: /m/small.gguf",
            "drafting off: the draft model could not be loaded",
        ),
        (several, "drafting off: speculation verifies the drafts of one answer"),
        ("the draft model's read was stopped", "drafting off: the draft model's read was stopped"),
        (
            "llama runs on the transformers fallback (no fast path), which has no verify step",
            "drafting off: llama runs on the transformers fallback",
        ),
    ]:
        m = GenerationMetrics(new_tokens_total=8, new_tokens=[8], ttft_ms=12.0, decode_tok_s=4.0)
        m.mark_na("acceptance_rate", f"speculation off: {why}")
        line, tip = format_stats(m.to_dict(), off, "cpu")
        assert line == f"{head} · {said}"
        assert f"Drafts accepted: n/a — speculation off: {why}" in tip.splitlines()
    m.mark_na("acceptance_rate", "speculation off")  # not asked for (or kept before the figures said why)
    assert format_stats(m.to_dict(), off, "cpu")[0] == head


def test_an_answer_stopped_after_one_token_says_1_token():
    """An answer stopped after its first token read "1 tokens" under it."""
    m = {"new_tokens_total": 1, "new_tokens": [1], "ttft_ms": 12.0}
    line, _ = format_stats(m, EngineOptions(device="cpu").to_dict(), "cpu", "cancelled")
    assert line.startswith("1 token · TTFT 12 ms")
    assert format_stats({**m, "new_tokens_total": 0, "new_tokens": [0]}, None, "cpu")[0].startswith("0 tokens · ")
    batch = format_stats({**m, "new_tokens": [1, 0]}, None, "cpu", candidate=0)[0]
    assert batch.startswith("1 of 1 token in the batch · "), batch


def test_a_gap_near_100_percent_is_not_rounded_up_to_it_in_the_stats_tooltip():
    """The line said "op gap >99.9%" and its tooltip "Op gap: 100.0%" for the same 99.97 %."""
    m = {"new_tokens_total": 40, "kernel_gap_pct": 99.97, "kernel_gap_source": "op gap — torch.profiler"}
    line, tip = format_stats(m, EngineOptions(device="cpu").to_dict(), "cpu")
    assert "op gap >99.9%" in line
    assert "Op gap: >99.9% — source: op gap — torch.profiler" in tip.splitlines()


def test_the_stats_tooltip_gives_every_count_and_the_step_latency_a_source_or_a_reason():
    """The tooltip said "Tokens: None new, n/a in the prompt" for an answer the app's close cut off, and
    "None new, None in the prompt" for a remote server's without usage, though the figures keep why; a count and
    the step latency never named their source."""
    from app.store import INTERRUPTED_METRICS

    _, tip = format_stats(INTERRUPTED_METRICS, None, "cpu", "interrupted")
    assert "None" not in tip
    why = "the app closed before this answer ended, so its figures were not kept"
    assert f"New tokens: n/a — {why}" in tip and f"Step latency p50 / p99: n/a — {why}" in tip
    remote = {
        "new_tokens_total": None,
        "prompt_tokens": None,
        "unavailable": dict.fromkeys(("new_tokens_total", "prompt_tokens"), "the server reported no token usage"),
    }
    _, tip = format_stats(remote, None, "remote")
    assert "New tokens: n/a — the server reported no token usage" in tip and "None" not in tip
    local = {"new_tokens_total": 1200, "prompt_tokens": 30, "step_ms_p50": 12.5, "step_ms_p99": 20.0}
    _, tip = format_stats(local, None, "cpu")
    assert "New tokens: 1,200 — source: " in tip and "Prompt tokens: 30 — source: " in tip
    assert "Step latency p50 / p99: 12.50 ms / 20.00 ms — source: " in tip
    _, tip = format_stats({**local, "prompt_reused_tokens": 24, "prompt_reuse_source": "the chat's cache"}, None, "cpu")
    assert "Prompt: 24 tokens reused, n/a computed — source: the chat's cache" in tip  # an older export's answer


def test_stats_line_says_na_and_names_sources():
    metrics = {
        "new_tokens_total": 12,
        "prompt_tokens": 5,
        "ttft_ms": 80.4,
        "decode_tok_s": None,
        "kernel_gap_pct": 33.3,
        "kernel_gap_source": "torch.profiler CUDA kernels",
        "unavailable": {},
    }
    options = preset_options("cuda-graph", EngineOptions(device="cuda")).to_dict()
    line, tip = format_stats(metrics, options, "cuda")
    assert line == "12 tokens · TTFT 80 ms · n/a tok/s · + CUDA graph · kernel gap 33.3%"
    assert "source: torch.profiler CUDA kernels" in tip
    assert "Launches per step: n/a" in tip
    _, tip = format_stats(
        {**metrics, "launches_per_step": 348.0, "launches_per_step_source": "kernels per step — x"}, options, "cuda"
    )
    assert "Launches per step: 348 — source: kernels per step — x" in tip
    line, tip = format_stats(
        {"new_tokens_total": 3, "unavailable": {"kernel_gap_pct": "profiling off"}}, options, "cpu", "cancelled"
    )
    assert line.endswith("op gap n/a · stopped by you")
    assert "profiling off" in tip
    for reason, words in (
        ("eos", "end of answer"),
        ("length", "token limit"),
        ("stop", "stop string"),
        ("context", "context full"),
    ):
        line, tip = format_stats(metrics, options, "cuda", reason)
        assert line.endswith(f"kernel gap 33.3% · {words}") and f"Finished: {words}" in tip
    assert format_stats(None, None, None)[0].startswith("n/a tokens")
    line, tip = format_stats({**metrics, "compile_seconds": 125.4}, options, "cuda")
    assert line.startswith("12 tokens · TTFT 80 ms + compile 125.4 s · ")
    assert "Time to first token: 80 ms, after 125.4 s compiling / capturing the decode step" in tip
    batch = {"new_tokens_total": 30, "new_tokens": [12, 18], "decode_tok_s": 56.0, "unavailable": {}}
    line, tip = format_stats(batch, options, "cuda", candidate=1)
    assert line.startswith("18 of 30 tokens in the batch · TTFT n/a · 56.0 tok/s (all 2 candidates) · ")
    assert "all 2 candidates together" in tip


def test_every_preset_is_recognised():
    for name, opts in PRESETS.items():
        assert preset_name(opts.to_dict()) == name
    assert preset_name(EngineOptions(dtype="fp16", kv_cache="none").to_dict()) is None


def test_toggles_emit_options_and_presets(qtbot):
    t, got = toggles_panel(qtbot, EngineOptions())
    pick(t.preset, "naive")
    assert got[-1] == preset_options("naive", EngineOptions())
    assert t.kv_cache.currentData() == "dynamic" and t.sampling.currentData() == "host"
    t.compile.setChecked(True)
    assert got[-1].compile is True
    assert t.preset.currentData() == "custom"


def test_arrowing_through_an_optimizations_dropdown_applies_only_the_entry_it_stops_at(qtbot, monkeypatch):
    """Each entry an arrow key passed in a closed dropdown was applied: fp32 to bf16 reconfigured the engine for
    fp16 on the way, and a preset passed on a CPU asked whether to compile. The entry stepped to applies once the
    steps pause, or at once on Enter or when the focus leaves; a choice from the list applies at once."""
    from app.worker import EngineController, EngineWorker

    ctl = EngineController(EngineWorker())  # no model: a choice is kept for the model to come, still a reconfigure
    ran: list[EngineOptions] = []
    real = ctl.worker._reconfigure
    monkeypatch.setattr(ctl.worker, "_reconfigure", lambda cmd: (ran.append(cmd.options), real(cmd)))
    asked: list[str] = []
    monkeypatch.setattr("ui.toggles.confirm", lambda _parent, title, *_a: asked.append(title) or True)
    t, _got = toggles_panel(qtbot, EngineOptions(dtype="fp32"))
    t.optionsChanged.connect(ctl.reconfigure)
    t.settle.setInterval(600_000)  # the steps "pause" only where the test says so
    t.show()
    t.activateWindow()
    qtbot.waitUntil(t.isActiveWindow)
    t.dtype.setFocus()

    def key(widget, k):
        qtbot.keyClick(widget, k)
        qtbot.waitUntil(ctl.worker.commands.empty)  # what the key sent is taken: a user's pace between keys

    try:
        key(t.dtype, Qt.Key.Key_Down)
        key(t.dtype, Qt.Key.Key_Down)
        assert ran == [] and t.dtype.currentData() == "bf16" and t.options.dtype == "fp32"
        t.set_applied(EngineOptions(dtype="fp32"), {})  # the reply to an earlier choice keeps the entry shown
        assert t.dtype.currentData() == "bf16"
        t.settle.setInterval(1)  # the steps pause
        qtbot.waitUntil(lambda: len(ran) == 1)
        key(t.dtype, Qt.Key.Key_Up)
        key(t.dtype, Qt.Key.Key_Return)
        qtbot.waitUntil(lambda: len(ran) == 2)
        t.settle.setInterval(600_000)
        key(t.dtype, Qt.Key.Key_Down)
        key(t.dtype, Qt.Key.Key_Tab)  # the focus leaves
        qtbot.waitUntil(lambda: len(ran) == 3)
        assert [o.dtype for o in ran] == ["bf16", "fp16", "bf16"] and t.options.dtype == "bf16"
        pick(t.dtype, "fp32")  # from the list: at once
        qtbot.waitUntil(lambda: len(ran) == 4)
        assert ran[-1].dtype == "fp32"

        t.set_resolved("cpu", "fp32")  # a compile on this CPU is asked about first
        t.set_options(preset_options("first-fixes", t.options))
        t.preset.setFocus()
        for _ in range(3):  # + compile, + CUDA graph, + fused kernels (which does not compile)
            key(t.preset, Qt.Key.Key_Down)
        key(t.preset, Qt.Key.Key_Return)
        qtbot.waitUntil(lambda: len(ran) == 5)
        assert asked == [] and t.preset.currentData() == "fused" and ran[-1] == t.options
        assert (ran[-1].kernels, ran[-1].compile) == ("fused", False)
    finally:
        assert ctl.shutdown(30)


def test_stepping_or_typing_an_optimizations_number_applies_only_the_number_it_stops_at(qtbot, monkeypatch):
    """Each number a held arrow key passed in Candidates, and each digit typed in Drafts ("12": 1, then 12), was
    applied, each a reconfigure of the engine (a runner rebuilt, a draft model reloaded). The number stepped or typed
    to applies once the steps pause, or at once on Enter or when the focus leaves, and until then the note and the
    box's tooltip say it is pending and what the next answer uses; a value the program sets applies at once."""
    from app.worker import EngineController, EngineWorker
    from ui.toggles import TIPS

    ctl = EngineController(EngineWorker())  # no model: a choice is kept for the model to come, still a reconfigure
    ran: list[EngineOptions] = []
    real = ctl.worker._reconfigure
    monkeypatch.setattr(ctl.worker, "_reconfigure", lambda cmd: (ran.append(cmd.options), real(cmd)))
    t, _got = toggles_panel(qtbot, EngineOptions(speculation="ngram"))
    t.optionsChanged.connect(ctl.reconfigure)
    t.settle.setInterval(600_000)  # the steps "pause" only where the test says so
    t.show()
    t.activateWindow()
    qtbot.waitUntil(t.isActiveWindow)

    def key(widget, k, modifier=Qt.KeyboardModifier.NoModifier):
        qtbot.keyClick(widget, k, modifier)
        qtbot.waitUntil(ctl.worker.commands.empty)  # what the key sent is taken: a user's pace between keys

    try:
        t.draft_tokens.setFocus()
        key(t.draft_tokens, Qt.Key.Key_A, Qt.KeyboardModifier.ControlModifier)  # "auto" selected, typed over
        key(t.draft_tokens, Qt.Key.Key_1)
        key(t.draft_tokens, Qt.Key.Key_2)
        assert ran == [] and t.draft_tokens.value() == 12 and t.options.draft_tokens == 0
        pending = "Drafts 12 applies once the steps pause, or at once on Enter; the next answer uses auto until then."
        assert t.note.text() == pending and t.draft_tokens.toolTip() == f"Not applied yet: {pending}"
        t.set_applied(EngineOptions(speculation="ngram"), {})  # the reply to an earlier change keeps both shown
        assert t.draft_tokens.value() == 12 and t.note.text() == pending
        assert t.draft_tokens.toolTip() == f"Not applied yet: {pending}"
        key(t.draft_tokens, Qt.Key.Key_Return)
        qtbot.waitUntil(lambda: len(ran) == 1)
        assert ran[0].draft_tokens == 12 and t.options.draft_tokens == 12
        assert t.note.text() == "Changes apply to the next answer." and t.draft_tokens.toolTip() == TIPS["draft_tokens"]

        t.candidates.setFocus()
        for _ in range(3):  # an arrow held: Qt steps the box once per repeat
            qtbot.keyPress(t.candidates, Qt.Key.Key_Up)
        qtbot.keyRelease(t.candidates, Qt.Key.Key_Up)
        qtbot.waitUntil(ctl.worker.commands.empty)
        assert len(ran) == 1 and t.candidates.value() == 4 and t.options.candidates == 1
        assert t.candidates.toolTip().startswith("Not applied yet: Candidates 4 applies once the steps pause")
        t.settle.setInterval(1)  # the steps pause
        qtbot.waitUntil(lambda: len(ran) == 2)
        t.settle.setInterval(600_000)
        key(t.candidates, Qt.Key.Key_Down)
        key(t.candidates, Qt.Key.Key_Up)  # back to the number in force: nothing to apply, the note as it was
        key(t.candidates, Qt.Key.Key_Tab)  # the focus leaves
        assert t.note.text() == "Changes apply to the next answer." and t.candidates.toolTip() == TIPS["candidates"]
        t.draft_tokens.setFocus()
        key(t.draft_tokens, Qt.Key.Key_Down)
        t.draft_tokens.clearFocus()
        qtbot.waitUntil(lambda: len(ran) == 3)
        t.candidates.setValue(6)  # set by the program: at once
        qtbot.waitUntil(lambda: len(ran) == 4)
        assert [(o.candidates, o.draft_tokens) for o in ran] == [(1, 12), (4, 12), (4, 11), (6, 11)]
    finally:
        assert ctl.shutdown(30)


def test_a_number_stepped_to_then_pasted_over_says_no_pending_number(qtbot):
    """Candidates stepped to 2 with an arrow, then 3 pasted (or an undo) in the same box: 3 applied, and the note
    went on saying "Candidates 2 applies once the steps pause" through the engine's reply, until the focus left."""
    from ui.toggles import TIPS

    t, got = toggles_panel(qtbot, EngineOptions())
    t.settle.setInterval(600_000)
    t.show()
    t.activateWindow()
    qtbot.waitUntil(t.isActiveWindow)
    t.candidates.setFocus()
    qtbot.keyClick(t.candidates, Qt.Key.Key_Up)
    assert got == [] and t.note.text().startswith("Candidates 2 applies once the steps pause")
    t.candidates.lineEdit().setText("3")  # what a paste from the box's menu does
    t.candidates.interpretText()
    assert [o.candidates for o in got] == [3]
    t.set_applied(got[-1], {})
    assert "applies once the steps pause" not in t.note.text()
    assert t.note.text() == "Ready: the next answer uses these options."
    assert t.candidates.toolTip() == TIPS["candidates"]


def test_toggles_turn_off_what_the_engine_cannot_do(qtbot):
    t, got = toggles_panel(qtbot, EngineOptions(cuda_graph=True))
    t.set_applied(EngineOptions(cuda_graph=True), {"cuda_graph": "CUDA graphs need a CUDA device"})
    assert got and got[-1].cuda_graph is False
    assert not t.cuda_graph.isChecked() and not t.cuda_graph.isEnabled()
    assert t.cuda_graph.toolTip() == "Unavailable: CUDA graphs need a CUDA device"
    cuda_graph_preset = t.preset.model().item(t.preset.findData("cuda-graph"))
    assert not cuda_graph_preset.isEnabled()
    t.set_model(EngineOptions(), {}, {})  # another model
    assert t.cuda_graph.isEnabled()


def test_chat_settings_keep_max_tokens_beyond_a_small_model_s_context(qtbot):
    """With a 256-token model loaded, OK cut a chat's saved 512 to 256 (kept after switching back)."""
    d = ChatSettingsDialog("", CHAT_DEFAULTS, context_length=256)
    qtbot.addWidget(d)
    assert d.values()[1].max_new_tokens == 512
    assert "more than this model's context (256 tokens)" in d.max_new_tokens.toolTip()
    d.max_new_tokens.setValue(200)
    assert d.max_new_tokens.toolTip() == "The longest answer, in tokens"


def test_chat_settings_ok_keeps_every_setting_it_was_not_asked_to_change(qtbot):
    """OK with only the system prompt changed rewrote the sampling to what the fields could show: temperature 7.5
    became 5, penalty 4 became 3, top-k 200,000 became 100,000, top-p 0.955 became 0.95, the stop "a,b" became
    two stops ("a" cut every answer at its first a) and "\\n\\n" none."""
    chosen = SamplingParams(
        temperature=7.5,
        top_p=0.955,
        top_k=200_000,
        repetition_penalty=4.0,
        max_new_tokens=700,
        seed=7,
        stop=("a,b", "\n\n", "\nUser:", "back\\slash"),
    )
    d = ChatSettingsDialog("old", chosen)
    qtbot.addWidget(d)
    d.system_prompt.setPlainText("Be brief.")
    assert d.values() == ("Be brief.", chosen)
    assert d.stop.text() == "a\\,b, \\n\\n, \\nUser:, back\\\\slash"
    d.stop.setText(d.stop.text() + ", END")  # edited: what it shows is read back, escapes and all
    d.temperature.setValue(9.0)
    assert d.sampling() == replace(chosen, temperature=9.0, stop=(*chosen.stop, "END"))


def test_chat_settings_dialog_defaults_and_validation(qtbot):
    d = ChatSettingsDialog("", CHAT_DEFAULTS)
    qtbot.addWidget(d)
    assert d.values() == ("", CHAT_DEFAULTS)
    assert (
        CHAT_DEFAULTS.temperature,
        CHAT_DEFAULTS.top_p,
        CHAT_DEFAULTS.top_k,
        CHAT_DEFAULTS.repetition_penalty,
        CHAT_DEFAULTS.max_new_tokens,
        CHAT_DEFAULTS.seed,
    ) == (0.7, 0.95, 40, 1.1, 512, None)
    d.system_prompt.setPlainText("  Be brief.  ")
    d.seed.setText("42")
    d.stop.setText("END, ###")
    prompt, s = d.values()
    assert prompt == "Be brief." and s.seed == 42 and s.stop == ("END", "###")
    d.temperature.setValue(0.0)
    d.max_new_tokens.setValue(1)
    assert d.sampling() == SamplingParams(
        temperature=0.0, top_p=0.95, top_k=40, repetition_penalty=1.1, max_new_tokens=1, seed=42, stop=("END", "###")
    )


@pytest.mark.parametrize("locale, typed", [("en_US", "1,000"), ("de_DE", "1.000"), ("fr_FR", "1 000")])
def test_a_seed_typed_with_a_thousands_separator_is_read_as_its_digits(qtbot, locale, typed):
    """The seed's validator followed the locale, took "1,000" as a number, and int() refused it: OK did nothing,
    with a traceback on stderr. Typed, the separator is not taken; set some other way, OK says what is wrong."""
    from PySide6.QtCore import QLocale

    before = QLocale()
    QLocale.setDefault(QLocale(locale))
    try:
        d = ChatSettingsDialog("", CHAT_DEFAULTS)
        qtbot.addWidget(d)
        qtbot.keyClicks(d.seed, typed)
        assert d.seed.text() == "1000" and d.sampling().seed == 1000
        d.seed.setText(typed)
        d.accept()
        assert d.result() == 0 and d.error.isVisibleTo(d) and "seed must be a whole number" in d.error.text()
    finally:
        QLocale.setDefault(before)


def test_theme_follows_choice(qapp):
    from ui.theme import DARK, LIGHT, ThemeManager

    tm = ThemeManager(qapp, "light")  # the look the tests start on: each change restyles every widget alive
    assert tm.scheme == "light" and qapp.palette().base().color().name() == LIGHT.base
    seen = []
    tm.changed.connect(seen.append)
    tm.set_choice("dark")
    assert seen == [DARK] and qapp.palette().base().color().name() == DARK.base
    assert "@" not in qapp.styleSheet()
    tm.set_choice("light")
    assert seen == [DARK, LIGHT] and qapp.palette().base().color().name() == LIGHT.base
    with pytest.raises(ValueError):
        tm.set_choice("purple")


def test_a_window_opened_on_the_theme_in_force_does_not_restyle_the_others(qapp, qtbot):
    """Each window's theme set the application's palette and style sheet (and Fusion, which the style under a sheet
    no longer named) although they were in force already: every widget alive, the other windows' too, was
    re-polished each time a window opened."""
    from PySide6.QtCore import QEvent, QObject
    from PySide6.QtWidgets import QLabel

    from ui.theme import LIGHT, ThemeManager

    ThemeManager(qapp, "light")  # (a change of look here would restyle every widget the tests left alive: slow)
    other = QLabel("another window")
    qtbot.addWidget(other)
    other.show()
    qapp.processEvents()
    seen: list = []

    class Watch(QObject):
        def eventFilter(self, obj, event):
            if obj is other and event.type() in (QEvent.Type.StyleChange, QEvent.Type.PaletteChange):
                seen.append(event.type())
            return False

    watch = Watch()
    other.installEventFilter(watch)
    tm = ThemeManager(qapp, "light")
    qapp.processEvents()
    assert tm.colors == LIGHT and qapp.palette().base().color().name() == LIGHT.base
    assert seen == []
    other.setStyleSheet("QLabel { font-weight: bold; }")  # the watch sees a restyle where there is one
    qapp.processEvents()
    assert QEvent.Type.StyleChange in seen


def _contrast(a: str, b: str) -> float:
    """WCAG 2 contrast ratio of two #rrggbb colours."""

    def lum(c: str) -> float:
        ch = [int(c[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        r, g, b = (x / 12.92 if x <= 0.03928 else ((x + 0.055) / 1.055) ** 2.4 for x in ch)
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_text_reads_on_its_background_in_both_themes(qapp, scheme):
    """White on the dark theme's Send (3.2:1) and Stop (2.5:1) buttons, the compare table's green (3.0:1 in the
    light theme), and in the light theme code comments (4.2:1) and numbers (4.47:1) and a code block's language
    (4.48:1), were below the 4.5:1 that text needs."""
    from ui.hud.compare_table import delta_colors
    from ui.hud.ladder_chart import GAP_COLOR, INSIDE_TEXT
    from ui.theme import DARK, LIGHT, ThemeManager

    c = DARK if scheme == "dark" else LIGHT
    ThemeManager(qapp, scheme)
    pairs = {
        "button text on accent": (c.accent_text, c.accent),
        "button text on stop": (c.accent_text, c.error),
        "text": (c.text, c.base),
        "muted text": (c.muted, c.base),
        "error text": (c.error, c.base),
        "link": (c.accent, c.base),
        **{f"compare {n}": (q.name(), c.base) for n, q in zip(("better", "worse"), delta_colors())},
        "figure inside a ladder gap bar": (INSIDE_TEXT, GAP_COLOR),
        **{f"code {n}": (getattr(c, f"syn_{n}"), c.code_bg) for n in ("keyword", "string", "comment", "number")},
        "code text": (c.text, c.code_bg),
        "code block's language": (c.muted, c.code_header),
        "context meter near the limit": (c.syn_number, c.base),
    }
    low = {k: round(_contrast(*v), 2) for k, v in pairs.items() if _contrast(*v) < 4.5}
    assert low == {}


def test_small_text_grows_with_the_application_font():
    """Hints, stats lines and notices were 11 px whatever the user's font (the title smaller than the text)."""
    import re

    from ui.theme import LIGHT, style_sheet

    sheet = style_sheet(LIGHT, font_pt=20.0)
    assert not re.search(r"font-size:\s*\d+px", sheet)
    assert "#statsLine { color: #626b78; font-size: 18.0pt; }" in sheet
    assert "#chatTitle { font-weight: 600; font-size: 23.0pt; }" in sheet


def test_model_panel_shows_load_time_bytes_per_token_and_floor_with_sources(qtbot):
    from engine.types import ModelInfo
    from ui.model_panel import ModelPanel

    panel = ModelPanel()
    qtbot.addWidget(panel)
    base = dict(
        name="m",
        family="llama",
        architecture="LlamaForCausalLM",
        backend="fast",
        parameters=10,
        dtype="fp32",
        device="cpu",
        context_length=256,
        weight_bytes=40,
        source="/m.gguf",
        source_kind="gguf",
    )
    panel.set_info(
        ModelInfo(
            **base,
            load_seconds=1.234,
            load_seconds_source="perf_counter around Engine.load",
            bytes_per_token=3 << 20,
            bytes_per_token_source="weights read",
            memory_floor_ms=0.0625,
            memory_floor_source="NVML peak",
            weights="int8",
            weights_kernel="own int8 GEMV (avx2+fma, OpenMP threads)",
        )
    )
    assert panel.values["weights"].toolTip() == "int8 linears: own int8 GEMV (avx2+fma, OpenMP threads)"
    assert panel.values["load"].text() == "1.23 s"
    assert panel.values["load"].toolTip() == "perf_counter around Engine.load"
    assert panel.values["per_token"].text() == "3.0 MiB" and panel.values["per_token"].toolTip() == "weights read"
    assert panel.values["floor"].text() == "0.062 ms/token" and panel.values["floor"].toolTip() == "NVML peak"
    assert panel.values["weights"].text() == "40 B (int8)"
    panel.set_info(
        ModelInfo(**base, memory_floor_source="n/a: the CPU's memory bandwidth could not be measured (out of memory)")
    )
    assert panel.values["weights"].toolTip() == ""  # native weights: no kernel of their own to name
    assert panel.values["load"].text() == "n/a" and "not timed" in panel.values["load"].toolTip()
    assert panel.values["floor"].text() == "n/a" and "could not be measured" in panel.values["floor"].toolTip()


def test_weights_toggle_and_its_unavailable_formats(qtbot):
    t, got = toggles_panel(qtbot, EngineOptions())
    pick(t.weights, "int8")
    assert got[-1].weights == "int8"
    pick(t.preset, "int8")
    assert got[-1] == preset_options("int8", EngineOptions()) and got[-1].weights == "int8"
    t.set_applied(EngineOptions(weights="int4"), {"weights": "int4 needs inputs in groups of 32"})
    assert got[-1].weights == "native" and t.weights.currentData() == "native"
    item = t.weights.model().item(t.weights.findData("int4"))
    assert not item.isEnabled() and item.toolTip() == "Unavailable: int4 needs inputs in groups of 32"


def test_a_narrow_message_folds_its_actions_into_a_menu(qtbot):
    """At 800 x 600 with the side panels open the conversation is ~260 px wide: a message with branches must fit
    it (its actions in a "⋯" menu) instead of widening the conversation past its edge."""
    from app.chat_flow import MessageItem
    from ui.message import MessageWidget
    from ui.theme import LIGHT

    item = MessageItem(7, "assistant", "An answer", sibling_index=1, sibling_count=3, author="SmolLM2")
    w = MessageWidget(item, LIGHT)
    qtbot.addWidget(w)
    w.resize(700, 200)
    w.show()
    assert w.regen_button.isVisible() and not w.more_button.isVisible()
    assert w.minimumSizeHint().width() < 150  # the actions never set the message's minimum width
    w.resize(240, 200)
    assert not w.regen_button.isVisible() and w.more_button.isVisible() and w.next_button.isVisible()
    menu = w.more_button.menu()
    assert [a.text() for a in menu.actions()] == ["Copy", "Regenerate", "Delete"]
    with qtbot.waitSignal(w.regenerateRequested) as asked:
        menu.actions()[1].trigger()
    assert asked.args == [7]
    w.resize(700, 200)
    assert w.regen_button.isVisible() and not w.more_button.isVisible()


def test_a_pasted_word_longer_than_a_line_breaks_anywhere_in_the_composer_and_the_edit_box(qtbot):
    """Laid out at word boundaries, a pasted 200 KB hex dump held the GUI thread 3.4 s (800 KB: 73 s); the answer's
    view already broke such a word anywhere, the boxes the user writes in did not."""
    from PySide6.QtCore import QMimeData
    from PySide6.QtGui import QTextOption

    from ui.composer import Composer
    from ui.message import _EditBox

    composer = Composer("enter")
    qtbot.addWidget(composer)
    edit = composer.edit
    assert edit.wordWrapMode() == QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere
    dump = QMimeData()
    dump.setText("ab" * 100_000)
    edit.insertFromMimeData(dump)
    assert edit.wordWrapMode() == QTextOption.WrapMode.WrapAnywhere and len(composer.text()) == 200_000
    composer.clear()  # sent: the next message breaks at words again
    assert edit.wordWrapMode() == QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere
    box = _EditBox()
    qtbot.addWidget(box)
    box.setPlainText("x" * 600)
    assert box.wordWrapMode() == QTextOption.WrapMode.WrapAnywhere


@pytest.mark.parametrize("before", [0, 1, 249, 250, 251, 499, 500, 777])
@pytest.mark.parametrize("length", [1, 249, 250, 251, 499, 500, 501, 1000])
@pytest.mark.parametrize("space", [" ", "\n", "\u00a0", "\u2003"])
def test_a_long_word_is_found_wherever_it_starts_as_a_search_of_the_whole_text_finds_it(before, length, space):
    """has_long_word searches only around the blocks without a space (a 4 MB paste of prose spent 0.34 s in the
    search over the whole text): the same answer as that search, for words ending and starting on every side of
    a block's edge."""
    import re

    from ui.parts import LONG_WORD, has_long_word

    whole = re.compile(r"\S{%d}" % LONG_WORD)
    for text in (
        "a" * before + space + "b" * length + space + "c" * 3,
        ("ab " * before) + "x" * length,
        "x" * length + space + "y" * before,
        space * before + "z" * length,
    ):
        assert has_long_word(text) == (whole.search(text) is not None), (before, length, repr(space))


def test_a_paste_that_carries_only_html_inserts_its_text(qtbot):
    """Some browsers and editors put only text/html on the clipboard: a plain text box took nothing from it."""
    from PySide6.QtCore import QMimeData
    from PySide6.QtGui import QTextOption

    from ui.composer import Composer

    composer = Composer("enter")
    qtbot.addWidget(composer)
    html = QMimeData()
    html.setHtml("<p>Rewrite <b>this</b>:</p><ul><li>one</li></ul><script>alert(1)</script>")
    assert composer.edit.canInsertFromMimeData(html)  # a drop is taken too
    composer.edit.insertFromMimeData(html)
    assert composer.text() == "Rewrite this:\none"
    with_image = QMimeData()
    with_image.setHtml('<p>See <img src="chart.png" alt="a chart"> here</p>')
    composer.clear()
    composer.edit.insertFromMimeData(with_image)
    assert composer.text() == "See  here"  # an image was an object replacement character sent to the model
    long_word = QMimeData()
    long_word.setHtml("<p>" + "ab" * 1_000 + "</p>")
    composer.clear()
    composer.edit.insertFromMimeData(long_word)
    assert composer.edit.wordWrapMode() == QTextOption.WrapMode.WrapAnywhere


def test_a_chat_s_tooltip_says_how_long_ago_it_changed_as_of_when_it_is_shown(qtbot, monkeypatch):
    """Switching chats no longer reads the list again: the age worked out when it was last read ("just now")
    stayed in every tooltip for as long as the window ran without a chat changing."""
    import time

    from PySide6.QtCore import QEvent
    from PySide6.QtGui import QHelpEvent
    from PySide6.QtWidgets import QApplication, QToolTip

    import ui.chat_list as chat_list_module
    from ui.chat_list import ChatEntry, ChatList

    listed_at = time.time()
    chats = ChatList()
    qtbot.addWidget(chats)
    chats.resize(300, 400)
    chats.show()
    chats.set_chats([ChatEntry(1, "old chat", listed_at - 10)])
    item = chats.list.item(0)
    assert item.toolTip() == "old chat\nlast change: just now"
    monkeypatch.setattr(chat_list_module.time, "time", lambda: listed_at + 7200)  # two hours on, nothing changed
    assert item.toolTip() == "old chat\nlast change: 2 h ago"
    viewport = chats.list.viewport()
    pos = chats.list.visualItemRect(item).center()
    QApplication.sendEvent(viewport, QHelpEvent(QEvent.Type.ToolTip, pos, viewport.mapToGlobal(pos)))
    try:
        assert "last change: 2 h ago" in QToolTip.text().replace("\xa0", " ")  # as the app shows it (plain text)
    finally:
        QToolTip.hideText()


def test_every_field_of_a_dialog_is_named_and_tab_reaches_it(qtbot):
    """Each stop Tab visits in Chat settings, Preferences, the remote model dialog and the Server panel is named for
    a screen reader: by its label (the label's buddy), its own text or an accessible name. The models folder's field
    in Preferences had none (a row of a field and a button)."""
    from PySide6.QtWidgets import QAbstractButton, QApplication, QLabel, QWidget

    from app.settings import CHAT_DEFAULTS
    from ui.preferences import Preferences, PreferencesDialog
    from ui.remote_dialog import RemoteDialog
    from ui.server_panel import ServerPanel

    def name(w: QWidget, root: QWidget) -> str:
        labels = [lb.text() for lb in root.findChildren(QLabel) if lb.buddy() is w]
        own = w.text() if isinstance(w, QAbstractButton) else ""
        return w.accessibleName() or own.replace("&", "") or " ".join(labels)

    prefs = Preferences("light", "enter", CHAT_DEFAULTS, "", "rolling", None)
    for root in (ChatSettingsDialog("", CHAT_DEFAULTS), PreferencesDialog(prefs), RemoteDialog(), ServerPanel()):
        qtbot.addWidget(root)
        root.show()
        root.activateWindow()
        qtbot.waitUntil(root.isActiveWindow)
        stops = []
        while QApplication.focusWidget() not in stops:
            stops.append(QApplication.focusWidget())
            qtbot.keyClick(stops[-1], Qt.Key.Key_Tab)
        fields = [w for w in root.findChildren(QWidget) if w.focusPolicy() & Qt.FocusPolicy.TabFocus and w.isVisible()]
        fields = [w for w in fields if w.focusProxy() is None and not any(s.isAncestorOf(w) for s in stops)]
        assert set(fields) <= set(stops), type(root).__name__  # every field reached by Tab
        unnamed = [type(w).__name__ for w in stops if not name(w, root)]
        assert unnamed == [], type(root).__name__
        root.close()


def test_the_menu_key_in_the_chat_list_opens_the_chosen_chat_s_menu_and_none_with_none_chosen(qtbot, monkeypatch):
    """The focus arriving in the list leaves no chat chosen; the menu key then opened the menu of whichever chat was
    at the middle of the list (Qt places a keyboard menu at the middle where there is no current row), and its
    Delete… asked to delete that chat, which nobody chose."""
    import time

    from PySide6.QtCore import QPoint, QTimer
    from PySide6.QtGui import QContextMenuEvent
    from PySide6.QtWidgets import QApplication, QMenu

    from ui.chat_list import ChatEntry, ChatList

    chats = ChatList()
    qtbot.addWidget(chats)
    chats.resize(300, 500)
    chats.set_chats([ChatEntry(i, f"chat {i}", time.time() - i) for i in range(1, 41)])
    chats.show()
    qtbot.waitExposed(chats)
    chats.activateWindow()
    qtbot.waitUntil(chats.isActiveWindow)
    chats.list.setFocus(Qt.FocusReason.TabFocusReason)
    assert QApplication.focusWidget() is chats.list and chats.list.currentItem() is None
    asked: list[int] = []
    monkeypatch.setattr(chats, "ask_delete", lambda chat_id, title=None: asked.append(chat_id))

    def delete_from_menu() -> None:
        menu = QApplication.activePopupWidget()
        if isinstance(menu, QMenu):
            next(a for a in menu.actions() if a.text() == "Delete…").trigger()
            menu.close()

    def menu_key() -> None:  # as the window gets it from the keyboard: the focus widget places the menu
        QTimer.singleShot(0, delete_from_menu)  # in the menu's own loop, where one opens
        QApplication.sendEvent(
            chats.windowHandle(), QContextMenuEvent(QContextMenuEvent.Reason.Keyboard, QPoint(0, 0), QPoint(0, 0))
        )
        qtbot.wait(1)

    menu_key()
    assert asked == [] and chats.list.currentItem() is None
    qtbot.keyClick(chats.list, Qt.Key.Key_Down)  # chooses the first chat
    qtbot.keyClick(chats.list, Qt.Key.Key_Down)
    menu_key()
    assert asked == [2] == [chats.current_id()]


def test_the_chat_list_keeps_its_scroll_when_refreshed_and_a_title_is_one_line(qtbot, monkeypatch):
    """A refresh of the list (an answer ending, a rename) scrolled it back to the top, losing the user's place; a
    title pasted from several lines into Rename kept its line breaks, and the chat's header broke on them."""
    import time

    from PySide6.QtWidgets import QInputDialog

    from ui.chat_list import ChatEntry, ChatList

    now = time.time()
    chats = ChatList()
    qtbot.addWidget(chats)
    chats.resize(300, 300)
    chats.show()
    qtbot.waitExposed(chats)
    entries = [ChatEntry(i, f"chat {i}", now - i) for i in range(1, 200)]
    chats.set_chats(entries, current=1)
    bar = chats.list.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0)  # laid out
    bar.setValue(bar.maximum() // 2)
    place = bar.value()
    chats.set_chats(entries, current=1)
    qtbot.wait(50)  # the list laid out again
    assert bar.value() == place
    renamed: list = []
    chats.renameRequested.connect(lambda chat_id, title: renamed.append((chat_id, title)))
    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: ("  Trip plan\nday 1: Lisbon\r\n\tday 2 ", True))
    chats.ask_rename(3)
    assert renamed == [(3, "Trip plan day 1: Lisbon day 2")]


def test_links_on_screen_take_the_new_theme_s_colour(qtbot, qapp):
    """Qt's markdown reader colours a link as it reads it: after a switch of theme the links already shown kept
    the other theme's blue (3.2:1 on the dark background) while code blocks changed."""
    from PySide6.QtGui import QPalette

    from ui.theme import DARK, LIGHT, ThemeManager

    tm = ThemeManager(qapp, "light")
    try:
        view = SegmentsView("See [the docs](https://example.com) and [more](https://example.org).", LIGHT_COLORS)
        qtbot.addWidget(view)
        tm.changed.connect(view.set_colors)

        def link_colors() -> set[str]:
            doc, seen = view._widgets[0].document(), set()
            block = doc.begin()
            while block.isValid():
                it = block.begin()
                while not it.atEnd():
                    if it.fragment().charFormat().isAnchor():
                        seen.add(it.fragment().charFormat().foreground().color().name())
                    it += 1
                block = block.next()
            return seen

        assert link_colors() == {qapp.palette().color(QPalette.ColorRole.Link).name()}
        tm.set_choice("dark")
        assert link_colors() == {qapp.palette().color(QPalette.ColorRole.Link).name()} != {LIGHT.accent}
        assert qapp.palette().base().color().name() == DARK.base
    finally:
        tm.set_choice("light")


def test_code_left_in_the_prose_keeps_its_lines_as_written(qtbot):
    """An indented code block and a fenced one inside a quote stay in the prose; each of their lines took the two
    trailing spaces of a hard break, and a copy of the code carried them. Prose lines keep their breaks."""
    view = ProseView("Run:\n\n    make all\n    make install\n\n> ```\n> a = 1\n> b = 2\n> ```\n\nline one\nline two")
    qtbot.addWidget(view)
    lines = view.document().toPlainText().split("\n")
    assert lines[:5] == ["Run:", "make all", "make install", "a = 1", "b = 2"]
    assert lines[-2:] == ["line one", "line two"]  # not joined into "line one line two"


def test_a_reasoning_model_s_thinking_shows_as_a_quote_before_its_answer(qtbot):
    """The answer showed "<think>…</think>" as text, the thinking run into the answer."""
    text = "<think>\nTwo and two make four.\n</think>\n\nIt is **4**."
    whole = SegmentsView(text, thinking=True)
    view = SegmentsView("", thinking=True)
    user = SegmentsView(text)  # a message of the user's is shown as written
    for w in (whole, view, user):
        qtbot.addWidget(w)
    for batch in ["<think>", "\nTwo", " and two", " make four."]:
        view.append(batch)
    view.flush()
    assert _shown(view) == [("prose", "Thinking…\nTwo and two make four.")]
    for batch in ["\n</think>", "\n\nIt", " is **4**."]:
        view.append(batch)
    view.flush()
    assert _shown(view) == _shown(whole) == [("prose", "Thinking\nTwo and two make four.\nIt is 4.")]
    assert view.text == text  # kept as written: copied, stored and sent back so
    assert "<think>" in user._widgets[0].toPlainText()


def test_an_empty_thinking_shows_the_answer_alone(qtbot):
    """A reasoning model asked not to think writes an empty "<think>\n\n</think>": it showed an empty quote."""
    view = SegmentsView("<think>\n\n</think>\n\nIt is 4.", thinking=True)
    qtbot.addWidget(view)
    assert _shown(view) == [("prose", "It is 4.")]


def test_thinking_a_template_opened_in_the_prompt_shows_as_a_quote_once_it_ends(qtbot):
    """DeepSeek-R1's distillations and QwQ are asked with "<think>\n" at the end of the prompt and write only the
    end tag: the thinking and "</think>" were shown as the answer. A tag the answer names in code stays text."""
    view = SegmentsView("", thinking=True)
    qtbot.addWidget(view)
    view.append("Two and two make four.")
    view.flush()
    assert _shown(view) == [("prose", "Two and two make four.")]  # nothing says it is thinking yet
    for batch in ["\n</think>", "\n\nIt", " is **4**."]:
        view.append(batch)
    view.flush()
    assert _shown(view) == [("prose", "Thinking\nTwo and two make four.\nIt is 4.")]
    named = SegmentsView("Close it with `</think>`:\n```\n</think>\n```\nas shown.", thinking=True)
    qtbot.addWidget(named)
    assert "Thinking" not in "".join(w.toPlainText() for w in named._widgets if not isinstance(w, CodeBlock))
