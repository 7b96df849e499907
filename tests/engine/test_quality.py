"""The quality bench: perplexity, top-1 agreement with fp32 and decode tok/s per weight format, on a tiny model
(the figures for the default model are in docs/benchmarks.md); a format this machine lacks is skipped with why."""

from __future__ import annotations

import json
import math

from cli_runner import bench_argv

from app.cli import main
from engine.quality import QualityConfig, format_quality_table, run_quality


def test_quality_report_per_format(tiny_llama, monkeypatch):
    import engine.quant as quant

    monkeypatch.setattr(quant, "has_op", lambda name: name != "_weight_int4pack_mm_for_cpu")
    report = run_quality(QualityConfig(model=str(tiny_llama), decode_tokens=4, repeats=2), progress=lambda m: None)
    by = {f["label"]: f for f in report["formats"]}
    assert list(by) == ["fp32", "bf16", "int8", "int4"]
    assert by["fp32"]["top1_agreement_vs_fp32"] == 1.0
    tokens = report["text"]["tokens"]
    assert tokens > 2000 and by["fp32"]["positions"] == tokens - 1
    for label in ("fp32", "bf16", "int8"):
        f = by[label]
        assert f["status"] == "ok" and math.isfinite(f["perplexity"]) and f["perplexity"] > 1
        assert 0.0 <= f["top1_agreement_vs_fp32"] <= 1.0
        assert f["decode_tok_s"] > 0 and len(f["decode_tok_s_runs"]) == 2
    assert by["int8"]["bytes_per_token"] < by["bf16"]["bytes_per_token"] < by["fp32"]["bytes_per_token"]
    assert by["int4"]["status"] == "skipped" and "_weight_int4pack_mm_for_cpu" in by["int4"]["reason"]
    table = format_quality_table(report)
    assert "| int4 | skipped: weights: this torch has no" in table and "| fp32 |" in table
    import importlib.util

    installed = importlib.util.find_spec("llama_cpp") is not None  # the optional extra, on either kind of machine
    why = "llama.cpp reads GGUF files" if installed else "llama-cpp-python is not installed"
    assert report["llama_cpp"]["status"] == "skipped" and why in report["llama_cpp"]["reason"] and why in table


def test_bench_quality_cli_writes_json(tiny_llama, tmp_path, capsys):
    out = tmp_path / "quality.json"
    assert main(bench_argv("--quality", tiny_llama, out)) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "quality" and [f["label"] for f in data["formats"]] == ["fp32", "bf16", "int8", "int4"]
    assert all(f["status"] == "ok" for f in data["formats"])
    assert "perplexity" in capsys.readouterr().out
