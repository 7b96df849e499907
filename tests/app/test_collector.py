"""Every collection runs on the GUI thread (app/collector.py): a pass run on the engine worker freed the GUI's
Qt objects there, and the app crashed in the GUI thread's event loop while the worker ran the full pass that
follows a model's close."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from app.collector import GuiThreadCollector, gui_thread_waits
from engine import heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only a collection frees it


@pytest.fixture
def passes():
    """(thread id, generation) of each collection that starts while the test runs."""
    seen: list[tuple[int, int]] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append((threading.get_ident(), info["generation"]))

    gc.callbacks.append(on_gc)
    yield seen
    gc.callbacks.remove(on_gc)


@pytest.fixture
def collector(qtbot):
    enabled = gc.isenabled()
    gc.enable()
    c = GuiThreadCollector(interval_ms=20)
    yield c
    c.close()
    gc.unfreeze()  # what a test froze goes back to the collector
    gc.enable() if enabled else gc.disable()


def test_automatic_collection_is_off_until_the_collector_closes(collector):
    assert not gc.isenabled()
    with heap.building():  # a compile's pause ends with collection still off: the collector owns the passes
        pass
    assert not gc.isenabled()
    collector.close()
    assert gc.isenabled()


def test_a_collector_turns_automatic_collection_off_even_where_it_was_turned_on_since(collector):
    """With one collector holding the passes, a gc.enable() elsewhere (a library, a test's own set-up) left
    automatic collection on when the next collector came: its passes ran on whichever thread allocated."""
    gc.enable()
    second = GuiThreadCollector(interval_ms=20)
    try:
        assert not gc.isenabled()
    finally:
        second.close()


def test_a_full_pass_asked_for_on_another_thread_runs_on_the_gui_thread(qtbot, collector, passes):
    node = _Node()
    ref = weakref.ref(node)
    heap.settle()
    del node
    asker = threading.Thread(target=heap.release)  # what the engine worker runs as it closes a model
    asker.start()
    qtbot.waitUntil(lambda: not asker.is_alive(), timeout=10_000)
    assert ref() is None  # freed before release returned: the next model loads with the memory back
    full = [thread for thread, generation in passes if generation == 2]
    assert full and set(full) == {threading.get_ident()}


def test_the_timer_runs_the_passes_automatic_collection_would_have(qtbot, collector, passes):
    refs = []
    for _ in range(2 * gc.get_threshold()[0]):
        node = _Node()
        refs.append(weakref.ref(node))
        del node
    qtbot.waitUntil(lambda: all(r() is None for r in refs), timeout=10_000)
    assert passes and {thread for thread, _ in passes} == {threading.get_ident()}


def test_while_the_app_closes_a_thread_asking_for_a_pass_does_not_wait_for_the_gui(collector, passes):
    collector.begin_close()  # the GUI thread now waits for the others; it runs no event loop here
    asker = threading.Thread(target=heap.collect)
    asker.start()
    asker.join(5)
    assert not asker.is_alive() and passes == []
    node = _Node()
    ref = weakref.ref(node)
    del node
    collector.close()  # the last pass, on this thread, frees what was left
    assert ref() is None


def test_closing_one_of_two_apps_leaves_the_passes_with_the_other(qtbot, collector, passes):
    """Two windows in one process (tests/robustness' two instances on one data folder): the first one closed
    handed collection back while the second one's engine worker still ran, and that worker's close of its model
    ran the full pass on its own thread, freeing the GUI's Qt objects there."""
    second = GuiThreadCollector(interval_ms=20)
    second.close()
    assert not gc.isenabled()  # the first still owns the passes
    asker = threading.Thread(target=heap.release)
    asker.start()
    qtbot.waitUntil(lambda: not asker.is_alive(), timeout=10_000)
    full = [thread for thread, generation in passes if generation == 2]
    assert full and set(full) == {threading.get_ident()}
    collector.close()
    assert gc.isenabled()


def test_the_first_of_two_apps_closed_leaves_the_passes_with_the_second(qtbot, collector, passes):
    second = GuiThreadCollector(interval_ms=20)
    try:
        collector.close()
        assert not gc.isenabled()
        asker = threading.Thread(target=heap.release)
        asker.start()
        qtbot.waitUntil(lambda: not asker.is_alive(), timeout=10_000)
        full = [thread for thread, generation in passes if generation == 2]
        assert full and set(full) == {threading.get_ident()}
    finally:
        second.close()
    assert gc.isenabled()


def test_while_the_first_of_two_apps_waits_for_its_worker_a_pass_asked_of_the_second_is_not_waited_for(
    qtbot, collector, passes
):
    """Two windows in one process: the first one's worker, closing its model, asked for a pass; the newest
    collector (the second window's) queued it for the GUI thread, which was waiting for that worker, and the
    worker waited for it: the first close hung until its timeout and left the worker running."""
    second = GuiThreadCollector(interval_ms=20)
    try:
        collector.begin_close()
        with gui_thread_waits():  # the first app's close, waiting for its worker
            asker = threading.Thread(target=heap.collect)
            asker.start()
            asker.join(5)
            assert not asker.is_alive() and passes == []
        collector.close()
        asker = threading.Thread(target=heap.collect)  # the second app's worker, later: its pass runs here again
        asker.start()
        qtbot.waitUntil(lambda: not asker.is_alive(), timeout=10_000)
        assert [thread for thread, generation in passes if generation == 2][-2:] == [threading.get_ident()] * 2
    finally:
        second.close()


def test_the_timer_runs_no_pass_while_a_compile_builds(collector, passes):
    """A compile builds ~200k objects to keep, in `heap.building()`, with automatic collection paused so no full
    pass walks them before they are frozen (each one froze the GUI for 0.2-0.35 s). The timer ran its passes all
    the same: the young ones at each tick and a full one every 121 ticks of the compile's minutes."""
    with heap.building():
        kept = [[] for _ in range(3 * gc.get_threshold()[0])]  # what a compile keeps: past every threshold
        counts = gc.get_count()
        collector.check()
        assert passes == [] and gc.get_count()[0] >= counts[0]
    assert kept
    gc.collect()  # counts past every threshold, with no compile building: the timer runs the passes
    garbage = [[] for _ in range(3 * gc.get_threshold()[0])]
    collector.check()
    assert [generation for _, generation in passes][-1:] == [0] and garbage


def test_an_app_closed_with_its_worker_still_busy_keeps_the_passes_on_the_gui_thread(qtbot, tmp_path, passes):
    """Quitting during a load that cannot be interrupted: `GuiApp.close` gives up on the worker after its timeout
    and the app leaves (app.gui.leave) with the window, and the error dialogs said after close, still up. The
    close handed collection back all the same, and the worker, still loading, ran its passes on its own thread,
    freeing the GUI's Qt objects there."""
    from app.gui import build
    from app.paths import AppPaths
    from engine.errors import ModelLoadError

    enabled = gc.isenabled()
    gc.enable()
    gui = build(AppPaths.resolve(tmp_path / "data"), "light")
    inside, release = threading.Event(), threading.Event()

    def stuck_load(source, options, progress):  # a load that cannot be interrupted, then a model's close
        inside.set()
        release.wait(30)
        heap.release()
        raise ModelLoadError("the load was given up")

    gui.controller.worker._engine_factory = stuck_load
    try:
        gui.controller.load(str(tmp_path / "model"))
        assert inside.wait(30)
        assert gui.close(timeout=0.2) is False  # the worker is still in the load
        assert not gc.isenabled()
        release.set()
        assert gui.controller._thread.wait(30_000)
        assert {thread for thread, _ in passes} <= {threading.get_ident()}
    finally:
        release.set()
        gui.controller._thread.wait(30_000)
        gui.window.close()
        gui.collector.close()
        gc.enable() if enabled else gc.disable()
    assert gc.isenabled() is enabled


def test_the_timer_walks_the_long_lived_heap_only_under_cpython_s_rule(collector, passes):
    """A full pass every eleventh middle pass, as the counts alone would run it, walked a large long-lived heap
    again and again on the GUI thread; automatic collection waits until a quarter as much is new there."""
    kept = [[] for _ in range(50_000)]  # long-lived: the oldest generation after the next full pass
    collector._pass()
    for _ in range(gc.get_threshold()[2] + 1):
        gc.collect(1)  # the oldest generation's count over its threshold, nothing new in it
    passes.clear()
    collector.check()
    assert all(generation != 2 for _, generation in passes)
    new = [[] for _ in range(len(gc.get_objects(2)) // 4 + 1000)]
    gc.collect(1)  # they reach the oldest generation: more than a quarter of what is there
    passes.clear()
    collector.check()
    assert [generation for _, generation in passes] == [2]
    assert kept and new


def test_after_a_freeze_the_full_pass_counts_what_reached_the_oldest_generation_since(collector, passes):
    """A load freezes what it built (heap.settle), which empties the oldest generation; measured by its size
    alone, a full pass came only once it outgrew what the last pass left there, five times later than CPython's."""
    kept = [[] for _ in range(100_000)]
    collector._pass()
    long_lived = len(gc.get_objects(2))
    heap.settle()  # the oldest generation is empty now
    new = [[] for _ in range(long_lived // 4 + 1000)]  # a quarter of the long-lived heap arrives, and a little more
    for _ in range(gc.get_threshold()[2] + 1):
        gc.collect(1)
    passes.clear()
    collector.check()
    assert [generation for _, generation in passes] == [2]
    assert kept and new
