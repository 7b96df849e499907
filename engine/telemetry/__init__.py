"""Measuring code: interval statistics, the profiler window (kernel/op gap), the NVML/process monitor and a
description of the machine. No Qt; every figure carries its source or is None with a reason."""

from engine.telemetry.machine import describe_machine
from engine.telemetry.monitor import Monitor, estimate_dram_bw_util
from engine.telemetry.stats import (
    busy_time,
    gap_fraction,
    merge_intervals,
    percentile,
)
from engine.telemetry.window import ProfileWindow, WindowStats, warm_up_profiler

__all__ = [
    "Monitor",
    "ProfileWindow",
    "WindowStats",
    "busy_time",
    "describe_machine",
    "estimate_dram_bw_util",
    "gap_fraction",
    "merge_intervals",
    "percentile",
    "warm_up_profiler",
]
