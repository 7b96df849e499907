"""What limits a generation, in words: a verdict from its own figures, the evidence, and the one option to try next.

Every claim names the figure behind it (value and source); a rule whose figures are missing makes no claim, and
the figures that were missing are listed with the reason the metrics give. Plain data in, plain data out: the
HUD, the stats tooltip and `gapless generate --json` show the same result.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from engine import figures
from engine.types import server_decides

HOST_SYNC_GAP_PCT = 50.0  # idle share of a traced step above which per-token host reads dominate
LAUNCH_GAP_PCT = 15.0  # idle share above which launch overhead, not kernel time, sets the pace
MEMORY_BOUND_PCT = 60.0  # DRAM bandwidth share above which the weights' reads set the pace
CACHE_SERVED_PCT = 110.0  # a CPU estimate above this says caches served part of the bytes: no memory-bound claim

# The figures the rules read, and how they are named in the list of missing ones.
FIGURES = {
    "kernel_gap_pct": "gap",
    "launches_per_step": "launches a step",
    "dram_bw_util_pct": "DRAM bandwidth",
    "sm_activity_pct": "SM activity",
    "gpu_util_pct": "GPU util",
}
CPU_FIGURES = ("kernel_gap_pct", "launches_per_step")
WEIGHT_FORMATS = ("native", "int8", "int4")  # fewer bytes a token from each to the next


@dataclass(frozen=True)
class Diagnosis:
    verdict: str  # "host sync", "launch-bound", "memory-bound", "GPU kernels", "CPU, memory-bound", "CPU, op-bound",
    # "CPU", "unknown"
    line: str  # the whole statement: verdict, its figures, and the option to try
    evidence: list[str] = field(default_factory=list)  # each figure used: "gap 89.6 % (torch.profiler ...)"
    next_step: Optional[str] = None  # the option to try next, in the toggles' words
    missing: list[str] = field(default_factory=list)  # "SM activity: no NVML on this machine"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _num(v: Any) -> Optional[float]:
    """A figure's value; None where it is none (not a number, or NaN or inf: no verdict rests on those)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        return None
    return float(v)


def _pct(v: float) -> str:
    """A share with the HUD's one decimal (whole numbers put 14.97 at the 15 % the verdicts part at, and said 50 %
    beside the HUD's 49.7 %), never rounded to 0 nor, under 100, to 100 (a DRAM estimate may pass 100)."""
    return f"{figures.rounded(v, 1, top=100.0)} %"


def _shown(v: Optional[float]) -> Optional[float]:
    """A share as _pct shows it, where that is a number (a share under 0.05 % stays itself: shown "<0.1")."""
    return v if v is None or v < 0.05 else round(v, 1)


def _count(v: float) -> str:
    """Kernels or ops a step: a whole number, one under 1 (a step run in a CUDA graph's share) not shown as 0."""
    return figures.rounded(v, 0)


def diagnose(metrics: dict[str, Any], options: dict[str, Any], device: Optional[str] = None) -> Diagnosis:
    """The verdict for one generation from GenerationMetrics.to_dict() and EngineOptions.to_dict()."""
    m, o = metrics or {}, options or {}
    if server_decides(o):
        return Diagnosis("unknown", "a remote server's answer: what limits it is measured there, not here")
    dev = device or o.get("device") or "cpu"
    cuda = dev == "cuda"
    unavailable = m.get("unavailable") or {}
    values = {k: _num(m.get(k)) for k in FIGURES}
    missing = [
        f"{FIGURES[k]}: {unavailable.get(k) or 'not measured'}"
        for k, v in values.items()
        if v is None and (cuda or k in CPU_FIGURES)
    ]

    def ev(key: str, shown: str) -> str:
        source = m.get(key.replace("_pct", "") + "_source")
        return f"{shown} ({source})" if source else shown

    # shares as quoted (one decimal): a verdict parts at the figure the line shows (14.97 % was "back to back
    # (gap 15.0 %)" where 15.0 % is "idle between ops")
    gap, dram, sm = (_shown(values[k]) for k in ("kernel_gap_pct", "dram_bw_util_pct", "sm_activity_pct"))
    launches = values["launches_per_step"]
    unit = "kernels" if cuda else "ops"
    sampling, compiled, graph = o.get("sampling"), bool(o.get("compile")), bool(o.get("cuda_graph"))
    static = o.get("kv_cache") == "static"
    weights, candidates = o.get("weights") or "native", int(o.get("candidates") or 1)
    speculating = (o.get("speculation") or "off") != "off"
    evidence: list[str] = []

    def done(verdict: str, claim: str, step: Optional[str]) -> Diagnosis:
        return Diagnosis(verdict, f"{claim} → {step}" if step else claim, evidence, step, missing)

    refused = o.get("unavailable") or {}  # option -> why this model or machine could not run what was asked
    # (option, value) pairs this model on this device never runs, whatever else is chosen (options_as_run); a
    # damaged stored answer's entries that are not (name, scalar) are passed over
    never = {
        (e.get("option"), e.get("value"))
        for e in o.get("limits") or ()
        if isinstance(e, dict) and isinstance(e.get("option"), str) and isinstance(e.get("value"), (str, bool, int))
    }
    fused = o.get("kernels") == "fused"
    # A refused static cache with a dynamic one running: only the transformers fallback refuses it (with the fused
    # kernels on, the static cache runs). Known where the static cache was asked for or probed.
    on_fallback = ("kv_cache" in refused or ("kv_cache", "static") in never) and not static

    def can(option: str, value: Any) -> bool:
        """Worth advising: neither refused in this run nor a value this model on this device never runs."""
        return option not in refused and (option, value) not in never

    def weight_step() -> Optional[str]:
        if on_fallback:
            return None
        if "weights" in refused and "limits" not in o:
            # an answer stored before the limits were recorded: which formats never run here is not known
            return None
        if cuda and fused:  # the fused kernels read the weights in the model's dtype
            return None
        after = WEIGHT_FORMATS[WEIGHT_FORMATS.index(weights) + 1 :] if weights in WEIGHT_FORMATS else ()
        return next((f"{f} weights" for f in after if ("weights", f) not in never), None)

    def launch_step() -> Optional[str]:
        if not static:
            return None if on_fallback else "static KV cache (compile and CUDA graphs need it)"
        if not cuda:
            # On a CPU the eager step runs each layer as one call of the own kernels, which a compiled step does not,
            # and fewer weight bytes are what speeds it: the default model in fp32 decoded at 13.5-14.3 tok/s compiled
            # (159 ops a step, after a 13-80 s compile) against 21.6-27.8 eager (64 ops), and at 70-106 in int8
            # (docs/benchmarks.md); int4 (its head in int8) is the last rung.
            return weight_step()
        # CUDA: the ladder's rungs in order, each one not taken and not refused here. The fused kernels replace the
        # compiled step, read the weights in the model's dtype and have no verify step for drafts.
        if not compiled and not fused and can("compile", True):
            return "compile"
        if not graph and can("cuda_graph", True):
            return "CUDA graph"
        if not fused and can("kernels", "fused") and weights == "native":
            return "fused kernels"
        if not fused and not speculating and candidates == 1 and can("speculation", "ngram"):
            return "speculation ngram (drafts from the conversation)"
        return None

    if gap is None:
        return done(
            "unknown",
            f"not enough figures to say what limits this answer: {missing[0] if missing else 'gap n/a'}",
            "turn on Measure the gap (--profile-window)"
            if "profiler window off" in (unavailable.get("kernel_gap_pct") or "")
            else None,
        )
    evidence.append(ev("kernel_gap_pct", f"gap {_pct(gap)}"))
    if launches is not None:
        evidence.append(ev("launches_per_step", f"{_count(launches)} {unit} a step"))
    # per token where a step makes one; candidates make one each a step, speculation several
    per = "a token" if candidates == 1 and not speculating else "a step"
    count = f"{_count(launches)} {unit} {per}, " if launches is not None else ""

    if cuda and sampling == "host" and gap >= HOST_SYNC_GAP_PCT:
        evidence.append("sampling on the host: .item() every token")
        return done(
            "host sync", f"host sync every token (.item()): the GPU idle {_pct(gap)} of each step", "device sampling"
        )
    if cuda and dram is not None and dram >= MEMORY_BOUND_PCT:
        evidence.append(ev("dram_bw_util_pct", f"DRAM bandwidth {_pct(dram)} of peak"))
        # not where candidates were cut for memory, would switch speculation off, or do not run (the fallback)
        more = candidates == 1 and "candidates" not in refused and not speculating and not on_fallback
        step = "more candidates (each weight read serves all)" if more else weight_step()
        return done("memory-bound", f"memory-bound: DRAM bandwidth {_pct(dram)} of peak", step)
    if cuda and gap >= LAUNCH_GAP_PCT:
        raw = values["dram_bw_util_pct"]  # the ratio from the figure itself, not its one decimal
        floor = f", {100 / raw:.0f}× over the memory floor" if raw else ""
        if dram:
            evidence.append(ev("dram_bw_util_pct", f"DRAM bandwidth {_pct(dram)} of peak"))
        return done(
            "launch-bound", f"launch-bound: {count}the GPU idle {_pct(gap)} between kernels{floor}", launch_step()
        )
    if cuda:
        if sm is not None:
            evidence.append(ev("sm_activity_pct", f"SM activity {_pct(sm)}"))
        busy = f", SM activity {_pct(sm)}" if sm is not None else ""
        return done("GPU kernels", f"GPU kernels: the GPU is busy (gap {_pct(gap)}){busy}", launch_step())
    # On a CPU the bandwidth figure is an estimate against its measured read bandwidth (engine.telemetry.bandwidth).
    memory = ""
    if dram is not None:
        evidence.append(ev("dram_bw_util_pct", f"memory read at {_pct(dram)} of the measured bandwidth"))
        # Above ~110 % the estimate's premise (every byte read from memory) does not hold: caches serve part.
        if MEMORY_BOUND_PCT <= dram <= CACHE_SERVED_PCT:
            claim = f"CPU, memory-bound: a step reads memory at {_pct(dram)} of its measured bandwidth"
            return done("CPU, memory-bound", claim, weight_step())
        memory = f", memory read at {_pct(dram)} of its measured bandwidth"
    if launches is not None:
        claim = f"CPU, op-bound: {_count(launches)} ops a step, {_pct(gap)} idle between ops{memory}"
        return done("CPU, op-bound", claim, launch_step())
    between = f"ops run back to back (gap {_pct(gap)})" if gap < LAUNCH_GAP_PCT else f"idle {_pct(gap)} between ops"
    return done("CPU", f"CPU: {between}{memory}; ops a step n/a", launch_step())
