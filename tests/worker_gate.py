"""Holding the engine's worker thread right after it sends a generation's first text batch, until the test lets
it go. What a test does in the GUI thread at that batch (cancel, load another model, change options) then lands
while the generation surely still runs, however late a loaded machine schedules the GUI thread."""

from __future__ import annotations

import threading

import engine.observers
from app.worker import EngineWorker


def hold_after_first_batch(monkeypatch, timeout_s: float = 60.0) -> threading.Event:
    """Patch the worker so that its first flush carrying text waits for the returned event (at most timeout_s,
    so a test that forgets to set it fails on its own assertions rather than hanging). The engine passes on its
    text from the first token on (not 1/30 s later), so the batch comes while a fast machine still decodes."""
    monkeypatch.setattr(engine.observers, "FLUSH_INTERVAL_S", 0.0)
    release = threading.Event()
    flush = EngineWorker._flush
    held: list[bool] = []

    def flush_then_hold(self):
        carries_text = bool(self._batcher._text)
        flush(self)
        if carries_text and not held:
            held.append(True)
            release.wait(timeout_s)

    monkeypatch.setattr(EngineWorker, "_flush", flush_then_hold)
    return release


def on_first_batch(ctl, action, monkeypatch) -> list[bool]:
    """Run action() in the GUI thread when the controller's next text batch arrives, as a user pressing a button
    would; the worker waits at that batch until action() has run, so the generation is still running when it
    does. The returned list holds True once action() has been called."""
    fired: list[bool] = []
    release = hold_after_first_batch(monkeypatch)

    def slot(_rid, _batch):
        if not fired:
            fired.append(True)
            try:
                action()
            finally:
                release.set()

    ctl.textBatch.connect(slot)
    return fired
