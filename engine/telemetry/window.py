"""Kernel gap (CUDA) or op gap (CPU) from a short torch.profiler window of decode steps.

The decode loop calls `step_begin(step)` / `step_end(step)` around every step; the window traces steps
`start .. start+steps-1` only, so the profiler's cost falls on a few steps that the engine leaves out of
tokens/s. `finish()` turns the trace into a `WindowStats`.

Which span the gap is measured over: the host wall time of the window, read with `perf_counter` after a
device synchronisation at both ends (the profiler is started after the first sync and stopped after the
second). Device work queued before the window has drained when the clock starts, and all work of the window
has finished when it stops, so the span is exactly the time the device had to do the window's work. Taking
first kernel start -> last kernel end instead would hide the idle time before the first launch and after the
last one, which is where a host-bound decode loop (a `.item()` sync per token, Python between launches)
spends it. Should the trace's own extent exceed the host span (the trace clock and perf_counter are separate
clocks), the extent is used so busy time can never exceed the span.

The CUDA analysis reads the chrome-trace JSON that `prof.export_chrome_trace` writes, tested on hand-written
traces in kineto's format (`"ph": "X", "cat": "kernel", "ts", "dur", "args": {"grid": [x, y, z], "block":
[...], "device": N}`). A CPU window reads the profiler's results directly instead (`_cpu_op_intervals`):
a decode step of a small model is thousands of aten ops, and writing them out as JSON and parsing it back held
the interpreter lock for 0.15-0.35 s at the end of every answer, a stall of the GUI thread. The op intervals
are the same either way (tested); where the results cannot be read directly, the JSON route is taken.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from engine.telemetry.quiet import native_stderr_filtered
from engine.telemetry.stats import device_sync_fn, gap_fraction, merge_intervals

log = logging.getLogger(__name__)

# Device-side activity in kineto's chrome trace (libkineto ActivityType names).
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
COPY_CATEGORIES = ("gpu_memcpy", "gpu_memset")
# A range around a CPU window on its own thread: the profiler's results name threads by their own ids, and this
# marker's id is the window thread's.
WINDOW_MARKER = "gapless::profile_window"
# What a CPU window counts as an op: torch's, and the project's own CPU kernels, which mark their calls with a
# record_function of this prefix while a profiler runs (engine/cpu_kernels.py). The marker itself is not an op.
CPU_OP_PREFIXES = ("aten::", "gapless::kernel::")


@dataclass(frozen=True)
class WindowStats:
    steps: int  # decode steps traced
    span_us: float  # the span the gap is measured over (see the module docstring)
    busy_us: float  # union of device intervals (CUDA) or aten op intervals (CPU)
    gap_pct: Optional[float]  # 100 * (1 - busy / span); None when the trace held no events
    gap_source: str
    events: int  # kernels/memcpys/memsets (CUDA) or top-level aten ops (CPU)
    sm_activity_est_pct: Optional[float]  # CUDA only: sum(dur * min(1, blocks / SMs)) / span
    sm_activity_source: Optional[str]  # the estimate's label, or why there is none
    bytes_per_step: Optional[float]  # CUDA: bytes of memcpy/memset per step (kernels' own reads are not traced)
    # What the host had the device run per decode step: kernels (CUDA; a CUDA graph's replayed kernels count
    # each) or top-level aten ops (CPU). Many tiny ones per token is why a small model is slow.
    launches_per_step: Optional[float] = None
    launches_source: Optional[str] = None


def profiler_busy() -> bool:
    """True when a torch profiler is already recording in this process. A second one would start silently and
    its stop would end the first one's session, so the window refuses to start instead."""
    return (
        bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False)) or torch._C._autograd._profiler_enabled()
    )


# The profiler is one per process: two windows started from two threads at once (two engines in one process)
# both pass the `profiler_busy()` check and crash kineto when they stop. This lock makes the second one skip.
_ONE_WINDOW = threading.Lock()


def warm_up_profiler(device: torch.device) -> None:
    """Pay the profiler's one-time initialisation (about 1-2 s on the first start in a process) now, e.g.
    while a model loads, instead of inside the first generation's window."""
    if not _ONE_WINDOW.acquire(blocking=False):
        return
    try:
        if profiler_busy():
            return
        with native_stderr_filtered(), torch.profiler.profile(activities=_activities(torch.device(device))):
            pass
    finally:
        _ONE_WINDOW.release()


def _activities(device: torch.device) -> list:
    # CUDA activity only on a GPU: recording every CPU op as well would add host overhead between launches
    # and so inflate the very gap being measured.
    if device.type == "cuda":
        return [torch.profiler.ProfilerActivity.CUDA]
    return [torch.profiler.ProfilerActivity.CPU]


class ProfileWindow:
    def __init__(
        self, device: torch.device, start: int = 8, steps: int = 8, enabled: bool = True, sm_count: Optional[int] = None
    ):
        if start < 0 or steps < 1:
            raise ValueError(f"profile window needs start >= 0 and steps >= 1, got start={start}, steps={steps}")
        self.device = torch.device(device)
        self.start = start
        self.steps = steps
        self.enabled = enabled
        self.sm_count = sm_count
        self._last = start + steps - 1
        self._prof: Optional[torch.profiler.profile] = None
        self._running = False
        self._t0 = 0.0
        self._t_end: Optional[float] = None
        self._last_step_t: Optional[float] = None
        self._last_step = -1
        self._tid: Optional[int] = None
        self._marker: Optional[torch.profiler.record_function] = None
        self._sync = device_sync_fn(self.device)
        self.skipped: Optional[str] = None  # why the window traced nothing, when it was reached but did not start
        if enabled and self.device.type == "cuda":
            # One profiler session per generation: keep CUPTI set up between them. Tearing it down after each
            # and initialising it again is what torch itself avoids when CUDA graphs are in play (re-inits after a
            # teardown have crashed, or recorded no kernels, with graphs); kineto reads this before its first use.
            os.environ.setdefault("TEARDOWN_CUPTI", "0")

    def in_window(self, step: int) -> bool:
        return self.enabled and self.start <= step <= self._last

    @property
    def tracing(self) -> bool:
        """The profiler is recording this window's steps now."""
        return self._running

    def _skip(self, reason: str) -> None:
        self.skipped = reason
        log.warning("profile window skipped: %s", reason)

    def step_begin(self, step: int) -> None:
        if not self.enabled or step != self.start or self._prof is not None:
            return
        if not _ONE_WINDOW.acquire(blocking=False):
            self._skip("another generation in this process is being profiled")
            return
        if profiler_busy():
            _ONE_WINDOW.release()
            self._skip("another torch profiler is running in this process")
            return
        prof = torch.profiler.profile(activities=_activities(self.device))
        self._sync()
        try:
            with native_stderr_filtered():
                prof.__enter__()
        except Exception as exc:  # e.g. kineto or CUPTI refusing to start; the lock must not stay held
            _ONE_WINDOW.release()
            self._skip(f"the profiler could not start: {exc}")
            return
        self._prof = prof
        self._running = True
        self._tid = threading.get_native_id()
        if self.device.type == "cpu":
            self._marker = torch.profiler.record_function(WINDOW_MARKER)
            self._marker.__enter__()
        self._t0 = time.perf_counter()

    def step_end(self, step: int) -> None:
        if not self._running or not self.in_window(step):
            return
        self._last_step = step
        if step == self._last:
            self._stop(synced_end=True)
        else:
            self._last_step_t = time.perf_counter()

    def _stop(self, synced_end: bool) -> None:
        if synced_end:
            self._sync()
            self._t_end = time.perf_counter()
        else:
            # Generation ended inside the window: the span ends at the last completed step, not at whatever
            # the caller did after it; the trace extent guards against device work still running then.
            self._t_end = self._last_step_t if self._last_step_t is not None else time.perf_counter()
        self._running = False
        assert self._prof is not None
        try:
            if self._marker is not None:
                marker, self._marker = self._marker, None
                marker.__exit__(None, None, None)
            with native_stderr_filtered():
                self._prof.__exit__(None, None, None)
        finally:
            _ONE_WINDOW.release()

    def discard(self) -> None:
        """Stop a window that a failed generation left open, without analysing it. Called while that failure
        propagates, so a profiler that will not stop cleanly is logged rather than raised over it."""
        try:
            if self._running:
                self._stop(synced_end=False)
        except RuntimeError as exc:
            log.warning("profile window: the profiler did not stop cleanly after a failed generation: %s", exc)
        finally:
            self._release()

    def _release(self) -> None:
        """Let go of the trace now. torch.profiler.profile sits in a reference cycle (its action map holds its
        own bound methods), so the results it holds would wait for a full garbage collection: ~2 MB per window
        on a tiny model, and the process grew by 100 MB over a few hundred generations."""
        if self._prof is not None:
            self._prof.profiler = None
        self._prof = None

    def finish(self) -> Optional[WindowStats]:
        """Stop the profiler if it is still running and analyse the window; None if it never started."""
        if self._prof is None:
            return None
        if self._running:
            self._stop(synced_end=False)
        assert self._t_end is not None
        steps = self._last_step - self.start + 1 if self._last_step >= self.start else 0
        span_us = (self._t_end - self._t0) * 1e6
        if self.device.type == "cpu":
            ops = _cpu_op_intervals(self._prof)
            if ops is not None:
                self._release()
                starts, ends, own = ops
                return _analyse_cpu_ops(starts, ends, span_us, steps, own)
        trace = _export_trace(self._prof)
        self._release()
        if trace is None:
            self.skipped = "the trace could not be exported or read (details in the log)"
            return None
        return analyse_trace(
            trace,
            device=self.device,
            span_us=span_us,
            steps=steps,
            sm_count=self.sm_count if self.sm_count is not None else _sm_count(self.device),
            tid=self._tid,
        )


def _cpu_op_intervals(prof: torch.profiler.profile) -> Optional[tuple[np.ndarray, np.ndarray, bool]]:
    """Starts and ends (µs) of the ops of the window's thread (CPU_OP_PREFIXES), and whether the project's own
    kernels are among them, read from the profiler's results without the JSON round trip (a CPU window records CPU
    activity only); None when this torch's results cannot be read so, or the marker is missing."""
    try:
        if prof.profiler is None or prof.profiler.kineto_results is None:
            raise AttributeError("the profiler kept no results")
        events = prof.profiler.kineto_results.events()
        names = [e.name() for e in events]
        threads = [e.start_thread_id() for e in events]
        starts = np.fromiter((e.start_ns() for e in events), dtype=np.int64, count=len(events))
        durs = np.fromiter((e.duration_ns() for e in events), dtype=np.int64, count=len(events))
    except (AttributeError, RuntimeError, TypeError) as exc:
        log.info("profile window: reading the results directly failed (%s); exporting the trace instead", exc)
        return None
    try:
        thread = threads[names.index(WINDOW_MARKER)]
    except ValueError:
        return None
    keep = np.fromiter(
        (t == thread and n.startswith(CPU_OP_PREFIXES) for n, t in zip(names, threads)), dtype=bool, count=len(names)
    )
    own = any(k and not n.startswith("aten::") for k, n in zip(keep, names))
    starts, durs = starts[keep], np.maximum(durs[keep], 0)
    if starts.size:
        starts = starts - starts.min()  # nanoseconds since the epoch would lose sub-microsecond detail as floats
    return starts / 1000.0, (starts + durs) / 1000.0, own


def _export_trace(prof: torch.profiler.profile) -> Optional[dict]:
    fd, path = tempfile.mkstemp(prefix="gapless-window-", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, RuntimeError) as exc:
        log.warning("profile window: the trace could not be exported or read: %s", exc)
        return None
    finally:
        try:
            os.unlink(path)
        except OSError as exc:
            log.debug("profile window: temporary trace %s not removed: %s", path, exc)


def _sm_count(device: torch.device) -> Optional[int]:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return None


def _device_index(device: torch.device) -> Optional[int]:
    if device.type != "cuda":
        return None
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def analyse_trace(
    trace: dict[str, Any],
    device: torch.device,
    span_us: Optional[float],
    steps: int,
    sm_count: Optional[int] = None,
    tid: Optional[int] = None,
) -> WindowStats:
    """Gap, event count and (CUDA) SM estimate and copy bytes of a chrome trace of `steps` decode steps.

    CUDA: device events (kernels, memcpy, memset) of this device. CPU: `aten::` ops and the own kernels' marked
    calls of thread `tid`; ops nest (aten::linear contains aten::addmm), and merging all their intervals counts
    each moment once.
    """
    device = torch.device(device)
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    if device.type == "cuda":
        return _analyse_cuda(trace, events, _device_index(device), span_us, steps, sm_count)
    return _analyse_cpu(events, span_us, steps, tid)


def _interval(e: dict) -> tuple[float, float]:
    ts = float(e["ts"])
    return ts, ts + max(0.0, float(e.get("dur", 0.0)))


def _span(intervals: list[tuple[float, float]], span_us: Optional[float]) -> tuple[float, bool]:
    """The span to divide by, and whether the host span had to give way to the trace extent."""
    merged = merge_intervals(intervals)
    extent = merged[-1][1] - merged[0][0] if merged else 0.0
    if span_us is None or span_us < extent:
        return extent, True
    return span_us, False


def _gap(intervals: list[tuple[float, float]], span: float) -> tuple[float, Optional[float]]:
    """Busy time and gap in percent; `span` is at least the events' extent (see `_span`)."""
    merged = merge_intervals(intervals)
    busy = sum(e - s for s, e in merged)
    if not merged or span <= 0:
        return busy, None
    frac = gap_fraction(merged, (merged[0][0], merged[0][0] + span))
    return busy, None if frac is None else 100.0 * frac


def _analyse_cuda(
    trace: dict, events: list[dict], index: Optional[int], span_us: Optional[float], steps: int, sm_count: Optional[int]
) -> WindowStats:
    dev_events = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "ts" in e]
    if index is not None:  # several GPUs in the trace: keep ours (events without a device field are kept)
        dev_events = [e for e in dev_events if (e.get("args") or {}).get("device", index) == index]
    intervals = [_interval(e) for e in dev_events]
    span, fell_back = _span(intervals, span_us)
    busy, gap = _gap(intervals, span)
    label = f"kernel gap — torch.profiler, {steps}-step window (sampled)"
    if fell_back:
        label += ", span = first to last device event"

    if sm_count is None:
        sm_count = _trace_sm_count(trace, index)
    kernels = [e for e in dev_events if e.get("cat") == "kernel"]
    sm_est: Optional[float] = None
    if not kernels:
        sm_src = "SM activity estimate: no kernels in the profiler window"
    elif sm_count is None or sm_count <= 0:
        sm_src = "SM activity estimate: SM count unknown"
    elif any(not _dims_ok((e.get("args") or {}).get("grid")) for e in kernels):
        sm_src = "SM activity estimate: kernel grid sizes missing from the trace"
    elif span <= 0:
        sm_src = "SM activity estimate: empty profiler window"
    else:
        weighted = 0.0
        for e in kernels:
            gx, gy, gz = (e.get("args") or {})["grid"]
            blocks = int(gx) * int(gy) * int(gz)
            s, t = _interval(e)
            weighted += (t - s) * min(1.0, blocks / sm_count)
        sm_est = min(100.0, 100.0 * weighted / span)
        sm_src = f"SM activity — estimate from the profiler window (kernel time × min(1, blocks/{sm_count} SMs))"

    copies = [e for e in dev_events if e.get("cat") in COPY_CATEGORIES]
    copy_bytes = [b for b in ((e.get("args") or {}).get("bytes") for e in copies) if isinstance(b, (int, float))]
    bytes_per_step: Optional[float] = None
    if copies and steps > 0 and len(copy_bytes) == len(copies):  # every copy says its size
        bytes_per_step = float(sum(copy_bytes)) / steps
    launches = len(kernels) / steps if steps > 0 and kernels else None
    return WindowStats(
        steps,
        span,
        busy,
        gap,
        label,
        len(dev_events),
        sm_est,
        sm_src,
        bytes_per_step,
        launches,
        f"kernels per step — torch.profiler, {steps}-step window (sampled)" if launches else None,
    )


def _dims_ok(dims: Any) -> bool:
    return isinstance(dims, (list, tuple)) and len(dims) == 3 and all(isinstance(d, int) and d > 0 for d in dims)


def _trace_sm_count(trace: dict, index: Optional[int]) -> Optional[int]:
    for props in trace.get("deviceProperties") or []:
        if isinstance(props, dict) and (index is None or props.get("id") == index):
            n = props.get("numSms")
            if isinstance(n, int) and n > 0:
                return n
    return None


def _analyse_cpu(events: list[dict], span_us: Optional[float], steps: int, tid: Optional[int]) -> WindowStats:
    ops = [
        e
        for e in events
        if e.get("cat") in ("cpu_op", "user_annotation")
        and str(e.get("name", "")).startswith(CPU_OP_PREFIXES)
        and "ts" in e
        and (tid is None or e.get("tid") == tid)
    ]
    intervals = np.array([_interval(e) for e in ops], dtype=np.float64).reshape(-1, 2)
    own = any(not str(e["name"]).startswith("aten::") for e in ops)
    return _analyse_cpu_ops(intervals[:, 0], intervals[:, 1], span_us, steps, own)


def op_union(starts: np.ndarray, ends: np.ndarray) -> tuple[float, float, float, int]:
    """(busy, first start, last end, top-level ops) of op intervals: busy is the length of their union with
    zero-length ones dropped (as `merge_intervals`); a top-level op is one not inside an earlier op's interval,
    ties in start taken longest first. Vectorised: a CPU window holds tens of thousands of ops."""
    if starts.size == 0:
        return 0.0, 0.0, 0.0, 0
    order = np.lexsort((-ends, starts))
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)  # the furthest end so far
    before = np.concatenate(([-np.inf], reach[:-1]))
    top = int(np.count_nonzero(s >= before))
    pos = e > s
    if not pos.any():
        return 0.0, 0.0, 0.0, top
    s, e = s[pos], e[pos]
    reach = np.maximum.accumulate(e)
    new_run = s > np.concatenate(([-np.inf], reach[:-1]))  # touching intervals merge, as merge_intervals
    first = np.flatnonzero(new_run)
    last = np.concatenate((first[1:] - 1, [s.size - 1]))
    busy = float(np.sum(reach[last] - s[first]))
    return busy, float(s[0]), float(reach[-1]), top


def _analyse_cpu_ops(
    starts: np.ndarray, ends: np.ndarray, span_us: Optional[float], steps: int, own_kernels: bool = False
) -> WindowStats:
    """Op gap and top-level op count of a CPU window's ops (µs); `own_kernels`: the project's kernels are among
    them."""
    busy, first, last, top = op_union(starts, ends)
    extent = last - first
    span = span_us if span_us is not None and span_us >= extent else extent
    fell_back = span != span_us
    gap = None if busy == 0.0 or span <= 0 else 100.0 * max(0.0, 1.0 - busy / span)
    label = f"op gap — torch.profiler CPU ops, {steps}-step window (sampled)"
    if fell_back:
        label += ", span = first to last op"
    launches = top / steps if steps > 0 and top else None
    counted = "aten and own-kernel ops" if own_kernels else "aten ops"
    source = f"{counted} per step — torch.profiler CPU ops, {steps}-step window (sampled)" if launches else None
    return WindowStats(steps, span, busy, gap, label, top, None, None, None, launches, source)
