"""The figures registry (engine/figures.py) and every place that reads figures agree on names and sources."""

from __future__ import annotations

from dataclasses import fields

import pytest

from engine import figures
from engine.ladder import MEDIAN_FIELDS, SOURCE_FIELDS, median_metrics
from engine.types import GenerationMetrics, MonitorSample

BOOKKEEPING = {
    "new_tokens",
    "unavailable",
    "overflow_policy",
    "prompt_cut",
}  # GenerationMetrics fields that are not figures


def _metric_fields() -> set[str]:
    source_fields = {f.source_field for f in figures.FIGURES if f.source_field}
    return {f.name for f in fields(GenerationMetrics)} - BOOKKEEPING - source_fields


def test_every_generation_field_is_registered_and_every_entry_is_a_field():
    registered = {f.key for f in figures.GENERATION_FIGURES}
    assert _metric_fields() == registered
    names = {f.name for f in fields(GenerationMetrics)}
    for f in figures.GENERATION_FIGURES:
        if f.source_field:
            assert f.source_field in names, f"{f.key}: source field {f.source_field} missing from GenerationMetrics"


def test_monitor_sample_fields_are_the_sample_figures():
    sample = {f.name for f in fields(MonitorSample)} - {"t", "sources", "unavailable"}
    assert sample == {f.key for f in figures.SAMPLE_FIGURES}


def test_each_figure_names_a_source_or_a_source_field():
    for f in figures.FIGURES:
        if "sample" in f.scopes and "generation" not in f.scopes:
            continue  # the monitor names each sample's source
        assert f.source is not None or f.source_field is not None, f.key
        assert f.better in (-1, 0, 1)
        assert f.label and f.unit


def test_a_fixed_source_gives_way_to_the_one_a_run_names():
    m = GenerationMetrics()
    m.put("prompt_tokens", 12)
    assert m.figure("prompt_tokens").source == figures.ENGINE_COUNT
    m.put("prompt_tokens", 12, figures.SERVER_USAGE)
    assert m.figure("prompt_tokens").source == figures.SERVER_USAGE
    assert figures.read(m.to_dict(), "new_tokens_total").source == figures.SERVER_USAGE  # the run's, both counts


def test_keys_are_unique_and_lookup_of_an_unknown_figure_says_where_to_register():
    assert len({f.key for f in figures.FIGURES}) == len(figures.FIGURES)
    with pytest.raises(KeyError, match="engine/figures.py"):
        figures.spec("acceptance_rate_typo")


def test_put_sets_value_and_source_and_clears_na():
    m = GenerationMetrics()
    m.mark_na("kernel_gap_pct", "profiler window off")
    assert m.figure("kernel_gap_pct") == figures.Figure(
        figures.spec("kernel_gap_pct"), None, None, "profiler window off"
    )
    m.put("kernel_gap_pct", 25.8, "kernel gap — torch.profiler")
    fig = m.figure("kernel_gap_pct")
    assert (fig.value, fig.source, fig.reason) == (25.8, "kernel gap — torch.profiler", None)
    assert "kernel_gap_pct" not in m.unavailable and m.kernel_gap_source == "kernel gap — torch.profiler"
    m.mark_na("kernel_gap_pct", "no events")
    assert m.kernel_gap_pct is None and m.kernel_gap_source is None and m.unavailable["kernel_gap_pct"] == "no events"


def test_a_machine_dependent_figure_needs_its_source_and_a_fixed_one_has_it():
    m = GenerationMetrics()
    with pytest.raises(ValueError, match="source"):
        m.put("gpu_util_pct", 50.0)
    with pytest.raises(ValueError, match="mark_na"):
        m.put("ttft_ms", None)
    m.put("ttft_ms", 12.5)
    assert m.figure("ttft_ms").source == figures.ENGINE_TIMING


def test_dict_form_reads_the_same_figure():
    m = GenerationMetrics(decode_tok_s=17.5)
    m.put("gpu_util_pct", 40.0, "GPU util — NVML samples")
    m.mark_na("sm_activity_pct", "no GPM on this GPU")
    d = m.to_dict()
    for key in ("decode_tok_s", "gpu_util_pct", "sm_activity_pct", "kernel_gap_pct"):
        assert figures.read(d, key) == m.figure(key)


def test_bench_medians_cover_every_generation_figure_with_its_source():
    assert set(MEDIAN_FIELDS) == {f.key for f in figures.GENERATION_FIGURES}
    assert set(SOURCE_FIELDS) == {f.source_field for f in figures.GENERATION_FIGURES if f.source_field}
    a, b = GenerationMetrics(decode_tok_s=10.0), GenerationMetrics(decode_tok_s=30.0)
    b.put("kernel_gap_pct", 5.0, "op gap — torch.profiler CPU ops")
    out = median_metrics([a.to_dict(), b.to_dict(), GenerationMetrics(decode_tok_s=20.0).to_dict()])
    assert out["decode_tok_s"] == 20.0 and out["kernel_gap_source"] == "op gap — torch.profiler CPU ops"


def test_bench_medians_keep_counts_whole_and_each_candidates_tokens():
    """The ladder's compare rows exported new_tokens [] beside new_tokens_total 24.0, and bytes as floats."""
    runs = [
        GenerationMetrics(new_tokens=[24, 20], new_tokens_total=44, decode_steps=23, peak_memory_bytes=1000).to_dict(),
        GenerationMetrics(new_tokens=[24, 22], new_tokens_total=46, decode_steps=23, peak_memory_bytes=1001).to_dict(),
    ]
    out = median_metrics(runs)
    assert out["new_tokens"] == [24, 20] and out["new_tokens_total"] == 45 and type(out["new_tokens_total"]) is int
    assert type(out["decode_steps"]) is int and out["peak_memory_bytes"] == 1000.5  # a half stays a half
    assert type(median_metrics(runs[:1])["peak_memory_bytes"]) is int


@pytest.mark.parametrize(
    "v, digits, top, text",
    [
        (0.004, 1, None, "<0.1"),
        (-0.004, 1, None, ">-0.1"),
        (0.0, 1, None, "0.0"),
        (0.4, 0, None, "<1"),
        (99.96, 1, 100.0, ">99.9"),
        (99.6, 0, 100.0, ">99"),
        (100.0, 1, 100.0, "100.0"),
        (123.4, 1, 100.0, "123.4"),  # a DRAM estimate may pass 100
        (1234.4, 0, None, "1,234"),
    ],
)
def test_a_value_is_never_rounded_onto_a_bound_it_does_not_reach(v, digits, top, text):
    assert figures.rounded(v, digits, top) == text


def test_a_remote_answer_s_timings_stand_in_for_the_engine_s():
    m = GenerationMetrics()
    m.put("http_ttft_ms", 42.0)
    m.mark_na("ttft_ms", "the model runs on a remote server")
    fig = figures.shown(m, "ttft_ms")
    assert (fig.spec.label, fig.value, fig.source) == ("TTFT (HTTP)", 42.0, figures.HTTP_TIMING)
    assert figures.shown(m.to_dict(), "ttft_ms").value == 42.0
    fig = figures.shown(m, "decode_tok_s")  # no stand-in measured: the figure itself, n/a
    assert fig.spec.key == "decode_tok_s" and fig.value is None


def test_a_count_marked_na_leaves_the_source_of_the_other_that_shares_it():
    """A server's usage with a prompt count but no completion count: the prompt count still names the server."""
    m = GenerationMetrics()
    m.put("prompt_tokens", 12, figures.SERVER_USAGE)
    m.mark_na("new_tokens_total", "the server reported no completion count")
    assert m.figure("prompt_tokens").source == figures.SERVER_USAGE
    m.mark_na("prompt_tokens", "none either")
    assert m.count_source is None


def test_json_of_a_path_whose_bytes_are_not_utf8_is_written_escaped():
    """A data folder or model path of such bytes (lone surrogates in Python) made every JSON written with
    ensure_ascii=False fail to encode: the smoke test's report, a bench report, a stored figure."""
    import json
    import os

    path = os.fsdecode(b"/data/caf\xe9")
    text = figures.strict_json({"data": path, "answer": "été"}, ensure_ascii=False)
    text.encode("utf-8")
    assert json.loads(text) == {"data": path, "answer": "été"}
    assert figures.strict_json({"answer": "été"}, ensure_ascii=False) == '{"answer": "été"}'  # as before
