"""What collectives cost a replayed step beyond their own time (the models' `allreduce_ms` and `allreduce_latency_ms`):
the part of it that does not use the link, the computation they take from an overlapped backward on a CPU machine,
and how many run at once per process group.

`model` is a `dtrain.collectives.costmodel` model: a topology preset (`NcclModel`), NCCL's logged table, or a fit to the
benchmark (`FittedModel`).
"""

from __future__ import annotations

from dtrain.collectives.costmodel.fit import FittedModel
from dtrain.collectives.timeline import GLOO_LANES, Timeline


LINK_PROBE_BYTES = 1 << 30  # sizes where a fit's time is the link's alone: its cost per byte there is the link's rate


def link_ms(model, nbytes: float) -> float | None:
    """How long an all-reduce of `nbytes` keeps the link busy (ms): its bytes at the link's rate, a fit's cost of a
    byte at the largest sizes (`LINK_PROBE_BYTES`). None for a model that is not a fit to a benchmark (NCCL's
    analytical models and tables: their latency term is already the part that does not use the link)."""
    if not isinstance(model, FittedModel):
        return None
    per_byte = (model.allreduce_ms(2 * LINK_PROBE_BYTES) - model.allreduce_ms(LINK_PROBE_BYTES)) / LINK_PROBE_BYTES
    return nbytes * per_byte if per_byte > 0 else None


def played_ms(model, nbytes: float, ms: float | None = None) -> float:
    """An all-reduce of `nbytes` as the replay plays it (ms): the model's time (or `ms`, another cost of it), and
    no less than its bytes at the link's rate (`link_ms`). A fit's flat small-size regime can reach past the size
    where its bytes alone take longer (a benchmark on 4 ranks sharing 2 vCPUs: 5.7 ms flat up to 512 KiB, whose
    bytes need 6.6 ms at the rate of the largest sizes): played as it stands, such a bucket would move its bytes
    faster than the link can, and plans of small buckets would be credited for it."""
    t = model.allreduce_ms(nbytes) if ms is None else ms
    link = link_ms(model, nbytes)
    return t if link is None else max(t, link)


def off_link_ms(model, nbytes: float, ms: float | None = None, share: float = 1.0) -> float:
    """The part of a collective that does not use the link (`play_timeline`'s latency, ms): of an all-reduce of
    `nbytes` as the model costs it, or of a collective taking `ms` that moves `share` of that all-reduce's bytes
    (1/2 for a reduce-scatter or an all-gather). Every byte crosses the link at its rate whatever the size: a
    fit's small-size regime whose time is flat (4 ranks on 2 vCPUs: about the same for 4 KB as for 512 KB, the
    2(N-1) ring steps' scheduling) holds its bytes' transfer inside that time, it does not make them free; taking
    the regime's intercept as latency would let a 512 KB bucket beside a large one cost that one nothing. So it is
    what is left of the collective's time after its bytes' transfer at the link's rate (`link_ms`); the model's
    latency term where the model has no fitted rate."""
    link = link_ms(model, nbytes)
    if link is None:
        return model.allreduce_latency_ms(nbytes)
    return max(0.0, (model.allreduce_ms(nbytes) if ms is None else ms) - share * link)


def host_ms(model, sizes: list[int], tl: Timeline, computing_ms: float | None = None) -> float | None:
    """How much longer backward computes (ms) because of the collectives of timeline `tl` (sizes in index order),
    from the benchmark's --overlap measurement (`FittedModel.host_us`): each costs the computation its measured
    amount pro rata to the part of its run (start to end) before backward ends; a collective still queued behind
    others costs nothing yet. None for a model without that measurement. On a CPU machine the backend's threads,
    the kernel's network stack and the averaging callback share the cores with backward. (The benchmark's CPU time
    per operation, `cpu_us`, is not this: its loop waits for every all-reduce.) `computing_ms`: when the last rank
    stops computing, where later than this rank's backward end (`ReferenceStep.compute_end_ms`): where ranks share
    the machine's cores, a collective running while any rank still computes takes its CPU from that rank, and the
    slowest rank's step is the step."""
    host = getattr(model, "host_us", None)
    if host is None or host(0) is None:
        return None
    until = tl.backward_ms if computing_ms is None else max(tl.backward_ms, computing_ms)
    total = 0.0
    for n, s, e in zip(sizes, tl.start, tl.end):
        if s >= until:
            continue
        total += host(n) * (1.0 if e <= s else (min(e, until) - s) / (e - s))
    return total / 1000.0


def default_lanes(backend: str, model) -> int:
    """gloo runs GLOO_LANES collectives at once per process group, which a fit to its benchmark models; NCCL's
    models (a preset, or the table NCCL logged) are one stream."""
    return GLOO_LANES if backend == "gloo" and isinstance(model, FittedModel) else 1


def lockstep(model) -> bool:
    """Whether the collectives running at once in one gloo process group share its link by size (`play_timeline`'s
    `lockstep`): on more than two ranks, where gloo's ring collectives move a chunk of each in turn, step by step
    (the testbed's records at 4 ranks: buckets completing in pairs). On two ranks they share it equally (its records
    there: small buckets completing before a large one launched ahead of them). Only matters with several lanes."""
    return (getattr(model, "ranks", None) or 2) > 2
