"""One generation: prefill, the decode loop, streaming, and the metrics of what happened.

The loop is the same for every option; the runner decides how a step is computed (kv mode, compile, graph),
`host_sync` decides whether the host reads every token (.item()) or reads copies a few steps behind.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from engine.decode import RunnerBase
from engine.sampling import SamplerKind
from engine.speculative import Speculator
from engine.stream import Readback, RowText, StepClock
from engine.telemetry.monitor import estimate_dram_bw_util
from engine.telemetry.stats import percentile
from engine.types import GenerationMetrics, RowFinished, StepRecord, TextDelta

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 1 / 30  # text and step records leave at most this often
MONITOR_INTERVAL_S = 0.1
READBACK_EVERY = 8  # device sampling on CUDA: steps between copies to the host (on a CPU a copy costs no sync)


@dataclass
class LoopResult:
    rows: list[RowText]
    metrics: GenerationMetrics
    notices: list[str] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_loop(
    runner: RunnerBase,
    prompt: torch.Tensor,  # [T] long on the device
    kind: SamplerKind,
    max_new: int,
    host_sync: bool,
    rows: list[RowText],
    device: torch.device,
    on_event: Callable,
    cancel: threading.Event,
    window=None,  # engine.telemetry.window.ProfileWindow or None
    monitor=None,  # engine.telemetry.monitor.Monitor or None
    spec: Optional[Speculator] = None,  # speculative decoding (batch 1, static cache) or None
    prefill: Optional[Callable] = None,  # (prompt, kind) -> None in place of runner.prefill (engine.prefix)
) -> LoopResult:
    B = runner.batch
    now = time.perf_counter
    clock = StepClock(device)
    readback = None if host_sync or spec is not None else Readback(runner.out)
    readback_every = READBACK_EVERY if device.type == "cuda" else 1
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if monitor is not None:
        monitor.drain()  # samples from before this generation are not its own

    _sync(device)
    t_start = now()
    (prefill or runner.prefill)(prompt, kind)
    clock.mark()
    if host_sync or spec is not None:
        first = runner.tok.view(-1).tolist()  # the per-token host sync of this mode
        for r, t in zip(rows, first):
            r.feed([t])
    else:
        readback.issue(1)
        readback.poll(wait=True)
        for r, col in zip(rows, readback.columns(0, 1)):
            r.feed(col)
    t_first = now()
    seen = 1  # tokens per row the host has read

    window_steps: set[int] = set()
    window_s = 0.0
    t_window0: Optional[float] = None  # set while the traced window is open
    last_flush = t_first
    last_monitor = t_first
    records_from = 1
    ended: set[int] = set()  # rows whose end was reported
    step = 0
    produced = 1  # tokens per row the device has written
    token_step = [0]  # token index -> the step that made it (0: the prefill)
    cancelled = False
    if spec is not None:
        spec.start(prompt.tolist() + rows[0].tokens)
    while produced < max_new:
        if all(r.finish is not None for r in rows):
            break
        if cancel.is_set():
            cancelled = True
            break
        step += 1
        in_window = False
        if window is not None and window.in_window(step):
            if step == window.start:
                _sync(device)
                t_open = now()
                window.step_begin(step)
                t_window0 = t_open if window.tracing else None
            # Only steps the profiler records are slowed by it, and only those are left out of tok/s.
            in_window = window.tracing
            if in_window:
                window_steps.add(step)
        if spec is None:
            runner.step(step)
            made = 1
        else:
            new = spec.step(runner, max_new - produced)
            made = len(new)
        if in_window:
            window.step_end(step)
            if not window.in_window(step + 1):
                _sync(device)
                window_s += now() - t_window0
                t_window0 = None
        clock.mark()
        made = min(made, max_new - produced)
        token_step.extend([step] * made)
        if spec is not None:  # the host reads every step's tokens: the next drafts follow from them
            new = new[:made]
            rows[0].feed(new)
            spec.accepted(new)
            produced += made
            seen = produced
        elif host_sync:
            produced += 1
            if B == 1:
                toks = [runner.tok.item()]
            else:
                toks = runner.tok.view(-1).tolist()
            for r, t in zip(rows, toks):
                r.feed([t])
            seen = produced
        else:
            produced += 1
            if step % readback_every == 0:
                readback.issue(produced)
                visible = readback.poll()
                if visible > seen:
                    for r, col in zip(rows, readback.columns(seen, visible)):
                        r.feed(col)
                    seen = visible
        t = now()
        if t - last_flush >= FLUSH_INTERVAL_S:
            _emit_text(rows, on_event, ended)
            records_from = _emit_steps(
                clock, records_from, _steps_seen(token_step, seen), rows, on_event, window_steps, token_step
            )
            last_flush = t
        if monitor is not None and t - last_monitor >= MONITOR_INTERVAL_S:
            for s in monitor.drain():
                on_event(s)
            last_monitor = t
    steps_done = step
    _sync(device)
    t_end = now()
    if t_window0 is not None:  # the generation ended inside the window
        window_s += t_end - t_window0
    if window is not None:
        stats = window.finish()
    else:
        stats = None
    if readback is not None:
        readback.issue(produced)
        visible = readback.poll(wait=True)
        if visible > seen:
            for r, col in zip(rows, readback.columns(seen, visible)):
                r.feed(col)
    for r in rows:
        if r.finish is None:
            r.finish = "cancelled" if cancelled else "length"
    _emit_text(rows, on_event, ended, final=True)
    _emit_steps(clock, records_from, steps_done + 1, rows, on_event, window_steps, token_step)
    if monitor is not None:
        for s in monitor.drain():
            on_event(s)

    metrics = GenerationMetrics(prompt_tokens=int(prompt.numel()))
    metrics.new_tokens = [len(r.tokens) for r in rows]
    metrics.new_tokens_total = sum(metrics.new_tokens)
    prefill_s = t_first - t_start
    metrics.ttft_ms = prefill_s * 1e3
    metrics.prefill_tok_s = metrics.prompt_tokens / prefill_s if prefill_s > 0 else None
    # Decode throughput: tokens made by decode steps outside the traced window, over the synchronised wall time
    # of the decode loop less the window.
    decode_tokens = sum(sum(1 for s in token_step[1 : len(r.tokens)] if s not in window_steps) for r in rows)
    decode_s = (t_end - t_first) - window_s
    metrics.decode_steps = steps_done
    metrics.profiled_steps = len(window_steps)
    metrics.decode_seconds = decode_s if steps_done else None
    metrics.decode_tok_s = decode_tokens / decode_s if steps_done and decode_s > 0 and decode_tokens else None
    kept = sum(len(r.tokens) for r in rows) - B  # decode steps' tokens the rows kept (the first is the prefill's)
    if steps_done:
        metrics.put("tokens_per_step", kept / B / steps_done)
    else:
        metrics.mark_na("tokens_per_step", "no decode step ran")
    _fill_speculation(metrics, spec)
    durations = [d for i, d in enumerate(clock.durations_s(steps_done + 1), start=1) if i not in window_steps]
    if durations:
        metrics.step_ms_p50 = percentile(durations, 50) * 1e3
        metrics.step_ms_p90 = percentile(durations, 90) * 1e3
        metrics.step_ms_p99 = percentile(durations, 99) * 1e3
    if device.type == "cuda":
        metrics.put(
            "peak_memory_bytes",
            int(torch.cuda.max_memory_allocated(device)),
            "torch.cuda.max_memory_allocated (this generation)",
        )
    else:
        try:
            import resource  # POSIX only

            metrics.put(
                "peak_memory_bytes",
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "process peak RSS since start (getrusage)",
            )
        except ImportError:
            metrics.mark_na("peak_memory_bytes", "no getrusage on this platform")
    _fill_telemetry(metrics, stats, window, monitor, runner, device, t_start, t_end, durations, prompt.numel())
    return LoopResult(rows=rows, metrics=metrics)


def _emit_text(rows: list[RowText], on_event: Callable, ended: set[int], final: bool = False) -> None:
    """Each row's new text; a row that has finished since the last call also says so (`ended` holds those
    that have)."""
    for i, r in enumerate(rows):
        delta = r.take_delta(final=final)
        if delta:
            on_event(TextDelta(candidate=i, text=delta))
        if r.finish is not None and i not in ended:
            ended.add(i)
            on_event(RowFinished(candidate=i, reason=r.finish))


def _steps_seen(token_step: list[int], seen: int) -> int:
    """The step bound [1, n) of the tokens the host has read: steps up to the one that made token seen - 1."""
    return token_step[min(seen, len(token_step)) - 1] + 1


def _emit_steps(clock: StepClock, start: int, upto: int, rows, on_event, window_steps, token_step: list[int]) -> int:
    """One StepRecord for the steps [start, upto) whose timings are known; returns the next start."""
    if upto <= start:
        return start
    durations = clock.durations_s(upto)[start - 1 :]
    if not durations:
        return start
    made_by = bisect.bisect_right(token_step, upto - 1)  # tokens per row made by steps before `upto`
    made_before = bisect.bisect_right(token_step, start - 1)
    tokens = sum(min(len(r.tokens), made_by) for r in rows)
    on_event(
        StepRecord(
            t=time.perf_counter(),
            step=upto - 1,
            tokens_total=tokens,
            step_ms=1e3 * sum(durations) / len(durations),
            profiled=any(s in window_steps for s in range(start, upto)),
            tokens_per_step=(made_by - made_before) / (upto - start),
        )
    )
    return upto


def _fill_speculation(metrics: GenerationMetrics, spec: Optional[Speculator]) -> None:
    names = ("drafted_tokens", "accepted_tokens", "verify_steps", "acceptance_rate")
    if spec is None:
        for name in names:
            metrics.mark_na(name, "speculation off")
        return
    c = spec.counts
    for name, value in zip(names, (c.drafted, c.accepted, c.verify_steps)):
        metrics.put(name, value, spec.source)
    if c.drafted:
        metrics.put("acceptance_rate", c.accepted / c.drafted, spec.source)
    else:
        metrics.mark_na("acceptance_rate", "nothing was drafted in this answer (no proposal, or it ended first)")


def _fill_telemetry(
    metrics: GenerationMetrics, stats, window, monitor, runner, device, t0, t1, durations, prompt_len
) -> None:
    if stats is not None and stats.gap_pct is not None:
        metrics.put("kernel_gap_pct", stats.gap_pct, stats.gap_source)
    elif window is None or not window.enabled:
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
            "launches_per_step", metrics.unavailable.get("kernel_gap_pct") or "no kernels or ops traced in the window"
        )
    summary = monitor.summary(t0, t1) if monitor is not None else {}
    for name in ("gpu_util_pct", "sm_activity_pct", "dram_bw_util_pct"):
        value, source = summary.get(name, (None, "no monitor"))
        if value is not None:
            metrics.put(name, value, source)
        else:
            metrics.mark_na(name, source)
    if metrics.sm_activity_pct is None and stats is not None and stats.sm_activity_est_pct is not None:
        metrics.put("sm_activity_pct", stats.sm_activity_est_pct, stats.sm_activity_source)
    peak_bw = getattr(monitor, "peak_dram_bw_bytes_s", None) if monitor is not None else None
    if metrics.dram_bw_util_pct is None and peak_bw and durations and device.type == "cuda":
        # The median step against the bytes a step reads halfway through the answer (weights + KV attended
        # there). Not capped: above 100 % says the estimate's premise (every byte read from DRAM) does not hold.
        value, source = estimate_dram_bw_util(
            runner.bytes_per_step(prompt_len + metrics.decode_steps // 2), percentile(durations, 50), peak_bw
        )
        if value is not None:
            metrics.put("dram_bw_util_pct", value, source)
