"""The HUD's bars, compare columns and plots are built from the figures registry."""

from __future__ import annotations

from engine import figures
from engine.types import GenerationMetrics
from ui.hud import fmt
from ui.hud.bars import BAR_ROWS
from ui.hud.compare_table import COLUMNS
from ui.hud.series import SAMPLE_FIELDS, STEP_COLUMNS
from ui.hud.series_view import PLOTS


def test_hud_rows_columns_and_plots_are_registered_figures():
    for row in BAR_ROWS:
        assert row.title == figures.spec(row.key).label
    for col in COLUMNS:
        if col.kind == "metric":
            s = figures.spec(col.key)
            assert (col.title, col.better, col.source_field) == (s.label, s.better, s.source_field)
    for plot in PLOTS:
        assert plot.title == figures.spec(plot.key).label
        if plot.from_steps:
            assert plot.key in STEP_COLUMNS
        else:
            assert plot.key in SAMPLE_FIELDS
    assert set(SAMPLE_FIELDS) == {f.key for f in figures.SAMPLE_FIGURES}


def test_values_are_written_in_the_registered_unit():
    assert fmt.figure_value(figures.spec("kernel_gap_pct"), 25.81) == "25.8 %"
    assert fmt.figure_value(figures.spec("decode_tok_s"), 969.4) == "969.4 tok/s"
    assert fmt.figure_value(figures.spec("peak_memory_bytes"), 3 * 2**30) == "3.0 GiB"
    assert fmt.figure_value(figures.spec("launches_per_step"), 348.0) == "348"
    assert fmt.figure_value(figures.spec("ttft_ms"), None) == fmt.NA


def test_sizes_and_counts_move_to_the_next_unit_rather_than_round_up_to_it():
    """The model panel showed 1,048,570 bytes as "1024.0 KiB" and 999,960 parameters as "1000.0K"."""
    assert [fmt.size(v) for v in (0, 1023, 1024, 1_048_570, 1023.9 * 2**20, 2**30 - 1, 3 * 2**30)] == [
        "0 B",
        "1,023 B",
        "1.0 KiB",
        "1.0 MiB",
        "1,023.9 MiB",
        "1.0 GiB",
        "3.0 GiB",
    ]
    assert [fmt.count(v) for v in (999, 1_000, 999_949, 999_960, 134_515_008, 8_030_261_248)] == [
        "999",
        "1.0K",
        "999.9K",
        "1.0M",
        "134.5M",
        "8.0B",
    ]
    assert fmt.size(None) == fmt.count(None) == fmt.NA


def test_a_compare_column_formats_and_sources_from_the_registry():
    col = next(c for c in COLUMNS if c.key == "gpu_util_pct")
    m = GenerationMetrics()
    m.put("gpu_util_pct", 42.0, "GPU util — NVML samples")
    assert col.format(m.gpu_util_pct) == "42.0 %"
    assert m.figure(col.key).source == "GPU util — NVML samples"
