"""The garbage collector's passes, on the GUI thread only.

A collection frees every unreachable cycle, whoever built it, on the thread that runs it. The GUI builds cycles
that hold Qt objects (a closed dialog, a plot's items and their pixmaps and paths); the engine worker, the
server's threads and the model's load build many objects and set off most automatic passes. A pass on one of
those threads frees the GUI's Qt objects there while the GUI thread paints, and Qt is not thread-safe for them:
the app crashed in the GUI thread's event loop while the engine worker ran the full pass that follows a model's
close (`engine.heap.release`). pyqtgraph's examples meet the same hazard the same way: automatic collection off,
and passes run by a timer on the GUI thread with the collector's own thresholds.

The engine asks for full passes through `engine.heap` (a closed model's cycles, a failed switch's leftovers):
asked from another thread, the pass runs on the GUI thread and the asking thread waits for it, so the memory is
free before the next model loads. While the app closes the GUI thread waits for those threads, so from then on
a pass they ask for is left to the last one, run here by `close`.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from PySide6.QtCore import QObject, Qt, QTimer, Signal, Slot

from engine import heap

log = logging.getLogger(__name__)

CHECK_INTERVAL_MS = 500  # how often the counts are compared with the thresholds
ASKED_WAIT_S = 60.0  # a thread waiting longer for the GUI's pass goes on without it (logged)

_waits_lock = threading.Lock()
_gui_waits = 0  # how many waits of the GUI thread for other threads are under way (`gui_thread_waits`)


@contextmanager
def gui_thread_waits() -> Iterator[None]:
    """Around a wait of the GUI thread for another thread (an engine worker's stop, the server's): meanwhile a
    pass that thread asks for is not waited for, whichever collector it goes to. With two windows in one
    process the first one's worker, closing its model, asked the second one's collector (the newest runs the
    passes), which queued the pass for the GUI thread and waited while that thread waited for the worker: the
    close hung until its timeout and left the worker running."""
    global _gui_waits
    with _waits_lock:
        _gui_waits += 1
    try:
        yield
    finally:
        with _waits_lock:
            _gui_waits -= 1


class GuiThreadCollector(QObject):
    """Created on the GUI thread; from then on every collection runs there until `close`."""

    _asked = Signal(object)  # a threading.Event, set when the pass asked for has run (or will not)

    def __init__(self, interval_ms: int = CHECK_INTERVAL_MS) -> None:
        super().__init__()
        self._gui_thread = threading.get_ident()
        self._thresholds = gc.get_threshold()
        self._closing = threading.Event()
        # what the last full pass left in the oldest generation, and the frozen count then
        self._long_lived, self._frozen = len(gc.get_objects(2)), gc.get_freeze_count()
        self._asked.connect(self._run_asked, Qt.ConnectionType.QueuedConnection)
        self._timer = QTimer(self)
        self._timer.timeout.connect(self.check)
        self._timer.start(interval_ms)
        heap.hand_collection_to(self.collect)

    @Slot()
    def check(self) -> None:
        """The pass automatic collection would have run by now: the oldest generation over its threshold (a pass
        takes the younger ones with it), the full one only under CPython's own rule; none while a compile or
        capture builds (`heap.building`: what it keeps is frozen at its end, before any pass walks it)."""
        if heap.is_building() or self._thresholds[0] == 0:  # a threshold of 0: automatic collection was off
            return
        counts = gc.get_count()
        for generation in (2, 1, 0):
            if counts[generation] <= self._thresholds[generation]:
                continue
            if generation == 2 and not self._full_pass_due():
                continue
            self._pass(generation)
            return

    def _full_pass_due(self) -> bool:
        """CPython's rule: a full pass only once what reached the oldest generation since the last one is more
        than a quarter of what that one left there, so a large long-lived heap is not walked again and again (each
        walk of a few million objects holds this thread for seconds). A freeze since (`heap.settle` after a load)
        emptied the oldest generation: all it holds now came after."""
        size = len(gc.get_objects(2))
        arrived = size if gc.get_freeze_count() != self._frozen else size - self._long_lived
        return arrived > self._long_lived // 4

    def _pass(self, generation: int = 2) -> None:
        gc.collect(generation)
        if generation == 2:
            self._long_lived, self._frozen = len(gc.get_objects(2)), gc.get_freeze_count()

    def collect(self) -> None:
        """A full pass on the GUI thread; from another thread, asked for and waited for."""
        if threading.get_ident() == self._gui_thread:
            self._pass()
            return
        if self._gui_busy_waiting():
            return  # the GUI thread may be waiting for this one: the last pass, in close, frees what is left
        done = threading.Event()
        self._asked.emit(done)
        waited = 0.0
        while not done.wait(0.1):
            waited += 0.1
            if self._gui_busy_waiting():
                return
            if waited >= ASKED_WAIT_S:
                log.warning("the GUI thread did not run a collection within %.0f s; going on without it", waited)
                return

    def _gui_busy_waiting(self) -> bool:
        return self._closing.is_set() or _gui_waits > 0

    @Slot(object)
    def _run_asked(self, done: threading.Event) -> None:
        try:
            if not self._closing.is_set():
                self._pass()
        finally:
            done.set()

    def begin_close(self) -> None:
        """The GUI thread is about to wait for the other threads: a pass they ask for is not waited for."""
        self._closing.set()

    def close(self, others_stopped: bool = True) -> None:
        """A last pass here, and, once the other threads have stopped, automatic collection back as it was. With
        a thread still running (`others_stopped` False: a load that cannot be interrupted, as the app leaves) the
        passes stay here: what that thread asks for is not run, and it sets off none of its own; a later `close()`
        hands them back."""
        self.begin_close()
        self._timer.stop()
        if others_stopped:
            heap.hand_collection_back(self.collect)
        self._pass()
