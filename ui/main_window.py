"""The main window: chat list | conversation and composer | right docks (model and optimizations; the HUD).

The window only arranges widgets and routes signals: the conversation logic is app.chat_flow.ChatFlow, the
engine is behind the controller (app.worker.EngineController), which never blocks this thread.
"""

from __future__ import annotations

import base64
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, cast

from PySide6.QtCore import QByteArray, QEvent, QPoint, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QActionGroup, QKeySequence, QTextCursor
from PySide6.QtWidgets import (
    QApplication,
    QDockWidget,
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMenu,
    QPushButton,
    QScrollArea,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.chat_flow import GONE, MADE, UNTITLED, ChatFlow, resolved
from app.chat_search import ChatSearch
from app.drafts import Drafts
from app.settings import SettingsError
from app.store import NotFound, StoreError
from engine.types import (
    DRAFT_READ_STOPPED,
    FINISH_WORDS,
    OVERFLOW_LABELS,
    OVERFLOW_POLICIES,
    REMOTE_DEVICE,
    EngineOptions,
    GenerationResult,
    ModelInfo,
    Progress,
    SamplingParams,
    options_as_run,
    source_in_full,
    source_label,
)
from ui.chat_list import ChatEntry, ChatList
from ui.chat_view import ChatView
from ui.composer import Composer
from ui.dialogs import (
    ChatSettingsDialog,
    ProgressDialog,
    ask_save_file,
    confirm,
    show_error,
    show_error_and_wait,
    show_info,
)
from ui.hud.bars import ElidedLabel
from ui.model_panel import ModelPanel
from ui.parts import tight_column
from ui.preferences import Preferences, PreferencesDialog
from ui.stats import options_label
from ui.theme import THEME_CHOICES, ThemeManager
from ui.toggles import TogglesPanel

if TYPE_CHECKING:
    from app.fetcher import DefaultModelFetcher
    from app.gui import ModelCatalog
    from app.settings import Settings
    from app.store import ChatStore
    from app.worker import EngineController
    from ui.hud import HudPanel

log = logging.getLogger(__name__)


def model_status_text(info: Optional[ModelInfo]) -> str:
    return f"{info.name} · {info.device} · {info.dtype}" if info is not None else "No model"


LEFT_MIN_WIDTH = 220  # the chat list and the model panel
CENTER_MIN_WIDTH = 280  # the conversation and the composer
DOCK_MIN_WIDTH = 260  # the optimizations and the HUD
LEFT_SHARE = 0.28  # of the splitter, when no saved sizes fit
DOCK_SHARE = 500 / 1440  # of the window's width, until the user drags the docks' edge


def saved_dock_share(sizes: Optional[list[int]]) -> float:
    """The docks' share of the window's width as saved ([dock width, window width]), else DOCK_SHARE."""
    if sizes is not None and len(sizes) == 2 and 0 < sizes[0] < sizes[1]:
        return sizes[0] / sizes[1]
    return DOCK_SHARE


FIRST_SIZE = QSize(1440, 900)  # the window's size at its first start, where the screen has room
FRAME_ROOM = QSize(32, 64)  # left on the screen for the window manager's frame and title bar


def first_size(available: QSize) -> QSize:
    """The window's size before any is saved: FIRST_SIZE, or smaller to fit a smaller screen's free area (a
    1366x768 laptop's) with room for the frame; the panes' minimum widths still apply."""
    return FIRST_SIZE.boundedTo(available - FRAME_ROOM)


def fitting_sizes(saved: Any, minimums: list[int], total: int) -> Optional[list[int]]:
    """The saved splitter sizes if they still fit: one per pane, each at least its pane's minimum, together no
    wider than `total`; None otherwise (they are then dropped)."""
    if not isinstance(saved, list) or len(saved) != len(minimums):
        return None
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in saved):
        return None
    if any(x < m for x, m in zip(saved, minimums)) or sum(saved) > total:
        return None
    return saved


METER_DEBOUNCE_MS = 250  # the context meter counts once typing pauses this long
DRAFT_SAVE_MS = 2000  # what is typed is written to the drafts file once typing pauses this long


MAX_TAB_STOPS = 5000  # a bound on the focus chain's walk
FIT_SCREEN_SHARE = 0.5  # of the screen's height, the most the options take before they scroll


class Pane(QWidget):
    """A splitter pane at least `least` wide, and never narrower than its contents need: a minimum set with
    setMinimumWidth overrides the contents' own, so at the smallest window the model panel's figures were cut
    off ("15.121 ms/to", a model's name "SmolLM2-135")."""

    def __init__(self, least: int, parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.least = least

    def minimumSizeHint(self) -> QSize:
        hint = super().minimumSizeHint()
        return QSize(max(self.least, hint.width()), hint.height())


class FitScrollArea(QScrollArea):
    """Shows its widget at the viewport's size, and scrolls only below the widget's minimum height or width, so
    a tall or wide panel never forces the window larger than the screen (a plain resizable scroll area would
    size a word-wrapping panel by its preferred height and always scroll)."""

    def __init__(self, widget: QWidget, parent: Optional[QWidget] = None, scroll_vertically: bool = True):
        super().__init__(parent)
        self._scroll_vertically = scroll_vertically  # False: as tall as the widget needs (to a share of the screen)
        self.setFrameShape(QFrame.Shape.NoFrame)
        if not scroll_vertically:
            self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.setWidgetResizable(False)
        self.setWidget(widget)
        self.setFocusPolicy(Qt.FocusPolicy.NoFocus)  # Tab goes to the panel's controls, scrolled into view
        widget.installEventFilter(self)

    def eventFilter(self, obj, event) -> bool:
        if obj is self.widget() and event.type() == QEvent.Type.LayoutRequest:
            QTimer.singleShot(0, self, self._fit)  # after the layout settles; dropped if this area is deleted first
        return super().eventFilter(obj, event)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit()

    def _tallest(self) -> int:
        """The most height a panel that does not scroll down takes: a share of the screen's."""
        return int(FIT_SCREEN_SHARE * self.screen().availableGeometry().height())

    def _fit(self) -> None:
        w = self.widget()
        if w is None:
            return
        bar = self.verticalScrollBar().sizeHint().width()
        fit_width = getattr(w, "fit_width", None)  # a panel that lays itself out again for the width it gets
        if fit_width is not None and self._scroll_vertically:
            fit_width(self.width() - bar)
        if not self._scroll_vertically:
            # As tall as the widget needs at the width it gets (wrapped lines included); sideways scroll below it.
            # On a short screen (a laptop at 150 %, a large font) at most a share of it, scrolling down the rest:
            # the window could not be made smaller than the screen.
            tallest = self._tallest()
            for room in (self.width(), self.width() - bar):  # the second where a vertical scroll bar takes room
                if fit_width is not None:
                    fit_width(room)
                width = max(room, w.minimumSizeHint().width())
                need = w.heightForWidth(width) if w.hasHeightForWidth() else w.minimumSizeHint().height()
                need = max(need, w.minimumSizeHint().height())
                total = need + (self.horizontalScrollBar().sizeHint().height() if width > room else 0)
                if total <= tallest:
                    break
            scrolls = total > tallest
            self.setVerticalScrollBarPolicy(
                Qt.ScrollBarPolicy.ScrollBarAsNeeded if scrolls else Qt.ScrollBarPolicy.ScrollBarAlwaysOff
            )
            self.setMinimumHeight(min(total, tallest))
            w.resize(width, need)
            return
        height = max(self.viewport().height(), w.minimumSizeHint().height())
        width = max(self.width() - (bar if height > self.height() else 0), w.minimumSizeHint().width())
        w.resize(width, height)


class MainWindow(QMainWindow):
    closed = Signal()
    chatsFound = Signal(str)  # the chat list shows what this search found

    def __init__(
        self,
        store: ChatStore,
        controller: EngineController,
        settings: Settings,
        save_settings: Callable[[Settings], list[str]],  # notices of a file kept aside (app.settings)
        theme: ThemeManager,
        default_sampling: SamplingParams,
        hud: Optional[HudPanel] = None,
        fetcher: Optional[DefaultModelFetcher] = None,
        catalog: Optional[ModelCatalog] = None,
        preset_resolver: Optional[Callable[[str, EngineOptions, str], EngineOptions]] = None,
        drafts: Optional[Drafts] = None,
    ):
        super().__init__()
        self.setWindowTitle("Gapless")
        self.setObjectName("mainWindow")
        self.store = store
        self.controller = controller
        self.settings = settings
        self._save_settings = save_settings
        self.theme = theme
        self.hud = hud
        self.fetcher = fetcher
        self.catalog = catalog  # known models: default, recent, scanned folder (app.gui.ModelCatalog)
        self.flow = ChatFlow(store, controller, default_sampling, self)
        self.drafts = drafts if drafts is not None else Drafts()  # what was typed in each chat and not sent
        self._draft_chat: Optional[int] = None  # the chat whose draft the composer holds (None: the new chat)
        self._draft_shown = False  # a chat has opened, its draft in the composer
        # what is typed is kept once typing pauses, not only at a switch or a close: a kill, a crash, a logout
        # that does not wait lost it
        self._draft_timer = QTimer(  # type: ignore[call-arg]  # the stubs omit the signal keywords Qt takes
            self, singleShot=True, interval=DRAFT_SAVE_MS, timeout=self._keep_draft
        )
        self.flow.default_overflow = settings.overflow_policy
        self.flow.default_system_prompt = settings.system_prompt
        self._loading: Optional[str] = None  # the source being loaded
        self._asked_loads: list[str] = []  # sources load_model asked the worker for, not yet loaded or failed
        # one of them failed while others were still to come: the panel goes on saying so until the last is done
        self._failed_in_queue = False
        self._answer_options: Optional[EngineOptions] = None  # what the answer in progress (or the last) ran with
        self._reading_shown = False  # the status bar says how much of a long prompt has been read
        self._fetch_dialog: Optional[ProgressDialog] = None
        self._fetching = False
        self._laddering = False  # a ladder run holds the engine: chat waits until it ends or is cancelled
        self._closed = False
        # What went wrong once the window had closed (a stopped answer's last save as the app quits): no event loop
        # is left to show a box on it, so the app says these after it has closed (app.gui.run_gui)
        self.said_after_close: list[str] = []
        self._requested: Optional[EngineOptions] = None  # the newest options sent to the engine, not yet confirmed
        self._requested_by_user = True  # False: they replace what the model refused (not saved)
        self._search = ""
        self._listed_version: Optional[int] = None  # the store's data_version when the chats were last listed
        self._chat_search = ChatSearch(store, self)
        self._chat_search.found.connect(self._chats_found)
        self._chat_search.failed.connect(self._search_failed)
        self._pick_notice = ""  # the status line's request to pick one of the candidates, while it is shown
        self._answer_notice = ""  # what the engine said of the last answer (a prompt cleaned, cut), while shown
        self._preset_resolver = preset_resolver  # how presets map to options on this device (the bench's rule)
        self._meter_request = 0  # the newest context count asked for
        self._meter_timer = QTimer(  # type: ignore[call-arg]  # the stubs omit the signal keywords Qt takes
            self, singleShot=True, interval=METER_DEBOUNCE_MS, timeout=self.count_context
        )
        self._build(settings)
        self._wire()
        self._menus()
        self.refresh_chats()
        self._forget_drafts_of_deleted_chats()
        self.flow.new_chat()
        self.composer.edit.setFocus()  # given when the window first becomes active
        self._update_can_send()
        self._restore_layout()

    # ---- building ------------------------------------------------------------------------------------

    def _build(self, settings: Any) -> None:
        self.chat_list = ChatList(self)
        self.chat_view = ChatView(self.theme.colors, self)
        self.composer = Composer(settings.send_with, self)
        # a long title (a renamed or imported chat) ends in "…", whole in its tooltip: cut off mid-word, unsaid
        self.chat_title = ElidedLabel(UNTITLED, self)
        self.chat_title.setObjectName("chatTitle")
        self.chat_settings_button = QPushButton("Chat settings…", self)
        self.chat_settings_button.setToolTip("System prompt and sampling parameters of this chat")
        self.chat_settings_button.clicked.connect(self.open_chat_settings)
        header = self._header = QWidget(self)
        header.setObjectName("chatHeader")
        hl = QHBoxLayout(header)
        hl.setContentsMargins(24, 8, 16, 8)
        hl.addWidget(self.chat_title, 1)
        hl.addWidget(self.chat_settings_button)
        center = QWidget(self)
        tight_column(center, header, (self.chat_view, 1), self.composer)
        # Left: chats above the model (the model rarely changes; chats do, so they get the height).
        self.model_panel = ModelPanel(self)
        left = Pane(LEFT_MIN_WIDTH, self)
        left.setObjectName("leftColumn")
        model_box = QVBoxLayout()
        model_box.setContentsMargins(10, 0, 10, 10)
        model_box.addWidget(self.model_panel)
        tight_column(left, (self.chat_list, 1), model_box)
        center.setMinimumWidth(CENTER_MIN_WIDTH)
        self.splitter = QSplitter(Qt.Orientation.Horizontal, self)
        self.splitter.setObjectName("mainSplitter")
        self.splitter.addWidget(left)
        self.splitter.addWidget(center)
        self._panes = (left, center)  # the splitter's widgets, in order
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setChildrenCollapsible(False)
        self.setCentralWidget(self.splitter)
        self._saved_splitter = settings.splitter_sizes.get("main")  # applied once shown, where they still fit
        self._splitter_fitted = False

        # Right: the optimizations over the HUD, so a toggle and its effect are in view together.
        self.toggles = TogglesPanel(settings.options(), self._preset_resolver, self)
        self.options_dock = QDockWidget("Optimizations", self)
        self.options_dock.setObjectName("optionsDock")
        self.options_dock.setWidget(FitScrollArea(self.toggles, self, scroll_vertically=False))
        self.options_dock.setMinimumWidth(DOCK_MIN_WIDTH)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.options_dock)
        self._dock_share = saved_dock_share(settings.splitter_sizes.get("docks"))
        self._dock_resizing = False
        self._size_seen = QSize()  # the window size the docks were last fitted to (none yet)
        self.options_dock.installEventFilter(self)
        self.hud_dock: Optional[QDockWidget] = None
        self.server_dock: Optional[QDockWidget] = None  # made by app.gui.attach_server
        if self.hud is not None:
            self.hud_dock = QDockWidget("Performance", self)
            self.hud_dock.setObjectName("hudDock")
            self.hud_dock.setWidget(FitScrollArea(self.hud, self))
            self.hud_dock.setMinimumWidth(DOCK_MIN_WIDTH)
            self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.hud_dock)
            self.hud_dock.setVisible(settings.hud_visible)
            self.refit_on_toggle(self.hud_dock)
        self.status = QLabel("", self)
        self.statusBar().addWidget(self.status, 1)
        self.model_status = QLabel("No model", self)
        self.statusBar().addPermanentWidget(self.model_status)
        self.resize(first_size(self.screen().availableGeometry().size()))
        self.resizeDocks([self.options_dock], [round(self._dock_share * self.width())], Qt.Orientation.Horizontal)
        if self.hud_dock is not None:  # the toggles take what they need, the HUD the rest
            self.resizeDocks(
                [self.options_dock, self.hud_dock], [self.toggles.sizeHint().height(), 2000], Qt.Orientation.Vertical
            )

    def _wire(self) -> None:
        f, v, c, chats, model = self.flow, self.chat_view, self.controller, self.chat_list, self.model_panel
        recount = lambda *_a: self.recount_context()  # noqa: E731 - one slot for several signals
        wiring: list[tuple[Any, Callable]] = [
            (chats.chatSelected, f.open_chat),
            (chats.chatClicked, lambda _id: self.composer.edit.setFocus()),
            (chats.newChatRequested, self.new_chat),
            (chats.renameRequested, f.rename_chat),
            (chats.deleteRequested, f.delete_chat),
            (chats.searchChanged, self._search_changed),
            (f.chatsChanged, self.refresh_chats),
            (f.chatOpened, self._chat_opened),
            (f.threadChanged, v.set_messages),
            (f.threadChanged, lambda _items: self._clear_pick_notice()),  # a thread without candidates to pick
            (f.messageAppended, v.add_message),
            (f.streamStarted, v.begin_stream),
            (f.streamDelta, v.append_stream),
            (f.streamDelta, self._answer_arrives),
            (f.streamRowsFinished, v.rows_finished),
            (f.streamFinished, v.finish_stream),
            (f.candidatesFinished, self._candidates_finished),
            (f.generatingChanged, self._generating_changed),
            (f.failed, self._failed),
            (f.noticed, self.status.setText),
            (v.editSubmitted, f.edit),
            (v.editSubmitted, lambda _id, _text: self.composer.edit.setFocus()),
            (v.focusReleased, self.composer.edit.setFocus),
            (v.regenerateRequested, f.regenerate),
            (v.deleteRequested, self.ask_delete_message),
            (v.siblingRequested, f.step_sibling),
            (v.candidateChosen, f.choose_candidate),
            (v.candidateChosen, lambda _i: self._clear_pick_notice()),
            (self.composer.sendRequested, self._send),
            (self.composer.edit.textChanged, self.recount_context),
            (self.composer.edit.textChanged, self._draft_timer.start),
            *((signal, recount) for signal in (f.threadChanged, f.messageAppended, f.streamFinished)),
            (f.candidatesFinished, recount),
            (v.candidateShown, recount),  # sending continues from the tab on screen: counted from it
            (c.loaded, recount),
            (c.contextCounted, self._context_counted),
            (self.composer.stopRequested, f.stop),
            (model.openRequested, self.load_model),
            (model.modelsFolderChosen, self.set_models_folder),
            (model.forgetRequested, self.forget_model),
            (model.clearRecentRequested, self.clear_recent_models),
            (model.folderUsed, self._folder_used),
            (model.focusReleased, self.composer.edit.setFocus),
            (self.toggles.folderUsed, self._folder_used),
            (self.toggles.columnsChanged, lambda _n: QTimer.singleShot(0, self, self._fit_dock_heights)),
            (self.toggles.optionsChanged, self._options_chosen),
            (self.theme.changed, v.set_colors),
            (c.loadStarted, self._load_started),
            (c.progress, self._progress),
            (c.loaded, self._loaded),
            (c.loadFailed, self._load_failed),
            (c.reconfigured, self._reconfigured),
            (c.reconfigureFailed, self._reconfigure_failed),
            (c.generationStarted, self._generation_started),
            (c.generationFinished, self._generation_finished),
            (c.generationFailed, self._generation_failed),
        ]
        model.last_folder = self.toggles.last_folder = self.settings.last_folder or ""
        if self.hud is not None:
            hud = self.hud
            if hasattr(hud, "folderUsed"):
                wiring.append((hud.folderUsed, self._folder_used))
                hud.last_folder = self.settings.last_folder or ""
            wiring += [
                (c.steps, lambda _rid, records: hud.add_steps(records)),
                (c.samples, hud.add_samples),
                (c.ladderProgress, hud.set_ladder_progress),
                (c.ladderFinished, hud.set_ladder_results),
                (c.ladderFailed, hud.set_ladder_failed),
                (hud.runLadderRequested, self.run_ladder),
                (c.ladderFinished, lambda _rows: self._ladder_ended()),
                (c.ladderFailed, lambda _msg: self._ladder_ended()),
                (hud.cancelLadderRequested, c.cancel_ladder),
            ]
        if self.fetcher is not None:
            wiring += [
                (self.fetcher.progress, self._fetch_progress),
                (self.fetcher.finished, self._fetch_finished),
                (self.fetcher.failed, self._fetch_failed),
            ]
        for signal, slot in wiring:
            signal.connect(slot)
        if self.hud is not None:
            self._restore_compare_history(self.hud)

    def _restore_compare_history(self, hud: HudPanel) -> None:
        """The compare table's rows are kept with the chats: those of earlier runs come back, new ones are added
        as they come (numbered after those any window kept), and Clear history removes them from the store too."""
        from app.store import CompareHistory
        from ui.hud.compare_table import CompareRow

        history = CompareHistory(self.store)
        try:
            rows = history.rows()
        except StoreError as exc:
            log.error("%s", exc)
            self.status.setText(f"The compare history could not be read: {exc}")
            rows = []
        hud.restore_compare(CompareRow(r.index, r.label, r.options, r.metrics, r.model) for r in rows)

        def last_index() -> int:
            try:
                return history.last_index()
            except StoreError as exc:  # numbered after this window's own rows alone
                log.warning("the compare rows' numbers could not be read: %s", exc)
                return 0

        hud.series.numbered_elsewhere = last_index

        def keep(row: CompareRow) -> None:
            try:
                history.add(row.index, row.label, row.options, row.metrics, row.model)
            except StoreError as exc:
                log.error("%s", exc)
                self.status.setText(f"The compare row was not kept: {exc}")

        def clear() -> None:
            try:
                history.clear()
            except StoreError as exc:
                self._failed(f"The compare history was not cleared: {exc}")

        hud.compareRowAdded.connect(keep)
        hud.compareCleared.connect(clear)

    def _menus(self) -> None:
        def action(menu, text: str, slot, shortcut=None, tip: str = "") -> QAction:
            act = QAction(text, self)
            if shortcut is not None:
                act.setShortcut(QKeySequence(shortcut))
                act.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
            act.setStatusTip(tip)
            act.triggered.connect(lambda _checked=False: slot())
            menu.addAction(act)
            return act

        bar = self.menuBar()
        file = bar.addMenu("&File")
        action(file, "&New chat", self.new_chat, QKeySequence.StandardKey.New)
        action(file, "&Open GGUF…", self.model_panel.open_file_dialog)
        action(file, "Open model &folder…", self.model_panel.open_folder_dialog)
        action(file, "Load the &default model", lambda: self.load_model("default"))
        file.addSeparator()
        self.export_json_action = action(
            file,
            "Export chat as &JSON…",
            lambda: self.export_chat(False),
            tip="Every branch and each answer's figures, in a file Gapless imports",
        )
        self.export_md_action = action(
            file, "Export chat as &Markdown…", lambda: self.export_chat(True), tip="Every branch, for reading"
        )
        self.import_action = action(file, "&Import chat…", self.import_chat, tip="Add a chat exported as JSON")
        file.addSeparator()
        preferences = QKeySequence.keyBindings(QKeySequence.StandardKey.Preferences)  # none on some desktops
        self.preferences_action = action(
            file,
            "&Preferences…",
            self.open_preferences,
            preferences[0] if preferences else QKeySequence("Ctrl+,"),
            "Theme, send key, the defaults of new chats, the models folder",
        )
        file.addSeparator()
        action(file, "&Quit", self.close, QKeySequence.StandardKey.Quit)
        chat = bar.addMenu("&Chat")
        self.stop_action = action(
            chat, "&Stop the answer", self.flow.stop, Qt.Key.Key_Escape, "Stop the answer; the text so far is kept"
        )
        self.stop_action.setEnabled(self.flow.generating)
        action(chat, "S&earch chats", self.chat_list.focus_search, QKeySequence.StandardKey.Find)
        action(chat, "Chat se&ttings…", self.open_chat_settings)
        # The open chat's, for the keyboard (the chat list's menu needed a right-click): F2 anywhere in the window,
        # Delete in the chat list (elsewhere it edits text)
        self.rename_action = action(chat, "&Rename chat…", self.rename_open_chat, Qt.Key.Key_F2)
        self.delete_action = action(
            chat, "&Delete chat…", self.delete_open_chat, tip="Delete this chat (Delete in the chat list); asked first"
        )
        overflow = chat.addMenu("&When a chat outgrows the context (default)")
        policies = QActionGroup(self)
        self.overflow_actions: dict[str, QAction] = {}
        for policy in OVERFLOW_POLICIES:
            act = QAction("&" + OVERFLOW_LABELS[policy], self, checkable=True)  # R, T, S
            act.setChecked(self.settings.overflow_policy == policy)
            act.triggered.connect(lambda _c=False, policy=policy: self.set_default_overflow(policy))
            policies.addAction(act)
            overflow.addAction(act)
            self.overflow_actions[policy] = act
        view = bar.addMenu("&View")
        themes = QActionGroup(self)
        self.theme_actions: dict[str, QAction] = {}
        for choice in THEME_CHOICES:
            act = QAction(
                f"&{choice.capitalize()} theme" if choice != "system" else "Follow the &system theme",  # L, D, S
                self,
                checkable=True,
            )
            act.setChecked(self.theme.choice == choice)
            act.triggered.connect(lambda _c=False, choice=choice: self.set_theme(choice))
            themes.addAction(act)
            view.addAction(act)
            self.theme_actions[choice] = act
        view.addSeparator()
        sends = QActionGroup(self)
        self.send_actions: dict[str, QAction] = {}
        for key, label in (("enter", "Send with &Enter"), ("ctrl+enter", "Send with &Ctrl+Enter")):
            act = QAction(label, self, checkable=True)
            act.setChecked(self.settings.send_with == key)
            act.triggered.connect(lambda _c=False, key=key: self.set_send_with(key))
            sends.addAction(act)
            view.addAction(act)
            self.send_actions[key] = act
        view.addSeparator()
        # the docks' titles, with an Alt letter in the menu alone (a title bar would show the "&")
        self.options_dock.toggleViewAction().setText("&" + self.options_dock.windowTitle())  # O
        view.addAction(self.options_dock.toggleViewAction())
        help_menu = bar.addMenu("&Help")
        action(help_menu, "&Keyboard shortcuts", self.show_shortcuts, QKeySequence.StandardKey.HelpContents)
        action(help_menu, "&About Gapless", self.show_about)
        if self.hud_dock is not None:
            self.hud_dock.toggleViewAction().setText("&" + self.hud_dock.windowTitle())  # P
            view.addAction(self.hud_dock.toggleViewAction())

    def shortcut_lines(self) -> list[str]:
        """Every menu action with a shortcut, as the menus have it, then the composer's keys."""
        lines = []
        for menu_action in self.menuBar().actions():
            menu = cast(QMenu, menu_action.menu())  # the stubs type menu() as QObject; Qt returns the QMenu
            for act in menu.actions():
                keys = act.shortcut().toString(QKeySequence.SequenceFormat.NativeText)
                if keys:
                    lines.append(f"{keys}\t{act.text().replace('&', '')}")  # without its mnemonic
        send = "Enter" if self.composer.edit.send_with == "enter" else "Ctrl+Enter"
        newline = "Shift+Enter" if send == "Enter" else "Enter"
        lines += [f"{send}\tSend the message", f"{newline}\tA new line in the message"]
        lines += ["Delete\tDelete the chat (in the chat list)", "Shift+F10\tThe chat's menu (in the chat list)"]
        return lines

    def show_shortcuts(self) -> None:
        self._info_box = show_info(self, "Keyboard shortcuts", "\n".join(self.shortcut_lines()))

    def show_about(self) -> None:
        import PySide6
        from PySide6.QtCore import qVersion

        from app import __version__

        self._info_box = show_info(
            self,
            "About Gapless",
            f"Gapless {__version__}\n\nA desktop chat app for local language models with a live performance HUD: "
            "each decode optimization can be switched on and off, and the HUD shows what it changes.\n\n"
            f"Qt {qVersion()} · PySide6 {PySide6.__version__} · Apache-2.0",
        )

    # ---- chats ---------------------------------------------------------------------------------------

    def _send(self, text: str) -> None:
        """The draft goes only once the message is stored: a failed send (a locked or full disk) keeps it.
        Replying while candidates wait for a choice continues from the one on screen."""
        tabs = self.chat_view.candidate_tabs()
        if tabs is not None and self.flow.awaiting_choice():
            self.flow.choose_candidate(tabs.tabs.currentIndex())
        if self.flow.send(text):
            self.composer.clear()
            self.drafts.put(self.flow.chat_id, "")  # sent: no longer a draft
            self.drafts.save()

    def ask_delete_message(self, message_id: int) -> None:
        """A message goes with everything after it on its branch: asked first, Cancel the default."""
        later = [m for m in self.chat_view.items() if m.id is not None]
        ids = [m.id for m in later]
        after = len(ids) - ids.index(message_id) - 1 if message_id in ids else 0
        try:
            hidden = self.store.subtree_size(message_id) - 1 - after  # below it on other branches: they go too
        except StoreError:
            hidden = 0
        text = (
            "Delete this message"
            + (f" and the {after} after it" if after else "")
            + (f", with {hidden} more in other versions below it" if hidden > 0 else "")
            + "? This cannot be undone."
        )
        if confirm(self, "Delete message", text, "Delete"):
            self.flow.delete_message(message_id)

    def new_chat(self) -> None:
        self.flow.new_chat()
        self.composer.edit.setFocus()

    def rename_open_chat(self) -> None:
        if self.flow.chat_id is not None:
            self.chat_list.ask_rename(self.flow.chat_id, self.chat_title.text())

    def delete_open_chat(self) -> None:
        if self.flow.chat_id is not None:
            self.chat_list.ask_delete(self.flow.chat_id, self.chat_title.text())

    def refresh_chats(self) -> None:
        """List the chats again; those of a search once it has run off the GUI thread (chatsFound)."""
        self._show_title()
        self._say_where_answering()  # the chat an answer runs in may have been renamed
        self._listed_version = self._data_version()
        if self._search:
            self._chat_search.ask(self._search)
            return
        self._chat_search.drop()  # a search still running: its result is no longer wanted
        try:
            chats = self.store.chat_titles()
        except StoreError as exc:
            self._failed(str(exc))
            return
        self.chat_list.set_chats([ChatEntry(*c) for c in chats], self.flow.chat_id)

    def _data_version(self) -> Optional[int]:
        try:
            return self.store.data_version()
        except StoreError:
            return None

    def _chats_found(self, serial: int, search: str, chats: list) -> None:
        if self._chat_search.is_latest(serial) and search == self._search:  # else a newer search is coming
            self.chat_list.set_chats([ChatEntry(*c) for c in chats], self.flow.chat_id)
            self.chatsFound.emit(search)

    def _search_failed(self, serial: int, message: str) -> None:
        if self._chat_search.is_latest(serial):
            self._failed(message)

    def _show_title(self) -> None:
        """The open chat's title as stored (a search may hide it from the list, and renaming it still shows)."""
        try:
            chat = self.store.get_chat(self.flow.chat_id) if self.flow.chat_id is not None else None
        except StoreError:
            chat = None  # deleted meanwhile: the flow opens another
        self.chat_title.setText(chat.title if chat is not None else UNTITLED)
        self.chat_title.setToolTip(self.chat_title.text())
        # a new chat is not stored until its first message: nothing to rename, delete or export
        for act in (self.rename_action, self.delete_action, self.export_json_action, self.export_md_action):
            act.setEnabled(chat is not None)

    def _search_changed(self, text: str) -> None:
        self._search = text
        self.refresh_chats()

    def _say_where_answering(self) -> None:
        """The composer names the chat an answer runs in while another chat is on screen."""
        chat_id = self.flow.answering_chat()
        title = None
        if chat_id is not None and chat_id != self.flow.chat_id:
            try:
                title = self.store.get_chat(chat_id).title
            except StoreError:
                title = "another chat"
        self.composer.set_answering_elsewhere(title)

    def _chat_opened(self, chat_id: Optional[int]) -> None:
        self._switch_draft(chat_id)
        self._say_where_answering()
        self._clear_pick_notice()
        if self._answer_notice and self.status.text() == self._answer_notice:  # of an answer in the chat left
            self.status.clear()
        # Opening a chat changes no title nor order: the list is not read again (chatsChanged does that), unless
        # another window or `gapless chats` changed the database since it was last read.
        version = self._data_version()
        if version is not None and version != self._listed_version:
            self.refresh_chats()
            if self._search:  # listed once the search has run: meanwhile the list follows
                self.chat_list.select(chat_id)
            return
        self.chat_list.select(chat_id)
        self._show_title()

    def _switch_draft(self, chat_id: Optional[int]) -> None:
        """The composer's text stays with the chat it was typed in: kept as its draft, and the opened chat's own
        draft shown (the one composer carried a draft into the next chat, where Enter sent it there)."""
        left, self._draft_chat = self._draft_chat, chat_id
        shown, self._draft_shown = self._draft_shown, True
        why = self.flow.opened_because
        if why == MADE:  # the new chat became this one (its first message, Chat settings): the text goes with it
            self.drafts.put(None, "")
            return
        text, orphan = self.composer.text(), ""
        if shown and (left is None or self._still_stored(left)):
            self.drafts.put(left, text)
        elif shown and why == GONE:  # deleted in another window: what was typed in it stays on screen
            orphan = text
        own = self.drafts.get(chat_id)
        self.composer.set_text(f"{own}\n\n{orphan}" if own.strip() and orphan.strip() else own or orphan)
        self.composer.edit.moveCursor(QTextCursor.MoveOperation.End)
        self._save_drafts(self.status.setText)

    def _keep_draft(self) -> None:
        if self._draft_shown and not self._closed:
            self.drafts.put(self._draft_chat, self.composer.text())
            self._save_drafts(self.status.setText)

    def _save_drafts(self, say: Callable[[str], Any]) -> None:
        """Write the drafts changed; why they could not be is said with `say`, as a sentence."""
        problem = self.drafts.save()
        if problem:
            say(problem[:1].upper() + problem[1:])

    def _still_stored(self, chat_id: int) -> bool:
        """Whether chat `chat_id` is still in the store (deleted, here or elsewhere, it keeps no draft); a store that
        cannot tell now (locked by another window) is taken to still have it: its draft is kept."""
        try:
            return self.store.get_chat(chat_id) is not None
        except NotFound:
            return False
        except StoreError:
            return True

    def _forget_drafts_of_deleted_chats(self) -> None:
        try:
            self.drafts.keep_only({c.id for c in self.store.list_chats()})
        except StoreError:
            pass

    def open_chat_settings(self) -> None:
        info: Optional[ModelInfo] = self.controller.info
        dialog = ChatSettingsDialog(
            self.flow.system_prompt(),
            self.flow.sampling(),
            info.context_length if info else None,
            self,
            self.flow.chat_overflow_policy(),
            self.settings.overflow_policy,
        )
        dialog.accepted.connect(lambda: self.flow.set_chat_settings(*dialog.values(), dialog.overflow_policy()))
        dialog.accepted.connect(self.recount_context)  # the answer's room or the policy may have changed
        dialog.finished.connect(dialog.deleteLater)  # else each one opened stays a child of the window
        dialog.open()
        self._chat_settings_dialog = dialog  # kept for tests and so it is not collected while open

    def export_chat(self, markdown: bool) -> None:
        from app.chat_io import ChatFileError, export_json, export_markdown, export_name, write_text

        chat_id = self.flow.chat_id
        if chat_id is None:
            self._failed("Nothing to export: this chat has no messages yet")
            return
        suffix, kind = (".md", "Markdown (*.md)") if markdown else (".json", "Gapless chat (*.json)")
        start = str(Path(self.settings.last_folder or "") / export_name(self.chat_title.text(), suffix))
        path = ask_save_file(self, "Export chat", start, kind)  # "notes" typed is notes.md, asked before replacing
        if not path:
            return
        self._folder_used(str(Path(path).parent))
        try:
            text = export_markdown(self.store, chat_id) if markdown else export_json(self.store, chat_id)
            write_text(Path(path), text)
        except (ChatFileError, StoreError) as exc:
            self._failed(f"The chat was not exported: {exc}")
            return
        self.status.setText(f"Chat exported to {path}")

    def import_chat(self) -> None:
        from app.chat_io import ChatFileError, import_chat

        path, _ = QFileDialog.getOpenFileName(
            self, "Import chat", self.settings.last_folder or "", "Gapless chat (*.json);;All files (*)"
        )
        if not path:
            return
        self._folder_used(str(Path(path).parent))
        try:
            chat_id = import_chat(self.store, Path(path))
        except ChatFileError as exc:
            self._failed(f"The chat was not imported: {exc}")
            return
        self.flow.open_chat(chat_id)
        self.refresh_chats()
        self.status.setText(f"Chat imported from {path}")

    def recount_context(self) -> None:
        """The draft or the conversation changed: counts asked for before are stale; count once typing pauses."""
        self._meter_request = 0
        self._meter_timer.start()

    def count_context(self) -> None:
        """Ask the engine (off this thread) what the conversation and the draft would take of the context."""
        if self.controller.info is None:
            self.composer.set_context(None)
            return
        try:
            tabs = self.chat_view.candidate_tabs()
            shown = tabs.tabs.currentIndex() if tabs is not None and self.flow.awaiting_choice() else None
            messages = self.flow.draft_messages(self.composer.text(), shown)
            max_new, overflow = self.flow.sampling().max_new_tokens, self.flow.overflow_policy()
        except StoreError as exc:
            self.composer.set_context(None, str(exc))
            return
        self._meter_request = self.controller.measure_context(messages, max_new, overflow)

    def _context_counted(self, request_id: int, use: Any) -> None:
        if request_id != self._meter_request:
            return  # an older draft's count
        if isinstance(use, str):
            self.composer.set_context(None, use)
        else:
            self.composer.set_context(use)

    # ---- generation ----------------------------------------------------------------------------------

    def _generating_changed(self, generating: bool) -> None:
        self.stop_action.setEnabled(generating)  # the menu offered Stop with nothing to stop
        self._update_can_send()  # the ladder waits for the answer
        self.composer.set_generating(generating)
        self._say_where_answering()
        self.chat_view.set_busy(generating)
        self.chat_list.new_button.setEnabled(True)
        self.status.setText("Answering…" if generating else "")

    def _answer_arrives(self, _deltas: dict) -> None:
        """The prompt has been read once text arrives: the status bar stops saying how much of it was."""
        if self._reading_shown:
            self._reading_shown = False
            self.status.setText("Answering…")

    def _generation_started(self, request_id: int, options: EngineOptions) -> None:
        self._answer_options = options
        if self.hud is None:
            return
        if self._remote_open():  # the server's settings: none but n is known here
            options = options.with_(device=REMOTE_DEVICE)
        self.hud.begin_generation(options_label(resolved(options, self.controller.info).to_dict()), options)

    def _generation_finished(self, request_id: int, result: GenerationResult) -> None:
        self.toggles.progress.hide()
        if self._loading is None:
            self.model_panel.clear_error()
        if self.hud is not None:
            label = options_label(result.options.to_dict())
            if "cancelled" in result.finish_reasons:  # its figures cover the part that ran: said in its row
                label += f" ({FINISH_WORDS['cancelled']})"
            self.hud.end_generation(result.metrics, result.options, label, result.unavailable, result.limits)
        if result.notices:
            self._answer_notice = " · ".join(result.notices)
            if self._pick_notice and self.status.text() == self._pick_notice:  # candidates still ask for a choice
                self._answer_notice = self._pick_notice = f"{self._answer_notice} · {self._pick_notice}"
            self.status.setText(self._answer_notice)
        # The reasons are for the options the answer ran with: where the panel has changed since (a choice made
        # while the engine was busy), they would be pinned on values they were not given for.
        # A draft model's read that Stop ended refuses nothing: the next answer reads it (pinned, it turned
        # drafting off in the panel and greyed out its entry).
        refused = {k: v for k, v in result.unavailable.items() if v != DRAFT_READ_STOPPED}
        if refused and self.toggles.options == self._answer_options:
            self.toggles.set_unavailable(refused)

    def _generation_failed(self, _request_id: int, message: str) -> None:
        self.toggles.progress.hide()
        if self.hud is not None:
            self.hud.generation_failed(message)

    def _candidates_finished(self, result: GenerationResult) -> None:
        tabs = self.chat_view.candidate_tabs()
        if tabs is not None:
            tabs.finish(
                result.texts,
                result.metrics.to_dict(),
                options_as_run(result.options, result.unavailable, result.limits),
                result.options.device,
                self.flow.last_finish_reasons,
                can_choose=True,
            )
        self._pick_notice = f"{len(result.texts)} candidates: pick one with “Use this answer” to continue from it"
        self.status.setText(self._pick_notice)

    def _clear_pick_notice(self) -> None:
        """The notice asking for a choice goes once there is nothing to choose (a pick, another chat)."""
        if not self.flow.awaiting_choice() and self.status.text() == self._pick_notice:
            self.status.clear()

    def run_ladder(self) -> None:
        """The HUD's "Run ladder": the last user prompt of this chat (or a fixed one) through every preset."""
        prompt = next(
            (m.content for m in reversed(self.chat_view.items()) if m.role == "user"),
            "Explain in three sentences why the sky is blue.",
        )
        self._laddering = True
        self._update_can_send()
        self.controller.run_ladder([{"role": "user", "content": prompt}], self.flow.sampling())

    def _ladder_ended(self) -> None:
        self._laddering = False
        self._update_can_send()

    def _failed(self, message: str) -> None:
        if self._closed:  # a box opened now would wait on a hidden window for a loop that never runs again
            log.error("%s", message)
            self.said_after_close.append(message)
            return
        self.status.setText(message)
        show_error(self, "Gapless", message)

    # ---- model ---------------------------------------------------------------------------------------

    def load_model(self, source: str) -> None:
        if self.flow.generating:
            self.flow.stop()
        if source == "default" and self.fetcher is not None and not self.fetcher.is_cached():
            self._start_fetch()
            return
        self._ask_load(source)

    def _ask_load(self, source: str) -> None:
        self.controller.load(source, self._options_to_load())
        self._asked_loads.append(source)  # the worker loads them in this order
        self._failed_in_queue = False  # a model asked for anew: what the panel said of an earlier one goes
        # Chat waits from now, not from when the worker starts the load: a message sent in between would be
        # answered by the new model but credited to the old one.
        self._load_started(source)

    def _start_fetch(self) -> None:
        fetcher = self.fetcher
        if fetcher is None:
            raise RuntimeError("no model fetcher was given: the default model cannot be downloaded")
        size = fetcher.size_text()
        self._fetch_dialog = ProgressDialog(
            "Downloading the default model",
            f"Gapless needs a model to chat with. Downloading SmolLM2-135M-Instruct ({size}, Apache-2.0) "
            "into the model cache; it is verified before use.",
            True,
            self,
        )
        self._fetch_dialog.cancelRequested.connect(fetcher.cancel)
        self._fetch_dialog.open()
        self.model_panel.set_loading("default")
        self._fetching = True
        self._update_can_send()
        fetcher.start()

    def _fetch_progress(self, p: Progress) -> None:
        if self._fetch_dialog is not None:
            self._fetch_dialog.set_progress(p)
        self.model_panel.set_progress(p)

    def _fetch_finished(self, _path: str) -> None:
        self._close_fetch_dialog()
        self._ask_load("default")

    def _fetch_failed(self, message: str) -> None:
        cancelled = self._fetch_dialog is not None and self._fetch_dialog.cancelled
        self._close_fetch_dialog()
        self.model_panel.set_failed("default", message)
        if not cancelled:
            show_error(
                self,
                "Download failed",
                f"{message}\n\nOpen a model with File ▸ Open GGUF…, or try again with File ▸ Load the default model.",
            )
        self._update_can_send()

    def _close_fetch_dialog(self) -> None:
        self._fetching = False
        if self._fetch_dialog is not None:
            self._fetch_dialog.done(0)
            self._fetch_dialog.deleteLater()
            self._fetch_dialog = None

    def refresh_models(self) -> None:
        c = self.catalog
        if c is not None:
            self.model_panel.set_models(c.default(), c.recent(), c.scanned(), c.folder)
            for notice in c.take_notices():
                self.status.setText(notice)

    def forget_model(self, source: str) -> None:
        """Off the Recent list (a file deleted, or not wanted any more); the file and the model open stay."""
        if self.catalog is not None:
            self.catalog.forget(source)
            self.refresh_models()

    def clear_recent_models(self) -> None:
        if self.catalog is not None:
            self.catalog.clear_recent()
            self.refresh_models()

    def _folder_used(self, folder: str) -> None:
        """Every file dialog starts where the last one was left, in this run and the next."""
        self.settings.last_folder = folder
        self.model_panel.last_folder = self.toggles.last_folder = folder
        if self.hud is not None:
            self.hud.last_folder = folder
        self._persist()

    def set_models_folder(self, folder: Optional[str]) -> None:
        self.settings.models_folder = folder
        self.refresh_models()
        self._persist()

    def _load_started(self, source: str) -> None:
        self._loading = source
        self.model_panel.set_loading(source, keep_error=self._failed_in_queue)
        self.model_status.setText(f"Loading {source_label(source)}…")
        self._update_can_send()

    def _progress(self, p: Progress) -> None:
        if p.stage == "prefill":  # a long prompt read in chunks: "reading the conversation: 1,200 of 3,000 tokens"
            self._reading_shown = True
            self.status.setText(f"{p.message} · Esc stops")
            self.chat_view.set_stream_status(p.message)
            return
        if self._loading is not None:
            self.model_panel.set_progress(p)
        else:  # reconfigure, recompile, recapture
            self.toggles.set_progress(p)
            if p.fraction is not None and p.fraction >= 1.0:
                QTimer.singleShot(600, self.toggles.progress.hide)

    def _loaded(self, info: ModelInfo, unavailable: dict) -> None:
        # The source this load was asked for (a second one asked for meanwhile is still to come: it was saved
        # as the last model, and when it failed the next start had none)
        source = self._asked_loads.pop(0) if self._asked_loads else info.source
        self._loading = self._asked_loads[-1] if self._asked_loads else None
        # a model asked for before this one failed: the panel goes on saying why (until the next answer)
        self.model_panel.set_loaded(info, keep_error=self._failed_in_queue)
        if self._loading is not None:  # the model asked for next is still on its way: the panel says so
            self.model_panel.set_loading(self._loading, keep_error=self._failed_in_queue)
        else:
            self._failed_in_queue = False
        if self.hud is not None:
            self.hud.model_name = info.name
        self.toggles.set_resolved(info.device, info.dtype)
        # A choice made while the model loaded waits behind the load: the panel goes on showing it (what the model
        # refuses is replaced in it), not the options the load began with (replaced from those, the choice was
        # dropped: its reply came after the replacement's and was taken for an outdated one)
        shown = self._requested if self._requested is not None else self.controller.options
        self.toggles.set_model(shown, unavailable, self.controller.limits)
        self.model_status.setText(model_status_text(info))
        self.settings.last_model = source
        if self.catalog is not None:
            self.catalog.remember(source)
        self.refresh_models()
        self._update_can_send()
        self._persist()

    def _load_failed(self, source: str, message: str) -> None:
        if source in self._asked_loads:
            self._asked_loads.remove(source)
        self._loading = self._asked_loads[-1] if self._asked_loads else None
        self.model_panel.set_failed(source, message, keep_error=self._failed_in_queue)
        self._failed_in_queue = self._loading is not None
        if self._loading is not None:  # the next one's progress shows, and this one's failure stays said
            self.model_panel.set_loading(self._loading, keep_error=True)
        info = self.controller.info
        self.model_status.setText(model_status_text(info))
        self._update_can_send()
        show_error(
            self,
            "Model not loaded",
            f"Could not load {source_in_full(source)}:\n{message}"
            + (f"\n\n{info.name} is still loaded." if info else ""),
        )

    def _options_to_load(self) -> EngineOptions:
        """The options a model opens with: the user's own as kept, not the panel's, which may show what the
        model open now put in place of what it refused (the server's settings, for a remote model)."""
        return self.settings.options()

    def _remote_open(self) -> bool:
        info = self.controller.info
        return info is not None and info.source_kind == "remote"

    def _keep_options(self, options: EngineOptions) -> None:
        """The options a local model opens with next time. A remote model's are the server's (the panel shows them
        turned back to their defaults): they would overwrite the user's own."""
        if not self._remote_open():
            self.settings.engine_options = options.to_dict()

    def _options_chosen(self, options: EngineOptions) -> None:
        # A value the model cannot take, replaced by the panel, is kept for this model alone: saved, it turned
        # draft speculation (or a device, a precision) off for every model opened after one that refused it.
        self._requested_by_user = not self.toggles.replacing
        if self._requested_by_user:
            self._keep_options(self.toggles.users_choice(options))
        self._requested = options
        self.controller.reconfigure(options)

    def _reconfigure_failed(self, message: str) -> None:
        """The engine kept its options: the panel shows them again, and they are what is saved (the refused
        choice, saved when it was made, opened the next start with the options that had just failed)."""
        self._requested = None
        in_force = self.controller.options
        self.toggles.set_failed(message, in_force)
        self._keep_options(self.toggles.users_choice(in_force))

    def _reconfigured(self, options: EngineOptions, unavailable: dict) -> None:
        info = self.controller.info  # the precision and device now in force, whichever choice this replies to
        if info is not None:
            self.model_panel.set_info(info)
            self.model_status.setText(model_status_text(info))
            self.toggles.set_resolved(info.device, info.dtype)
        if self._requested is not None and options != self._requested:
            # The reply to a choice the user has since replaced (changes wait while an answer runs): the
            # panel keeps the newer choice, whose own reply follows with its own limits, and neither this
            # reply's reasons nor its limits (they follow its device) are pinned on it.
            return
        by_user = self._requested is None or self._requested_by_user
        self._requested = None
        self.toggles.set_limits(self.controller.limits)
        self.toggles.set_applied(options, unavailable)
        if by_user:
            self._keep_options(self.toggles.users_choice(options))

    def _update_can_send(self) -> None:
        if self._fetching:
            why = "Downloading the default model…"
        elif self._loading is not None:
            why = f"Loading {source_label(self._loading)}…"
        elif self.controller.info is None:
            why = "No model loaded: open one in the model panel (bottom left)"
        elif self._laddering:
            why = "The ladder is running (Cancel in the HUD's Ladder tab to chat now)"
        else:
            why = ""
        if self.hud is not None:  # the ladder measures the loaded model, as an answer does
            # nor while an answer runs: queued behind it, the composer said at once the ladder was running
            answering = "An answer is being generated: run the ladder once it ends" if self.flow.generating else ""
            self.hud.ladder.set_blocked("" if self._laddering else why or answering)
        self.composer.set_can_send(not why, why)
        self.chat_view.set_can_answer(not why)  # Edit and Regenerate ask the model as Send does

    # ---- settings ------------------------------------------------------------------------------------

    def set_theme(self, choice: str, save: bool = True) -> None:
        self.theme.set_choice(choice)
        self.settings.theme = choice
        self.theme_actions[choice].setChecked(True)
        if save:
            self._persist()

    def set_default_overflow(self, policy: str, save: bool = True) -> None:
        """The policy of chats that have none of their own (Chat settings can give one its own)."""
        self.flow.default_overflow = policy
        self.settings.overflow_policy = policy
        self.overflow_actions[policy].setChecked(True)
        if save:
            self._persist()
        self.recount_context()

    def set_send_with(self, key: str, save: bool = True) -> None:
        self.composer.set_send_with(key)
        self.settings.send_with = key
        self.send_actions[key].setChecked(True)
        if save:
            self._persist()

    def current_preferences(self) -> Preferences:
        s = self.settings
        return Preferences(
            self.theme.choice,  # a --theme of this run, else the saved one
            s.send_with,
            self.flow.default_sampling,
            self.flow.default_system_prompt,
            s.overflow_policy,
            s.models_folder,
        )

    def open_preferences(self) -> None:
        dialog = PreferencesDialog(self.current_preferences(), self.settings.last_folder or "", self)
        dialog.accepted.connect(lambda: self.apply_preferences(dialog.preferences(), dialog.last_folder))
        dialog.finished.connect(dialog.deleteLater)  # else each one opened stays a child of the window
        dialog.open()
        self._preferences_dialog = dialog  # kept for tests and so it is not collected while open

    def apply_preferences(self, p: Preferences, last_folder: str = "") -> None:
        """In force at once and saved: the theme and the send key now, the defaults from the chat on screen if it
        is still new and every new chat after it (chats with settings of their own keep them)."""
        if p.theme != self.theme.choice:  # a --theme of this run, left as it was, is not saved as the user's own
            self.set_theme(p.theme, save=False)
        self.set_send_with(p.send_with, save=False)
        self.flow.default_sampling = p.sampling
        self.settings.sampling = p.sampling.to_dict()
        self.settings.sampling_saved = True
        self.flow.default_system_prompt = p.system_prompt
        self.settings.system_prompt = p.system_prompt
        if last_folder and last_folder != self.settings.last_folder:
            self._folder_used(last_folder)
        if p.models_folder != self.settings.models_folder:
            self.settings.models_folder = p.models_folder
            self.refresh_models()
        self.set_default_overflow(p.overflow_policy, save=False)  # recounts the context with the new defaults
        self._persist()

    def _restore_layout(self) -> None:
        s = self.settings
        if s.window_geometry:
            self.restoreGeometry(QByteArray(base64.b64decode(s.window_geometry)))
        if s.window_state:
            self.restoreState(QByteArray(base64.b64decode(s.window_state)))
        self.refresh_models()

    def _persist(self, closing: bool = False) -> None:
        s = self.settings
        s.window_geometry = base64.b64encode(self.saveGeometry().data()).decode("ascii")
        s.window_state = base64.b64encode(self.saveState().data()).decode("ascii")
        s.splitter_sizes = {**s.splitter_sizes, "main": [int(x) for x in self.splitter.sizes()]}
        if self.width() > 0:  # the docks' share of the window's width, as the user dragged it
            s.splitter_sizes["docks"] = [round(self._dock_share * self.width()), self.width()]
        if self.hud_dock is not None:
            s.hud_visible = self.hud_dock.isVisible()
        if self.server_dock is not None:  # the Server panel (app.gui.attach_server)
            s.server_visible = self.server_dock.isVisible()
        try:
            kept_aside = self._save_settings(s)
        except SettingsError as exc:  # a read-only or full disk: the app keeps running
            log.error("%s", exc)
            if not closing:
                self.status.setText(str(exc))
                return
            # The status bar goes with the window: said where it is read, before the window closes.
            reason = str(exc)
            show_error_and_wait(
                self,
                "Settings not saved",
                f"{reason[:1].upper()}{reason[1:]}.\n\nWhat changed since they were last saved (the optimization "
                "choices, the window's size and place) will not be there at the next start.",
            )
            return
        for notice in kept_aside:  # a file damaged or a newer version's since it was read: moved, not written over
            if closing:
                show_error_and_wait(self, "Settings file kept aside", notice)
            else:
                self.status.setText(notice)

    def showEvent(self, event) -> None:
        super().showEvent(event)
        if not self._splitter_fitted:
            QTimer.singleShot(0, self, self._fit_splitter)  # once the first layout has given the splitter its width
        self._refit_docks(self.size())  # a window sized before it was shown gets its docks fitted to that size

    def _fit_splitter(self) -> None:
        if self._splitter_fitted:
            return
        self._splitter_fitted = True
        total = self.splitter.width() - self.splitter.handleWidth()
        mins = [max(w.minimumWidth(), w.minimumSizeHint().width()) for w in self._panes]
        sizes = fitting_sizes(self._saved_splitter, mins, total)
        if sizes is None:
            left = max(mins[0], int(total * LEFT_SHARE))
            sizes = [left, max(mins[1], total - left)]
        self.splitter.setSizes(sizes)

    def resizeEvent(self, event) -> None:
        """The docks keep their share of the window's width (changed only by dragging their edge): a window
        made narrow and wide again gets its panels back at their width, not the narrow one. Its height goes to
        the HUD: the optimizations keep what they need."""
        super().resizeEvent(event)
        if self.isVisible():
            # The window's layout has squeezed or stretched the docks already (before this event): not a drag.
            self._refit_docks(event.size())

    def _refit_docks(self, size: QSize) -> None:
        """The docks fitted to a new window size once the layout has settled: their share of its width, its
        height to the HUD."""
        if size == self._size_seen:
            return
        self._size_seen = QSize(size)
        width = max(DOCK_MIN_WIDTH, int(self._dock_share * size.width()))
        QTimer.singleShot(0, self, lambda: self._resize_docks(width))

    def _resize_docks(self, width: int) -> None:
        if self.options_dock.isFloating():
            return
        self._dock_resizing = True
        self.resizeDocks([self.options_dock], [width], Qt.Orientation.Horizontal)
        self._fit_dock_heights()
        self._dock_resizing = False

    def refit_on_toggle(self, dock: QDockWidget) -> None:
        """A right-hand panel shown or hidden (View menu): the optimizations are fitted again (hiding the Server
        panel left its height to them, a blank gap under their controls)."""
        dock.visibilityChanged.connect(self._refit_soon)  # a method: Qt drops it with the window (a lambda ran
        # on a window being deleted)

    def _refit_soon(self, _shown: bool) -> None:
        QTimer.singleShot(0, self, self._fit_dock_heights)

    def _fit_dock_heights(self) -> None:
        """The optimizations as tall as they need (one column of controls or two), the HUD the rest."""
        hud = self.hud_dock
        if hud is not None and hud.isVisible() and not hud.isFloating() and not self.options_dock.isFloating():
            need = self.options_dock.minimumSizeHint().height()
            self.resizeDocks([self.options_dock, hud], [need, self.height()], Qt.Orientation.Vertical)

    def eventFilter(self, obj, event) -> bool:
        if (
            obj is self.options_dock
            and event.type() == QEvent.Type.Resize
            and self.isVisible()
            and not self._dock_resizing
            and self.width() == self._size_seen.width()
            and not self.options_dock.isFloating()
        ):
            self._dock_share = self.options_dock.width() / self.width()  # the user dragged the edge
        return super().eventFilter(obj, event)

    # ---- keyboard ------------------------------------------------------------------------------------

    def tab_stops(self) -> list[QWidget]:
        """The widgets Tab visits, in reading order: the chats, the chat's header, the conversation from top to
        bottom, the composer, then the panels. Qt's own order is the order widgets were made, which put every
        message (made as the chat grows) after the panels, and the earlier messages of a long chat after the later."""
        regions: list[QWidget] = [self.chat_list, self._header, self.chat_view, self.composer, self.model_panel]
        regions += [d for d in (self.options_dock, self.hud_dock, self.server_dock) if d is not None]
        found: list[tuple[tuple[int, ...], QWidget]] = []
        w: Optional[QWidget] = self.nextInFocusChain()
        while w is not None and w is not self and len(found) < MAX_TAB_STOPS:
            stop = (
                w.focusPolicy().value & Qt.FocusPolicy.TabFocus.value
                and w.focusProxy() is None
                and w.isVisible()
                and w.isEnabled()
                and w.window() is self  # a floating dock is a window of its own, with its own order
            )
            if stop:
                rank = next((n for n, r in enumerate(regions) if r is w or r.isAncestorOf(w)), len(regions))
                where = (0, 0, 0)
                if rank < len(regions) and regions[rank] is self.chat_view and w is not self.chat_view:
                    at = w.mapTo(self.chat_view, QPoint(0, 0))
                    where = (1, at.y(), at.x())
                found.append(((rank, *where, len(found)), w))
            w = w.nextInFocusChain()
        return [w for _key, w in sorted(found, key=lambda f: f[0])]

    def focusNextPrevChild(self, forward: bool) -> bool:
        stops = self.tab_stops()
        here = QApplication.focusWidget()
        at = None
        if here is not None:
            at = next((n for n, w in enumerate(stops) if w is here), None)
            if at is None:  # inside a stop (a spin box's line edit)
                at = next((n for n, w in enumerate(stops) if w.isAncestorOf(here)), None)
        if at is None:
            return super().focusNextPrevChild(forward)
        target = stops[(at + (1 if forward else -1)) % len(stops)]
        target.setFocus(Qt.FocusReason.TabFocusReason if forward else Qt.FocusReason.BacktabFocusReason)
        parent = target.parentWidget()
        while parent is not None and parent is not self:  # the conversation and the panels scroll it into view
            if isinstance(parent, QScrollArea):
                parent.ensureWidgetVisible(target)
            parent = parent.parentWidget()
        return True

    def closeEvent(self, event) -> None:
        self.flow.stop()
        self._chat_search.close()
        self.toggles.apply_stepped()  # a dropdown or number stepped to just before: kept, as the focus leaving keeps it
        if self._draft_shown:
            self.drafts.put(self._draft_chat, self.composer.text())
        self._save_drafts(self.said_after_close.append)  # the status bar goes with the window
        self._persist(closing=True)
        self.closed.emit()
        super().closeEvent(event)
        self._closed = True
