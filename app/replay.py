"""`gapless replay FILE`: a generation's recorded telemetry (engine/recording.py) shown in the HUD, as it looked
on the machine it ran on — a GPU machine without Qt records, this one replays."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from engine.recording import Recording, load

log = logging.getLogger(__name__)
SETTLE_MS = 1200  # the plots repaint at 20 Hz and their labels at 2 Hz: let both catch up before a screenshot


class _RecordedClock:
    """The HUD dates a generation's start and end with its clock; here they are the recorded times."""

    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def show(recording: Recording, panel_factory=None):
    """A HUD panel holding the recording: its live plots, bars, sources and compare row."""
    from ui.hud import HudPanel

    steps, samples = recording.steps, recording.samples
    times = [s.t for s in steps] + [s.t for s in samples]
    t0 = recording.t_start if recording.t_start is not None else min(times, default=0.0)
    t1 = recording.t_end if recording.t_end is not None else max(times, default=t0)
    clock = _RecordedClock(t0)
    panel = (panel_factory or HudPanel)(clock=clock)
    panel.begin_generation(recording.label, recording.options)
    panel.add_samples(samples)
    panel.add_steps(steps)
    clock.t = t1
    panel.end_generation(recording.metrics, recording.options, recording.label, recording.unavailable, recording.limits)
    return panel


def run_replay(args: argparse.Namespace) -> int:
    from PySide6.QtCore import QEventLoop, QTimer

    from app.gui import qt_application
    from ui.theme import ThemeManager

    recording = load(args.file)
    app = qt_application()
    ThemeManager(app, args.theme or "system")
    panel = show(recording)
    gpu = (recording.machine.get("gpus") or [{}])[0].get("name") if recording.machine else None
    panel.setWindowTitle(f"Gapless — {recording.label}" + (f" on {gpu}" if gpu else ""))
    panel.resize(args.width, args.height)
    panel.show()
    if args.screenshot is None:
        return app.exec()
    loop = QEventLoop()
    QTimer.singleShot(SETTLE_MS, loop.quit)
    loop.exec()
    out = Path(args.screenshot)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not panel.grab().save(str(out)):
        log.error("could not write %s", out)
        return 1
    print(out)
    return 0
