"""Where the engine keeps downloaded models and compiled artifacts (the user cache dir, or $GAPLESS_CACHE_DIR)."""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import platformdirs

from engine.errors import ModelLoadError, OutputPathError

APP_NAME = "gapless"


NO_HOME = (
    "cannot tell where the home folder is (HOME is not set, and the password database has none for this user): "
    "set HOME, or GAPLESS_DATA_DIR and GAPLESS_CACHE_DIR"
)


def user_path(given: "str | os.PathLike[str]") -> Path:
    """`given` with a leading ~ or ~user expanded where that user's home is known, else as it is (then not found,
    with its own message): Path.expanduser raised RuntimeError for "~nosuchuser/m.gguf", an internal error."""
    return Path(os.path.expanduser(os.fspath(given)))


def absolute(given: "str | os.PathLike[str]", what: str) -> Path:
    """user_path(given), absolute with its links resolved; OutputPathError naming `what` (a folder's role) where
    it cannot be (a loop of symbolic links)."""
    try:
        return user_path(given).resolve()
    except (RuntimeError, OSError) as exc:  # Python 3.11 says "Symlink loop from ..." as a RuntimeError
        raise OutputPathError(f"{what} {os.fspath(given)!r} cannot be used: {_why(exc)}") from None


def platform_dir(kind: str) -> Path:
    """platformdirs' user folder of `kind` ("data", "config", "log", "cache") for the app; OutputPathError where
    there is no home folder to put it in."""
    try:
        return Path(getattr(platformdirs, f"user_{kind}_dir")(APP_NAME, appauthor=False))
    except (RuntimeError, KeyError) as exc:
        raise OutputPathError(NO_HOME) from exc


def _why(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def cache_dir() -> Path:
    """$GAPLESS_CACHE_DIR with `~` expanded and made absolute (as typed, "~/x" in quotes made a folder named "~"
    in whatever folder the app started in), else the user cache dir."""
    given = os.environ.get("GAPLESS_CACHE_DIR")
    if given:
        return _made(absolute(given, "GAPLESS_CACHE_DIR"))
    return _made(platform_dir("cache"))


def models_cache_dir() -> Path:
    return _made(cache_dir() / "models")


def compile_cache_dir() -> Path:
    return _made(cache_dir() / "inductor")


def _made(path: Path) -> Path:
    """`path`, made where missing. A cache that cannot be made (read-only, another user's) is not fatal: what
    would be kept there is made again each time, and a write that needs it fails with its own message."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if path not in _WARNED:  # once: every load and conversion asks for it
            _WARNED.add(path)
            logging.getLogger(__name__).warning("cannot make the cache folder %s: %s", path, exc.strerror or exc)
    return path


_WARNED: set[Path] = set()


def output_file(path: "str | os.PathLike[str]", what: str) -> Path:
    """Where to write `what` that the user named `path`: checked before any work is done, so a long run is not lost
    at its end. A symlink is followed (the file it names is written, the link kept); a folder, a device or any
    other file that is not a regular one is refused, as is a folder that does not exist (none is created).
    Raises OutputPathError with the reason."""
    from engine.errors import OutputPathError

    given = Path(path)
    try:
        target = given.resolve() if given.is_symlink() else given
        if target.exists() and not target.is_file():
            kind = "a folder" if target.is_dir() else "not a regular file"
            raise OutputPathError(f"cannot write {what} to {given}: it is {kind}")
        folder = target.parent
        found = folder.is_dir()
    except OSError as exc:  # a name longer than the file system takes, a folder that may not be looked into
        raise OutputPathError(f"cannot write {what} to {given}: {exc.strerror or exc}") from None
    if not found:
        raise OutputPathError(f"cannot write {what} to {given}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot write {what} to {given}: the folder {folder} is not writable")
    return target


def write_whole(path: Path, text: "str | bytes", mode: int = 0o644, durable: bool = False) -> None:
    """`text` (UTF-8, or bytes as they are: an image) written whole or not at all: to a temporary file beside
    `path` (owner-only until it is whole), then renamed over it with `mode`; `durable`: on the disk before the
    rename. Raises OSError, leaving no temporary file where it can be removed."""
    import contextlib
    import tempfile

    # The temporary name is the file's, cut: a name near the file system's longest would be too long with the
    # dot and the random part added. Cut between characters, counted in the file system's own encoding (an ASCII
    # locale's "ëxport.json" made of UTF-8 here became a name it could not write; a cut inside a character is a
    # name Windows cannot decode and macOS refuses).
    stem = path.name[:64]
    while len(os.fsencode(stem)) > 64:
        stem = stem[:-1]
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=TEMPORARY_SUFFIX, dir=path.parent)
    try:
        data = text if isinstance(text, bytes) else text.encode("utf-8")  # a character it refuses: nothing written
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to report
            Path(tmp).unlink(missing_ok=True)
        raise
    _remove_stale_temporaries(path.parent, f".{stem}.")


# A temporary file of write_whole this old is one a process stopped while writing (killed, a power cut) left: no
# write takes that long, a paused one neither. They were never removed, each as large as the file it was to be.
# Only names this code makes are removed: an export's folder is the user's, and ".report.md.original" theirs.
STALE_TEMPORARY_S = 86400
TEMPORARY_SUFFIX = ".gapless-part"
_TEMPORARY_TAIL = re.compile(r"[a-z0-9_]{8}" + re.escape(TEMPORARY_SUFFIX))  # tempfile.mkstemp's random part


def _remove_stale_temporaries(folder: Path, prefix: str) -> None:
    """Remove the temporaries named `prefix` + mkstemp's part + TEMPORARY_SUFFIX in `folder` that no write has
    touched for STALE_TEMPORARY_S; nothing is said where one cannot be (the write itself is done)."""
    try:
        with os.scandir(folder) as entries:
            stale = [
                e.path
                for e in entries
                if e.name.startswith(prefix)
                and _TEMPORARY_TAIL.fullmatch(e.name[len(prefix) :])
                and e.is_file(follow_symlinks=False)
                and time.time() - e.stat(follow_symlinks=False).st_mtime > STALE_TEMPORARY_S
            ]
    except OSError:
        return
    for name in stale:
        try:
            os.unlink(name)
        except OSError:  # removed by another process's write meanwhile, or not ours to remove
            pass


# What flock says on a file system that has no locks.
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


@contextlib.contextmanager
def locked_beside(path: Path, what: str) -> Iterator[None]:
    """Held by one process (or one open of the lock file) at a time, around a read, merge and write of `path`:
    two windows saving at once (a logout closes both) each read the file before the other wrote it, and the second
    write undid the first's changes. The lock is the file `.<name>.lock` beside `path`, kept: removing it would
    race. `what` names the file's contents in the warning where its file system has no locks."""
    lock_file = path.with_name(f".{path.name}.lock")
    with open(lock_file, "a+b") as f:
        if sys.platform == "win32":
            import msvcrt

            f.seek(0)
            msvcrt.locking(f.fileno(), msvcrt.LK_LOCK, 1)  # retries for 10 s, then OSError
            try:
                yield
            finally:
                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)
        else:
            import fcntl

            try:
                _flock_waiting(f, lock_file)
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    raise
                # A file system without locks (some network and FUSE mounts): saved as before there was a lock,
                # one window's save at the same moment as another's may undo it.
                logging.getLogger(__name__).warning(
                    "%s saved without a lock: %s cannot be locked (%s)", what, lock_file, exc.strerror
                )
                yield
                return
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


# How long a save waits for another process's (Windows' msvcrt.locking gives up after 10 s too): a process that
# hung holding the lock, or a network file system's lock that is never granted, froze the window for good.
LOCK_WAIT_S = 10.0


def _flock_waiting(f: BinaryIO, lock_file: Path) -> None:
    """flock `f` exclusively, waiting at most LOCK_WAIT_S; OSError (EAGAIN) with the reason past that."""
    import fcntl

    waited_until = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= waited_until:
                raise OSError(errno.EAGAIN, f"another process has held {lock_file} for {LOCK_WAIT_S:g} s") from None
            time.sleep(0.02)


def file_stamp(st: os.stat_result) -> tuple[int, ...]:
    """What says a file is the one loaded: its size and time, and which file it is (another moved over it with
    the same size and time, as `cp -p` or `rsync -a` write, was taken as the one loaded)."""
    return st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino


def read_into(f: io.RawIOBase, at: int, out: memoryview, name: str) -> None:
    """Fill `out` with the bytes of the weights file open as `f` from offset `at`, read through the descriptor:
    a file cut short is a short read, said as a load error (under a mapping, the missing pages ended the process
    with SIGBUS), and a file moved over the path meanwhile is not read at all (the descriptor keeps the first)."""
    f.seek(at)
    got = 0
    while got < len(out):
        n = f.readinto(out[got:])
        if not n:  # the file ends before what its header (checked at the load) said it holds: cut short since
            raise ModelLoadError(f"{name} changed while it was read (it ends early); open it again")
        got += n


def unchanged_while_read(f: BinaryIO, name: str) -> Callable[[], None]:
    """A check, made before each tensor of a weights file open as `f` is read, that the file is as it was: a file
    overwritten in place (a download into the same name) between two tensors gives a model of both files' tensors
    (read_into reads each tensor through the descriptor: one cut short meanwhile is a short read)."""
    first = os.fstat(f.fileno())

    def check() -> None:
        now = os.fstat(f.fileno())
        if (now.st_size, now.st_mtime_ns) != (first.st_size, first.st_mtime_ns):
            raise ModelLoadError(f"{name} changed while it was read; open it again")

    return check
