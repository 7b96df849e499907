"""Background sampler of the machine: NVML GPU figures where there is NVML, this process's CPU and RSS always.

Every NVML call can fail (no driver, no permission, a virtual GPU without counters, a GPU lost mid-run).
Each metric is read on its own; a failure marks that metric unavailable with the reason, and sampling goes on
with the others. Nothing here raises to the caller because a counter is missing.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Callable, Optional

import torch

from engine import figures
from engine.types import MonitorSample

log = logging.getLogger(__name__)

GPU_METRICS = (
    "gpu_util_pct",
    "sm_activity_pct",
    "sm_occupancy_pct",
    "dram_bw_util_pct",
    "gpu_memory_used_bytes",
    "power_w",
    "sm_clock_mhz",
)
GPM_METRICS = ("sm_activity_pct", "sm_occupancy_pct", "dram_bw_util_pct")
SUMMARY_METRICS = ("gpu_util_pct", "sm_activity_pct", "dram_bw_util_pct")
GPM_MIN_INTERVAL_S = 0.1  # NVML computes GPM metrics from two samples at least this far apart

SOURCES = {
    "gpu_util_samples": "GPU util — NVML samples",
    "gpu_util_rates": "GPU util — NVML utilization rates",
    "sm_activity_pct": "SM activity — NVML GPM",
    "sm_occupancy_pct": "SM occupancy — NVML GPM",
    "dram_bw_util_pct": "DRAM bandwidth — NVML GPM",
    "gpu_memory_used_bytes": "GPU memory — NVML memory info",
    "power_w": "power — NVML power usage",
    "sm_clock_mhz": "SM clock — NVML clock info",
    "cpu_util_pct": "CPU util — process CPU time (time.process_time)",
    "process_rss_bytes": "RSS — /proc/self/statm",
}


def _load_pynvml() -> Any:
    import pynvml  # nvidia-ml-py

    return pynvml


NVML_PEAK = "NVML peak (memory clock × bus width × 2)"


def estimate_dram_bw_util(
    bytes_per_step: Optional[float],
    step_s: Optional[float],
    peak_bytes_s: Optional[float],
    peak_name: str = NVML_PEAK,
) -> tuple[Optional[float], str]:
    """DRAM bandwidth use estimated as bytes moved per decode step / step time / the memory's bandwidth.

    `bytes_per_step` should be what a step must read (the weights plus the attended KV cache, as in
    gpt-fast's bandwidth figure); `peak_bytes_s` comes from `Monitor.peak_dram_bw_bytes_s` on a GPU, or from
    the CPU's measured read bandwidth (engine.telemetry.bandwidth), named by `peak_name`.
    """
    if peak_bytes_s is None or not peak_bytes_s > 0:
        return None, "DRAM bandwidth estimate: peak bandwidth unknown (needs NVML memory clock and bus width)"
    if bytes_per_step is None or step_s is None or not step_s > 0 or bytes_per_step < 0:
        return None, "DRAM bandwidth estimate: bytes per step or step time unknown"
    pct = 100.0 * bytes_per_step / step_s / peak_bytes_s
    return pct, f"DRAM bandwidth — estimate: bytes per step / step time / {peak_name}"


class Monitor:
    """Background sampler thread: NVML (GPU util via nvmlDeviceGetSamples or utilization rates, memory,
    power, SM clock; GPM SM activity / SM occupancy / DRAM bandwidth util where nvmlGpmQueryDeviceSupport
    says yes) and, always, this process's CPU utilisation and RSS.

    `nvml` is the NVML binding (default: `pynvml` from nvidia-ml-py); any object with the same functions
    and constants works, which is how the GPU branches are tested without a GPU.
    """

    def __init__(
        self,
        device: torch.device,
        interval_s: float = 0.1,
        nvml: Any = None,
        clock: Callable[[], float] = time.perf_counter,
        history: int = 36_000,
    ):
        if not interval_s > 0:
            raise ValueError(f"monitor interval must be > 0, got {interval_s}")
        self.device = torch.device(device)
        self.interval_s = interval_s
        self.unavailable: dict[str, str] = {}
        # GPM figures (and GPU utilisation) n/a for a reading no share can be: asked again at each sample
        self._odd: set[str] = set()
        self.peak_dram_bw_bytes_s: Optional[float] = None
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: list[MonitorSample] = []
        self._history: collections.deque[MonitorSample] = collections.deque(maxlen=history)
        self._stop_event = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._nvml: Any = None
        self._handle: Any = None
        self._gpm = False
        self._gpm_samples: list[Any] = []
        self._gpm_prev_t: Optional[float] = None
        self._util_samples = True  # nvmlDeviceGetSamples until it fails, then utilization rates
        self._util_last_ts = 0
        self._util_last: Optional[float] = None  # the newest NVML utilization sample's value
        self._cpu_prev: Optional[tuple[float, float]] = None
        self._page_size = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else None
        if not os.path.exists("/proc/self/statm"):
            self.unavailable["process_rss_bytes"] = "process RSS: /proc/self/statm not available on this OS"
        self._open_nvml(nvml)

    # ---- setup ------------------------------------------------------------------------------------

    def _mark_gpu_unavailable(self, reason: str, metrics=GPU_METRICS) -> None:
        for m in metrics:
            self.unavailable.setdefault(m, reason)

    def _errors(self) -> tuple[type[BaseException], ...]:
        # NVMLError for the library's failures; AttributeError for a function this nvidia-ml-py lacks;
        # OSError for a broken driver library.
        err = getattr(self._nvml, "NVMLError", None)
        return tuple(e for e in (err, AttributeError, OSError) if isinstance(e, type) and issubclass(e, BaseException))

    def _open_nvml(self, nvml: Any) -> None:
        if self.device.type != "cuda":
            self._mark_gpu_unavailable(f"the model runs on the {self.device.type.upper()}, not on a GPU")
            return
        if nvml is None:
            try:
                nvml = _load_pynvml()
            except ImportError as exc:
                self._mark_gpu_unavailable(f"NVML not available: nvidia-ml-py not installed ({exc})")
                return
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except self._errors() as exc:
            self._nvml = None
            self._mark_gpu_unavailable(f"NVML not available: {exc}")
            return
        try:
            self._handle = nvml.nvmlDeviceGetHandleByIndex(self._nvml_index())
        except self._errors() as exc:
            self._close_nvml()
            self._mark_gpu_unavailable(f"NVML cannot open the GPU: {exc}")
            return
        try:
            support = nvml.nvmlGpmQueryDeviceSupport(self._handle)
            self._gpm = bool(support.isSupportedDevice)
            if not self._gpm:
                self._mark_gpu_unavailable("GPM not supported on this GPU", GPM_METRICS)
        except self._errors() as exc:
            self._mark_gpu_unavailable(f"GPM not available: {exc}", GPM_METRICS)
        try:
            mem_mhz = nvml.nvmlDeviceGetMaxClockInfo(self._handle, nvml.NVML_CLOCK_MEM)
            bus_bits = nvml.nvmlDeviceGetMemoryBusWidth(self._handle)
            if mem_mhz > 0 and bus_bits > 0:
                self.peak_dram_bw_bytes_s = mem_mhz * 1e6 * bus_bits / 8 * 2  # two transfers per clock
        except self._errors() as exc:
            log.info("peak DRAM bandwidth unknown: %s", exc)

    def _nvml_index(self) -> int:
        """NVML numbers GPUs over the whole machine; CUDA only the visible ones (CUDA_VISIBLE_DEVICES)."""
        idx = self.device.index
        if torch.cuda.is_available():
            if idx is None:
                idx = torch.cuda.current_device()
            try:
                return torch.cuda._get_nvml_device_index(idx)
            except (AttributeError, RuntimeError, ValueError) as exc:
                log.info("NVML index of cuda:%s taken as %s: %s", idx, idx, exc)
        return idx or 0

    def _close_nvml(self) -> None:
        if self._nvml is None:
            return
        for sample in self._gpm_samples:
            try:
                self._nvml.nvmlGpmSampleFree(sample)
            except self._errors() as exc:
                log.debug("nvmlGpmSampleFree: %s", exc)
        self._gpm_samples = []
        self._gpm = False
        try:
            self._nvml.nvmlShutdown()
        except self._errors() as exc:
            log.debug("nvmlShutdown: %s", exc)
        self._nvml = None
        self._handle = None

    # ---- public -----------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop_event.clear()
        self._thread = threading.Thread(target=self._run, name="gapless-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop and release NVML. The monitor cannot sample GPU figures afterwards."""
        self.stop()
        self._close_nvml()

    def drain(self) -> list[MonitorSample]:
        """Samples taken since the last drain, oldest first."""
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def history(self) -> list[MonitorSample]:
        with self._lock:
            return list(self._history)

    def summary(
        self, t0: float, t1: float, metrics: tuple[str, ...] = SUMMARY_METRICS
    ) -> dict[str, tuple[Optional[float], str]]:
        """Per metric: (mean over [t0, t1], source) or (None, why).

        A sample describes the period since the one before it (an NVML sample or GPM pair covers the time up to
        its reading), so each is weighted by how much of that period lies in [t0, t1]: the first reading after a
        short generation's start is mostly idle time before it and counts only for its part inside.
        """
        with self._lock:
            history = list(self._history)
        weighted = []  # (sample, weight)
        for i, smp in enumerate(history):
            start = history[i - 1].t if i else smp.t - self.interval_s
            overlap = min(smp.t, t1) - max(start, t0)
            if overlap > 0:
                weighted.append((smp, overlap))
        out: dict[str, tuple[Optional[float], str]] = {}
        for m in metrics:
            vals = [(getattr(smp, m), w, smp.sources.get(m, "")) for smp, w in weighted if getattr(smp, m) is not None]
            if vals:
                sources = collections.Counter(src for _, _, src in vals)
                total = sum(w for _, w, _ in vals)
                source = sources.most_common(1)[0][0]
                out[m] = (sum(v * w for v, w, _ in vals) / total, source + self._cut_short(m, weighted, t0, t1))
            elif why := next((smp.unavailable[m] for smp, _ in weighted if m in smp.unavailable), None):
                out[m] = (None, why)
            elif why := self.unavailable.get(m):  # read once: the sampling thread drops a GPM figure's on its own
                out[m] = (None, why)
            elif not weighted:
                out[m] = (None, "no monitor sample in the interval (shorter than the sampling period)")
            else:
                out[m] = (None, "not measured in the interval")
        return out

    def _cut_short(self, metric: str, weighted: list, t0: float, t1: float) -> str:
        """Where `metric` stopped being measured part way through [t0, t1] (NVML GPM failing mid-answer), what
        its mean covers and why it stopped, to follow its source: the mean of the first tenth of an answer was
        given as the whole answer's. "" where it was measured to the end."""
        last = max(smp.t for smp, _ in weighted if getattr(smp, metric) is not None)
        later = [smp for smp, _ in weighted if smp.t > last]
        why = next((smp.unavailable[metric] for smp in later if metric in smp.unavailable), None)
        why = why or (self.unavailable.get(metric) if later else None)
        if why is None or t1 <= t0:  # measured to the end (a GPM figure read every other sample is)
            return ""
        share = figures.rounded(100 * (min(last, t1) - t0) / (t1 - t0), 0, top=100.0)
        return f" (the first {share} % of the interval only; then {why})"

    # ---- sampling ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._prime()
            while not self._stop_event.wait(self.interval_s):
                sample = self.sample_once()
                with self._lock:
                    self._pending.append(sample)
                    self._history.append(sample)
        except Exception as exc:  # a bug here must not pass silently, nor take the engine down with it
            log.exception("the monitor thread stopped")
            for m in (*GPU_METRICS, "cpu_util_pct", "process_rss_bytes"):
                self.unavailable.setdefault(m, f"monitor stopped: {type(exc).__name__}: {exc}")

    def _prime(self) -> None:
        """Reference readings, so the first sample covers only time after start()."""
        self._cpu_prev = (self._clock(), time.process_time())
        if self._handle is None:
            return
        nvml = self._nvml
        if self._util_samples and "gpu_util_pct" not in self.unavailable:
            try:
                _, samples = nvml.nvmlDeviceGetSamples(self._handle, nvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
                self._util_last_ts = max((s.timeStamp for s in samples), default=0)
            except self._errors() as exc:
                if not self._is_not_found(exc):
                    self._util_samples = False
                    log.info("NVML utilization samples unavailable, using utilization rates: %s", exc)
        if self._gpm:
            try:
                if not self._gpm_samples:
                    self._gpm_samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
                nvml.nvmlGpmSampleGet(self._handle, self._gpm_samples[0])
                self._gpm_prev_t = self._clock()
            except self._errors() as exc:
                self._gpm = False
                self._mark_gpu_unavailable(f"GPM sampling failed: {exc}", GPM_METRICS)

    def _is_not_found(self, exc: BaseException) -> bool:
        return getattr(exc, "value", None) == getattr(self._nvml, "NVML_ERROR_NOT_FOUND", object())

    def sample_once(self) -> MonitorSample:
        """One reading of every available metric (the thread calls this every `interval_s`)."""
        t = self._clock()
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        self._sample_process(t, values, sources)
        if self._handle is not None:
            self._sample_gpu(t, values, sources)
        # a GPM figure n/a for its last reading says so in the sample: once a later reading is taken, the monitor's
        # `unavailable` no longer has it, and an answer's window holding only odd readings would not say why
        odd = {m: self.unavailable[m] for m in self._odd if m not in values and m in self.unavailable}
        return MonitorSample(t=t, sources=sources, unavailable=odd, **values)

    def _sample_process(self, t: float, values: dict, sources: dict) -> None:
        cpu = time.process_time()
        if self._cpu_prev is not None and t > self._cpu_prev[0]:
            values["cpu_util_pct"] = 100.0 * (cpu - self._cpu_prev[1]) / (t - self._cpu_prev[0])
            sources["cpu_util_pct"] = SOURCES["cpu_util_pct"]
        self._cpu_prev = (t, cpu)
        if "process_rss_bytes" not in self.unavailable and self._page_size:
            try:
                with open("/proc/self/statm", encoding="ascii") as f:
                    values["process_rss_bytes"] = int(f.read().split()[1]) * self._page_size
                sources["process_rss_bytes"] = SOURCES["process_rss_bytes"]
            except (OSError, ValueError, IndexError) as exc:
                self.unavailable["process_rss_bytes"] = f"process RSS: /proc/self/statm unreadable: {exc}"

    def _read(self, metric: str, what: str, fn: Callable[[], Any]) -> Any:
        """fn() or None; a failure marks `metric` unavailable for the rest of the run."""
        if metric in self.unavailable:
            return None
        try:
            return fn()
        except self._errors() as exc:
            self.unavailable[metric] = f"{what} failed: {exc}"
            log.warning("monitor: %s failed, %s is n/a from now on: %s", what, metric, exc)
            return None

    def _sample_gpu(self, t: float, values: dict, sources: dict) -> None:
        nvml, h = self._nvml, self._handle
        util = self._gpu_util()
        if util is not None:
            values["gpu_util_pct"], sources["gpu_util_pct"] = util
        mem = self._read("gpu_memory_used_bytes", "nvmlDeviceGetMemoryInfo", lambda: nvml.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            values["gpu_memory_used_bytes"] = int(mem.used)
            sources["gpu_memory_used_bytes"] = SOURCES["gpu_memory_used_bytes"]
        mw = self._read("power_w", "nvmlDeviceGetPowerUsage", lambda: nvml.nvmlDeviceGetPowerUsage(h))
        if mw is not None:
            values["power_w"] = mw / 1000.0
            sources["power_w"] = SOURCES["power_w"]
        mhz = self._read(
            "sm_clock_mhz", "nvmlDeviceGetClockInfo", lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)
        )
        if mhz is not None:
            values["sm_clock_mhz"] = float(mhz)
            sources["sm_clock_mhz"] = SOURCES["sm_clock_mhz"]
        if self._gpm and self._gpm_prev_t is not None and t - self._gpm_prev_t >= GPM_MIN_INTERVAL_S:
            self._sample_gpm(t, values, sources)

    def _gpu_util(self) -> Optional[tuple[float, str]]:
        if "gpu_util_pct" in self._odd:  # its last reading was none a share can be: read again
            self.unavailable.pop("gpu_util_pct", None)
        if "gpu_util_pct" in self.unavailable:
            return None
        nvml, h = self._nvml, self._handle
        if self._util_samples:
            # The driver samples utilization at its own rate (about 6 Hz on many GPUs), slower than this poll:
            # a poll with no new sample holds the newest one, so the series keeps one source and the summary's
            # time weighting sees a sample-and-hold signal. Utilization rates only once samples have failed.
            held = (self._util_last, SOURCES["gpu_util_samples"]) if self._util_last is not None else None
            try:
                vtype, samples = nvml.nvmlDeviceGetSamples(h, nvml.NVML_GPU_UTILIZATION_SAMPLES, self._util_last_ts)
                new = [s for s in samples if s.timeStamp > self._util_last_ts]
                if not new:
                    return held
                self._util_last_ts = max(s.timeStamp for s in new)
                vals = [_sample_value(s.sampleValue, vtype) for s in new]
                if all(0 <= v <= 100 for v in vals):
                    self._util_last = sum(vals) / len(vals)
                    return self._util_last, SOURCES["gpu_util_samples"]
                self._util_samples = False
                log.info("NVML utilization samples out of 0..100 (%s); using utilization rates", vals[:4])
            except self._errors() as exc:
                if self._is_not_found(exc):  # no sample newer than the last one yet
                    return held
                self._util_samples = False
                log.info("NVML utilization samples failed, using utilization rates: %s", exc)
        rates = self._read(
            "gpu_util_pct", "nvmlDeviceGetUtilizationRates", lambda: nvml.nvmlDeviceGetUtilizationRates(h)
        )
        if rates is None:
            self._odd.discard("gpu_util_pct")  # the call failed: n/a from now on, as every NVML call
            return None
        # 0xFFFFFFFF where the driver has no figure: it was shown as 4,294,967,295 %
        if not self._share_read("gpu_util_pct", float(rates.gpu), "nvmlDeviceGetUtilizationRates"):
            return None
        return float(rates.gpu), SOURCES["gpu_util_rates"]

    def _share_read(self, metric: str, value: float, reader: str) -> bool:
        """Whether `value` can be a reading of `metric`. One no share can be (NaN, inf, below 0, SM activity above
        100 % as on some MIG slices) is not shown, nor averaged into the answer's figure: the figure is n/a with
        what it was, and the next reading is taken again (a single skewed reading turned the figure off for as
        long as the model stayed loaded)."""
        problem = figures.value_problem(figures.spec(metric), value)
        if problem:
            if metric not in self._odd:
                log.warning("monitor: %s's %s %s; n/a until a reading is", reader, metric, problem)
            self.unavailable[metric] = f"{reader}'s reading {problem}"
            self._odd.add(metric)
            return False
        if metric in self._odd:
            self._odd.discard(metric)
            self.unavailable.pop(metric, None)
        return True

    def _sample_gpm(self, t: float, values: dict, sources: dict) -> None:
        nvml = self._nvml
        prev, cur = self._gpm_samples
        wanted = [m for m in GPM_METRICS if m not in self.unavailable or m in self._odd]
        if not wanted:
            self._gpm = False
            return
        ids = {
            "sm_activity_pct": nvml.NVML_GPM_METRIC_SM_UTIL,
            "sm_occupancy_pct": nvml.NVML_GPM_METRIC_SM_OCCUPANCY,
            "dram_bw_util_pct": nvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
        }
        try:
            nvml.nvmlGpmSampleGet(self._handle, cur)
            req = nvml.c_nvmlGpmMetricsGet_t()
            req.version = nvml.NVML_GPM_METRICS_GET_VERSION
            req.numMetrics = len(wanted)
            req.sample1, req.sample2 = prev, cur
            for i, m in enumerate(wanted):
                req.metrics[i].metricId = ids[m]
            nvml.nvmlGpmMetricsGet(req)
        except self._errors() as exc:
            self._gpm = False
            self._mark_gpu_unavailable(f"GPM sampling failed: {exc}", GPM_METRICS)
            log.warning("monitor: GPM failed, SM activity/occupancy and DRAM bandwidth are n/a: %s", exc)
            return
        for i, m in enumerate(wanted):
            ret = req.metrics[i].nvmlReturn
            if ret != nvml.NVML_SUCCESS:
                self.unavailable[m] = f"GPM metric failed: {_error_text(nvml, ret)}"
                continue
            value = float(req.metrics[i].value)
            if not self._share_read(m, value, "NVML GPM"):
                continue
            values[m] = value
            sources[m] = SOURCES[m]
        self._gpm_samples = [cur, prev]
        self._gpm_prev_t = t


def _sample_value(value: Any, vtype: int) -> float:
    """Read a c_nvmlValue_t union by its NVML_VALUE_TYPE_* tag."""
    field = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}.get(vtype, "uiVal")
    return float(getattr(value, field))


def _error_text(nvml: Any, code: int) -> str:
    try:
        return str(nvml.NVMLError(code))
    except (TypeError, ValueError) as exc:
        return f"NVML error {code} ({exc})"
