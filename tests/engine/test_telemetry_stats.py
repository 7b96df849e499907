"""Interval merging, gap, percentiles and the DRAM estimate on hand-made data (decode tok/s itself is checked on
real generations in test_engine.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.telemetry.stats import (
    busy_time,
    gap_fraction,
    merge_intervals,
    percentile,
)


def test_merge_overlapping_nested_touching():
    ivs = [(5, 7), (0, 2), (1, 3), (10, 20), (12, 15), (3, 4), (20, 21)]
    # (0,2)+(1,3) overlap, (3,4) touches -> (0,4); (12,15) nested in (10,20); (20,21) touches
    assert merge_intervals(ivs) == [(0, 4), (5, 7), (10, 21)]


def test_merge_drops_zero_and_negative_lengths():
    assert merge_intervals([(1, 1), (3, 2), (4, 5)]) == [(4, 5)]
    assert merge_intervals([]) == []
    assert merge_intervals([(2, 2)]) == []


def test_merge_single_and_unsorted_input():
    assert merge_intervals([(3.5, 9.25)]) == [(3.5, 9.25)]
    assert merge_intervals(iter([(9, 10), (0, 1)])) == [(0, 1), (9, 10)]


def test_busy_time_of_merged():
    assert busy_time(merge_intervals([(0, 2), (1, 3), (10, 11)])) == 4
    assert busy_time([]) == 0


def test_gap_default_span_is_first_start_to_last_end():
    # busy 2 + 2 over span 0..10 -> 60 % idle
    assert gap_fraction([(0, 2), (8, 10)]) == pytest.approx(0.6)
    # nested intervals count once: busy 4 over 0..8
    assert gap_fraction([(0, 4), (1, 2), (6, 8)]) == pytest.approx(1 - 6 / 8)


def test_gap_with_explicit_span_counts_idle_edges_and_clips():
    # the same kernels inside a longer host window: idle before the first and after the last count
    assert gap_fraction([(2, 4), (6, 8)], span=(0, 10)) == pytest.approx(0.6)
    # an interval reaching outside the span is clipped to it
    assert gap_fraction([(-5, 5)], span=(0, 10)) == pytest.approx(0.5)
    # fully busy
    assert gap_fraction([(0, 5), (5, 10)], span=(0, 10)) == pytest.approx(0.0)


def test_gap_none_when_nothing_to_measure():
    assert gap_fraction([]) is None
    assert gap_fraction([], span=(0, 10)) is None
    assert gap_fraction([(1, 1)]) is None
    assert gap_fraction([(0, 1)], span=(5, 5)) is None


def test_gap_single_interval_is_zero():
    assert gap_fraction([(3, 7)]) == 0.0


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_matches_numpy_linear(q):
    rng = random.Random(7)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.uniform(-3, 50) for _ in range(n)]
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-12)


def test_percentile_empty_and_bad_q():
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_dram_bandwidth_estimate_of_a_generation_without_gpm():
    """Without GPM the generation's DRAM figure is bytes a step reads halfway through the answer / median step
    time / the card's peak, labelled an estimate, and never capped."""
    import torch

    from engine.observers import LoopState, MonitorDrain
    from engine.stream import StepClock
    from engine.types import GenerationMetrics

    asked = []

    class Runner:
        device = torch.device("cuda")

        def bytes_per_step(self, pos):
            asked.append(pos)
            return 300e6

    class Monitor:
        peak_dram_bw_bytes_s = 4.8e12

        def summary(self, t0, t1):
            return {
                m: (None, "GPM not supported on this GPU")
                for m in ("gpu_util_pct", "sm_activity_pct", "dram_bw_util_pct")
            }

    def run(durations):
        """A finished generation of 20 prompt tokens whose decode steps took `durations` (the host clock's marks)."""
        clock = StepClock(torch.device("cpu"))
        clock.marks = [0.0]
        for d in durations:
            clock.marks.append(clock.marks[-1] + d)
        return LoopState(Runner(), torch.zeros(20, dtype=torch.long), [], 0, clock, step=len(durations), t_end=1.0)

    m = GenerationMetrics(prompt_tokens=20, decode_steps=100)
    durations = [0.0001] * 50 + [0.00005] * 49 + [0.01]  # median 0.1 ms: 300 MB in it is 3 TB/s
    MonitorDrain(Monitor(), print).fill(run(durations), m)
    assert asked == [70]
    assert m.dram_bw_util_pct == pytest.approx(100 * 300e6 / 0.0001 / 4.8e12)
    assert m.dram_bw_util_source.startswith("DRAM bandwidth — estimate")
    assert "dram_bw_util_pct" not in m.unavailable
    fast = GenerationMetrics(prompt_tokens=20, decode_steps=100)
    MonitorDrain(Monitor(), print).fill(run([0.00001] * 10), fast)
    assert fast.dram_bw_util_pct == pytest.approx(625.0)  # shown as computed: the premise fails, not the figure
