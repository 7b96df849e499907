"""The GPU check script runs on a CPU machine too: CUDA sections skipped with the reason, CPU parity real."""

from __future__ import annotations

import json

import torch

from gpu.gpu_check import main


def test_gpu_check_on_cpu_skips_cuda_sections_and_checks_parity(tmp_path):
    if torch.cuda.is_available():
        import pytest

        pytest.skip("this test checks the CPU behaviour of the script")
    rc = main(["--out", str(tmp_path), "--model", "tiny", "--max-new-tokens", "24", "--budget-s", "300"])
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = data["sections"]
    assert rc == 0, {k: v.get("error") for k, v in sections.items()}
    assert sections["machine"]["ok"] and sections["machine"]["result"]["cpu_model"]
    assert sections["model"]["result"]["kind"] == "tiny"
    for name in (
        "nvml",
        "fused",
        "ladder",
        "sdpa_first_use",
        "kernels",
        "parity_fp16",
        "parity_bf16",
        "oom_fallback",
        "logits_fp16",
        "logits_bf16",
        "speculation",
        "weights",
    ):
        assert sections[name] == {"skipped": "no CUDA device on this machine"}
    tel = sections["telemetry"]["result"]  # the recording runs on any device; the GPU's is the one that counts
    from engine.recording import load

    recording = load(tmp_path / tel["file"])
    assert len(recording.steps) == tel["steps"] > 0 and recording.machine["cpu_model"]
    assert recording.metrics.decode_tok_s == tel["decode_tok_s"]
    par = sections["parity_fp32"]["result"]
    combos = {(r["options"]["kv_cache"], r["options"]["sampling"], r["options"]["candidates"]) for r in par["rows"]}
    assert len(combos) == 12  # 3 cache modes x 2 sampling modes x candidates 1 and 4
    assert par["all_identical"] is True
    row = next(r for r in par["rows"] if r["options"]["kv_cache"] == "static" and r["options"]["candidates"] == 1)
    assert row["kernel_gap_source"].startswith("op gap")  # the window ran in every row


def test_first_step_logits_feed_the_step_as_the_compiled_runner_does(tmp_path):
    """The logits comparison itself, with an identity in place of torch.compile: equal logits, and the step fed
    the way the static runner feeds its compiled and captured step (the whole bucket under the position mask)."""
    from gpu.gpu_check import TINY, logits_check, make_model_folder

    folder = make_model_folder(tmp_path / "tiny", TINY)
    seen = []

    def identity(model, **kw):
        seen.append(kw)
        return model

    got = logits_check(folder, "cpu", "fp32", compile_fn=identity)
    assert seen == [{"dynamic": False}]
    assert got["max_abs_diff"] == 0.0 and got["within"] and got["same_argmax"]
    assert got["max_abs_logit"] > 0


def test_an_interrupted_section_keeps_its_progress(tmp_path):
    from gpu.gpu_check import Report

    report = Report(tmp_path, budget_s=60)

    def long_section():
        say = report.progress("ladder")
        say("naive: run 1/3: 212.0 tok/s, 200 tokens")
        raise KeyboardInterrupt

    try:
        report.section("ladder", long_section)
    except KeyboardInterrupt:
        pass
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    sec = data["sections"]["ladder"]
    assert sec["ok"] is False and sec["error"] == "interrupted (time limit)"
    assert sec["progress"][0].endswith("naive: run 1/3: 212.0 tok/s, 200 tokens")


def test_chosen_sections_only_and_unknown_ones_refused(tmp_path, capsys):
    import pytest

    rc = main(["--out", str(tmp_path), "--model", "tiny", "--sections", "nvml,logits_fp16"])
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert rc == 0 and set(sections) == {"machine", "model", "nvml", "logits_fp16"}
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--sections", "ladder,warp_drive"])
    assert "unknown sections ['warp_drive']" in capsys.readouterr().err


def test_kernel_table_counts_kernels_per_pass_by_kind():
    from gpu.gpu_check import kernel_table

    ev = lambda name, dur, cat="kernel": {"name": name, "dur": dur, "cat": cat, "ts": 0}  # noqa: E731
    trace = {
        "traceEvents": [
            ev("nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNT", 4.0),
            ev("nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNT", 6.0),
            ev("fmha_cutlassF_f16_aligned_64x64_rf_sm80", 3.0),
            ev("triton_red_fused_add_mean_mul_rsqrt_0", 1.0),
            ev("triton_poi_fused_index_copy_1", 1.0),
            ev("void at::native::vectorized_elementwise_kernel", 2.0),
            ev("cudaGraphLaunch", 50.0, cat="cuda_runtime"),  # not a kernel: left out
        ]
    }
    t = kernel_table(trace, forward_passes=2)
    assert t["kernels_per_pass"] == 3.0 and t["kernel_us_per_pass"] == 8.5
    assert t["by_kind"]["matmul (cuBLAS/CUTLASS)"] == {"kernels_per_pass": 1.0, "us_per_pass": 5.0}
    assert t["by_kind"]["attention"]["kernels_per_pass"] == 0.5
    assert t["by_kind"]["fused (inductor Triton)"]["kernels_per_pass"] == 1.0
    assert t["by_kind"]["other"]["us_per_pass"] == 1.0
    assert t["top"][0]["name"].startswith("nvjet") and t["top"][0]["mean_us"] == 5.0


def test_kernels_and_sdpa_sections_run_their_course_on_the_cpu(tmp_path):
    """The two measuring sections run end to end on the CPU (eager, no graph; CPU ops carry no kernels), so a
    lent GPU's minutes are not spent finding a slip in them."""
    import torch._inductor.config as inductor_config

    from gpu.gpu_check import KERNEL_VARIANTS, TINY, changes_compiled_code, kernels, make_model_folder, sdpa_first_use

    folder = make_model_folder(tmp_path / "tiny", TINY)
    before = inductor_config.coordinate_descent_tuning
    got = kernels(folder, lambda msg: None, max_new=8, device="cpu", fast_path=False)
    assert inductor_config.coordinate_descent_tuning == before  # the variants' settings do not leak out
    assert [v["variant"] for v in got["variants"]] == [v[0] for v in KERNEL_VARIANTS]
    assert all(v["same_tokens_as_first_variant"] and v["forward_passes"] == 8 for v in got["variants"])
    assert got["variants"][-1]["candidates"] == 16
    changed = [v[0] for v in KERNEL_VARIANTS if changes_compiled_code(v)]
    assert [p["variant"] for p in got["fp32_parity"]] == changed
    assert all(p["identical"] is True for p in got["fp32_parity"])
    first_use = sdpa_first_use(folder, lambda msg: None, device="cpu")
    assert [r["prompt_tokens"] for r in first_use["rows"]] == [300, 600]
    assert all(r["first_tok_s"] > 0 and r["second_tok_s"] > 0 for r in first_use["rows"])


def test_fused_section_runs_its_cpu_parts_through_the_interpreter(tmp_path):
    """The fused section's parity and half-precision parts, on the CPU through Triton's interpreter, so a lent
    GPU's minutes are not spent finding a slip in them; the speed and bandwidth parts need CUDA."""
    import pytest

    pytest.importorskip("triton")
    from engine.kernels import interpreting
    from gpu.fused_check import fused_check
    from gpu.gpu_check import TINY, make_model_folder

    if not interpreting():
        pytest.skip("needs GAPLESS_TRITON_INTERPRET=1 (set by conftest on a machine without CUDA)")
    folder = make_model_folder(tmp_path / "tiny", dict(TINY, num_hidden_layers=1))
    said = []
    got = fused_check(folder, said.append, device="cpu", max_new=6)
    par = got["parity_fp32"]
    assert par["all_identical"] and [r["options"]["kernels"] for r in par["rows"]] == ["fused", "fused"]
    assert [r["options"]["candidates"] for r in par["rows"]] == [1, 4]
    for dtype in ("fp16", "bf16"):
        h = got[f"half_{dtype}"]
        assert h["options"]["kernels"] == "fused" and h["within"] and h["same_argmax"]
        assert h["first_divergence"] is None or 0 <= h["first_divergence"] < 6
    assert "speed_pdl" not in got and said[0].startswith("fp32 fused vs eager: identical=True")


def test_fused_trace_helpers():
    from gpu.fused_check import fused_kind, overlapping_pairs

    ev = lambda name, ts, dur: {"name": name, "ts": ts, "dur": dur, "cat": "kernel"}  # noqa: E731
    trace = {
        "traceEvents": [
            ev("qkv_rope_kernel", 0, 3),
            ev("decode_attention_kernel", 2, 3),
            ev("gemv_residual_kernel", 6, 1),
            ev("nvjet_hsh_64x8", 7, 2),
            {"name": "cudaGraphLaunch", "ts": 0, "dur": 50, "cat": "cuda_runtime"},
        ]
    }
    assert overlapping_pairs(trace) == 1  # the attention starts before the QKV kernel ends; the rest do not
    assert fused_kind("norm_head_kernel") == "norm_head_kernel"
    assert fused_kind("nvjet_hsh_64x8") == "torch matmul (cuBLAS/CUTLASS)"


def test_speculation_section_runs_its_course_on_the_cpu(tmp_path):
    """The speculation section eager on the CPU: every workload with both arms, the same greedy tokens, and the
    step costs of every draft length."""
    from gpu.gpu_check import TINY, make_model_folder, speculation

    folder = make_model_folder(tmp_path / "tiny", TINY)
    threads = torch.get_num_threads()
    try:
        got = speculation(folder, lambda msg: None, device="cpu", max_new=16)
    finally:
        torch.set_num_threads(threads)
    assert [r["workload"] for r in got["results"]] == ["rewrite", "summarise", "free chat"]
    assert all(r["status"] == "ok" and all(p["identical"] for p in r["prompts"]) for r in got["results"])
    costs = got["step_costs"][0]
    assert set(costs["verify_step_ms"]) == {"1", "2", "4", "8", "15"} and costs["plain_step_ms"] > 0
    assert "| fp32  | rewrite " in got["table"]


def test_the_weights_section_on_a_tiny_shape_on_the_cpu(tmp_path):
    """What the weights section computes, run eagerly on the CPU in fp32 on the tiny shape: a random folder the
    engine loads, each format placed and timed, memory ratios against native (no fp32 embedding kept: int8 under
    0.3x of fp32, int4 under int8)."""
    from gpu.gpu_check import weight_formats

    lines: list[str] = []
    out = weight_formats(tmp_path, ["tiny"], lines.append, device="cpu", dtype="fp32", fast=False, max_new=6, repeats=1)
    rows = out["tiny"]["formats"]
    assert list(rows) == ["native", "int8", "int4"] and len(lines) == 4
    for fmt, row in rows.items():
        assert row["decode_tok_s"] > 0 and row["allocated_bytes_after_placing"] is None, fmt
        assert "weights" not in row["unavailable"], fmt
    assert rows["int8"]["weight_bytes_vs_native"] < 0.3
    assert rows["int4"]["weight_bytes"] < rows["int8"]["weight_bytes"]
    assert rows["int8"]["decode_vs_native"] > 0


def test_every_section_fits_one_call_s_default_budget():
    """A section whose need_s passes the default budget is skipped in every call: the ladder's (250 s) did, once
    the budget came down to 240 s for calls of 5 minutes."""
    import re
    import subprocess
    from pathlib import Path

    script = Path(__file__).with_name("gpu_check.py").read_text()
    budget = float(re.search(r'"--budget-s", type=float, default=(\d+)', script).group(1))
    needs = [float(n) for n in re.findall(r"need_s=(\d+)", script)]
    assert needs and max(needs) <= budget
    wrapper = Path(__file__).with_name("run_on_device.sh").read_text()
    assert f'"${{BUDGET_S:-{budget:.0f}}}"' in wrapper
    subprocess.run(["bash", "-n", str(Path(__file__).with_name("run_on_device.sh"))], check=True)
