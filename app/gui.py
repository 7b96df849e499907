"""`gapless gui`: build the desktop app (settings, chat store, engine controller, main window) and run it.

With --smoke-test it opens the same window offscreen, answers one prompt and writes a report (app.smoke).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

from app.paths import AppPaths

if TYPE_CHECKING:
    from PySide6.QtWidgets import QApplication

    from app.registry import RecentModels
    from app.settings import Settings

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USER_ERROR = 2


@dataclass
class GuiApp:
    """Everything the window needs, built once and closed in reverse order."""

    paths: AppPaths
    settings: Any  # app.settings.Settings
    settings_store: Any  # app.settings.SettingsStore
    notices: list[str]
    store: Any  # app.store.ChatStore
    controller: Any  # app.worker.EngineController
    theme: Any  # ui.theme.ThemeManager
    fetcher: Any  # app.fetcher.DefaultModelFetcher
    hud: Any  # ui.hud.HudPanel
    window: Any  # ui.main_window.MainWindow
    server: Any = None  # app.serve_app.AppServer
    collector: Any = None  # app.collector.GuiThreadCollector

    def close(self, timeout: float = 15.0) -> bool:
        """Stop the engine worker and the fetcher, close the chat store. False if the worker is still busy (in
        a load or a compile, which cannot be interrupted) after `timeout` s."""
        if self.collector is not None:
            self.collector.begin_close()  # this thread waits for the others from here: they must not wait for it
        from app.collector import gui_thread_waits

        with gui_thread_waits():  # the server's threads, the engine worker's, the fetcher's
            if self.server is not None:
                import app.engines

                self.server.stop()
                app.engines.keys_dir = app.engines.own_server = None
                app.engines.saved_key_first = False
            self.fetcher.cancel()
            stopped = self.controller.shutdown(timeout)
            self.fetcher.wait(5.0)
        # the worker's last signals (a stopped answer's result) wait in the event queue for the controller:
        # delivered before the store closes, the answer is kept as stopped with its figures, not as a crash's
        # (only those: the application's own posted events, a quit among them, are left to its loop)
        from PySide6.QtCore import QCoreApplication, QEvent

        QCoreApplication.sendPostedEvents(self.controller, QEvent.Type.MetaCall)
        self.store.close()
        if self.collector is not None:  # a worker still busy keeps running: its passes must not run there
            self.collector.close(others_stopped=stopped)
        return stopped


def leave(code: int, stopped: bool) -> int:
    """Return the exit code, or, when the engine worker is still busy, exit now: the chats are saved and the
    store closed, and Qt would abort the process when it tears down a thread still running."""
    if stopped:
        return code
    log.warning("exiting with the engine still busy (a load or compile that cannot be interrupted)")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ModelCatalog:
    """The models the window offers: the default, the recent ones (app.registry, shared with `gapless models
    list`) and those in the models folder chosen in the settings."""

    def __init__(self, recent: RecentModels, settings: Settings):
        self._recent = recent
        self._settings = settings

    @property
    def folder(self) -> Optional[str]:
        return self._settings.models_folder

    def default(self):
        from app.registry import default_model_entry

        return default_model_entry()

    def recent(self) -> list:
        return self._recent.entries()

    def scanned(self) -> list:
        from app.registry import scan_models_folder

        return scan_models_folder(Path(self.folder)) if self.folder else []

    def remember(self, source: str) -> None:
        self._recent.add(source)

    def forget(self, source: str) -> None:
        self._recent.remove(source)

    def clear_recent(self) -> None:
        self._recent.clear()

    def take_notices(self) -> list[str]:
        notices, self._recent.notices = list(self._recent.notices), []
        return notices


def preset_for_device(name: str, base: Any, device_type: str):
    """A preset as the ladder runs it on this device: on a CPU the half rung in bf16, the rest in fp32, and the
    int8, candidates and speculation rungs without compile (there a compile takes minutes and its step is slower
    than the eager one's own kernels; the ladder runs them so) and CUDA graphs (none on a CPU)."""
    from engine.ladder import rung_options, uncompiled

    opts = rung_options(name, base, device_type, None)
    return uncompiled(name, opts) if device_type != "cuda" else opts


def app_icon():
    from PySide6.QtGui import QIcon

    with resources.as_file(resources.files("assets").joinpath("gapless.svg")) as path:
        return QIcon(str(path))


def qt_application(argv0: str = "gapless") -> QApplication:
    from PySide6.QtWidgets import QApplication

    existing = QApplication.instance()  # typed QCoreApplication: the singleton, whichever class made it
    app = existing if isinstance(existing, QApplication) else QApplication([argv0])
    app.setApplicationName("Gapless")
    app.setApplicationDisplayName("Gapless")
    app.setDesktopFileName("gapless")
    app.setWindowIcon(app_icon())
    from ui.plain_text import install

    install(app)
    return app


def build(paths: AppPaths, theme_choice: Optional[str] = None, fetcher: Any = None) -> GuiApp:
    """Open the settings, the chat store and the engine controller, and build the main window (not shown).
    A QApplication must exist. Raises StoreError when the chat database cannot be opened."""
    from PySide6.QtWidgets import QApplication

    from app.collector import GuiThreadCollector
    from app.drafts import DRAFTS_FILE, Drafts
    from app.fetcher import DefaultModelFetcher
    from app.registry import RecentModels
    from app.settings import SettingsStore
    from app.store import ChatStore
    from app.worker import EngineController
    from ui.hud import HudPanel
    from ui.main_window import MainWindow
    from ui.plain_text import install
    from ui.theme import ThemeManager

    qapp = QApplication.instance()
    if not isinstance(qapp, QApplication):
        raise RuntimeError("build() needs a QApplication; create one first (qt_application())")
    install(qapp)  # outside text is never read as HTML (an application made elsewhere, e.g. by a test runner)
    paths.ensure()
    settings_store = SettingsStore(paths.settings_file)
    settings, notices = settings_store.load()
    store = ChatStore(paths.database)
    notices = notices + list(store.notices)
    theme = ThemeManager(qapp, theme_choice or settings.theme)  # --theme: this run only
    collector = GuiThreadCollector()  # from here on every collection runs on this thread (Qt objects die here)
    try:
        controller = EngineController()
    except BaseException:
        collector.close()
        store.close()
        raise
    try:
        fetcher = fetcher if fetcher is not None else DefaultModelFetcher()
        hud = HudPanel()
        catalog = ModelCatalog(RecentModels(paths.config), settings)
        window = MainWindow(
            store,
            controller,
            settings,
            settings_store.save,
            theme,
            settings.new_chat_sampling(),
            hud=hud,
            fetcher=fetcher,
            catalog=catalog,
            preset_resolver=preset_for_device,
            drafts=Drafts(paths.config / DRAFTS_FILE),
        )
        window.setWindowIcon(app_icon())
        server = attach_server(window, controller, paths)
    except BaseException:
        # the engine thread is running: stop it, or Qt aborts the process when the QThread is destroyed
        collector.begin_close()
        stopped = controller.shutdown()
        store.close()
        collector.close(others_stopped=stopped)
        raise
    return GuiApp(
        paths, settings, settings_store, notices, store, controller, theme, fetcher, hud, window, server, collector
    )


SERVER_KEY_NAME = "gapless serve (this app's own server)"  # the Server panel's key, among remote servers' (app.keys)


def attach_server(window: Any, controller: Any, paths: AppPaths) -> Any:
    """The Server dock (hidden until View > Server) and the model panel's remote models."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QDockWidget

    import app.engines
    from app.keys import KeyStore
    from app.serve_app import AppServer, reachable_url
    from ui.main_window import FitScrollArea
    from ui.server_panel import ServerPanel

    app.engines.keys_dir = paths.config
    app.engines.saved_key_first = True
    server = AppServer(controller, window)
    app.engines.own_server = server.serves  # read on the engine worker's thread when a remote model loads
    panel = ServerPanel()
    # where it listened and with which key, as the last run left them (they were typed again at each start)
    settings = window.settings
    panel.host.setText(settings.server_host)
    panel.port.setValue(settings.server_port)
    made: list[KeyStore] = []

    def keys() -> KeyStore:
        """The key store, made when the panel is first shown: an OS keyring is looked up (and may ask to be
        unlocked) then, not at every start of the app."""
        if not made:
            made.append(KeyStore(paths.config))
            panel.api_key.setText(made[0].get(SERVER_KEY_NAME) or "")
        return made[0]

    dock = QDockWidget("Server", window)
    dock.visibilityChanged.connect(lambda shown: shown and keys())
    dock.setObjectName("serverDock")
    dock.setWidget(FitScrollArea(panel, window, scroll_vertically=False))  # wrapped lines squeezed its fields
    window.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, dock)
    dock.setVisible(settings.server_visible)
    window.refit_on_toggle(dock)
    for act in window.menuBar().actions():
        if act.text().replace("&", "") == "View" and act.menu() is not None:
            dock.toggleViewAction().setText("Se&rver")  # S is the system theme's, in the View menu
            act.menu().addAction(dock.toggleViewAction())

    def start(host: str, port: int, api_key: str) -> None:
        settings.server_host, settings.server_port = host or settings.server_host, port
        refused = keep_key(keys(), SERVER_KEY_NAME, api_key or None)
        if refused:  # the server starts with it all the same; the next start asks for it again
            panel.set_error(refused)
        server.start(host, port, api_key)

    panel.startRequested.connect(start)
    panel.stopRequested.connect(server.stop)
    server.started.connect(lambda url: panel.set_running(url, reachable_url(url)))
    server.stopped.connect(lambda: panel.set_running(None))
    server.failed.connect(panel.set_error)
    server.statsChanged.connect(panel.set_stats)
    window.server_dock, window.server_panel = dock, panel
    window.model_panel.remoteRequested.connect(
        lambda url, model, key, timeout: open_remote(window, paths, url, model, key, timeout, server)
    )
    return server


def open_remote(
    window: Any, paths: AppPaths, base_url: str, model: str, api_key: str, timeout_s: float, server: Any = None
) -> None:
    """Keep the key (if one was given) and open the remote model like any other; not the app's own server."""
    from app.engines import SELF_REMOTE
    from app.keys import KeyStore
    from engine.errors import OptionsError
    from engine.remote import RemoteSource

    try:
        source = RemoteSource(base_url, model, timeout_s).validate()
        if server is not None and server.serves(source.base_url):
            raise OptionsError(f"{source.base_url}: {SELF_REMOTE}")
    except OptionsError as exc:
        window.model_panel.set_failed(f"remote:{base_url}#{model}", str(exc))
        return
    if api_key:
        refused = keep_key(KeyStore(paths.config), source.base_url, api_key)
        if refused:  # a read-only or full config folder: the model would open without its key
            window.model_panel.set_failed(source.to_source(), refused)
            return
    window.load_model(source.to_source())


def keep_key(keys: Any, name: str, key: Optional[str]) -> Optional[str]:
    """Keep `key` under `name` in `keys` (an app.keys.KeyStore; None forgets it); why it could not be, or None."""
    try:
        keys.set(name, key)
    except OSError as exc:
        # the file's error: a keyring that refused the key handed it on to the file (app.keys)
        reason = f"the API key could not be kept in {keys.file}: {exc.strerror or exc}"
        return reason + (" (the OS keyring refused it too)" if keys.keyring is not None else "")
    return None


def screenshot_file(given: "str | Path") -> tuple[Path, str]:
    """Where a screenshot the user named is written, and the image format its suffix names: checked before any
    work is done. Raises OutputPathError with the reason. Needs the QApplication (Qt's image plugins)."""
    from PySide6.QtGui import QImageWriter

    from engine.errors import OutputPathError
    from engine.paths import output_file

    target = output_file(given, "the screenshot")
    formats = sorted(bytes(f.data()).decode() for f in QImageWriter.supportedImageFormats())
    image_format = target.suffix.lower().lstrip(".")
    if image_format not in formats:
        raise OutputPathError(
            f"cannot write the screenshot to {given}: its suffix names no image format Qt writes ({', '.join(formats)})"
        )
    return target, image_format


def save_screenshot(widget: Any, given: "str | Path") -> Path:
    """`widget` as it is drawn now, written to `given` whole or not at all: encoded in memory, then written beside
    it and renamed over it (Qt wrote the image straight to the name given: a disk that filled left a truncated
    image there, with no reason). Raises OutputPathError saying what, where and why."""
    from engine.errors import OutputPathError
    from ui.hud import export

    _, image_format = screenshot_file(given)
    try:
        return export.save_image(given, widget, "the screenshot", image_format)
    except export.ExportError as exc:
        raise OutputPathError(str(exc)) from None


WITHOUT_A_WINDOW = (
    "without one, answer with gapless generate, serve the model with gapless serve, or check the app with "
    "gapless --smoke-test"
)


def no_display_reason(
    env: Optional[Mapping[str, str]] = None,
    platform: str = sys.platform,
    x_answers: Optional[Callable[[str], Optional[bool]]] = None,
) -> str:
    """Why the desktop app cannot open a window here ("" when it can), where Qt would abort the process with a
    message about libxcb-cursor0: a Linux session with no display (SSH, a server), or an X display named that
    does not answer (a DISPLAY left from another session, an X server that went away, one this user may not
    use). `x_answers(display)`: whether an X server answers there, None where that cannot be told."""
    seen: Mapping[str, str] = os.environ if env is None else env
    if not platform.startswith("linux"):
        return ""
    display, qpa = seen.get("DISPLAY", ""), seen.get("QT_QPA_PLATFORM", "")
    if not (display or seen.get("WAYLAND_DISPLAY") or qpa):
        return f"no display to open the app on (neither DISPLAY nor WAYLAND_DISPLAY is set); {WITHOUT_A_WINDOW}"
    x_only = not seen.get("WAYLAND_DISPLAY") and qpa.split(":")[0] in ("", "xcb")
    if display and x_only and (x_answers or _x_answers)(display) is False:
        return (
            f"the display {display} does not answer (no X server runs there, or this user may not use it: "
            f"xhost, XAUTHORITY); {WITHOUT_A_WINDOW}"
        )
    return ""


def _x_answers(display: str) -> Optional[bool]:
    """Whether an X server answers at `display` (libxcb's own connect, as Qt's xcb platform makes); None where
    libxcb cannot be loaded (Qt then says which library it misses)."""
    import ctypes

    try:
        xcb = ctypes.CDLL("libxcb.so.1")
    except OSError:
        return None
    xcb.xcb_connect.restype = ctypes.c_void_p
    xcb.xcb_connect.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    xcb.xcb_connection_has_error.argtypes = [ctypes.c_void_p]
    xcb.xcb_disconnect.argtypes = [ctypes.c_void_p]
    connection = xcb.xcb_connect(os.fsencode(display), None)  # never NULL: an error is a connection that says so
    try:
        return xcb.xcb_connection_has_error(connection) == 0
    finally:
        xcb.xcb_disconnect(connection)


def run_gui(args: Any, paths: AppPaths) -> int:
    if getattr(args, "smoke_test", False):
        return _run_smoke(args, paths)
    from app.store import StoreError
    from engine.errors import OutputPathError
    from ui.dialogs import show_error, show_error_and_wait

    no_display = no_display_reason()
    if no_display:  # Qt aborts the process, blaming a library that is there
        print(f"gapless: error: {no_display}", file=sys.stderr)
        return EXIT_USER_ERROR
    app = qt_application()
    try:
        gui = build(paths, getattr(args, "theme", None))
    except (StoreError, OutputPathError) as exc:  # started from a launcher, stderr is seen by nobody
        from PySide6.QtWidgets import QMessageBox

        QMessageBox.critical(None, "Gapless cannot start", str(exc))
        print(f"gapless: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    gui.window.show()
    for notice in gui.notices:
        show_error(gui.window, "Gapless", notice)
    from app.registry import source_key

    gui.window.load_model(source_key(args.model) if args.model else gui.settings.last_model or "default")
    stopped = False
    try:
        with closed_by_signals(gui.window):
            code = app.exec()
    finally:
        stopped = gui.close()
    for message in gui.window.said_after_close:  # a stopped answer the store refused as the app closed
        print(f"gapless: {message}", file=sys.stderr)
        show_error_and_wait(None, "Gapless", message)
    return leave(code, stopped)


CLOSING_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")  # Ctrl+C in the terminal; kill, a logout; the terminal closed
SIGNAL_POLL_MS = 200  # how often Python gets the chance to run a signal's handler while Qt's loop runs


@contextlib.contextmanager
def closed_by_signals(window: Any) -> Iterator[None]:
    """While the app runs, Ctrl+C in its terminal, SIGTERM and SIGHUP close the window as its close button does:
    the draft, the settings and an answer in progress (as stopped) are kept. SIGTERM ended the process at once,
    all three lost; Ctrl+C printed a KeyboardInterrupt traceback from whatever Python code ran next and the app
    went on."""
    import signal

    from PySide6.QtCore import QTimer

    def close(signum: int, _frame: Any) -> None:
        log.info("signal %d: closing the window", signum)
        QTimer.singleShot(0, window.close)

    previous: dict[int, Any] = {}
    for name in CLOSING_SIGNALS:
        number = getattr(signal, name, None)
        if number is None:
            continue
        try:
            if signal.getsignal(number) is signal.SIG_IGN:  # `nohup`, a background job: asked to be ignored
                continue
            previous[number] = signal.signal(number, close)
        except (ValueError, OSError):  # not the main thread, or a signal this system will not hand over
            pass
    poll = QTimer()  # Python runs a handler only when Python code runs: this gives it the chance
    poll.timeout.connect(lambda: None)
    poll.start(SIGNAL_POLL_MS)
    try:
        yield
    finally:
        poll.stop()
        for number, handler in previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(number, handler)


def _run_smoke(args: Any, paths: AppPaths) -> int:
    """Offscreen, in a private data dir unless one was given, so a check never touches the user's chats."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from app.smoke import SmokeTest

    temp: Optional[str] = None
    if args.data_dir is None and not os.environ.get("GAPLESS_DATA_DIR"):
        temp = tempfile.mkdtemp(prefix="gapless-smoke-")
        paths = AppPaths.resolve(Path(temp))
    app = qt_application()
    try:
        gui = build(paths, getattr(args, "theme", None))
        try:
            return SmokeTest(app, gui, args).run()
        finally:
            gui.close()
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
