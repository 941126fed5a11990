"""Calibration: what the reference step's own collectives, played again at their recorded launch times, say about
the cost model on this run: how much slower collectives run while backward computes (or, when none overlapped it,
measured over modeled collective time), and the time `wait()` spends after the last collective.
"""

from __future__ import annotations

import math

from dtrain.collectives.costmodel.played import host_ms, lockstep, off_link_ms, played_ms
from dtrain.analysis.simulate.reference import ReferenceStep
from dtrain.collectives.schedule import LOOKUP_GROUP
from dtrain.collectives.step_time import Calibration
from dtrain.collectives.timeline import Timeline, play_timeline


def in_launch_order(recs: list[dict]) -> list[dict]:
    """The records as their collectives launched: a split embedding's lookups, recorded after the buckets, launch
    during backward."""
    return sorted(recs, key=lambda r: r["launch_ms"])


def record_groups(recs: list[dict], by_class: bool) -> list | None:
    """Each record's process group for `play_timeline`: a split embedding's lookups run on the split's own group
    (`dtrain.collectives.tied_split`), beside the buckets; the buckets on their class's group where `by_class`, else
    on one. None: all on one group."""
    groups = [LOOKUP_GROUP if r.get("part") == "lookup" else (r.get("class") if by_class else None) for r in recs]
    return groups if any(g is not None for g in groups) else None


def calibrate(ref: ReferenceStep, model, host_cost: bool = False, lanes: int = 1, class_groups: bool = False
              ) -> Calibration:
    """`host_cost`: the run computed on the CPU, so collectives during backward take CPU time from it. `lanes`:
    collectives run at once per process group (see `play_timeline`); `class_groups`: the profiled run sent each
    tensor class through its own group."""
    calib = _calibrate(ref, model, lanes, class_groups)
    if host_cost and calib.timeline is not None:
        base = host_ms(model, [r["bytes"] for r in in_launch_order(ref.records)], calib.timeline,
                       ref.compute_end_ms)
        if base is not None:
            calib.host_base_ms = base
            calib.note += (f"; backward lengthened by the collectives it overlaps, as the benchmark measured "
                           f"({base:.1f} ms for the profiled step's)")
    return calib


def _calibrate(ref: ReferenceStep, model, lanes: int, class_groups: bool) -> Calibration:
    """Plays the reference step's own collectives again (at their measured launch times, with the lanes the
    prediction uses) and fits what makes that timeline match their measured completions."""
    recs = ref.records
    if not recs or any(r.get(k) is None for r in recs for k in ("launch_ms", "complete_ms")):
        return Calibration(note="none (the profiled step has no launch/complete times)", lanes=lanes)
    backward = ref.sync_backward_ms
    recs = in_launch_order(recs)
    launch = [r["launch_ms"] for r in recs]
    work = [played_ms(model, r["bytes"]) for r in recs]
    lat = [off_link_ms(model, r["bytes"]) for r in recs]  # what the predictions play as latency, for the same reason
    groups = record_groups(recs, class_groups and lanes > 1)
    by_size = lockstep(model)
    ends = [r["complete_ms"] for r in recs]
    wait_start = recs[0].get("wait_start_ms")
    post = 0.0
    if wait_start is not None:
        post = max(0.0, ref.exposed_ms - max(0.0, max(ends) - wait_start))

    def played(k: float, scale: float = 1.0) -> Timeline:
        return play_timeline(launch, [scale * w for w in work], backward, True, k, lanes, [scale * a for a in lat],
                             groups, computing_ms=ref.compute_end_ms, lockstep=by_size)

    lanes_note = f", {lanes} collectives at once per process group" if lanes > 1 else ""
    if any(s < ref.compute_end_ms for s in played(1.0).start):
        # Fit the slowdown during backward (log-scale golden section on [1/4, 8]) to the measured completions.
        def err(log_k):
            return sum((e - m) ** 2 for e, m in zip(played(math.exp(log_k)).end, ends))

        lo, hi = math.log(0.25), math.log(8.0)
        g = (math.sqrt(5) - 1) / 2
        for _ in range(60):
            a, b = hi - g * (hi - lo), lo + g * (hi - lo)
            lo, hi = (lo, b) if err(a) < err(b) else (a, hi)
        k = math.exp((lo + hi) / 2)
        return Calibration(1.0, post, f"collectives x{k:.3f} slower while backward computes (fitted to the "
                                      f"{len(recs)} completions of the profiled step{lanes_note}), +{post:.2f} ms "
                                      f"after the last collective", slowdown=k, lanes=lanes, timeline=played(k))
    measured = Timeline(launch, launch, launch, ends, backward).comm_ms  # busy from first launch to last completion
    modeled = played(1.0).comm_ms
    scale = measured / modeled if modeled > 0 else 1.0
    return Calibration(scale, post, f"comm x{scale:.3f} (measured {measured:.2f} ms / modeled {modeled:.2f} ms, "
                                    f"none overlapped backward{lanes_note}), +{post:.2f} ms after the last "
                                    f"collective", lanes=lanes, timeline=played(1.0, scale))
