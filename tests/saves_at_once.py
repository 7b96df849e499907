"""Two saves of one file at the same moment, as two windows on one data folder make them when a logout closes
both: the first reads the file, the second saves, then the first writes what it merged before."""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Callable

OVERLAP_S = 1.0  # how long the first save's write waits for the second save to end


def saves_at_once(monkeypatch, module: ModuleType, first: Callable[[], object], second: Callable[[], object]) -> None:
    """Runs `first()` in a thread whose write (`module.write_whole`) waits until `second()` has run here, or
    OVERLAP_S has passed. Without a lock around the read, merge and write, `second` runs inside that wait and
    the first write undoes it; with one, `second` waits for `first` to end, the wait runs out and `second` reads
    what `first` wrote."""
    real = module.write_whole
    first_writes, second_done = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def write(path, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread() and not first_writes.is_set():
            first_writes.set()
            second_done.wait(OVERLAP_S)
        return real(path, *args, **kwargs)

    def run_first() -> None:
        try:
            first()
        except BaseException as exc:  # said in the test's thread
            failed.append(exc)
            first_writes.set()

    monkeypatch.setattr(module, "write_whole", write)
    thread = threading.Thread(target=run_first)
    thread.start()
    assert first_writes.wait(30), "the first save never wrote"
    try:
        second()
    finally:
        second_done.set()
        thread.join()
    if failed:
        raise failed[0]
