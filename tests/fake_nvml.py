"""What stand-ins for the pynvml module share: its error type and the constants the monitor reads."""

from __future__ import annotations

import pynvml


class FakeNVMLError(Exception):
    """pynvml.NVMLError as the monitor sees it: a return code in `value`, NVML's wording as the text."""

    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {3: "Not Supported", 6: "Not Found", 12: "NVML Shared Library Not Found", 15: "GPU is lost"}.get(
            self.value, f"error {self.value}"
        )


class NVMLConstants:
    """The part of a stand-in pynvml module that is not a call."""

    NVMLError = FakeNVMLError
    NVML_SUCCESS = 0
    NVML_ERROR_NOT_FOUND = 6
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_CLOCK_MEM = pynvml.NVML_CLOCK_MEM
    NVML_GPU_UTILIZATION_SAMPLES = pynvml.NVML_GPU_UTILIZATION_SAMPLES
