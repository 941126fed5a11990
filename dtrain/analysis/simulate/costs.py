"""What collectives cost the replay beyond their own time (the models' `allreduce_ms` and `allreduce_latency_ms`):
the computation they take from an overlapped backward on a CPU machine, and how many run at once per process group.

`model` is a `dtrain.collectives.costmodel` model: a topology preset (`NcclModel`), NCCL's logged table, or a fit to the
benchmark (`FittedModel`).
"""

from __future__ import annotations

from dtrain.collectives import costmodel as cm
from dtrain.collectives.timeline import GLOO_LANES, Timeline


def host_ms(model, sizes: list[int], tl: Timeline) -> float | None:
    """How much longer backward computes (ms) because of the collectives of timeline `tl` (sizes in index order),
    from the benchmark's --overlap measurement (`FittedModel.host_us`): each costs the computation its measured
    amount pro rata to the part of its run (start to end) before backward ends; a collective still queued behind
    others costs nothing yet. None for a model without that measurement. On a CPU machine the backend's threads,
    the kernel's network stack and the averaging callback share the cores with backward. (The benchmark's CPU time
    per operation, `cpu_us`, is not this: its loop waits for every all-reduce.)"""
    host = getattr(model, "host_us", None)
    if host is None or host(0) is None:
        return None
    total = 0.0
    for n, s, e in zip(sizes, tl.start, tl.end):
        if s >= tl.backward_ms:
            continue
        total += host(n) * (1.0 if e <= s else (min(e, tl.backward_ms) - s) / (e - s))
    return total / 1000.0


def default_lanes(backend: str, model) -> int:
    """gloo runs GLOO_LANES collectives at once per process group, which a fit to its benchmark models; NCCL's
    models (a preset, or the table NCCL logged) are one stream."""
    return GLOO_LANES if backend == "gloo" and isinstance(model, cm.FittedModel) else 1


def lockstep(model) -> bool:
    """Whether the collectives running at once in one gloo process group share its link by size (`play_timeline`'s
    `lockstep`): on more than two ranks, where gloo's ring collectives move a chunk of each in turn, step by step
    (the testbed's records at 4 ranks: buckets completing in pairs). On two ranks they share it equally (its records
    there: small buckets completing before a large one launched ahead of them). Only matters with several lanes."""
    return (getattr(model, "ranks", None) or 2) > 2
