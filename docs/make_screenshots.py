"""Screenshots from real runs for the README: the main window with an answer (dark and light theme, and at
800×600), the HUD during a generation, after it with its diagnosis line, and the ladder chart.

    python docs/make_screenshots.py [--model default] [--out docs/screenshots]   (offscreen, a 1920x1200 screen)

Every figure in them is measured on the machine that runs this script (nothing is synthetic).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="default")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "screenshots")
    p.add_argument(
        "--prompt", default="Explain how a GPU runs a small language model, step by step, in about 150 words."
    )
    p.add_argument("--ladder-tokens", type=int, default=32)
    p.add_argument(
        "--main-prompt",
        default="Write a Python function that returns the n-th Fibonacci number. "
        "Put the code in a code block, then explain it briefly.",
    )
    p.add_argument(
        "--parts", default="hud,ladder,main", help="which shots to make: hud, ladder, main (comma-separated)"
    )
    p.add_argument("--main-tokens", type=int, default=200)
    p.add_argument("--hud-tokens", type=int, default=160)
    args = p.parse_args()
    parts = set(args.parts.split(","))
    if "QT_QPA_PLATFORM" not in os.environ:  # a 1920x1200 screen: offscreen's own is 800x800, shorter than the shots
        screen = {"name": "shots", "x": 0, "y": 0, "width": 1920, "height": 1200, "logicalDpi": 96, "dpr": 1}
        config = Path(tempfile.mkdtemp(prefix="gapless-screen-")) / "screen.json"
        config.write_text(json.dumps({"screens": [screen]}), encoding="utf-8")
        os.environ["QT_QPA_PLATFORM"] = f"offscreen:configfile={config}"
    from PySide6.QtCore import QEventLoop, QTimer

    from app.gui import build, qt_application
    from app.paths import AppPaths

    qt_application()  # before any widget
    gui = build(AppPaths.resolve(Path(tempfile.mkdtemp(prefix="gapless-shots-"))), "dark")
    w, c, hud = gui.window, gui.controller, gui.hud
    w.resize(1440, 900)
    w.show()

    def wait(signal, timeout_s: float = 900) -> tuple:
        loop, got = QEventLoop(), []
        signal.connect(lambda *a: (got.append(a), loop.quit()))
        QTimer.singleShot(int(timeout_s * 1000), loop.quit)
        loop.exec()
        if not got:
            raise SystemExit(f"timed out waiting for {signal}")
        return got[0]

    def settle(ms: int = 600) -> None:
        loop = QEventLoop()
        QTimer.singleShot(ms, loop.quit)
        loop.exec()

    args.out.mkdir(parents=True, exist_ok=True)
    batches: list = []
    finished: list = []
    c.textBatch.connect(lambda *a: batches.append(1))
    c.generationFinished.connect(lambda *a: finished.append(1))

    def hud_shots() -> None:
        w.flow.default_sampling = replace(w.flow.default_sampling, max_new_tokens=args.hud_tokens, seed=0)
        w.composer.set_text(args.prompt)
        w.composer.send_button.click()
        while len(batches) < 12 and not finished:
            settle(100)
        w.grab().save(str(args.out / "hud-during.png"))
        while not finished:
            settle(200)
        settle()
        w.grab().save(str(args.out / "hud-after.png"))
        hud.bars.grab().save(str(args.out / "hud-diagnosis.png"))  # the figures and what limited the answer
        print("diagnosis:", hud.bars.diagnosis.text())

    def ladder_shot() -> None:
        hud.tabs.setCurrentWidget(hud.ladder)
        c.run_ladder(
            [{"role": "user", "content": args.prompt}],
            replace(w.flow.sampling(), temperature=0.0, max_new_tokens=args.ladder_tokens),
            ["naive", "half", "device-sampling", "first-fixes", "candidates"],
        )
        rows = wait(c.ladderFinished, 1800)[0]
        settle()
        hud.grab().save(str(args.out / "hud-ladder.png"))
        for r in rows:
            print(r.label, r.decode_tok_s, r.skipped)

    def main_shots() -> None:
        # a fresh chat with an answer that has a code block, in both themes, then in a narrow window
        hud.tabs.setCurrentIndex(0)  # Live
        w.new_chat()
        w.flow.default_sampling = replace(w.flow.default_sampling, max_new_tokens=args.main_tokens, seed=0)
        finished.clear()
        w.composer.set_text(args.main_prompt)
        w.composer.send_button.click()
        while not finished:
            settle(200)
        settle()
        w.grab().save(str(args.out / "main-dark.png"))
        gui.theme.set_choice("light")
        settle()
        w.grab().save(str(args.out / "main-light.png"))
        w.resize(800, 600)  # the conversation wraps to its width
        settle(1000)
        w.grab().save(str(args.out / "main-narrow.png"))

    try:
        w.load_model(args.model)
        wait(c.loaded)
        if "hud" in parts:
            hud_shots()
        if "ladder" in parts:
            ladder_shot()
        if "main" in parts:
            main_shots()
    finally:
        gui.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
