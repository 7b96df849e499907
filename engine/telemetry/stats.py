"""Small, exact statistics for the measuring code: interval merging, idle gap, percentiles, device sync.

Plain Python on purpose: these run on a few thousand values per generation, must not need numpy at import,
and are unit-tested against hand-made data.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Sequence

Interval = tuple[float, float]


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted union of [start, end) intervals: overlapping, nested and touching ones become one;
    zero- and negative-length ones are dropped (an event with no duration keeps nothing busy)."""
    spans = sorted((float(s), float(e)) for s, e in intervals if e > s)
    merged: list[Interval] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            if e > merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


def busy_time(merged: Iterable[Interval]) -> float:
    """Total length of already merged (disjoint) intervals."""
    return sum(e - s for s, e in merged)


def gap_fraction(intervals: Iterable[Interval], span: Optional[Interval] = None) -> Optional[float]:
    """Idle share of `span`: 1 - busy / span (the idle-time definition of Holistic Trace Analysis).

    `span` defaults to first start -> last end of the intervals. Intervals are clipped to the span, so busy
    never exceeds it. None when there is nothing to measure: no intervals (a trace that recorded nothing is
    not evidence of idleness) or a zero span.
    """
    merged = merge_intervals(intervals)
    if not merged:
        return None
    if span is None:
        span = (merged[0][0], merged[-1][1])
    lo, hi = float(span[0]), float(span[1])
    if not hi > lo:
        return None
    clipped = [(max(s, lo), min(e, hi)) for s, e in merged if e > lo and s < hi]
    return max(0.0, 1.0 - busy_time(clipped) / (hi - lo))


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100) with linear interpolation between closest ranks, as numpy's default
    ("linear") method. None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    return xs[lo] + (xs[hi] - xs[lo]) * frac


def device_sync_fn(device) -> Callable[[], None]:
    """A function that waits for all queued work on `device` (a no-op on the CPU, where ops are eager)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    if dev.type == "mps":
        return torch.mps.synchronize
    return lambda: None
