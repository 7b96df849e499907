"""The fused kernels compile for the GPU without one: Triton's compiler and its ptxas on the calls a real step
makes, for Hopper with PDL and for Ampere without, in each dtype, and no kernel spills registers (ptxas's resource
usage: no stack frame, no local memory). The interpreter runs the same kernels' logic; this checks what only the
GPU compiler sees (types, layouts, PDL's instructions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels import STEP_KERNELS

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("fused_aot.py")


@pytest.mark.parametrize(
    "arch,pdl,dtype,family,rows",
    [
        (90, True, "fp16", "llama", 1),
        (80, False, "bf16", "qwen3", 5),
        (90, True, "fp32", "qwen2", 16),
    ],
)
def test_every_kernel_compiles_for_the_gpu_without_spilling(arch, pdl, dtype, family, rows):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "GAPLESS_TRITON_INTERPRET")}
    cmd = [sys.executable, str(SCRIPT), "--arch", str(arch), "--dtype", dtype, "--family", family, "--rows", str(rows)]
    out = subprocess.run(cmd + (["--pdl"] if pdl else []), env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows_ = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {r["kernel"] for r in rows_} == set(STEP_KERNELS)
    assert sum(r["kernel"] == "qkv_rope_kernel" for r in rows_) == 2  # the first layer's (embedding) and the rest
    for r in rows_:
        assert r["arch"] == arch and r["pdl"] == pdl
        assert r["stack"] == 0 and r["local"] == 0, f"{r['kernel']} spills: {r}"
