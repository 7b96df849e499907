"""The `gapless` command line run as a user runs it: a child process on this checkout's code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO, Optional

ROOT = Path(__file__).resolve().parents[1]


def gapless(
    *args: str, timeout: float = 300, extra_env: Optional[dict[str, str]] = None, stdin: Optional[BinaryIO] = None
) -> subprocess.CompletedProcess:
    """Run `gapless ARGS`; `extra_env` adds variables to the test process's environment (an API key); `stdin`: a
    file its standard input reads (else none: /dev/null)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONIOENCODING="utf-8", **(extra_env or {}))
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        stdin=stdin if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def bench_argv(mode: str, model: Path, out: Path, *flags: str) -> list[str]:
    """The arguments of `gapless bench <mode>` at its smallest on the CPU (one repeat of 4 tokens), writing its
    JSON to `out`."""
    smallest = ["--repeats", "1", "--max-new-tokens", "4"]
    return ["bench", mode, "--model", str(model), "--device", "cpu", *flags, *smallest, "--json", str(out)]


def generate_json(model: Path, prompt: str, *flags: str) -> dict:
    """`gapless generate --json` of `prompt` on the CPU: the command succeeds, and its JSON is returned."""
    r = gapless("generate", "--model", str(model), "--prompt", prompt, "--device", "cpu", *flags, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)
