"""The log file (app/logs.py): every line kept whatever its file names hold, and a disk that cannot take it said
once, in one line."""

from __future__ import annotations

import logging
import os

import pytest

from app.logs import setup_logging


@pytest.fixture
def root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    root.setLevel(level)


def test_a_file_name_that_is_not_utf8_is_logged_escaped_with_the_lines_around_it(tmp_path, root_logger, capsys):
    log_file = tmp_path / "logs" / "gapless.log"
    setup_logging(log_file)
    name = os.fsdecode(b"caf\xe9.gguf")  # a Latin-1 name on a Linux disk: a lone surrogate in Python
    log = logging.getLogger("gapless.test")
    log.info("before")
    log.warning("cannot open %s", name)
    log.info("after")
    for h in root_logger.handlers:
        h.flush()
    lines = log_file.read_text(encoding="utf-8").splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == ["before", "cannot open caf\\udce9.gguf", "after"]
    assert capsys.readouterr().err == ""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device every write to fails)")
def test_a_log_file_the_disk_cannot_take_is_said_once_and_logging_goes_on_quietly(tmp_path, root_logger, capsys):
    log_file = tmp_path / "logs" / "gapless.log"
    log_file.parent.mkdir()
    log_file.symlink_to("/dev/full")  # every write: ENOSPC, as on a full disk
    setup_logging(log_file)
    log = logging.getLogger("gapless.test")
    for i in range(5):
        log.warning("line %d", i)
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"gapless: the log file {log_file} cannot be written ([Errno 28] No space left on device); "
        "nothing more is logged to it"
    ]
    assert "Logging error" not in err and "Traceback" not in err
    assert not any(getattr(h, "baseFilename", None) == str(log_file) for h in root_logger.handlers)
