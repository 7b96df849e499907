"""A disk that fills half way through a write: what a file written whole (engine.paths.write_whole) meets."""

from __future__ import annotations

import errno
import os

import pytest


class FillingFile:
    """Takes half of what it is given, then the disk is full."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        self.f.close()

    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")


def fill_the_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file write_whole writes from now on (until `monkeypatch` is undone) fills the disk half way."""
    real_fdopen = os.fdopen
    monkeypatch.setattr("engine.paths.os.fdopen", lambda fd, *a, **k: FillingFile(real_fdopen(fd, *a, **k)))
