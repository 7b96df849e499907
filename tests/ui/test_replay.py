"""`gapless replay`: a recorded generation shown in the HUD with its figures and sources."""

from __future__ import annotations

import csv
import json

import pytest

import ui.hud.series
from app.replay import show
from engine.recording import Recording, load, save
from engine.types import EngineOptions, GenerationMetrics, MonitorSample, StepRecord
from ui.hud.series import LiveSeries


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


def test_a_recording_longer_than_the_live_rings_is_replayed_and_exported_whole(qtbot, tmp_path, monkeypatch):
    """A 40-minute answer (72,000 steps at 30 Hz, 24,000 samples at 10 Hz) was replayed in the live rings (65,536
    steps, 16,384 samples): its first 13 minutes of samples were missing from the plots and every export, unsaid.
    Here the live rings are made small; the replay holds every step and sample all the same."""
    monkeypatch.setattr(ui.hud.series, "STEP_CAPACITY", 64)
    monkeypatch.setattr(ui.hud.series, "SAMPLE_CAPACITY", 16)
    live = LiveSeries()
    assert (live.steps.capacity, live.samples.capacity) == (64, 16)
    steps = [StepRecord(t=100.0 + i / 30, step=i, tokens_total=i, step_ms=33.0) for i in range(1, 241)]  # 8 s
    source = {"gpu_util_pct": "GPU util — NVML samples"}
    # 80 samples over 8 s and a 5 s pause in the monitor (drawn as a gap: one row more to hold)
    samples = [
        MonitorSample(t=100.0 + i / 10 + (5.0 if i >= 40 else 0.0), gpu_util_pct=float(i), sources=source)
        for i in range(80)
    ]
    m = GenerationMetrics(prompt_tokens=3, new_tokens=[240], new_tokens_total=240, decode_tok_s=30.0)
    save(Recording("long · fp16", EngineOptions(device="cuda"), m, steps, samples, 100.0, 113.0), tmp_path / "r.json")
    panel = show(load(tmp_path / "r.json"))
    qtbot.addWidget(panel)
    assert panel.series.dropped() == {"steps": 0, "samples": 0}
    lengths = panel.series_lengths()
    assert (lengths["steps"], lengths["samples"]) == (len(steps), len(samples))

    with open(panel.export_series_csv(tmp_path / "series.csv"), newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    step_rows = [r for r in rows if r["kind"] == "step"]
    sample_rows = [r for r in rows if r["kind"] == "sample"]
    assert (len(step_rows), len(sample_rows)) == (len(steps), len(samples))
    assert [float(r["t"]) for r in step_rows] == [s.t for s in steps]
    assert [float(r["gpu_util_pct"]) for r in sample_rows] == [s.gpu_util_pct for s in samples]
    doc = json.loads(panel.export_series_json(tmp_path / "series.json").read_text(encoding="utf-8"))
    assert (len(doc["steps"]), len(doc["samples"])) == (len(steps), len(samples))
    assert doc["dropped"] == {"steps": 0, "samples": 0}

    panel.show()
    panel.live.paint(force=True)
    panel.live.refresh_labels()
    x, _ = panel.live.view("gpu_util_pct").curve.getData()
    assert x[0] == pytest.approx(samples[0].t - panel.series.t0)  # the plot starts at the first sample
    assert panel.live.dropped_note.text() == "" and not panel.live.dropped_note.isVisible()


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


def test_a_screenshot_the_disk_cannot_take_says_why_and_leaves_the_earlier_file(qtbot, tmp_path, monkeypatch, capsys):
    """Qt wrote the screenshot straight to the name given: a disk that filled on the way left the user's earlier
    image as a truncated one, said as "could not write the screenshot to <path>" with no reason."""
    import argparse

    from full_disk import fill_the_disk
    from PySide6.QtGui import QImage

    from app.replay import run_replay
    from engine.errors import OutputPathError
    from engine.recording import save

    rec = Recording("tiny · fp32", EngineOptions(device="cpu"), GenerationMetrics(prompt_tokens=3), [], [])
    save(rec, tmp_path / "t.json")
    folder = tmp_path / "shots é"
    folder.mkdir()
    shot = folder / "hud.png"
    shot.write_bytes(b"the user's earlier image\n")
    args = argparse.Namespace(file=tmp_path / "t.json", theme="light", width=520, height=860, screenshot=shot)
    with monkeypatch.context() as m:
        fill_the_disk(m)
        with pytest.raises(OutputPathError) as caught:
            run_replay(args)
    assert str(caught.value) == f"cannot write the screenshot to {shot}: No space left on device"
    assert shot.read_bytes() == b"the user's earlier image\n"
    assert [p.name for p in folder.iterdir()] == ["hud.png"]  # no half file, no temporary one
    assert capsys.readouterr().out == ""  # the path is printed only once it is written

    jpeg = folder / "hud.jpg"  # in the format its suffix names, as before
    assert run_replay(argparse.Namespace(**dict(vars(args), screenshot=jpeg))) == 0
    assert jpeg.read_bytes()[:3] == b"\xff\xd8\xff" and QImage(str(jpeg)).size().toTuple() == (520, 860)
    assert capsys.readouterr().out == f"{jpeg}\n"
