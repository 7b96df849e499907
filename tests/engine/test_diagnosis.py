"""The diagnosis rules on figures recorded by real runs (docs/bench-gpu.json: an H200 ladder; docs/bench-cpu.json:
the 2-core CPU ladder; docs/gpu/h200-gpu-check-2-kernels.json: the kernels of the compiled, captured step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.diagnosis import diagnose
from engine.types import EngineOptions, preset_options

DOCS = Path(__file__).resolve().parents[2] / "docs"


def rung(path: str, name: str) -> tuple[dict, dict]:
    doc = json.loads((DOCS / path).read_text())
    row = next(r for r in doc["rungs"] if r["name"] == name)
    return row["runs"][0]["metrics"], row["options"]


@pytest.mark.parametrize(
    "name, verdict, line, step",
    [
        ("naive", "host sync", "host sync every token (.item()): the GPU idle 90.0 % of each step", "device sampling"),
        (
            "device-sampling",
            "launch-bound",
            "launch-bound: the GPU idle 89.6 % between kernels, 296× over the memory floor",
            "static KV cache (compile and CUDA graphs need it)",
        ),
        (
            "first-fixes",
            "launch-bound",
            "launch-bound: the GPU idle 89.6 % between kernels, 313× over the memory floor",
            "compile",
        ),
        (
            "compile",
            "launch-bound",
            "launch-bound: the GPU idle 88.6 % between kernels, 124× over the memory floor",
            "CUDA graph",
        ),
        (
            "cuda-graph",
            "launch-bound",
            "launch-bound: the GPU idle 25.5 % between kernels, 29× over the memory floor",
            "fused kernels",
        ),
    ],
)
def test_the_h200_ladder(name, verdict, line, step):
    metrics, options = rung("bench-gpu.json", name)
    d = diagnose(metrics, options)
    assert (d.verdict, d.line, d.next_step) == (verdict, f"{line} → {step}", step)
    gap = metrics["kernel_gap_pct"]
    assert d.evidence[0] == f"gap {gap:.1f} % ({metrics['kernel_gap_source']})"  # the HUD's digits
    assert d.missing == ["launches a step: not measured"]  # this run predates the launches figure


def test_every_claim_carries_its_figure_and_source():
    metrics, options = rung("bench-gpu.json", "cuda-graph")
    d = diagnose(metrics, options)
    assert (
        f"DRAM bandwidth {metrics['dram_bw_util_pct']:.1f} % of peak ({metrics['dram_bw_util_source']})" in d.evidence
    )
    assert round(100 / metrics["dram_bw_util_pct"]) == 29


def test_the_captured_step_with_its_kernel_count():
    doc = json.loads((DOCS / "gpu" / "h200-gpu-check-2-kernels.json").read_text())
    v = doc["sections"]["kernels"]["result"]["variants"][0]
    metrics = {
        "kernel_gap_pct": v["kernel_gap_pct"],
        "kernel_gap_source": v["kernel_gap_source"],
        "launches_per_step": v["kernels_per_pass"],
        "launches_per_step_source": "kernels per pass, torch.profiler",
    }
    d = diagnose(metrics, preset_options("cuda-graph", EngineOptions(device="cuda")).to_dict())
    assert d.line == "launch-bound: 348 kernels a token, the GPU idle 21.8 % between kernels → fused kernels"
    assert "348 kernels a step (kernels per pass, torch.profiler)" in d.evidence
    assert "DRAM bandwidth: not measured" in d.missing and "SM activity: not measured" in d.missing


@pytest.mark.parametrize("more", [{"candidates": 4}, {"speculation": "ngram"}])
def test_a_step_that_makes_several_tokens_counts_its_kernels_a_step(more):
    """With candidates (a token each a step) or speculation (several a step), the claim read "348 kernels a token"
    from the launches-per-step figure."""
    metrics = {"kernel_gap_pct": 22.0, "kernel_gap_source": "trace", "launches_per_step": 348.0}
    options = preset_options("cuda-graph", EngineOptions(device="cuda")).with_(**more).to_dict()
    d = diagnose(metrics, options)
    assert d.verdict == "launch-bound" and "348 kernels a step, the GPU idle 22.0 %" in d.line
    assert "a token" not in d.line


@pytest.mark.parametrize(
    "name, step",
    [
        ("naive", "static KV cache (compile and CUDA graphs need it)"),
        ("first-fixes", "int8 weights"),
        ("compile", "int8 weights"),
    ],
)
def test_the_cpu_ladder_says_what_it_cannot_know(name, step):
    metrics, options = rung("bench-cpu.json", name)
    d = diagnose(metrics, options)
    gap = metrics["kernel_gap_pct"]
    shown = f"{gap:.1f} %"
    assert d.verdict == "CPU" and d.line == f"CPU: ops run back to back (gap {shown}); ops a step n/a → {step}"
    assert d.missing == ["launches a step: not measured"]  # and nothing about a GPU


def test_cpu_op_bound_with_the_op_count():
    metrics = {
        "kernel_gap_pct": 12.0,
        "kernel_gap_source": "op gap — torch.profiler CPU ops",
        "launches_per_step": 1565.0,
        "launches_per_step_source": "top-level aten ops per step",
    }
    d = diagnose(metrics, preset_options("first-fixes", EngineOptions(device="cpu"), half_dtype="fp32").to_dict())
    assert d.line == "CPU, op-bound: 1,565 ops a step, 12.0 % idle between ops → int8 weights"


@pytest.mark.parametrize("weights, step", [("native", "int8 weights"), ("int8", "int4 weights"), ("int4", None)])
def test_a_cpus_next_step_is_fewer_weight_bytes_not_compile(weights, step):
    """On a CPU the eager step runs the own layer kernel, which a compiled step does not: the advice is the next
    weight format, and none past int4; without a static cache, that first."""
    metrics = {"kernel_gap_pct": 9.0, "launches_per_step": 65.0}
    options = EngineOptions(device="cpu", dtype="fp32", kv_cache="static", weights=weights).to_dict()
    d = diagnose(metrics, options)
    assert d.next_step == step
    assert d.line == "CPU, op-bound: 65 ops a step, 9.0 % idle between ops" + (f" → {step}" if step else "")
    dynamic = diagnose(metrics, EngineOptions(device="cpu", kv_cache="dynamic", weights=weights).to_dict())
    assert dynamic.next_step == "static KV cache (compile and CUDA graphs need it)"
    unavailable = {**options, "unavailable": {"weights": "the transformers fallback keeps its own linears"}}
    assert diagnose(metrics, unavailable).next_step is None  # no advice the model cannot take


def test_a_refused_weight_format_still_leaves_the_others_advised():
    """int4 asked and refused (the run kept native weights): with the limits recorded, int8, which runs here, is
    still the next step; with both formats among the limits, or no limits recorded (an older stored answer),
    nothing is advised."""
    from engine.types import options_as_run

    metrics = {"kernel_gap_pct": 9.0, "launches_per_step": 65.0}
    ran = EngineOptions(device="cpu", dtype="fp32", kv_cache="static", weights="native")
    why = "int4 needs inputs in groups of 32; w2 is 64x48"
    refused = {"weights": why}
    d = diagnose(metrics, options_as_run(ran, refused, {("weights", "int4"): why}))
    assert d.next_step == "int8 weights"
    both = {("weights", "int4"): why, ("weights", "int8"): "this torch has no aten._weight_int8pack_mm for the CPU"}
    assert diagnose(metrics, options_as_run(ran, refused, both)).next_step is None
    assert diagnose(metrics, {**ran.to_dict(), "unavailable": refused}).next_step is None


def test_memory_bound_and_missing_gap():
    metrics = {"kernel_gap_pct": 4.0, "dram_bw_util_pct": 82.0, "dram_bw_util_source": "NVML GPM"}
    d = diagnose(metrics, preset_options("cuda-graph", EngineOptions(device="cuda")).to_dict())
    assert d.line == "memory-bound: DRAM bandwidth 82.0 % of peak → more candidates (each weight read serves all)"
    d = diagnose({"unavailable": {"kernel_gap_pct": "profiler window off"}}, EngineOptions().to_dict(), "cpu")
    assert d.verdict == "unknown" and d.next_step == "turn on Measure the gap (--profile-window)"
    assert d.line.startswith("not enough figures to say what limits this answer: gap: profiler window off")


def _cuda(**changes):
    """The options a CUDA generation ran with after the CUDA-graph rung, with `changes` (unavailable included)."""
    base = preset_options("cuda-graph", EngineOptions(device="cuda")).to_dict()
    return {**base, **changes}


LAUNCH_BOUND = {"kernel_gap_pct": 22.0, "launches_per_step": 150.0}


@pytest.mark.parametrize(
    "changes, step",
    [
        ({}, "fused kernels"),
        # the fused step ran (compile refused: the fused kernels replace it): the ladder ends there
        ({"kernels": "fused", "compile": False, "unavailable": {"compile": "the fused kernels replace it"}}, None),
        # int8 weights run on the torch kernels: the next rung that can take them
        ({"weights": "int8"}, "speculation ngram (drafts from the conversation)"),
        ({"unavailable": {"kernels": "this GPU is too old"}}, "speculation ngram (drafts from the conversation)"),
        # several candidates cannot share drafts, and speculation already on is not advised again
        ({"weights": "int8", "candidates": 4}, None),
        ({"weights": "int8", "speculation": "ngram"}, None),
        # a rung the machine refused is skipped
        ({"cuda_graph": False, "unavailable": {"cuda_graph": "no captured step"}}, "fused kernels"),
        ({"compile": False}, "compile"),
    ],
)
def test_the_cuda_advice_is_a_rung_not_taken_and_not_refused(changes, step):
    d = diagnose(LAUNCH_BOUND, _cuda(**changes))
    assert d.verdict == "launch-bound" and d.next_step == step


def test_a_model_on_the_fallback_gets_no_advice_it_cannot_take():
    """The transformers fallback refuses the static cache (and with it every rung after it) on either device."""
    refused = {"kv_cache": "llama runs on the transformers fallback, which uses its own dynamic cache"}
    for device in ("cpu", "cuda"):
        options = {**EngineOptions(device=device, kv_cache="dynamic").to_dict(), "unavailable": refused}
        assert diagnose(LAUNCH_BOUND, options).next_step is None
        plain = EngineOptions(device=device, kv_cache="dynamic").to_dict()  # chosen, not refused: advise it
        assert diagnose(LAUNCH_BOUND, plain).next_step == "static KV cache (compile and CUDA graphs need it)"


@pytest.mark.parametrize(
    "weights, refused, step",
    [
        ("native", {}, "int8 weights"),
        ("int8", {}, "int4 weights"),
        ("int4", {}, None),
        ("native", {"weights": "x"}, None),
    ],
)
def test_memory_bound_with_candidates_advises_the_next_weight_format(weights, refused, step):
    metrics = {"kernel_gap_pct": 4.0, "dram_bw_util_pct": 82.0}
    d = diagnose(metrics, _cuda(candidates=4, weights=weights, unavailable=refused))
    assert d.verdict == "memory-bound" and d.next_step == step


def test_a_cpu_step_against_its_measured_memory_bandwidth():
    """On a CPU the bandwidth figure is an estimate against the read bandwidth measured on it: at 60 % or more the
    step is memory-bound (fewer weight bytes next); below, the op-bound line names it as evidence."""
    source = "DRAM bandwidth — estimate: bytes per step / step time / this CPU's measured read bandwidth (30 GB/s)"
    options = EngineOptions(device="cpu", dtype="fp32", kv_cache="static").to_dict()
    base = {"kernel_gap_pct": 3.1, "launches_per_step": 64.0, "dram_bw_util_source": source}
    d = diagnose({**base, "dram_bw_util_pct": 72.0}, options)
    assert d.verdict == "CPU, memory-bound" and d.next_step == "int8 weights"
    assert d.line == "CPU, memory-bound: a step reads memory at 72.0 % of its measured bandwidth → int8 weights"
    assert f"memory read at 72.0 % of the measured bandwidth ({source})" in d.evidence
    d = diagnose({**base, "dram_bw_util_pct": 43.5}, {**options, "weights": "int4"})
    assert d.verdict == "CPU, op-bound" and d.next_step is None
    assert (
        d.line
        == "CPU, op-bound: 64 ops a step, 3.1 % idle between ops, memory read at 43.5 % of its measured bandwidth"
    )


def test_the_fallback_refusing_the_fused_kernels_and_the_static_cache_gets_no_advice():
    refused = {
        "kernels": "llama runs on the transformers fallback, which has no fused kernels",
        "kv_cache": "llama runs on the transformers fallback, which uses its own dynamic cache",
    }
    options = {**EngineOptions(device="cuda", kv_cache="dynamic", kernels="torch").to_dict(), "unavailable": refused}
    assert diagnose(LAUNCH_BOUND, options).next_step is None


@pytest.mark.parametrize(
    "changes, step",
    [
        ({"kernels": "fused", "compile": False, "candidates": 4}, None),  # fused kernels read native weights only
        ({"unavailable": {"candidates": "out of device memory: 2 candidates"}}, "int8 weights"),
        ({"speculation": "ngram"}, "int8 weights"),  # more candidates would switch speculation off
    ],
)
def test_cuda_memory_bound_advice_respects_the_ladder(changes, step):
    d = diagnose({"kernel_gap_pct": 4.0, "dram_bw_util_pct": 82.0}, _cuda(**changes))
    assert d.verdict == "memory-bound" and d.next_step == step


def test_a_cpu_memory_bound_step_is_advised_fewer_bytes_and_cached_reads_are_not_called_memory_bound():
    dynamic = EngineOptions(device="cpu", dtype="fp32", kv_cache="dynamic").to_dict()
    d = diagnose({"kernel_gap_pct": 3.0, "launches_per_step": 900.0, "dram_bw_util_pct": 75.0}, dynamic)
    assert d.verdict == "CPU, memory-bound" and d.next_step == "int8 weights"
    d = diagnose({"kernel_gap_pct": 3.0, "launches_per_step": 64.0, "dram_bw_util_pct": 150.0}, dynamic)
    assert d.verdict == "CPU, op-bound" and "memory read at 150.0 % of its measured bandwidth" in d.line


def test_a_figure_that_is_not_finite_is_no_evidence():
    """An infinite DRAM share (NVML GPM) said "memory-bound: DRAM bandwidth inf % of peak"; a NaN gap read as "the
    GPU is busy (gap nan %)"."""
    cuda = preset_options("cuda-graph", EngineOptions(device="cuda")).to_dict()
    d = diagnose({"kernel_gap_pct": 30.0, "dram_bw_util_pct": float("inf"), "launches_per_step": 348.0}, cuda)
    assert d.verdict == "launch-bound" and "inf" not in d.line and "DRAM bandwidth: not measured" in d.missing
    d = diagnose({"kernel_gap_pct": float("nan"), "sm_activity_pct": 20.0}, cuda)
    assert d.verdict == "unknown" and "nan" not in d.line


@pytest.mark.parametrize(
    "metrics, device, quoted",
    [
        ({"kernel_gap_pct": 14.94, "sm_activity_pct": 40.0}, "cuda", "GPU kernels: the GPU is busy (gap 14.9 %)"),
        ({"kernel_gap_pct": 14.97, "sm_activity_pct": 40.0}, "cuda", "launch-bound: the GPU idle 15.0 % between"),
        ({"kernel_gap_pct": 49.7}, "cuda-host", "the GPU idle 49.7 % between kernels"),  # not "50 %": host sync's
        ({"kernel_gap_pct": 3.0, "launches_per_step": 64.0, "dram_bw_util_pct": 59.7}, "cpu", "memory read at 59.7 %"),
        ({"kernel_gap_pct": 30.0, "launches_per_step": 0.375}, "cuda", "launch-bound: <1 kernels a token"),
    ],
)
def test_figures_are_quoted_as_the_hud_shows_them(metrics, device, quoted):
    """The line rounded shares to whole numbers where the HUD shows one decimal: 49.7 % was quoted "50 %" beside
    the verdict that 50 % would not get, and 0.375 kernels a step "0"."""
    options = EngineOptions(device="cuda" if device.startswith("cuda") else "cpu", kv_cache="static")
    if device == "cuda-host":
        options = options.with_(sampling="host")
    d = diagnose(metrics, options.to_dict(), "cuda" if device.startswith("cuda") else "cpu")
    assert quoted in d.line, d.line


def test_a_cpu_step_idle_between_its_ops_is_not_called_back_to_back():
    cpu = EngineOptions(device="cpu").to_dict()
    d = diagnose({"kernel_gap_pct": 80.0}, cpu, "cpu")
    assert d.verdict == "CPU" and d.line.startswith("CPU: idle 80.0 % between ops; ops a step n/a")
    # the verdict parts at the figure as quoted: 14.97 % is quoted 15.0 %, and said as 15.0 % is
    for gap in (14.97, 15.0):
        assert diagnose({"kernel_gap_pct": gap}, cpu, "cpu").line.startswith("CPU: idle 15.0 % between ops")
    assert diagnose({"kernel_gap_pct": 14.94}, cpu, "cpu").line.startswith("CPU: ops run back to back (gap 14.9 %)")
