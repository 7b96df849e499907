"""The stats line under an answer: what the generation cost and which options produced it.

Every figure comes from the stored GenerationMetrics; a missing one reads "n/a" and the tooltip says why
where the engine gave a reason. Nothing here computes or estimates a figure.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from engine import figures
from engine.diagnosis import diagnose
from engine.types import (
    FINISH_WORDS,
    PRESET_LABELS,
    PRESETS,
    EngineOptions,
    describe_options,
    preset_options,
    server_decides,
)

NA = "n/a"


def finish_words(reason: Optional[str]) -> Optional[str]:
    return None if reason is None else FINISH_WORDS.get(reason, reason)


def fmt(value: Optional[float], unit: str = "", digits: int = 1, top: Optional[float] = None) -> str:
    """`value` never rounded to 0, or to `top` where it is under it (figures.rounded)."""
    if value is None:
        return NA
    return f"{figures.rounded(value, digits, top)}{unit}"


def preset_name(options: dict[str, Any]) -> Optional[str]:
    """The preset these options are, if any (a preset's half dtype may be fp16, bf16 or fp32)."""
    try:
        opts = EngineOptions.from_dict({k: v for k, v in options.items() if k in EngineOptions.__dataclass_fields__})
    except (TypeError, ValueError):
        return None
    for name, p in PRESETS.items():
        for half in ("fp16", "bf16", "fp32"):
            n = opts.candidates if p.candidates > 1 else None
            if preset_options(name, opts, half_dtype=half, candidates=n) == opts:
                return name
    return None


def options_label(options: Optional[dict[str, Any]]) -> str:
    if not options:
        return NA
    if server_decides(options):
        return "remote server"
    name = preset_name(options)
    return PRESET_LABELS[name] if name else "custom"


def diagnosis_lines(metrics: dict[str, Any], options: dict[str, Any], device: Optional[str]) -> list[str]:
    """What limits this answer (engine.diagnosis), with the figures behind it and those that were missing."""
    d = diagnose(metrics, options, device)
    lines = [f"Diagnosis: {d.line}"]
    lines += [f"  from {e}" for e in d.evidence]
    if d.missing:
        lines.append(f"  missing: {'; '.join(d.missing)}")
    return lines


def gap_label(device: Optional[str]) -> str:
    """On CUDA the profiler window gives the kernel gap; elsewhere it gives the gap between aten ops."""
    return "kernel gap" if device == "cuda" else "op gap"


def first_clause(reason: str) -> str:
    """A reason as a line with little room says it: up to its first ": ", "; ", " (" or ", which" ("the draft model
    could not be loaded" of "the draft model could not be loaded: model not found: <path>"); the tooltip says all."""
    return re.split(r": |; | \(|, which ", reason, maxsplit=1)[0]


def _sourced(label: str, value: Optional[float], shown: str, source: Optional[str], reason: Optional[str]) -> str:
    """A tooltip line for a figure: the value and its source, or n/a and why."""
    if value is not None:
        return f"{label}: {shown} — source: {source or NA}"
    return f"{label}: n/a" + (f" — {reason}" if reason else "")


def _steps_line(m: dict[str, Any]) -> str:
    """The step latencies, or over HTTP the gaps between text chunks that stand in for them."""
    p50, p99 = figures.shown(m, "step_ms_p50"), figures.shown(m, "step_ms_p99")
    label = "Inter-token gap (HTTP)" if figures.over_http(p50, "step_ms_p50") else "Step latency"
    shown = f"{fmt(p50.value, ' ms', 2)} / {fmt(p99.value, ' ms', 2)}"
    return _sourced(f"{label} p50 / p99", p50.value, shown, p50.source, p50.reason or p99.reason)


def format_stats(
    metrics: Optional[dict[str, Any]],
    options: Optional[dict[str, Any]],
    device: Optional[str],
    finish_reason: Optional[str] = None,
    candidate: Optional[int] = None,
) -> tuple[str, str]:
    """(line, tooltip) for one answer. `device` is where it ran ("cpu", "cuda"), deciding kernel vs op gap;
    `candidate` is the answer's index in a batch of candidates (the figures are the batch's)."""
    m = metrics or {}
    tokens = m.get("new_tokens_total")
    gap = gap_label(device)
    per = m.get("new_tokens") or []
    own = figures.candidate_tokens(m, candidate)
    batch = own is not None
    if batch:
        count = f"{own} of {tokens} token{'' if tokens == 1 else 's'} in the batch"
    else:
        count = f"{tokens} token{'' if tokens == 1 else 's'}" if tokens is not None and metrics else f"{NA} tokens"
    compile_s = m.get("compile_seconds")
    compile_part = f" + compile {fmt(compile_s)} s" if compile_s is not None else ""
    # a remote server's answer: the client's timings over HTTP stand in for the engine's (figures.shown)
    ttft, decode = figures.shown(m, "ttft_ms"), figures.shown(m, "decode_tok_s")
    prefill = figures.read(m, "prefill_tok_s")  # no stand-in over HTTP
    ttft_how, decode_how = figures.over_http(ttft, "ttft_ms"), figures.over_http(decode, "decode_tok_s")
    rate = f"{fmt(decode.value)} tok/s{decode_how}" + (f" (all {len(per)} candidates)" if batch else "")
    line = " · ".join(
        [
            count,
            f"{ttft.spec.label} {fmt(ttft.value, ' ms', 0)}" + compile_part,
            rate,
            options_label(options),
            f"{gap} {fmt(m.get('kernel_gap_pct'), '%', top=100.0)}",
        ]
    )
    speculating = bool(options and options.get("speculation", "off") != "off")
    # asked for and not run (a refused draft model, several candidates): the options say off, the figures why
    refused = figures.speculation_refused(m)
    if speculating:
        accepted = m.get("acceptance_rate")
        line += (
            f" · {fmt(m.get('tokens_per_step'), ' tok/step', 2)}, "
            f"{NA if accepted is None else fmt(100 * accepted, '%', 0, top=100.0)} accepted"
        )
    elif refused is not None:
        line += f" · drafting off: {first_clause(refused)}"
    reused = m.get("prompt_reused_tokens")
    if reused:
        line += f" · prompt {m.get('prompt_tokens')} ({reused} reused)"
    if m.get("prompt_cut"):
        line += f" · context full: {m['prompt_cut']}"
    if finish_reason:
        line += f" · {finish_words(finish_reason)}"
    unavailable = m.get("unavailable") or {}
    # each count with its source (the engine's counter, the server's usage), or n/a with the reason ("None")
    new, prompt = figures.read(m, "new_tokens_total"), figures.read(m, "prompt_tokens")
    tips = [
        *(
            _sourced(label, f.value, f"{f.value:,}" if f.value is not None else NA, f.source, f.reason)
            for label, f in (("New tokens", new), ("Prompt tokens", prompt))
        ),
        _sourced(
            f"Time to first token{ttft_how}",
            ttft.value,
            fmt(ttft.value, " ms", 0 if ttft.value is None or ttft.value >= 10 else 2)
            + (f", after {fmt(compile_s)} s compiling / capturing the decode step" if compile_s is not None else ""),
            ttft.source,
            ttft.reason,
        ),
        _sourced("Prefill", prefill.value, f"{fmt(prefill.value)} tok/s", prefill.source, prefill.reason),
        _sourced(
            f"Decode{decode_how}",
            decode.value,
            f"{fmt(decode.value)} tok/s"
            + (f", all {len(per)} candidates together" if batch else "")
            + ("" if decode_how else ", traced window left out"),
            decode.source,
            decode.reason,
        ),
        _steps_line(m),
        f"Options: {describe_options(options) if options else NA}",
    ]
    if reused is not None:
        tips.append(
            f"Prompt: {reused} tokens reused, {_or_na(m.get('prompt_computed_tokens'))} computed — source: "
            f"{m.get('prompt_reuse_source') or NA}"
        )
    if m.get("overflow_policy"):
        tips.append(
            f"Context full: {m.get('prompt_cut') or 'nothing dropped'} (overflow policy: "
            f"{m['overflow_policy']}; source: the engine's prompt fitting)"
        )
    tips.append(
        _sourced(
            gap.capitalize(),
            m.get("kernel_gap_pct"),
            fmt(m.get("kernel_gap_pct"), "%", top=100.0),
            m.get("kernel_gap_source"),
            unavailable.get("kernel_gap_pct") or unavailable.get("kernel_gap"),
        )
    )
    tips.append(
        _sourced(
            "Launches per step",
            m.get("launches_per_step"),
            fmt(m.get("launches_per_step"), "", 0),
            m.get("launches_per_step_source"),
            unavailable.get("launches_per_step"),
        )
    )
    tips.append(
        _sourced(
            "Tokens per step",
            m.get("tokens_per_step"),
            fmt(m.get("tokens_per_step"), "", 2),
            figures.SPEC_COUNT,
            unavailable.get("tokens_per_step"),
        )
    )
    if speculating or refused is not None or m.get("acceptance_rate") is not None:
        accepted = m.get("acceptance_rate")
        shown = (
            (
                f"{fmt(100 * accepted, '%', 1, top=100.0)} ({m.get('accepted_tokens')} of {m.get('drafted_tokens')} drafts, "
                f"{m.get('verify_steps')} verify steps{_paused(m.get('paused_steps'))})"
            )
            if accepted is not None
            else NA
        )
        tips.append(
            _sourced(
                "Drafts accepted", accepted, shown, m.get("speculation_source"), unavailable.get("acceptance_rate")
            )
        )
    if finish_reason:
        tips.append(f"Finished: {finish_words(finish_reason)}")
    if metrics and options:
        tips.extend(diagnosis_lines(metrics, options, device))
    return line, "\n".join(tips)


def _paused(steps: Optional[int]) -> str:
    """The steps the adaptive draft length paused drafting in, for the drafts line; nothing where there were none
    (or the answer was kept before they were counted)."""
    return f", {steps} held back while drafts did not pay" if steps else ""


def _or_na(v: Any) -> str:
    """A count as it was kept, or n/a where it was not (an answer imported from an older export)."""
    return NA if v is None else str(v)
