"""The Server dock and the remote model dialog: the widgets alone, then in the app with the real engine on a tiny
model (API requests answered by the worker's engine between the app's own chats; a remote model opened through
the model panel with its key stored)."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import openai
import pytest
from PySide6.QtCore import Qt

from app.gui import build
from app.keys import KeyStore
from app.paths import AppPaths
from engine.types import ModelInfo, SamplingParams
from ui.model_panel import ModelPanel
from ui.remote_dialog import RemoteDialog
from ui.server_panel import ServerPanel

TIMEOUT_MS = 120_000
HELLO = [{"role": "user", "content": "hello world"}]


def test_server_panel_start_stop_and_figures(qtbot):
    panel = ServerPanel()
    qtbot.addWidget(panel)
    panel.port.setValue(9123)
    panel.api_key.setText("k")
    with qtbot.waitSignal(panel.startRequested) as start:
        qtbot.mouseClick(panel.button, Qt.MouseButton.LeftButton)
    assert start.args == ["127.0.0.1", 9123, "k"]
    panel.set_running("http://127.0.0.1:9123/v1")
    assert panel.button.text() == "Stop server" and not panel.host.isEnabled()
    assert "http://127.0.0.1:9123/v1" in panel.address.text()
    panel.set_stats(
        {
            "served": 3,
            "cancelled": 1,
            "rejected": 2,
            "failed": 1,
            "running": 1,
            "waiting": 4,
            "last_error": "prompt too long",
        }
    )
    assert "Requests served: 3" in panel.counts.text() and "4 waiting" in panel.counts.text()
    assert panel.error.text() == "Last error: prompt too long"
    with qtbot.waitSignal(panel.stopRequested):
        qtbot.mouseClick(panel.button, Qt.MouseButton.LeftButton)
    panel.set_running(None)
    assert panel.button.text() == "Start server" and panel.host.isEnabled()


def test_the_server_s_key_can_be_shown_generated_and_copied(qtbot):
    """The key was typed blind in a password field Qt does not copy from, with no way to read it back for the
    clients or to make one."""
    from PySide6.QtGui import QGuiApplication
    from PySide6.QtWidgets import QLineEdit

    panel = ServerPanel()
    qtbot.addWidget(panel)
    assert panel.api_key.echoMode() == QLineEdit.EchoMode.Password
    panel.show_key.click()
    assert panel.api_key.echoMode() == QLineEdit.EchoMode.Normal and panel.show_key.text() == "Hide"
    panel.new_key.click()
    key = panel.api_key.text()
    assert key.startswith("sk-") and len(key) >= 32
    panel.new_key.click()
    assert panel.api_key.text() != key  # random each time
    QGuiApplication.clipboard().setText("before")
    panel.copy_key.click()
    assert QGuiApplication.clipboard().text() == panel.api_key.text()
    panel.set_running("http://0.0.0.0:9123/v1", "http://192.168.1.7:9123/v1")
    assert panel.address.text() == (
        "Listening at http://0.0.0.0:9123/v1 — on every address of this machine, e.g. http://192.168.1.7:9123/v1"
    )
    assert not panel.new_key.isEnabled() and not panel.api_key.isEnabled()


def test_a_server_on_every_address_is_shown_at_one_a_client_can_use():
    from app.serve_app import reachable_url

    assert reachable_url("http://127.0.0.1:8080/v1") is None
    for wildcard in ("http://0.0.0.0:8080/v1", "http://[::]:8080/v1"):
        url = reachable_url(wildcard)
        assert url is not None and url.endswith(":8080/v1") and "0.0.0.0" not in url and "[::]" not in url


def test_enter_in_the_server_panel_s_fields_starts_the_server(qtbot):
    """A docked panel has no default button: Enter in Host, Port or API key did nothing. It starts the server with
    what the fields show (the port as typed), as the button does; while the server runs Enter stops nothing."""
    panel = ServerPanel()
    qtbot.addWidget(panel)
    panel.show()
    panel.activateWindow()
    qtbot.waitUntil(panel.isActiveWindow)
    starts: list[tuple] = []
    stops: list[bool] = []
    panel.startRequested.connect(lambda *args: starts.append(args))
    panel.stopRequested.connect(lambda: stops.append(True))
    panel.host.setFocus()
    panel.host.selectAll()
    qtbot.keyClicks(panel.host, "127.0.0.2")
    qtbot.keyClick(panel.host, Qt.Key.Key_Return)
    panel.port.setFocus()
    panel.port.selectAll()
    qtbot.keyClicks(panel.port, "9123")
    qtbot.keyClick(panel.port, Qt.Key.Key_Enter)  # the keypad's
    panel.api_key.setFocus()
    qtbot.keyClicks(panel.api_key, "sk-1")
    qtbot.keyClick(panel.api_key, Qt.Key.Key_Return)
    assert starts == [("127.0.0.2", 8080, ""), ("127.0.0.2", 9123, ""), ("127.0.0.2", 9123, "sk-1")]
    panel.set_running("http://127.0.0.2:9123/v1")
    panel.button.setFocus()
    qtbot.keyClick(panel.button, Qt.Key.Key_Return)
    assert len(starts) == 3 and stops == []


def test_remote_dialog_refuses_a_bad_url_and_returns_the_values(qtbot):
    d = RemoteDialog(None, "ftp://x", "m")
    qtbot.addWidget(d)
    d.accept()
    assert d.result() != RemoteDialog.DialogCode.Accepted and "http://" in d.error.text()
    d.base_url.setText("http://10.0.0.2:8000/v1/")
    d.model.setText("")
    d.accept()
    assert "model's name" in d.error.text()
    d.model.setText("qwen2.5:7b")
    d.api_key.setText("sk-1")
    d.timeout.setValue(15)
    d.accept()
    assert d.result() == RemoteDialog.DialogCode.Accepted
    assert d.values() == ("http://10.0.0.2:8000/v1", "qwen2.5:7b", "sk-1", 15.0)


@pytest.mark.parametrize(
    "url, key, words",
    [
        ("http://[::1/v1", "", "is not one (Invalid IPv6 URL)"),  # not a URL at all: it used to raise in accept()
        ("http://me:hunter2@10.0.0.2/v1", "", "may not hold a user name or password"),
        ("http://10.0.0.2/v1", "sk-é", "printable ASCII"),
        # a space opened "Name or service not known" for an IP address; '#' and '|' cut the address in two
        ("http://10.0.0.2 :8000/v1", "", "has no spaces, '#' or '|' in it"),
        ("http://10.0.0.2:8000/ v1", "", "has no spaces, '#' or '|' in it"),
        ("http://10.0.0.2:8000/v1#x", "", "has no spaces, '#' or '|' in it"),
        ("http://10.0.0.2:8000/v1|x", "", "has no spaces, '#' or '|' in it"),
    ],
)
def test_remote_dialog_says_what_is_wrong_with_the_address_or_key(qtbot, url, key, words):
    d = RemoteDialog(None, url, "m")
    qtbot.addWidget(d)
    d.api_key.setText(key)
    d.accept()
    assert d.result() != RemoteDialog.DialogCode.Accepted and words in d.error.text()


def test_a_pasted_key_loses_its_spaces_and_newline(qtbot):
    d = RemoteDialog(None, "http://10.0.0.2/v1", "m")
    qtbot.addWidget(d)
    d.api_key.setText("  sk-1\n")
    d.accept()
    assert d.result() == RemoteDialog.DialogCode.Accepted and d.values()[2] == "sk-1"


def test_a_key_pasted_into_the_server_panel_loses_its_spaces_and_newline(qtbot):
    panel = ServerPanel()
    qtbot.addWidget(panel)
    panel.api_key.setText("  sk-1\n")
    with qtbot.waitSignal(panel.startRequested) as start:
        qtbot.mouseClick(panel.button, Qt.MouseButton.LeftButton)
    assert start.args[2] == "sk-1"


def test_remote_dialog_shows_its_hints_whole(qtbot):
    d = RemoteDialog(None)
    qtbot.addWidget(d)
    d.show()
    for field in (d.model, d.api_key):
        assert field.width() > d.fontMetrics().horizontalAdvance(field.placeholderText()), field.placeholderText()


def test_model_panel_shows_a_remote_model_without_invented_numbers(qtbot):
    panel = ModelPanel()
    qtbot.addWidget(panel)
    panel.set_info(
        ModelInfo(
            "llama3",
            "remote",
            "OpenAI-compatible server",
            "remote",
            0,
            "set by the server",
            "http://h:8000/v1",
            0,
            0,
            "remote:http://h:8000/v1#llama3",
            "remote",
            "the model runs on a remote server",
        )
    )
    assert panel.values["parameters"].text() == "n/a (remote)" and panel.values["weights"].text() == "n/a (remote)"
    assert panel.values["context"].text() == "n/a (not reported)"
    assert panel.values["backend"].text() == "remote server"


@pytest.fixture
def gui(qtbot, tmp_path, tiny_llama):
    g = build(AppPaths.resolve(tmp_path / "data"), "light")
    g.window.show()
    with qtbot.waitSignal(g.controller.loaded, timeout=TIMEOUT_MS):
        g.window.load_model(str(tiny_llama))
    yield g
    g.window.close()
    g.close()


def test_the_key_store_is_not_asked_at_start_while_the_server_panel_is_hidden(qtbot, tmp_path, monkeypatch):
    """An OS keyring is looked up (and may ask to be unlocked) when the panel is first shown, not at every start."""
    import app.keys

    asked: list[int] = []
    monkeypatch.setattr(app.keys, "_keyring", lambda: asked.append(1))
    g = build(AppPaths.resolve(tmp_path / "data"), "light")
    try:
        g.window.show()
        qtbot.waitExposed(g.window)
        assert asked == [] and g.window.server_dock.isHidden()
        from app.gui import SERVER_KEY_NAME

        KeyStore(AppPaths.resolve(tmp_path / "data").config, use_keyring=False).set(SERVER_KEY_NAME, "sk-kept")
        g.window.server_dock.show()
        qtbot.waitUntil(lambda: g.window.server_panel.api_key.text() == "sk-kept", timeout=TIMEOUT_MS)
        assert asked == [1]
    finally:
        g.window.close()
        g.close()


def test_the_server_s_address_key_and_panel_are_kept_for_the_next_start(qtbot, gui, tmp_path):
    """Host, port and key were the defaults again at each start, and the panel hidden."""
    w, server = gui.window, gui.server
    w.server_dock.show()
    port = _free_port()
    w.server_panel.port.setValue(port)
    w.server_panel.api_key.setText("sk-mine")
    with qtbot.waitSignal(server.started, timeout=TIMEOUT_MS):
        w.server_panel.button.click()
    r = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-mine").models.list()
    assert r.data
    w.close()
    gui.close()
    again = build(AppPaths.resolve(tmp_path / "data"), "light")
    try:
        again.window.show()  # as the app starts (the key is read once the panel shows)
        qtbot.waitExposed(again.window)
        panel = again.window.server_panel
        assert (panel.host.text(), panel.port.value(), panel.api_key.text()) == ("127.0.0.1", port, "sk-mine")
        assert not again.window.server_dock.isHidden() and not panel.running  # shown, and not started by itself
        assert "sk-mine" not in (tmp_path / "data" / "config" / "settings.json").read_text(encoding="utf-8")
    finally:
        again.window.close()
        again.close()


def test_every_collection_of_a_model_switch_runs_on_the_gui_thread(qtbot, gui, tmp_path):
    """The app crashed in this thread's event loop while the engine worker ran the full collection that follows
    a model's close: the pass freed the GUI's Qt objects on the worker. Loads, closes and the server's threads
    leave every pass to this thread now, and the closed model's pass still runs before the next model loads."""
    import gc

    from tiny_models import make_tiny_model

    other = make_tiny_model(tmp_path / "other-model", "qwen2")
    passes: list[tuple[int, int]] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            passes.append((threading.get_ident(), info["generation"]))

    gc.callbacks.append(on_gc)
    try:
        with qtbot.waitSignal(gui.controller.loaded, timeout=TIMEOUT_MS):
            gui.window.load_model(str(other))
    finally:
        gc.callbacks.remove(on_gc)
    assert not gc.isenabled()
    assert any(generation == 2 for _, generation in passes)  # the closed model's cycles were collected
    assert {thread for thread, _ in passes} == {threading.get_ident()}


@pytest.mark.parametrize("same_name", [False, True])
def test_a_request_waiting_while_the_app_loads_another_model_is_not_answered_by_it(qtbot, gui, tmp_path, same_name):
    """A request for the loaded model, waiting behind a model switch, was answered by the new model under the
    old one's name; and, where the new model has the same name (two files or folders of one name, two servers'
    models of one name), by it with a 200."""
    from tiny_models import make_tiny_model

    from app.worker import Call

    w, server, c = gui.window, gui.server, gui.controller
    old_name = c.info.name
    other = make_tiny_model(tmp_path / "elsewhere" / (old_name if same_name else "other-model"), "qwen2")
    port = _free_port()
    w.server_panel.port.setValue(port)
    with qtbot.waitSignal(server.started, timeout=TIMEOUT_MS):
        w.server_panel.button.click()
    busy, release = threading.Event(), threading.Event()  # the engine busy a moment (another client's answer)
    c.worker.commands.put(Call(lambda _e: (busy.set(), release.wait(60)), threading.Event()))
    assert busy.wait(60)
    w.load_model(str(other))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    got: dict = {}

    def ask() -> None:
        try:
            got["r"] = client.chat.completions.create(model=old_name, messages=HELLO, max_tokens=12, temperature=0)
        except openai.APIStatusError as exc:
            got["error"] = exc

    asker = threading.Thread(target=ask)
    asker.start()
    qtbot.waitUntil(lambda: server.engines.stats.waiting + server.engines.stats.running >= 1, timeout=TIMEOUT_MS)
    with qtbot.waitSignal(c.loaded, timeout=TIMEOUT_MS):
        release.set()
    qtbot.waitUntil(lambda: not asker.is_alive(), timeout=TIMEOUT_MS)
    error = got["error"]
    assert isinstance(error, openai.NotFoundError) and error.body["code"] == "model_not_found"
    assert f"was replaced by {c.info.name!r} while the request waited" in error.body["message"]
    assert (c.info.name == old_name) is same_name and c.info.source == str(other)
    qtbot.waitUntil(lambda: server.engines.model_id == c.info.name, timeout=TIMEOUT_MS)
    r = client.chat.completions.create(model=c.info.name, messages=HELLO, max_tokens=4, temperature=0)
    assert r.model == c.info.name  # the new model's name is served


def test_a_model_opened_in_the_app_stops_an_api_answer_with_the_reason(qtbot, gui, tmp_path, monkeypatch):
    """The load waited for the whole answer of an API client (minutes, for a long max_tokens), the app saying
    nothing; the answer is stopped now and its client told why."""
    from tiny_models import make_tiny_model

    import app.server.engine_queue as engine_queue
    import engine.observers

    monkeypatch.setattr(engine.observers, "FLUSH_INTERVAL_S", 0.0)
    other = make_tiny_model(tmp_path / "other-model", "qwen2")
    w, server, c = gui.window, gui.server, gui.controller
    old_name = c.info.name
    streaming = threading.Event()
    real = engine_queue._texts_to

    def held(sink):
        send = real(sink)

        def on_event(event):
            send(event)
            if event.__class__.__name__ == "TextDelta" and not streaming.is_set():
                streaming.set()  # the answer is running: it goes on only once it is stopped (or after 30 s)
                job = server.engines._current
                job.cancel.wait(30)

        return on_event

    monkeypatch.setattr(engine_queue, "_texts_to", held)
    port = _free_port()
    w.server_panel.port.setValue(port)
    with qtbot.waitSignal(server.started, timeout=TIMEOUT_MS):
        w.server_panel.button.click()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    got: dict = {}

    def ask() -> None:
        try:
            got["r"] = client.chat.completions.create(model=c.info.name, messages=HELLO, max_tokens=40, temperature=0)
        except openai.APIStatusError as exc:
            got["error"] = exc

    asker = threading.Thread(target=ask)
    asker.start()
    assert streaming.wait(60)
    with qtbot.waitSignal(c.loaded, timeout=TIMEOUT_MS):
        w.load_model(str(other))
    qtbot.waitUntil(lambda: not asker.is_alive(), timeout=TIMEOUT_MS)
    error = got.get("error")
    assert isinstance(error, openai.APIStatusError), got
    assert error.status_code == 503 and error.body["code"] == "model_replaced"
    assert error.body["message"] == (
        "the answer was stopped: the app is opening another model (other-model); ask again once it is in"
    )
    assert c.info.name != old_name and server.engines.stats.failed == 1


def test_the_app_serves_its_engine_between_its_own_chats(qtbot, gui, tiny_llama):
    from engine.engine import Engine
    from engine.types import EngineOptions

    panel, server = gui.window.server_panel, gui.server
    assert gui.window.server_dock.isHidden()
    panel.host.setText("0.0.0.0")  # beyond loopback without a key: refused with the reason, the app goes on
    with qtbot.waitSignal(server.failed, timeout=TIMEOUT_MS) as failed:
        qtbot.mouseClick(panel.button, Qt.MouseButton.LeftButton)
    assert failed.args[0].startswith("refusing to listen on 0.0.0.0 without an API key")
    assert not panel.error.isHidden() and panel.error.text().startswith("refusing") and not server.running
    panel.host.setText("127.0.0.1")
    server_port = _free_port()
    panel.port.setValue(server_port)
    with qtbot.waitSignal(server.started, timeout=TIMEOUT_MS):
        qtbot.mouseClick(panel.button, Qt.MouseButton.LeftButton)
    assert panel.address.text() == f"Listening at http://127.0.0.1:{server_port}/v1"

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server_port}/v1", api_key="unused", max_retries=0)
    api: dict = {}
    asker = threading.Thread(
        target=lambda: api.update(
            r=client.chat.completions.create(model=tiny_llama.name, messages=HELLO, max_tokens=12, temperature=0)
        )
    )
    asker.start()
    sampling = SamplingParams(temperature=0.0, max_new_tokens=16)
    with qtbot.waitSignal(gui.controller.generationFinished, timeout=TIMEOUT_MS) as chat:
        gui.controller.generate([{"role": "user", "content": "the quick brown fox"}], sampling)
    qtbot.waitUntil(lambda: not asker.is_alive(), timeout=TIMEOUT_MS)
    ref = Engine.load(str(tiny_llama), EngineOptions(device="cpu"))
    try:
        assert (
            api["r"].choices[0].message.content
            == ref.generate(HELLO, SamplingParams(temperature=0.0, max_new_tokens=12)).texts[0]
        )
        assert chat.args[1].texts == ref.generate([{"role": "user", "content": "the quick brown fox"}], sampling).texts
    finally:
        ref.close()
    qtbot.waitUntil(lambda: panel.counts.text().startswith("Requests served: 1"), timeout=TIMEOUT_MS)
    # the app's own server as a remote model: each would wait for the other (every answer hung to its timeout)
    for own in (f"http://localhost:{server_port}/v1", f"http://127.0.0.1:{server_port}/v1"):
        gui.window.model_panel.remoteRequested.emit(own, tiny_llama.name, "", 30.0)
        assert "it is this app's own server (the Server panel)" in gui.window.model_panel.error.text()
    assert gui.controller.info.source_kind != "remote"
    with qtbot.waitSignal(server.stopped, timeout=TIMEOUT_MS):
        qtbot.mouseClick(panel.button, Qt.MouseButton.LeftButton)
    assert panel.address.text() == "Not running"


@pytest.mark.parametrize(
    "server_url, base_url, same",
    [
        ("http://127.0.0.1:8080/v1", "http://localhost:8080/v1", True),
        ("http://0.0.0.0:8080/v1", "http://127.0.0.1:8080/v1", True),
        ("http://[::1]:8080/v1", "http://[::1]:8080/v1", True),
        ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8081/v1", False),
        ("http://127.0.0.1:8080/v1", "http://gpu-box:8080/v1", False),
        ("http://127.0.0.1:80/v1", "http://localhost/v1", True),
        ("http://127.0.0.1:8080/v1", "http://localhost:notaport/v1", False),
    ],
)
def test_a_remote_address_is_known_for_the_app_s_own_server(server_url, base_url, same):
    from app.serve_app import reaches

    assert reaches(server_url, base_url) is same


def test_a_server_on_every_address_is_known_by_this_machine_s_name_and_lan_address():
    """A server on 0.0.0.0 listens on the machine's LAN address too: a remote model at that address is the
    app's own server, and answering through it would have each wait for the other."""
    import socket

    from app.serve_app import reaches

    name = socket.gethostname()
    assert reaches("http://0.0.0.0:8080/v1", f"http://{name}:8080/v1")
    assert not reaches("http://0.0.0.0:8080/v1", f"http://{name}:8081/v1")
    assert not reaches("http://127.0.0.1:8080/v1", f"http://{name}:8080/v1")  # loopback only: not on the LAN
    assert not reaches("http://0.0.0.0:8080/v1", "http://203.0.113.7:8080/v1")  # another machine
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        try:
            udp.connect(("192.0.2.1", 9))  # picks the interface a packet would leave by; sends nothing
            lan = udp.getsockname()[0]
        except OSError:  # no route at all: the machine has no LAN address to check
            lan = None
    if lan is not None:
        assert reaches("http://0.0.0.0:8080/v1", f"http://{lan}:8080/v1")
        assert reaches("http://[::]:8080/v1", f"http://{lan}:8080/v1")


def test_stop_answers_a_request_still_waiting_for_the_engine_with_503(qtbot, gui, tiny_llama, caplog):
    """A request waiting for the worker (busy with the app's own work) when the server stops: 503 shutting_down,
    counted as cancelled, no error in the log."""
    from app.worker import Call

    panel, server = gui.window.server_panel, gui.server
    port = _free_port()
    panel.port.setValue(port)
    with qtbot.waitSignal(server.started, timeout=TIMEOUT_MS):
        qtbot.mouseClick(panel.button, Qt.MouseButton.LeftButton)
    busy, release = threading.Event(), threading.Event()
    gui.controller.worker.commands.put(Call(lambda _e: (busy.set(), release.wait(60)), threading.Event()))
    try:
        stop_while_the_worker_is_busy(qtbot, gui, tiny_llama, caplog, port, busy)
    finally:
        release.set()  # the worker goes on, whatever the test found


def stop_while_the_worker_is_busy(qtbot, gui, tiny_llama, caplog, port, busy) -> None:
    import logging

    panel, server = gui.window.server_panel, gui.server
    assert busy.wait(60)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    got: dict = {}

    def ask() -> None:
        try:
            client.chat.completions.create(model=tiny_llama.name, messages=HELLO, max_tokens=4)
        except openai.APIStatusError as exc:
            got["error"] = exc

    asker = threading.Thread(target=ask)
    asker.start()
    # handed to the worker, which finishes the app's own work first: the panel says it waits (it said "running")
    qtbot.waitUntil(lambda: gui.controller.worker.commands.qsize() == 1, timeout=TIMEOUT_MS)
    qtbot.waitUntil(lambda: "now 0 running, 1 waiting" in panel.counts.text(), timeout=TIMEOUT_MS)
    with caplog.at_level(logging.ERROR), qtbot.waitSignal(server.stopped, timeout=TIMEOUT_MS):
        qtbot.mouseClick(panel.button, Qt.MouseButton.LeftButton)
    asker.join(60)
    assert got["error"].status_code == 503 and got["error"].body["code"] == "shutting_down"
    assert panel.counts.text().startswith("Requests served: 0") and "failed 0" in panel.counts.text()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@contextmanager
def served(model_path, api_key: str):
    """`gapless serve` on a second engine, in this process, on a free loopback port."""
    from app.server.engine_queue import EngineQueue
    from app.server.http import ServeConfig
    from app.server.run import BackgroundServer
    from engine.engine import Engine
    from engine.types import EngineOptions

    engine = Engine.load(str(model_path), EngineOptions(device="cpu"))
    engines = EngineQueue(engine)
    server = BackgroundServer(engines, config=ServeConfig(api_key=api_key))
    try:
        yield server.url
    finally:
        server.stop()
        engines.close()
        engine.close()


def _free_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class PlainServer:
    """A stand-in for an OpenAI-compatible server that is none of those known to take top-k or a repetition
    penalty (as OpenAI's own, or Ollama's): it lists one model with its context and answers every chat with the
    same few words."""

    MODEL = "plain-model"
    CONTEXT = 8192

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(
            routes=[Route("/v1/models", self.models), Route("/v1/chat/completions", self.chat, methods=["POST"])]
        )

    async def models(self, _request):
        from starlette.responses import JSONResponse

        entry = {"id": self.MODEL, "object": "model", "owned_by": "someone", "context_length": self.CONTEXT}
        return JSONResponse({"object": "list", "data": [entry]})

    async def chat(self, request):
        import json

        from starlette.responses import StreamingResponse

        self.bodies.append(await request.json())

        def chunk(text: str, finish=None) -> str:
            delta = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
            return f"data: {json.dumps(delta)}\n\n"

        events = [chunk("Hello"), chunk(" there"), chunk("", "stop"), "data: [DONE]\n\n"]
        return StreamingResponse(iter(events), media_type="text/event-stream")


@contextmanager
def plain_server():
    from app.server.run import AsgiThread

    stand_in = PlainServer()
    thread = AsgiThread(stand_in.app())
    try:
        yield stand_in, thread.url
    finally:
        thread.stop()


def _listed(url: str, key: str = "") -> dict:
    import httpx

    r = httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)
    assert r.status_code == 200, r.text
    (entry,) = r.json()["data"]
    return entry


def test_the_app_s_server_lists_its_model_as_gapless_serve_does(qtbot, gui, tiny_llama, monkeypatch):
    """The app's server listed its model without its context (`max_model_len`) and with top-k and the repetition
    penalty even where the loaded model was a remote one whose server takes neither: a Gapless client in front of
    it (with the app's default top-k of 40) got a 400 on every answer instead of a note that top-k was not
    applied. It lists what `gapless serve` lists for the same model, and follows the model the app loads."""
    import app.keys
    from engine.remote import RemoteEngine, RemoteSource

    monkeypatch.setattr(app.keys, "_keyring", lambda: None)
    server = gui.server
    port = _free_port()
    server.start("127.0.0.1", port)
    assert server.running
    url = f"http://127.0.0.1:{port}/v1"
    with served(tiny_llama, api_key="sk-serve") as serve_url:
        assert _listed(url) == _listed(serve_url, "sk-serve")
    assert _listed(url)["max_model_len"] == gui.controller.info.context_length > 0

    with plain_server() as (stand_in, plain_url):
        with qtbot.waitSignal(gui.controller.loaded, timeout=TIMEOUT_MS):
            gui.window.model_panel.remoteRequested.emit(plain_url, PlainServer.MODEL, "", 30.0)
        entry = _listed(url)
        assert entry["id"] == gui.controller.info.name and entry["max_model_len"] == PlainServer.CONTEXT
        assert entry["x_gapless"] == {"sampling_extensions": []}
        front = RemoteEngine.load(RemoteSource(url, entry["id"]))
        try:
            sampling = SamplingParams(temperature=0.7, top_k=40, repetition_penalty=1.1, max_new_tokens=8)
            r = front.generate(HELLO, sampling)
        finally:
            front.close()
        assert r.texts == ["Hello there"]
        assert any("top-k 40 and repetition penalty 1.1 not applied" in n for n in r.notices), r.notices
        assert "top_k" not in stand_in.bodies[-1] and "repetition_penalty" not in stand_in.bodies[-1]

    with qtbot.waitSignal(gui.controller.loaded, timeout=TIMEOUT_MS):
        gui.window.load_model(str(tiny_llama))
    entry = _listed(url)
    assert entry["max_model_len"] == gui.controller.info.context_length
    assert entry["x_gapless"] == {"sampling_extensions": ["top_k", "repetition_penalty"]}
    server.stop()


def test_an_api_key_that_cannot_be_kept_says_so(qtbot, gui, monkeypatch):
    """A config folder that refuses the key file: OK did nothing at all (the error escaped the slot)."""
    import app.keys

    monkeypatch.setattr(app.keys, "_keyring", lambda: None)
    (gui.paths.config / app.keys.FILE_NAME).mkdir(parents=True)  # the key file cannot be written
    panel, before = gui.window.model_panel, gui.controller.info
    panel.remoteRequested.emit("http://10.0.0.2:8000/v1", "llama3", "sk-1", 30.0)
    assert panel.error.isVisible() and "the API key could not be kept in" in panel.error.text()
    assert gui.window._loading is None and gui.controller.info is before


def test_an_api_key_that_neither_the_keyring_nor_the_file_takes_names_the_file(qtbot, gui, monkeypatch):
    """It said "could not be kept in the OS keyring: Is a directory": the error was the file's, where the key went
    after the keyring refused it."""
    import types

    import app.keys

    def refuse(*_args):
        raise RuntimeError("locked")

    monkeypatch.setattr(app.keys, "_keyring", lambda: types.SimpleNamespace(set_password=refuse))
    key_file = gui.paths.config / app.keys.FILE_NAME
    key_file.mkdir(parents=True)  # the key file cannot be written
    gui.window.model_panel.remoteRequested.emit("http://10.0.0.2:8000/v1", "llama3", "sk-1", 30.0)
    said = gui.window.model_panel.error.text()
    assert f"could not be kept in {key_file}: " in said and "the OS keyring refused it too" in said, said


def test_a_remote_model_opens_through_the_model_panel(qtbot, gui, tiny_llama, monkeypatch):
    import app.keys

    monkeypatch.setattr(app.keys, "_keyring", lambda: None)
    with served(tiny_llama, api_key="sk-ui") as url:
        with qtbot.waitSignal(gui.controller.loaded, timeout=TIMEOUT_MS) as loaded:
            gui.window.model_panel.remoteRequested.emit(url, tiny_llama.name, "sk-ui", 30.0)
        info = loaded.args[0]
        assert info.backend == "remote" and info.source == f"remote:{url}#{tiny_llama.name}|timeout=30"
        assert KeyStore(gui.paths.config, use_keyring=False).get(url) == "sk-ui"
        assert gui.window.model_panel.values["backend"].text() == "remote server"
        with qtbot.waitSignal(gui.controller.generationFinished, timeout=TIMEOUT_MS) as done:
            gui.controller.generate(HELLO, SamplingParams(temperature=0.0, max_new_tokens=8))
        assert done.args[1].metrics.http_ttft_ms > 0 and done.args[1].texts[0]


def test_the_server_does_not_start_where_the_loaded_remote_model_is(qtbot, gui, tiny_llama, monkeypatch):
    """A remote model at the address the app's server then takes: every request would wait on itself."""
    import app.keys

    monkeypatch.setattr(app.keys, "_keyring", lambda: None)
    with served(tiny_llama, api_key="sk-ui") as url:
        with qtbot.waitSignal(gui.controller.loaded, timeout=TIMEOUT_MS):
            gui.window.model_panel.remoteRequested.emit(url, tiny_llama.name, "sk-ui", 30.0)
    server, said = gui.server, []
    server.failed.connect(said.append)
    server.start("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0]))
    assert len(said) == 1 and "the loaded model is a remote one at" in said[0] and "this app's own server" in said[0]
    assert not server.running


def test_a_recent_remote_model_at_the_app_s_own_server_is_refused(qtbot, gui, tiny_llama, monkeypatch):
    """A remote model opened from the Recent menu (or a load asked for before the server started) at the address
    the app's server now listens on, as `gapless serve` once did on the same default port: it opened, and every
    answer then waited on itself until its timeout. It is refused as from the Remote dialog."""
    import app.keys

    monkeypatch.setattr(app.keys, "_keyring", lambda: None)
    c = gui.controller
    with served(tiny_llama, api_key="sk-ui") as url:
        with qtbot.waitSignal(c.loaded, timeout=TIMEOUT_MS):
            gui.window.model_panel.remoteRequested.emit(url, tiny_llama.name, "sk-ui", 30.0)
        remote = c.info.source
    with qtbot.waitSignal(c.loaded, timeout=TIMEOUT_MS):
        gui.window.load_model(str(tiny_llama))
    assert any(e.source == remote for e in gui.window.catalog.recent())
    with qtbot.waitSignal(gui.server.started, timeout=TIMEOUT_MS):
        gui.server.start("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0]))
    outcomes: list = []
    c.loaded.connect(lambda info, _u: outcomes.append(("loaded", info.source)))
    c.loadFailed.connect(lambda source, message: outcomes.append(("failed", message)))
    gui.window.model_panel.openRequested.emit(remote)  # as the Recent menu opens it
    qtbot.waitUntil(lambda: bool(outcomes), timeout=TIMEOUT_MS)
    assert outcomes[0][0] == "failed" and "it is this app's own server (the Server panel)" in outcomes[0][1]
    assert c.info.source == str(tiny_llama)
    assert "it is this app's own server" in gui.window.model_panel.error.text()
    gui.server.stop()


def test_a_remote_model_leaves_the_user_s_own_options_as_they_were(qtbot, gui, tiny_llama, monkeypatch):
    """The panel shows a remote model's options turned back to the defaults (the server decides them); opening a
    local model afterwards brings back the user's, and the settings never held the remote ones."""
    import dataclasses

    import app.keys

    monkeypatch.setattr(app.keys, "_keyring", lambda: None)
    chosen = dataclasses.replace(gui.controller.options, kv_cache="dynamic", sampling="host")
    with qtbot.waitSignal(gui.controller.reconfigured, timeout=TIMEOUT_MS):
        gui.window.toggles._change(chosen)
    assert gui.settings.options() == chosen
    with served(tiny_llama, api_key="sk-ui") as url:
        with qtbot.waitSignal(gui.controller.loaded, timeout=TIMEOUT_MS):
            gui.window.model_panel.remoteRequested.emit(url, tiny_llama.name, "sk-ui", 30.0)
        qtbot.waitUntil(lambda: gui.window.toggles.options.kv_cache == "static", timeout=TIMEOUT_MS)
        assert gui.settings.options() == chosen
        with qtbot.waitSignal(gui.controller.loaded, timeout=TIMEOUT_MS):
            gui.window.load_model(str(tiny_llama))
    assert gui.controller.options == chosen and gui.window.toggles.options == chosen
    assert gui.settings.options() == chosen


def test_the_hud_bars_show_the_client_side_figures_of_a_remote_model(qtbot):
    from engine.diagnosis import diagnose
    from engine.types import EngineOptions, GenerationMetrics
    from ui.hud.bars import BarStrip

    m = GenerationMetrics(prompt_tokens=5, new_tokens_total=20)
    m.put("http_ttft_ms", 42.0)
    m.put("http_decode_tok_s", 31.0)
    m.put("inter_token_ms_p50", 30.0)
    for key in ("ttft_ms", "decode_tok_s", "step_ms_p50", "step_ms_p99", "kernel_gap_pct"):
        m.mark_na(key, "the model runs on a remote server; measured there, not here")
    m.mark_na("inter_token_ms_p99", "too few text chunks arrived to time")
    strip = BarStrip()
    qtbot.addWidget(strip)
    strip.set_metrics(m, EngineOptions(), "remote", diagnose(m.to_dict(), EngineOptions().to_dict()))
    shown = strip.values()
    assert shown["ttft_ms"]["text"].startswith("42") and shown["ttft_ms"]["source"] == "client-side timing over HTTP"
    assert strip._rows["ttft_ms"][0].text() == "TTFT (HTTP)"
    assert shown["decode_tok_s"]["source"] == "client-side timing over HTTP"
    assert strip._rows["step_ms_p50"][0].text() == "Inter-token p50 (HTTP)"
    assert shown["step_ms_p99"]["fraction"] is None and "remote server" in shown["step_ms_p99"]["source"]
    assert shown["kernel_gap_pct"]["fraction"] is None and "remote server" in shown["kernel_gap_pct"]["source"]
    local = GenerationMetrics(new_tokens_total=3)
    local.put("ttft_ms", 7.0)
    strip.set_metrics(local, EngineOptions(), "local", diagnose(local.to_dict(), EngineOptions().to_dict()))
    assert strip._rows["ttft_ms"][0].text() == "TTFT" and "engine timing" in strip.values()["ttft_ms"]["source"]
