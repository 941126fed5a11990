"""Host CPU time of one step, by thread: the training thread, the communication backend's threads, the rest; and
the step's page faults and the process's host memory.

Where the ranks already keep the cores busy (the CPU benchmark: two ranks on two vCPUs), communication costs step time
through the CPU it takes as well as through waiting for the link, and a strategy that moves half the bytes can still
cost as much. A step record gains, per group of the process's threads, the CPU time they took during the step:

    cpu_main_ms     the training thread (forward, backward, the strategies' hooks, whatever posts from there)
    cpu_backend_ms  the process group backend's threads (gloo's `gloo_*` and `pt_gloo_*`, NCCL's `pt_nccl_*`)
    cpu_other_ms    every other thread (a strategy's own Python threads, such as the sharded reducer's completion
                    thread, and the progress bar's)
    minor_faults    the process's minor page faults (`getrusage`'s ru_minflt, all threads): each is a page the kernel
                    mapped, and for fresh memory zeroed, which a step that reuses its memory does not pay again
    peak_rss_mib    the process's peak resident memory so far (ru_maxrss)
    heap_mib, heap_used_mib  the allocator's heap at the step's end and what of it is in use
                    (`dtrain.common.host_memory.heap_mib`; glibc only)

Read from `/proc/self/task/<tid>/schedstat`, the scheduler's time on a CPU in ns (user and kernel alike; interrupt
and softirq work, network receive processing among it, counts for whichever thread the CPU was running). Per thread:
one started within the step counts all its time, one that ended within it none (its counters went with it; the
backends' and the strategies' threads live as long as the job). Off where there is no such file (not Linux): no
fields.

And whether the device computes bf16 natively (`bf16_native`), which `train.amp: auto` follows: a CPU without bf16
instructions runs bf16 autocast by converting to fp32 and back around fp32 arithmetic, many times slower than fp32
itself (docs/profiles.md).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Callable

import torch

from dtrain.common.host_memory import heap_mib

CPU_FIELDS = ("cpu_main_ms", "cpu_backend_ms", "cpu_other_ms")
FIELDS = CPU_FIELDS + ("minor_faults", "peak_rss_mib", "heap_mib", "heap_used_mib")
BACKEND_PREFIXES = ("gloo", "pt_gloo", "pt_nccl")  # the OS names of the backends' threads (/proc/.../comm)
TASKS = Path("/proc/self/task")


def minor_faults() -> int:
    """The process's minor page faults so far, all threads."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def read_threads(tasks: Path = TASKS) -> dict[int, tuple[str, int]]:
    """tid -> (field, ns on a CPU so far) for the process's live threads; threads gone while reading are left out."""
    main, out = os.getpid(), {}
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # the thread ended in between, or no schedstat
            continue
        tid = int(task.name)
        field = ("cpu_main_ms" if tid == main else
                 "cpu_backend_ms" if name.startswith(BACKEND_PREFIXES) else "cpu_other_ms")
        out[tid] = (field, ns)
    return out


class HostCpu:
    """`begin()` at the start of a step, `sample_into(record)` at its end: the groups' CPU time in between, and the
    process's minor page faults."""

    def __init__(self, on: bool = True, tasks: Path = TASKS, faults: Callable[[], int] = minor_faults):
        self.tasks, self.faults = tasks, faults
        self.on = on and tasks.is_dir() and any(tasks.glob("*/schedstat"))
        self._start: dict[int, int] | None = None  # tid -> ns on a CPU at begin()
        self._faults = 0  # minor faults at begin()

    def begin(self) -> None:
        self._start = {tid: ns for tid, (_, ns) in read_threads(self.tasks).items()} if self.on else None
        self._faults = self.faults() if self.on else 0

    def sample_into(self, record: dict) -> dict:
        if self._start is None:
            return record
        total = dict.fromkeys(CPU_FIELDS, 0)
        for tid, (field, ns) in read_threads(self.tasks).items():
            total[field] += max(0, ns - self._start.get(tid, 0))  # a thread new since begin(): all of its time
        self._start = None
        record.update({k: round(v / 1e6, 3) for k, v in total.items()})
        record["minor_faults"] = self.faults() - self._faults
        record["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # Linux: KiB
        record.update(heap_mib())
        return record


# -- bf16 ----------------------------------------------------------------------------------------------------------

CPUINFO = Path("/proc/cpuinfo")
# The features whose instructions compute bf16, as Linux names them: x86's AVX512-BF16 and AMX-BF16, Arm's BF16
# extension. torch's own CPU capability does not tell: it reads "AVX512" on a CPU with avx512_bf16 as on one without.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags(cpuinfo: Path | None = None) -> set[str] | None:
    """The first CPU's feature flags (x86's `flags` line, Arm's `Features`; default /proc/cpuinfo); None where there
    is no such file."""
    try:
        lines = (CPUINFO if cpuinfo is None else cpuinfo).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def _isa_cap() -> str | None:
    """The environment's cap on the instructions torch's CPU kernels use, where it leaves out bf16's (oneDNN's
    ONEDNN_MAX_CPU_ISA, ATen's ATEN_CPU_CAPABILITY: set to run as an older CPU would), in words; else None."""
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if onednn and onednn != "ALL" and "BF16" not in onednn and "AMX" not in onednn:
        return f"ONEDNN_MAX_CPU_ISA={onednn}"
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if aten in ("default", "avx2"):
        return f"ATEN_CPU_CAPABILITY={aten}"
    return None


def bf16_native(device: torch.device, cpuinfo: Path | None = None) -> tuple[bool, str]:
    """Whether `device` computes bf16 natively, and why, in words for run.json's `amp_reason`. A GPU: what CUDA
    says without counting emulation; a CPU: its flags in /proc/cpuinfo (none to read: not native)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"GPU {name}: bf16 native"
        major, minor = torch.cuda.get_device_capability(device)
        return False, f"GPU {name} (compute capability {major}.{minor}) without native bf16"
    if device.type != "cpu":
        return False, f"device {device.type}: native bf16 not known"
    capability = torch.backends.cpu.get_cpu_capability()
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return False, f"CPU capability {capability}, its bf16 instructions not known (no {CPUINFO})"
    have = [f for f in BF16_FLAGS if f in flags]
    capped = _isa_cap()
    if have and capped:
        return False, f"CPU with {', '.join(have)}, but {capped}: bf16 emulated"
    if have:
        return True, f"CPU capability {capability} with {', '.join(have)}: bf16 native"
    return False, f"CPU capability {capability} without bf16 instructions (avx512_bf16, amx_bf16): bf16 emulated"
