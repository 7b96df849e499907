"""Profiler chatter is kept off stderr; everything else written to stderr meanwhile still arrives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.telemetry.quiet import filter_chatter

ROOT = Path(__file__).resolve().parents[2]


def test_filter_drops_kineto_lines_only():
    data = (
        b"USDT:2026-11-30 13:15:29 10980:10980 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
        b"real warning: disk almost full\n"
        b"STAGE:2026-11-30 13:20:09 14796:14796 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\n"
        b"[W1130 External init callback must run in same thread as registerClient (1 != 2)\n"
        b"USDT: not a kineto line\n"
    )
    assert filter_chatter(data) == b"real warning: disk almost full\nUSDT: not a kineto line\n"


def test_a_profiled_generation_prints_nothing_on_stderr(tiny_llama):
    code = (
        "import sys\n"
        "from engine.engine import Engine\n"
        "from engine.types import EngineOptions, SamplingParams\n"
        f"e = Engine.load({str(tiny_llama)!r}, EngineOptions(device='cpu'))\n"
        "r = e.generate([{'role': 'user', 'content': 'hello'}], SamplingParams(temperature=0, max_new_tokens=24))\n"
        "assert r.metrics.profiled_steps > 0, r.metrics\n"
        "sys.stderr.write('after\\n')\n"
        "e.close()\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), TQDM_DISABLE="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "USDT" not in r.stderr and "profiler_start" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "after"
