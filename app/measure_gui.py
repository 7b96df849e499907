"""Does the GUI stay fluid while the engine streams at full speed, and does it cost decode speed?

    python -m app.measure_gui [--model default] [--runs 3] [--max-new-tokens 128] [--json out.json]

Two figures, both measured here, never estimated:
- GUI event-loop latency while an answer streams into the real main window (HUD visible): a 10 ms precise
  QTimer records how late each tick fires; p50 / p99 / max of the lateness over all streaming time.
- Decode tok/s (the engine's own device-synchronised figure) with the GUI attached, vs the same engine
  driven headless (Engine.generate on this thread, no Qt event loop running). Runs alternate
  headless / GUI so a change in machine load hits both alike; the ratio is of the medians, and the median of
  the per-pair ratios is given beside it. The GUI thread's CPU time during each GUI run is recorded too.
  The latency probe ticks 100 times a second on the GUI thread, itself a cost, so it runs only in separate
  GUI runs after the speed pairs, never during them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from engine import figures

PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a map. Use many paragraphs."
TICK_MS = 10


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class LatencyProbe:
    """A precise timer that records how late each tick fires, while `recording` is on."""

    def __init__(self, tick_ms: int = TICK_MS):
        from PySide6.QtCore import Qt, QTimer

        self.tick_s = tick_ms / 1000
        self.late_ms: list[float] = []
        self.recording = False
        self._last: Optional[float] = None
        self.timer = QTimer(interval=tick_ms, timerType=Qt.TimerType.PreciseTimer)
        self.timer.timeout.connect(self._tick)

    def start(self) -> None:
        self._last = None
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()

    def _tick(self) -> None:
        now = time.perf_counter()
        if self.recording and self._last is not None:
            self.late_ms.append(max(0.0, (now - self._last - self.tick_s) * 1000))
        self._last = now


def headless_tok_s(engine, sampling) -> tuple[Optional[float], int]:
    r = engine.generate([{"role": "user", "content": PROMPT}], sampling)
    return r.metrics.decode_tok_s, r.metrics.new_tokens_total


def gui_tok_s(gui, probe: LatencyProbe, sampling) -> tuple[Optional[float], int, float]:
    """One answer through the real window: (decode tok/s, new tokens, GUI thread CPU seconds meanwhile)."""
    from PySide6.QtCore import QEventLoop, QTimer

    w, c = gui.window, gui.controller
    w.new_chat()
    w.flow.default_sampling = sampling
    loop = QEventLoop()
    out: list = []

    def ended(_rid: int, result: object) -> None:  # a GenerationResult, or the message of a failure
        out.append(result)
        loop.quit()

    slots = [
        (c.generationStarted, lambda *_: setattr(probe, "recording", True)),
        (c.generationFinished, ended),
        (c.generationFailed, ended),
    ]
    for sig, slot in slots:
        sig.connect(slot)
    QTimer.singleShot(0, lambda: (w.composer.set_text(PROMPT), w.composer.send_button.click()))
    cpu0 = time.thread_time()
    loop.exec()
    cpu = time.thread_time() - cpu0
    probe.recording = False
    for sig, slot in slots:
        sig.disconnect(slot)
    r = out[0]
    if isinstance(r, str):
        raise RuntimeError(f"the answer failed: {r}")
    return r.metrics.decode_tok_s, r.metrics.new_tokens_total, cpu


def measure(model: str, runs: int, max_new_tokens: int, hide_hud: bool = False, lateness_runs: int = 3) -> dict:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QEventLoop, QTimer

    from app.gui import build, qt_application
    from app.paths import AppPaths
    from engine.engine import Engine
    from engine.types import EngineOptions, SamplingParams

    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, seed=0)  # the same tokens every run
    options = EngineOptions()
    app = qt_application()
    data = tempfile.mkdtemp(prefix="gapless-measure-")
    gui = build(AppPaths.resolve(Path(data)), "light")
    gui.window.show()
    app.processEvents()
    if hide_hud and gui.window.hud_dock is not None:
        gui.window.hud_dock.hide()  # to tell the HUD's share of the cost from the conversation's
    loop = QEventLoop()
    gui.controller.loaded.connect(lambda *_: loop.quit())

    def load_failed(source: str, message: str) -> None:
        print(f"cannot load {source}: {message}", file=sys.stderr)
        loop.quit()

    gui.controller.loadFailed.connect(load_failed)
    gui.window.load_model(model)
    loop.exec()
    if gui.controller.info is None:
        gui.close()
        raise SystemExit(1)
    headless = Engine.load(model, options)
    probe = LatencyProbe()

    idle = LatencyProbe()  # the same probe with the window idle, for reference
    idle.start()
    idle.recording = True
    idle_loop = QEventLoop()
    QTimer.singleShot(2000, idle_loop.quit)
    idle_loop.exec()
    idle.recording = False
    idle.stop()

    headless_tok_s(headless, sampling)  # warm-up, not counted
    gui_tok_s(gui, probe, sampling)
    rows: list[dict[str, Any]] = []  # one per run, as the JSON report has them
    for i in range(runs):  # speed pairs, the probe not ticking
        h, hn = headless_tok_s(headless, sampling)
        g, gn, cpu = gui_tok_s(gui, probe, sampling)
        rows.append({"run": i + 1, "headless_tok_s": h, "gui_tok_s": g, "tokens": [hn, gn], "gui_thread_cpu_s": cpu})
        print(
            f"run {i + 1}: headless {h:.2f} tok/s, GUI {g:.2f} tok/s ({hn}/{gn} tokens), GUI thread CPU {cpu:.3f} s",
            file=sys.stderr,
        )
    probe.start()
    for _ in range(lateness_runs):  # then the lateness, with the probe ticking
        gui_tok_s(gui, probe, sampling)
    probe.stop()
    headless.close()
    gui.window.close()
    gui.close()
    shutil.rmtree(data, ignore_errors=True)

    hs = [r["headless_tok_s"] for r in rows if r["headless_tok_s"]]
    gs = [r["gui_tok_s"] for r in rows if r["gui_tok_s"]]
    h_med = statistics.median(hs) if hs else None
    g_med = statistics.median(gs) if gs else None
    pairs = [r["gui_tok_s"] / r["headless_tok_s"] for r in rows if r["gui_tok_s"] and r["headless_tok_s"]]
    return {
        "model": gui.controller.info.to_dict() if gui.controller.info else model,
        "options": options.to_dict(),
        "max_new_tokens": max_new_tokens,
        "hud_visible": not hide_hud,
        "runs": rows,
        "decode_tok_s": {
            "headless_median": h_med,
            "gui_median": g_med,
            "ratio": (g_med / h_med) if (g_med and h_med) else None,
            "pair_ratio_median": statistics.median(pairs) if pairs else None,
            "source": "GenerationMetrics.decode_tok_s (engine, device-synchronised, profiled window excluded)",
        },
        "gui_thread_cpu_s_median": statistics.median(r["gui_thread_cpu_s"] for r in rows) if rows else None,
        "event_loop_lateness_ms": {
            "runs": lateness_runs,
            "while_streaming": {
                "ticks": len(probe.late_ms),
                "p50": percentile(probe.late_ms, 0.5),
                "p99": percentile(probe.late_ms, 0.99),
                "max": max(probe.late_ms, default=None),
            },
            "idle": {
                "ticks": len(idle.late_ms),
                "p50": percentile(idle.late_ms, 0.5),
                "p99": percentile(idle.late_ms, 0.99),
                "max": max(idle.late_ms, default=None),
            },
            "source": f"{TICK_MS} ms Qt PreciseTimer on the GUI thread, lateness of each tick (time.perf_counter)",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0],
            "platform": sys.platform,
            "qt_platform": os.environ.get("QT_QPA_PLATFORM"),
        },
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.measure_gui", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--lateness-runs", type=int, default=3, help="GUI runs with the latency probe, after the speed pairs"
    )
    p.add_argument("--hide-hud", action="store_true", help="measure with the performance HUD hidden")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = measure(args.model, args.runs, args.max_new_tokens, args.hide_hud, args.lateness_runs)
    text = figures.strict_json(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
