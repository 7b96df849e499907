"""One generation: prefill, the decode loop, and the metrics of what happened.

The loop is the same for every option; the runner decides how a step is computed (kv mode, compile, graph), the
speculator (when on) what a step verifies. Everything around a step — reading tokens back, streaming text and
step records, passing monitor samples on, the profiler window — is a StepObserver (engine.observers).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from engine import figures
from engine.decode import RunnerBase
from engine.observers import LoopState, Reader, StepObserver, sync
from engine.sampling import SamplerKind
from engine.speculative import Speculator, speculation_off
from engine.stream import RowText, StepClock
from engine.telemetry.stats import percentile
from engine.types import GenerationMetrics

log = logging.getLogger(__name__)

NOT_REMOTE = "a local model: measured only on a remote server's answers"  # why the REMOTE_ONLY figures are n/a


@dataclass
class LoopResult:
    rows: list[RowText]
    metrics: GenerationMetrics


def run_loop(
    runner: RunnerBase,
    prompt: torch.Tensor,  # [T] long on the device
    kind: SamplerKind,
    max_new: int,
    rows: list[RowText],
    cancel: threading.Event,
    observers: Sequence[StepObserver],  # called in this order; exactly one is a Reader (engine.observers)
    spec: Optional[Speculator] = None,  # speculative decoding (batch 1, static cache, a HostReader) or None
    prefill: Optional[Callable[[torch.Tensor, SamplerKind], None]] = None,  # in place of runner.prefill (engine.prefix)
) -> LoopResult:
    readers = [o for o in observers if isinstance(o, Reader)]
    if len(readers) != 1:
        raise ValueError(f"a generation needs one reader of its tokens among its observers, got {len(readers)}")
    watchers = [*observers, spec] if spec is not None else list(observers)
    run = LoopState(runner, prompt, rows, max_new, StepClock(runner.device))

    for o in watchers:
        o.on_start(run)
    sync(run.device)
    run.t_start = time.perf_counter()
    (prefill or runner.prefill)(prompt, kind)
    _stepped(run, watchers, None)
    while not run.finished():
        if cancel.is_set():
            run.cancelled = True
            break
        run.step += 1
        for o in watchers:
            o.before_step(run)
        if spec is None:
            runner.step(run.step)
            tokens = None  # one per row, on the device
        else:
            tokens = spec.step(runner, max_new - run.produced)
        for o in watchers:
            o.after_step(run)
        _stepped(run, watchers, tokens)
    sync(run.device)
    run.t_end = time.perf_counter()
    for o in watchers:
        o.on_finish(run)

    metrics = _metrics(run)
    if spec is None:
        speculation_off(metrics)
    for o in watchers:
        o.fill(run, metrics)
    return LoopResult(rows=rows, metrics=metrics)


def _stepped(run: LoopState, watchers: list[StepObserver], tokens: Optional[list[int]]) -> None:
    run.advance(tokens)
    for o in watchers:
        o.on_step(run)


def _metrics(run: LoopState) -> GenerationMetrics:
    """The figures of the loop itself: tokens, time to the first token, decode throughput and step times."""
    rows, steps = run.rows, run.step
    metrics = GenerationMetrics(prompt_tokens=int(run.prompt.numel()))
    for key in figures.REMOTE_ONLY:
        metrics.mark_na(key, NOT_REMOTE)
    metrics.new_tokens = [len(r.tokens) for r in rows]
    metrics.new_tokens_total = sum(metrics.new_tokens)
    prefill_s = run.t_first - run.t_start
    metrics.ttft_ms = prefill_s * 1e3
    metrics.prefill_tok_s = metrics.prompt_tokens / prefill_s if prefill_s > 0 else None
    # Decode throughput: tokens made by decode steps outside the traced window, over the synchronised wall time
    # of the decode loop less the window.
    decode_tokens = sum(sum(1 for s in run.token_step[1 : len(r.tokens)] if s not in run.profiled) for r in rows)
    decode_s = (run.t_end - run.t_first) - run.profiled_s
    metrics.decode_steps = steps
    metrics.profiled_steps = len(run.profiled)
    none_ran = "no decode step ran: the answer ended at its first token"
    untimed = none_ran if not steps else "every decode step was in the traced window"
    if steps:
        metrics.decode_seconds = decode_s
    else:
        metrics.mark_na("decode_seconds", none_ran)
    if steps and decode_s > 0 and decode_tokens:
        metrics.decode_tok_s = decode_tokens / decode_s
    else:
        metrics.mark_na("decode_tok_s", untimed)
    per_step = run.kept_per_step(1, steps + 1) if steps else None
    if per_step is not None:
        metrics.put("tokens_per_step", per_step)
    else:
        metrics.mark_na("tokens_per_step", none_ran if not steps else "every row ended at its first token")
    durations = run.durations_s()
    for q in (50, 90, 99):
        value = percentile(durations, q)  # None: no decode step outside the window
        if value is not None:
            metrics.put(f"step_ms_p{q}", value * 1e3)
        else:
            metrics.mark_na(f"step_ms_p{q}", untimed)
    return metrics
