"""Keeping the garbage collector's full passes off the long-lived heap.

A full (generation-2) collection walks every object the collector tracks, holding the interpreter lock. With
torch, transformers and a model loaded that is ~300-400k objects and 0.2-0.35 s on a 2-core CPU; a cold
torch.compile builds ~200k more that live as long as the compiled step and sets off two or three such passes.
Whichever thread runs a pass, every other Python thread waits: in the app the GUI thread froze for as long
(docs/benchmarks.md, "The GUI thread during a cold compile": each stall over 100 ms was a full pass).

So what a load or a compile builds to keep is moved to the collector's permanent generation (`gc.freeze`), and
automatic collection pauses while a compile or capture builds (it makes almost no cyclic garbage: ~900 objects
of ~190k measured). Frozen objects are still freed by reference counting; only a cycle among them waits for
`release`, which the engine calls when it closes.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

_lock = threading.Lock()
_building = 0  # nested or concurrent `building` blocks
_collectors: list[Callable[[], None]] = []  # handed the passes, newest last: it runs each full pass asked for here
_paused = False  # automatic collection turned off here (by a `building` block or a collector)
_was_enabled = True  # automatic collection before it was turned off here


def _apply() -> None:
    """Automatic collection off while a block builds or a collector owns the passes, else as it was found.
    Called with `_lock` held."""
    global _paused, _was_enabled
    want_paused = _building > 0 or bool(_collectors)
    if want_paused and not _paused:
        _was_enabled = gc.isenabled()
        gc.disable()
        _paused = True
    elif not want_paused and _paused:
        _paused = False
        if _was_enabled:
            gc.enable()


def hand_collection_to(collector: Callable[[], None]) -> None:
    """From now on automatic collection stays off and `collector` runs each full pass this module is asked for,
    until `hand_collection_back(collector)`. A Qt application runs them on its own thread (app/collector.py): a
    pass run on the engine's thread would free the GUI's Qt objects there, and Qt crashes when they are freed off
    its thread. Several may hold the passes (two windows in one process): the newest runs them, and collection
    comes back only when the last one hands it back."""
    with _lock:
        _collectors.append(collector)
        _apply()
        gc.disable()  # also where it was paused here already: a gc.enable() since, elsewhere, must not stand


def hand_collection_back(collector: Callable[[], None]) -> None:
    """`collector` runs no more passes; the one handed them before it does, or, if none is left, automatic
    collection is back as it was. A collector handed back already is no error (an app closed twice)."""
    with _lock:
        if collector in _collectors:
            _collectors.remove(collector)
        _apply()


def is_handed() -> bool:
    """Whether a collector holds the passes (`hand_collection_to`): automatic collection is off for every thread."""
    with _lock:
        return bool(_collectors)


def collect() -> None:
    """A full pass, on the thread that owns the passes if one does."""
    with _lock:
        collector = _collectors[-1] if _collectors else None
    collector() if collector is not None else gc.collect()


def is_building() -> bool:
    """Whether a `building` block is open on any thread: automatic collection is paused, and a collector that
    runs its passes by a timer (app/collector.py) runs none either."""
    return _building > 0


def settle() -> None:
    """Freeze everything alive now: later full passes skip it."""
    gc.freeze()


def release() -> None:
    """Give the frozen objects back to the collector and collect, so cycles among what was dropped are freed."""
    gc.unfreeze()
    collect()


@contextmanager
def building() -> Iterator[None]:
    """Automatic collection paused while the block builds long-lived objects (a compile, a capture); what it
    built is frozen at the end. Safe to nest and to enter from several threads."""
    global _building
    with _lock:
        _building += 1
        _apply()
    try:
        yield
    finally:
        with _lock:
            _building -= 1
            if _building == 0:
                gc.freeze()
            _apply()


def trim() -> None:
    """Hand the memory the C allocator keeps free back to the system (glibc's malloc_trim; nothing elsewhere). A
    model quantised as it loads frees its fp32 linears, but glibc kept them: the default model settled at 940 MiB
    in int8 against 391 MiB after a trim (36 ms), more than in fp32 (809 MiB)."""
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = _find_malloc_trim()
    if _malloc_trim:
        _malloc_trim(0)


def _find_malloc_trim() -> Any:
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False


_malloc_trim: Any = None  # the function once looked up, or False where there is none
