"""dtrain.engine.telemetry: off without a GPU (no thread, no fields, no error); the sampling thread and the per-step
aggregate on a stand-in for NVML."""

import threading
import time
from types import SimpleNamespace

import torch

from dtrain.engine.telemetry import FIELDS, Telemetry


class FakeNvml:
    """The few pynvml calls telemetry makes; utilization climbs 10, 20, 30 ... per sample."""

    class NVMLError_NotSupported(Exception):
        pass

    def __init__(self, power=True):
        self.calls, self.power, self.shut = 0, power, False
        self.power_asked = 0

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetUtilizationRates(self, handle):
        self.calls += 1
        return SimpleNamespace(gpu=min(100, 10 * self.calls), memory=5)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=(1000 + self.calls) * 2**20, total=80 * 2**30)

    def nvmlDeviceGetPowerUsage(self, handle):
        self.power_asked += 1
        if not self.power:
            raise self.NVMLError_NotSupported()
        return 250_000  # mW


def test_off_without_a_gpu():
    before = threading.active_count()
    tel = Telemetry.for_device(torch.device("cpu"))
    assert not tel.enabled and "not a GPU" in tel.reason
    rec = {"step": 1, "step_ms": 5.0}
    with tel:
        assert tel.sample_into(rec) is rec and rec == {"step": 1, "step_ms": 5.0}
        assert threading.active_count() == before  # no sampling thread
    tel.stop()  # stopping twice is harmless


def test_off_when_nvml_cannot_start():
    class NoDriver(FakeNvml):
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    tel = Telemetry.for_device(torch.device("cuda", 0), nvml=NoDriver())
    assert not tel.enabled and "NVML unavailable" in tel.reason and "Not Found" in tel.reason
    assert tel.start().sample_into({}) == {}


def test_samples_off_thread_and_aggregates_per_step():
    nvml = FakeNvml()
    tel = Telemetry(nvml, handle="gpu0", interval_s=0.005).start()
    assert any(t.name == "dtrain-telemetry" for t in threading.enumerate())
    time.sleep(0.1)
    rec = tel.sample_into({"step": 1})
    n = nvml.calls
    assert n >= 3 and set(FIELDS) <= set(rec)
    assert 10 <= rec["gpu_util_pct"] < 10 * n  # a mean of 10, 20, ... over the window
    assert rec["gpu_mem_mib"] >= 1000 + n - 1  # the peak of the window
    assert rec["gpu_power_w"] == 250.0
    # A step shorter than the interval repeats the latest sample instead of leaving a hole.
    tel.interval_s = 10.0
    time.sleep(0.05)
    tel.sample_into({})
    assert tel.sample_into({})["gpu_power_w"] == 250.0
    tel.stop()
    assert nvml.shut and not any(t.name == "dtrain-telemetry" for t in threading.enumerate())


def test_a_field_the_board_does_not_report_is_left_empty_and_not_asked_again():
    nvml = FakeNvml(power=False)
    tel = Telemetry(nvml, handle="gpu0", interval_s=0.005).start()
    time.sleep(0.05)
    rec = tel.sample_into({})
    tel.stop()
    assert rec["gpu_power_w"] is None and rec["gpu_util_pct"] is not None
    assert nvml.power_asked == 1
