"""The CPU's memory read bandwidth, measured once per machine and kept in the user cache dir.

A GPU's peak bandwidth comes from NVML (memory clock x bus width); a CPU reports none. The memory floor of a
decode step on the CPU (the weights' bytes per token over the bandwidth) needs one, so it is measured: torch
sums a buffer far larger than any cache (MEASURE_BYTES) with the threads the engine runs with, after one pass
that touches its pages, and the best of MEASURE_REPEATS passes gives bytes per second. What is measured is what
torch's own streaming kernel achieves, a lower bound of the hardware's peak, so the floor it gives is at or
above the true one; every figure built on it says so in its source.

The result is kept in `cpu-bandwidth.json` under the cache dir, keyed by the CPU model, its logical CPUs, the
installed memory and the thread count, so a launch reads it back in a millisecond and a different machine or
thread count measures again. A file that cannot be read or parsed is measured over and replaced.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from engine.paths import cache_dir, write_whole
from engine.telemetry.machine import cpu_model, memory_bytes

log = logging.getLogger(__name__)

MEASURE_BYTES = 512 << 20  # beyond the largest L3 of common desktop and workstation CPUs (AMD's X3D: 96-128 MiB)
MEASURE_REPEATS = 5  # each pass is tens of ms; the best of five rides out a busy moment
CACHE_FILE = "cpu-bandwidth.json"


@dataclass(frozen=True)
class Bandwidth:
    bytes_s: float
    source: str  # how it was measured, in words: "torch sum over 512 MiB, best of 3, 2 threads, 2026-12-03"


def measure_read_bandwidth(nbytes: int = MEASURE_BYTES, repeats: int = MEASURE_REPEATS) -> float:
    """Bytes per second torch's sum reads from memory on this CPU with the current intra-op threads: the best of
    `repeats` timed passes over `nbytes`, after one untimed pass."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()  # pages touched, the thread pool up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    rate = x.numel() * 4 / best if best > 0 else math.inf
    if not math.isfinite(rate):
        raise RuntimeError(f"a pass over {nbytes >> 20} MiB took {best} s: no rate can be taken from that")
    return rate


@functools.lru_cache(maxsize=1)
def _machine() -> str:
    """The CPU model, logical CPUs and installed memory, read once a process (from /proc on Linux)."""
    return f"{cpu_model() or 'unknown CPU'} | {os.cpu_count()} CPUs | {memory_bytes()} bytes"


def machine_key(threads: int) -> str:
    """What a measurement is valid for: the CPU model, logical CPUs, installed memory and torch's threads."""
    return f"{_machine()} | {threads} threads"


_memo: dict[tuple[str, str], Bandwidth] = {}
_lock = threading.Lock()


def cpu_read_bandwidth(cache: Path, measure: Optional[Callable[[], float]] = None, refresh: bool = False) -> Bandwidth:
    """This machine's measured read bandwidth at torch's current thread count: from `cache`/CACHE_FILE when it
    holds this machine's entry, else measured now and written there (a failed write is logged; the figure
    stands). `refresh` measures again (the bench does, before it measures anything else) and keeps the higher of
    the two: other work on the machine only ever lowers the figure. Raises what the measurement raises (out of
    memory, say): the caller shows n/a with it."""
    threads = torch.get_num_threads()
    key = machine_key(threads)
    path = Path(cache) / CACHE_FILE
    with _lock:
        known = _memo.get((str(path), key))
        if known is not None and not refresh:
            return known
        doc = _read(path)
        stored: Optional[dict[str, Any]] = doc.get(key) if _valid(doc.get(key)) else None
        if stored is None or refresh:
            fresh: dict[str, Any] = {
                "bytes_s": (measure or measure_read_bandwidth)(),
                "measured": time.strftime("%Y-%m-%d"),
                "nbytes": MEASURE_BYTES,
                "repeats": MEASURE_REPEATS,
                "threads": threads,
            }
            if stored is None or fresh["bytes_s"] > stored["bytes_s"]:
                stored = doc[key] = fresh
                _write(path, doc)
        found = Bandwidth(
            float(stored["bytes_s"]),
            f"torch sum over {int(stored['nbytes']) >> 20} MiB, best of {stored['repeats']}, "
            f"{stored['threads']} threads, measured {stored['measured']}",
        )
        _memo[(str(path), key)] = found
        return found


def this_cpu(refresh: bool = False) -> tuple[Optional[Bandwidth], str]:
    """cpu_read_bandwidth kept in the user cache dir, or None and why it could not be measured: what the memory
    floor, the per-answer estimate and the bench read."""
    try:
        return cpu_read_bandwidth(cache_dir(), refresh=refresh), ""
    except (RuntimeError, MemoryError, OSError) as exc:
        return None, str(exc)


def _valid(entry: object) -> bool:
    if not isinstance(entry, dict):
        return False
    bw = entry.get("bytes_s")
    try:
        ok_bw = isinstance(bw, (int, float)) and not isinstance(bw, bool) and math.isfinite(bw) and bw > 0
    except OverflowError:  # an integer too large for a float
        return False
    ints = all(isinstance(entry.get(k), int) and entry[k] > 0 for k in ("nbytes", "repeats", "threads"))
    return ok_bw and ints and isinstance(entry.get("measured"), str)


def _read(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:  # unreadable, not UTF-8 or JSON, nested too deep
        log.info("re-measuring the CPU's bandwidth: %s is unreadable (%s)", path, exc)
        return {}
    return doc if isinstance(doc, dict) else {}


def _write(path: Path, doc: dict) -> None:
    """Whole or not at all (engine.paths.write_whole); a failure leaves the figure standing, with a warning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps(doc, indent=1), mode=0o600)
    except OSError as exc:
        log.warning("could not keep the CPU's measured bandwidth in %s: %s", path, exc)
