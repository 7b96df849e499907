"""Every figure Gapless measures, in one table: what it is called, its unit, which way is better, where it is
measured (per generation, per decode step, per monitor sample) and where its value comes from.

A figure's value lives in a plain field (`GenerationMetrics.decode_tok_s`, `MonitorSample.gpu_util_pct`, a bench
median of the same name); its source is either fixed here (`source`) or, where it depends on the machine, the
field named by `source_field`; when it could not be measured, `GenerationMetrics.unavailable[key]` says why.
`Figure` joins the three. The HUD's bars, compare columns and plots, the bench medians and tables, the stats
tooltip and the exports are built from this table, so a new figure is one entry here plus the code that
measures it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

Scope = Literal["generation", "step", "sample"]
Unit = Literal["tok/s", "ms", "s", "%", "bytes", "tokens", "count", "W", "MHz", "ratio", "fraction", "tok/step"]

ENGINE_TIMING = "engine timing, device-synchronised"
ENGINE_COUNT = "engine token count"
HTTP_TIMING = "client-side timing over HTTP"
SPEC_COUNT = "engine counters: tokens kept / decode steps, each row while it runs"
# the speculation figures' reason where an answer ran without it; "speculation off: <why>" where it was asked for
SPECULATION_OFF = "speculation off"
VLLM_METRICS = "vLLM Prometheus /metrics, read while the answer streamed"
SERVER_USAGE = "the server's token usage (OpenAI stream usage)"


@dataclass(frozen=True)
class FigureSpec:
    key: str  # the field name in GenerationMetrics / MonitorSample / bench medians / JSON
    label: str  # as a title: "Decode", "Kernel / op gap"
    unit: Unit
    better: int  # +1 higher is better, -1 lower is better, 0 neither
    scopes: tuple[Scope, ...]
    source: Optional[str] = None  # a fixed source, when it does not depend on the machine
    # else the field that names the source of this run's value (with `source` too: where that field is empty)
    source_field: Optional[str] = None
    digits: Optional[int] = None  # decimals when shown; None: by magnitude
    tip: str = ""  # one line on what it means, for tooltips and docs

    @property
    def per_generation(self) -> bool:
        return "generation" in self.scopes

    @property
    def integral(self) -> bool:
        """Counted in whole units (tokens, launches, bytes): a value that is a whole number is an int."""
        return self.unit in ("tokens", "count", "bytes")

    def typed(self, value: Optional[float]) -> Optional[float]:
        """`value` as an int where this figure counts whole units and it is one (a median of 24.0 tokens)."""
        return int(value) if value is not None and self.integral and float(value).is_integer() else value


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec(
        "decode_tok_s",
        "Decode",
        "tok/s",
        +1,
        ("generation",),
        ENGINE_TIMING,
        tip="aggregate over candidates, traced window left out",
    ),
    FigureSpec("prefill_tok_s", "Prefill", "tok/s", +1, ("generation",), ENGINE_TIMING),
    FigureSpec("ttft_ms", "TTFT", "ms", -1, ("generation",), ENGINE_TIMING, tip="prompt in → first token on the host"),
    FigureSpec(
        "compile_seconds",
        "Compile",
        "s",
        -1,
        ("generation",),
        "engine timing: the compile / CUDA-graph capture warm-up before the first token",
        digits=1,
        tip="time spent compiling or capturing the decode step before the first token, not in TTFT",
    ),
    FigureSpec("step_ms_p50", "Step p50", "ms", -1, ("generation",), ENGINE_TIMING),
    FigureSpec("step_ms_p90", "Step p90", "ms", -1, ("generation",), ENGINE_TIMING),
    FigureSpec("step_ms_p99", "Step p99", "ms", -1, ("generation",), ENGINE_TIMING),
    FigureSpec("decode_seconds", "Decode time", "s", -1, ("generation",), ENGINE_TIMING, digits=2),
    FigureSpec(
        "kernel_gap_pct",
        "Kernel / op gap",
        "%",
        -1,
        ("generation",),
        source_field="kernel_gap_source",
        digits=1,
        tip="share of the traced window's span with no kernel (GPU) or aten op (CPU) running",
    ),
    FigureSpec(
        "launches_per_step",
        "Launches/step",
        "count",
        -1,
        ("generation",),
        source_field="launches_per_step_source",
        digits=0,
        tip="kernels (GPU) or top-level aten ops (CPU) per decode step, traced window",
    ),
    FigureSpec(
        "sm_activity_pct", "SM activity", "%", +1, ("generation", "sample"), source_field="sm_activity_source", digits=1
    ),
    FigureSpec("gpu_util_pct", "GPU util", "%", +1, ("generation", "sample"), source_field="gpu_util_source", digits=1),
    FigureSpec(
        "dram_bw_util_pct",
        "DRAM bandwidth",
        "%",
        +1,
        ("generation", "sample"),
        source_field="dram_bw_util_source",
        digits=1,
    ),
    FigureSpec("peak_memory_bytes", "Peak memory", "bytes", -1, ("generation",), source_field="peak_memory_source"),
    # a remote server's answer: counted by the server (count_source names its report)
    FigureSpec("new_tokens_total", "New tokens", "tokens", 0, ("generation",), ENGINE_COUNT, "count_source", digits=0),
    FigureSpec("prompt_tokens", "Prompt tokens", "tokens", 0, ("generation",), ENGINE_COUNT, "count_source", digits=0),
    FigureSpec("decode_steps", "Decode steps", "count", 0, ("generation",), ENGINE_COUNT, digits=0),
    FigureSpec(
        "profiled_steps",
        "Traced steps",
        "count",
        0,
        ("generation",),
        ENGINE_COUNT,
        digits=0,
        tip="decode steps inside the traced window, left out of tok/s",
    ),
    # Speculative decoding (engine/speculative.py): the engine's counters, the drafter named by the source.
    FigureSpec(
        "tokens_per_step",
        "Tokens/step",
        "tok/step",
        +1,
        ("generation", "step"),  # per step: StepRecord.tokens_per_step, drawn live in the HUD
        SPEC_COUNT,
        digits=2,
        tip="tokens kept per decode step and candidate: 1 without speculation, above 1 where drafts were accepted",
    ),
    FigureSpec(
        "drafted_tokens",
        "Drafted",
        "tokens",
        0,
        ("generation",),
        source_field="speculation_source",
        digits=0,
        tip="drafts the model verified",
    ),
    FigureSpec(
        "accepted_tokens", "Accepted drafts", "tokens", +1, ("generation",), source_field="speculation_source", digits=0
    ),
    FigureSpec(
        "acceptance_rate",
        "Acceptance",
        "fraction",
        +1,
        ("generation",),
        source_field="speculation_source",
        digits=1,
        tip="accepted / drafted, shown as a percentage",
    ),
    FigureSpec(
        "verify_steps",
        "Verify steps",
        "count",
        0,
        ("generation",),
        source_field="speculation_source",
        digits=0,
        tip="decode steps that verified drafts; the others ran plain",
    ),
    FigureSpec(
        "paused_steps",
        "Paused steps",
        "count",
        0,
        ("generation",),
        source_field="speculation_source",
        digits=0,
        tip="decode steps that ran plain although there were drafts: the adaptive draft length held them back while "
        "verify steps made fewer tokens a second than plain steps",
    ),
    FigureSpec(
        "prompt_reused_tokens",
        "Prompt reused",
        "tokens",
        +1,
        ("generation",),
        source_field="prompt_reuse_source",
        digits=0,
        tip="prompt positions taken from the last generation's KV cache, not computed again",
    ),
    FigureSpec(
        "prompt_computed_tokens",
        "Prompt computed",
        "tokens",
        -1,
        ("generation",),
        ENGINE_COUNT,
        digits=0,
        tip="prompt positions the prefill computed",
    ),
    # A remote engine (engine/remote.py): timed by the client over HTTP, or reported by the server.
    FigureSpec(
        "http_ttft_ms",
        "TTFT (HTTP)",
        "ms",
        -1,
        ("generation",),
        HTTP_TIMING,
        tip="request sent → first text chunk received, network and the server's queue included",
    ),
    FigureSpec(
        "http_decode_tok_s",
        "Decode (HTTP)",
        "tok/s",
        +1,
        ("generation",),
        HTTP_TIMING,
        tip="the server's token count over the time between the first and the last text chunk",
    ),
    FigureSpec(
        "inter_token_ms_p50",
        "Inter-token p50 (HTTP)",
        "ms",
        -1,
        ("generation",),
        HTTP_TIMING,
        tip="gap between text chunks as they arrive (one token per chunk on vLLM, llama.cpp, Ollama)",
    ),
    FigureSpec("inter_token_ms_p99", "Inter-token p99 (HTTP)", "ms", -1, ("generation",), HTTP_TIMING),
    FigureSpec("server_ttft_ms", "TTFT (server)", "ms", -1, ("generation",), source_field="server_ttft_source"),
    FigureSpec(
        "server_decode_tok_s", "Decode (server)", "tok/s", +1, ("generation",), source_field="server_decode_source"
    ),
    FigureSpec("server_running_requests", "Server running", "count", 0, ("generation",), VLLM_METRICS, digits=0),
    FigureSpec("server_waiting_requests", "Server waiting", "count", -1, ("generation",), VLLM_METRICS, digits=0),
    FigureSpec("server_kv_cache_pct", "Server KV cache", "%", 0, ("generation",), VLLM_METRICS, digits=1),
    # Per decode step, from the engine's step records.
    FigureSpec("step_ms", "Step latency", "ms", -1, ("step",), ENGINE_TIMING),
    FigureSpec("tokens_per_s", "Tokens/s", "tok/s", +1, ("step",), ENGINE_TIMING),
    # Per monitor sample only (the monitor names each sample's source).
    FigureSpec("sm_occupancy_pct", "SM occupancy", "%", +1, ("sample",), digits=1),
    FigureSpec("gpu_memory_used_bytes", "GPU memory", "bytes", -1, ("sample",)),
    FigureSpec("power_w", "Power", "W", 0, ("sample",), digits=0),
    FigureSpec("sm_clock_mhz", "SM clock", "MHz", 0, ("sample",), digits=0),
    FigureSpec("cpu_util_pct", "CPU (this process)", "%", 0, ("sample",), digits=1),
    FigureSpec("process_rss_bytes", "Process memory", "bytes", -1, ("sample",)),
)

BY_KEY: dict[str, FigureSpec] = {f.key: f for f in FIGURES}
# what only a remote engine measures: n/a on a local model's answers
REMOTE_ONLY: tuple[str, ...] = (
    "http_ttft_ms",
    "http_decode_tok_s",
    "inter_token_ms_p50",
    "inter_token_ms_p99",
    "server_ttft_ms",
    "server_decode_tok_s",
    "server_running_requests",
    "server_waiting_requests",
    "server_kv_cache_pct",
)
# shares that may pass 100 %: the DRAM bandwidth is measured against an estimate of the peak; a process's CPU use
# counts every core (100 % = one core busy)
OVER_100: tuple[str, ...] = ("dram_bw_util_pct", "cpu_util_pct")
GENERATION_FIGURES: tuple[FigureSpec, ...] = tuple(f for f in FIGURES if "generation" in f.scopes)
SAMPLE_FIGURES: tuple[FigureSpec, ...] = tuple(f for f in FIGURES if "sample" in f.scopes)
STEP_FIGURES: tuple[FigureSpec, ...] = tuple(f for f in FIGURES if "step" in f.scopes)
SOURCE_FIELDS: tuple[str, ...] = tuple(f.source_field for f in FIGURES if f.source_field)


def spec(key: str) -> FigureSpec:
    try:
        return BY_KEY[key]
    except KeyError:
        raise KeyError(f"{key!r} is not a registered figure (engine/figures.py)") from None


def source_field_of(key: str) -> str:
    """The field naming the source of a machine-dependent figure (gpu_util_pct -> gpu_util_source)."""
    field = spec(key).source_field
    if field is None:
        raise KeyError(f"{key!r} has a fixed source ({spec(key).source}), no source field")
    return field


@dataclass(frozen=True)
class Figure:
    """One measured figure: its value with its source, or None with the reason it is n/a."""

    spec: FigureSpec
    value: Optional[float]
    source: Optional[str]
    reason: Optional[str] = None

    @property
    def available(self) -> bool:
        return self.value is not None


def speculation_refused(data: Any) -> Optional[str]:
    """Why drafting asked for did not run in this answer (GenerationMetrics or its dict form): the reason its
    speculation figures keep after "speculation off: ". None where it ran, or was not asked for (a bare "speculation
    off", as an answer kept before the figures said why has it too)."""
    reason = read(data, "acceptance_rate").reason or ""
    head = f"{SPECULATION_OFF}: "
    return reason[len(head) :] if reason.startswith(head) else None


def read(data: Any, key: str) -> Figure:
    """The figure `key` of a GenerationMetrics, or of its dict form (JSON, bench medians, the store)."""
    s = spec(key)
    get = data.get if isinstance(data, Mapping) else lambda name, default=None: getattr(data, name, default)
    value = get(key)
    source = (get(s.source_field) if s.source_field else None) or s.source
    unavailable = get("unavailable") or {}
    reason = None if value is not None else unavailable.get(key)
    return Figure(s, None if value is None else value, source if value is not None else None, reason)


# What stands in for a figure an answer from a remote server cannot have: the same thing, timed by the client
# over HTTP; the HUD's bars, the stats line, the compare table and the exports show it under its own title.
REMOTE_STAND_INS: dict[str, str] = {
    "ttft_ms": "http_ttft_ms",
    "decode_tok_s": "http_decode_tok_s",
    "step_ms_p50": "inter_token_ms_p50",
    "step_ms_p99": "inter_token_ms_p99",
}


def shown(data: Any, key: str) -> Figure:
    """The figure `key` as a view shows it: where it is n/a and its remote stand-in was measured, the stand-in
    (its spec names it: "TTFT (HTTP)")."""
    fig = read(data, key)
    alt = REMOTE_STAND_INS.get(key)
    if fig.value is None and alt is not None:
        other = read(data, alt)
        if other.value is not None:
            return other
    return fig


def over_http(fig: Figure, key: str) -> str:
    """ " (HTTP)" where `fig` is the stand-in shown for figure `key` (see shown), else ""."""
    return " (HTTP)" if fig.spec.key != key else ""


def candidate_tokens(metrics: Mapping[str, Any], index: Optional[int]) -> Optional[int]:
    """Candidate `index`'s own tokens in a batch of candidates, whose other figures are the batch's; None for an
    answer that is not one of several."""
    per = metrics.get("new_tokens") or []
    return per[index] if len(per) > 1 and index is not None and 0 <= index < len(per) else None


def rounded(v: float, digits: int, top: Optional[float] = None) -> str:
    """`v` with `digits` decimals and thousands separators, never rounded onto a bound it does not reach: a value
    that is not zero is not shown as 0 ("<0.1"), nor one under `top` (100 for a share) as `top` (">99.9")."""
    text = f"{v + 0.0:,.{digits}f}"  # + 0.0: no "-0.0"
    step = 10.0**-digits
    near = float(text.replace(",", ""))
    if v != 0 and near == 0:
        return f"<{step:.{digits}f}" if v > 0 else f">-{step:.{digits}f}"
    if top is not None and v < top and near >= top:
        return f">{top - step:,.{digits}f}"
    return text


def counted(n: int, noun: str) -> str:
    """`n` and `noun`, in the plural unless `n` is 1: "1 run", "3 runs" (the tables' counts of runs, threads)."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def texts(value: Any) -> bool:
    """Whether `value` is an object of texts, as the n/a reasons of figures and options are."""
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def value_problem(spec: FigureSpec, v: Any) -> Optional[str]:
    """Why `v` cannot be a value of the figure `spec` ("is -5, not a count or a time"); None when it can."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"is {json.dumps(v)[:40]}, not a number"
    if isinstance(v, int) and v.bit_length() > 1000:  # no float holds it: the HUD's formatting of it raised
        return f"is an integer of {len(str(v)):,} digits, past what a figure holds"
    if not v >= 0:  # every figure counts or times something (NaN fails this too)
        return f"is {v}, not a count or a time"
    if v == math.inf:  # an estimate allowed past 100 % still is a number (NVML GPM gave inf)
        return "is inf, not a measured value"
    if spec.unit == "%" and spec.key not in OVER_100 and v > 100:
        return f"is {v}, more than all of it (100 %)"
    if spec.unit == "fraction" and v > 1:
        return f"is {v}, more than all of it (1)"
    return None


def metrics_problem(metrics: Mapping[str, Any]) -> Optional[str]:
    """What makes a metrics object read back (a chat file, the store) unfit to show: a figure that is not a
    number, a source or finish reason that is not text, n/a reasons that are not texts. None when it is fit."""
    for f in GENERATION_FIGURES:
        v = metrics.get(f.key)
        problem = None if v is None else value_problem(f, v)
        if problem:
            return f"its figure {f.key} {problem}"
    for name in (*SOURCE_FIELDS, "finish_reason"):
        if not isinstance(metrics.get(name), (str, type(None))):
            return f"its {name} is not text"
    if not texts(metrics.get("unavailable", {})):
        return "its n/a reasons are not an object of texts"
    counts = metrics.get("new_tokens", [])
    if not isinstance(counts, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts
    ):
        return "its new_tokens is not a list of whole numbers"
    return None


def not_finite(value: Any) -> Optional[str]:
    """Why `value` cannot be a figure's value in JSON ("came out as nan, not a finite number"); None where it can."""
    return (
        f"came out as {value}, not a finite number" if isinstance(value, float) and not math.isfinite(value) else None
    )


def finite(value: Any) -> Any:
    """`value` (a report: dicts, lists, numbers, texts) as JSON can hold it, which has no NaN or infinity: a float
    that is not finite becomes null (n/a). Where the object holding it says why its figures are n/a (`unavailable`;
    `speedup_unavailable` for a rung's speed-ups) it says this one came out as that value, and its `sources` no
    longer names a source for it; an `unavailable` beside `options` (a recording's) is the options' refusals, and
    is left alone. `value` itself is left as it was."""
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if not isinstance(value, dict):
        return None if isinstance(value, float) and not math.isfinite(value) else value
    out = {k: finite(v) for k, v in value.items()}
    for key, v in value.items():
        if not (isinstance(v, float) and not math.isfinite(v)):
            continue
        holders = (f"{key.split('_')[0]}_unavailable",) + (() if "options" in value else ("unavailable",))
        holder = next((h for h in holders if texts(out.get(h))), None)
        if holder is not None:
            out[holder] = {**out[holder], key: not_finite(v)}
        if texts(out.get("sources")):
            out["sources"] = {k: s for k, s in out["sources"].items() if k != key}
    return out


def strict_json(value: Any, escape_unencodable: bool = True, **kwargs: Any) -> str:
    """`value` as JSON text, through `finite`: never the NaN or Infinity that strict JSON readers refuse. With
    ensure_ascii=False, text UTF-8 cannot hold (a path whose bytes are not UTF-8, kept by Python as lone
    surrogates) is written escaped, as ensure_ascii=True writes everything: the smoke test's report from such a
    data folder was never written ("internal error: UnicodeEncodeError"). `escape_unencodable` False leaves it
    to the caller (the server sends U+FFFD in its place, what a client can show)."""
    value = finite(value)
    text = json.dumps(value, allow_nan=False, **kwargs)
    if escape_unencodable and kwargs.get("ensure_ascii", True) is False and not utf8_text(text):
        text = json.dumps(value, allow_nan=False, **{**kwargs, "ensure_ascii": True})
    return text


def utf8_text(text: str) -> bool:
    """Whether `text` can be written as UTF-8 (no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
