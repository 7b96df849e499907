"""The CPU's measured read bandwidth (engine/telemetry/bandwidth.py): measured once per machine and thread count,
kept in the cache dir, measured again when the file is unreadable or names another machine; and the memory floor
the model panel shows on a CPU, built from it."""

from __future__ import annotations

import json
import math

import pytest
import torch

import engine.telemetry.bandwidth as bandwidth
from engine.telemetry.bandwidth import CACHE_FILE, cpu_read_bandwidth, machine_key, measure_read_bandwidth
from engine.types import SamplingParams


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch):
    """Each test starts as a new process would: nothing remembered in memory, only what the file holds."""
    monkeypatch.setattr(bandwidth, "_memo", {})


class Counting:
    def __init__(self, value: float):
        self.value, self.calls = value, 0

    def __call__(self) -> float:
        self.calls += 1
        return self.value


def test_a_real_measurement_is_a_finite_positive_rate():
    bw = measure_read_bandwidth(nbytes=8 << 20, repeats=2)
    assert math.isfinite(bw) and bw > 0


def test_measured_once_then_read_back_from_the_cache(tmp_path, monkeypatch):
    measure = Counting(12.5e9)
    first = cpu_read_bandwidth(tmp_path, measure)
    assert measure.calls == 1 and first.bytes_s == 12.5e9
    assert first.source.startswith(f"torch sum over 512 MiB, best of 5, {torch.get_num_threads()} threads, measured ")
    entry = json.loads((tmp_path / CACHE_FILE).read_text())[machine_key(torch.get_num_threads())]
    assert entry["bytes_s"] == 12.5e9 and entry["threads"] == torch.get_num_threads()
    monkeypatch.setattr(bandwidth, "_memo", {})  # a later launch
    again = Counting(99e9)
    assert cpu_read_bandwidth(tmp_path, again) == first and again.calls == 0


def test_another_thread_count_is_measured_on_its_own(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    cpu_read_bandwidth(tmp_path, Counting(10e9))
    try:
        torch.set_num_threads(threads + 1)
        other = Counting(14e9)
        assert cpu_read_bandwidth(tmp_path, other).bytes_s == 14e9 and other.calls == 1
    finally:
        torch.set_num_threads(threads)
    doc = json.loads((tmp_path / CACHE_FILE).read_text())
    assert {machine_key(threads), machine_key(threads + 1)} <= set(doc)


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2]",
        "KEY_WITH_A_NEGATIVE_RATE",
        "KEY_WITH_A_HUGE_INTEGER",
        "[" * 100_000,
        "\udcff",
    ],
)
def test_an_unreadable_or_wrong_cache_is_measured_again_and_replaced(tmp_path, content):
    path = tmp_path / CACHE_FILE
    key = machine_key(torch.get_num_threads())
    if content.startswith("KEY_"):
        rate = -1.0 if content == "KEY_WITH_A_NEGATIVE_RATE" else 10**400  # beyond a float: math.isfinite raises
        entry = {"bytes_s": rate, "measured": "2026-01-01", "nbytes": 1, "repeats": 1, "threads": 1}
        path.write_text(json.dumps({key: entry}))
    else:
        path.write_bytes(content.encode("utf-8", "surrogateescape"))
    measure = Counting(20e9)
    assert cpu_read_bandwidth(tmp_path, measure).bytes_s == 20e9 and measure.calls == 1
    assert json.loads(path.read_text())[key]["bytes_s"] == 20e9


def test_a_cache_that_cannot_be_written_keeps_the_figure(tmp_path, caplog):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("x")  # the cache "dir" is a file: nothing can be written under it
    assert cpu_read_bandwidth(blocked, Counting(8e9)).bytes_s == 8e9
    assert "could not keep the CPU's measured bandwidth" in caplog.text


def test_the_cpu_memory_floor_is_bytes_per_token_over_the_measured_bandwidth(tiny_llama, tmp_path, monkeypatch):
    from engine.engine import Engine
    from engine.types import EngineOptions

    monkeypatch.setenv("GAPLESS_CACHE_DIR", str(tmp_path))
    key = machine_key(torch.get_num_threads())
    entry = {"bytes_s": 4e9, "measured": "2026-12-01", "nbytes": 512 << 20, "repeats": 5, "threads": 2}
    (tmp_path / CACHE_FILE).write_text(json.dumps({key: entry}))
    e = Engine.load(str(tiny_llama), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    try:
        info = e.info
        assert info.memory_floor_ms == pytest.approx(info.bytes_per_token / 4e9 * 1e3)
        assert info.memory_floor_source.startswith("bytes per token / this CPU's measured read bandwidth, 4.0 GB/s")
        assert "best of 5, 2 threads, measured 2026-12-01" in info.memory_floor_source
        # and each answer's bandwidth figure: the bytes a step reads over its median time, against the same rate
        m = e.generate([{"role": "user", "content": "hi"}], SamplingParams(temperature=0.0, max_new_tokens=16)).metrics
        assert m.dram_bw_util_pct is not None and m.dram_bw_util_pct > 0
        assert m.dram_bw_util_source == (
            "DRAM bandwidth — estimate: bytes per step / step time / this CPU's measured read bandwidth "
            "(4.0 GB/s: torch sum over 512 MiB, best of 5, 2 threads, measured 2026-12-01)"
        )
    finally:
        e.close()


def test_a_failed_measurement_leaves_the_floor_na_with_the_reason(tiny_llama, tmp_path, monkeypatch):
    from engine.engine import Engine
    from engine.types import EngineOptions

    def out_of_memory() -> float:
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setenv("GAPLESS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bandwidth, "measure_read_bandwidth", out_of_memory)
    e = Engine.load(str(tiny_llama), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    try:
        assert e.info.memory_floor_ms is None
        m = e.generate([{"role": "user", "content": "hi"}], SamplingParams(temperature=0.0, max_new_tokens=8)).metrics
        assert m.dram_bw_util_pct is None and m.unavailable["dram_bw_util_pct"] == (
            "DRAM bandwidth estimate: the CPU's read bandwidth could not be measured "
            "(DefaultCPUAllocator: not enough memory)"
        )
        assert e.info.memory_floor_source == (
            "n/a: the CPU's memory bandwidth could not be measured (DefaultCPUAllocator: not enough memory)"
        )
    finally:
        e.close()


def test_a_refresh_measures_again_and_keeps_the_higher_figure(tmp_path):
    """Other work on the machine only lowers a measurement: the bench measures again and the cache keeps the
    best seen."""
    cpu_read_bandwidth(tmp_path, Counting(10e9))
    slower = Counting(7e9)
    assert cpu_read_bandwidth(tmp_path, slower, refresh=True).bytes_s == 10e9 and slower.calls == 1
    faster = Counting(13e9)
    assert cpu_read_bandwidth(tmp_path, faster, refresh=True).bytes_s == 13e9 and faster.calls == 1
    assert cpu_read_bandwidth(tmp_path, Counting(1.0)).bytes_s == 13e9  # remembered, not measured
    assert json.loads((tmp_path / CACHE_FILE).read_text())[machine_key(torch.get_num_threads())]["bytes_s"] == 13e9
