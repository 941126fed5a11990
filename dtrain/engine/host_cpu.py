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
"""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Callable

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
