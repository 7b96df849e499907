"""`gapless bench`: the optimization ladder (engine/ladder.py) and the transformers baseline, measured in one
process on one prompt.

The baseline is transformers' `generate()` on the same weights, prompt ids and token count. On the CPU the
repeats are interleaved (see `run_suite`), because a shared machine's load drifts over minutes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

import torch

from engine.figures import source_field_of, spec
from engine.ladder import (
    RUN_ERRORS,
    SPREAD_SOURCES,
    BenchConfig,
    LadderRunner,
    Progress,
    Rung,
    compile_enabled,
    median,
    partial_figures,
    ratio,
    validate,
)
from engine.telemetry.machine import describe_machine, load_average
from engine.types import CPU_DTYPE_NOTE, EngineOptions

log = logging.getLogger(__name__)

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


# Where each of the baseline's own figures comes from: measured around transformers' generate(), not by the engine
# (the registry's fixed source of a figure, "engine timing", is the engine's). The runs and the median name them
# under "sources", as the engine's metrics do; new_tokens_total's also in count_source, its source field.
BASELINE_SOURCES = {
    "ttft_ms": "wall time of a 1-token transformers generate(), device-synchronised",
    "total_s": "wall time of the n-token transformers generate(), device-synchronised",
    "decode_tok_s": (
        "(n - 1) / (t(n tokens) - t(1 token)) of transformers generate(), device-synchronised (prefill left out)"
    ),
    "new_tokens_total": "the tokens transformers generate() returned",
}
# the figures of the baseline the monitor or the OS measure: their source fields name the source of each run
MEASURED_AROUND = ("peak_memory_bytes", "gpu_util_pct", "sm_activity_pct", "dram_bw_util_pct")
BASELINE_FIGURES = ("decode_tok_s", "ttft_ms", "total_s", "new_tokens_total", *MEASURED_AROUND)


def _sources(figures_of: dict[str, Any]) -> dict[str, str]:
    """The source of each figure of a baseline's run or median that has a value."""
    out = {k: v for k, v in {**BASELINE_SOURCES, **SPREAD_SOURCES}.items() if figures_of.get(k) is not None}
    for metric in MEASURED_AROUND:
        source = figures_of.get(source_field_of(metric))
        if figures_of.get(metric) is not None and source:
            out[metric] = source
    return out


class BaselineRunner:
    """transformers' generate(), greedy, exactly `n_tokens` new tokens (min_new_tokens = max_new_tokens).

    TTFT is a 1-token generate(); decode tok/s is (n - 1) / (time of n tokens - time of 1 token), both
    device-synchronised, so prefill is left out as in the engine's decode figure.
    """

    def __init__(
        self,
        model,
        prompt_ids: list[int],
        eos_ids: list[int],
        n_tokens: int,
        device: torch.device,
        config: BenchConfig,
        static_compile: bool,
        monitor=None,
        progress: Progress = log.info,
    ):
        self.model, self.device, self.config, self.monitor, self.progress = model, device, config, monitor, progress
        self.n_tokens, self.static_compile = n_tokens, static_compile
        self.ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        self.eos_ids = list(eos_ids)
        name = "transformers-static-compile" if static_compile else "transformers"
        label = "transformers generate(), static cache + compile" if static_compile else "transformers generate()"
        self.result = Baseline(
            name,
            label,
            "ok",
            settings={
                "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                "device": str(device),
                "do_sample": False,
                "max_new_tokens": n_tokens,
                "min_new_tokens": n_tokens,
                "cache_implementation": "static" if static_compile else "default (dynamic)",
                "compile": (
                    "transformers auto-compile of the forward with a static cache (CompileConfig defaults)"
                    if static_compile
                    else "off"
                ),
            },
        )

    def _timed(self, n: int) -> tuple[float, torch.Tensor, float, float]:
        from transformers import GenerationConfig

        g = GenerationConfig(
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=self.eos_ids or None,
            pad_token_id=self.eos_ids[0] if self.eos_ids else 0,
        )
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
        new = out[0, self.ids.shape[1] :].tolist()
        run: dict[str, Any] = {
            "ttft_ms": first_s * 1e3,
            "total_s": total_s,
            "new_tokens_total": len(new),
            "decode_tok_s": ratio(len(new) - 1, total_s - first_s),
            "count_source": BASELINE_SOURCES["new_tokens_total"],
            "unavailable": {},
        }
        run["peak_memory_bytes"], run["peak_memory_source"] = _peak_memory(self.device)
        if run["peak_memory_bytes"] is None:  # what _peak_memory said is then why, not a source
            run["unavailable"]["peak_memory_bytes"], run["peak_memory_source"] = run["peak_memory_source"], None
        if self.monitor is not None:
            for metric, (value, source) in self.monitor.summary(t0, t1).items():
                run[metric] = value
                run[source_field_of(metric)] = source if value is not None else None
                if value is None:
                    run["unavailable"][metric] = source
        if run["decode_tok_s"] is None:
            run["unavailable"]["decode_tok_s"] = "the n-token generate() took no longer than the 1-token one"
        run["sources"] = _sources(run)
        self.result.runs.append(run)
        self.result.token_ids = new
        tok_s = run["decode_tok_s"]
        self.progress(
            f"{self.result.name}: run {index + 1}/{self.config.repeats}: "
            f"{'n/a' if tok_s is None else f'{tok_s:.1f}'} tok/s"
        )

    def finish(self) -> Baseline:
        base = self.result
        if not base.runs:
            return base
        # counts stay ints where the median is a whole number, as the rungs' (engine.ladder.median_metrics)
        base.median = {f: median(r.get(f) for r in base.runs) for f in BASELINE_FIGURES}
        for f in ("new_tokens_total", "peak_memory_bytes"):
            base.median[f] = spec(f).typed(base.median[f])
        # Only these figures are measured around transformers' generate(); the rest are n/a with the reason.
        tok_s = [r["decode_tok_s"] for r in base.runs if r.get("decode_tok_s") is not None]
        base.median["decode_tok_s_min"] = min(tok_s) if tok_s else None
        base.median["decode_tok_s_max"] = max(tok_s) if tok_s else None
        base.median["count_source"] = BASELINE_SOURCES["new_tokens_total"]
        for f in MEASURED_AROUND:
            source_field = source_field_of(f)
            base.median[source_field] = next((r[source_field] for r in base.runs if r.get(source_field)), None)
        base.median["unavailable"] = {}
        for metric in ("kernel_gap_pct", "launches_per_step"):
            base.median[metric] = base.median[source_field_of(metric)] = None
            base.median["unavailable"][metric] = "not traced inside transformers generate()"
        for r in base.runs:
            for k, v in r["unavailable"].items():
                base.median["unavailable"].setdefault(k, v)
        for k in [k for k in base.median["unavailable"] if base.median.get(k) is not None]:
            del base.median["unavailable"][k]  # n/a in a run, measured in others: their median is the figure
        base.median["partial"] = partial_figures(base.runs, base.median, BASELINE_FIGURES)
        base.median["sources"] = _sources(base.median)
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


def _missing_figure(what: str, found: Any, off: Optional[str]) -> Optional[str]:
    """Why the decode figure of `what` (a rung or a baseline, None where it did not run) is missing; None where
    it is there. `off`: why it did not run, where it was not meant to."""
    if found is None:
        return off or f"{what} did not run"
    if found.status != "ok":
        return f"{what} {found.status}: {found.reason}"
    return None if found.median.get("decode_tok_s") is not None else f"{what} has no decode figure"


def add_ratios(
    rungs: list[Rung], baselines: list[Baseline], baseline: bool = True, compiled_baseline: bool = False
) -> dict[str, Any]:
    """Speed-ups of every rung against Naive and the baselines, and the best rungs' figures; a speed-up that is
    null says why (`speedup_unavailable` of a rung, `unavailable` of the ratios). `baseline`: whether the
    baselines were asked for; `compiled_baseline`: whether the compiled one was (CUDA with compile on)."""
    naive = next((r for r in rungs if r.name == "naive"), None)
    naive_tok_s = naive.median.get("decode_tok_s") if naive and naive.status == "ok" else None
    by_name = {b.name: b.median.get("decode_tok_s") for b in baselines if b.status == "ok"}
    named = {b.name: b for b in baselines}
    off = None if baseline else "the transformers baseline was not run (--no-baseline)"
    why = {
        "naive_decode_tok_s": _missing_figure("the Naive rung", naive, "the Naive rung was not among the presets"),
        "transformers_decode_tok_s": _missing_figure("the transformers baseline", named.get("transformers"), off),
        "transformers_static_compile_decode_tok_s": _missing_figure(
            "the compiled transformers baseline",
            named.get("transformers-static-compile"),
            off or (None if compiled_baseline else "the compiled transformers baseline runs on CUDA with compile on"),
        ),
    }
    against = {
        "speedup_vs_naive": "naive_decode_tok_s",
        "speedup_vs_transformers": "transformers_decode_tok_s",
        "speedup_vs_transformers_compiled": "transformers_static_compile_decode_tok_s",
    }
    for r in rungs:
        if r.status != "ok":
            continue
        tok_s = r.median.get("decode_tok_s")
        r.speedup_vs_naive = ratio(tok_s, naive_tok_s)
        r.speedup_vs_transformers = ratio(tok_s, by_name.get("transformers"))
        r.speedup_vs_transformers_compiled = ratio(tok_s, by_name.get("transformers-static-compile"))
        r.speedup_unavailable = {
            field: "this rung has no decode figure" if tok_s is None else why[base] or "the base figure is 0"
            for field, base in against.items()
            if getattr(r, field) is None
        }

    def best(pred) -> Optional[dict[str, Any]]:
        ok = [r for r in rungs if r.status == "ok" and r.median.get("decode_tok_s") is not None and pred(r)]
        if not ok:
            return None
        r = max(ok, key=lambda x: x.median["decode_tok_s"])
        return {
            "rung": r.name,
            "decode_tok_s": r.median["decode_tok_s"],
            "vs_naive": r.speedup_vs_naive,
            "vs_transformers": r.speedup_vs_transformers,
            "vs_transformers_compiled": r.speedup_vs_transformers_compiled,
            "kernel_gap_pct": r.median.get("kernel_gap_pct"),
            "unavailable": dict(r.speedup_unavailable),
        }

    return {
        "naive_decode_tok_s": naive_tok_s,
        "transformers_decode_tok_s": by_name.get("transformers"),
        "transformers_static_compile_decode_tok_s": by_name.get("transformers-static-compile"),
        "unavailable": {k: v for k, v in why.items() if v},
        "best_single_stream": best(lambda r: (r.options or {}).get("candidates", 1) == 1),
        "best_aggregate": best(lambda r: True),
    }


def interleaved(config: BenchConfig, device_type: str) -> bool:
    return config.interleave if config.interleave is not None else device_type != "cuda"


def _baseline_runners(
    config: BenchConfig, context_length: int, device: torch.device, nvml: Any, progress: Progress
) -> tuple[list[BaselineRunner], list[int], Any]:
    """The transformers model on the same weights and prompt ids, and a monitor for its GPU figures."""
    from engine.fallback import build_hf_model
    from engine.loader import load_checkpoint
    from engine.prompt import build_prompt
    from engine.telemetry.monitor import Monitor

    dtype = torch.float16 if device.type == "cuda" else torch.float32  # generate()'s usual choice per device
    ckpt = load_checkpoint(config.model, lambda p: progress(f"{p.stage}: {p.message}"), dtype=dtype, device=device)
    messages = [{"role": "user", "content": config.prompt}]
    prompt_ids = list(build_prompt(ckpt.tokenizer, messages, context_length, config.max_new_tokens).ids)
    model = build_hf_model(ckpt.config, ckpt.state_dict, dtype, device)
    eos_ids = list(ckpt.eos_token_ids)
    monitor = Monitor(device, nvml=nvml)
    monitor.start()
    kinds = [False] + ([True] if device.type == "cuda" and compile_enabled(config, device.type) else [])
    runners = [
        BaselineRunner(
            model,
            prompt_ids,
            eos_ids,
            config.max_new_tokens,
            device,
            config,
            static_compile=k,
            monitor=monitor,
            progress=progress,
        )
        for k in kinds
    ]
    return runners, prompt_ids, monitor


def _refresh_cpu_bandwidth(device: str) -> None:
    """On a CPU, measure its read bandwidth again before the ladder (the memory floor and the bandwidth estimates
    divide by it); the cache keeps the highest figure measured."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return
    from engine.telemetry.bandwidth import this_cpu

    bw, why = this_cpu(refresh=True)
    if bw is None:
        log.warning("the CPU's read bandwidth could not be measured: %s", why)
        return
    log.info("CPU read bandwidth %.1f GB/s (%s)", bw.bytes_s / 1e9, bw.source)


INTERRUPTED = "the bench was interrupted (Ctrl+C)"


def _mark_interrupted(rungs: list[Rung], baselines: list[Baseline], config: BenchConfig) -> dict[str, str]:
    """After a Ctrl+C: a rung or baseline with no timed run is "interrupted", one with some keeps their median and
    says how many; returns why each one that did not run in full did not (the baselines never started included)."""
    not_run: dict[str, str] = {}
    items: list[Union[Rung, Baseline]] = [*rungs, *baselines]
    for item in items:
        if item.status != "ok" or len(item.runs) >= config.repeats:
            continue
        if not item.runs:
            item.status, item.reason = "interrupted", f"{INTERRUPTED} before its first timed run"
            item.median = {}
            not_run[item.name] = item.reason
        else:
            why = f"{INTERRUPTED} after {len(item.runs)} of {config.repeats} timed runs: the median is of those"
            if isinstance(item, Rung):
                item.notes.append(why)
            else:
                item.reason = why
            not_run[item.name] = why
    if config.baseline and not baselines:
        not_run["transformers"] = f"{INTERRUPTED} before the baseline started"
    return not_run


def run_suite(
    config: BenchConfig, progress: Progress = log.info, command: Optional[list[str]] = None, nvml: Any = None
) -> dict[str, Any]:
    """Load the model, run the ladder and the baselines, and return the report (plain JSON-able data).

    Interleaved (the default on the CPU, where the machine is often shared): after every warm-up, each round
    runs every rung and the baseline once, so a stretch of outside load slows all of them alike instead of
    one rung. Sequential (the default on CUDA): each rung's repeats back to back, so compiled steps and
    captured graphs are not rebuilt for every round.
    """
    from engine.engine import Engine

    config = validate(config)
    started = time.time()
    load_at_start = load_average()
    _refresh_cpu_bandwidth(config.device)
    engine = Engine.load(
        config.model,
        EngineOptions(device=config.device, profile_window=config.profile_window, prefix_reuse=config.prefix_reuse),
        progress=lambda p: progress(f"{p.stage}: {p.message}"),
    )
    runners: list[BaselineRunner] = []
    prompt_ids: Optional[list[int]] = None
    monitor = None
    interrupted = False
    try:
        info = engine.info.to_dict()
        device = torch.device(engine.info.device)
        inter = interleaved(config, device.type)
        ladder = LadderRunner(engine, config, progress)
        try:
            ladder.warm_up()
            if inter:
                if config.baseline:
                    runners, prompt_ids, monitor = _baseline_runners(
                        config, info["context_length"], device, nvml, progress
                    )
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
        except KeyboardInterrupt:  # Ctrl+C: what was measured is kept, the report says what did not run
            interrupted = True
        rungs = ladder.finish()
    finally:
        engine.close()
    try:
        if config.baseline and not inter and not interrupted:
            runners, prompt_ids, monitor = _baseline_runners(config, info["context_length"], device, nvml, progress)
            for b in runners:
                b.warm_up()
                for i in range(config.repeats):
                    b.run_once(i)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if monitor is not None:
            monitor.close()
    baselines = [b.finish() for b in runners]
    not_run = _mark_interrupted(rungs, baselines, config) if interrupted else {}
    if interrupted:
        progress(f"interrupted: {len(not_run)} rung(s) or baseline(s) not run in full")

    greedy_match: Optional[dict[str, int]] = None
    naive = next((r for r in rungs if r.name == "naive" and r.runs), None)
    plain = next((b for b in baselines if b.name == "transformers" and b.token_ids), None)
    if naive is not None and plain is not None:
        ours = naive.runs[0]["token_ids"][0]
        greedy_match = {
            "matching_prefix": matching_prefix(ours, plain.token_ids),
            "naive_tokens": len(ours),
            "transformers_tokens": len(plain.token_ids),
        }
    ratios = add_ratios(
        rungs, baselines, config.baseline, device.type == "cuda" and compile_enabled(config, device.type)
    )
    machine = describe_machine(nvml=nvml, load_average_at_start=load_at_start)
    order = (
        "interleaved: each round runs every rung and the baseline once"
        if inter
        else "sequential: each rung's repeats back to back, then the baseline"
    )
    return {
        "command": command,
        "created_unix": started,
        "wall_seconds": time.time() - started,
        "config": {
            **asdict(config),
            "presets": list(config.presets),
            "interleaved": inter,
            "compile_rungs": compile_enabled(config, device.type),
        },
        "machine": machine,
        "model": info,
        "device": device.type,
        "dtype_note": CPU_DTYPE_NOTE if device.type != "cuda" else "CUDA ladder: half-precision rungs in fp16",
        "prompt": config.prompt,
        "prompt_tokens_transformers": len(prompt_ids) if prompt_ids is not None else None,
        "greedy_match_naive_vs_transformers": greedy_match,
        "method": (
            "engine rungs: the engine's own metrics (device-synchronised; the profiled window's steps are "
            "excluded from decode tok/s), median of the repeats after warm-up; transformers: generate() "
            "greedy with min_new_tokens = max_new_tokens, decode tok/s = (n - 1) / (t(n tokens) - t(1 token)); "
            f"order {order}"
        ),
        "rungs": [asdict(r) for r in rungs],
        "baselines": [asdict(b) for b in baselines],
        "ratios": ratios,
        # Ctrl+C: the rungs and baselines measured before it; not_run: each one not run in full, and why
        "interrupted": interrupted,
        "not_run": not_run,
    }
