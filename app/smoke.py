"""`gapless gui --smoke-test`: the real main window, offscreen, loads a model, answers one prompt through the
composer, then saves a screenshot and a JSON report of what the user would see. Exit 0 only when all of it
happened; otherwise one line on stderr says which step failed."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from PySide6.QtCore import QEventLoop, QObject, QTimer

from engine import figures

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 900.0  # a first run downloads ~93 MB before loading
ANSWER_TIMEOUT_S = 600.0
SETTLE_MS = 400  # let the HUD and the stats line paint before the screenshot


class SmokeFailed(Exception):
    """Why the smoke test failed; `code` its exit status: 2 for what the user gave (an output path, a model that
    cannot load), as every command exits on bad input, else 1."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class SmokeTest(QObject):
    def __init__(self, app: Any, gui: Any, args: Any):
        super().__init__()
        self.app = app
        self.gui = gui
        self.args = args
        self.window = gui.window
        self.result = None
        self.error: Optional[str] = None

    def run(self) -> int:
        from app.gui import screenshot_file
        from engine.errors import OutputPathError
        from engine.paths import output_file, write_whole

        t0 = time.monotonic()
        try:
            try:  # where the results go, checked before the model loads (as every output of the command line)
                report_path = output_file(self.args.report, "the report") if self.args.report else None
                if self.args.screenshot:
                    screenshot_file(self.args.screenshot)
            except OutputPathError as exc:
                raise SmokeFailed(str(exc), code=2) from None
            report = self._run(t0)
            if report_path is not None:
                try:  # whole or not at all; a full disk is said with the path and the reason
                    write_whole(report_path, figures.strict_json(report, indent=2, ensure_ascii=False) + "\n")
                except OSError as exc:
                    raise SmokeFailed(f"cannot write the report to {self.args.report}: {exc.strerror or exc}") from exc
        except SmokeFailed as exc:
            print(f"gapless: smoke test failed: {exc}", file=sys.stderr)
            log.error("smoke test failed: %s", exc)
            return exc.code
        said = {"ok": True, "answer": report["answer"], "seconds": report["seconds"]}
        print(figures.strict_json(said, ensure_ascii=False))
        return 0

    def _wait(self, signals: list, timeout_s: float, what: str) -> tuple:
        """Run the event loop until one of `signals` fires; return (index, args)."""
        loop = QEventLoop()
        got: list = []

        def make(i: int):
            def slot(*a):
                if not got:
                    got.append((i, a))
                    loop.quit()

            return slot

        slots = [make(i) for i in range(len(signals))]
        for sig, slot in zip(signals, slots):
            sig.connect(slot)
        timer = QTimer(singleShot=True, interval=int(timeout_s * 1000))
        timer.timeout.connect(loop.quit)
        timer.start()
        loop.exec()
        for sig, slot in zip(signals, slots):
            sig.disconnect(slot)
        if not got:
            raise SmokeFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
        return got[0]

    def _run(self, t0: float) -> dict:
        from engine.types import options_as_run

        w, c, flow = self.window, self.gui.controller, self.window.flow
        w.show()
        source = self.args.model or "default"
        fetch = self.gui.fetcher
        signals = [c.loaded, c.loadFailed, fetch.failed]
        w.load_model(source)
        which, payload = self._wait(signals, LOAD_TIMEOUT_S, f"the model {source!r} to load")
        if which == 1:
            raise SmokeFailed(f"cannot load {payload[0]}: {payload[1]}", code=2)
        if which == 2:
            raise SmokeFailed(f"cannot fetch the default model: {payload[0]}")
        loaded_s = time.monotonic() - t0

        # A fixed seed and the app's default sampling, with the answer length asked for.
        flow.default_sampling = replace(flow.default_sampling, max_new_tokens=self.args.max_new_tokens, seed=0)
        w.composer.set_text(self.args.prompt)
        w.composer.send_button.click()
        if not flow.generating:
            raise SmokeFailed("the composer did not send the prompt")
        which, payload = self._wait([c.generationFinished, c.generationFailed], ANSWER_TIMEOUT_S, "the answer")
        if which == 1:
            raise SmokeFailed(f"the answer failed: {payload[1]}")
        result = payload[1]
        self._settle()
        answer_s = time.monotonic() - t0 - loaded_s

        messages = flow.items()
        answer = messages[-1] if messages and messages[-1].role == "assistant" else None
        if answer is None or not answer.content:
            raise SmokeFailed("no answer is shown in the conversation")
        stats = w.chat_view.messages()[-1].stats_label
        shot = self._screenshot()
        hud = self.gui.hud
        return {
            "ok": True,
            "model": c.info.to_dict() if c.info else None,
            "prompt": self.args.prompt,
            "answer": answer.content,
            "finish_reason": result.finish_reasons[0] if result.finish_reasons else None,
            "messages_in_store": self.gui.store.count_messages(),
            "messages_in_chat": self.gui.store.count_messages(flow.chat_id),
            "options": options_as_run(result.options, result.unavailable, result.limits),
            "stats_line": stats.text(),
            "stats_tooltip": stats.toolTip(),
            "metrics": result.metrics.to_dict(),
            "hud": {"series_lengths": hud.series_lengths(), "last_values": hud.last_values()},
            "screenshot": str(shot) if shot else None,
            "data_dir": str(self.gui.paths.data),
            "seconds": {"load": round(loaded_s, 2), "answer": round(answer_s, 2)},
        }

    def _screenshot(self) -> Optional[Path]:
        """The window as the user sees it, written whole or not at all (Qt wrote it straight to the name given: a
        disk that filled left a truncated image, said as "cannot save the screenshot" with no reason)."""
        from app.gui import save_screenshot
        from engine.errors import OutputPathError

        if not self.args.screenshot:
            return None
        try:
            return save_screenshot(self.window, self.args.screenshot)
        except OutputPathError as exc:
            raise SmokeFailed(str(exc)) from None

    def _settle(self) -> None:
        loop = QEventLoop()
        QTimer.singleShot(SETTLE_MS, loop.quit)
        loop.exec()
