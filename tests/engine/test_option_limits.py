"""What a model on this machine never runs (engine.protocol.option_limits): probed for every option with a value
that can be refused, carried in each result's options, and read by the diagnosis so it advises none of them."""

from __future__ import annotations

import pytest
import torch

from engine.diagnosis import diagnose
from engine.engine import Engine
from engine.kernels import INTERPRET_ENV
from engine.protocol import option_limits
from engine.types import EngineOptions, SamplingParams, limits_as_list, limits_from_list

CPU = EngineOptions(device="cpu", dtype="fp32")
MESSAGES = [{"role": "user", "content": "hi"}]


def _limits(path, options=CPU):
    eng = Engine.load(str(path), options)
    try:
        return option_limits(eng), eng
    finally:
        eng.close()


def test_a_llama_on_the_cpu_is_limited_only_where_this_machine_lacks_something(tiny_llama, monkeypatch):
    limits, _ = _limits(tiny_llama)
    cuda = torch.cuda.is_available()
    assert set(limits) == {("cuda_graph", True)} | ({("device", "cuda")} if not cuda else set())
    assert limits[("cuda_graph", True)] == "CUDA graphs need a CUDA device; this machine runs on the CPU"
    monkeypatch.setenv(INTERPRET_ENV, "0")  # the fused kernels need a GPU unless Triton interprets them
    limits, _ = _limits(tiny_llama)
    assert "Triton GPU kernels" in limits[("kernels", "fused")]
    assert ("speculation", "ngram") not in limits and ("weights", "int8") not in limits


def test_int4_is_limited_where_the_model_s_widths_do_not_group(tiny_factory):
    # 48 inputs are not in groups of 32: int4 is never possible for this model, int8 (per-channel) is
    path = tiny_factory("llama", hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    limits, _ = _limits(path)
    assert limits[("weights", "int4")].startswith("int4 needs inputs in groups of 32; wqkv is ")
    assert ("weights", "int8") not in limits


def test_the_probes_do_not_depend_on_the_other_options_in_force(tiny_llama):
    # Asked with the fused kernels and candidates on, compile and speculation are still possible on this model:
    # each value is probed with the others set as it needs them, not as they happen to be.
    eng = Engine.load(str(tiny_llama), CPU.with_(kernels="fused", candidates=2, weights="int8"))
    try:
        limits = option_limits(eng)
    finally:
        eng.close()
    for value in (("compile", True), ("speculation", "ngram"), ("kernels", "fused"), ("weights", "int4")):
        assert value not in limits, limits.get(value)


def test_the_fallback_never_runs_the_fast_path_s_options_and_its_answers_say_so(tiny_factory):
    path = tiny_factory("gpt2")
    eng = Engine.load(str(path), CPU)
    try:
        limits = option_limits(eng)
        result = eng.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=3))
    finally:
        eng.close()
    for value in (("kv_cache", "static"), ("compile", True), ("kernels", "fused"), ("weights", "int8")):
        assert "transformers fallback" in limits[value], value
    assert "transformers fallback" in limits[("speculation", "ngram")]
    assert result.limits == limits
    listed = result.to_dict()["options"]["limits"]
    assert {"option": "weights", "value": "int4", "why": limits[("weights", "int4")]} in listed
    assert limits_from_list(listed) == limits


def test_limits_round_trip_and_bad_ones_are_named():
    limits = {("compile", True): "no compiler", ("weights", "int4"): "widths"}
    assert limits_from_list(limits_as_list(limits)) == limits
    with pytest.raises(ValueError, match=r"limits\[0\] is not an object of option, value and why"):
        limits_from_list([{"option": "compile", "value": True}])
    with pytest.raises(ValueError, match=r"limits\[0\]: value is list"):
        limits_from_list([{"option": "compile", "value": [], "why": "x"}])
    with pytest.raises(ValueError, match="limits are a list, not dict"):
        limits_from_list({})


# ---- the diagnosis reads them --------------------------------------------------------------------------------

LAUNCH_BOUND = {
    "kernel_gap_pct": 40.0,
    "kernel_gap_source": "torch.profiler trace",
    "launches_per_step": 350,
    "dram_bw_util_pct": 5.0,
}


def _cuda(limits, **options):
    o = EngineOptions(device="cuda", dtype="fp16", kv_cache="static").with_(**options)
    return {**o.to_dict(), "unavailable": {}, "limits": limits_as_list(limits)}


@pytest.mark.parametrize(
    "options, limits, step",
    [
        ({}, {}, "compile"),
        ({}, {("compile", True): "no compiler"}, "CUDA graph"),
        ({"compile": True}, {("cuda_graph", True): "x"}, "fused kernels"),
        ({"compile": True, "cuda_graph": True}, {("kernels", "fused"): "old GPU"}, "speculation ngram"),
        ({"compile": True, "cuda_graph": True}, {("kernels", "fused"): "x", ("speculation", "ngram"): "y"}, None),
    ],
)
def test_the_cuda_ladder_skips_what_never_runs(options, limits, step):
    d = diagnose(LAUNCH_BOUND, _cuda(limits, **options))
    assert d.verdict == "launch-bound"
    assert (d.next_step or "").startswith(step or "") and bool(d.next_step) == bool(step)


CPU_MEMORY_BOUND = {
    "kernel_gap_pct": 3.0,
    "kernel_gap_source": "torch.profiler trace",
    "launches_per_step": 64,
    "dram_bw_util_pct": 80.0,
}


@pytest.mark.parametrize(
    "weights, kv, limits, step",
    [
        ("native", "static", {}, "int8 weights"),
        ("native", "static", {("weights", "int8"): "x"}, "int4 weights"),
        ("int8", "static", {}, "int4 weights"),
        ("int8", "static", {("weights", "int4"): "int4 needs inputs in groups of 32"}, None),
        ("native", "dynamic", {}, "int8 weights"),
        ("native", "dynamic", {("kv_cache", "static"): "the transformers fallback"}, None),  # no weight step there
    ],
)
def test_a_memory_bound_cpu_is_not_told_to_try_what_it_cannot_run(weights, kv, limits, step):
    o = {**CPU.with_(kv_cache=kv, weights=weights).to_dict(), "unavailable": {}, "limits": limits_as_list(limits)}
    d = diagnose(CPU_MEMORY_BOUND, o)
    assert d.verdict == "CPU, memory-bound"
    assert d.next_step == step


def test_a_probe_that_fails_is_left_out_and_costs_nothing(tiny_llama, monkeypatch, caplog):
    """A check that breaks (e.g. a Triton that imports but fails) must not turn a finished answer, a load or a
    switch into a failure: the other probes still give their limits and the answer comes with them."""
    eng = Engine.load(str(tiny_llama), CPU)
    real = eng.unavailable

    def breaks_on_fused(options=None):
        if options is not None and options.kernels == "fused":
            raise RuntimeError("triton: broken install")
        return real(options) if options is not None else real()

    monkeypatch.setattr(eng, "unavailable", breaks_on_fused)
    try:
        with caplog.at_level("WARNING", logger="engine.protocol"):
            result = eng.generate(MESSAGES, SamplingParams(max_new_tokens=3, temperature=0.0))
    finally:
        eng.close()
    assert result.finish_reasons == ["length"]
    assert ("kernels", "fused") not in result.limits and ("cuda_graph", True) in result.limits
    assert "checking whether kernels='fused' can run failed" in caplog.text and "broken install" in caplog.text


def test_a_damaged_stored_limit_is_passed_over_by_the_diagnosis():
    o = {**CPU.to_dict(), "unavailable": {}}
    o["limits"] = [{"option": "weights", "value": ["int8"], "why": "x"}, {"option": None, "value": {}}, "junk"]
    d = diagnose(CPU_MEMORY_BOUND, o)
    assert d.verdict == "CPU, memory-bound" and d.next_step == "int8 weights"
