"""The quality bench: perplexity, top-1 agreement with fp32 and decode tok/s per weight format, on a tiny model
(the figures for the default model are in docs/benchmarks.md); a format this machine lacks is skipped with why."""

from __future__ import annotations

import json
import math

import pytest
from cli_runner import bench_argv

from app.cli import main
from engine.quality import QualityConfig, format_quality_table, run_quality


def test_quality_report_per_format(tiny_llama, monkeypatch):
    import engine.cpu_kernels as cpu_kernels
    import engine.quant as quant

    monkeypatch.setattr(quant, "has_op", lambda name: name != "_weight_int4pack_mm_for_cpu")
    monkeypatch.setattr(cpu_kernels, "kernel", lambda: None)  # no own kernels either: int4 has no CPU kernel
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
        assert f["prefill_tok_s"] > 0 and len(f["prefill_tok_s_runs"]) == 2 and f["prefill_tokens"] > 200
    assert by["int8"]["bytes_per_token"] < by["bf16"]["bytes_per_token"] < by["fp32"]["bytes_per_token"]
    assert by["int4"]["status"] == "skipped" and "_weight_int4pack_mm_for_cpu" in by["int4"]["reason"]
    table = format_quality_table(report)
    assert "| int4 | skipped: weights: this torch has no" in table and "| fp32 |" in table
    import importlib.util

    installed = importlib.util.find_spec("llama_cpp") is not None  # the optional extra, on either kind of machine
    why = "llama.cpp reads GGUF files" if installed else "llama-cpp-python is not installed"
    assert report["llama_cpp"]["status"] == "skipped" and why in report["llama_cpp"]["reason"] and why in table


def test_bench_quality_cli_writes_json(tiny_llama, tmp_path, capsys):
    import torch

    out = tmp_path / "quality.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # so that one thread in the JSON can only come from --threads
    try:
        assert main(bench_argv("--quality", tiny_llama, out, "--threads", "1")) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads(out.read_text())
    assert data["machine"]["torch_threads"] == 1  # --threads reaches the quality bench (and llama.cpp's column)
    assert data["kind"] == "quality" and [f["label"] for f in data["formats"]] == ["fp32", "bf16", "int8", "int4"]
    assert all(f["status"] == "ok" for f in data["formats"])
    table = capsys.readouterr().out
    assert "perplexity" in table
    # where it ran and what was asked, as the other benches' reports say (the GPU under machine.cuda is only present)
    assert data["device"] == "cpu" and data["config"]["decode_tokens"] == 4 and data["config"]["device"] == "cpu"
    assert "| 0 MiB" not in table and "<1 MiB" in table  # the tiny model's weights are a fraction of one


class _FakeLlama:
    """llama_cpp.Llama's face for the column: each call advances the fake clock by a fixed cost and a cost a token;
    a prompt's tokens cost 1 ms each past what the context already holds, as llama.cpp keeps the last prompt."""

    def __init__(self, clock: list[float], **kw):
        self.clock, self.held = clock, None

    def reset(self):
        self.held = None

    def create_chat_completion(self, messages, max_tokens, temperature):
        prompt = 10 * len(messages[-1]["content"].split())
        n = min(max_tokens, 6)  # the answer ends after six tokens however many were allowed
        computed = 1 if self.held == messages else prompt
        self.held = messages
        self.clock[0] += 0.030 + 0.001 * computed + 0.004 * n  # the call's own costs, the prompt, 4 ms a token
        return {"usage": {"completion_tokens": n, "prompt_tokens": prompt}}


def test_llama_cpp_decode_is_counted_as_the_engines(monkeypatch, tmp_path):
    """llama.cpp's figure leaves out the first token and the call's fixed costs, as the engine's decode_tok_s does:
    a 4 ms token is 250 tok/s, where tokens over the whole call would read 6 / 0.054 = 111. Its prefill computes
    the whole page each time (the context emptied first), as the engine's does with prefix reuse off."""
    import sys
    import types

    import engine.quality as quality

    clock = [0.0]
    fake = types.ModuleType("llama_cpp")
    fake.Llama = lambda **kw: _FakeLlama(clock, **kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setattr(quality.time, "perf_counter", lambda: clock[0])
    col = quality.llama_cpp_column(str(tmp_path / "m.gguf"), decode_tokens=32, repeats=3)
    assert col["status"] == "ok" and len(col["decode_tok_s_runs"]) == 3
    assert math.isclose(col["decode_tok_s"], 250.0, rel_tol=1e-9)
    assert all(math.isclose(w, 6 / (0.054 + 0.001), rel_tol=1e-9) for w in col["wall_tok_s_runs"])
    tokens = col["prefill_tokens"]
    assert tokens == 10 * len(quality.PREFILL_PROMPT[0]["content"].split()) and tokens > 3000
    want = tokens / (0.030 + 0.001 * tokens + 0.004)
    assert len(col["prefill_tok_s_runs"]) == 3
    assert all(math.isclose(p, want, rel_tol=1e-9) for p in col["prefill_tok_s_runs"])
    one = quality.llama_cpp_column(str(tmp_path / "m.gguf"), decode_tokens=1, repeats=2)
    assert one["status"] == "failed" and "one token" in one["reason"]


def test_a_perplexity_beyond_a_double_is_na_with_the_reason(tiny_llama, monkeypatch):
    """A model far from the text (random weights in a real model's shapes) can average more nats a token than a
    double's exponent holds; that format says so, keeps its log-likelihood, and the bench goes on."""
    import engine.quality as quality

    real = quality.teacher_forced

    def far(model, ids, device, window):
        nll, argmax = real(model, ids, device, window)
        return nll * 1000.0, argmax

    monkeypatch.setattr(quality, "teacher_forced", far)
    config = QualityConfig(model=str(tiny_llama), decode_tokens=4, repeats=1, formats=("fp32", "int8"))
    report = run_quality(config, progress=lambda m: None)
    for f in report["formats"]:
        assert f["status"] == "ok" and f["perplexity"] is None and f["decode_tok_s"] > 0
        assert f["nll_per_token"] > 709 and f["perplexity_note"].startswith("n/a: e^")
    assert "| fp32 |" in format_quality_table(report) and "is beyond a double" in format_quality_table(report)
    assert quality.perplexity(math.log(2.0)) == (pytest.approx(2.0), "")
    assert quality.perplexity(float("nan"))[0] is None


def test_ctrl_c_during_a_quality_bench_keeps_the_formats_measured_before_it(tiny_llama, tmp_path, monkeypatch, capsys):
    """Ctrl+C during `gapless bench --quality` printed no table and wrote no JSON: every format measured was lost."""
    from engine.engine import Engine

    real, calls = Engine.generate, []

    def ctrl_c_in_bf16s_second_decode_run(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 9:  # fp32: a warm-up and 2 runs each of decode and prefill; bf16: a warm-up, a run
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", ctrl_c_in_bf16s_second_decode_run)
    out = tmp_path / "quality.json"
    argv = ["bench", "--quality", "--model", str(tiny_llama), "--device", "cpu", "--repeats", "2"]
    assert main([*argv, "--max-new-tokens", "4", "--json", str(out)]) == 130
    stdout, err = capsys.readouterr()
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["interrupted"] is True and [p.name for p in tmp_path.iterdir()] == ["quality.json"]
    fp32, bf16, int8, int4 = report["formats"]
    assert fp32["status"] == "ok" and len(fp32["decode_tok_s_runs"]) == len(fp32["prefill_tok_s_runs"]) == 2
    partial = (
        "the bench was interrupted (Ctrl+C) after 1 of 2 decode runs, before its prefill runs: its medians are of "
        "the runs made"
    )
    assert (bf16["status"], bf16["reason"]) == ("interrupted", partial)
    assert bf16["perplexity"] > 1 and bf16["decode_tok_s"] == bf16["decode_tok_s_runs"][0] > 0
    assert bf16["prefill_tok_s"] is None and bf16["prefill_tok_s_runs"] == []
    before = "the bench was interrupted (Ctrl+C) before it started"
    assert [(f["label"], f["status"], f["reason"]) for f in (int8, int4)] == [
        ("int8", "interrupted", before),
        ("int4", "interrupted", before),
    ]
    assert report["not_run"] == {"bf16": partial, "int8": before, "int4": before}
    assert report["llama_cpp"] == {"status": "skipped", "reason": "the bench was interrupted (Ctrl+C) before it ran"}
    lines = stdout.splitlines()
    assert any(x.startswith("| bf16 (interrupted) | ") and f"| {bf16['decode_tok_s']:.1f} | n/a |" in x for x in lines)
    assert f"| int8 | interrupted: {before} | | | | | |" in lines and f"bf16: {partial}." in lines
    assert err.splitlines()[-1] == "gapless: interrupted: the table and JSON hold the runs measured before it"
