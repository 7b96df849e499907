"""The prefix-reuse switch: on the command line (generate, bench), in the toggles panel, kept by presets."""

from __future__ import annotations

from cli_runner import generate_json

from app.cli import build_parser
from app.cmd_bench import config_from_args
from app.cmd_generate import options_from_args
from engine.types import EngineOptions, preset_options


def test_the_flags_reach_the_options():
    p = build_parser()
    assert options_from_args(p.parse_args(["generate", "--prompt", "x"])).prefix_reuse is True
    assert options_from_args(p.parse_args(["generate", "--prompt", "x", "--no-prefix-reuse"])).prefix_reuse is False
    assert (
        options_from_args(
            p.parse_args(["generate", "--prompt", "x", "--preset", "naive", "--no-prefix-reuse"])
        ).prefix_reuse
        is False
    )
    # the bench reads the whole prompt in every timed run unless asked to reuse it
    assert config_from_args(p.parse_args(["bench"])).prefix_reuse is False
    assert config_from_args(p.parse_args(["bench", "--prefix-reuse"])).prefix_reuse is True
    assert config_from_args(p.parse_args(["bench", "--no-prefix-reuse"])).prefix_reuse is False


def test_a_preset_keeps_the_switch():
    off = EngineOptions(prefix_reuse=False)
    assert all(not preset_options(name, off).prefix_reuse for name in ("naive", "first-fixes", "candidates"))


def test_generate_json_reports_the_reuse_figures(tiny_llama):
    out = generate_json(tiny_llama, "hello world", "--max-new-tokens", "4", "--no-prefix-reuse")
    assert out["options"]["prefix_reuse"] is False
    m = out["metrics"]
    assert m["prompt_reused_tokens"] == 0 and m["prompt_computed_tokens"] == m["prompt_tokens"]
    assert m["prompt_reuse_source"] == "prefix reuse is off"


def test_the_toggle_switches_it(qtbot):
    from ui.toggles import TogglesPanel

    panel = TogglesPanel(EngineOptions())
    qtbot.addWidget(panel)
    assert panel.prefix_reuse.isChecked()
    with qtbot.waitSignal(panel.optionsChanged) as blocker:
        panel.prefix_reuse.click()
    assert blocker.args[0].prefix_reuse is False and panel.options.prefix_reuse is False
    panel.set_options(EngineOptions(prefix_reuse=True))
    assert panel.prefix_reuse.isChecked()
