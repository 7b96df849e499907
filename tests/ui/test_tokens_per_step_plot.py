"""The HUD's live tokens-per-step plot draws the step records of a real generation: several tokens a step where
n-gram speculation's drafts were accepted, exactly 1 without speculation, with its source in the header."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_hud import curve_xy, show_and_paint

from engine.engine import Engine
from engine.types import EngineOptions, SamplingParams, StepRecord
from ui.hud import HudPanel
from ui.hud.series_view import TOKENS_PER_STEP_SOURCE

REPEATS = [
    {
        "role": "user",
        "content": "Repeat exactly: the quick brown fox jumps over the lazy dog. "
        "the quick brown fox jumps over the lazy dog.",
    }
]
GREEDY = SamplingParams(temperature=0, max_new_tokens=40)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = Engine.load(str(tiny_llama), EngineOptions(device="cpu"))
    yield eng
    eng.close()


def run(eng: Engine, panel: HudPanel, **options) -> tuple[list[StepRecord], object]:
    eng.reconfigure(EngineOptions(device="cpu", **options))
    records: list[StepRecord] = []
    panel.begin_generation(options.get("speculation", "off"), eng.options)
    res = eng.generate(REPEATS, GREEDY, on_event=lambda e: records.append(e) if isinstance(e, StepRecord) else None)
    panel.add_steps(records)
    panel.end_generation(res.metrics, res.options, "run")
    return records, res


def test_the_plot_gets_tokens_per_step_from_a_speculative_generation(engine, qtbot):
    panel = HudPanel(clock=time.perf_counter)
    panel.resize(520, 1200)
    qtbot.addWidget(panel)
    records, res = run(engine, panel, speculation="ngram", draft_tokens=8)
    assert res.metrics.accepted_tokens > 0  # the repeating answer is where drafts are accepted
    show_and_paint(qtbot, panel)
    panel.live.paint(force=True)

    view = panel.live.view("tokens_per_step")
    x, y = curve_xy(view.curve)
    np.testing.assert_array_equal(y, [r.tokens_per_step for r in records])
    np.testing.assert_array_equal(x, [r.t - panel.series.t0 for r in records])
    assert y.max() > 1.0  # a step that verified drafts gave several tokens
    assert view.label_text == f"Tokens/step — {TOKENS_PER_STEP_SOURCE}"
    assert view.value.text() == f"{records[-1].tokens_per_step:.2f} tok/step"
    assert panel.series_lengths()["tokens_per_step"] == len(records)

    # Without speculation every step gives one token, and the plot says so (it is not n/a).
    plain, _ = run(engine, panel)
    panel.live.paint(force=True)
    panel.live.refresh_labels()
    _, y = curve_xy(view.curve)
    assert [r.tokens_per_step for r in plain] == [1.0] * len(plain)
    np.testing.assert_array_equal(y[-len(plain) :], [1.0] * len(plain))
    assert view.na_reason is None and view.value.text() == "1.00 tok/step"
