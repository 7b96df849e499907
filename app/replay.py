"""`gapless replay FILE`: a generation's recorded telemetry (engine/recording.py) shown in the HUD, as it looked
on the machine it ran on — a GPU machine without Qt records, this one replays."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from engine.paths import output_file
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
    """A HUD panel holding the recording whole: its live plots, bars, sources and compare row. Its series are
    sized to the recording, not the live rings (a 40-minute answer lost its first 13 minutes of samples)."""
    from ui.hud import HudPanel
    from ui.hud.series import LiveSeries

    steps, samples = recording.steps, recording.samples
    times = [s.t for s in steps] + [s.t for s in samples]
    t0 = recording.t_start if recording.t_start is not None else min(times, default=0.0)
    t1 = recording.t_end if recording.t_end is not None else max(times, default=t0)
    clock = _RecordedClock(t0)
    panel = (panel_factory or HudPanel)(series=LiveSeries.holding(steps, samples), clock=clock)
    name = recording.model.get("name")
    panel.model_name = name if isinstance(name, str) else ""  # the compare row's Model
    panel.begin_generation(recording.label, recording.options)
    panel.add_samples(samples)
    panel.add_steps(steps)
    clock.t = t1
    panel.end_generation(recording.metrics, recording.options, recording.label, recording.unavailable, recording.limits)
    panel.live.show_all_held()  # the recording fills the plots' width, however short it was
    return panel


def run_replay(args: argparse.Namespace) -> int:
    from PySide6.QtCore import QEventLoop, QTimer

    from app.gui import EXIT_USER_ERROR, no_display_reason, qt_application, save_screenshot, screenshot_file
    from ui.theme import ThemeManager

    recording = load(args.file)
    out = None if args.screenshot is None else output_file(args.screenshot, "the screenshot")
    no_display = no_display_reason()
    if no_display and out is None:  # Qt aborts the process, blaming a library that is there
        print(f"gapless: error: {no_display}; a screenshot (--screenshot FILE) needs none", file=sys.stderr)
        return EXIT_USER_ERROR
    if no_display:  # a screenshot is drawn offscreen: a GPU machine over SSH records and shows in one go
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
    app = qt_application()
    if out is not None:
        screenshot_file(args.screenshot)  # a suffix naming no format Qt writes: said before the HUD is drawn
    ThemeManager(app, args.theme or "system")
    panel = show(recording)
    gpu = (recording.machine.get("gpus") or [{}])[0].get("name") if recording.machine else None
    panel.setWindowTitle(f"Gapless — {recording.label}" + (f" on {gpu}" if gpu else ""))
    panel.resize(args.width, args.height)
    panel.show()
    if (panel.width(), panel.height()) != (args.width, args.height):  # the HUD's least size won
        print(
            f"gapless: the HUD is shown at {panel.width()}x{panel.height()}, the least its contents take "
            f"(asked for {args.width}x{args.height})",
            file=sys.stderr,
        )
    if args.screenshot is None:
        return app.exec()
    loop = QEventLoop()
    QTimer.singleShot(SETTLE_MS, loop.quit)
    loop.exec()
    save_screenshot(panel, args.screenshot)
    print(args.screenshot)
    return 0
