"""The HUD's live time series: what the engine measured, held in ring buffers, with the source of every series.

Plain data, no Qt: the panel's slots push StepRecords and MonitorSamples in, the plots and the exports read
out. Times stay on the engine's clock (time.perf_counter(), the same clock in this process); `t0` is the
first time seen, and plots use seconds since it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from engine.figures import SAMPLE_FIGURES, STEP_FIGURES
from engine.types import EngineOptions, GenerationMetrics, MonitorSample, StepRecord
from ui.hud.ring import RingTable, last_finite

# Every per-step figure of engine/figures.py (scope "step") is a column and a series here. Its value is the
# StepRecord field of the same name, unless STEP_PRODUCERS computes it from the records (tokens/s is a rate).
STEP_SERIES = tuple(f.key for f in STEP_FIGURES)
STEP_COLUMNS = ("t", "generation", "tokens_total") + STEP_SERIES + ("profiled",)
SAMPLE_FIELDS = tuple(f.key for f in SAMPLE_FIGURES)  # every per-sample figure of engine/figures.py
SAMPLE_COLUMNS = ("t", "record", "generation") + SAMPLE_FIELDS  # record: 1, NaN on a gap row
INT_FIELDS = frozenset({"generation", "tokens_total", "gpu_memory_used_bytes", "process_rss_bytes"})

# The series the HUD plots and reports.
SAMPLE_SERIES = ("gpu_util_pct", "sm_activity_pct", "dram_bw_util_pct", "cpu_util_pct", "process_rss_bytes")
SERIES = STEP_SERIES + SAMPLE_SERIES


# The live rings: a bounded memory for an app that runs for days. What they overwrite once full is counted
# (LiveSeries.dropped) and the HUD says so; a finished recording is shown in series sized to hold it whole
# (LiveSeries.holding), so nothing of it is dropped.
STEP_CAPACITY = 65536
SAMPLE_CAPACITY = 16384


# Per-generation figures that stand in for a live series the monitor could not measure (no NVML GPM):
# each is drawn over the stretch of time it describes.
ESTIMATED_SERIES = ("sm_activity_pct", "dram_bw_util_pct")
LIVE_REASON_FIELDS = ("gpu_util_pct", "sm_activity_pct", "dram_bw_util_pct")


@dataclass(frozen=True)
class Estimate:
    field: str
    t_start: float
    t_end: float
    value: float
    source: str
    generation: int


@dataclass
class Generation:
    index: int
    label: str
    options: EngineOptions
    t_start: float
    t_end: Optional[float] = None


class LiveSeries:
    """Ring-buffered steps and monitor samples of this session, with sources and the generations' spans.

    `rate_window_s`: tokens/s is the token count over the last window of step records (at least this long once
    warm), restarted at each generation and after the profiled window, whose traced steps are left out as the
    engine leaves them out of its own decode tok/s. `sample_break_s`: a pause in the monitor longer than this
    is drawn as a gap rather than a line across time nobody measured. Once a ring is full its oldest rows are
    overwritten: `dropped()` counts the records no longer held. A capacity left out is the live rings' (STEP_CAPACITY,
    SAMPLE_CAPACITY).
    """

    def __init__(
        self,
        step_capacity: Optional[int] = None,
        sample_capacity: Optional[int] = None,
        rate_window_s: float = 1.0,
        sample_break_s: float = 2.0,
        max_generations: int = 256,
    ):
        self.steps = RingTable(STEP_CAPACITY if step_capacity is None else step_capacity, STEP_COLUMNS)
        self.samples = RingTable(SAMPLE_CAPACITY if sample_capacity is None else sample_capacity, SAMPLE_COLUMNS)
        self.rate_window_s = rate_window_s
        self.sample_break_s = sample_break_s
        self.generations: deque[Generation] = deque(maxlen=max_generations)
        self.sources: dict[str, str] = {}  # sample field -> source of its newest measured value
        self.reasons: dict[str, str] = {}  # sample field -> why it is n/a, from the last generation's metrics
        # why the last answer has no estimate of a series an earlier answer's estimate is plotted for
        self.answer_reasons: dict[str, str] = {}
        self.estimates: dict[str, deque[Estimate]] = {f: deque(maxlen=max_generations) for f in ESTIMATED_SERIES}
        self.t0: Optional[float] = None
        self._rate_window: deque[tuple[float, float]] = deque()
        self._last_step_t: Optional[float] = None
        self._last_sample_t: Optional[float] = None
        self._running: Optional[Generation] = None
        self._count = 0
        # the last number another window on the same data folder gave a generation (MainWindow: the compare rows
        # kept with the chats); a number is taken after it, so two windows' rows do not share numbers
        self.numbered_elsewhere: Callable[[], int] = lambda: 0
        self._spans = 0  # bumped when a generation span starts, moves or ends
        self.steps_seen = 0  # step records added, those the ring has overwritten since included
        self.samples_seen = 0  # monitor samples added, likewise

    @classmethod
    def holding(
        cls, steps: Sequence[StepRecord], samples: Sequence[MonitorSample], sample_break_s: float = 2.0
    ) -> LiveSeries:
        """Series whose rings hold these step records and monitor samples whole, fed as one generation, with the
        gap rows add_samples puts between samples further apart than `sample_break_s`. A finished recording
        knows what it holds: in the live rings the oldest part of a long one was overwritten."""
        times = [s.t for s in samples]
        gaps = sum(1 for a, b in zip(times, times[1:]) if b - a > sample_break_s)
        return cls(
            step_capacity=max(1, len(steps)),
            sample_capacity=max(1, len(samples) + gaps),
            sample_break_s=sample_break_s,
        )

    # ---- producers -------------------------------------------------------------------------------------

    def begin_generation(self, label: str, options: EngineOptions, t: float) -> Generation:
        self._origin(t)
        gen = Generation(index=self.take_index(), label=label, options=options, t_start=t)
        self.generations.append(gen)
        self._running = gen
        self.answer_reasons.clear()
        self._spans += 1
        self._rate_window.clear()
        if self._last_step_t is not None:
            # A NaN row keeps the step curves from joining the previous generation's last point to this one's first.
            self.steps.append((self._last_step_t, gen.index) + (None,) * (len(STEP_COLUMNS) - 2))
        return gen

    def take_index(self) -> int:
        """The next generation number of this session (the ladder's runs take theirs from here too), after the
        numbers kept elsewhere."""
        self._count = max(self._count, self.numbered_elsewhere()) + 1
        return self._count

    def number_after(self, index: int) -> None:
        """The next generation is numbered after `index` (a row kept from an earlier run)."""
        self._count = max(self._count, index)

    def end_generation(
        self,
        t: float,
        metrics: Optional[GenerationMetrics] = None,
        options: Optional[EngineOptions] = None,
        label: Optional[str] = None,
    ) -> Optional[Generation]:
        """Closes the running generation's span. `metrics` adds what the engine knows beyond the samples:
        why a GPU series is n/a, and estimates standing in for series the monitor did not measure. `options` and
        `label`: what ran and its name as the compare row gives it (the span kept what was asked for: "auto")."""
        gen, self._running = self._running, None
        if gen is not None:
            last = self._last_step_t
            gen.t_end = last if last is not None and last >= gen.t_start else t
            gen.options = options if options is not None else gen.options
            gen.label = label if label is not None else gen.label
            self._spans += 1
        if metrics is not None:
            for f in LIVE_REASON_FIELDS:  # not where an earlier answer's estimate is shown in its place
                if f in metrics.unavailable and not self.measured(f) and not self.estimates.get(f):
                    self.reasons[f] = metrics.unavailable[f]
                elif f in metrics.unavailable and not self.measured(f):  # said beside it, as this answer's
                    self.answer_reasons[f] = metrics.unavailable[f]
            # no decode step seen: the answer's own reason (one token, a remote server), not "no steps yet"
            why = metrics.unavailable.get("decode_steps") or metrics.unavailable.get("decode_tok_s")
            for f in STEP_SERIES:
                if why and not self.measured(f):
                    self.reasons[f] = why
                elif why:  # an earlier answer's curve is held: said beside it, as this answer's (a bare n/a)
                    self.answer_reasons[f] = why
            if gen is not None:
                self._add_estimates(gen, metrics)
        return gen

    def _add_estimates(self, gen: Generation, metrics: GenerationMetrics) -> None:
        t_end = gen.t_end
        if t_end is None:
            raise ValueError(f"generation {gen.index} has no end yet: its estimates span start to end")
        t = self.samples.column("t")
        during = (t >= gen.t_start) & (t <= t_end)
        for f in ESTIMATED_SERIES:
            fig = metrics.figure(f)
            value, source = fig.value, fig.source
            if value is None or np.isfinite(self.samples.column(f)[during]).any():
                continue  # nothing to add, or the monitor measured it live
            # SM activity is estimated from the traced window; DRAM bandwidth from the decode steps' times.
            span = self._steps_span(gen, traced_only=(f == "sm_activity_pct"))
            t_a, t_b = span or (gen.t_start, t_end)
            self.estimates[f].append(Estimate(f, t_a, t_b, float(value), source or "estimate", gen.index))
            self.reasons.pop(f, None)
            self._spans += 1

    def _steps_span(self, gen: Generation, traced_only: bool) -> Optional[tuple[float, float]]:
        """From the start of the generation's first (traced) decode step to the end of its last one."""
        rows = self.steps.rows()
        if rows.size == 0:
            return None
        col = {name: i for i, name in enumerate(STEP_COLUMNS)}
        keep = rows[:, col["generation"]] == gen.index
        if traced_only:
            keep &= rows[:, col["profiled"]] > 0.5
        mine = rows[keep & np.isfinite(rows[:, col["tokens_total"]])]
        if mine.size == 0:
            return None
        first_ms = mine[0, col["step_ms"]]
        start = mine[0, col["t"]] - (first_ms / 1000.0 if np.isfinite(first_ms) else 0.0)
        return float(start), float(mine[-1, col["t"]])

    def add_steps(self, records: Iterable[StepRecord]) -> None:
        gen = self._running
        index = gen.index if gen is not None else None
        rows = []
        for r in records:
            self._origin(r.t)
            if gen is not None and r.t < gen.t_start:
                # The GUI hears of a start after the worker has begun; the first record dates it better.
                gen.t_start = r.t
                self._spans += 1
            values = tuple(
                STEP_PRODUCERS[name](self, r) if name in STEP_PRODUCERS else getattr(r, name) for name in STEP_SERIES
            )
            rows.append((r.t, index, r.tokens_total) + values + (1.0 if r.profiled else 0.0,))
            self._last_step_t = r.t
        if rows:
            self.steps.extend(rows)
            self.steps_seen += len(rows)
            for f in STEP_SERIES:
                self.reasons.pop(f, None)

    def add_samples(self, samples: Iterable[MonitorSample]) -> None:
        index = self._running.index if self._running is not None else None
        rows = []
        for s in samples:
            self._origin(s.t)
            if self._last_sample_t is not None and s.t - self._last_sample_t > self.sample_break_s:
                rows.append((self._last_sample_t, None, None) + (None,) * len(SAMPLE_FIELDS))
            values = tuple(getattr(s, f) for f in SAMPLE_FIELDS)
            for f, v in zip(SAMPLE_FIELDS, values):
                if v is not None:
                    self.sources[f] = s.sources.get(f) or "source not reported"
                    self.reasons.pop(f, None)
                elif f in s.unavailable and not self.measured(f) and not self.estimates.get(f):
                    # why the monitor cannot measure it here; where an answer's estimate stands in for it, that
                    # answer says so (the exports named the CPU as the reason beside the estimates they held)
                    self.reasons[f] = s.unavailable[f]
            rows.append((s.t, 1.0, index) + values)
            self._last_sample_t = s.t
            self.samples_seen += 1
        if rows:
            self.samples.extend(rows)

    # ---- readers ---------------------------------------------------------------------------------------

    @property
    def version(self) -> tuple[int, int, int]:
        return self.steps.version, self.samples.version, self._spans

    @property
    def spans_version(self) -> int:
        """Changes whenever a generation span starts, moves or ends, or an estimate is added."""
        return self._spans

    def x(self, ring: RingTable) -> np.ndarray:
        """Seconds since t0 of the held rows of `ring`."""
        return ring.column("t") - (self.t0 or 0.0)

    def values(self, name: str) -> np.ndarray:
        ring = self.steps if name in STEP_COLUMNS else self.samples
        return ring.column(name)

    def series_lengths(self) -> dict[str, int]:
        """Measured points held per series (an estimate segment counts as one), plus the step records and
        monitor samples held."""
        out = {name: int(np.isfinite(self.values(name)).sum()) + len(self.estimates.get(name, ())) for name in SERIES}
        out["steps"] = int(np.isfinite(self.steps.column("tokens_total")).sum())
        out["samples"] = int(np.isfinite(self.samples.column("record")).sum())
        return out

    def dropped(self) -> dict[str, int]:
        """Step records and monitor samples added but no longer held: the oldest, overwritten once their ring was
        full. They are neither plotted nor exported."""
        return {
            "steps": _lost(self.steps_seen, self.steps, "tokens_total"),
            "samples": _lost(self.samples_seen, self.samples, "record"),
        }

    def dropped_text(self) -> str:
        """What the HUD says of `dropped()`; "" when every record added is held."""
        lost = self.dropped()
        what = [
            f"{n:,} {noun if n == 1 else noun + 's'}"
            for n, noun in ((lost["steps"], "step record"), (lost["samples"], "monitor sample"))
            if n
        ]
        if not what:
            return ""
        return f"Not plotted or exported: the oldest {' and '.join(what)}, overwritten when the HUD's rings filled"

    def last_values(self) -> dict[str, Optional[float]]:  # process_rss_bytes as an int
        """The newest measured value of each series (else its newest estimate); None when there is neither."""
        out = {name: last_finite(self.values(name)) for name in SERIES}
        for name in INT_FIELDS & set(SERIES):
            value = out[name]
            out[name] = None if value is None else int(value)
        for name, est in self.estimates.items():
            if out[name] is None and est:
                out[name] = est[-1].value
        return out

    def current_estimate(self, name: str) -> Optional[Estimate]:
        """The estimate of the running answer, else of the last one; None when that answer has none (an earlier
        answer's stays plotted over its own time, and is not this one's)."""
        gen = self._running or (self.generations[-1] if self.generations else None)
        mine = [e for e in self.estimates.get(name, ()) if gen is not None and e.generation == gen.index]
        return mine[-1] if mine else None

    def header_values(self) -> dict[str, Optional[float]]:
        """What each plot's header shows as its current figure. Monitor series: the newest sample (it describes
        now). Step series: the newest value of the running generation, else of the last one; None until the
        running one has one, so a previous answer's figure is never shown as this one's. The traced window's
        step times are left out (tracing slows those steps)."""
        out = self.last_values()
        for name in ESTIMATED_SERIES:  # an estimate is of its answer: never shown as the running or a later one's
            if last_finite(self.values(name)) is None:
                est = self.current_estimate(name)
                out[name] = est.value if est is not None else None
        gens = self.steps.column("generation")
        held = gens[np.isfinite(gens)]
        if held.size == 0 and self._running is None:
            return out
        # the last answer's, even where it ran no decode step (the one before it was shown as its figure)
        last_gen = self.generations[-1].index if self.generations else held[-1]
        current = self._running.index if self._running is not None else last_gen
        mine = gens == current
        traced = self.steps.column("profiled") > 0.5
        for name in STEP_SERIES:
            rows = mine & ~traced if name == "step_ms" else mine
            out[name] = last_finite(self.values(name)[rows])
        return out

    def measured(self, name: str) -> bool:
        """Whether the monitor (or the step records) measured this series at least once in what is held."""
        return bool(np.isfinite(self.values(name)).any())

    def step_rows(self) -> list[dict]:
        """The held step records as dicts (generation breaks left out), None where not measured."""
        return [r for r in _records(self.steps, self.t0) if r["tokens_total"] is not None]

    def estimate_rows(self) -> list[dict]:
        return [
            {
                "series": e.field,
                "t_start": e.t_start,
                "t_end": e.t_end,
                "value": e.value,
                "source": e.source,
                "generation": e.generation,
            }
            for est in self.estimates.values()
            for e in est
        ]

    def sample_rows(self) -> list[dict]:
        return [r for r in _records(self.samples, self.t0) if r.pop("record") is not None]

    # ---- internals -------------------------------------------------------------------------------------

    def _origin(self, t: float) -> None:
        if self.t0 is None:
            self.t0 = t

    def _rate(self, r: StepRecord) -> Optional[float]:
        if r.profiled:
            self._rate_window.clear()
            return None
        w = self._rate_window
        if w and r.tokens_total < w[-1][1]:  # a stop string took back tokens counted before: a new window
            w.clear()
        w.append((r.t, float(r.tokens_total)))
        while len(w) >= 2 and w[1][0] <= r.t - self.rate_window_s:
            w.popleft()
        if len(w) < 2:
            return None
        (t_a, n_a), (t_b, n_b) = w[0], w[-1]
        return (n_b - n_a) / (t_b - t_a) if t_b > t_a else None


# A per-step series computed from the records rather than read from one (see STEP_SERIES).
STEP_PRODUCERS: dict[str, Callable[[LiveSeries, StepRecord], Optional[float]]] = {
    "tokens_per_s": LiveSeries._rate,
}
assert set(STEP_PRODUCERS) <= set(STEP_SERIES)


def _lost(seen: int, ring: RingTable, marker: str) -> int:
    """Records of `seen` no longer in the ring; `marker` is a column every record has and no gap row has."""
    if ring.dropped == 0:
        return 0
    return seen - int(np.isfinite(ring.column(marker)).sum())


def _records(ring: RingTable, t0: Optional[float]) -> list[dict]:
    out = []
    for row in ring.rows():
        rec: dict = {}
        for name, v in zip(ring.columns, row):
            if math.isnan(v):
                rec[name] = None
            elif name in INT_FIELDS:
                rec[name] = int(v)
            elif name == "profiled":
                rec[name] = bool(v)
            else:
                rec[name] = float(v)
        rec["t_rel"] = rec["t"] - (t0 or 0.0)
        out.append(rec)
    return out
