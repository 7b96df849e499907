"""Quality and speed per weight format: perplexity on a fixed text, top-1 agreement with fp32, decode and prefill
tok/s.

Each format runs on the same loaded model (the engine re-places the weights from the checkpoint between them).
Perplexity is over non-overlapping windows of WINDOW tokens (the context, if shorter) of engine.quality_text, each window read from a
fresh context; top-1 agreement is the share of those positions whose most likely next token equals fp32's.
Decode tok/s is the engine's own device-synchronised figure, the median over short greedy generations; prefill
tok/s the engine's figure for a prompt of a pasted page (the text's first PREFILL_CHARS characters), the median over
one-token answers, each computing the whole prompt (prefix reuse off).
"""

from __future__ import annotations

import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any, Callable, Optional

import torch

from engine import figures
from engine.bench import INTERRUPTED
from engine.quality_text import QUALITY_TEXT
from engine.telemetry.machine import describe_machine
from engine.types import EngineOptions, SamplingParams

WINDOW = 512
# (label, dtype, weights); the first is the reference the others are compared with
FORMATS: tuple[tuple[str, str, str], ...] = (
    ("fp32", "fp32", "native"),
    ("bf16", "bf16", "native"),
    ("int8", "fp32", "int8"),
    ("int4", "fp32", "int4"),
)
PROMPT = [{"role": "user", "content": "Write a short paragraph about lighthouses."}]
PREFILL_CHARS = 2400  # about 500 tokens of the text: a pasted page
PREFILL_PROMPT = [{"role": "user", "content": QUALITY_TEXT[:PREFILL_CHARS] + "\n\nSummarise the text above."}]


@dataclass
class QualityConfig:
    model: str = "default"
    device: str = "cpu"
    decode_tokens: int = 32
    repeats: int = 3
    formats: tuple[str, ...] = tuple(f[0] for f in FORMATS)


@dataclass
class FormatResult:
    label: str
    dtype: str
    weights: str
    status: str = "ok"  # ok | skipped | interrupted (Ctrl+C: the figures measured before it are kept)
    reason: str = ""
    perplexity: Optional[float] = None  # None where it cannot be a number: `perplexity_note` says why
    perplexity_note: str = ""
    nll_per_token: Optional[float] = None  # the mean negative log-likelihood, nats: log(perplexity)
    top1_agreement_vs_fp32: Optional[float] = None
    positions: int = 0
    decode_tok_s: Optional[float] = None
    decode_tok_s_runs: list[float] = field(default_factory=list)
    prefill_tok_s: Optional[float] = None
    prefill_tok_s_runs: list[float] = field(default_factory=list)
    prefill_tokens: Optional[int] = None
    weight_bytes: Optional[int] = None
    bytes_per_token: Optional[int] = None
    kernel: str = ""  # what computes the quantised linears ("" for native weights)


def teacher_forced(
    model: torch.nn.Module, ids: list[int], device: torch.device, window: int
) -> tuple[float, torch.Tensor]:
    """(summed negative log-likelihood of every next token, the argmax at every position), window by window."""
    nll, argmax = 0.0, []
    cover = getattr(model, "cover_positions", None)  # the fast path's rope tables, grown where the window needs it
    if cover is not None:
        cover(window)
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor(ids[start : start + window + 1], device=device)
            x, y = chunk[:-1], chunk[1:]
            logits = model(x[None], torch.arange(len(x), device=device), last_only=False)[0].float()
            nll += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
            argmax.append(logits.argmax(-1).cpu())
    return nll, torch.cat(argmax)


def llama_cpp_column(gguf_path: Optional[str], decode_tokens: int, repeats: int) -> dict[str, Any]:
    """llama.cpp's decode and prefill speed on the same GGUF, when llama-cpp-python is installed (an optional
    extra)."""
    try:
        import llama_cpp
    except ImportError:
        return {
            "status": "skipped",
            "reason": "llama-cpp-python is not installed (optional; it has no prebuilt "
            "wheel for this machine and builds llama.cpp from source)",
        }
    if not gguf_path or not gguf_path.lower().endswith(".gguf"):
        return {"status": "skipped", "reason": "llama.cpp reads GGUF files; this model is a Hugging Face folder"}
    # typed loosely: the optional extra is type-checked only where it is installed
    llm: Any = llama_cpp.Llama(model_path=gguf_path, n_threads=torch.get_num_threads(), n_ctx=2048, verbose=False)

    def timed(max_tokens: int) -> tuple[int, float]:
        started = time.perf_counter()
        out = llm.create_chat_completion(messages=PROMPT, max_tokens=max_tokens, temperature=0.0)
        return int(out["usage"]["completion_tokens"]), time.perf_counter() - started

    runs, wall = [], []
    timed(decode_tokens)  # warms up (and leaves the prompt in llama.cpp's cache, as every later call finds it)
    for _ in range(repeats):
        # the engine's decode figure is the tokens after the first over the time after the first; a one-token
        # call (the prompt, the first token, the call's own costs) taken from a whole one gives llama.cpp's the same way
        _, first_s = timed(1)
        n, total_s = timed(decode_tokens)
        wall.append(n / total_s)
        if n > 1 and total_s > first_s:
            runs.append((n - 1) / (total_s - first_s))
    if not runs:
        return {"status": "failed", "reason": "llama.cpp answered in one token or less; no decode to time"}
    # the pasted page: a one-token answer from an emptied context (reset: llama.cpp keeps the last prompt's
    # tokens and would compute only past the common prefix), as the engine's prefill_tok_s with prefix reuse off
    prefill, prompt_tokens = [], 0
    for _ in range(repeats + 1):  # the first warms up
        llm.reset()
        started = time.perf_counter()
        out = llm.create_chat_completion(messages=PREFILL_PROMPT, max_tokens=1, temperature=0.0)
        prompt_tokens = int(out["usage"]["prompt_tokens"])
        prefill.append(prompt_tokens / (time.perf_counter() - started))
    prefill = prefill[1:]
    return {
        "status": "ok",
        "decode_tok_s": median(runs),
        "decode_tok_s_runs": runs,
        "wall_tok_s_runs": wall,
        "prefill_tok_s": median(prefill),
        "prefill_tok_s_runs": prefill,
        "prefill_tokens": prompt_tokens,
        "threads": torch.get_num_threads(),
        "figure": "(completion tokens - 1) / (the time of create_chat_completion - that of a one-token call), as "
        "the engine's decode_tok_s counts the tokens after the first; wall_tok_s_runs: completion tokens / the "
        "whole call; prefill: prompt tokens / a one-token call from an emptied context",
    }


def perplexity(nll_per_token: float) -> tuple[Optional[float], str]:
    """(exp of the mean negative log-likelihood, ""), or (None, why) where that is no number: a model far from the
    text (random weights) can average more than the 709 nats a double's exponent holds, and a NaN logit makes the
    sum NaN."""
    if not math.isfinite(nll_per_token):
        return None, f"n/a: the log-likelihood is {nll_per_token}"
    if nll_per_token > math.log(sys.float_info.max):
        return None, f"n/a: e^{nll_per_token:.0f} is beyond a double (mean NLL {nll_per_token:.1f} nats a token)"
    return math.exp(nll_per_token), ""


def _relay(progress: Callable[[str], None], label: str) -> Callable[[Any], None]:
    return lambda p: progress(f"{label}: {p.message}")


def _measure_formats(
    engine,
    base: EngineOptions,
    config: QualityConfig,
    ids: list[int],
    window: int,
    results: list[FormatResult],
    finished: set[str],
    progress: Callable[[str], None],
) -> None:
    """Measures each format of `config` in turn, appending its result to `results` as it starts and its label to
    `finished` once measured or skipped (a Ctrl+C leaves the one it was measuring with its figures so far)."""
    reference = None
    for label, dtype, weights in FORMATS:
        if label not in config.formats:
            continue
        r = FormatResult(label, dtype, weights)
        results.append(r)
        opts = base.with_(dtype=dtype, weights=weights)
        why = engine.unavailable(opts)
        if why:
            r.status, r.reason = "skipped", "; ".join(f"{k}: {v}" for k, v in why.items())
            finished.add(label)
            progress(f"{label}: skipped: {r.reason}")
            continue
        engine.reconfigure(opts, _relay(progress, label))
        info = engine.info
        r.weight_bytes, r.bytes_per_token, r.kernel = info.weight_bytes, info.bytes_per_token, info.weights_kernel
        progress(f"{label}: perplexity over {len(ids)} tokens")
        assert engine.model is not None  # placed by reconfigure
        nll, top1 = teacher_forced(engine.model, ids, engine.device, window)
        r.positions = len(top1)
        r.nll_per_token = nll / r.positions
        r.perplexity, r.perplexity_note = perplexity(r.nll_per_token)
        if reference is None and label == "fp32":
            reference = top1
        if reference is not None:
            r.top1_agreement_vs_fp32 = float((top1 == reference).float().mean())
        params = SamplingParams(temperature=0.0, max_new_tokens=config.decode_tokens, seed=0)
        engine.generate(PROMPT, params)  # warm-up
        for i in range(config.repeats):
            tok_s = engine.generate(PROMPT, params).metrics.decode_tok_s
            if tok_s is not None:
                r.decode_tok_s_runs.append(tok_s)
            progress(f"{label}: decode run {i + 1}/{config.repeats}: {tok_s or 0:.1f} tok/s")
        r.decode_tok_s = median(r.decode_tok_s_runs) if r.decode_tok_s_runs else None
        one = SamplingParams(temperature=0.0, max_new_tokens=1, seed=0)
        engine.generate(PREFILL_PROMPT, one)  # warm-up
        for i in range(config.repeats):
            m = engine.generate(PREFILL_PROMPT, one).metrics
            r.prefill_tokens = m.prompt_tokens
            if m.prefill_tok_s is not None:
                r.prefill_tok_s_runs.append(m.prefill_tok_s)
            progress(f"{label}: prefill run {i + 1}/{config.repeats}: {m.prefill_tok_s or 0:.1f} tok/s")
        r.prefill_tok_s = median(r.prefill_tok_s_runs) if r.prefill_tok_s_runs else None
        finished.add(label)


def _mark_interrupted(results: list[FormatResult], finished: set[str], config: QualityConfig) -> dict[str, str]:
    """After a Ctrl+C: the format it stopped keeps the figures measured in full before it and the medians of the
    runs it made, and says what it lacks; a format not started is "interrupted" too. Why each one did not run in
    full, by label."""
    not_run: dict[str, str] = {}
    started = {r.label for r in results}
    last = results[-1] if results else None
    if last is not None and last.label not in finished:
        last.decode_tok_s = median(last.decode_tok_s_runs) if last.decode_tok_s_runs else None
        last.prefill_tok_s = median(last.prefill_tok_s_runs) if last.prefill_tok_s_runs else None
        if not last.positions:
            what = "before its perplexity was measured"
        elif len(last.decode_tok_s_runs) < config.repeats and not last.prefill_tok_s_runs:
            what = f"after {len(last.decode_tok_s_runs)} of {config.repeats} decode runs, before its prefill runs"
        else:
            what = f"after {len(last.prefill_tok_s_runs)} of {config.repeats} prefill runs"
        last.status, last.reason = "interrupted", f"{INTERRUPTED} {what}: its medians are of the runs made"
        not_run[last.label] = last.reason
    for label, dtype, weights in FORMATS:
        if label in config.formats and label not in started:
            r = FormatResult(label, dtype, weights, status="interrupted", reason=f"{INTERRUPTED} before it started")
            results.append(r)
            not_run[label] = r.reason
    return not_run


def run_quality(
    config: QualityConfig, progress: Callable[[str], None], command: Optional[list[str]] = None
) -> dict[str, Any]:
    from engine.engine import Engine

    base = EngineOptions(
        device=config.device,
        dtype="fp32",
        kv_cache="static",
        sampling="device",
        profile_window=False,
        prefix_reuse=False,
    )
    engine = Engine.load(config.model, base, lambda p: progress(f"{p.stage}: {p.message}"))
    try:
        if not engine.fast:
            raise ValueError("the quality bench runs on the fast path; this model runs on the transformers fallback")
        ids = engine.tokenizer(QUALITY_TEXT)["input_ids"]
        window = min(WINDOW, engine.context_length)
        results: list[FormatResult] = []
        finished: set[str] = set()
        interrupted = False
        try:
            _measure_formats(engine, base, config, ids, window, results, finished, progress)
        except KeyboardInterrupt:  # Ctrl+C: the formats measured are kept, the report says what did not run
            interrupted = True
        model_info = engine.info.to_dict()
    finally:
        engine.close()
    not_run = _mark_interrupted(results, finished, config) if interrupted else {}
    if interrupted:
        llama_cpp = {"status": "skipped", "reason": f"{INTERRUPTED} before it ran"}
    else:
        progress("llama.cpp: decode and prefill on the same GGUF")
        try:
            llama_cpp = llama_cpp_column(model_info["source"], config.decode_tokens, config.repeats)
        except KeyboardInterrupt:
            interrupted = True
            llama_cpp = {"status": "interrupted", "reason": f"{INTERRUPTED} while it ran"}
    return {
        "kind": "quality",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command or [],
        "machine": describe_machine(
            platform=platform.platform(),
            processor=platform.processor() or platform.machine(),
            torch=torch.__version__,
            threads=torch.get_num_threads(),
            cuda=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        ),
        "config": asdict(config),
        "device": model_info["device"],  # where the formats ran (machine.cuda names a GPU present, used or not)
        "model": {k: model_info[k] for k in ("name", "source", "parameters", "context_length")},
        "text": {"source": "engine/quality_text.py", "tokens": len(ids), "window": window},
        "decode": {
            "prompt": PROMPT[0]["content"],
            "new_tokens": config.decode_tokens,
            "repeats": config.repeats,
            "figure": "median of the engine's decode_tok_s (device-synchronised) after one warm-up",
        },
        "prefill": {
            "prompt": f"the text's first {PREFILL_CHARS} characters, then 'Summarise the text above.'",
            "repeats": config.repeats,
            "figure": "median of the engine's prefill_tok_s (prompt tokens computed / time to the first token) "
            "over one-token answers after one warm-up, prefix reuse off",
        },
        "formats": [r.__dict__ for r in results],
        "llama_cpp": llama_cpp,
        # Ctrl+C: the formats measured before it; not_run: each one not measured in full, and why
        "interrupted": interrupted,
        "not_run": not_run,
    }


def _num(v: Optional[float], fmt: str) -> str:
    return "n/a" if v is None else fmt.format(v)


def _mib(b: Optional[int]) -> str:
    """Never rounded to "0 MiB" (a tiny model's weights are a fraction of one)."""
    return "n/a" if b is None else f"{figures.rounded(b / 2**20, 0)} MiB"


def format_quality_table(report: dict[str, Any]) -> str:
    rows = [
        "| format | weights held | bytes/token | perplexity | top-1 = fp32 | decode tok/s (median) | "
        "prefill tok/s (median) |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in report["formats"]:
        if f["status"] == "skipped" or (f["status"] != "ok" and f["weight_bytes"] is None):  # nothing measured
            rows.append(f"| {f['label']} | {f['status']}: {f['reason']} | | | | | |")
            continue
        label = f["label"] if f["status"] == "ok" else f"{f['label']} ({f['status']})"  # the notes below say why
        rows.append(
            f"| {label} | {_mib(f['weight_bytes'])} | {_mib(f['bytes_per_token'])} | "
            f"{f.get('perplexity_note') or _num(f['perplexity'], '{:.3f}')} | "
            f"{_num(f['top1_agreement_vs_fp32'], '{:.2%}')} | "
            f"{_num(f['decode_tok_s'], '{:.1f}')} | {_num(f.get('prefill_tok_s'), '{:.0f}')} |"
        )
    lc = report.get("llama_cpp") or {}
    if lc.get("status") == "ok":
        rows.append(
            f"| llama.cpp (same GGUF) | | | | | {_num(lc.get('decode_tok_s'), '{:.1f}')} | "
            f"{_num(lc.get('prefill_tok_s'), '{:.0f}')} |"
        )
    elif lc:
        rows.append(f"| llama.cpp | {lc.get('status')}: {lc.get('reason')} | | | | | |")
    t = report["text"]
    rows.append("")
    for f in report["formats"]:
        if f["status"] == "ok" and f.get("kernel"):
            rows.append(f"{f['label']} linears: {f['kernel']}.")
    rows.append(
        f"Perplexity and top-1 over {t['tokens']} tokens of {t['source']} in windows of {t['window']}; "
        f"decode: {report['decode']['figure']}, {report['decode']['new_tokens']} new tokens"
        + (f"; prefill: {p['figure']}, {p['prompt']}." if (p := report.get("prefill")) else ".")
    )
    if lc.get("status") == "ok":
        rows.append(f"llama.cpp: {lc['figure']}.")
    if report.get("interrupted"):
        rows.append("Interrupted (Ctrl+C): the rows hold the formats measured before it.")
        rows.extend(f"{label}: {why}." for label, why in report["not_run"].items())
    return "\n".join(rows)
