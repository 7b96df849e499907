"""The bench: medians, ratios, rung planning, the table and the JSON; and a real run on a tiny model."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import pytest
import torch

from app.cmd_bench import config_from_args, format_table, options_text, write_json
from engine.bench import Baseline, add_ratios, matching_prefix
from engine.errors import OptionsError
from engine.ladder import SPREAD_SOURCES, BenchConfig, Rung, median, median_metrics, ratio, rung_options, validate
from engine.types import PRESETS, EngineOptions, GenerationMetrics, SamplingParams


def test_median_and_ratio():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert median([None, 5.0, None]) == 5.0
    assert median([]) is None and median([None]) is None
    nan, inf = float("nan"), float("inf")
    # a run whose figure came out NaN or infinite is not measured: the median was 1.0, nan or 2.0 by the runs' order
    assert median([nan, 1.0, 2.0]) == median([1.0, nan, 2.0]) == median([2.0, 1.0, nan]) == 1.5
    assert median([inf, 3.0]) == 3.0 and median([nan]) is None
    assert ratio(10.0, 4.0) == 2.5
    assert ratio(None, 4.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None


def test_median_metrics_per_field_sources_and_reasons():
    runs = [
        {
            "decode_tok_s": 10.0,
            "ttft_ms": 50.0,
            "kernel_gap_pct": 80.0,
            "kernel_gap_source": "op gap — x",
            "gpu_util_pct": None,
            "unavailable": {"gpu_util_pct": "no GPU"},
            "new_tokens_total": 128,
        },
        {
            "decode_tok_s": 30.0,
            "ttft_ms": 40.0,
            "kernel_gap_pct": None,
            "kernel_gap_source": None,
            "gpu_util_pct": None,
            "unavailable": {},
            "new_tokens_total": 128,
        },
        {
            "decode_tok_s": 20.0,
            "ttft_ms": 45.0,
            "kernel_gap_pct": 70.0,
            "kernel_gap_source": "op gap — x",
            "gpu_util_pct": None,
            "unavailable": {"gpu_util_pct": "no GPU"},
            "new_tokens_total": 120,
        },
    ]
    m = median_metrics(runs)
    assert m["decode_tok_s"] == 20.0 and m["ttft_ms"] == 45.0
    assert (m["decode_tok_s_min"], m["decode_tok_s_max"]) == (10.0, 30.0)
    assert m["kernel_gap_pct"] == 75.0  # median of the two runs that measured it
    assert m["kernel_gap_source"] == "op gap — x"
    assert m["gpu_util_pct"] is None and m["unavailable"] == {"gpu_util_pct": "no GPU"}
    assert m["new_tokens_total"] == 128


def test_rung_options_cpu_dtypes():
    base = EngineOptions(device="cpu", profile_window=False)
    assert rung_options("naive", base, "cpu", None).dtype == "fp32"
    assert rung_options("half", base, "cpu", None).dtype == "bf16"
    first = rung_options("first-fixes", base, "cpu", None)
    assert (first.dtype, first.kv_cache, first.sampling, first.profile_window) == ("fp32", "static", "device", False)
    assert rung_options("candidates", base, "cpu", 8).candidates == 8
    assert rung_options("candidates", base, "cpu", None).candidates == 4
    cuda = EngineOptions(device="cuda")
    assert rung_options("half", cuda, "cuda", None).dtype == "fp16"
    assert rung_options("cuda-graph", cuda, "cuda", None).cuda_graph


def test_validate_rejects_bad_configs():
    with pytest.raises(OptionsError, match="unknown preset"):
        validate(BenchConfig(presets=("naive", "turbo")))
    with pytest.raises(OptionsError):
        validate(BenchConfig(repeats=0))
    with pytest.raises(OptionsError):
        validate(BenchConfig(max_new_tokens=1))
    with pytest.raises(OptionsError):
        validate(BenchConfig(candidates=99))
    assert validate(BenchConfig(presets=("naive",))).presets == ("naive",)


def test_config_from_args(tmp_path):
    args = bench_args("m.gguf", None, max_new_tokens=16, repeats=2, presets="naive, first-fixes", prompt=None)
    args.speculation = args.draft_tokens = args.draft_model = None
    c = config_from_args(args)
    assert c.presets == ("naive", "first-fixes") and c.baseline is False and c.prompt
    assert (c.speculation, c.draft_tokens, c.draft_model) == ("ngram", 0, "")
    args.presets = None
    assert config_from_args(args).presets[0] == "naive" and config_from_args(args).presets == tuple(PRESETS)
    assert config_from_args(args).presets[-1] == "speculation"
    small = tmp_path / "small.gguf"
    args.speculation, args.draft_tokens, args.draft_model = "draft", 4, str(small)
    with pytest.raises(OptionsError, match="no such file or folder"):
        config_from_args(args)
    small.write_bytes(b"GGUF")
    c = config_from_args(args)
    assert (c.speculation, c.draft_tokens, c.draft_model) == ("draft", 4, str(small))


def rung(name, label, tok_s, options=None, status="ok", reason=None, gap=None, notes=()):
    r = Rung(name, label, status, reason=reason, options=options, notes=list(notes))
    if status == "ok":
        r.median = {
            "decode_tok_s": tok_s,
            "ttft_ms": 100.0,
            "kernel_gap_pct": gap,
            "tokens_per_step": 1.0,
            "kernel_gap_source": "op gap — torch.profiler CPU ops, 8-step window (sampled)" if gap else None,
            "launches_per_step": 4 * gap if gap else None,
            "launches_per_step_source": "aten ops per step — torch.profiler CPU ops, 8-step window (sampled)"
            if gap
            else None,
            "sm_activity_pct": None,
            "gpu_util_pct": None,
            "peak_memory_bytes": 3 * 2**30,
            "peak_memory_source": "process peak RSS since start (getrusage)",
            "new_tokens_total": 128.0,
            "unavailable": {
                "gpu_util_pct": "the model runs on the CPU, not on a GPU",
                "sm_activity_pct": "the model runs on the CPU, not on a GPU",
            },
        }
    return r


def opts(**kw):
    return EngineOptions(device="cpu", **kw).to_dict()


def sample_report(with_compiled=False):
    rungs = [
        rung("naive", "Naive", 10.0, opts(dtype="fp32", kv_cache="dynamic", sampling="host"), gap=60.0),
        rung("half", "+ half precision", 8.0, opts(dtype="bf16", kv_cache="dynamic", sampling="host"), gap=55.0),
        rung("first-fixes", "+ static KV cache", 25.0, opts(dtype="fp32"), gap=20.0),
        rung("compile", "+ compile", None, status="skipped", reason="compile off for this bench"),
        rung(
            "candidates",
            "+ 4 candidates",
            60.0,
            opts(dtype="fp32", candidates=4),
            gap=10.0,
            notes=["without cuda_graph: CUDA graphs need a CUDA device"],
        ),
    ]
    rungs[0].median.update(decode_tok_s_min=8.0, decode_tok_s_max=12.0)
    baselines = [
        Baseline(
            "transformers",
            "transformers generate()",
            "ok",
            settings={"dtype": "float32", "cache_implementation": "default (dynamic)"},
            median={"decode_tok_s": 20.0, "ttft_ms": 90.0, "new_tokens_total": 128.0, "peak_memory_bytes": 2**29},
        )
    ]
    if with_compiled:
        baselines.append(
            Baseline(
                "transformers-static-compile",
                "transformers generate(), static cache + compile",
                "ok",
                settings={"dtype": "float16", "cache_implementation": "static"},
                median={"decode_tok_s": 40.0, "ttft_ms": 30.0, "new_tokens_total": 128.0},
            )
        )
    ratios = add_ratios(rungs, baselines)
    from dataclasses import asdict

    return {
        "rungs": [asdict(r) for r in rungs],
        "baselines": [asdict(b) for b in baselines],
        "ratios": ratios,
        "config": {"max_new_tokens": 128, "repeats": 3, "warmup": 1},
        "model": {"name": "SmolLM2-135M-Instruct.Q4_1", "parameters": 134_515_008},
        "device": "cpu",
        "dtype_note": "CPU ladder: bf16 half rung",
        "method": "medians",
        "greedy_match_naive_vs_transformers": {"matching_prefix": 128, "naive_tokens": 128, "transformers_tokens": 128},
    }, rungs


def test_ratios_against_naive_and_transformers():
    report, rungs = sample_report(with_compiled=True)
    by = {r.name: r for r in rungs}
    assert by["naive"].speedup_vs_naive == 1.0
    assert by["first-fixes"].speedup_vs_naive == 2.5
    assert by["first-fixes"].speedup_vs_transformers == 1.25
    assert by["first-fixes"].speedup_vs_transformers_compiled == 25.0 / 40.0
    assert by["compile"].speedup_vs_naive is None
    r = report["ratios"]
    assert r["best_single_stream"]["rung"] == "first-fixes" and r["best_single_stream"]["vs_naive"] == 2.5
    assert r["best_aggregate"]["rung"] == "candidates" and r["best_aggregate"]["vs_transformers"] == 3.0
    assert r["transformers_decode_tok_s"] == 20.0 and r["naive_decode_tok_s"] == 10.0


def test_ratios_without_naive_or_baseline_are_none_with_the_reason():
    rungs = [rung("first-fixes", "+ static KV cache", 25.0, opts())]
    ratios = add_ratios(rungs, [], baseline=False)
    assert rungs[0].speedup_vs_naive is None and rungs[0].speedup_vs_transformers is None
    assert ratios["naive_decode_tok_s"] is None and ratios["best_single_stream"]["decode_tok_s"] == 25.0
    off = "the transformers baseline was not run (--no-baseline)"
    assert ratios["unavailable"] == {
        "naive_decode_tok_s": "the Naive rung was not among the presets",
        "transformers_decode_tok_s": off,
        "transformers_static_compile_decode_tok_s": off,
    }
    assert rungs[0].speedup_unavailable == {
        "speedup_vs_naive": "the Naive rung was not among the presets",
        "speedup_vs_transformers": off,
        "speedup_vs_transformers_compiled": off,
    }
    assert ratios["best_single_stream"]["unavailable"] == rungs[0].speedup_unavailable
    failed = Baseline("transformers", "transformers generate()", "failed", reason="out of memory")
    naive = rung("naive", "Naive", 10.0, opts())
    add_ratios([naive, rungs[0]], [failed], baseline=True, compiled_baseline=False)
    assert naive.speedup_vs_naive == 1.0 and rungs[0].speedup_unavailable == {
        "speedup_vs_transformers": "the transformers baseline failed: out of memory",
        "speedup_vs_transformers_compiled": "the compiled transformers baseline runs on CUDA with compile on",
    }
    report, _ = sample_report()
    report.update(rungs=[asdict(naive), asdict(rungs[0])], baselines=[asdict(failed)])
    report["ratios"] = add_ratios([naive, rungs[0]], [failed])
    assert "× transformers: n/a (the transformers baseline failed: out of memory)." in format_table(report)


def test_the_table_names_a_source_only_a_baseline_gave():
    report, _ = sample_report()
    for r in report["rungs"]:
        r["median"].pop("peak_memory_source", None)
    report["baselines"][0]["median"]["peak_memory_source"] = "torch.cuda.max_memory_allocated"
    assert "Peak memory: torch.cuda.max_memory_allocated." in format_table(report)


def test_the_table_names_each_source_its_rungs_measured_a_figure_with():
    """The notes named the first rung's source for every rung: a gap measured inside a CUDA graph was credited to
    the eager rungs' profiler."""
    report, _ = sample_report()
    for r in report["rungs"][-2:]:
        if r["median"].get("kernel_gap_source"):
            r["median"]["kernel_gap_source"] = "graph replay"
    table = format_table(report)
    first = report["rungs"][0]
    line = next(x for x in table.splitlines() if x.startswith("Kernel / op gap:"))
    assert f"{first['label']}" in line and ": graph replay" in line and "torch.profiler CPU ops" in line


def test_the_table_says_why_a_figure_is_na_in_a_row_where_other_rows_name_its_source():
    """The notes gave the source of a figure other rows measured and nothing for the row where it was n/a (the
    speculation rung's gap, every rung's answer ending before the traced window; the baseline's)."""
    report, _ = sample_report()
    last = report["rungs"][-1]["median"]
    last["kernel_gap_pct"] = last["kernel_gap_source"] = None
    last["unavailable"] = {"kernel_gap_pct": "the answer ended before the traced window (decode steps 8-15)"}
    report["baselines"][0]["median"]["unavailable"] = {"kernel_gap_pct": "not traced inside transformers generate()"}
    line = next(x for x in format_table(report).splitlines() if x.startswith("Kernel / op gap:"))
    source = report["rungs"][0]["median"]["kernel_gap_source"]
    assert line == (
        f"Kernel / op gap: {source}; n/a in + 4 candidates: the answer ended before the traced window (decode steps "
        "8-15); transformers generate(): not traced inside transformers generate()."
    )


def test_a_figure_measured_in_some_runs_is_their_median_with_a_source_and_no_reason():
    """A rung's median kept the reason of a run where a figure was n/a beside the median of the runs that measured
    it: the JSON gave a value and a reason for it, and the table's notes said n/a in a row that showed a value."""
    runs = [GenerationMetrics(decode_tok_s=v, new_tokens_total=128) for v in (10.0, 12.0, 11.0)]
    runs[0].put("gpu_util_pct", 40.0, "NVML utilization samples")
    runs[1].mark_na("gpu_util_pct", "no NVML sample inside the generation")
    runs[2].put("gpu_util_pct", 50.0, "NVML utilization samples")
    for r in runs:
        r.mark_na("sm_activity_pct", "no GPM on this GPU")
    m = median_metrics([r.to_dict() for r in runs])
    assert (m["gpu_util_pct"], m["gpu_util_source"]) == (45.0, "NVML utilization samples")
    assert m["unavailable"] == {"sm_activity_pct": "no GPM on this GPU"}  # measured in none: n/a with why
    partial = "measured in 2 of 3 timed runs, the median is of those (n/a in the other: no NVML sample inside the "
    assert m["partial"] == {"gpu_util_pct": partial + "generation)"}
    odd = [dict(r.to_dict()) for r in runs]
    odd[1]["gpu_util_pct"] = float("nan")  # one that came out NaN is not one that measured it
    assert median_metrics(odd)["gpu_util_pct"] == 45.0
    assert median_metrics(odd)["partial"]["gpu_util_pct"].startswith("measured in 2 of 3 timed runs")
    report, _ = sample_report()
    report["rungs"][0]["median"] = {**m, "peak_memory_bytes": None}
    table = format_table(report)
    naive = next(x for x in table.splitlines() if x.startswith("| Naive"))
    assert [c.strip() for c in naive.strip("|").split("|")][10] == "45.0"
    line = next(x for x in table.splitlines() if x.startswith("GPU util:"))
    assert (
        line
        == "GPU util: NVML utilization samples; n/a in + half precision, + static KV cache, + 4 candidates: "
        + ("the model runs on the CPU, not on a GPU.")
    )
    assert (
        f"(1) Naive: GPU util {partial}generation)" in table and "fp32, dynamic KV, host sampling, eager (1)" in naive
    )


def test_a_baseline_figure_measured_in_some_runs_says_in_how_many():
    from engine.bench import BaselineRunner

    runner = BaselineRunner.__new__(BaselineRunner)
    runner.result = Baseline("transformers", "transformers generate()", "ok")
    for gpu in (30.0, None, 50.0):
        run = {"decode_tok_s": 20.0, "ttft_ms": 9.0, "total_s": 1.0, "new_tokens_total": 8, "gpu_util_pct": gpu}
        run["gpu_util_source"] = "NVML" if gpu is not None else None
        run["unavailable"] = {} if gpu is not None else {"gpu_util_pct": "no NVML sample"}
        runner.result.runs.append(run)
    m = runner.finish().median
    assert (m["gpu_util_pct"], m["sources"]["gpu_util_pct"]) == (40.0, "NVML") and "gpu_util_pct" not in m[
        "unavailable"
    ]
    assert m["partial"] == {
        "gpu_util_pct": "measured in 2 of 3 timed runs, the median is of those (n/a in the other: no NVML sample)"
    }


def test_table_rows_figures_and_notes():
    report, _ = sample_report()
    table = format_table(report)
    lines = table.splitlines()
    assert lines[0].startswith("| rung ") and "× transformers compiled" not in lines[0]
    row = next(line for line in lines if line.startswith("| + static KV cache"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == [
        "+ static KV cache",
        "fp32, static KV, device sampling, eager",
        "128",
        "25.0",
        "2.50×",
        "1.25×",
        "100.0",
        "20.0",
        "80",
        "n/a",
        "n/a",
        "3.00 GiB",
        "1.00",
        "n/a",
    ]
    naive = next(line for line in lines if line.startswith("| Naive"))
    assert [c.strip() for c in naive.strip("|").split("|")][3] == "10.0 (8.0–12.0)"
    skipped = next(line for line in lines if line.startswith("| + compile"))
    assert "skipped (1)" in skipped
    assert "(1) + compile: skipped: compile off for this bench" in table
    assert "(2) + 4 candidates: without cuda_graph: CUDA graphs need a CUDA device" in table
    base = next(line for line in lines if line.startswith("| transformers generate()"))
    bcells = [c.strip() for c in base.strip("|").split("|")]
    assert bcells[3:6] == ["20.0", "2.00×", "1.00×"] and bcells[7] == "n/a" and bcells[8] == "n/a"
    assert "Kernel / op gap: op gap — torch.profiler CPU ops, 8-step window (sampled)." in table
    assert "Launches/step: aten ops per step — torch.profiler CPU ops, 8-step window (sampled)." in table
    assert "GPU util: n/a (the model runs on the CPU, not on a GPU)." in table
    assert "the first 128 of 128 / 128 agree" in table
    assert len({len(line) for line in lines[:8]}) == 1  # aligned columns


def test_the_table_describes_the_machine_with_or_without_a_load_average():
    """Where the OS has no load average (Windows), the table left out the machine line whole."""
    report, _ = sample_report()
    machine = {"cpu_model": "AMD EPYC", "cpu_cores_logical": 16, "gpu_name": None, "load_average_1_5_15min": None}
    report["machine"] = {**machine, "load_average_at_start": None}
    assert "Machine: AMD EPYC, 16 logical cores, no GPU.\n" in format_table(report)
    report["machine"] = {**machine, "load_average_1_5_15min": [2.5, 1, 1], "load_average_at_start": [1.25, 1, 1]}
    assert (
        "Machine: AMD EPYC, 16 logical cores, no GPU; load average (1 min) 1.2 at the start, 2.5 at the end.\n"
        in format_table(report)
    )


def test_the_table_counts_one_run_and_one_warm_up_in_the_singular():
    """`--repeats 1` said "median of 1 runs"."""
    report, _ = sample_report()
    for repeats, warmup, said in (
        (1, 1, "median of 1 run after 1 warm-up."),
        (3, 2, "median of 3 runs after 2 warm-ups."),
    ):
        report["config"] = {"max_new_tokens": 128, "repeats": repeats, "warmup": warmup}
        line = next(x for x in format_table(report).splitlines() if x.startswith("Model "))
        assert line.endswith(f"128 new tokens, greedy, {said}")


def test_table_with_compiled_baseline_has_its_column():
    report, _ = sample_report(with_compiled=True)
    lines = format_table(report).splitlines()
    assert "× transformers compiled" in lines[0]
    row = next(line for line in lines if line.startswith("| + static KV cache"))
    assert "0.62×" in row


def test_describe_options():
    assert options_text(opts(dtype="fp16", compile=True, cuda_graph=True, candidates=16)) == (
        "fp16, static KV, device sampling, compiled, CUDA graph, 16 candidates"
    )
    assert options_text(opts(dtype="fp32", sampling="host", profile_window=False)) == (
        "fp32, static KV, host sampling, eager"
    )
    assert options_text(None) == ""
    assert options_text(opts(dtype="fp32", speculation="ngram", draft_tokens=0)) == (
        "fp32, static KV, device sampling, eager, speculation ngram"
    )


def test_write_json_round_trip(tmp_path):
    report, _ = sample_report()
    path = tmp_path / "bench.json"
    write_json(path, report)
    back = json.loads(path.read_text(encoding="utf-8"))
    assert back["rungs"][2]["speedup_vs_naive"] == 2.5
    assert back["rungs"][3]["status"] == "skipped"
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # no temporary file left
    from engine.errors import OutputPathError

    with pytest.raises(OutputPathError, match="the folder .*out does not exist"):
        write_json(tmp_path / "out" / "bench.json", report)


def test_a_figure_that_is_not_finite_is_null_with_why_in_the_json_and_na_in_the_table(tmp_path, capsys):
    """A NaN or infinite figure was written as NaN / Infinity, which strict JSON readers refuse."""
    from app.cmd_bench import _report

    report, _ = sample_report()
    naive = report["rungs"][0]
    naive["median"]["ttft_ms"] = float("nan")
    naive["speedup_vs_transformers"] = float("inf")
    path = tmp_path / "bench.json"
    args = argparse.Namespace(json=path)
    _report(args, lambda config, progress, command: report, None, format_table)
    back = json.loads(path.read_text(encoding="utf-8"), parse_constant=_refuse_nan)["rungs"][0]
    assert back["median"]["ttft_ms"] is None and back["speedup_vs_transformers"] is None
    assert back["median"]["unavailable"]["ttft_ms"] == "came out as nan, not a finite number"
    assert back["speedup_unavailable"]["speedup_vs_transformers"] == "came out as inf, not a finite number"
    assert naive["median"]["ttft_ms"] != naive["median"]["ttft_ms"]  # the report it was given is left as it was
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| Naive"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[5] == "n/a" and cells[6] == "n/a" and "nan" not in row and "inf" not in row


def _refuse_nan(constant: str) -> None:
    raise AssertionError(f"not strict JSON: {constant}")


def test_matching_prefix():
    assert matching_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert matching_prefix([], [1]) == 0
    assert matching_prefix([7, 8], [7, 8]) == 2


# ---- the real bench on a tiny model ------------------------------------------------------------------


def bench_args(model, json_path, **kw):
    base = dict(
        model=str(model),
        device="cpu",
        max_new_tokens=12,
        repeats=1,
        presets="naive,first-fixes",
        candidates=None,
        baseline=False,
        compile=None,
        prompt="hello world",
        json=json_path,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_bench_tiny_model_without_baseline(tiny_llama, tmp_path, capsys):
    from app.cmd_bench import run_bench

    path = tmp_path / "bench.json"
    assert run_bench(bench_args(tiny_llama, path, presets="naive,first-fixes,compile,cuda-graph")) == 0
    out = capsys.readouterr().out
    assert "| Naive " in out and "| + static KV cache " in out and f"written: {path}" in out
    report = json.loads(path.read_text(encoding="utf-8"))
    assert set(report) >= {"command", "config", "machine", "model", "rungs", "baselines", "ratios", "dtype_note"}
    assert report["baselines"] == [] and report["greedy_match_naive_vs_transformers"] is None
    assert report["machine"]["libraries"]["torch"] and report["machine"]["cpu_cores_logical"] >= 1
    assert report["model"]["family"] == "llama" and report["device"] == "cpu"
    naive, fixes, compiled, graph = report["rungs"]
    assert (naive["name"], naive["status"], fixes["name"], fixes["status"]) == ("naive", "ok", "first-fixes", "ok")
    # compile is off by default on the CPU; the CUDA graph rung could not run here even with it, and says why
    assert compiled["status"] == "skipped" and compiled["reason"].startswith("compile off for this bench")
    assert compiled["reason"].endswith("gapless bench --compile includes it)")  # the GUI has no --compile to give
    assert graph["status"] == "skipped" and graph["reason"].startswith("cuda_graph: CUDA graphs need a CUDA device")
    assert naive["options"]["kv_cache"] == "dynamic" and naive["options"]["sampling"] == "host"
    assert fixes["options"]["kv_cache"] == "static" and fixes["options"]["dtype"] == "fp32"
    for r in (naive, fixes):
        assert len(r["runs"]) == 1
        m = r["runs"][0]["metrics"]
        assert m["new_tokens_total"] == len(r["runs"][0]["token_ids"][0]) >= 1
        assert r["median"]["decode_tok_s"] == m["decode_tok_s"]
        assert r["median"]["gpu_util_pct"] is None and r["median"]["unavailable"]["gpu_util_pct"]
    assert naive["speedup_vs_naive"] == 1.0 and naive["speedup_vs_transformers"] is None
    assert fixes["speedup_vs_naive"] == pytest.approx(fixes["median"]["decode_tok_s"] / naive["median"]["decode_tok_s"])
    # greedy decoding: the same tokens whatever the optimisations (both fp32)
    assert naive["runs"][0]["token_ids"] == fixes["runs"][0]["token_ids"]
    # every timed run read the whole prompt: a rung after another that kept its cache reused it (TTFT 1.37 s
    # beside 0.16 s for the same prompt on the default model, most of the ladder's TTFT "gain")
    assert all(r["runs"][0]["metrics"]["prompt_reused_tokens"] == 0 for r in (naive, fixes))
    assert "TTFT with the prompt's cache reused" not in out


def test_the_json_is_written_before_the_table_goes_to_a_closed_pipe(tiny_llama, tmp_path, monkeypatch):
    """`gapless bench --json x.json | head` ended with 141 and no x.json: the table went first and its print
    raised BrokenPipeError after the whole bench had run."""
    import builtins

    from app.cmd_bench import run_bench

    path = tmp_path / "bench.json"
    real = builtins.print

    def closed_pipe(*a, **k):
        if k.get("file") is None:  # stdout: its reader has gone
            raise BrokenPipeError(32, "Broken pipe")
        real(*a, **k)

    monkeypatch.setattr(builtins, "print", closed_pipe)
    with pytest.raises(BrokenPipeError):
        run_bench(bench_args(tiny_llama, path, presets="naive"))
    assert json.loads(path.read_text(encoding="utf-8"))["rungs"][0]["name"] == "naive"


def test_a_json_the_disk_cannot_take_loses_no_table(tiny_llama, tmp_path, monkeypatch, capsys):
    """A full disk at the end of a bench ended it with "internal error: OSError" and nothing else: the table of
    what the whole run measured was never printed."""
    import errno

    from app.cli import main

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("engine.paths.os.replace", full)
    path = tmp_path / "bench.json"
    argv = ["bench", "--model", str(tiny_llama), "--device", "cpu", "--presets", "naive", "--no-baseline"]
    code = main([*argv, "--repeats", "1", "--max-new-tokens", "4", "--json", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and out.splitlines()[2].startswith("| Naive ") and "written:" not in out
    assert err.splitlines()[-1] == f"gapless: error: cannot write the bench's JSON to {path}: No space left on device"
    assert "internal error" not in err and not path.exists() and list(tmp_path.iterdir()) == []


def test_cuda_on_a_machine_without_it_is_refused_before_any_model_loads(monkeypatch):
    """The ladder, --quality and --speculation-workloads ran with every engine figure skipped, and the ladder
    timed transformers on the CPU into a report that said cuda."""
    import torch

    from app.cli import build_parser
    from app.cmd_bench import check_flags

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for kind in ([], ["--quality"], ["--speculation-workloads"]):
        with pytest.raises(OptionsError, match="--device cuda: CUDA is not available on this machine"):
            check_flags(build_parser().parse_args(["bench", *kind, "--device", "cuda"]))


def test_a_bench_where_no_rung_ran_exits_1_after_its_table_and_json(tiny_llama, tmp_path, capsys):
    """--presets cuda-graph on a CPU skipped every rung and still exited 0: a script took the table as measured."""
    from app.cmd_bench import run_bench

    path = tmp_path / "bench.json"
    assert run_bench(bench_args(tiny_llama, path, presets="cuda-graph", repeats=1)) == 1
    [graph] = json.loads(path.read_text(encoding="utf-8"))["rungs"]
    assert graph["status"] == "skipped"
    out, err = capsys.readouterr()
    assert "skipped (1)" in out and "no rung ran (each one's reason is in the table above)" in err


def test_bench_tiny_model_with_baseline_and_a_skipped_rung(tiny_llama, tmp_path, capsys):
    from app.cmd_bench import run_bench

    path = tmp_path / "bench.json"
    args = bench_args(tiny_llama, path, presets="naive,first-fixes,cuda-graph", baseline=True, compile=True, repeats=2)
    assert run_bench(args) == 0
    report = json.loads(path.read_text(encoding="utf-8"))
    naive, fixes, graph = report["rungs"]
    assert graph["status"] == "skipped" and "CUDA graphs need a CUDA device" in graph["reason"]
    assert len(naive["runs"]) == len(fixes["runs"]) == 2
    # on the CPU the repeats are interleaved: every rung and the baseline once per round
    assert report["config"]["interleaved"] is True
    err = capsys.readouterr().err
    runs = [line.split(":")[0] + line.split(":")[1] for line in err.splitlines() if ": run " in line]
    assert runs == [
        "naive run 1/2",
        "first-fixes run 1/2",
        "transformers run 1/2",
        "naive run 2/2",
        "first-fixes run 2/2",
        "transformers run 2/2",
    ]
    [hf] = report["baselines"]
    assert hf["name"] == "transformers" and hf["status"] == "ok" and len(hf["runs"]) == 2
    assert hf["settings"]["min_new_tokens"] == hf["settings"]["max_new_tokens"] == 12
    assert all(r["new_tokens_total"] == 12 for r in hf["runs"])
    assert hf["median"]["kernel_gap_pct"] is None
    # a busy machine can time the 12 tiny steps shorter than its noise: that run's figure is n/a, saying so
    why = "the n-token generate() took no longer than the 1-token one"
    assert all(
        r["decode_tok_s"] > 0 if r["decode_tok_s"] is not None else r["unavailable"]["decode_tok_s"] == why
        for r in hf["runs"]
    )
    assert hf["median"]["decode_tok_s"] is None or hf["median"]["decode_tok_s"] > 0
    # its counts are ints, as the rungs' (the median of 12 and 12 tokens was written 12.0, of the RSS 778039296.0)
    assert type(hf["median"]["new_tokens_total"]) is int and hf["median"]["new_tokens_total"] == 12
    assert type(hf["median"]["peak_memory_bytes"]) is int  # whole KiB each run
    # each figure names its source as the engine's do (decode tok/s and TTFT read as "engine timing" before)
    sources = {
        "ttft_ms": "wall time of a 1-token transformers generate(), device-synchronised",
        "total_s": "wall time of the n-token transformers generate(), device-synchronised",
        "decode_tok_s": "(n - 1) / (t(n tokens) - t(1 token)) of transformers generate(), device-synchronised "
        "(prefill left out)",
        "new_tokens_total": "the tokens transformers generate() returned",
        "peak_memory_bytes": "process peak RSS since start (getrusage)",
    }
    for figures_of in hf["runs"]:  # a figure n/a (decode tok/s on a busy machine) names none
        assert figures_of["sources"] == {k: v for k, v in sources.items() if figures_of[k] is not None}
    median_sources = {**sources, **SPREAD_SOURCES}  # the medians' spread of decode tok/s names its own
    assert hf["median"]["sources"] == {k: v for k, v in median_sources.items() if hf["median"][k] is not None}
    assert naive["runs"][0]["metrics"]["sources"]["decode_tok_s"] == "engine timing, device-synchronised"
    # the rungs' medians, which the table and the speed-ups read, name theirs as their runs do (they named none)
    for rung in (naive, fixes):
        kept = rung["median"]["sources"]
        for key in ("decode_tok_s", "ttft_ms", "new_tokens_total", "decode_tok_s_min", "decode_tok_s_max"):
            assert rung["median"][key] is not None and kept[key], (rung["name"], key)
        assert kept["decode_tok_s"] == rung["runs"][0]["metrics"]["sources"]["decode_tok_s"]
        assert all(rung["median"][k] is not None for k in kept)
    from engine import figures

    assert figures.read(hf["median"], "new_tokens_total").source == sources["new_tokens_total"]
    assert figures.read(naive["median"], "new_tokens_total").source == "engine token count"
    # one warm-up each (config.warmup), timed and kept out of the runs; the table names them
    assert len(naive["warmup_seconds"]) == len(fixes["warmup_seconds"]) == len(hf["warmup_seconds"]) == 1
    assert all(s > 0 for s in naive["warmup_seconds"] + hf["warmup_seconds"])
    assert report["prompt_tokens_transformers"] == naive["runs"][0]["metrics"]["prompt_tokens"]
    ours = naive["runs"][0]["token_ids"][0]
    match = report["greedy_match_naive_vs_transformers"]
    # transformers is made to continue past EOS (min_new_tokens), so only an EOS of ours may differ
    expected = len(ours) if naive["runs"][0]["finish_reasons"][0] == "length" else len(ours) - 1
    assert match["matching_prefix"] >= expected
    if hf["median"]["decode_tok_s"] is None:
        assert naive["speedup_vs_transformers"] is None
    else:
        assert naive["speedup_vs_transformers"] == pytest.approx(
            naive["median"]["decode_tok_s"] / hf["median"]["decode_tok_s"]
        )
    assert report["ratios"]["transformers_decode_tok_s"] == hf["median"]["decode_tok_s"]
    out = format_table(report)
    assert "| transformers generate() " in out and "skipped (1)" in out
    warm = next(line for line in out.splitlines() if line.startswith("Warm-up seconds"))
    assert f"Naive {naive['warmup_seconds'][0]:.1f}" in warm and "transformers generate() " in warm


def test_ctrl_c_during_a_bench_writes_the_rungs_measured_before_it(tiny_llama, tmp_path, monkeypatch, capsys):
    """Ctrl+C during a bench wrote no JSON and printed no table: every rung already measured was lost."""
    from app.cli import main
    from engine.ladder import LadderRunner

    real = LadderRunner.run_once

    def ctrl_c_in_the_first_round(self, rung, index, cancel=None):
        if rung.name == "first-fixes":  # inside a rung, as a Ctrl+C in its generation lands
            raise KeyboardInterrupt
        real(self, rung, index, cancel)

    monkeypatch.setattr(LadderRunner, "run_once", ctrl_c_in_the_first_round)
    path = tmp_path / "bench.json"
    argv = ["bench", "--model", str(tiny_llama), "--device", "cpu", "--presets", "naive,first-fixes,half"]
    assert main([*argv, "--repeats", "2", "--max-new-tokens", "4", "--json", str(path)]) == 130
    out, err = capsys.readouterr()
    report = json.loads(path.read_text(encoding="utf-8"))
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # written whole, no temporary file left
    naive, half, fixes = report["rungs"]  # the ladder's order
    assert report["interrupted"] is True
    partial = "the bench was interrupted (Ctrl+C) after 1 of 2 timed runs: the median is of those"
    for r in (naive, half):  # their first round ran: kept, with how many runs the median is of
        assert (r["status"], len(r["runs"]), r["notes"][-1]) == ("ok", 1, partial)
        assert r["median"]["new_tokens_total"] == 4 and r["median"]["decode_tok_s"] > 0
    before = "the bench was interrupted (Ctrl+C) before its first timed run"
    assert (fixes["status"], fixes["reason"], fixes["runs"]) == ("interrupted", before, [])
    [hf] = report["baselines"]  # interleaved: warmed up, never timed
    assert (hf["status"], hf["reason"], hf["runs"]) == ("interrupted", before, [])
    assert report["not_run"] == {"naive": partial, "half": partial, "first-fixes": before, "transformers": before}
    assert half["speedup_vs_naive"] == pytest.approx(half["median"]["decode_tok_s"] / naive["median"]["decode_tok_s"])
    assert "| Naive " in out and "interrupted (" in out and "Interrupted (Ctrl+C)" in out and f"written: {path}" in out
    assert err.splitlines()[-1] == "gapless: interrupted: the table and JSON hold the runs measured before it"


def two_rungs(model, presets: tuple[str, str], interleave: bool) -> BenchConfig:
    """Two rungs, two repeats each, of a short answer, without a baseline."""
    return BenchConfig(
        model=str(model),
        device="cpu",
        max_new_tokens=10,
        repeats=2,
        presets=presets,
        baseline=False,
        interleave=interleave,
        prompt="hello",
    )


def test_bench_sequential_order(tiny_llama):
    from engine.bench import run_suite

    msgs: list[str] = []
    report = run_suite(two_rungs(tiny_llama, ("naive", "first-fixes"), interleave=False), progress=msgs.append)
    assert report["config"]["interleaved"] is False and report["baselines"] == []
    runs = [m.split(":")[0] + m.split(":")[1] for m in msgs if ": run " in m]
    assert runs == ["naive run 1/2", "naive run 2/2", "first-fixes run 1/2", "first-fixes run 2/2"]
    assert "sequential" in report["method"]


def test_interleaved_rounds_warm_up_after_each_switch_of_the_weight_format(tiny_llama):
    """A switch between native and int8 weights re-places them and drops the compiled steps, as a dtype's does;
    only a dtype's or device's switch was followed by a warm-up, so every interleaved int8 round was timed cold."""
    from engine.bench import run_suite

    msgs: list[str] = []
    run_suite(two_rungs(tiny_llama, ("first-fixes", "int8"), interleave=True), progress=msgs.append)
    said = [m for m in msgs if ": run " in m or "warm-up after re-placing" in m]
    switches = [m.split(":")[0] for m in said if "warm-up after re-placing" in m]
    # each round goes back to native weights from the int8 before it, then to int8 again
    assert switches == ["first-fixes", "int8", "first-fixes", "int8"], said


def test_run_ladder_for_the_app_runs_the_users_prompt_and_restores_options(tiny_llama):
    """The app's "Run ladder": rows per preset, the user's prompt, progress per step, options restored."""
    import threading

    from engine.engine import Engine
    from engine.ladder import run_ladder
    from engine.types import EngineOptions, SamplingParams

    before = EngineOptions(device="cpu", kv_cache="none", sampling="host")
    eng = Engine.load(str(tiny_llama), before)
    try:
        progress = []
        rows = run_ladder(
            eng,
            [{"role": "user", "content": "hello world"}],
            SamplingParams(temperature=1.5, max_new_tokens=6),  # the chat's; the ladder runs greedy
            presets=["naive", "first-fixes", "cuda-graph"],
            on_progress=lambda d, t, label: progress.append((d, t, label)),
            cancel=threading.Event(),
        )
        assert [r.preset for r in rows] == ["naive", "first-fixes", "cuda-graph"]
        naive, fixes, graph = rows
        assert naive.skipped is None and naive.decode_tok_s > 0 and naive.metrics["ttft_ms"] > 0
        # the counts the compare table shows for a ladder row (they were missing, so shown as 0)
        from engine.prompt import build_prompt

        n_prompt = len(
            build_prompt(eng.tokenizer, [{"role": "user", "content": "hello world"}], eng.context_length, 6).ids
        )
        assert naive.metrics["prompt_tokens"] == fixes.metrics["prompt_tokens"] == n_prompt
        assert naive.metrics["decode_steps"] == naive.metrics["new_tokens_total"] - 1
        # every timed run reads the whole prompt, so its TTFT is the prompt's (not a cached prefix's)
        assert naive.metrics["prompt_reused_tokens"] == fixes.metrics["prompt_reused_tokens"] == 0
        greedy = eng.generate(
            [{"role": "user", "content": "hello world"}], SamplingParams(temperature=0, max_new_tokens=6)
        )
        assert naive.metrics["new_tokens_total"] == fixes.metrics["new_tokens_total"] == len(greedy.token_ids[0])
        assert naive.options["kv_cache"] == "dynamic" and fixes.options["kv_cache"] == "static"
        assert graph.skipped and graph.decode_tok_s is None and graph.metrics is None
        assert progress[-1][0] == progress[-1][1] and all(d <= t for d, t, _ in progress)
        assert eng.options == before
        cancel = threading.Event()
        cancel.set()
        progress.clear()
        rows = run_ladder(
            eng,
            [{"role": "user", "content": "hi"}],
            SamplingParams(max_new_tokens=4),
            presets=["naive"],
            cancel=cancel,
            on_progress=lambda d, t, label: progress.append((d, t, label)),
        )
        assert rows[0].skipped == "cancelled before it ran" and rows[0].cancelled and rows[0].metrics is None
        assert progress == [(0, 2, "cancelled")]  # not "done"
        assert eng.options == before
        # Cancel during a rung's warm-up, then during one's timed run: each says it was stopped while it ran (both
        # were said to be cancelled before they ran), the rungs after it that they never ran
        for stop_at, cut_in in (("Naive: warm-up", "warm-up"), ("Naive", "timed run")):
            rows = _ladder_cancelled_at(eng, run_ladder, stop_at)
            assert rows[0].skipped == (
                f"cancelled while it ran (during its {cut_in}): a run cut short is no measurement"
            ), stop_at
            assert rows[0].cancelled and rows[1].skipped == "cancelled before it ran"
            assert eng.options == before
    finally:
        eng.close()


def _ladder_cancelled_at(eng, run_ladder, stop_at: str) -> list:
    """The app's ladder of two rungs, cancelled as the generation that the progress `stop_at` announces runs."""
    import threading

    cancel = threading.Event()
    state = {"stop": False}
    real = eng.generate

    def generate(*a, **kw):
        if state["stop"]:
            cancel.set()  # as the user's Cancel while this generation runs
        return real(*a, **kw)

    def on_progress(d, t, label):
        state["stop"] = label == stop_at

    eng.generate = generate
    try:
        return run_ladder(
            eng,
            [{"role": "user", "content": "hi"}],
            SamplingParams(max_new_tokens=4),
            presets=["naive", "first-fixes"],
            cancel=cancel,
            on_progress=on_progress,
        )
    finally:
        del eng.generate


def test_the_apps_ladder_drafts_with_the_draft_model_chosen(tiny_llama, tmp_path):
    from tiny_models import make_tiny_model

    from engine.engine import Engine
    from engine.ladder import run_ladder
    from engine.types import EngineOptions, SamplingParams

    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1)
    chosen = EngineOptions(device="cpu", speculation="draft", draft_model=str(draft), draft_tokens=3)
    eng = Engine.load(str(tiny_llama), chosen)
    try:
        (row,) = run_ladder(eng, [{"role": "user", "content": "hello"}], SamplingParams(), presets=["speculation"])
        assert row.skipped is None and row.options["speculation"] == "draft"
        assert (row.options["draft_model"], row.options["draft_tokens"]) == (str(draft), 3)
        assert "draft model draft" in row.metrics["speculation_source"]
        assert eng.options == chosen
    finally:
        eng.close()


def test_speculation_rung_runs_on_the_cpu_without_compile(tiny_llama, tmp_path, capsys):
    from app.cmd_bench import run_bench

    path = tmp_path / "bench.json"
    assert run_bench(bench_args(tiny_llama, path, presets="first-fixes,speculation")) == 0
    report = json.loads(path.read_text(encoding="utf-8"))
    fixes, spec = report["rungs"]
    assert spec["name"] == "speculation" and spec["status"] == "ok" and spec["label"] == "+ speculation"
    assert spec["options"]["speculation"] == "ngram" and spec["options"]["compile"] is False
    assert spec["notes"] == ["without compile and CUDA graph (compile off for this bench)"]
    assert spec["runs"][0]["token_ids"] == fixes["runs"][0]["token_ids"]  # greedy: the same answer
    m = spec["median"]
    assert m["tokens_per_step"] is not None and m["speculation_source"].startswith("engine counters: n-gram")
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| + speculation"))
    assert "eager, speculation ngram (1)" in row


def test_a_draft_model_the_engine_refuses_skips_the_speculation_rung_and_arm(tiny_llama, tmp_path, capsys):
    """The draft model is loaded, and its vocabulary checked, when the engine switches to it: a refused one skips
    the rung (and the workloads' arm) with the reason instead of timing plain decoding as speculation."""
    from tiny_models import make_tiny_model

    from app.cli import build_parser
    from app.cmd_bench import run_bench

    other = make_tiny_model(tmp_path / "other", "llama", vocab_size=300)
    path = tmp_path / "bench.json"
    args = bench_args(tiny_llama, path, presets="first-fixes,speculation", speculation="draft", draft_model=str(other))
    assert run_bench(args) == 0
    fixes, spec = json.loads(path.read_text(encoding="utf-8"))["rungs"]
    assert fixes["status"] == "ok" and spec["status"] == "skipped" and spec["runs"] == []
    assert spec["reason"].startswith("speculation: the draft model's vocabulary has 300 entries and the target's 320")
    table = capsys.readouterr().out.splitlines()
    assert next(line for line in table if line.startswith("| + speculation")).startswith(
        "| + speculation     | skipped"
    )
    assert "draft model" not in next(line for line in table if line.startswith("| + static KV cache"))
    path = tmp_path / "spec.json"
    argv = ["bench", "--model", str(tiny_llama), "--device", "cpu", "--speculation-workloads", "--json", str(path)]
    argv += ["--speculation", "draft", "--draft-model", str(other), "--max-new-tokens", "8"]
    assert run_bench(build_parser().parse_args(argv)) == 0
    (result,) = json.loads(path.read_text(encoding="utf-8"))["results"]
    assert result["status"] == "skipped" and "vocabulary has 300 entries" in result["reason"]


def test_speculation_workloads_report(tiny_llama, tmp_path, capsys):
    from app.cli import build_parser
    from app.cmd_bench import run_bench

    path = tmp_path / "spec.json"
    args = build_parser().parse_args(
        [
            "bench",
            "--model",
            str(tiny_llama),
            "--device",
            "cpu",
            "--speculation-workloads",
            "--max-new-tokens",
            "24",
            "--threads",
            "1",
            "--json",
            str(path),
        ]
    )
    threads = torch.get_num_threads()
    try:
        assert run_bench(args) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(path.read_text(encoding="utf-8"))
    assert report["torch_threads"] == 1 and report["config"]["speculation"] == "ngram"
    results = report["results"]
    assert [r["workload"] for r in results] == ["rewrite", "summarise", "free chat"]
    for r in results:
        assert r["status"] == "ok" and r["dtype"] == "fp32"
        assert all(p["identical"] for p in r["prompts"])  # greedy: the same tokens with and without
        off, on = r["plain"], r["speculation"]
        assert off["tokens_per_step"] == 1.0 and off["drafted_tokens"] == 0
        assert on["decode_tokens"] == off["decode_tokens"]
        assert r["speedup"] == pytest.approx(on["decode_tok_s"] / off["decode_tok_s"])
        # a null figure says why (the speculation-off arm's acceptance was null with no reason)
        assert off["acceptance_rate"] is None and off["unavailable"] == {"acceptance_rate": "speculation off"}
        assert on["unavailable"] == ({} if on["drafted_tokens"] else {"acceptance_rate": "no drafts were made"})
        assert r["unavailable"] == {}
    machine = report["machine"]  # gpu_name, sm_count and torch_cuda were null with no reason
    nulls = {k for k, v in machine.items() if v is None and not k.endswith("_reason")}
    assert set(machine["unavailable"]) == nulls
    if not torch.cuda.is_available():
        assert nulls >= {"gpu_name", "sm_count"}
        assert machine["unavailable"]["gpu_name"].startswith("no CUDA device: ")
    if torch.version.cuda is None:
        built = f"this torch ({torch.__version__}) is built without CUDA"
        assert machine["unavailable"]["torch_cuda"] == built and machine["unavailable"]["sm_count"].endswith(built)
    assert results[0]["standing"].startswith("target >= 1.5x") and results[1]["standing"] is None
    out = capsys.readouterr().out
    assert "| fp32  | rewrite " in out
    assert "on cpu, 1 torch thread; 24 new tokens, 3 runs per prompt and arm" in out  # it said "1 torch thread(s)"


@pytest.mark.parametrize(
    "threads, repeats, said",
    [
        (1, 1, "1 torch thread; 24 new tokens, 1 run per prompt and arm."),
        (2, 3, "2 torch threads; 24 new tokens, 3 runs"),
    ],
)
def test_the_speculation_table_counts_threads_and_runs_in_the_singular_or_plural(threads, repeats, said):
    """It said "1 torch thread(s)" and "1 run(s) per prompt and arm", whatever the count."""
    from engine.bench_spec import format_workloads

    report = {
        "results": [],
        "machine": {"load_average_at_start": None},
        "model": {"name": "tiny", "device": "cpu"},
        "torch_threads": threads,
        "config": {"max_new_tokens": 24, "repeats": repeats},
        "method": "greedy",
    }
    line = next(x for x in format_workloads(report).splitlines() if x.startswith("Model "))
    assert line.startswith(f"Model tiny on cpu, {said}")


def test_ctrl_c_during_speculation_workloads_keeps_the_workloads_measured_before_it(
    tiny_llama, tmp_path, monkeypatch, capsys
):
    """Ctrl+C during `gapless bench --speculation-workloads` printed no table and wrote no JSON: every workload
    measured was lost."""
    from app.cli import main
    from engine.engine import Engine

    real, calls = Engine.generate, []

    def ctrl_c_in_the_second_workload(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 8:  # 2 warm-ups, rewrite's 2 prompts with both arms, summarise's first prompt, arm on
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", ctrl_c_in_the_second_workload)
    path = tmp_path / "spec.json"
    argv = ["bench", "--speculation-workloads", "--model", str(tiny_llama), "--device", "cpu", "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert main([*argv, "--repeats", "1", "--max-new-tokens", "8", "--json", str(path)]) == 130
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    report = json.loads(path.read_text(encoding="utf-8"))
    assert report["interrupted"] is True and [p.name for p in tmp_path.iterdir()] == ["spec.json"]
    rewrite, summarise, chat = report["results"]
    assert (rewrite["workload"], rewrite["status"], len(rewrite["prompts"])) == ("rewrite", "ok", 2)
    assert rewrite["plain"]["decode_tok_s"] > 0
    stopped = "the bench was interrupted (Ctrl+C) while it ran: its arms compare only over all its prompts and repeats"
    before = "the bench was interrupted (Ctrl+C) before it started"
    assert summarise == {"dtype": "fp32", "workload": "summarise", "status": "interrupted", "reason": stopped}
    assert chat == {"dtype": "fp32", "workload": "free chat", "status": "interrupted", "reason": before}
    assert report["not_run"] == {"fp32 summarise": stopped, "fp32 free chat": before}
    assert [c["dtype"] for c in report["step_costs"]] == ["fp32"]  # measured before the workloads: kept
    lines = out.splitlines()
    assert next(x for x in lines if x.startswith("| fp32  | summarise ")).split("|")[3].strip() == "interrupted"
    assert f"fp32 summarise: {stopped}." in lines and f"fp32 free chat: {before}." in lines
    assert err.splitlines()[-1] == "gapless: interrupted: the table and JSON hold the runs measured before it"


def test_an_arm_without_decode_steps_says_why_each_figure_is_null():
    from engine.bench_spec import NO_DECODE, _arm

    first_token_only = {"decode_seconds": None, "new_tokens_total": 1, "decode_steps": 0, "decode_tok_s": None}
    arm = _arm([first_token_only], drafting=True)
    assert arm["decode_tok_s"] is arm["tokens_per_step"] is arm["acceptance_rate"] is None
    assert arm["unavailable"] == {
        "decode_tok_s": NO_DECODE,
        "tokens_per_step": NO_DECODE,
        "acceptance_rate": "no drafts were made",
    }
    assert NO_DECODE == "the answers ended at their first token: no decode step ran"


def test_footnotes_say_each_rung_s_reason_and_why_naive_ratios_are_na():
    """Two rungs n/a for different reasons are both said (not the first rung's for all); without the Naive rung the
    × Naive column says why it is n/a."""
    report, _ = sample_report()
    report["rungs"][0]["median"]["unavailable"]["acceptance_rate"] = "speculation off"
    report["rungs"][2]["median"]["unavailable"]["acceptance_rate"] = "no drafts were verified (2 tokens)"
    table = format_table(report)
    assert "Acceptance: n/a: Naive: speculation off; + static KV cache: no drafts were verified (2 tokens)." in table
    assert "× Naive: n/a" not in table
    from dataclasses import asdict

    rungs = [rung("first-fixes", "+ static KV cache", 25.0, opts())]
    report["ratios"] = add_ratios(rungs, [])
    report["rungs"] = [asdict(r) for r in rungs]
    assert "× Naive: n/a (the Naive rung was not among the presets)." in format_table(report)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--conversation", "--presets", "bogus"], "--presets is for the ladder, not --conversation"),
        (["--quality", "--prompt", "MY PROMPT"], "--prompt is for the ladder, not --quality"),
        (
            ["--conversation", "--compile"],
            "--compile is for the ladder and --speculation-workloads, not --conversation",
        ),
        (["--quality", "--draft-tokens", "3"], "--draft-tokens is for the ladder and --speculation-workloads"),
        (["--dtypes", "bf16"], "--dtypes is for --speculation-workloads, not the ladder"),
        (["--cuda-graph"], "--cuda-graph is for --speculation-workloads, not the ladder"),
        (["--turns", "3"], "--turns is for --conversation, not the ladder"),
        (["--speculation-workloads", "--no-baseline"], "--baseline is for the ladder, not --speculation-workloads"),
        # given at their default value, they were taken as left out
        (["--conversation", "--baseline"], "--baseline is for the ladder, not --conversation"),
        (["--quality", "--turns", "10"], "--turns is for --conversation, not --quality"),
        (["--quality", "--tur", "10"], "--turns is for --conversation, not --quality"),  # as argparse reads it
        (["--quality", "--repeats", "0"], "--repeats must be at least 1 and --max-new-tokens at least 2"),
        (["--max-new-tokens", "1"], "--max-new-tokens at least 2, got 3 and 1"),
        (["--conversation", "--max-new-tokens", "0"], "--max-new-tokens at least 1"),
        # accepted and then ignored before: a rung's flag where --presets leaves its rung out, a draft model
        # without draft speculation (the rung ran n-gram), an empty --presets (it ran the whole ladder)
        (["--presets", "naive", "--candidates", "8"], "--candidates is for the candidates rung, which --presets"),
        (["--presets", "naive,half", "--draft-tokens", "4"], "--draft-tokens is for the speculation rung"),
        (["--draft-model", "d.gguf"], "--draft-model is the model --speculation draft drafts with"),
        (["--speculation-workloads", "--draft-model", "d.gguf"], "give --speculation draft too"),
        (["--presets", ""], "--presets: no preset to run"),
        (["--presets", " , "], "--presets: no preset to run"),
        # an empty --dtypes ran the default dtypes, where an empty --presets was refused
        (["--speculation-workloads", "--dtypes", ""], "--dtypes: no dtype to run (leave the flag out for the default"),
        (["--speculation-workloads", "--dtypes", ","], "--dtypes: no dtype to run"),
    ],
)
def test_a_flag_the_chosen_bench_would_not_read_is_refused(argv, words):
    from app.cli import build_parser
    from app.cmd_bench import check_flags

    with pytest.raises(OptionsError) as info:
        check_flags(build_parser().parse_args(["bench", *argv]))
    assert words in str(info.value)


@pytest.mark.parametrize("kind", [[], ["--conversation"], ["--speculation-workloads"]])
def test_counts_no_answer_can_have_are_refused_before_the_model_loads(kind, tmp_path, capsys):
    """Past the engine's limits, every answer was refused only once the model had loaded: the ladder then printed
    a table of failed rungs and exited 1, the other kinds exited after loading (and a warm-up). The model named here
    does not exist: a check after loading would say so instead."""
    from app.cli import main

    bench = ["bench", *kind, "--model", str(tmp_path / "nope.gguf"), "--device", "cpu", "--repeats", "1"]
    assert main([*bench, "--max-new-tokens", "2000000"]) == 2
    assert capsys.readouterr().err == "gapless: error: --max-new-tokens is at most 1048576, got 2000000\n"
    if kind != ["--conversation"]:  # the two kinds that draft
        with pytest.raises(SystemExit) as exited:  # refused as the arguments are read
            main([*bench, "--draft-tokens", "99"])
        assert exited.value.code == 2
        assert "argument --draft-tokens: expected 1..15 tokens or 'auto', got '99'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, said",
    [
        (
            ["--presets", "naive,,half"],
            "--presets: 'naive,,half' has an empty item; name each preset once, between commas",
        ),
        (
            ["--presets", "naive,half,"],
            "--presets: 'naive,half,' has an empty item; name each preset once, between commas",
        ),
        (["--presets", "naive, half,naive"], "--presets: preset naive is given twice; name each preset once"),
        (
            ["--speculation-workloads", "--dtypes", "fp32,fp32"],
            "--dtypes: dtype fp32 is given twice; name each dtype once",
        ),
        (
            ["--speculation-workloads", "--dtypes", ",bf16"],
            "--dtypes: ',bf16' has an empty item; name each dtype once, between commas",
        ),
        # auto is fp32 on the CPU: fp32 ran twice, the second time on the cache the first left
        (
            ["--speculation-workloads", "--dtypes", "fp32,auto"],
            "--dtypes: fp32 and auto are both fp32 on cpu; name each once",
        ),
    ],
)
def test_a_list_flag_with_an_empty_or_repeated_item_is_refused_before_the_model_loads(argv, said, tmp_path, capsys):
    """`--dtypes fp32,fp32` ran fp32 twice, `--presets naive,naive` ran Naive once, and `--presets naive,,half`
    dropped the empty item without a word. The model named here does not exist: a check after loading would say
    so instead."""
    from app.cli import main

    bench = ["bench", "--model", str(tmp_path / "nope.gguf"), "--device", "cpu", "--json", str(tmp_path / "b.json")]
    assert main([*bench, *argv]) == 2
    assert capsys.readouterr() == ("", f"gapless: error: {said}\n")
    assert list(tmp_path.iterdir()) == []


def test_more_threads_than_the_machine_has_cores_are_refused(monkeypatch):
    """`--threads 100000` ended the process in a segmentation fault inside torch, with nothing said."""
    import os

    from app.cli import build_parser
    from app.cmd_bench import check_flags

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    parser = build_parser()
    for kind in ([], ["--quality"], ["--conversation"], ["--speculation-workloads"]):
        check_flags(parser.parse_args(["bench", *kind, "--threads", "4"]))  # no error
        with pytest.raises(OptionsError) as info:
            check_flags(parser.parse_args(["bench", *kind, "--threads", "100000"]))
        expected = (
            "--threads is at most this machine's 4 logical cores (more threads only wait for each other), got 100000"
        )
        assert str(info.value) == expected


def test_bench_kinds_are_one_at_a_time_and_their_own_flags_pass(capsys):
    from app.cli import build_parser
    from app.cmd_bench import check_flags

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--conversation", "--quality"])
    assert "not allowed with argument" in capsys.readouterr().err
    for argv in (
        ["--presets", "naive,speculation", "--compile", "--no-baseline", "--draft-tokens", "3", "--prompt", "x"],
        ["--conversation", "--turns", "3", "--max-new-tokens", "1"],
        ["--quality", "--max-new-tokens", "8"],
        ["--speculation-workloads", "--dtypes", "bf16", "--cuda-graph", "--compile", "--speculation", "ngram"],
    ):
        check_flags(parser.parse_args(["bench", *argv]))  # no error
    assert config_from_args(parser.parse_args(["bench", "--prompt", ""])).prompt == ""  # then refused as empty
    # every timed run reads the whole prompt unless asked (the flag's default had stayed on)
    assert config_from_args(parser.parse_args(["bench"])).prefix_reuse is False
    assert config_from_args(parser.parse_args(["bench", "--prefix-reuse"])).prefix_reuse is True
    with pytest.raises(OptionsError, match="the prompt is empty"):
        validate(config_from_args(parser.parse_args(["bench", "--prompt", ""])))


def test_the_quality_bench_decodes_64_tokens_unless_told_fewer(monkeypatch):
    import app.cmd_bench as cmd_bench
    from app.cli import build_parser

    configs = []
    monkeypatch.setattr(cmd_bench, "_report", lambda args, run, config, table: configs.append(config) or {})
    parser = build_parser()

    def quality(*argv: str) -> None:
        args = parser.parse_args(["bench", "--quality", *argv])
        cmd_bench.check_flags(args)  # as run_bench does first: it fills in each kind's default
        cmd_bench.run_quality_bench(args)

    quality()
    quality("--max-new-tokens", "8")
    assert [c.decode_tokens for c in configs] == [64, 8]
    for asked in ("100", "128"):  # 128, the ladder's default, was silently run as 64
        with pytest.raises(OptionsError, match=f"with --quality, --max-new-tokens is at most 64, got {asked}"):
            quality("--max-new-tokens", asked)


def test_the_speculation_table_says_why_each_figure_it_shows_as_na_is():
    """The JSON said why each null figure is, the table showed a bare "n/a" (an accepted % on a workload where no
    drafts were made, every figure of an answer that ended at its first token)."""
    from engine.bench_spec import NO_DECODE, _arm, format_workloads

    decoded = {"decode_seconds": 0.5, "new_tokens_total": 9, "decode_steps": 8, "decode_tok_s": 16.0}
    first_token_only = {"decode_seconds": None, "new_tokens_total": 1, "decode_steps": 0, "decode_tok_s": None}
    prompts = [{"prompt": "p", "tokens": 9, "identical": True, "first_difference": None}]
    no_drafts = {
        "dtype": "fp32",
        "workload": "free chat",
        "status": "ok",
        "plain": _arm([decoded], drafting=False),
        "speculation": _arm([decoded], drafting=True),
        "speedup": 1.0,
        "unavailable": {},
        "standing": None,
        "prompts": prompts,
    }
    no_decode = {
        **no_drafts,
        "workload": "rewrite",
        "plain": _arm([first_token_only], drafting=False),
        "speculation": _arm([first_token_only], drafting=True),
        "speedup": None,
        "unavailable": {"speedup": "no decode figure with speculation off and on"},
    }
    report = {
        "results": [no_drafts, no_decode],
        "machine": {"load_average_at_start": None},
        "model": {"name": "tiny", "device": "cpu"},
        "torch_threads": 1,
        "config": {"max_new_tokens": 24, "repeats": 1},
        "method": "greedy",
    }
    lines = format_workloads(report).splitlines()
    assert [c.strip() for c in lines[2].split("|")[3:8]] == ["16.0", "16.0", "1.00×", "n/a (1)", "1.00"]
    assert [c.strip() for c in lines[3].split("|")[3:8]] == ["n/a (2)", "n/a (2)", "n/a (3)", "n/a (4)", "n/a (2)"]
    assert [x for x in lines if x[:1] == "("] == [
        "(1) fp32 free chat: accepted % n/a: no drafts were made.",
        f"(2) fp32 rewrite: plain tok/s, speculation tok/s and tok/step n/a: {NO_DECODE}.",
        "(3) fp32 rewrite: speedup n/a: no decode figure with speculation off and on.",
        "(4) fp32 rewrite: accepted % n/a: no drafts were made.",
    ]


def test_a_missed_speculation_target_shows_as_many_decimals_as_the_miss_needs():
    """0.9454 against a target of 0.95 read "missed (0.95x, 0.00 short)"."""
    from engine.bench_spec import standing

    assert standing("free chat", 0.9454) == "target >= 0.95x: missed (0.945x, 0.005 short)"
    assert standing("free chat", 0.90) == "target >= 0.95x: missed (0.90x, 0.05 short)"
    assert standing("rewrite", 1.49996) == "target >= 1.5x: missed (1.49996x, 0.00004 short)"
    assert standing("free chat", 0.95) == "target >= 0.95x: met (0.95x)"
