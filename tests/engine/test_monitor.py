"""The monitor with no NVML (this machine), and with a fake NVML module that has or lacks GPM and fails mid-run."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Optional

import pynvml
import pytest
import torch
from fake_nvml import FakeNVMLError, NVMLConstants

from engine.telemetry.machine import describe_machine
from engine.telemetry.monitor import GPU_METRICS, Monitor, estimate_dram_bw_util

CUDA = torch.device("cuda", 0)


class FakeNVML(NVMLConstants):
    """The subset of pynvml the monitor uses. `fail` maps a function name to the call number (1-based)
    from which it raises `fail_code`; `gpm_metric_errors` gives per-metric return codes."""

    NVML_GPM_METRIC_SM_UTIL = pynvml.NVML_GPM_METRIC_SM_UTIL
    NVML_GPM_METRIC_SM_OCCUPANCY = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
    NVML_GPM_METRIC_DRAM_BW_UTIL = pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
    NVML_GPM_METRICS_GET_VERSION = pynvml.NVML_GPM_METRICS_GET_VERSION
    c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t

    def __init__(
        self, gpm=True, init_error=None, fail=None, fail_code=15, gpm_metric_errors=None, util_scale=1, util_every=1
    ):
        self.gpm = gpm
        self.util_every = util_every  # a new utilization sample on every n-th call (the driver's own rate)
        self.util_scale = util_scale
        self.init_error = init_error
        self.fail = dict(fail or {})
        self.fail_code = fail_code
        self.gpm_metric_errors = dict(gpm_metric_errors or {})
        self.calls: dict[str, int] = {}
        self.util_ts = 1_000_000  # µs, NVML's sample clock
        self.util_value = 40
        self.util_rate = 77  # nvmlDeviceGetUtilizationRates' gpu
        self.freed = 0
        self.shutdowns = 0
        self.gpm_values = {
            pynvml.NVML_GPM_METRIC_SM_UTIL: 12.5,
            pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 6.25,
            pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 30.0,
        }

    def _call(self, name):
        n = self.calls[name] = self.calls.get(name, 0) + 1
        if name in self.fail and n >= self.fail[name]:
            raise FakeNVMLError(self.fail_code)

    def nvmlInit(self):
        self._call("nvmlInit")
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self):
        return "570.124.06"

    def nvmlDeviceGetHandleByIndex(self, i):
        self._call("nvmlDeviceGetHandleByIndex")
        return ("gpu", i)

    def nvmlGpmQueryDeviceSupport(self, h):
        self._call("nvmlGpmQueryDeviceSupport")
        return SimpleNamespace(isSupportedDevice=int(self.gpm))

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        assert kind == self.NVML_CLOCK_MEM
        return 2619

    def nvmlDeviceGetMemoryBusWidth(self, h):
        return 5120

    def nvmlDeviceGetSamples(self, h, kind, last_ts):
        self._call("nvmlDeviceGetSamples")
        assert kind == self.NVML_GPU_UTILIZATION_SAMPLES
        if self.calls["nvmlDeviceGetSamples"] % self.util_every == 0:
            self.util_ts += 50_000
            self.util_value = (self.util_value + 10) % 100
        value = self.util_value * self.util_scale
        samples = [SimpleNamespace(timeStamp=self.util_ts, sampleValue=pynvml.c_nvmlValue_t(uiVal=value))]
        samples = [s for s in samples if s.timeStamp > last_ts]
        if not samples:
            raise FakeNVMLError(self.NVML_ERROR_NOT_FOUND)
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, samples

    def nvmlDeviceGetUtilizationRates(self, h):
        self._call("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=self.util_rate, memory=20)

    def nvmlDeviceGetMemoryInfo(self, h):
        self._call("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(used=3 << 30, total=141 << 30, free=138 << 30)

    def nvmlDeviceGetPowerUsage(self, h):
        self._call("nvmlDeviceGetPowerUsage")
        return 123_456  # mW

    def nvmlDeviceGetClockInfo(self, h, kind):
        self._call("nvmlDeviceGetClockInfo")
        assert kind == self.NVML_CLOCK_SM
        return 1980

    def nvmlGpmSampleAlloc(self):
        return pynvml.c_nvmlGpmSample_t()

    def nvmlGpmSampleFree(self, s):
        self.freed += 1

    def nvmlGpmSampleGet(self, h, s):
        self._call("nvmlGpmSampleGet")
        return s

    def nvmlGpmMetricsGet(self, req):
        self._call("nvmlGpmMetricsGet")
        assert req.version == self.NVML_GPM_METRICS_GET_VERSION
        for i in range(req.numMetrics):
            mid = req.metrics[i].metricId
            req.metrics[i].nvmlReturn = self.gpm_metric_errors.get(mid, 0)
            req.metrics[i].value = self.gpm_values[mid]
        return req


class StepClock:
    """A clock the test advances, so GPM's 100 ms spacing is deterministic."""

    def __init__(self):
        self.t = 10.0

    def __call__(self) -> float:
        return self.t


def primed(nvml, clock=None) -> Monitor:
    m = Monitor(CUDA, nvml=nvml, clock=clock or StepClock())
    m._prime()  # what the thread does first
    return m


def held_samples(m: Monitor, clock: StepClock, n: int) -> None:
    """`n` samples 0.2 s apart, kept in the monitor's history as its thread keeps them."""
    for _ in range(n):
        clock.t += 0.2
        with m._lock:
            m._history.append(m.sample_once())


def wait_for_a_sample(m: Monitor, timeout_s: float = 10.0) -> None:
    """Until the monitor thread has taken a sample newer than any it held at the call (a loaded machine may
    start or schedule the thread late; one that never samples fails here)."""
    before = m.history()
    last = before[-1].t if before else None
    deadline = time.monotonic() + timeout_s
    while True:
        now = m.history()
        if now and (last is None or now[-1].t > last):
            return
        assert time.monotonic() < deadline, f"the monitor thread took no sample within {timeout_s} s"
        time.sleep(0.005)


def _nvml_probe() -> Optional[str]:
    """None when NVML initialises in this process (an NVIDIA driver is present), else the library's reason."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return str(exc)
    pynvml.nvmlShutdown()
    return None


def test_real_pynvml_gpu_figures_follow_the_driver_and_process_figures_never_need_it():
    """On a machine without an NVIDIA driver the GPU figures are n/a with NVML's own reason; with one they are
    measured or n/a for a reason other than NVML being missing. Either way the process figures are sampled."""
    why = _nvml_probe()
    m = Monitor(CUDA, interval_s=0.01)
    if why is not None:
        for metric in GPU_METRICS:
            assert m.unavailable[metric] == f"NVML not available: {why}"
        assert m.peak_dram_bw_bytes_s is None
    else:
        assert not any(r.startswith("NVML not available") for r in m.unavailable.values()), m.unavailable
    m.start()
    wait_for_a_sample(m)
    m.stop()
    samples = m.drain()
    assert samples, "the process figures are sampled with or without NVML"
    if why is not None:
        assert all(s.gpu_util_pct is None and s.sm_activity_pct is None and s.power_w is None for s in samples)
    else:
        assert any(s.gpu_util_pct is not None for s in samples)
        assert samples[-1].sources["gpu_util_pct"]
    assert all(s.cpu_util_pct is not None and s.cpu_util_pct >= 0 for s in samples)
    assert all(s.process_rss_bytes and s.process_rss_bytes > 10 << 20 for s in samples)
    assert samples[0].sources["cpu_util_pct"].startswith("CPU util — ")
    summ = m.summary(samples[0].t, samples[-1].t)
    if why is not None:
        assert summ["gpu_util_pct"] == (None, m.unavailable["gpu_util_pct"])
    assert set(summ) == {"gpu_util_pct", "sm_activity_pct", "dram_bw_util_pct"}


def test_cpu_device_never_touches_nvml():
    nvml = FakeNVML()
    m = Monitor(torch.device("cpu"), nvml=nvml)
    assert nvml.calls == {}
    assert m.unavailable["gpu_util_pct"] == "the model runs on the CPU, not on a GPU"
    s = m.sample_once()
    assert s.gpu_util_pct is None and s.process_rss_bytes is not None


def test_fake_nvml_library_missing():
    m = Monitor(CUDA, nvml=FakeNVML(init_error=12))
    assert m.unavailable["sm_activity_pct"] == "NVML not available: NVML Shared Library Not Found"
    assert m.sample_once().gpu_util_pct is None


def test_gpm_supported_gives_every_gpu_figure_with_sources():
    clock = StepClock()
    nvml = FakeNVML(gpm=True)
    m = primed(nvml, clock)
    assert m.unavailable == {}
    assert m.peak_dram_bw_bytes_s == pytest.approx(2619e6 * 5120 / 8 * 2)  # H100 SXM: ~3.35 TB/s
    clock.t += 0.05
    early = m.sample_once()  # GPM needs two samples >= 100 ms apart: not yet
    assert early.sm_activity_pct is None and "sm_activity_pct" not in m.unavailable
    clock.t += 0.06
    s = m.sample_once()
    assert s.gpu_util_pct == 70.0  # 40, +10 when primed, +10 for `early`, +10 now
    assert s.sources["gpu_util_pct"] == "GPU util — NVML samples"
    assert (s.sm_activity_pct, s.sm_occupancy_pct, s.dram_bw_util_pct) == (12.5, 6.25, 30.0)
    assert s.sources["sm_activity_pct"] == "SM activity — NVML GPM"
    assert s.sources["dram_bw_util_pct"] == "DRAM bandwidth — NVML GPM"
    assert s.gpu_memory_used_bytes == 3 << 30 and s.power_w == pytest.approx(123.456) and s.sm_clock_mhz == 1980
    m.close()
    assert nvml.freed == 2 and nvml.shutdowns == 1


def test_gpm_not_supported():
    m = primed(FakeNVML(gpm=False))
    for metric in ("sm_activity_pct", "sm_occupancy_pct", "dram_bw_util_pct"):
        assert m.unavailable[metric] == "GPM not supported on this GPU"
    m._clock.t += 1
    s = m.sample_once()
    assert s.sm_activity_pct is None and s.dram_bw_util_pct is None
    assert s.gpu_util_pct is not None and s.power_w is not None
    assert "gpu_util_pct" not in m.unavailable


def test_failures_mid_run_mark_only_that_metric_and_sampling_goes_on():
    clock = StepClock()
    nvml = FakeNVML(fail={"nvmlDeviceGetPowerUsage": 3, "nvmlDeviceGetSamples": 3, "nvmlGpmMetricsGet": 2})
    m = primed(nvml, clock)  # samples call 1
    readings = []
    for _ in range(4):
        clock.t += 0.2
        readings.append(m.sample_once())
    first, second, third, fourth = readings
    assert first.power_w is not None and second.power_w is not None and third.power_w is None
    assert m.unavailable["power_w"] == "nvmlDeviceGetPowerUsage failed: GPU is lost"
    # utilization samples fail from call 3: the monitor falls back to utilization rates, and says so
    assert first.sources["gpu_util_pct"] == "GPU util — NVML samples"
    assert second.gpu_util_pct == 77.0 and second.sources["gpu_util_pct"] == "GPU util — NVML utilization rates"
    assert fourth.gpu_util_pct == 77.0 and "gpu_util_pct" not in m.unavailable
    # GPM worked once, then failed: all three GPM figures n/a with the reason, the rest still sampled
    assert first.sm_activity_pct == 12.5 and second.sm_activity_pct is None
    assert m.unavailable["sm_activity_pct"] == "GPM sampling failed: GPU is lost"
    assert m.unavailable["dram_bw_util_pct"] == "GPM sampling failed: GPU is lost"
    assert fourth.gpu_memory_used_bytes == 3 << 30 and fourth.sm_clock_mhz == 1980
    assert nvml.calls["nvmlDeviceGetPowerUsage"] == 3  # not called again once marked


def test_gpm_per_metric_error_marks_only_that_metric():
    clock = StepClock()
    m = primed(FakeNVML(gpm_metric_errors={pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 3}), clock)
    clock.t += 0.2
    s = m.sample_once()
    assert s.sm_activity_pct == 12.5 and s.dram_bw_util_pct is None
    assert m.unavailable["dram_bw_util_pct"] == "GPM metric failed: Not Supported"
    clock.t += 0.2
    assert m.sample_once().sm_occupancy_pct == 6.25


@pytest.mark.parametrize(
    "reading, why",
    [(float("nan"), "is nan, not a count or a time"), (103.7, "more than all of it"), (-2.0, "is -2.0, not a count")],
)
def test_a_gpm_reading_no_share_can_be_is_na_with_what_it_was(reading, why):
    """SM activity above 100 % (as GPM reports on some MIG slices) or NaN was shown and kept with the answer, whose
    figures then read back as damaged (and NaN would not save as JSON)."""
    clock = StepClock()
    nvml = FakeNVML()
    nvml.gpm_values[pynvml.NVML_GPM_METRIC_SM_UTIL] = reading
    nvml.gpm_values[pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL] = 130.0  # an over-100 bandwidth share is a possible one
    m = primed(nvml, clock)
    t0 = clock.t
    held_samples(m, clock, 2)
    s = m.history()[-1]
    assert s.sm_activity_pct is None and "sm_activity_pct" not in s.sources
    assert s.sm_occupancy_pct == 6.25 and s.dram_bw_util_pct == 130.0
    assert (
        m.unavailable["sm_activity_pct"].startswith("NVML GPM's reading ") and why in m.unavailable["sm_activity_pct"]
    )
    value, reason = m.summary(t0, clock.t)["sm_activity_pct"]
    assert value is None and reason == m.unavailable["sm_activity_pct"]
    # the next reading that can be a share is shown again (one skewed reading turned the figure off for good)
    nvml.gpm_values[pynvml.NVML_GPM_METRIC_SM_UTIL] = 40.0
    clock.t += 0.2
    assert m.sample_once().sm_activity_pct == 40.0 and "sm_activity_pct" not in m.unavailable


def test_an_answer_that_saw_only_odd_gpm_readings_says_why_after_a_good_one():
    """The reason lived only in the monitor's `unavailable`, which the next reading that can be a share clears: an
    answer (or a bench run) whose window held only the odd reading, summed up after that, read "not measured in the
    interval"."""
    clock = StepClock()
    nvml = FakeNVML()
    nvml.gpm_values[pynvml.NVML_GPM_METRIC_SM_UTIL] = 103.7
    m = primed(nvml, clock)
    t0 = clock.t
    clock.t += 0.2
    with m._lock:
        m._history.append(m.sample_once())
    t1 = clock.t
    nvml.gpm_values[pynvml.NVML_GPM_METRIC_SM_UTIL] = 40.0
    clock.t += 0.2
    with m._lock:
        m._history.append(m.sample_once())
    assert "sm_activity_pct" not in m.unavailable
    value, reason = m.summary(t0, t1)["sm_activity_pct"]
    assert value is None and reason.startswith("NVML GPM's reading ") and "more than all of it" in reason
    assert m.summary(t0, clock.t)["sm_activity_pct"][0] == 40.0


def test_thread_drain_and_summary_with_fake_nvml():
    m = Monitor(CUDA, interval_s=0.01, nvml=FakeNVML(gpm=False))
    t0 = time.perf_counter()
    m.start()
    m.start()  # idempotent
    wait_for_a_sample(m)
    first = m.drain()
    wait_for_a_sample(m)
    m.stop()
    m.stop()
    second = m.drain()
    t1 = time.perf_counter()
    assert first and second and m.drain() == []
    assert first[-1].t < second[0].t
    everything = first + second
    assert len(everything) == len(m.history())
    mean, source = m.summary(t0, t1)["gpu_util_pct"]
    assert min(s.gpu_util_pct for s in everything) <= mean <= max(s.gpu_util_pct for s in everything)
    assert source == "GPU util — NVML samples"
    assert m.summary(t0, t1)["sm_activity_pct"] == (None, "GPM not supported on this GPU")
    assert m.summary(t1 + 1, t1 + 2)["gpu_util_pct"][0] is None
    m.start()  # can run again after a stop
    wait_for_a_sample(m)
    m.close()
    assert m.drain()


def test_polls_between_the_drivers_samples_hold_the_newest_sample():
    clock = StepClock()
    nvml = FakeNVML(gpm=False, util_every=2)  # NVML has a new sample on every second poll only
    m = primed(nvml, clock)
    readings = []
    for _ in range(6):
        clock.t += 0.1
        readings.append(m.sample_once())
    assert {s.sources["gpu_util_pct"] for s in readings} == {"GPU util — NVML samples"}
    assert "nvmlDeviceGetUtilizationRates" not in nvml.calls  # never mixed with the other source
    values = [s.gpu_util_pct for s in readings]
    assert values == [50.0, 50.0, 60.0, 60.0, 70.0, 70.0]


def test_summary_weights_each_sample_by_its_period_inside_the_interval():
    clock = StepClock()
    m = primed(FakeNVML(gpm=False), clock)  # util 50 at t=10.0 ... each poll +10
    with m._lock:
        m._history.clear()
    for _ in range(4):
        clock.t += 0.1
        m._history.append(m.sample_once())  # 60 @ 10.1, 70 @ 10.2, 80 @ 10.3, 90 @ 10.4
    # [10.15, 10.35]: half of 70's period (10.1-10.2], all of 80's (10.2-10.3], half of 90's (10.3-10.4]
    mean, _ = m.summary(10.15, 10.35)["gpu_util_pct"]
    assert mean == pytest.approx((70 * 0.05 + 80 * 0.1 + 90 * 0.05) / 0.2)
    # the first sample covers one interval before it: [10.0, 10.1] is the 60 alone
    assert m.summary(10.0, 10.1)["gpu_util_pct"][0] == pytest.approx(60.0)
    assert m.summary(11.0, 12.0)["gpu_util_pct"][0] is None


def test_utilization_samples_out_of_range_are_not_shown_as_percent():
    clock = StepClock()
    m = primed(FakeNVML(util_scale=100), clock)  # a driver reporting another unit
    clock.t += 0.2
    s = m.sample_once()
    assert s.gpu_util_pct == 77.0 and s.sources["gpu_util_pct"] == "GPU util — NVML utilization rates"


def test_a_utilization_rate_no_share_can_be_is_na_until_one_is():
    """0xFFFFFFFF from nvmlDeviceGetUtilizationRates (a driver with no figure) was shown as 4,294,967,295 %, and the
    answer that kept it read back as damaged."""
    clock = StepClock()
    nvml = FakeNVML(util_scale=100)  # samples out of range: the monitor reads utilization rates
    nvml.util_rate = 0xFFFFFFFF
    m = primed(nvml, clock)
    t0 = clock.t
    clock.t += 0.2
    with m._lock:
        m._history.append(m.sample_once())
    s = m.history()[-1]
    assert s.gpu_util_pct is None and "gpu_util_pct" not in s.sources
    why = "nvmlDeviceGetUtilizationRates's reading is 4294967295.0, more than all of it (100 %)"
    assert s.unavailable["gpu_util_pct"] == why
    assert m.summary(t0, clock.t)["gpu_util_pct"] == (None, why)
    nvml.util_rate = 55
    clock.t += 0.2
    assert m.sample_once().gpu_util_pct == 55.0 and "gpu_util_pct" not in m.unavailable


@pytest.mark.parametrize("metric", ["dram_bw_util_pct", "sm_activity_pct"])
def test_an_infinite_gpm_reading_is_na_not_a_figure(metric):
    """An infinite DRAM bandwidth share passed (a share over 100 % is allowed for it): the answer kept inf, the
    diagnosis said "memory-bound: DRAM bandwidth inf % of peak", and the compare table's JSON export failed."""
    clock = StepClock()
    nvml = FakeNVML()
    key = {"dram_bw_util_pct": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, "sm_activity_pct": pynvml.NVML_GPM_METRIC_SM_UTIL}
    nvml.gpm_values[key[metric]] = float("inf")
    m = primed(nvml, clock)
    clock.t += 0.2
    s = m.sample_once()
    assert getattr(s, metric) is None and s.unavailable[metric] == "NVML GPM's reading is inf, not a measured value"


def test_estimate_dram_bw_util():
    pct, src = estimate_dram_bw_util(270e6, 0.001, 3.35e12)
    assert pct == pytest.approx(100 * 270e9 / 3.35e12)
    assert "estimate" in src
    assert estimate_dram_bw_util(270e6, 0.001, None)[0] is None
    assert estimate_dram_bw_util(None, 0.001, 3e12)[0] is None
    assert estimate_dram_bw_util(1e6, 0.0, 3e12)[0] is None


def test_describe_machine_here_and_with_a_driver():
    here = describe_machine()
    assert here["cpu_cores_logical"] >= 1 and here["memory_bytes"] > 1 << 30
    assert here["libraries"]["torch"] == torch.__version__
    assert here["torch_threads"] == torch.get_num_threads()
    assert here["python"].count(".") == 2
    if not torch.cuda.is_available():
        assert here["gpus"] == [] and here["gpu_name"] is None
    if here["driver_version"] is None:
        assert here["driver_version_reason"]
    nvml = FakeNVML()
    with_driver = describe_machine(nvml=nvml)
    assert with_driver["driver_version"] == "570.124.06" and with_driver["driver_version_reason"] is None
    assert nvml.shutdowns == 1
    assert describe_machine(nvml=FakeNVML(init_error=12))["driver_version_reason"] == (
        "NVML not available: NVML Shared Library Not Found"
    )


def test_a_figure_measured_for_part_of_an_answer_says_so_with_why_it_stopped():
    """GPM failing 0.2 s into a 2 s answer left SM activity and DRAM bandwidth given as the answer's, from its
    first tenth, and the reason it stopped was dropped."""
    clock = StepClock()
    nvml = FakeNVML(fail={"nvmlGpmMetricsGet": 2})
    m = primed(nvml, clock)
    t0 = clock.t
    held_samples(m, clock, 10)
    summary = m.summary(t0, clock.t)
    value, source = summary["sm_activity_pct"]
    assert value == 12.5
    assert (
        source == "SM activity — NVML GPM (the first 10 % of the interval only; then GPM sampling failed: GPU is lost)"
    )
    assert summary["gpu_util_pct"][1] == "GPU util — NVML samples"  # measured to the end: as it was
    assert m.summary(t0, t0 + 0.2)["sm_activity_pct"] == (12.5, "SM activity — NVML GPM")
