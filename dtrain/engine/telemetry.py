"""GPU telemetry for step records: utilization, memory and power from nvidia-ml-py, sampled on a daemon thread.

Sits beside the training loop, which drives it: `start()` before the first step, `sample_into(record)` as each step
record is written (it adds the aggregate of the samples taken since the previous step), `stop()` at the end. Without
a CUDA device, or where NVML cannot start, it is off: no thread, no fields, no error.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

FIELDS = ("gpu_util_pct", "gpu_mem_mib", "gpu_power_w")  # what a step record gains on a GPU


@dataclass
class Sample:
    t: float  # time.monotonic()
    util_pct: float | None  # % of the last NVML sample period (1/6 s to 1 s) in which a kernel ran
    mem_mib: float | None  # device memory in use, all processes (MiB)
    power_w: float | None  # board power draw (W)


def _nvml_handle(nvml, device):
    """The NVML handle of a torch CUDA device: by UUID, which survives CUDA_VISIBLE_DEVICES renumbering."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    for candidate in (uuid, f"GPU-{uuid}"):
        try:
            return nvml.nvmlDeviceGetHandleByUUID(candidate)
        except Exception:  # NVMLError_NotFound and friends: try the other spelling, then the index
            pass
    return nvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(index))


class Telemetry:
    """Samples one GPU every `interval_s` off the training thread; off (a no-op) when `handle` is None."""

    def __init__(self, nvml=None, handle=None, interval_s: float = 0.1, reason: str = ""):
        self.nvml, self.handle, self.interval_s = nvml, handle, interval_s
        self.enabled = handle is not None
        self.reason = reason  # why it is off
        self._samples: list[Sample] = []
        self._last: Sample | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsupported: set[str] = set()  # fields this GPU does not report (power on some boards)

    @classmethod
    def off(cls, reason: str) -> "Telemetry":
        return cls(reason=reason)

    @classmethod
    def for_device(cls, device, interval_s: float = 0.1, nvml=None) -> "Telemetry":
        """On for a CUDA device whose NVML handle can be had; off otherwise, with the reason kept."""
        if getattr(device, "type", str(device)) != "cuda":
            return cls.off(f"device {device} is not a GPU")
        try:
            if nvml is None:
                import pynvml as nvml  # nvidia-ml-py: loaded only for a CUDA device, where NVML can answer
            nvml.nvmlInit()
            return cls(nvml, _nvml_handle(nvml, device), interval_s)
        except Exception as e:  # no driver, no library, a MIG slice NVML will not describe ...
            return cls.off(f"NVML unavailable: {e.__class__.__name__}: {e}")

    # -- the sampling thread --------------------------------------------------------------------------------------

    def _read(self, name: str, fn):
        if name in self._unsupported:
            return None
        try:
            return fn()
        except Exception as e:  # a missing value, never a dead thread
            if type(e).__name__ == "NVMLError_NotSupported":  # this board never reports it: stop asking
                self._unsupported.add(name)
            return None

    def sample(self) -> Sample:
        n, h = self.nvml, self.handle
        return Sample(time.monotonic(),
                      self._read("util", lambda: float(n.nvmlDeviceGetUtilizationRates(h).gpu)),
                      self._read("mem", lambda: n.nvmlDeviceGetMemoryInfo(h).used / 2**20),
                      self._read("power", lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0))  # mW

    def _run(self) -> None:
        while not self._stop.is_set():
            s = self.sample()
            with self._lock:
                self._samples.append(s)
            self._stop.wait(self.interval_s)

    def start(self) -> "Telemetry":
        if self.enabled and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="dtrain-telemetry", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5 * self.interval_s + 1)
            self._thread = None
        if self.enabled:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
            self.enabled = False

    # -- what a step record gets ----------------------------------------------------------------------------------

    def sample_into(self, record: dict) -> dict:
        """Add the mean utilization, peak memory and mean power of the samples since the last call; a step shorter
        than the sampling interval repeats the latest sample. Off: the record is returned untouched."""
        if not self.enabled:
            return record
        with self._lock:
            window, self._samples = self._samples, []
        if not window and self._last is not None:
            window = [self._last]
        if not window:
            return record
        self._last = window[-1]

        def agg(values, how):
            values = [v for v in values if v is not None]
            return round(how(values), 1) if values else None

        record["gpu_util_pct"] = agg([s.util_pct for s in window], lambda v: sum(v) / len(v))
        record["gpu_mem_mib"] = agg([s.mem_mib for s in window], max)
        record["gpu_power_w"] = agg([s.power_w for s in window], lambda v: sum(v) / len(v))
        return record

    def __enter__(self) -> "Telemetry":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
