"""The GPU check script runs on a CPU machine too: CUDA sections skipped with the reason, CPU parity real."""
from __future__ import annotations

import json

import torch

from gpu.gpu_check import main


def test_gpu_check_on_cpu_skips_cuda_sections_and_checks_parity(tmp_path):
    if torch.cuda.is_available():
        import pytest

        pytest.skip("this test checks the CPU behaviour of the script")
    rc = main(["--out", str(tmp_path), "--model", "tiny", "--max-new-tokens", "8", "--budget-s", "300"])
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = data["sections"]
    assert rc == 0, {k: v.get("error") for k, v in sections.items()}
    assert sections["machine"]["ok"] and sections["machine"]["result"]["cpu_model"]
    for name in ("nvml", "ladder", "parity_fp16", "parity_bf16", "oom_fallback"):
        assert sections[name] == {"skipped": "no CUDA device on this machine"}
    par = sections["parity_fp32"]["result"]
    combos = {(r["options"]["kv_cache"], r["options"]["sampling"], r["options"]["candidates"]) for r in par["rows"]}
    assert len(combos) == 12  # 3 cache modes x 2 sampling modes x candidates 1 and 4
    assert par["all_identical"] is True
