"""`gapless replay`: a recorded generation shown in the HUD with its figures and sources."""

from __future__ import annotations

from app.replay import show
from engine.recording import Recording
from engine.types import EngineOptions, GenerationMetrics, MonitorSample, StepRecord


def test_a_recording_fills_the_bars_the_plots_and_the_compare_table(qtbot):
    m = GenerationMetrics(prompt_tokens=20, new_tokens=[64], new_tokens_total=64, ttft_ms=12.0, decode_tok_s=969.0)
    m.put("kernel_gap_pct", 25.8, "kernel gap — torch.profiler, 8-step window (sampled)")
    m.put("gpu_util_pct", 71.0, "GPU util — NVML samples")
    m.mark_na("sm_activity_pct", "no GPM on this GPU")
    steps = [StepRecord(t=100.0 + i * 0.01, step=i, tokens_total=i + 1, step_ms=1.03) for i in range(1, 64)]
    samples = [
        MonitorSample(t=100.0 + i * 0.1, gpu_util_pct=70.0 + i, sources={"gpu_util_pct": "GPU util — NVML samples"})
        for i in range(6)
    ]
    rec = Recording(
        "H200 · fp16 · CUDA graph",
        EngineOptions(device="cuda", dtype="fp16"),
        m,
        steps,
        samples,
        t_start=99.99,
        t_end=100.7,
        model={"name": "SmolLM2-135M"},
        machine={"gpus": [{"name": "NVIDIA H200"}]},
    )
    panel = show(rec)
    qtbot.addWidget(panel)
    values = panel.bars.values()
    assert values["decode_tok_s"]["text"] == "969.0 tok/s"
    assert values["kernel_gap_pct"]["source"] == "kernel gap — torch.profiler, 8-step window (sampled)"
    rows = panel.compare.model.rows
    assert len(rows) == 1 and rows[0].label == "H200 · fp16 · CUDA graph" and rows[0].metrics == m
    assert rows[0].model == "SmolLM2-135M"  # the recording's model, not n/a
    lengths = panel.series_lengths()
    assert lengths["step_ms"] == len(steps) and lengths["gpu_util_pct"] == len(samples)
    panel.show()
    panel.live.paint()
    x_lo, x_hi = panel.live._x_shown  # the 0.7 s recording fills the width, from its start (its "#1" mark)
    assert panel.live.window_s is None and x_lo == 0.0 and 0.7 <= x_hi < 1.0


def test_the_replayed_diagnosis_advises_nothing_the_machine_refused(qtbot):
    """A run on the transformers fallback: the static cache it was asked for was refused, so the HUD's diagnosis
    names no next step; the same figures without the refusal would advise the static cache."""
    m = GenerationMetrics(prompt_tokens=5, new_tokens=[8], new_tokens_total=8, decode_tok_s=20.0)
    m.put("kernel_gap_pct", 6.0, "op gap — torch.profiler CPU ops")
    m.put("launches_per_step", 900.0, "top-level aten ops per step")
    options = EngineOptions(device="cpu", dtype="fp32", kv_cache="dynamic")
    refused = {"kv_cache": "gpt2 runs on the transformers fallback, which uses its own dynamic cache"}
    advice = "static KV cache (compile and CUDA graphs need it)"
    for unavailable, step in ((refused, None), ({}, advice)):
        panel = show(Recording("fallback", options, m, unavailable=unavailable))
        qtbot.addWidget(panel)
        line = "CPU, op-bound: 900 ops a step, 6.0 % idle between ops" + (f" → {step}" if step else "")
        assert panel.bars.diagnosis.text() == f"Limit: {line}"


def test_a_screenshot_goes_to_an_image_format_qt_writes(qtbot, tmp_path, capsys):
    import argparse

    import pytest

    from app.replay import run_replay
    from engine.errors import OutputPathError
    from engine.recording import save

    rec = Recording("tiny · fp32", EngineOptions(device="cpu"), GenerationMetrics(prompt_tokens=3), [], [])
    save(rec, tmp_path / "t.json")
    args = argparse.Namespace(file=tmp_path / "t.json", theme="light", width=520, height=860)
    with pytest.raises(OutputPathError, match=r"out\.txt: its suffix names no image format Qt writes \(.*png"):
        run_replay(argparse.Namespace(**vars(args), screenshot=tmp_path / "out.txt"))
    assert run_replay(argparse.Namespace(**vars(args), screenshot=tmp_path / "out.png")) == 0
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().err == ""  # the default size fits
    assert run_replay(argparse.Namespace(**dict(vars(args), width=200), screenshot=tmp_path / "narrow.png")) == 0
    assert "(asked for 200x860)" in capsys.readouterr().err  # the HUD could not be that narrow: said, not silent


def test_replay_without_a_display_draws_its_screenshot_offscreen_or_says_why(tmp_path):
    """On a machine without a display (the GPU machine over SSH that recorded it) Qt aborted the process, blaming
    libxcb-cursor0, even for a screenshot, which needs no screen."""
    import os
    import subprocess
    import sys

    from cli_runner import ROOT

    from engine.recording import save

    rec = Recording("tiny · fp32", EngineOptions(device="cpu"), GenerationMetrics(prompt_tokens=3), [], [])
    save(rec, tmp_path / "t.json")
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env["PYTHONPATH"] = str(ROOT)

    def replay(*extra: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "app", "replay", str(tmp_path / "t.json"), *extra]
        return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)

    shot = replay("--screenshot", str(tmp_path / "hud.png"))
    assert shot.returncode == 0, shot.stderr
    assert (tmp_path / "hud.png").read_bytes()[:4] == b"\x89PNG"
    window = replay()
    assert window.returncode == 2 and window.stderr.startswith("gapless: error: no display to open the app on")
    assert "--screenshot FILE" in window.stderr and "Aborted" not in window.stderr
