"""Timestamps on the timeline that matters: the host clock on CPU, the GPU's own on CUDA.

On CPU (gloo) work runs when the host calls it and a collective's completion callback runs once the data has arrived,
so the host clock measures both. On CUDA (NCCL) kernels and collectives run asynchronously to the host: gradient-ready
hooks and completion callbacks fire when work is *enqueued*, so a host time says nothing about when it ran. There a
`Stamp` also records a CUDA event on the current stream — in a ready hook, behind the gradient kernels; in a
completion callback, on the stream that the future has synchronized with the collective — and intervals are read
from the events once the step's work is done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class Stamp:
    host: float  # time.perf_counter()
    event: torch.cuda.Event | None = None  # recorded on the current stream, on CUDA only


def stamp(device: torch.device | None = None) -> Stamp:
    """Now: the host clock, and on a CUDA device also an event recorded on the current stream."""
    event = None
    if device is not None and device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
    return Stamp(time.perf_counter(), event)


def ms_between(a: Stamp | None, b: Stamp | None) -> float | None:
    """Milliseconds from `a` to `b`: between their events when both have one (waiting for them to complete), else
    between their host times. None when either is missing."""
    if a is None or b is None:
        return None
    if a.event is not None and b.event is not None:
        a.event.synchronize()
        b.event.synchronize()
        return a.event.elapsed_time(b.event)
    return (b.host - a.host) * 1000.0


def record_ms(t0: Stamp | None, t: Stamp | None) -> float | None:
    """`ms_between(t0, t)` as a bucket record keeps it: rounded to the microsecond, None when not measured."""
    v = ms_between(t0, t)
    return None if v is None else round(v, 3)
