"""Synthetic metric streams for the HUD: step records, monitor samples (GPU with NVML GPM, GPU with estimates,
CPU with NVML missing), per-generation metrics and ladder rows. Deterministic (seeded), shaped like what the
engine emits on an H200 and on this CPU machine, so the tests and the synthetic screenshots share them.

Run as a script to redraw the synthetic screenshots:
    PYTHONPATH=. QT_QPA_PLATFORM=offscreen python tests/ui/hud_streams.py docs/screenshots
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from engine.telemetry.monitor import SOURCES
from engine.types import (
    PRESET_LABELS,
    EngineOptions,
    GenerationMetrics,
    LadderRow,
    MonitorSample,
    StepRecord,
    preset_options,
)

# The labels the engine's monitor and profiler window put on their figures.
GPM = SOURCES["sm_activity_pct"]  # "SM activity — NVML GPM"
NVML = SOURCES["gpu_util_samples"]
SM_ESTIMATE = "SM activity — estimate from the profiler window (kernel time × min(1, blocks/132 SMs))"
DRAM_ESTIMATE = "estimate: weight + KV bytes per step / median step time / NVML peak bandwidth"
CPU_REASON = "the model runs on the CPU, not on a GPU"
NVML_MISSING = "NVML not available: nvidia-ml-py not installed (No module named 'pynvml')"
KERNEL_GAP = "kernel gap — torch.profiler, 8-step window (sampled)"
OP_GAP = "op gap — torch.profiler CPU ops, 8-step window (sampled)"


class ManualClock:
    """The HUD's clock in tests: time moves only when the stream says so."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass(frozen=True)
class Rung:
    label: str
    options: EngineOptions
    step_ms: float  # mean decode step
    gpu_util: Optional[float]
    sm_activity: Optional[float]
    dram_bw: Optional[float]
    gap_pct: float
    candidates: int = 1


GPU_RUNGS = (
    Rung("Naive", preset_options("naive", EngineOptions(device="cuda")), 21.0, 24.0, 11.0, 2.5, 81.0),
    Rung("+ static KV cache", preset_options("first-fixes", EngineOptions(device="cuda")), 4.6, 58.0, 31.0, 9.0, 42.0),
    Rung("+ CUDA graph", preset_options("cuda-graph", EngineOptions(device="cuda")), 0.48, 96.0, 78.0, 46.0, 6.0),
)


def steps(
    t_start: float,
    n: int,
    step_ms: float,
    candidates: int = 1,
    profiled: tuple[int, int] = (16, 24),
    seed: int = 0,
    first_step_delay_s: float = 0.02,
) -> list[StepRecord]:
    """n decode steps starting after a prefill delay; the steps in `profiled` are traced (and slower)."""
    rng = np.random.default_rng(seed)
    out, t = [], t_start + first_step_delay_s
    for i in range(1, n + 1):
        traced = profiled[0] <= i < profiled[1]
        ms = step_ms * float(1.0 + 0.08 * rng.standard_normal()) * (3.0 if traced else 1.0)
        t += ms / 1000.0
        out.append(StepRecord(t=t, step=i, tokens_total=i * candidates, step_ms=ms, profiled=traced))
    return out


def samples(
    t_start: float,
    t_end: float,
    hz: float,
    values: dict[str, Optional[float]],
    sources: dict[str, str],
    seed: int = 0,
    cpu_util: float = 98.0,
    rss: int = 1_350_000_000,
) -> list[MonitorSample]:
    """Monitor readings every 1/hz s: `values` gives each GPU field's mean (None: not measured)."""
    rng = np.random.default_rng(seed)
    out, t = [], t_start
    while t <= t_end:
        jitter = {
            k: (None if v is None else float(np.clip(v * (1 + 0.06 * rng.standard_normal()), 0, 100)))
            for k, v in values.items()
        }
        out.append(
            MonitorSample(
                t=t,
                cpu_util_pct=float(cpu_util + 4 * rng.standard_normal()),
                process_rss_bytes=int(rss + rng.integers(0, 4_000_000)),
                sources=dict(sources),
                **jitter,
            )
        )
        t += 1.0 / hz
    return out


def gpu_sources(gpm: bool = True) -> dict[str, str]:
    """Sources of a GPU sample; without GPM the monitor reads no SM activity or DRAM bandwidth at all."""
    out = {"gpu_util_pct": NVML, **cpu_sources()}
    if gpm:
        out.update({f: SOURCES[f] for f in ("sm_activity_pct", "sm_occupancy_pct", "dram_bw_util_pct")})
    return out


def cpu_sources() -> dict[str, str]:
    """Without NVML a sample carries only the process figures; why the GPU ones are n/a is in the metrics."""
    return {"cpu_util_pct": SOURCES["cpu_util_pct"], "process_rss_bytes": SOURCES["process_rss_bytes"]}


def metrics_for(
    records: list[StepRecord],
    rung: Rung,
    prompt_tokens: int = 42,
    gpu: bool = True,
    gpm: bool = True,
    gpu_reason: str = CPU_REASON,
) -> GenerationMetrics:
    """Per-generation figures consistent with the records (the engine computes its own; this mirrors them)."""
    untraced = [r for r in records if not r.profiled]
    ms = np.array([r.step_ms for r in untraced])
    span = sum(r.step_ms for r in untraced) / 1000.0
    n = records[-1].tokens_total
    m = GenerationMetrics(
        prompt_tokens=prompt_tokens,
        new_tokens=[n // rung.candidates] * rung.candidates,
        new_tokens_total=n,
        ttft_ms=20.0 + rung.step_ms,
        prefill_tok_s=prompt_tokens / (0.02 + rung.step_ms / 1000.0),
        decode_tok_s=len(untraced) * rung.candidates / span,
        decode_steps=len(records),
        decode_seconds=span,
        step_ms_p50=float(np.percentile(ms, 50)),
        step_ms_p90=float(np.percentile(ms, 90)),
        step_ms_p99=float(np.percentile(ms, 99)),
        kernel_gap_pct=rung.gap_pct,
        kernel_gap_source=KERNEL_GAP if gpu else OP_GAP,
        profiled_steps=sum(r.profiled for r in records),
    )
    if gpu:
        m.peak_memory_bytes, m.peak_memory_source = 412_000_000, "torch.cuda.max_memory_allocated"
        m.gpu_util_pct, m.gpu_util_source = rung.gpu_util, NVML
        m.sm_activity_pct, m.sm_activity_source = rung.sm_activity, GPM if gpm else SM_ESTIMATE
        m.dram_bw_util_pct, m.dram_bw_util_source = rung.dram_bw, SOURCES["dram_bw_util_pct"] if gpm else DRAM_ESTIMATE
    else:
        for k in ("sm_activity_pct", "gpu_util_pct", "dram_bw_util_pct"):
            m.unavailable[k] = gpu_reason
        m.unavailable["peak_memory_bytes"] = "no device memory counter on CPU"
    return m


def ladder_rows(gpu: bool = True) -> list[LadderRow]:
    """Rows as engine.ladder.run_ladder makes them, one rung skipped with its reason."""
    figures = {  # preset -> (decode tok/s, kernel gap %)
        "naive": (47.6, 81.0),
        "half": (52.0, 79.5),
        "device-sampling": (118.0, 58.0),
        "first-fixes": (214.0, 42.0),
        "compile": (905.0, 17.0),
        "cuda-graph": (2080.0, 6.0),
        "candidates": (7900.0, 5.1),
    }
    rows = []
    for preset, (tok, gap) in figures.items():
        opts = preset_options(preset, EngineOptions(device="cuda" if gpu else "cpu"))
        skipped = None if gpu or preset not in ("cuda-graph", "candidates") else "CUDA graphs need a CUDA device"
        m = (
            None
            if skipped
            else GenerationMetrics(
                decode_tok_s=tok if gpu else tok / 40,
                kernel_gap_pct=gap,
                kernel_gap_source=KERNEL_GAP if gpu else OP_GAP,
                new_tokens_total=128,
                new_tokens=[128],
                prompt_tokens=42,
            )
        )
        rows.append(
            LadderRow(
                preset,
                PRESET_LABELS[preset],
                "skipped" if skipped else "ok",
                opts.to_dict(),
                skipped,
                metrics=None if m is None else m.to_dict(),
            )
        )
    return rows


def feed_gpu_session(panel, clock: ManualClock, n_steps: int = 160, gpm: bool = True) -> float:
    """Three generations (Naive, static KV cache, CUDA graph) with GPU samples at 10 Hz from clock.t on.
    Returns the end time."""
    t = clock.t
    for i, rung in enumerate(GPU_RUNGS):
        clock.t = t
        panel.begin_generation(rung.label, rung.options)
        recs = steps(t, n_steps * (1 if rung.step_ms > 1 else 8), rung.step_ms, seed=i)
        end = recs[-1].t
        vals = {
            "gpu_util_pct": rung.gpu_util,
            "sm_activity_pct": rung.sm_activity if gpm else None,
            "dram_bw_util_pct": rung.dram_bw if gpm else None,
        }
        panel.add_samples(samples(t, end, 10.0, vals, gpu_sources(gpm), seed=i))
        for k in range(0, len(recs), 16):  # the worker batches records at ~30 Hz
            panel.add_steps(recs[k : k + 16])
        clock.t = end + 0.01
        panel.end_generation(metrics_for(recs, rung, gpm=gpm), rung.options, rung.label)
        t = end + 0.8
        idle = {"gpu_util_pct": 0.0, "sm_activity_pct": 0.0 if gpm else None, "dram_bw_util_pct": 0.0 if gpm else None}
        panel.add_samples(samples(end + 0.1, t - 0.05, 10.0, idle, gpu_sources(gpm), seed=10 + i, cpu_util=3.0))
    return t


def feed_cpu_session(panel, clock: ManualClock, n_steps: int = 120) -> float:
    """Two generations on a CPU without NVML: every GPU field None with its reason, CPU use and memory measured."""
    t = clock.t
    cpu_rungs = (
        Rung("Naive", preset_options("naive", EngineOptions(device="cpu")), 31.0, None, None, None, 64.0),
        Rung(
            "+ static KV cache",
            preset_options("first-fixes", EngineOptions(device="cpu"), half_dtype="fp32"),
            19.0,
            None,
            None,
            None,
            38.0,
        ),
    )
    for i, rung in enumerate(cpu_rungs):
        clock.t = t
        panel.begin_generation(rung.label, rung.options)
        recs = steps(t, n_steps, rung.step_ms, seed=i)
        end = recs[-1].t
        none = {"gpu_util_pct": None, "sm_activity_pct": None, "dram_bw_util_pct": None}
        panel.add_samples(
            samples(
                t, end, 10.0, none, cpu_sources(), seed=i, cpu_util=185.0 - 60 * i, rss=1_100_000_000 + 40_000_000 * i
            )
        )
        for k in range(0, len(recs), 8):
            panel.add_steps(recs[k : k + 8])
        clock.t = end + 0.01
        panel.end_generation(metrics_for(recs, rung, gpu=False), rung.options, rung.label)
        t = end + 1.0
        panel.add_samples(
            samples(
                end + 0.1,
                t - 0.05,
                10.0,
                none,
                cpu_sources(),
                seed=10 + i,
                cpu_util=2.0,
                rss=1_100_000_000 + 40_000_000 * i,
            )
        )
    return t


def write_screenshots(out_dir: Path) -> list[Path]:
    """The HUD after a synthetic GPU session (each tab, dark and light) and a CPU session (dark)."""
    from PySide6.QtWidgets import QApplication

    from ui.hud.panel import HudPanel
    from ui.theme import ThemeManager

    app = QApplication.instance() or QApplication(["hud-screenshots"])
    theme = ThemeManager(app, "dark")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def shoot(panel, tab: int, name: str) -> None:
        panel.tabs.setCurrentIndex(tab)
        app.processEvents()
        panel.live.refresh_labels()
        panel.live.paint()
        app.processEvents()
        path = out_dir / f"{name}.png"
        panel.grab().save(str(path))
        written.append(path)

    for choice, suffix in (("dark", ""), ("light", "-light")):
        theme.set_choice(choice)
        clock = ManualClock(1000.0)
        panel = HudPanel(clock=clock)
        panel.resize(560, 1020)
        feed_gpu_session(panel, clock)
        panel.set_ladder_results(ladder_rows())
        panel.show()
        for tab, name in ((0, "hud-synthetic"), (1, "hud-compare-synthetic"), (2, "hud-ladder-synthetic")):
            shoot(panel, tab, name + suffix)
        panel.close()
        if choice == "dark":
            clock = ManualClock(1000.0)
            panel = HudPanel(clock=clock)
            panel.resize(560, 1020)
            feed_cpu_session(panel, clock)
            panel.set_ladder_results(ladder_rows(gpu=False))
            panel.show()
            shoot(panel, 0, "hud-synthetic-cpu")
            shoot(panel, 2, "hud-ladder-synthetic-cpu")
            panel.close()
    return written


if __name__ == "__main__":
    for p in write_screenshots(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/screenshots")):
        print(p)
