"""The optimization ladder and the transformers baseline, measured in one process on one prompt.

Each rung is a preset of `engine.types.PRESETS`, run through the engine facade: warm-up generations first
(compile, capture and the profiler's first start happen there), then `repeats` timed greedy generations
whose figures are the engine's own device-synchronised metrics; a rung's figure is the median over repeats.
The baseline is transformers' `generate()` on the same weights, prompt ids and token count. On the CPU the
repeats are interleaved (see `run_suite`), because a shared machine's load drifts over minutes.
"""
from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from engine.errors import GaplessError
from engine.telemetry.machine import describe_machine
from engine.types import PRESET_LABELS, PRESETS, EngineOptions, SamplingParams, preset_options

log = logging.getLogger(__name__)

DEFAULT_PROMPT = (
    "Write a detailed essay on the history of computing, from the abacus and mechanical calculators to "
    "transistors, personal computers and today's GPUs."
)
DEFAULT_CANDIDATES = 4
COMPILED_RUNGS = ("compile", "cuda-graph")
CPU_DTYPE_NOTE = (
    "CPU ladder: Naive and every rung after '+ half precision' run in fp32; the half-precision rung runs in bf16, "
    "because CPUs run fp16 matmuls slowly and bf16 only as fast as their bf16 support allows"
)
# Figures reduced to a median over the repeats of a rung.
MEDIAN_FIELDS = (
    "decode_tok_s", "ttft_ms", "prefill_tok_s", "step_ms_p50", "step_ms_p90", "step_ms_p99", "decode_seconds",
    "kernel_gap_pct", "launches_per_step", "sm_activity_pct", "gpu_util_pct", "dram_bw_util_pct",
    "peak_memory_bytes", "new_tokens_total", "prompt_tokens", "decode_steps", "profiled_steps",
)
SOURCE_FIELDS = ("kernel_gap_source", "launches_per_step_source", "sm_activity_source", "gpu_util_source",
                 "dram_bw_util_source", "peak_memory_source")

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
    baseline: bool = True
    compile: Optional[bool] = None  # None: on with CUDA, off on the CPU (a cold compile takes minutes there)
    interleave: Optional[bool] = None  # rounds over all rungs and the baseline; None: on the CPU only
    prompt: str = DEFAULT_PROMPT
    profile_window: bool = True
    prefix_reuse: bool = True  # repeats of the prompt then reuse its KV cache (prompt_reused_tokens says how much)


def median(values) -> Optional[float]:
    """Median of the values that are not None; None when there are none."""
    xs = [float(v) for v in values if v is not None]
    return statistics.median(xs) if xs else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or not b > 0:
        return None
    return a / b


def median_metrics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-field median over repeated runs (GenerationMetrics dicts); sources from the first run that has one."""
    out: dict[str, Any] = {f: median(r.get(f) for r in runs) for f in MEDIAN_FIELDS}
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
    out["unavailable"] = reasons
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
    # Wall time of each warm-up generation, device-synchronised: compile and graph capture happen in the first.
    warmup_seconds: list[float] = field(default_factory=list)


def compile_enabled(config: BenchConfig, device_type: str) -> bool:
    return config.compile if config.compile is not None else device_type == "cuda"


def rung_options(name: str, base: EngineOptions, device_type: str, candidates: Optional[int]) -> EngineOptions:
    """A preset's options for this bench: on CUDA as defined; on the CPU the half rung in bf16 and the
    later rungs in fp32 (see CPU_DTYPE_NOTE)."""
    opts = preset_options(name, base, candidates=candidates if candidates is not None else DEFAULT_CANDIDATES)
    if device_type != "cuda" and opts.dtype == "fp16":
        opts = replace(opts, dtype="bf16" if name == "half" else "fp32")
    return opts


def plan_rung(engine, name: str, base: EngineOptions, device_type: str, config: BenchConfig
              ) -> tuple[Optional[EngineOptions], Optional[str], list[str]]:
    """(options, skip reason, notes). A rung whose defining optimisation cannot run here is skipped; the
    candidates rung keeps running without the optimisations this machine lacks, and says which."""
    opts = rung_options(name, base, device_type, config.candidates)
    notes: list[str] = []
    compile_on = compile_enabled(config, device_type)
    if name in COMPILED_RUNGS and not compile_on:
        # A rung this device cannot run at all says so first; "compile off" is only the reason where it could.
        own = engine.unavailable(replace(opts, compile=False)) if name == "cuda-graph" else {}
        if own:
            return None, "; ".join(f"{k}: {v}" for k, v in own.items()), notes
        return None, "compile off for this bench (default on the CPU, where a cold compile takes minutes; --compile to include)", notes
    if name == "candidates" and not compile_on and opts.compile:
        opts = replace(opts, compile=False, cuda_graph=False)
        notes.append("without compile and CUDA graph (compile off for this bench)")
    reasons = engine.unavailable(opts)
    if reasons and name == "candidates":
        for key, why in reasons.items():
            if key in ("compile", "cuda_graph") and getattr(opts, key):
                opts = replace(opts, **{key: False})
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
        base = EngineOptions(device=config.device, profile_window=config.profile_window,
                             prefix_reuse=config.prefix_reuse)
        for name in [p for p in PRESETS if p in config.presets]:
            opts, skip, notes = plan_rung(engine, name, base, self.device_type, config)
            label = f"+ {opts.candidates} candidates" if opts is not None and opts.candidates > 1 else PRESET_LABELS[name]
            self.rungs.append(Rung(name, label, "skipped" if skip else "ok", reason=skip, notes=notes))
            if skip:
                progress(f"{name}: skipped: {skip}")
            else:
                self.opts[name] = opts

    def ok(self) -> list[Rung]:
        return [r for r in self.rungs if r.status == "ok"]

    def _switch(self, rung: Rung, warm: bool = True) -> None:
        """Options of `rung`; a change of dtype or device re-places the weights (and drops compiled steps), so
        the first generation after it is a warm-up, not a measurement."""
        opts = self.opts[rung.name]
        rebuilt = self._current is not None and (opts.dtype, opts.device) != (self._current.dtype, self._current.device)
        self.engine.reconfigure(opts)
        self._current = opts
        if rebuilt and warm:
            self.progress(f"{rung.name}: warm-up after re-placing the weights")
            self.engine.generate(self.messages, self.sampling)

    def warm_up(self) -> None:
        for rung in self.ok():
            try:
                self._switch(rung, warm=False)
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
        rung.runs.append({"metrics": m, "new_tokens": m["new_tokens"], "finish_reasons": result.finish_reasons,
                          "token_ids": result.token_ids, "unavailable_options": dict(result.unavailable)})
        tok_s = m.get("decode_tok_s")
        self.progress(f"{rung.name}: run {index + 1}/{self.config.repeats}: "
                      f"{'n/a' if tok_s is None else f'{tok_s:.1f}'} tok/s, {m['new_tokens_total']} tokens")

    def finish(self) -> list[Rung]:
        for rung in self.rungs:
            if rung.runs:
                rung.median = median_metrics([r["metrics"] for r in rung.runs])
        return self.rungs


def run_ladder(engine, messages: list[dict], sampling: SamplingParams, presets: Optional[list[str]] = None,
               on_progress: Optional[Callable[[int, int, str], None]] = None,
               cancel: Optional[threading.Event] = None, repeats: int = 1,
               candidates: Optional[int] = None) -> list[dict[str, Any]]:
    """The app's "Run ladder": the user's prompt through every preset, as `gapless bench` runs them (the same
    plan, warm-up and timing), one rung after another so progress and cancel are per rung. The engine's
    options are restored afterwards. Returns one plain dict per preset."""
    previous = engine.options
    config = validate(BenchConfig(
        model=engine.info.source, device=previous.device, max_new_tokens=max(2, sampling.max_new_tokens),
        repeats=repeats, warmup=1, presets=tuple(presets or PRESETS), candidates=candidates, baseline=False,
        prompt=next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "") or "-",
        profile_window=previous.profile_window,
    ))
    runner = LadderRunner(engine, config, log.info)
    runner.messages = list(messages)
    runner.sampling = replace(sampling, seed=sampling.seed if sampling.seed is not None else 0)
    todo = runner.ok()
    total, done = len(todo) * (1 + repeats), 0
    report = on_progress or (lambda d, t, label: None)
    try:
        for rung in todo:
            if cancel is not None and cancel.is_set():
                break
            report(done, total, f"{rung.label}: warm-up")
            try:
                runner._switch(rung, warm=False)
                engine.generate(runner.messages, runner.sampling, cancel=cancel)
            except RUN_ERRORS as exc:
                _failed(rung, exc, log.info)
            done += 1
            for i in range(repeats):
                if cancel is not None and cancel.is_set():
                    break
                report(done, total, rung.label)
                runner.run_once(rung, i, cancel)
                done += 1
        report(total, total, "done")
    finally:
        engine.reconfigure(previous)
    return [_ladder_row(r) for r in runner.finish()]


def _ladder_row(rung: Rung) -> dict[str, Any]:
    m = rung.median or None
    reason = rung.reason if rung.status != "ok" else (None if rung.runs else "cancelled before it ran")
    return {
        "preset": rung.name, "label": rung.label, "status": rung.status, "options": rung.options,
        "skipped": reason, "notes": list(rung.notes), "metrics": m,
        "decode_tok_s": m.get("decode_tok_s") if m else None,
        "kernel_gap_pct": m.get("kernel_gap_pct") if m else None,
        "kernel_gap_source": m.get("kernel_gap_source") if m else None,
    }


# ---- the transformers baseline ---------------------------------------------------------------------------


@dataclass
class Baseline:
    name: str  # "transformers" | "transformers-static-compile"
    label: str
    status: str  # "ok" | "failed"
    reason: Optional[str] = None
    settings: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    median: dict[str, Any] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    warmup_seconds: list[float] = field(default_factory=list)  # each warm-up (a 1-token and a full generate())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory(device: torch.device) -> tuple[Optional[int], str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated (this generation)"
    try:
        import resource
    except ImportError:  # Windows
        return None, "no getrusage on this OS"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS since start (getrusage)"


class BaselineRunner:
    """transformers' generate(), greedy, exactly `n_tokens` new tokens (min_new_tokens = max_new_tokens).

    TTFT is a 1-token generate(); decode tok/s is (n - 1) / (time of n tokens - time of 1 token), both
    device-synchronised, so prefill is left out as in the engine's decode figure.
    """

    def __init__(self, model, prompt_ids: list[int], eos_ids: list[int], n_tokens: int, device: torch.device,
                 config: BenchConfig, static_compile: bool, monitor=None, progress: Progress = log.info):
        self.model, self.device, self.config, self.monitor, self.progress = model, device, config, monitor, progress
        self.n_tokens, self.static_compile = n_tokens, static_compile
        self.ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        self.eos_ids = list(eos_ids)
        name = "transformers-static-compile" if static_compile else "transformers"
        label = "transformers generate(), static cache + compile" if static_compile else "transformers generate()"
        self.result = Baseline(name, label, "ok", settings={
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "device": str(device),
            "do_sample": False, "max_new_tokens": n_tokens, "min_new_tokens": n_tokens,
            "cache_implementation": "static" if static_compile else "default (dynamic)",
            "compile": ("transformers auto-compile of the forward with a static cache (CompileConfig defaults)"
                        if static_compile else "off"),
        })

    def _timed(self, n: int) -> tuple[float, torch.Tensor, float, float]:
        from transformers import GenerationConfig

        g = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=self.eos_ids or None,
                             pad_token_id=self.eos_ids[0] if self.eos_ids else 0)
        if self.static_compile:
            g.cache_implementation = "static"
        _sync(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=self.ids, attention_mask=torch.ones_like(self.ids), generation_config=g)
        _sync(self.device)
        t1 = time.perf_counter()
        return t1 - t0, out, t0, t1

    def _fail(self, exc: BaseException) -> None:
        log.error("baseline %s failed", self.result.name, exc_info=exc)
        self.result.status, self.result.reason = "failed", f"{type(exc).__name__}: {exc}"
        self.progress(f"{self.result.name}: failed: {self.result.reason}")

    def warm_up(self) -> None:
        for i in range(self.config.warmup + (1 if self.static_compile else 0)):  # compile needs a second one
            self.progress(f"{self.result.name}: warm-up {i + 1}")
            try:
                first_s = self._timed(1)[0]
                self.result.warmup_seconds.append(first_s + self._timed(self.n_tokens)[0])
            except RUN_ERRORS + (TypeError,) as exc:
                self._fail(exc)
                return

    def run_once(self, index: int) -> None:
        if self.result.status != "ok":
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            first_s, _, _, _ = self._timed(1)
            total_s, out, t0, t1 = self._timed(self.n_tokens)
        except RUN_ERRORS + (TypeError,) as exc:
            self._fail(exc)
            return
        new = out[0, self.ids.shape[1]:].tolist()
        run: dict[str, Any] = {"ttft_ms": first_s * 1e3, "total_s": total_s, "new_tokens_total": len(new),
                               "decode_tok_s": ratio(len(new) - 1, total_s - first_s), "unavailable": {}}
        run["peak_memory_bytes"], run["peak_memory_source"] = _peak_memory(self.device)
        if self.monitor is not None:
            for metric, (value, source) in self.monitor.summary(t0, t1).items():
                run[metric] = value
                run[metric.replace("_pct", "_source")] = source if value is not None else None
                if value is None:
                    run["unavailable"][metric] = source
        self.result.runs.append(run)
        self.result.token_ids = new
        tok_s = run["decode_tok_s"]
        self.progress(f"{self.result.name}: run {index + 1}/{self.config.repeats}: "
                      f"{'n/a' if tok_s is None else f'{tok_s:.1f}'} tok/s")

    def finish(self) -> Baseline:
        base = self.result
        if not base.runs:
            return base
        base.median = {f: median(r.get(f) for r in base.runs)
                       for f in ("decode_tok_s", "ttft_ms", "total_s", "new_tokens_total", "peak_memory_bytes",
                                 "gpu_util_pct", "sm_activity_pct", "dram_bw_util_pct")}
        tok_s = [r["decode_tok_s"] for r in base.runs if r.get("decode_tok_s") is not None]
        base.median["decode_tok_s_min"] = min(tok_s) if tok_s else None
        base.median["decode_tok_s_max"] = max(tok_s) if tok_s else None
        for f in ("peak_memory_source", "gpu_util_source", "sm_activity_source", "dram_bw_util_source"):
            base.median[f] = next((r[f] for r in base.runs if r.get(f)), None)
        base.median["unavailable"] = {}
        for metric, source in (("kernel_gap_pct", "kernel_gap_source"), ("launches_per_step", "launches_per_step_source")):
            base.median[metric] = base.median[source] = None
            base.median["unavailable"][metric] = "not traced inside transformers generate()"
        for r in base.runs:
            for k, v in r["unavailable"].items():
                base.median["unavailable"].setdefault(k, v)
        return base


def matching_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---- the whole run -----------------------------------------------------------------------------------------


def validate(config: BenchConfig) -> BenchConfig:
    from engine.errors import OptionsError

    unknown = [p for p in config.presets if p not in PRESETS]
    if unknown:
        raise OptionsError(f"unknown preset(s): {', '.join(unknown)}; choose from {', '.join(PRESETS)}")
    if not config.presets:
        raise OptionsError("no preset to run")
    if config.repeats < 1 or config.warmup < 0:
        raise OptionsError(f"repeats must be >= 1 and warm-up >= 0, got {config.repeats} and {config.warmup}")
    if config.max_new_tokens < 2:
        raise OptionsError(f"max_new_tokens must be >= 2 for a decode figure, got {config.max_new_tokens}")
    if config.candidates is not None:
        EngineOptions(candidates=config.candidates).validate()
    if not config.prompt.strip():
        raise OptionsError("the prompt is empty")
    return config


def add_ratios(rungs: list[Rung], baselines: list[Baseline]) -> dict[str, Any]:
    """Speed-ups of every rung against Naive and the baselines, and the best rungs' figures."""
    naive = next((r for r in rungs if r.name == "naive" and r.status == "ok"), None)
    naive_tok_s = naive.median.get("decode_tok_s") if naive else None
    by_name = {b.name: b.median.get("decode_tok_s") for b in baselines if b.status == "ok"}
    for r in rungs:
        if r.status != "ok":
            continue
        tok_s = r.median.get("decode_tok_s")
        r.speedup_vs_naive = ratio(tok_s, naive_tok_s)
        r.speedup_vs_transformers = ratio(tok_s, by_name.get("transformers"))
        r.speedup_vs_transformers_compiled = ratio(tok_s, by_name.get("transformers-static-compile"))

    def best(pred) -> Optional[dict[str, Any]]:
        ok = [r for r in rungs if r.status == "ok" and r.median.get("decode_tok_s") is not None and pred(r)]
        if not ok:
            return None
        r = max(ok, key=lambda x: x.median["decode_tok_s"])
        return {"rung": r.name, "decode_tok_s": r.median["decode_tok_s"], "vs_naive": r.speedup_vs_naive,
                "vs_transformers": r.speedup_vs_transformers,
                "vs_transformers_compiled": r.speedup_vs_transformers_compiled,
                "kernel_gap_pct": r.median.get("kernel_gap_pct")}

    return {
        "naive_decode_tok_s": naive_tok_s,
        "transformers_decode_tok_s": by_name.get("transformers"),
        "transformers_static_compile_decode_tok_s": by_name.get("transformers-static-compile"),
        "best_single_stream": best(lambda r: (r.options or {}).get("candidates", 1) == 1),
        "best_aggregate": best(lambda r: True),
    }


def interleaved(config: BenchConfig, device_type: str) -> bool:
    return config.interleave if config.interleave is not None else device_type != "cuda"


def _baseline_runners(config: BenchConfig, context_length: int, device: torch.device, nvml: Any,
                      progress: Progress) -> tuple[list[BaselineRunner], list[int], Any]:
    """The transformers model on the same weights and prompt ids, and a monitor for its GPU figures."""
    from engine.fallback import build_hf_model
    from engine.loader import load_checkpoint
    from engine.prompt import build_prompt
    from engine.telemetry.monitor import Monitor

    ckpt = load_checkpoint(config.model, lambda p: progress(f"{p.stage}: {p.message}"))
    messages = [{"role": "user", "content": config.prompt}]
    prompt_ids = list(build_prompt(ckpt.tokenizer, messages, context_length, config.max_new_tokens).ids)
    dtype = torch.float16 if device.type == "cuda" else torch.float32  # generate()'s usual choice per device
    model = build_hf_model(ckpt.config, ckpt.state_dict, dtype, device)
    eos_ids = list(ckpt.eos_token_ids)
    monitor = Monitor(device, nvml=nvml)
    monitor.start()
    kinds = [False] + ([True] if device.type == "cuda" and compile_enabled(config, device.type) else [])
    runners = [BaselineRunner(model, prompt_ids, eos_ids, config.max_new_tokens, device, config, static_compile=k,
                              monitor=monitor, progress=progress) for k in kinds]
    return runners, prompt_ids, monitor


def run_suite(config: BenchConfig, progress: Progress = log.info, command: Optional[list[str]] = None,
              nvml: Any = None) -> dict[str, Any]:
    """Load the model, run the ladder and the baselines, and return the report (plain JSON-able data).

    Interleaved (the default on the CPU, where the machine is often shared): after every warm-up, each round
    runs every rung and the baseline once, so a stretch of outside load slows all of them alike instead of
    one rung. Sequential (the default on CUDA): each rung's repeats back to back, so compiled steps and
    captured graphs are not rebuilt for every round.
    """
    from engine.engine import Engine

    config = validate(config)
    started = time.time()
    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    engine = Engine.load(config.model, EngineOptions(device=config.device, profile_window=config.profile_window,
                                                     prefix_reuse=config.prefix_reuse),
                         progress=lambda p: progress(f"{p.stage}: {p.message}"))
    runners: list[BaselineRunner] = []
    prompt_ids: Optional[list[int]] = None
    monitor = None
    try:
        info = engine.info.to_dict()
        device = torch.device(engine.info.device)
        inter = interleaved(config, device.type)
        ladder = LadderRunner(engine, config, progress)
        ladder.warm_up()
        if inter:
            if config.baseline:
                runners, prompt_ids, monitor = _baseline_runners(config, info["context_length"], device, nvml, progress)
                for b in runners:
                    b.warm_up()
            for i in range(config.repeats):
                for rung in ladder.ok():
                    ladder.run_once(rung, i)
                for b in runners:
                    b.run_once(i)
        else:
            for rung in ladder.ok():
                for i in range(config.repeats):
                    ladder.run_once(rung, i)
        rungs = ladder.finish()
    finally:
        engine.close()
    try:
        if config.baseline and not inter:
            runners, prompt_ids, monitor = _baseline_runners(config, info["context_length"], device, nvml, progress)
            for b in runners:
                b.warm_up()
                for i in range(config.repeats):
                    b.run_once(i)
    finally:
        if monitor is not None:
            monitor.close()
    baselines = [b.finish() for b in runners]

    greedy_match: Optional[dict[str, int]] = None
    naive = next((r for r in rungs if r.name == "naive" and r.runs), None)
    plain = next((b for b in baselines if b.name == "transformers" and b.token_ids), None)
    if naive is not None and plain is not None:
        ours = naive.runs[0]["token_ids"][0]
        greedy_match = {"matching_prefix": matching_prefix(ours, plain.token_ids), "naive_tokens": len(ours),
                        "transformers_tokens": len(plain.token_ids)}
    ratios = add_ratios(rungs, baselines)
    machine = describe_machine(nvml=nvml)
    machine["load_average_at_start"] = load_at_start
    order = ("interleaved: each round runs every rung and the baseline once" if inter
             else "sequential: each rung's repeats back to back, then the baseline")
    return {
        "command": command,
        "created_unix": started,
        "wall_seconds": time.time() - started,
        "config": {**asdict(config), "presets": list(config.presets), "interleaved": inter,
                   "compile_rungs": compile_enabled(config, device.type)},
        "machine": machine,
        "model": info,
        "device": device.type,
        "dtype_note": CPU_DTYPE_NOTE if device.type != "cuda" else "CUDA ladder: half-precision rungs in fp16",
        "prompt": config.prompt,
        "prompt_tokens_transformers": len(prompt_ids) if prompt_ids is not None else None,
        "greedy_match_naive_vs_transformers": greedy_match,
        "method": ("engine rungs: the engine's own metrics (device-synchronised; the profiled window's steps are "
                   "excluded from decode tok/s), median of the repeats after warm-up; transformers: generate() "
                   "greedy with min_new_tokens = max_new_tokens, decode tok/s = (n - 1) / (t(n tokens) - t(1 token)); "
                   f"order {order}"),
        "rungs": [asdict(r) for r in rungs],
        "baselines": [asdict(b) for b in baselines],
        "ratios": ratios,
    }
