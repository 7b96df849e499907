"""A description of the machine and libraries, stored with every benchmark so its figures can be compared."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import sys
from typing import Any, Optional

log = logging.getLogger(__name__)

LIBRARIES = (
    "torch",
    "transformers",
    "gguf",
    "safetensors",
    "tokenizers",
    "numpy",
    "PySide6-Essentials",
    "pyqtgraph",
    "nvidia-ml-py",
)


def cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: platform.processor() below
    return platform.processor() or None


def memory_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass  # not Linux: sysconf below
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def library_versions() -> dict[str, Optional[str]]:
    """Installed versions of the libraries whose speed or behaviour matters here; None when not installed."""
    out: dict[str, Optional[str]] = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _gpus(nvml: Any) -> tuple[list[dict[str, Any]], Optional[str], Optional[str]]:
    """(CUDA devices as torch sees them, NVIDIA driver version, why there is no driver version)."""
    import torch

    gpus: list[dict[str, Any]] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "index": i,
                    "name": p.name,
                    "sm_count": p.multi_processor_count,
                    "memory_bytes": p.total_memory,
                    "compute_capability": f"{p.major}.{p.minor}",
                }
            )
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError as exc:
            return gpus, None, f"nvidia-ml-py not installed: {exc}"
    errors: tuple[type[BaseException], ...] = tuple(
        e
        for e in (getattr(nvml, "NVMLError", None), AttributeError, OSError)
        if isinstance(e, type) and issubclass(e, BaseException)
    )
    try:
        nvml.nvmlInit()
    except errors as exc:
        return gpus, None, f"NVML not available: {exc}"
    try:
        driver = nvml.nvmlSystemGetDriverVersion()
        return gpus, driver.decode() if isinstance(driver, bytes) else str(driver), None
    except errors as exc:
        return gpus, None, f"NVML driver version: {exc}"
    finally:
        try:
            nvml.nvmlShutdown()
        except errors as exc:
            log.debug("nvmlShutdown: %s", exc)


NO_LOAD_AVERAGE = "the OS gives no load average (os.getloadavg; Windows has none)"


def load_average() -> Optional[list[float]]:
    """The 1, 5 and 15 minute load averages; None where the OS gives none (NO_LOAD_AVERAGE)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _why_null(machine: dict[str, Any], driver_reason: Optional[str]) -> dict[str, str]:
    """Why each field of `machine` that is null is (its `unavailable`, as a figure's)."""
    import torch

    no_cuda = (
        f"this torch ({torch.__version__}) is built without CUDA"
        if torch.version.cuda is None
        else "torch sees no CUDA device (torch.cuda.is_available() is false)"
    )
    reasons = {
        "cpu_model": "the OS names no CPU model (/proc/cpuinfo, platform.processor())",
        "cpu_cores_logical": "the OS gives no core count (os.cpu_count)",
        "cpu_cores_usable": "the OS gives no core count (os.cpu_count)",
        "memory_bytes": "the OS gives no memory size (/proc/meminfo, sysconf)",
        "torch_cuda": f"this torch ({torch.__version__}) is built without CUDA",
        "gpu_name": f"no CUDA device: {no_cuda}",
        "sm_count": f"no CUDA device: {no_cuda}",
        "cuda": f"no CUDA device: {no_cuda}",
        "driver_version": driver_reason or "NVML gave no driver version",
    }
    return {
        k: reasons.get(k, NO_LOAD_AVERAGE if k.startswith("load_average") else "not measured")
        for k, v in machine.items()
        if v is None and not k.endswith("_reason")
    }


def describe_machine(nvml: Any = None, **extra: Any) -> dict[str, Any]:
    """CPU, memory, OS, Python, library versions, torch threads and the CUDA devices with their driver, and the
    fields in `extra` (load_average_at_start=...); `unavailable` says why each field that is null is."""
    import torch

    gpus, driver, driver_reason = _gpus(nvml)
    machine = {
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the widest vector ISA torch's kernels use
        "cpu_cores_logical": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": memory_bytes(),
        "os": platform.platform(),
        # Other work on the machine slows every figure; the load when the description was taken says how much.
        "load_average_1_5_15min": load_average(),
        "python": sys.version.split()[0],
        "libraries": library_versions(),
        "torch_threads": torch.get_num_threads(),
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpus,
        "gpu_name": gpus[0]["name"] if gpus else None,
        "sm_count": gpus[0]["sm_count"] if gpus else None,
        "driver_version": driver,
        "driver_version_reason": driver_reason,
        **extra,
    }
    machine["unavailable"] = _why_null(machine, driver_reason)
    return machine
