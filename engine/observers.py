"""What the decode loop tells the rest of a generation: one state object and one observer interface.

The loop (engine.generate.run_loop) only prefills, steps and checks whether to stop. Everything else that happens
around a step — tokens read back to the host, text and step records streamed, monitor samples passed on, the
profiler window opened and closed — is a `StepObserver`, called at fixed points of every generation with the
`LoopState`, and each fills the figures it measured into the generation's metrics.
"""

from __future__ import annotations

import bisect
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Optional

import torch

from engine.stream import Readback, RowText, StepClock
from engine.telemetry.monitor import NVML_PEAK, estimate_dram_bw_util
from engine.telemetry.stats import percentile
from engine.types import GenerationMetrics, RowFinished, StepRecord, TextDelta

if TYPE_CHECKING:
    from engine.decode import RunnerBase
    from engine.telemetry.monitor import Monitor
    from engine.telemetry.window import ProfileWindow, WindowStats

FLUSH_INTERVAL_S = 1 / 30  # text and step records leave at most this often
MONITOR_INTERVAL_S = 0.1
READBACK_EVERY = 8  # device sampling on CUDA: steps between copies to the host (on a CPU a copy costs no sync)

Event = Callable[[object], None]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class LoopState:
    """One generation as the loop has run it so far. The loop advances `step`, `produced` and `token_step`;
    the reader moves `seen` (through `feed`); the profiler window adds the steps it slowed to `profiled`."""

    runner: RunnerBase
    prompt: torch.Tensor  # [T] long on the device
    rows: list[RowText]
    max_new: int
    clock: StepClock
    step: int = 0  # the last step run: 0 is the prefill, decode steps count from 1
    produced: int = 0  # tokens per row the device has written
    seen: int = 0  # tokens per row the host has read
    token_step: list[int] = field(default_factory=list)  # token index -> the step that made it (0: the prefill)
    fresh: Optional[list[int]] = None  # the last step's tokens when the step itself returned them to the host
    profiled: set[int] = field(default_factory=set)  # decode steps the profiler recorded (left out of tok/s)
    profiled_s: float = 0.0  # wall time of those steps, synchronised
    cancelled: bool = False
    t_start: float = 0.0  # before the prefill, device synchronised
    t_first: float = 0.0  # the first token of every row on the host
    t_end: float = 0.0  # after the last step, device synchronised

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def finished(self) -> bool:
        return self.produced >= self.max_new or all(r.finish is not None for r in self.rows)

    def advance(self, tokens: Optional[list[int]]) -> None:
        """Step `step` has run: mark its end, count what it made (`tokens` when the step gave them to the host,
        else one per row, still on the device)."""
        self.clock.mark()
        made = min(1 if tokens is None else len(tokens), self.max_new - self.produced)
        self.fresh = None if tokens is None else tokens[:made]
        self.token_step.extend([self.step] * made)
        self.produced += made

    def feed(self, columns: list[list[int]], upto: int) -> None:
        """The host has read tokens [seen, upto) of every row (`columns`, one list per row)."""
        for r, col in zip(self.rows, columns):
            r.feed(col)
        self.seen = upto
        if not self.t_first:
            self.t_first = time.perf_counter()

    def kept_per_step(self, start: int, upto: int) -> Optional[float]:
        """Tokens kept per row and decode step over the steps [start, upto), counting a row's steps only while it
        was open (up to the step that made its last kept token, once it has ended): 1 without speculation,
        whatever the candidates, and tokens a stop string cut never count. None where no row was open."""
        kept = open_steps = 0
        for r in self.rows:
            n = len(r.tokens)
            kept += bisect.bisect_left(self.token_step, upto, hi=n) - bisect.bisect_left(self.token_step, start, hi=n)
            last = upto - 1 if r.finish is None else (self.token_step[n - 1] if n else 0)
            open_steps += max(0, min(upto, last + 1) - start)
        return kept / open_steps if open_steps else None

    def durations_s(self) -> list[float]:
        """Decode steps' durations, leaving out the steps the profiler slowed."""
        return [d for i, d in enumerate(self.clock.durations_s(self.step + 1), start=1) if i not in self.profiled]


class StepObserver:
    """Told what the decode loop does, in this order; each hook does nothing unless overridden.

    on_start     before the prefill (device not yet synchronised)
    before_step  before decode step `run.step` (already counted up) runs
    after_step   right after it ran, before its end is marked on the step clock (work here is timed with the step)
    on_step      after the prefill (`run.step` 0) and after each decode step, its tokens counted and its end marked
    on_finish    after the last step, the device synchronised and `run.t_end` set
    fill         the metrics of the generation are made: set the figures this observer measured (put / mark_na)
    """

    def on_start(self, run: LoopState) -> None:
        pass

    def before_step(self, run: LoopState) -> None:
        pass

    def after_step(self, run: LoopState) -> None:
        pass

    def on_step(self, run: LoopState) -> None:
        pass

    def on_finish(self, run: LoopState) -> None:
        pass

    def fill(self, run: LoopState, metrics: GenerationMetrics) -> None:
        pass


class Reader(StepObserver):
    """Brings the tokens to the host (into the rows, where EOS and stop strings end them); at the end, a row still
    open was cut by the length limit or the stop."""

    def on_finish(self, run: LoopState) -> None:
        for r in run.rows:
            if r.finish is None:
                r.finish = "cancelled" if run.cancelled else "length"


def reader_for(runner: RunnerBase, host_reads: bool) -> Reader:
    """The reader of a generation: the host reads every step (host sampling, speculation) or copies behind."""
    return HostReader() if host_reads else DeviceReader(runner)


class HostReader(Reader):
    """Host sampling (and speculation, whose step returns its tokens): the host reads every step's tokens at once."""

    def on_step(self, run: LoopState) -> None:
        if run.fresh is not None:  # speculation: batch 1
            run.feed([run.fresh], run.produced)
        elif run.step and run.runner.batch == 1:
            run.feed([[int(run.runner.tok.item())]], run.produced)  # the per-token host sync of this mode
        else:
            run.feed([[t] for t in run.runner.tok.view(-1).tolist()], run.produced)


class DeviceReader(Reader):
    """Device sampling: asynchronous copies of the token buffer every `every` steps (engine.stream.Readback), so
    the host reads tokens a few steps behind the device and never makes it wait; all of them at the end."""

    def __init__(self, runner: RunnerBase):
        self.readback = Readback(runner.out)
        self.every = READBACK_EVERY if runner.device.type == "cuda" else 1

    def _read(self, run: LoopState, wait: bool) -> None:
        self.readback.issue(run.produced)
        visible = self.readback.poll(wait=wait)
        if visible > run.seen:
            run.feed(self.readback.columns(run.seen, visible), visible)

    def on_step(self, run: LoopState) -> None:
        if run.step % self.every == 0:
            self._read(run, wait=run.step == 0)  # the prefill's token: the first token is waited for

    def on_finish(self, run: LoopState) -> None:
        self._read(run, wait=True)
        super().on_finish(run)


class _Paced(StepObserver, ABC):
    """Passes events on (`emit`) at most every `interval_s` from the first token on, and once more at the end."""

    def __init__(self, on_event: Event, interval_s: float):
        self.on_event = on_event
        self.interval_s = interval_s
        self.last = 0.0

    def on_step(self, run: LoopState) -> None:
        if run.step == 0:
            self.last = run.t_first
            return
        t = time.perf_counter()
        if t - self.last >= self.interval_s:
            self.emit(run, final=False)
            self.last = t

    def on_finish(self, run: LoopState) -> None:
        self.emit(run, final=True)

    @abstractmethod
    def emit(self, run: LoopState, final: bool) -> None:
        """Pass on what has come since the last emit (all that is left when `final`)."""


class TextFlush(_Paced):
    """Streams each row's new text (TextDelta, RowFinished once a row ends) and a StepRecord of the steps whose
    tokens the host has read, at most every `interval_s`, and what is left at the end."""

    def __init__(self, on_event: Event, interval_s: Optional[float] = None):
        super().__init__(on_event, FLUSH_INTERVAL_S if interval_s is None else interval_s)
        self.ended: set[int] = set()  # rows whose end was reported
        self.records_from = 1  # the first step not yet in a StepRecord
        self.last_t = 0.0  # the time of the last StepRecord: a record is never dated before the one it follows

    def emit(self, run: LoopState, final: bool) -> None:
        self._text(run, final)
        self._steps(run, run.step + 1 if final else _steps_seen(run.token_step, run.seen))

    def _text(self, run: LoopState, final: bool) -> None:
        for i, r in enumerate(run.rows):
            delta = r.take_delta(final=final)
            if delta:
                self.on_event(TextDelta(candidate=i, text=delta))
            if r.finish is not None and i not in self.ended:
                self.ended.add(i)
                self.on_event(RowFinished(candidate=i, reason=r.finish))

    def _steps(self, run: LoopState, upto: int) -> None:
        """StepRecords for the steps [records_from, upto) whose timings are known: one per stretch of steps that
        are all traced or all untraced (a record mixing them read as traced, its mean step time as the traced
        steps'), each dated by the end of its last step: now, less the measured steps that came after it."""
        start = self.records_from
        durations = run.clock.durations_s(upto)[start - 1 :]
        if not durations:
            return
        end = start + len(durations)
        traced = [s in run.profiled for s in range(start, end)]
        cuts = [start] + [s for s in range(start + 1, end) if traced[s - start] != traced[s - start - 1]] + [end]
        now = time.perf_counter()
        for a, b in zip(cuts, cuts[1:]):
            part = durations[a - start : b - start]
            made_by = bisect.bisect_right(run.token_step, b - 1)  # tokens per row made by steps before `b`
            self.last_t = max(self.last_t, now - sum(durations[b - start :]))
            self.on_event(
                StepRecord(
                    t=self.last_t,
                    step=b - 1,
                    tokens_total=sum(min(len(r.tokens), made_by) for r in run.rows),
                    step_ms=1e3 * sum(part) / len(part),
                    profiled=traced[a - start],
                    tokens_per_step=run.kept_per_step(a, b),
                )
            )
        self.records_from = end


def _steps_seen(token_step: list[int], seen: int) -> int:
    """The step bound [1, n) of the tokens the host has read: steps up to the one that made token seen - 1."""
    return token_step[min(seen, len(token_step)) - 1] + 1


class MonitorDrain(_Paced):
    """Passes the monitor's samples on as they come (at most every `interval_s`), and fills the generation's
    GPU figures from the samples taken while it ran: utilisation, SM activity, DRAM bandwidth (estimated from
    the median step when the monitor has no measure of it)."""

    def __init__(self, monitor: Monitor, on_event: Event, interval_s: Optional[float] = None):
        super().__init__(on_event, MONITOR_INTERVAL_S if interval_s is None else interval_s)
        self.monitor = monitor
        self._told = False  # the generation's samples have said why the monitor leaves some series empty

    def on_start(self, run: LoopState) -> None:
        self.monitor.drain()  # samples from before this generation are not its own
        self._told = False

    def emit(self, run: LoopState, final: bool) -> None:
        for s in self.monitor.drain():
            if not self._told:  # why the series it leaves empty are n/a, once a generation
                s = replace(s, unavailable={**self.monitor.unavailable, **s.unavailable})
                self._told = True
            self.on_event(s)

    def fill(self, run: LoopState, metrics: GenerationMetrics) -> None:
        summary = self.monitor.summary(run.t_start, run.t_end)
        for name in ("gpu_util_pct", "sm_activity_pct", "dram_bw_util_pct"):
            value, source = summary.get(name, (None, "no monitor"))
            if value is not None:
                metrics.put(name, value, source)
            elif getattr(metrics, name) is None:  # an estimate another observer made stands
                metrics.mark_na(name, source)
        durations = run.durations_s()
        if metrics.dram_bw_util_pct is None and not durations and run.device.type == "cpu":
            metrics.mark_na("dram_bw_util_pct", "estimated from the decode steps' timings: no decode step was timed")
        if metrics.dram_bw_util_pct is None and durations:
            peak_bw, peak_name = self._bandwidth(run.device)
            if not peak_bw and peak_name:  # the CPU's bandwidth could not be measured: say why
                metrics.mark_na("dram_bw_util_pct", peak_name)
            if peak_bw:
                # The median step against the bytes a step reads halfway through the answer (weights + KV attended
                # there). Not capped: above 100 % says the estimate's premise (every byte read from DRAM, at
                # most at that bandwidth) does not hold.
                value, source = estimate_dram_bw_util(
                    run.runner.bytes_per_step(int(run.prompt.numel()) + metrics.decode_steps // 2),
                    percentile(durations, 50),
                    peak_bw,
                    peak_name,
                )
                if value is not None:
                    metrics.put("dram_bw_util_pct", value, source)

    def _bandwidth(self, device: torch.device) -> tuple[Optional[float], str]:
        """The bandwidth the estimate divides by, and its name: NVML's peak on a GPU; on a CPU, its read bandwidth
        as measured once (where that failed: None, and why)."""
        if device.type == "cuda":  # without a peak, the monitor's own reason for the n/a stands
            peak = getattr(self.monitor, "peak_dram_bw_bytes_s", None)
            return (peak, NVML_PEAK) if peak else (None, "")
        if device.type != "cpu":
            return None, ""
        from engine.telemetry.bandwidth import this_cpu

        bw, why = this_cpu()
        if bw is None:
            return None, f"DRAM bandwidth estimate: the CPU's read bandwidth could not be measured ({why})"
        return bw.bytes_s, f"this CPU's measured read bandwidth ({bw.bytes_s / 1e9:.1f} GB/s: {bw.source})"


class WindowObserver(StepObserver):
    """The profiler window (engine.telemetry.window): opened at its first step, closed after its last or at the
    end of the generation; the steps it recorded, slowed by it, are marked so tok/s and step times leave them out.
    Fills the kernel gap and launches per step, and an SM activity estimate for the monitor to replace."""

    def __init__(self, window: ProfileWindow):
        self.window = window
        self.t_open: Optional[float] = None  # while the traced window is open
        self.stats: Optional[WindowStats] = None

    def before_step(self, run: LoopState) -> None:
        w = self.window
        if not w.in_window(run.step):
            return
        if run.step == w.start:
            sync(run.device)
            t_open = time.perf_counter()
            w.step_begin(run.step)
            self.t_open = t_open if w.tracing else None
        if w.tracing:  # only the steps the profiler records are slowed by it
            run.profiled.add(run.step)

    def after_step(self, run: LoopState) -> None:
        if run.step not in run.profiled:
            return
        self.window.step_end(run.step)
        if not self.window.in_window(run.step + 1) and self.t_open is not None:
            sync(run.device)
            run.profiled_s += time.perf_counter() - self.t_open
            self.t_open = None

    def on_finish(self, run: LoopState) -> None:
        if self.t_open is not None:  # the generation ended inside the window
            run.profiled_s += run.t_end - self.t_open
            self.t_open = None
        self.stats = self.window.finish()

    def fill(self, run: LoopState, metrics: GenerationMetrics) -> None:
        stats, window = self.stats, self.window
        if stats is not None and stats.gap_pct is not None:
            metrics.put("kernel_gap_pct", stats.gap_pct, stats.gap_source)
        elif not window.enabled:
            metrics.mark_na("kernel_gap_pct", "profiler window off")
        elif stats is None and window.skipped:
            metrics.mark_na("kernel_gap_pct", f"window not traced: {window.skipped}")
        elif stats is None:
            metrics.mark_na(
                "kernel_gap_pct",
                f"the answer ended before the traced window (decode steps {window.start}-"
                f"{window.start + window.steps - 1})",
            )
        else:
            metrics.mark_na("kernel_gap_pct", "no events traced in the window")
        if stats is not None and stats.launches_per_step is not None:
            metrics.put("launches_per_step", stats.launches_per_step, stats.launches_source)
        else:
            metrics.mark_na(
                "launches_per_step",
                metrics.unavailable.get("kernel_gap_pct") or "no kernels or ops traced in the window",
            )
        if stats is not None and stats.sm_activity_est_pct is not None and metrics.sm_activity_pct is None:
            metrics.put("sm_activity_pct", stats.sm_activity_est_pct, stats.sm_activity_source)


class PeakMemory(StepObserver):
    """The generation's peak memory: the CUDA allocator's peak since the start, or the process's peak RSS."""

    def on_start(self, run: LoopState) -> None:
        if run.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(run.device)

    def fill(self, run: LoopState, metrics: GenerationMetrics) -> None:
        if run.device.type == "cuda":
            metrics.put(
                "peak_memory_bytes",
                int(torch.cuda.max_memory_allocated(run.device)),
                "torch.cuda.max_memory_allocated (this generation)",
            )
            return
        try:
            import resource  # POSIX only
        except ImportError:
            metrics.mark_na("peak_memory_bytes", "no getrusage on this platform")
            return
        metrics.put(
            "peak_memory_bytes",
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "process peak RSS since start (getrusage)",
        )
