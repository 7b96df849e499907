"""Files written whole (engine.paths.write_whole) and output paths checked before the work (output_file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import OutputPathError
from engine.paths import output_file, write_whole


def test_a_name_near_the_longest_a_file_system_takes_is_written_whole(tmp_path):
    """The temporary file beside it was named after it with more added: a name of 250 bytes could not be written."""
    target = tmp_path / ("é" * 123 + ".md")  # 250 bytes
    write_whole(target, "kept")
    assert target.read_text(encoding="utf-8") == "kept"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no temporary file left


def test_a_name_longer_than_a_file_system_takes_is_refused_with_the_reason(tmp_path):
    with pytest.raises(OutputPathError, match="cannot write the chat to .*: File name too long"):
        output_file(tmp_path / ("t" * 300 + ".md"), "the chat")


def test_a_non_ascii_name_is_written_where_the_file_system_encoding_is_ascii(tmp_path):
    """With an ASCII file system encoding (LC_ALL=C, Python's UTF-8 mode off) "ëxport.json" (UTF-8 bytes, held
    by Python as surrogates) gave its temporary file a name decoded as UTF-8 that the encoding could not write:
    `chats export -o ëxport.json` was an internal error."""
    import os
    import subprocess
    import sys

    name = "\u00ebxport.json".encode("utf-8")
    script = (
        "import os, sys; from pathlib import Path; from engine.paths import write_whole; "
        "assert sys.getfilesystemencoding() == 'ascii', sys.getfilesystemencoding(); "
        "write_whole(Path(os.fsdecode(sys.argv[1].encode('ascii', 'surrogateescape'))), 'kept')"
    )
    env = {**os.environ, "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "LC_ALL": "C", "LANG": "C"}
    target = os.path.join(os.fsencode(tmp_path), name)
    r = subprocess.run(
        [sys.executable, "-c", script, os.fsdecode(target)],
        env=env,
        capture_output=True,
        cwd=Path(__file__).resolve().parents[2],  # the project's root: engine is imported from there
    )
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert open(target, "rb").read() == b"kept" and os.listdir(os.fsencode(tmp_path)) == [name]


def test_the_temporary_name_of_a_long_name_is_cut_between_characters(tmp_path, monkeypatch):
    """A 74-byte export name of CJK characters was cut at 64 bytes inside a character: a temporary name Windows'
    file system encoding cannot decode (the export failed) and macOS refuses."""
    import tempfile

    made: list[str] = []
    real = tempfile.mkstemp

    def mkstemp(*a, prefix="", **k):
        made.append(prefix)
        return real(*a, prefix=prefix, **k)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    name = "东京旅行计划第一天去浅草寺然后去上野公园看樱花.json"
    write_whole(tmp_path / name, "kept")
    assert (tmp_path / name).read_text() == "kept"
    prefix = made[0]
    prefix.encode("utf-8")  # whole characters: no surrogate from a cut byte sequence
    assert len(prefix.encode("utf-8")) <= 66 and name.startswith(prefix[1:-1])


def test_temporaries_a_stopped_write_left_are_removed_by_the_next_write(tmp_path):
    """A process killed while it wrote left `.settings.json.abcd1234` beside the file, for good (9 of them after
    30 kills). Only names write_whole makes are removed: a user's own files beside an export stay."""
    import os
    import time

    from engine.paths import STALE_TEMPORARY_S, TEMPORARY_SUFFIX

    target = tmp_path / "settings.json"
    old = time.time() - STALE_TEMPORARY_S - 60
    left = [
        tmp_path / f".settings.json.k1_x9zq0{TEMPORARY_SUFFIX}",
        tmp_path / f".settings.json.ab12cd34{TEMPORARY_SUFFIX}",
    ]
    kept = [
        tmp_path / ".settings.json.lock",  # the lock beside it
        tmp_path / ".settings.json.0123abcd.bak",  # not a temporary's name
        tmp_path / ".settings.json.12345678",  # the user's (an export's folder is theirs)
        tmp_path / ".settings.json.original",
        tmp_path / f".other.json.ab12cd34{TEMPORARY_SUFFIX}",  # another file's
        tmp_path / "settings.json.corrupt-20261207",
    ]
    for p in left + kept:
        p.write_text("x")
        os.utime(p, (old, old))
    writing = tmp_path / f".settings.json.zz99yy88{TEMPORARY_SUFFIX}"  # another process's write, under way
    writing.write_text("half")
    write_whole(target, "{}")
    assert target.read_text() == "{}"
    assert not any(p.exists() for p in left) and all(p.exists() for p in kept) and writing.exists()


def test_a_lock_another_process_holds_too_long_is_an_error_not_a_frozen_window(tmp_path, monkeypatch):
    """A save waited for the lock beside the file for good: a process that hung holding it (or a network file
    system's lock never granted) froze the window that saved. It waits LOCK_WAIT_S, as Windows' locking does."""
    import fcntl
    import sys

    import engine.paths
    from engine.paths import locked_beside

    if sys.platform == "win32":
        pytest.skip("msvcrt.locking gives up after 10 s by itself")
    monkeypatch.setattr(engine.paths, "LOCK_WAIT_S", 0.2)
    target = tmp_path / "drafts.json"
    with open(tmp_path / ".drafts.json.lock", "a+b") as held:  # another open of it: another holder
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(OSError) as caught:
            with locked_beside(target, "the unsent messages"):
                pass
        assert caught.value.strerror == f"another process has held {tmp_path / '.drafts.json.lock'} for 0.2 s"
        fcntl.flock(held, fcntl.LOCK_UN)
    with locked_beside(target, "the unsent messages"):  # let go: taken at once
        pass
