"""How often the live plots may repaint: as often as the top rate allows while the painting stays within a
budgeted share of the GUI thread's time.

The GUI thread and the engine's Python share one interpreter lock, so every millisecond spent painting is a
millisecond the decoder may wait. A frame's cost is the paint slot (feeding the curves) plus the plots' paint
events that follow it, in CPU time of the GUI thread; the interval is the smoothed cost over the budget,
clamped to [1/max_hz, 1/min_hz].

The budget is set as a share of the whole machine (`budget_for`): the engine's intra-op threads use every
core, so a millisecond of GUI time on a 2-core laptop costs the decoder far more than on a 16-core workstation.
"""

from __future__ import annotations

import math
from typing import Optional

STEP_MS = 5  # intervals move in steps of this, so the timer is not restarted for noise
MACHINE_SHARE = 0.005  # painting may take this share of all cores while an answer streams
MAX_BUDGET = 0.10  # and never more than this share of the GUI thread


def budget_for(cores: Optional[int], machine_share: float = MACHINE_SHARE) -> float:
    """The GUI thread's paint budget on a machine with `cores` cores: 1 % on 2 cores, 4 % on 8, at most 10 %."""
    return min(MAX_BUDGET, machine_share * max(1, cores or 1))


class PaintRate:
    def __init__(self, max_hz: float = 20.0, min_hz: float = 2.0, budget: float = 0.03, smoothing: float = 0.25):
        if not 0 < budget < 1 or not 0 < smoothing <= 1:
            raise ValueError(f"budget and smoothing must be in (0, 1), got {budget}, {smoothing}")
        self.min_ms = math.ceil(1000.0 / max_hz)
        self.max_ms = max(self.min_ms, math.ceil(1000.0 / min(min_hz, max_hz)))
        self.budget = budget
        self.smoothing = smoothing
        self.interval_ms = self.min_ms
        self.cost_s: Optional[float] = None  # smoothed cost of a frame that fed the curves
        self.frames = 0  # frames that fed the curves
        self.slot_s = 0.0  # all paint-slot time so far
        self.render_s = 0.0  # all paint-event time so far
        self._pending_render_s = 0.0  # paint events since the last frame that fed the curves

    def add_render(self, seconds: float) -> None:
        """A plot's paint event took this long."""
        self.render_s += seconds
        self._pending_render_s += seconds

    def frame(self, slot_seconds: float, fed: bool) -> int:
        """One tick of the paint timer took `slot_seconds`; `fed` says whether it fed any curve (the paint
        events it causes come after it and count towards the next such frame). Returns the next interval."""
        self.slot_s += slot_seconds
        if not fed:
            return self.interval_ms
        cost = slot_seconds + self._pending_render_s
        self._pending_render_s = 0.0
        self.frames += 1
        self.cost_s = cost if self.cost_s is None else self.cost_s + self.smoothing * (cost - self.cost_s)
        wanted = self.cost_s / self.budget * 1000.0
        stepped = STEP_MS * math.ceil(wanted / STEP_MS)
        self.interval_ms = int(min(self.max_ms, max(self.min_ms, stepped)))
        return self.interval_ms

    @property
    def share(self) -> Optional[float]:
        """The smoothed cost over the current interval: the GUI thread's share spent painting while streaming."""
        return None if self.cost_s is None else self.cost_s * 1000.0 / self.interval_ms
