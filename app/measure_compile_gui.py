"""How late the GUI thread's timer fires while a worker thread cold-compiles the decode step, and which of the
late ticks fell in one of the collector's full (generation-2) passes.

    python -m app.measure_compile_gui --model PATH [--json out.json]

An offscreen QApplication runs a 50 ms QTimer on the GUI thread and records how late each tick fires, while a
worker thread switches the loaded engine to compile (static KV cache) and generates 8 greedy tokens: the first
generation compiles and warms up every context bucket. TORCHINDUCTOR_CACHE_DIR is a fresh temporary folder, so
the compile is cold. `gc.callbacks` time every full pass and the thread that ran it. The GUI thread runs the
collections as in the app (app/collector.py), or with `--automatic-collection` automatic collection runs them on
whichever thread allocates, as before the app took them.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import threading
import time
from typing import Any

from engine import figures

TICK_S = 0.05
LATE_S = 0.1


def measure(model: str, gui_collector: bool = True) -> dict[str, Any]:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="gapless-inductor-")
    from PySide6.QtCore import QMetaObject, Qt, QTimer
    from PySide6.QtWidgets import QApplication

    from app.collector import GuiThreadCollector
    from engine.engine import Engine
    from engine.types import EngineOptions, SamplingParams

    app = QApplication.instance() or QApplication([])
    collector = GuiThreadCollector() if gui_collector else None
    engine = Engine.load(model, EngineOptions(device="cpu"))
    passes: list[tuple[float, float, str]] = []  # start, end, thread of each full collection
    started: dict[str, float] = {}

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            passes.append((started["t"], time.perf_counter(), threading.current_thread().name))

    ticks: list[tuple[float, float]] = []  # when, how late
    last = [time.perf_counter()]

    def tick() -> None:
        now = time.perf_counter()
        ticks.append((now, now - last[0] - TICK_S))
        last[0] = now

    result: dict[str, Any] = {}

    def work() -> None:
        try:
            t0 = time.perf_counter()
            engine.reconfigure(EngineOptions(device="cpu", kv_cache="static", compile=True))
            r = engine.generate(
                [{"role": "user", "content": "hello world"}], SamplingParams(temperature=0.0, max_new_tokens=8)
            )
            result.update(seconds=time.perf_counter() - t0, compiled=r.options.compile)
        finally:
            # queued: a quit called before exec() starts would be lost, and the tool would wait for ever
            QMetaObject.invokeMethod(app, "quit", Qt.ConnectionType.QueuedConnection)

    gc.callbacks.append(on_gc)
    timer = QTimer()
    timer.setInterval(int(TICK_S * 1000))
    timer.timeout.connect(tick)
    timer.start()
    worker = threading.Thread(target=work, name="worker")
    worker.start()
    app.exec()
    worker.join()
    timer.stop()
    gc.callbacks.remove(on_gc)
    engine.close()
    if collector is not None:
        collector.close()

    late = sorted(lateness for _, lateness in ticks)
    stalls = [(t, lateness) for t, lateness in ticks if lateness > LATE_S]
    in_pass = sum(any(a < t and b > t - lateness - TICK_S for a, b, _ in passes) for t, lateness in stalls)
    return {
        "compile_and_answer_s": round(result.get("seconds", float("nan")), 2),
        "compiled": result.get("compiled"),
        "collections": "on the GUI thread (app.collector)" if gui_collector else "automatic",
        "ticks": len(ticks),
        "lateness_ms": {
            "p50": round(1000 * late[len(late) // 2], 1),
            "p99": round(1000 * late[int(len(late) * 0.99)], 1),
            "max": round(1000 * late[-1], 1),
        },
        "ticks_over_100ms_late": len(stalls),
        "of_them_during_a_full_collection": in_pass,
        "full_collections_ms": [round(1000 * (b - a)) for a, b, _ in passes],
        "full_collection_threads": sorted({name for *_, name in passes}),
        "loadavg_1min": os.getloadavg()[0],
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.measure_compile_gui", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a model folder or GGUF file (a small one: the compile is cold)")
    ap.add_argument("--json", help="write the report here as well")
    ap.add_argument("--automatic-collection", action="store_true", help="leave the collections to automatic collection")
    args = ap.parse_args(argv)
    report = measure(args.model, gui_collector=not args.automatic_collection)
    text = figures.strict_json(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
