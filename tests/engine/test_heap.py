"""What a load or a compile builds is kept out of the collector's full passes (engine/heap.py): automatic
collection pauses while a warm-up compiles, what it built is frozen, a warm-up that has nothing left to compile
does not run the step again, and closing the engine hands the frozen objects back so dropped cycles are freed."""

from __future__ import annotations

import gc
import platform
import sys
import weakref

import pytest
import torch

from engine import heap
from engine.engine import Engine
from engine.types import EngineOptions, SamplingParams


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture(autouse=True)
def _collector_as_found():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable() if enabled else gc.disable()


def test_building_pauses_collection_and_freezes_what_it_built():
    gc.enable()
    gc.unfreeze()
    with heap.building():
        assert not gc.isenabled()
        with heap.building():  # nested: the outer block still holds the pause
            pass
        assert not gc.isenabled()
        kept = [_Node() for _ in range(100)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(kept)


def test_building_leaves_a_disabled_collector_disabled():
    gc.disable()
    with heap.building():
        pass
    assert not gc.isenabled()


def test_release_frees_a_cycle_that_was_frozen():
    node = _Node()
    ref = weakref.ref(node)
    heap.settle()
    del node
    gc.collect()
    assert ref() is not None  # frozen: full passes skip it
    heap.release()
    assert ref() is None and gc.get_freeze_count() == 0


def test_the_engine_freezes_after_a_load_and_around_a_compile_and_releases_on_close(tiny_llama):
    gc.unfreeze()
    eng = Engine.load(str(tiny_llama), EngineOptions(device="cpu", kv_cache="static"))
    try:
        assert gc.get_freeze_count() > 0
        eng.generate([{"role": "user", "content": "hello"}], SamplingParams(temperature=0.0, max_new_tokens=4))
        runner = next(iter(eng._runners.values()))
        seen: list[bool] = []

        def step(bucket, kind):  # stands in for the compiled step: the same writes, and it records the collector
            seen.append(gc.isenabled())
            runner.masked_step(bucket, kind)

        buckets = runner.buckets_for(10, 4)
        with torch.inference_mode():
            runner.set_compiled(step)
            frozen = gc.get_freeze_count()
            runner.warm_up(buckets, runner.kind, False, lambda m, f: None)
            assert seen == [False] * len(buckets) and gc.isenabled()
            assert gc.get_freeze_count() > frozen
            runner.warm_up(buckets, runner.kind, False, lambda m, f: None)
            assert len(seen) == len(buckets)  # every shape already ran through this step: nothing to compile
            runner.set_compiled(None)
            runner.warm_up(buckets, runner.kind, False, lambda m, f: None)  # eager: nothing to compile either
            assert len(seen) == len(buckets)
    finally:
        eng.close()
    assert gc.get_freeze_count() == 0


@pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's: a no-op elsewhere"
)
def test_a_load_and_a_switch_hand_the_freed_memory_back(tiny_llama, monkeypatch):
    """glibc kept what a quantising load freed (the default model settled at 940 MiB in int8, 391 MiB after
    malloc_trim): a load, a switch of weights and a close each trim."""
    assert heap._find_malloc_trim()  # found in the C library this process runs on
    trims: list[int] = []
    monkeypatch.setattr(heap, "_malloc_trim", lambda pad: trims.append(pad))
    e = Engine.load(str(tiny_llama), EngineOptions(device="cpu", weights="int8", profile_window=False))
    assert trims == [0]
    e.reconfigure(e.options.with_(weights="native"))
    assert trims == [0, 0]
    e.close()
    assert trims == [0, 0, 0]


def test_a_failed_switch_leaves_the_previous_model_frozen_again(tiny_llama, monkeypatch):
    """A switch gives the heap back to the collector to free the model it replaces; one that failed placed the
    previous weights again and left the whole heap unfrozen, each full pass on the GUI thread walking it."""
    import engine.quant as quant

    e = Engine.load(str(tiny_llama), EngineOptions(device="cpu", profile_window=False))
    try:
        assert gc.get_freeze_count() > 0

        def cannot_hold(*_a, **_k):
            raise ValueError("cannot hold")

        monkeypatch.setattr(quant, "quantize_linears", cannot_hold)
        with pytest.raises(Exception, match="cannot hold"):
            e.reconfigure(e.options.with_(weights="int8"))
        assert e.model is not None and e.weights == "native"
        assert gc.get_freeze_count() > 0
    finally:
        e.close()
