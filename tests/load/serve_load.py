"""A bounded load test of `gapless serve` on loopback: N streaming chat requests from C concurrent clients.

    PYTHONPATH=. python tests/load/serve_load.py --model default --requests 200 --concurrency 16 --json out.json

The server runs as its own process (so its RSS is its own). First each prompt is answered once, alone: its greedy
answer is the reference and the server is warm. Then the clients send the requests; every one must either end
with `data: [DONE]` and exactly its prompt's reference text (anything else is mixed), or get a 503; any other end
is lost. Reports throughput (requests and tokens per second of wall time), client-side TTFT p50/p99, and the
server's RSS after the warm-up and after the run. Stops by itself: a fixed number of requests, each with a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import httpx

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Give a synonym for happy.",
    "What does a CPU do? One sentence.",
    "Name a planet in the solar system.",
    "Say hello in Spanish.",
]


def rss_bytes(pid: int) -> Optional[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def start_server(model: str, max_queue: int) -> tuple[subprocess.Popen, str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app",
            "serve",
            "--model",
            model,
            "--port",
            "0",
            "--device",
            "cpu",
            "--max-queue",
            str(max_queue),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert p.stderr is not None
    for line in p.stderr:
        m = re.search(r"serving (.+) at (http://\S+/v1)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()  # keep draining
            return p, m.group(2), m.group(1)
    p.wait()
    raise SystemExit(f"the server did not start (exit {p.returncode})")


def one(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    out: dict[str, Any] = {"prompt": prompt, "status": None, "text": "", "ttft_s": None, "done": False, "tokens": 0}
    try:
        with client.stream("POST", f"{url}/chat/completions", json=body) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                r.read()
                return out
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                obj = json.loads(line[6:])
                if obj.get("x_gapless"):
                    out["engine_ttft_ms"] = obj["x_gapless"]["ttft_ms"]["value"]
                    out["queue_wait_ms"] = obj["x_gapless"]["queue_wait_ms"]["value"]
                if obj.get("usage"):
                    out["tokens"] = obj["usage"]["completion_tokens"]
                for c in obj.get("choices", []):
                    text = c["delta"].get("content") or ""
                    if text and out["ttft_s"] is None:
                        out["ttft_s"] = time.perf_counter() - t0
                    out["text"] += text
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["total_s"] = time.perf_counter() - t0
    return out


def pct(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def run(model: str, requests: int, concurrency: int, max_tokens: int, max_queue: int) -> dict[str, Any]:
    proc, url, model_id = start_server(model, max_queue)
    try:
        with httpx.Client(timeout=httpx.Timeout(600.0)) as client:
            reference = {p: one(client, url, model_id, p, max_tokens)["text"] for p in PROMPTS}
            rss_before = rss_bytes(proc.pid)
            jobs = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                results = list(pool.map(lambda p: one(client, url, model_id, p, max_tokens), jobs))
            wall = time.perf_counter() - t0
            rss_after = rss_bytes(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    ok = [r for r in results if r["status"] == 200 and r["done"]]
    busy = [r for r in results if r["status"] == 503]
    mixed = [r for r in ok if r["text"] != reference[r["prompt"]]]
    lost = [r for r in results if r not in ok and r not in busy]
    ttfts = [r["ttft_s"] * 1e3 for r in ok if r["ttft_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "command": " ".join(sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs ({platform.processor() or platform.platform()}), "
        "no GPU, shared with other work",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": model_id,
        "requests": requests,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "max_queue": max_queue,
        "completed": len(ok),
        "rejected_503": len(busy),
        "lost": len(lost),
        "mixed": len(mixed),
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "completion_tok_s": tokens / wall,
        "ttft_ms_p50": pct(ttfts, 50),
        "ttft_ms_p99": pct(ttfts, 99),
        "ttft_source": "client-side: request sent -> first text chunk, the wait in the server's queue included",
        "engine_ttft_ms_p50": pct([r["engine_ttft_ms"] for r in ok if r.get("engine_ttft_ms") is not None], 50),
        "engine_ttft_ms_p99": pct([r["engine_ttft_ms"] for r in ok if r.get("engine_ttft_ms") is not None], 99),
        "engine_ttft_source": "x_gapless.ttft_ms: engine timing, prompt in -> first token, queue excluded",
        "queue_wait_ms_p50": pct([r["queue_wait_ms"] for r in ok if r.get("queue_wait_ms") is not None], 50),
        "rss_before_bytes": rss_before,
        "rss_after_bytes": rss_after,
        "rss_change_pct": (rss_after - rss_before) / rss_before * 100 if rss_before and rss_after else None,
        "lost_examples": [{k: r.get(k) for k in ("status", "error", "done")} for r in lost[:3]],
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    report = run(args.model, args.requests, args.concurrency, args.max_tokens, args.max_queue)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if report["lost"] == 0 and report["mixed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
