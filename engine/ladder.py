"""The optimization ladder: every preset of `engine.types.PRESETS` run through the engine facade on one prompt.

Each rung gets warm-up generations first (compile, capture and the profiler's first start happen there), then
`repeats` timed greedy generations whose figures are the engine's own device-synchronised metrics; a rung's
figure is the median over repeats. `run_ladder` is the app's "Run ladder"; engine/bench.py runs the same rungs
with the transformers baseline for `gapless bench`.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Optional

import torch

from engine.errors import GaplessError
from engine.figures import GENERATION_FIGURES
from engine.types import (
    PRESET_LABELS,
    PRESETS,
    EngineOptions,
    LadderRow,
    SamplingParams,
    preset_options,
)

log = logging.getLogger(__name__)

DEFAULT_PROMPT = (
    "Write a detailed essay on the history of computing, from the abacus and mechanical calculators to "
    "transistors, personal computers and today's GPUs."
)
DEFAULT_CANDIDATES = 4
COMPILED_RUNGS = ("compile", "cuda-graph")
# rungs whose own optimisation is not compile or graphs: they run without those where this bench lacks them
RELAXED_RUNGS = ("int8", "candidates", "speculation")
# Figures reduced to a median over the repeats of a rung: every per-generation figure of the registry.
MEDIAN_FIELDS = tuple(f.key for f in GENERATION_FIGURES)
SOURCE_FIELDS = tuple(f.source_field for f in GENERATION_FIGURES if f.source_field)
# the spread of decode tok/s over a rung's (or the baseline's) timed repeats
SPREAD_SOURCES = {
    "decode_tok_s_min": "the lowest decode_tok_s of the timed repeats",
    "decode_tok_s_max": "the highest decode_tok_s of the timed repeats",
}

Progress = Callable[[str], None]


@dataclass(frozen=True)
class BenchConfig:
    model: str = "default"
    device: str = "auto"
    max_new_tokens: int = 128
    repeats: int = 3
    warmup: int = 1
    presets: tuple[str, ...] = tuple(PRESETS)
    candidates: Optional[int] = None  # N of the candidates rung (default 4)
    kernels: Optional[str] = None  # the candidates rung's kernels; None: as its preset (torch, compiled)
    baseline: bool = True
    compile: Optional[bool] = None  # None: on with CUDA, off on the CPU (a cold compile takes minutes there)
    interleave: Optional[bool] = None  # rounds over all rungs and the baseline; None: on the CPU only
    prompt: str = DEFAULT_PROMPT
    profile_window: bool = True
    speculation: str = "ngram"  # how the speculation rung drafts
    draft_tokens: int = 0
    draft_model: str = ""
    # Off: every timed run reads the whole prompt, in every rung alike, so TTFT and prefill compare rungs. On
    # (--prefix-reuse): a run reuses what the run before it left in the cache, which depends on the order of the
    # rungs (a change of KV cache drops it); prompt_reused_tokens says how much, and the table notes it.
    prefix_reuse: bool = False


def measured(value: Any) -> bool:
    """A run's figure counts: not None, and a finite number (a NaN sorts anywhere, so a median with one in it
    depended on the order of the runs)."""
    return value is not None and math.isfinite(float(value))


def median(values) -> Optional[float]:
    """Median of the values measured (not None, finite); None when there are none."""
    xs = [float(v) for v in values if measured(v)]
    return statistics.median(xs) if xs else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or not b > 0:
        return None
    return a / b


def partial_figures(runs: list[dict[str, Any]], medians: dict[str, Any], keys: Iterable[str]) -> dict[str, str]:
    """For each figure of `keys` that has a median but was n/a in some of `runs`: in how many runs it was measured
    (its median is of those) and why the others have none, as the first of them said."""
    out: dict[str, str] = {}
    for key in keys:
        missing = [r for r in runs if not measured(r.get(key))]
        if medians.get(key) is None or not missing:
            continue
        why = next((r["unavailable"][key] for r in missing if (r.get("unavailable") or {}).get(key)), None)
        others = "the other" if len(missing) == 1 else f"the other {len(missing)}"
        out[key] = f"measured in {len(runs) - len(missing)} of {len(runs)} timed runs, the median is of those" + (
            f" (n/a in {others}: {why})" if why else f" (n/a in {others})"
        )
    return out


def median_metrics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-field median over repeated runs (GenerationMetrics dicts); sources from the first run that has one.
    Counts stay ints where the median is a whole number; new_tokens is each candidate's lower median. A figure
    measured in some runs only is the median of those, `partial` saying how many; one measured in none is None,
    `unavailable` saying why."""
    out: dict[str, Any] = {f.key: f.typed(median(r.get(f.key) for r in runs)) for f in GENERATION_FIGURES}
    rows = [r.get("new_tokens") or [] for r in runs]
    if rows and all(isinstance(x, list) and x and len(x) == len(rows[0]) for x in rows):
        out["new_tokens"] = [statistics.median_low(column) for column in zip(*rows)]
    tok_s = [r["decode_tok_s"] for r in runs if r.get("decode_tok_s") is not None]
    # The spread says how far one run's figure can be trusted on this machine (other load only slows runs down).
    out["decode_tok_s_min"] = min(tok_s) if tok_s else None
    out["decode_tok_s_max"] = max(tok_s) if tok_s else None
    for f in SOURCE_FIELDS:
        out[f] = next((r[f] for r in runs if r.get(f)), None)
    reasons: dict[str, str] = {}
    for r in runs:
        for k, v in (r.get("unavailable") or {}).items():
            reasons.setdefault(k, v)
    out["partial"] = partial_figures(runs, out, MEDIAN_FIELDS)
    # a figure is a value with its source or None with the reason, never both
    out["unavailable"] = {k: v for k, v in reasons.items() if out.get(k) is None}
    # each median figure names its source, as each run's do (the medians the table and the speed-ups read had none)
    sources: dict[str, str] = {}
    for r in runs:
        for k, v in (r.get("sources") or {}).items():
            sources.setdefault(k, v)
    out["sources"] = {k: v for k, v in {**sources, **SPREAD_SOURCES}.items() if out.get(k) is not None}
    return out


@dataclass
class Rung:
    name: str
    label: str
    status: str  # "ok" | "skipped" | "failed"
    reason: Optional[str] = None  # why skipped or failed
    options: Optional[dict[str, Any]] = None  # the options the engine ran with
    notes: list[str] = field(default_factory=list)  # e.g. optimisations left out of the candidates rung
    runs: list[dict[str, Any]] = field(default_factory=list)  # every timed repeat: metrics, tokens, finish
    median: dict[str, Any] = field(default_factory=dict)
    speedup_vs_naive: Optional[float] = None
    speedup_vs_transformers: Optional[float] = None
    speedup_vs_transformers_compiled: Optional[float] = None
    speedup_unavailable: dict[str, str] = field(default_factory=dict)  # a speed-up above that is null: why
    # Wall time of each warm-up generation, device-synchronised: compile and graph capture happen in the first.
    warmup_seconds: list[float] = field(default_factory=list)


def compile_enabled(config: BenchConfig, device_type: str) -> bool:
    return config.compile if config.compile is not None else device_type == "cuda"


def rung_options(
    name: str, base: EngineOptions, device_type: str, candidates: Optional[int], speculation: str = "ngram"
) -> EngineOptions:
    """A preset's options for this bench: on CUDA as defined; on the CPU the half rung in bf16 and the
    later rungs in fp32 (see CPU_DTYPE_NOTE). The speculation rung drafts as `speculation` says."""
    opts = preset_options(name, base, candidates=candidates if candidates is not None else DEFAULT_CANDIDATES)
    if opts.speculation != "off":
        opts = replace(opts, speculation=speculation)
    if device_type != "cuda" and opts.dtype == "fp16":
        opts = replace(opts, dtype="bf16" if name == "half" else "fp32")
    return opts


def uncompiled(name: str, opts: EngineOptions) -> EngineOptions:
    """A rung's options where nothing is compiled (a CPU, a bench without compile): the int8, candidates and
    speculation rungs run without compile and CUDA graphs; the others are returned as they are (their own
    optimisation is the compile or the graph, so they are skipped instead)."""
    return replace(opts, compile=False, cuda_graph=False) if name in RELAXED_RUNGS and opts.compile else opts


def plan_rung(
    engine, name: str, base: EngineOptions, device_type: str, config: BenchConfig
) -> tuple[Optional[EngineOptions], Optional[str], list[str]]:
    """(options, skip reason, notes). A rung whose defining optimisation cannot run here is skipped; the
    int8, candidates and speculation rungs keep running without the optimisations this machine lacks, and say which."""
    opts = rung_options(name, base, device_type, config.candidates, config.speculation)
    notes: list[str] = []
    if name == "candidates" and config.kernels == "fused":  # the fused step replaces the compiled one
        opts = replace(opts, kernels="fused", compile=False)
    compile_on = compile_enabled(config, device_type)
    if name in COMPILED_RUNGS and not compile_on:
        # A rung this device cannot run at all says so first; "compile off" is only the reason where it could.
        own = engine.unavailable(replace(opts, compile=False)) if name == "cuda-graph" else {}
        if own:
            return None, "; ".join(f"{k}: {v}" for k, v in own.items()), notes
        return (
            None,
            "compile off for this bench (default on the CPU, where a cold compile takes minutes; "
            "gapless bench --compile includes it)",
            notes,
        )
    if not compile_on and (relaxed := uncompiled(name, opts)) != opts:
        opts = relaxed
        notes.append("without compile and CUDA graph (compile off for this bench)")
    reasons = engine.unavailable(opts)
    if reasons and name in RELAXED_RUNGS:
        if "kernels" in reasons and opts.kernels == "fused":
            opts = replace(opts, kernels="torch")
            notes.append(f"without fused kernels: {reasons['kernels']}")
        for key, why in reasons.items():
            if key in ("compile", "cuda_graph") and getattr(opts, key):
                opts = opts.with_(**{key: False})
                notes.append(f"without {key}: {why}")
        reasons = engine.unavailable(opts)
    if reasons:
        return None, "; ".join(f"{k}: {v}" for k, v in reasons.items()), notes
    return opts, None, notes


def _failed(rung: Rung, exc: BaseException, progress: Progress) -> None:
    log.error("bench rung %s failed", rung.name, exc_info=exc)
    rung.status, rung.reason = "failed", f"{type(exc).__name__}: {exc}"
    progress(f"{rung.name}: failed: {rung.reason}")


# Errors that end one rung or baseline but not the bench: out of memory, a compile failure, an engine refusal.
RUN_ERRORS = (GaplessError, RuntimeError, ValueError)


class LadderRunner:
    """The engine side of the bench: plans the rungs, warms each one up, then times one repeat at a time."""

    def __init__(self, engine, config: BenchConfig, progress: Progress):
        self.engine, self.config, self.progress = engine, config, progress
        self.device_type = torch.device(engine.info.device).type
        self.sampling = SamplingParams(temperature=0.0, max_new_tokens=config.max_new_tokens, seed=0)
        self.messages = [{"role": "user", "content": config.prompt}]
        self.rungs: list[Rung] = []
        self.opts: dict[str, EngineOptions] = {}
        self._current: Optional[EngineOptions] = None
        base = EngineOptions(
            device=config.device,
            profile_window=config.profile_window,
            draft_tokens=config.draft_tokens,
            draft_model=config.draft_model,
            prefix_reuse=config.prefix_reuse,
        )
        for name in [p for p in PRESETS if p in config.presets]:
            opts, skip, notes = plan_rung(engine, name, base, self.device_type, config)
            label = (
                f"+ {opts.candidates} candidates" if opts is not None and opts.candidates > 1 else PRESET_LABELS[name]
            )
            self.rungs.append(Rung(name, label, "skipped" if skip else "ok", reason=skip, notes=notes))
            if opts is None:
                progress(f"{name}: skipped: {skip}")
            else:
                self.opts[name] = opts

    def ok(self) -> list[Rung]:
        return [r for r in self.rungs if r.status == "ok"]

    def _switch(self, rung: Rung, warm: bool = True) -> None:
        """Options of `rung`; a change of dtype, device or weight format re-places the weights (and drops compiled
        steps), so the first generation after it is a warm-up, not a measurement. Told by the engine's placement:
        the weight format's switch (native and int8 rounds interleaved) was timed cold."""
        opts = self.opts[rung.name]

        def placement() -> tuple:
            return (self.engine.device, self.engine.dtype, self.engine.weights)

        placed = placement()
        self.engine.reconfigure(opts)
        rebuilt = self._current is not None and placement() != placed
        self._current = opts
        if rebuilt and warm:
            self.progress(f"{rung.name}: warm-up after re-placing the weights")
            self.engine.generate(self.messages, self.sampling)

    def refused_after_switch(self, rung: Rung) -> bool:
        """Whether the engine, switched to `rung`, refuses what the plan could not know before (a draft model is
        loaded, and its vocabulary checked, at the switch): the rung is then skipped with the reason instead of
        timing the previous rung's path under its name."""
        reasons = self.engine.unavailable(self.opts[rung.name])
        if not reasons:
            return False
        rung.status, rung.reason = "skipped", "; ".join(f"{k}: {v}" for k, v in reasons.items())
        self.progress(f"{rung.name}: skipped: {rung.reason}")
        return True

    def warm_up(self) -> None:
        for rung in self.ok():
            try:
                self._switch(rung, warm=False)
                if self.refused_after_switch(rung):
                    continue
                for i in range(self.config.warmup):
                    self.progress(f"{rung.name}: warm-up {i + 1}/{self.config.warmup}")
                    t0 = time.perf_counter()
                    self.engine.generate(self.messages, self.sampling)
                    rung.warmup_seconds.append(time.perf_counter() - t0)
            except RUN_ERRORS as exc:
                _failed(rung, exc, self.progress)

    def run_once(self, rung: Rung, index: int, cancel: Optional[threading.Event] = None) -> None:
        if rung.status != "ok":
            return
        try:
            self._switch(rung)
            result = self.engine.generate(self.messages, self.sampling, cancel=cancel)
        except RUN_ERRORS as exc:
            _failed(rung, exc, self.progress)
            return
        if "cancelled" in result.finish_reasons:
            return  # a cut-short run is no measurement
        m = result.metrics.to_dict()
        rung.options = result.options.to_dict()
        rung.runs.append(
            {
                "metrics": m,
                "new_tokens": m["new_tokens"],
                "finish_reasons": result.finish_reasons,
                "token_ids": result.token_ids,
                "unavailable_options": dict(result.unavailable),
            }
        )
        tok_s = m.get("decode_tok_s")
        self.progress(
            f"{rung.name}: run {index + 1}/{self.config.repeats}: "
            f"{'n/a' if tok_s is None else f'{tok_s:.1f}'} tok/s, {m['new_tokens_total']} tokens"
        )

    def finish(self) -> list[Rung]:
        for rung in self.rungs:
            if rung.runs:
                rung.median = median_metrics([r["metrics"] for r in rung.runs])
        return self.rungs


def run_ladder(
    engine,
    messages: list[dict],
    sampling: SamplingParams,
    presets: Optional[list[str]] = None,
    on_progress: Optional[Callable[[int, int, str], None]] = None,
    cancel: Optional[threading.Event] = None,
    repeats: int = 1,
    candidates: Optional[int] = None,
) -> list[LadderRow]:
    """The app's "Run ladder": the user's prompt through every preset, as `gapless bench` runs them (the same
    plan, warm-up and timing; greedy, so every rung makes the same answer of the same length, whatever the chat
    samples with), one rung after another so progress and cancel are per rung. Every timed run reads the whole
    prompt (no prefix reuse), so its TTFT and prefill are the prompt's, as a chat's first answer. The engine's
    options are restored afterwards. Returns one row per preset."""
    previous = engine.options
    config = validate(
        BenchConfig(
            model=engine.info.source,
            device=previous.device,
            max_new_tokens=max(2, sampling.max_new_tokens),
            repeats=repeats,
            warmup=1,
            presets=tuple(presets or PRESETS),
            candidates=candidates,
            baseline=False,
            prompt=next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "") or "-",
            profile_window=previous.profile_window,
            prefix_reuse=False,
            # the speculation rung drafts as the user's options do (a draft model chosen in the app), else ngram
            speculation=previous.speculation if previous.speculation != "off" else "ngram",
            draft_tokens=previous.draft_tokens,
            draft_model=previous.draft_model if previous.speculation == "draft" else "",
        )
    )
    runner = LadderRunner(engine, config, log.info)
    runner.messages = list(messages)
    runner.sampling = SamplingParams(temperature=0.0, max_new_tokens=config.max_new_tokens, seed=0)
    todo = runner.ok()
    total, done = len(todo) * (1 + repeats), 0
    report = on_progress or (lambda d, t, label: None)
    stopped = lambda: cancel is not None and cancel.is_set()  # noqa: E731
    cut: dict[str, str] = {}  # the rung Cancel stopped in before it had a timed run -> what it was running
    try:
        for rung in todo:
            if stopped():
                break
            report(done, total, f"{rung.label}: warm-up")
            try:
                runner._switch(rung, warm=False)
                if not runner.refused_after_switch(rung):
                    engine.generate(runner.messages, runner.sampling, cancel=cancel)
            except RUN_ERRORS as exc:
                _failed(rung, exc, log.info)
            done += 1
            if stopped() and rung.status == "ok":
                cut[rung.name] = "warm-up"
            for i in range(repeats):
                if stopped():
                    break
                report(done, total, rung.label)
                runner.run_once(rung, i, cancel)
                done += 1
                if stopped() and rung.status == "ok" and not rung.runs:
                    cut[rung.name] = "timed run"
        if stopped():
            report(done, total, "cancelled")
        else:
            report(total, total, "done")
    finally:
        engine.reconfigure(previous)
    return [_ladder_row(r, cut.get(r.name)) for r in runner.finish()]


def _ladder_row(rung: Rung, cut_in: Optional[str] = None) -> LadderRow:
    """`cut_in`: what the rung was running when Cancel stopped it (no timed run kept), None where it was not."""
    unrun = LadderRow.CUT_SHORT.format(cut_in) if cut_in else LadderRow.NOT_RUN
    reason = rung.reason if rung.status != "ok" else (None if rung.runs else unrun)
    return LadderRow(rung.name, rung.label, rung.status, rung.options, reason, tuple(rung.notes), rung.median or None)


def validate(config: BenchConfig) -> BenchConfig:
    from engine.errors import OptionsError

    unknown = [p for p in config.presets if p not in PRESETS]
    if unknown:
        raise OptionsError(f"unknown preset(s): {', '.join(unknown)}; choose from {', '.join(PRESETS)}")
    if not config.presets:
        raise OptionsError("no preset to run")
    if config.speculation not in ("ngram", "draft"):
        raise OptionsError(f"the speculation rung drafts with ngram or draft, got {config.speculation!r}")
    if config.speculation == "draft" and not config.draft_model:
        raise OptionsError("--speculation draft needs --draft-model PATH")
    if config.repeats < 1 or config.warmup < 0:
        raise OptionsError(f"repeats must be >= 1 and warm-up >= 0, got {config.repeats} and {config.warmup}")
    if config.max_new_tokens < 2:
        raise OptionsError(f"max_new_tokens must be >= 2 for a decode figure, got {config.max_new_tokens}")
    if config.candidates is not None:
        EngineOptions(candidates=config.candidates).validate()
        if config.candidates < 2:  # the rung ran as the static-KV one under the label "+ N candidates"
            raise OptionsError(f"--candidates for the candidates rung must be 2 or more, got {config.candidates}")
    if config.kernels is not None:
        EngineOptions(kernels=config.kernels).validate()
    if not config.prompt.strip():
        raise OptionsError("the prompt is empty")
    return config
