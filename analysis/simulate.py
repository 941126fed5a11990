"""Step-time simulator: replays one profiled backward with other bucket plans.

Sits after the records: from one profiled step of a run (compute phases from steps.jsonl, gradient-ready times from
buckets.jsonl) and a cost model (`collectives.costmodel`: a fit to the benchmark, or a topology preset) it predicts
step time and exposed communication per strategy and bucket size. With a preset (NCCL) the collectives run on a
single communication stream; for a gloo run with a fitted model, two at a time per process group (ProcessGroupGloo's
threads), sharing the link per connection (between groups, then within one), and on a CPU machine the benchmark's
measured cost of a collective to the computation it overlaps (`collectives.bench --overlap`) lengthens backward.
Everything it prints is modeled.

    python -m analysis.simulate --run runs/m30k --topology local:bench.json --strategies flat,bucketed,per_class
    python -m analysis.simulate --run runs/m30k --topology local:bench.json --measured runs/flat runs/b5 runs/b25
    python -m analysis.simulate --run runs/m30k --topology local:bench.json --median   # medians of steady steps
    python -m analysis.simulate --paper                  # the paper's base configuration projected on 8 P100
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from collectives import costmodel as cm
from common.errors import ArgumentParser, UserError, exit_on_user_error

PROG = "analysis.simulate"
DEFAULT_STRATEGIES = ("per_tensor", "flat", "bucketed", "per_class", "ddp", "noop")
DEFAULT_CAPS_MB = (1.0, 5.0, 25.0, 100.0)
CAPPED = {"bucketed", "per_class", "ddp"}  # strategies whose plan depends on the bucket cap


# ---------------------------------------------------------------------------------------------------------------
# The replay


GLOO_LANES = 2  # collectives one gloo process group runs at once: ProcessGroupGloo's worker threads (default 2)


@dataclass
class Timeline:
    """Per bucket (index order): when it is ready, launched, starts on the stream and completes (ms from the start
    of the synchronized backward)."""

    ready: list[float]
    launch: list[float]
    start: list[float]
    end: list[float]
    backward_ms: float

    @property
    def comm_ms(self) -> float:
        """Time with at least one collective in flight (on one stream: the sum of their durations)."""
        busy, reach = 0.0, -math.inf
        for s, e in sorted(zip(self.start, self.end)):
            if e > reach:
                busy += e - max(s, reach)
                reach = e
        return busy

    @property
    def exposed_ms(self) -> float:
        """Communication still running when backward ends: what `wait()` blocks on."""
        return max(0.0, max(self.end, default=0.0) - self.backward_ms)


def launch_times(ready_ms: list[float], backward_ms: float, overlap: bool = True) -> list[float]:
    """With `overlap` bucket i launches once it is ready and bucket i-1 has launched (every rank launches in index
    order); otherwise all launch when backward ends."""
    out, prev = [], 0.0
    for r in ready_ms:
        prev = max(r, prev) if overlap else max(backward_ms, r)
        out.append(prev)
    return out


def replay(ready_ms: list[float], durations_ms: list[float], backward_ms: float, overlap: bool = True,
           slowdown: float = 1.0, lanes: int = 1, latency_ms: list[float] | None = None,
           groups: list | None = None) -> Timeline:
    """Replays the collectives of one backward. A launched bucket waits in its process group's queue (`groups`, one
    group if None) until one of the group's `lanes` is free, then runs: first its latency part (`latency_ms`, at most
    its duration; none if None), which does not use the link, then its transfer part, which shares the link: equally
    between the groups transferring at that moment (each group is its own set of connections, and TCP shares a link
    between connections), and equally between the transfers of one group. Everything runs `slowdown` times
    slower while backward computes (on CPUs, compute and gloo share the cores). With one lane and one group this is
    a single stream: a bucket starts when launched and the previous one is done.

    lanes=1 is NCCL's model here (one communication stream); gloo runs GLOO_LANES collectives per process group at
    once, which shows in its records as small buckets completing out of index order."""
    n = len(durations_ms)
    launch = launch_times(ready_ms, backward_ms, overlap)
    lat = [min(max(0.0, a), d) for a, d in zip(latency_ms or [0.0] * n, durations_ms)]
    left = [[a, d - a] for a, d in zip(lat, durations_ms)]  # per bucket: [latency, transfer] still to do
    group = groups or [None] * n
    start, end = [math.nan] * n, [math.nan] * n
    queues: dict = {}
    running: dict = {}  # group -> indices running now
    now, nxt, eps = 0.0, 0, 1e-9
    while True:
        while nxt < n and launch[nxt] <= now + eps:  # launched: queue in the group
            queues.setdefault(group[nxt], []).append(nxt)
            nxt += 1
        for g, q in queues.items():
            on = running.setdefault(g, [])
            while q and len(on) < lanes:
                i = q.pop(0)
                start[i] = now
                on.append(i)
        active = [i for on in running.values() for i in on]
        if not active and nxt == n:
            break
        rate = 1.0 / slowdown if now < backward_ms else 1.0
        # The link's share of each transfer (`share[i]` of the link): equal between the groups transferring (each
        # group is its own connection), and equal between a group's transfers.
        sending = {g: sum(1 for i in on if left[i][0] <= eps) for g, on in running.items()}
        groups_sending = sum(1 for k in sending.values() if k) or 1
        share = {i: 1.0 / (groups_sending * sending[g]) for g, on in running.items() for i in on
                 if left[i][0] <= eps}
        horizon = [launch[nxt] - now] if nxt < n else []
        if now < backward_ms and slowdown != 1.0:
            horizon.append(backward_ms - now)
        for i in active:
            horizon.append(left[i][0] / rate if i not in share else left[i][1] / (rate * share[i]))
        dt = max(0.0, min(horizon))
        for i in active:
            if i not in share:
                left[i][0] -= dt * rate
            else:
                left[i][1] -= dt * rate * share[i]
        now += dt
        for on in running.values():
            for i in [i for i in on if left[i][0] <= eps and left[i][1] <= eps]:
                end[i] = now
                on.remove(i)
    return Timeline(list(ready_ms), launch, start, end, backward_ms)


class ReadyCurve:
    """Milliseconds from the start of backward until the first `x` gradient elements (in ready order) are ready:
    piecewise linear through measured points, from (0, 0) to (all elements, end of backward)."""

    def __init__(self, points: list[tuple[float, float]], source: str):
        pts = sorted(points)
        xs, ts, t_max = [], [], 0.0
        for x, t in pts:
            t_max = max(t_max, t)  # gradients never become un-ready: keep the curve monotone
            if xs and x == xs[-1]:
                ts[-1] = t_max
            else:
                xs.append(x)
                ts.append(t_max)
        self.xs, self.ts, self.source = xs, ts, source

    @classmethod
    def uniform(cls, total: int, backward_ms: float) -> "ReadyCurve":
        return cls([(0, 0.0), (total, backward_ms)], "uniform over backward (assumed)")

    def at(self, x: float) -> float:
        i = bisect.bisect_left(self.xs, x)
        if i == 0:
            return self.ts[0]
        if i >= len(self.xs):
            return self.ts[-1]
        x0, x1, t0, t1 = self.xs[i - 1], self.xs[i], self.ts[i - 1], self.ts[i]
        return t0 + (t1 - t0) * (x - x0) / (x1 - x0)


def through(buckets, params) -> list[int]:
    """Per bucket: elements of all gradients up to and including its last member, in ready order. A bucket is
    ready when that many elements are, whatever else is still open in other classes' buckets."""
    pos = {name: i for i, (name, _) in enumerate(params)}
    prefix, acc = [], 0
    for _, p in params:
        acc += p.numel()
        prefix.append(acc)
    return [prefix[max(pos[n] for n in b.names)] for b in buckets]


# ---------------------------------------------------------------------------------------------------------------
# Runs and their profiled step


@dataclass
class StepProfile:
    """One synchronized step as the simulator uses it (ms)."""

    step: int
    data_ms: float
    forward_ms: float
    backward_ms: float  # all micro-batches
    optimizer_ms: float
    exposed_ms: float
    step_ms: float
    accum_steps: int = 1
    records: list[dict] = field(default_factory=list)  # buckets.jsonl rows of this step
    notes: list[str] = field(default_factory=list)

    @property
    def sync_backward_ms(self) -> float:
        """When the synchronized (last) micro-batch's backward ends, on the clock of the ready times: the
        reducer's clock starts at the first gradient hook, after the loss and generator backward, so it is when
        `wait()` started where the records say, else the trainer's backward time."""
        starts = [r["wait_start_ms"] for r in self.records if r.get("wait_start_ms") is not None]
        return max(starts) if starts else self.backward_ms / self.accum_steps

    @property
    def compute_ms(self) -> float:
        return self.data_ms + self.forward_ms + self.backward_ms + self.optimizer_ms


@dataclass
class Run:
    path: Path
    cfg: object  # RunConfig
    header: dict
    steps: list[dict]
    buckets: dict[int, list[dict]]  # rank 0's records by step
    # the other ranks' records by rank and step (`train.record_ranks`), each on its own rank's clock
    rank_buckets: dict[int, dict[int, list[dict]]] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return int(self.header.get("world_size") or 1)

    @property
    def vocab(self) -> int:
        return int(self.header.get("vocab") or self.cfg.data.vocab_size)

    @property
    def strategy(self) -> str:
        return self.cfg.sync.strategy


def load_run(path: str | Path) -> Run:
    from dtrain import config as config_mod
    from common.jsonl import read_jsonl
    from dtrain.log import rank_file

    p = Path(path)
    for f in ("config.yaml", "steps.jsonl"):
        if not (p / f).is_file():
            raise UserError(f"{p}: not a run directory (no {f})")
    cfg = config_mod.load(p / "config.yaml")
    try:
        header = json.loads((p / "run.json").read_text()) if (p / "run.json").is_file() else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{p}/run.json: not JSON ({e.__class__.__name__})") from e
    if not isinstance(header, dict):
        raise UserError(f"{p}/run.json: not a JSON object")
    steps = [s for s in read_jsonl(p / "steps.jsonl") if "step_ms" in s]
    if not steps:
        raise UserError(f"{p}/steps.jsonl: no step records")
    _check_numbers(steps, p / "steps.jsonl", STEP_FIELDS, ("data_ms", "comm_exposed_ms"))
    def by_step(rows):
        out: dict[int, list[dict]] = {}
        for r in rows:
            out.setdefault(int(r["step"]), []).append(r)
        return {k: sorted(v, key=lambda r: r["bucket"]) for k, v in out.items()}

    def buckets(path):
        rows = read_jsonl(path)
        _check_numbers(rows, path, BUCKET_FIELDS, BUCKET_TIMES)
        return by_step(rows)

    world = header.get("world_size") or 1
    if not isinstance(world, int) or world < 1:
        raise UserError(f"{p}/run.json: world_size must be a positive integer, not {world!r}")
    others = {rank: buckets(p / rank_file(rank)) for rank in range(1, world) if (p / rank_file(rank)).is_file()}
    return Run(p, cfg, header, steps, buckets(p / "buckets.jsonl"), others)


STEP_FIELDS = ("step", "step_ms", "forward_ms", "backward_ms", "optimizer_ms")
BUCKET_FIELDS = ("step", "bucket", "bytes")
BUCKET_TIMES = ("ready_ms", "launch_ms", "complete_ms", "wait_start_ms")  # null where not measured


def _check_numbers(rows: list[dict], path: Path, required: tuple, optional: tuple) -> None:
    """Records the simulator computes with: the `required` fields numbers, the `optional` ones numbers or null."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for k, row in enumerate(rows, 1):
        bad = [f for f in required if not number(row.get(f))]
        bad += [f for f in optional if row.get(f) is not None and not number(row[f])]
        if bad:
            raise UserError(f"{path}: record {k}: {', '.join(bad)} must be a number")


def slowest_rank_records(run: Run, step: int) -> tuple[list[dict], float | None]:
    """Rank 0's bucket records of `step`, with each bucket's ready and launch times the latest over the ranks whose
    records the run has (`train.record_ranks`): a collective cannot start before every rank has launched it. Each
    rank's clock starts at its own backward; it is put on rank 0's by the median, over buckets, of the difference
    in completion times (an all-reduce completes on every rank at about the same moment). Also returns the largest
    delay another rank added to a bucket's launch (ms), None where no other rank's records cover the step."""
    own = run.buckets.get(step, [])
    others = [recs[step] for recs in run.rank_buckets.values() if own and len(recs.get(step, [])) == len(own)]
    if not own or not others or any(r.get("complete_ms") is None or r.get("launch_ms") is None
                                    for recs in (own, *others) for r in recs):
        return own, None
    out = [dict(r) for r in own]
    delay = 0.0
    for recs in others:
        offset = statistics.median(a["complete_ms"] - b["complete_ms"] for a, b in zip(own, recs))
        for rec, theirs in zip(out, recs):
            for key in ("ready_ms", "launch_ms"):
                if theirs.get(key) is not None and rec.get(key) is not None:
                    later = theirs[key] + offset
                    if key == "launch_ms":
                        delay = max(delay, later - rec[key])
                    rec[key] = max(rec[key], later)
    return out, delay


def steady_steps(run: Run, warmup: int | None = None) -> list[dict]:
    """Steps after warm-up (default: the first max(3, 10 %) are dropped: allocation, re-planning, caches)."""
    n = len(run.steps)
    skip = warmup if warmup is not None else max(3, n // 10)
    kept = [s for s in run.steps[skip:] if not s.get("skipped")]
    if not kept:
        raise UserError(f"{run.path}: no steps left after skipping {skip} warm-up steps (it has {n})")
    return kept


def profiled_step(run: Run, step: int | None = None, warmup: int | None = None, median: bool = False
                  ) -> StepProfile:
    """The step to replay: `step`, or the most typical of the steady steps with bucket records (`typical_step`);
    with `median`, a synthetic step of the steady steps' medians, phase by phase and bucket time by bucket time
    (a steadier basis on a noisy machine than any single step)."""
    steady = steady_steps(run, warmup)
    if median:
        return _median_step(run, steady)
    if step is not None:
        chosen = next((s for s in run.steps if s["step"] == step), None)
        if chosen is None:
            raise UserError(f"{run.path}: no step {step} in steps.jsonl")
    else:
        chosen = typical_step(run, [s for s in steady if s["step"] in run.buckets] or steady)
    records, delay = slowest_rank_records(run, chosen["step"])
    prof = StepProfile(chosen["step"], chosen.get("data_ms", 0.0), chosen["forward_ms"], chosen["backward_ms"],
                       chosen["optimizer_ms"], chosen.get("comm_exposed_ms", 0.0), chosen["step_ms"],
                       run.cfg.train.accum_steps, records)
    if delay is not None:
        prof.notes.append(f"ready and launch times: the latest of {len(run.rank_buckets) + 1} ranks (the others "
                          f"delayed a launch by up to {max(0.0, delay):.1f} ms)")
    return _ddp_backward(run, prof)


TYPICAL_PHASES = ("forward_ms", "backward_ms", "comm_exposed_ms", "step_ms")


def typical_step(run: Run, pool: list[dict]) -> dict:
    """The step of `pool` nearest the run's medians in every part: the least sum of |ln(x / median)| over
    TYPICAL_PHASES, plus ln(1 + d / median backward) for d, how late another rank launched a bucket (where the
    ranks' records say). The step of median step time alone can be an outlier in its parts: on the testbed one had
    the other rank launching up to 241 ms late, so nothing overlapped backward and the calibration had nothing to
    fit; profiled on it, 9 pairs of configurations were ranked wrongly, on the most typical step 3."""
    med = {k: statistics.median(s.get(k) or 0.0 for s in pool) for k in TYPICAL_PHASES}

    def distance(s):
        d = sum(abs(math.log(max(s.get(k) or 0.0, 1e-3) / max(med[k], 1e-3))) for k in TYPICAL_PHASES)
        _, delay = slowest_rank_records(run, s["step"])
        return d + (math.log1p(max(0.0, delay) / max(med["backward_ms"], 1e-3)) if delay is not None else 0.0)

    return min(pool, key=distance)


def _median_step(run: Run, steady: list[dict]) -> StepProfile:
    med = lambda rows, k: statistics.median(r.get(k) or 0.0 for r in rows)  # noqa: E731
    prof = StepProfile(0, med(steady, "data_ms"), med(steady, "forward_ms"), med(steady, "backward_ms"),
                       med(steady, "optimizer_ms"), med(steady, "comm_exposed_ms"), med(steady, "step_ms"),
                       run.cfg.train.accum_steps)
    layouts = [slowest_rank_records(run, s["step"])[0] for s in steady if s["step"] in run.buckets]
    if layouts:
        shape = statistics.mode(tuple(r["numel"] for r in lay) for lay in layouts)
        layouts = [lay for lay in layouts if tuple(r["numel"] for r in lay) == shape]
        for i, first in enumerate(layouts[0]):
            rec = dict(first)
            for k in ("ready_ms", "launch_ms", "complete_ms", "wait_start_ms"):
                vals = [lay[i][k] for lay in layouts if lay[i].get(k) is not None]
                rec[k] = statistics.median(vals) if vals else None
            prof.records.append(rec)
    prof.notes.append(f"profile: medians of {len(steady)} steady steps ({len(layouts)} with bucket records)")
    return _ddp_backward(run, prof)


def _ddp_backward(run: Run, prof: StepProfile) -> StepProfile:
    """A DDP profile's backward without the communication DDP waits for inside it."""
    if run.strategy == "ddp":
        # DDP waits for its buckets inside backward(): its backward time holds exposed communication. The last
        # gradient's ready time is the end of the compute.
        readies = [r["ready_ms"] for r in prof.records if r.get("ready_ms") is not None]
        if readies:
            prof.backward_ms = max(readies) * prof.accum_steps
            prof.notes.append("ddp profile: backward compute taken as the last bucket's ready time")
        else:
            prof.notes.append("ddp profile without bucket timings: backward includes DDP's exposed communication")
    return prof


def ready_curve(run: Run, prof: StepProfile) -> ReadyCurve:
    """The profiled step's ready curve. Bucket positions come from re-planning the run's own strategy when that
    plan matches the recorded bucket sizes, else the buckets are taken as contiguous in ready order."""
    params = cm.ready_params(run.cfg, run.vocab)
    total = sum(p.numel() for _, p in params)
    recs = [r for r in prof.records if r.get("ready_ms") is not None]
    if not recs:
        prof.notes.append("no per-bucket ready times: gradients assumed ready uniformly over backward")
        return ReadyCurve.uniform(total, prof.sync_backward_ms)
    xs = None
    try:
        plan = cm.bucket_plan(run.cfg, vocab=run.vocab).buckets
        if [b.numel for b in plan] == [r["numel"] for r in prof.records]:
            by_index = dict(zip([b.index for b in plan], through(plan, params)))
            xs = [by_index[r["bucket"]] for r in recs]
    except (UserError, KeyError):
        pass
    source = "profiled step, bucket positions from the re-planned plan"
    if xs is None:
        acc, xs = 0, []
        for r in sorted(recs, key=lambda r: r["ready_ms"]):
            acc += r["numel"]
            xs.append(acc)
        recs = sorted(recs, key=lambda r: r["ready_ms"])
        source = "profiled step, buckets taken as contiguous in ready order"
    pts = [(0, 0.0)] + [(x, r["ready_ms"]) for x, r in zip(xs, recs)]
    pts.append((total, max(prof.sync_backward_ms, max(t for _, t in pts))))
    return ReadyCurve(pts, source)


@dataclass
class Calibration:
    """What the profiled step says about the cost model on this run: how much slower collectives run while
    backward computes (or, when none overlapped it, measured/modeled collective time), and the time `wait()`
    spends after the last collective."""

    comm_scale: float = 1.0
    post_ms: float = 0.0
    note: str = "none"
    slowdown: float = 1.0
    # CPU machines: what the profiled step's own collectives took from its backward (`host_ms` of its replay), which
    # its backward time already holds; a plan running more (or fewer) there costs the difference. None: not applied
    host_base_ms: float | None = None
    lanes: int = 1  # collectives at once per process group (`replay`): 1 for NCCL's single stream, 2 for gloo
    timeline: Timeline | None = field(default=None, repr=False)  # the profiled step's collectives, replayed


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


def calibrate(prof: StepProfile, model, host_cost: bool = False, lanes: int = 1, class_groups: bool = False
              ) -> Calibration:
    """`host_cost`: the run computed on the CPU, so collectives during backward take CPU time from it. `lanes`:
    collectives run at once per process group (see `replay`); `class_groups`: the profiled run sent each tensor
    class through its own group."""
    calib = _calibrate(prof, model, lanes, class_groups)
    if host_cost and calib.timeline is not None:
        base = host_ms(model, [r["bytes"] for r in prof.records], calib.timeline)
        if base is not None:
            calib.host_base_ms = base
            calib.note += (f"; backward lengthened by the collectives it overlaps, as the benchmark measured "
                           f"({base:.1f} ms for the profiled step's)")
    return calib


def _calibrate(prof: StepProfile, model, lanes: int, class_groups: bool) -> Calibration:
    """Replays the profiled step's own collectives (at their measured launch times, with the lanes the prediction
    uses) and fits what makes the replay match their measured completions."""
    recs = prof.records
    if not recs or any(r.get(k) is None for r in recs for k in ("launch_ms", "complete_ms")):
        return Calibration(note="none (the profiled step has no launch/complete times)", lanes=lanes)
    backward = prof.sync_backward_ms
    launch = [r["launch_ms"] for r in recs]
    work = [cost_ms(model, r["bytes"]) for r in recs]
    lat = [latency_ms(model, r["bytes"]) for r in recs]
    groups = [r.get("class") for r in recs] if class_groups and lanes > 1 else None
    ends = [r["complete_ms"] for r in recs]
    wait_start = recs[0].get("wait_start_ms")
    post = 0.0
    if wait_start is not None:
        post = max(0.0, prof.exposed_ms - max(0.0, max(ends) - wait_start))

    def replayed(k: float, scale: float = 1.0) -> Timeline:
        return replay(launch, [scale * w for w in work], backward, True, k, lanes, [scale * a for a in lat], groups)

    lanes_note = f", {lanes} collectives at once per process group" if lanes > 1 else ""
    if any(s < backward for s in replayed(1.0).start):
        # Fit the slowdown during backward (log-scale golden section on [1/4, 8]) to the measured completions.
        def err(log_k):
            return sum((e - m) ** 2 for e, m in zip(replayed(math.exp(log_k)).end, ends))

        lo, hi = math.log(0.25), math.log(8.0)
        g = (math.sqrt(5) - 1) / 2
        for _ in range(60):
            a, b = hi - g * (hi - lo), lo + g * (hi - lo)
            lo, hi = (lo, b) if err(a) < err(b) else (a, hi)
        k = math.exp((lo + hi) / 2)
        return Calibration(1.0, post, f"collectives x{k:.3f} slower while backward computes (fitted to the "
                                      f"{len(recs)} completions of the profiled step{lanes_note}), +{post:.2f} ms "
                                      f"after the last collective", slowdown=k, lanes=lanes, timeline=replayed(k))
    measured = Timeline(launch, launch, launch, ends, backward).comm_ms  # busy from first launch to last completion
    modeled = replayed(1.0).comm_ms
    scale = measured / modeled if modeled > 0 else 1.0
    return Calibration(scale, post, f"comm x{scale:.3f} (measured {measured:.2f} ms / modeled {modeled:.2f} ms, "
                                    f"none overlapped backward{lanes_note}), +{post:.2f} ms after the last "
                                    f"collective", lanes=lanes, timeline=replayed(1.0, scale))


# ---------------------------------------------------------------------------------------------------------------
# Predictions


def cost_ms(model, nbytes: int, algo: str | None = None, proto: str | None = None) -> float:
    """One all-reduce (ms); a preset honours a class's forced NCCL choice, a gloo fit has none to honour."""
    if isinstance(model, cm.NcclModel):
        return model.time_us(nbytes, "allreduce", algo=algo, proto=proto) / 1000.0
    return model.time_us(nbytes, "allreduce") / 1000.0


def latency_ms(model, nbytes: int) -> float:
    """The part of `cost_ms` that does not use the link (a fit's latency term), where the model separates it: with
    several collectives in flight only the rest shares the bandwidth. 0 where it does not (all of it shared)."""
    if not isinstance(model, cm.FittedModel):  # NCCL's models: one stream, nothing to share
        return 0.0
    return model.latency_us(nbytes, "allreduce") / 1000.0


@dataclass
class Prediction:
    strategy: str
    cap_mb: float | None
    buckets: int
    comm_ms: float
    exposed_ms: float
    step_ms: float
    lossless: bool = True
    communicates: bool = True
    measured_step_ms: float | None = None
    measured_exposed_ms: float | None = None
    measured_ci: tuple[float, float] | None = None  # interval of the measured median (see `measured_runs`)
    measured_optimizer_ms: float | None = None  # the optimizer step: compute only, a probe of the machine's speed
    measured_runs: int = 0
    # steady step times keyed by (the run's parent folder, step): configurations of one interleaved job
    # (`analysis.interleave`) share keys, and a pair of them is compared step by step, paired
    samples: dict = field(default_factory=dict, repr=False)
    speed: float | None = None  # median over its runs of (run's forward / profiled run's forward): machine speed
    adjusted_step_ms: float | None = None  # measured, each run scaled to the profiled run's machine speed
    adjusted_ci: tuple[float, float] | None = None
    run: str | None = None

    @property
    def label(self) -> str:
        return self.strategy + (f"@{self.cap_mb:g}M" if self.cap_mb is not None else "")


def requested_nccl(cfg, class_groups: bool):
    """bucket -> (algo, proto) as the run would request them (None: NCCL decides): a class's own settings where
    each class has its communicator (`collectives.nccl.resolve`), else `collectives.default` for every bucket."""
    from collectives import nccl

    cache: dict = {}

    def of(bucket):
        name = bucket.tensor_class if class_groups else None
        if name not in cache:
            s = nccl.resolve(cfg, name) if name else cfg.collectives.default
            cache[name] = (s.algo, s.proto)
        return cache[name]

    return of


def predict(cfg, prof: StepProfile, curve: ReadyCurve, model, calib: Calibration, strategy: str,
            cap_mb: float | None = None, vocab: int | None = None, classes: dict | None = None,
            cost=None, nccl_of=None) -> Prediction:
    """Predicted step of `cfg`'s model under `strategy` (bucket cap, per-class overrides), replayed on the profiled
    step. `cost(nbytes, algo, proto) -> ms` replaces the model's cost of one all-reduce; `nccl_of(bucket)` gives
    the (algo, proto) a bucket is forced to (default: what the profile requests)."""
    if strategy == "powersgd":
        raise UserError("powersgd is lossy and sends low-rank factors, not buckets: not simulated")
    compute = prof.compute_ms
    if strategy == "noop":
        return Prediction("noop", None, 0, 0.0, 0.0, compute - (calib.host_base_ms or 0.0), lossless=False,
                          communicates=False)
    plan, overlap, class_groups = cm.bucket_plan(cfg, strategy, bucket_cap_mb=cap_mb, classes=classes, vocab=vocab)
    params = cm.ready_params(cfg, vocab)
    ready = [curve.at(x) for x in through(plan, params)]
    one = cost or (lambda n, a, p: cost_ms(model, n, a, p))
    nccl_of = nccl_of or requested_nccl(cfg, class_groups)
    dur = [calib.comm_scale * one(b.nbytes, *nccl_of(b)) for b in plan]
    lat = [calib.comm_scale * latency_ms(model, b.nbytes) for b in plan] if cost is None else None
    groups = [b.tensor_class for b in plan] if class_groups and calib.lanes > 1 else None
    tl = replay(ready, dur, prof.sync_backward_ms, overlap, calib.slowdown, calib.lanes, lat, groups)
    exposed = tl.exposed_ms + calib.post_ms
    if calib.host_base_ms is not None:  # more collectives during backward than the profiled step: slower compute
        compute += host_ms(model, [b.nbytes for b in plan], tl) - calib.host_base_ms
    lossless = all(b.settings.wire_dtype == "fp32" for b in plan)
    return Prediction(strategy, cap_mb if strategy in CAPPED else None, len(plan), tl.comm_ms, exposed,
                      compute + exposed, lossless)


def sweep(cfg, prof, curve, model, calib, strategies, caps, vocab=None) -> list[Prediction]:
    out = []
    for s in strategies:
        for cap in (caps if s in CAPPED else (None,)):
            out.append(predict(cfg, prof, curve, model, calib, s, cap, vocab))
    return out


def median_ci(values: list[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free ~95% confidence interval of the median: the order statistics n/2 ± z·√n/2."""
    v = sorted(values)
    n = len(v)
    half = z * math.sqrt(n) / 2
    return v[max(0, math.floor(n / 2 - half))], v[min(n - 1, math.ceil(n / 2 + half) - 1)]


def run_level(values: list[float]) -> tuple[float, tuple[float, float]]:
    """The median of per-run medians and its interval: the lowest to the highest run median. With repeats, runs
    are the independent units: steps of one run share the machine's state of those minutes (this machine's speed
    drifts by 20-30 % over minutes), so intervals from pooled steps would be far too narrow. For n runs the range
    holds the true median with probability 1 - 2·0.5^n (75 % for 3, 94 % for 5)."""
    return statistics.median(values), (min(values), max(values))


def measured_runs(measured: list[Run], prof_run: Run, prof: StepProfile, curve: ReadyCurve, model, calib: Calibration,
                  warmup: int | None) -> list[Prediction]:
    """For each measured configuration: the median steady step and exposed time, next to the prediction for its own
    configuration (same strategy, caps and classes) replayed on the profiled step. Runs of the same resolved profile
    (repeats, e.g. the rounds of a sweep run into several folders) are taken together: the median of their run
    medians, with the range of run medians as its interval (`run_level`); one run: its steps' median and the order-
    statistics interval.

    Each is also given speed-adjusted: every run's step time scaled by the profiled run's median forward over its
    own. The forward pass does identical work under every strategy (same seed, same batches, no communication), so
    that ratio is the machine's speed during the run relative to the profiled run; the adjusted figure asks whether
    the model is right about communication and overlap when the machine's drift is taken out. It is a correction of
    the measurement, labelled as such, not a fit: nothing in the model changes. It holds only where the forward pass
    is untouched by the strategy: on a CPU machine whose speed drifts, yes; with two ranks time-slicing one GPU, no
    (the other rank's collectives take the GPU's time slices, and the forward time then measures that)."""
    groups: dict[str, list[Run]] = {}
    for run in measured:
        groups.setdefault(run.cfg.config_hash(), []).append(run)
    ref_forward = statistics.median(s["forward_ms"] for s in steady_steps(prof_run, warmup))
    out = []
    for runs in groups.values():
        cfg = runs[0].cfg
        per_run = [steady_steps(run, warmup) for run in runs]
        cap = cfg.sync.bucket_cap_mb
        pred = predict(cfg, prof, curve, model, calib, runs[0].strategy, cap, prof_run.vocab)
        pred.cap_mb = cap if runs[0].strategy in CAPPED else None
        medians = [statistics.median(s["step_ms"] for s in steady) for steady in per_run]
        speeds = [statistics.median(s["forward_ms"] for s in steady) / ref_forward for steady in per_run]
        adjusted = [m / k for m, k in zip(medians, speeds)]
        if len(runs) > 1:
            pred.measured_step_ms, pred.measured_ci = run_level(medians)
            pred.adjusted_step_ms, pred.adjusted_ci = run_level(adjusted)
        else:
            steps = [s["step_ms"] for s in per_run[0]]
            pred.measured_step_ms, pred.measured_ci = statistics.median(steps), median_ci(steps)
            pred.adjusted_step_ms = adjusted[0]
            pred.adjusted_ci = tuple(v / speeds[0] for v in pred.measured_ci)
        pred.speed = statistics.median(speeds)
        pred.measured_runs = len(runs)
        pred.samples = {(str(run.path.parent), s["step"]): s["step_ms"] for run, rows in zip(runs, per_run)
                        for s in rows}
        steady = [s for rows in per_run for s in rows]
        pred.measured_exposed_ms = statistics.median(s.get("comm_exposed_ms", 0.0) for s in steady)
        pred.measured_optimizer_ms = statistics.median(s["optimizer_ms"] for s in steady)
        pred.run = str(runs[0].path) if len(runs) == 1 else f"{len(runs)} runs: " + ", ".join(
            str(r.path) for r in runs)
        out.append(pred)
    return out


def speed_probe(prof: StepProfile, measured: list[Prediction]) -> str:
    """Forward and optimizer do the same local compute under every strategy: when their time differs between the
    profiled run and the measured runs, the machine's speed changed between them, and that shows up as error."""
    opt = [r.measured_optimizer_ms for r in measured]
    speeds = [r.speed for r in measured if r.speed is not None]
    return (f"machine-speed probes (compute only, the same work in every run): optimizer step profiled "
            f"{prof.optimizer_ms:.1f} ms, measured configurations {min(opt):.1f}-{max(opt):.1f} ms; forward relative "
            f"to the profiled run's {min(speeds):.2f}-{max(speeds):.2f}x; a drift in the machine's speed between "
            "the runs shows up as prediction error")


@dataclass
class Ranking:
    """Predicted against measured order, pair by pair. A pair is a tie, and cannot disagree, when the measured
    medians' confidence intervals overlap (measurement cannot order them) or the predictions are within
    `PREDICTED_TIE` of each other (the model does not order them)."""

    pairs: int
    ties: int
    discordant: list[tuple[str, str]]

    @property
    def agrees(self) -> bool:
        return not self.discordant


PREDICTED_TIE = 0.005  # relative


MIN_PAIRED = 10  # common steps for a paired comparison


def paired(a: Prediction, b: Prediction) -> tuple[float, float, float] | None:
    """Configurations measured in the same interleaved job(s) ran each step within seconds of each other: the
    median of their step-by-step differences (a - b, ms) and its ~95% order-statistics interval; the machine's drift
    cancels in each difference. None when they share fewer than `MIN_PAIRED` steps."""
    common = a.samples.keys() & b.samples.keys()
    if len(common) < MIN_PAIRED:
        return None
    diffs = [a.samples[k] - b.samples[k] for k in common]
    return (statistics.median(diffs), *median_ci(diffs))


def ranking(rows: list[Prediction], adjusted: bool = False) -> Ranking:
    """Pairwise order of predictions against measurement: for configurations of one interleaved job, their paired
    step differences (a pair is separated when the interval of the median difference excludes 0); otherwise their
    medians' intervals (the speed-adjusted ones with `adjusted`), separated when they do not overlap."""
    def value(r):
        return (r.adjusted_step_ms, r.adjusted_ci) if adjusted else (r.measured_step_ms, r.measured_ci)

    m = [r for r in rows if value(r)[0] is not None]
    pairs, ties, bad = 0, 0, []
    for i, a in enumerate(m):
        for b in m[i + 1:]:
            pairs += 1
            (va, ci_a), (vb, ci_b) = value(a), value(b)
            diff = None if adjusted else paired(a, b)
            if diff is not None:
                separated, a_faster = diff[1] > 0 or diff[2] < 0, diff[0] < 0
            else:
                lo_a, hi_a = ci_a or (va, va)
                lo_b, hi_b = ci_b or (vb, vb)
                separated, a_faster = not (lo_a <= hi_b and lo_b <= hi_a), va < vb
            if not separated or abs(a.step_ms - b.step_ms) <= PREDICTED_TIE * min(a.step_ms, b.step_ms):
                ties += 1
            elif (a.step_ms < b.step_ms) != a_faster:
                bad.append((a.label, b.label))
    return Ranking(pairs, ties, bad)


# ---------------------------------------------------------------------------------------------------------------
# The paper's base configuration, projected

# Vendor datasheet peaks of the SXM parts: dense TFLOPS for fp32 (no tensor cores; PyTorch's default for fp32
# matmuls) and for bf16 autocast (tensor cores; P100 has none: fp16 without tensor cores stands in, V100 has no
# bf16: its fp16 tensor cores stand in), and HBM GB/s. The projection's compute side rests on these and an assumed
# fraction of peak.
GPU_PEAK = {"P100": {"fp32": 10.6, "bf16": 21.2, "hbm": 732.0}, "V100": {"fp32": 15.7, "bf16": 125.0, "hbm": 900.0},
            "A100": {"fp32": 19.5, "bf16": 312.0, "hbm": 2039.0}, "H100": {"fp32": 67.0, "bf16": 989.0, "hbm": 3350.0}}
PAPER_STEP_S = 0.4  # "each training step took about 0.4 seconds" (base model, 8 P100), Vaswani et al. 2017 §5.2
PAPER_TOKENS = 25_000  # source and target tokens per step, each (§5.1)


def flop_step(cfg, topo: cm.Topology, src_tokens: float, tgt_tokens: float, vocab: int | None = None,
              mfu: float = 0.3, sentence_len: int = 27) -> tuple[StepProfile, ReadyCurve, list[str]]:
    """A step of `cfg`'s model on one of the topology's GPUs, from a FLOP count at `mfu` of its peak (fp32, or
    bf16 under autocast), for `src_tokens` + `tgt_tokens` per GPU; gradients ready uniformly over backward."""
    if topo.gpu not in GPU_PEAK:
        raise UserError(f"no peak figures for {topo.gpu} (known: {', '.join(GPU_PEAK)})")
    if not 0 < mfu <= 1:
        raise UserError("the fraction of peak (--mfu) must be in (0, 1]")
    params = cm.ready_params(cfg, vocab)
    enc = sum(p.numel() for n, p in params if n.startswith("encoder"))
    dec = sum(p.numel() for n, p in params if n.startswith("decoder"))
    emb = sum(p.numel() for n, p in params if n.startswith("embed"))
    total = sum(p.numel() for _, p in params)
    d, n_layers = cfg.model.d_model, cfg.model.N
    # Forward FLOPs: 2 per weight per token through the layers and the tied generator, plus attention scores and
    # their weighted sum (4·T·d per token, layer and attention block) at an assumed sentence length.
    attn = 4 * sentence_len * d * n_layers * (src_tokens + 2 * tgt_tokens)
    fwd = 2 * (enc * src_tokens + (dec + emb) * tgt_tokens) + attn
    precision = "bf16" if cfg.train.amp == "bf16" else "fp32"
    peak_tflops, hbm = GPU_PEAK[topo.gpu][precision], GPU_PEAK[topo.gpu]["hbm"]
    rate = peak_tflops * 1e12 * mfu
    forward_ms, backward_ms = 1e3 * fwd / rate, 1e3 * 2 * fwd / rate
    optimizer_ms = 1e3 * total * 28 / (hbm * 1e9)  # Adam: ~7 fp32 reads/writes per parameter, memory-bound
    prof = StepProfile(0, 0.0, forward_ms, backward_ms, optimizer_ms, 0.0, 0.0)
    notes = [f"{total / 1e6:.1f}M parameters; {src_tokens:.0f} source + {tgt_tokens:.0f} target tokens per GPU "
             f"per step",
             f"compute from FLOPs: {3 * fwd / 1e12:.2f} TFLOP per GPU per step (forward x3) at {mfu:.0%} of the "
             f"{topo.gpu}'s {peak_tflops:g} TFLOPS {precision} peak (assumed), sentences of {sentence_len} tokens (assumed)",
             f"optimizer: Adam, memory-bound at {hbm:g} GB/s; gradients ready uniformly over backward (assumed)"]
    return prof, ReadyCurve.uniform(total, backward_ms), notes


def flop_timeline(cfg, topo: cm.Topology, vocab: int | None = None, mfu: float = 0.3) -> tuple:
    """(StepProfile, ReadyCurve, Calibration, notes) for a profile on a preset without a profiled run: each GPU
    takes `data.max_tokens` x `train.accum_steps` tokens per side (the batch cap: an upper bound)."""
    tokens = cfg.data.max_tokens * cfg.train.accum_steps
    prof, curve, notes = flop_step(cfg, topo, tokens, tokens, vocab, mfu)
    return prof, curve, Calibration(note="none (modeled compute)"), ["timeline estimated, not profiled:", *notes]


def paper_profile(topo: cm.Topology, vocab: int = 37000, mfu: float = 0.3) -> tuple:
    """(cfg, StepProfile, ReadyCurve, notes, implied fraction of peak) for the paper's base model at 25,000 +
    25,000 tokens per step over the topology's GPUs."""
    from dtrain import config as config_mod

    cfg = config_mod.from_dict({"model": {"preset": "base"}, "data": {"vocab_size": vocab}}, "<paper base>")
    per_gpu = PAPER_TOKENS / topo.ranks
    prof, curve, notes = flop_step(cfg, topo, per_gpu, per_gpu, vocab, mfu)
    # The fraction of peak at which forward + backward alone would take the paper's whole step.
    implied = mfu * (prof.forward_ms + prof.backward_ms) / (PAPER_STEP_S * 1000)
    notes = [f"the paper's base model (vocab {vocab}, shared BPE), {PAPER_TOKENS} source + {PAPER_TOKENS} target "
             f"tokens per step over {topo.ranks} GPUs", *notes]
    return cfg, prof, curve, notes, implied


# ---------------------------------------------------------------------------------------------------------------
# Command line


@dataclass
class EveryStep:
    """The check against measurement repeated with each steady step of the profiled run as the profiled step: how
    much the verdict depends on which step was profiled."""

    steps: int
    max_err: list[float]  # per profiled step: the largest |error| over the measured configurations, %
    discordant: list[int]  # per profiled step: pairs ordered differently
    separated: list[int]  # per profiled step: pairs measurement and model both order
    frequent: list[tuple[str, str, int]]  # the discordant pairs, with how many profiled steps they are discordant in

    def lines(self) -> list[str]:
        e, d = sorted(self.max_err), self.discordant
        return [f"every steady step of the profiled run as the profiled step ({self.steps}): max |err| median "
                f"{statistics.median(e):.1f}% (range {e[0]:.1f}-{e[-1]:.1f}%), within 15% for "
                f"{sum(x <= 15 for x in e)}; discordant pairs mean {statistics.mean(d):.2f} (none for "
                f"{sum(x == 0 for x in d)}, at most one for {sum(x <= 1 for x in d)}) of "
                f"{statistics.median(self.separated):g} separated (median)",
                *(f"  discordant with {n} of {self.steps} profiled steps: {a} vs {b}" for a, b, n in self.frequent[:5])]


def every_step(run: Run, model, measured: list[Run], host_cost: bool, lanes: int,
               warmup: int | None) -> EveryStep:
    """`EveryStep` over the profiled run's steady steps that have bucket records."""
    class_groups = cm.bucket_plan(run.cfg).class_groups
    errs, disc, sep, count = [], [], [], {}
    for s in steady_steps(run, warmup):
        if not run.buckets.get(s["step"]):
            continue
        prof = profiled_step(run, s["step"], warmup)
        curve = ready_curve(run, prof)
        calib = calibrate(prof, model, host_cost, lanes, class_groups)
        rows = measured_runs(measured, run, prof, curve, model, calib, warmup)
        rk = ranking(rows)
        errs.append(max(abs(_error_pct(r.step_ms, r.measured_step_ms)) for r in rows))
        disc.append(len(rk.discordant))
        sep.append(rk.pairs - rk.ties)
        for pair in rk.discordant:
            count[pair] = count.get(pair, 0) + 1
    if not errs:
        raise UserError(f"{run.path}: no steady step with bucket records to profile")
    frequent = sorted(((a, b, n) for (a, b), n in count.items()), key=lambda t: -t[2])
    return EveryStep(len(errs), errs, disc, sep, frequent)


def _error_pct(predicted: float, measured: float) -> float:
    return 100 * (predicted - measured) / measured


def _summary(m: list[Prediction], adjusted: bool) -> list[str]:
    values = [r.adjusted_step_ms if adjusted else r.measured_step_ms for r in m]
    errs = [abs(_error_pct(r.step_ms, v)) for r, v in zip(m, values)]
    rk = ranking(m, adjusted)
    what = ("speed-adjusted (each run scaled to the profiled run's machine speed by its forward time)" if adjusted
            else "against measurement")
    out = [f"# {what}: max |err| {max(errs):.1f}% (mean {statistics.mean(errs):.1f}%), same ranking: "
           f"{'yes' if rk.agrees else 'no'} ({rk.pairs} pairs, {rk.ties} ties: measurement does not separate them "
           f"or predictions within {PREDICTED_TIE:.1%})"]
    out += [f"#   ordered differently: {a} vs {b}" for a, b in rk.discordant]
    return out


def format_rows(rows: list[Prediction], header: list[str]) -> str:
    lines = [f"# {h}" for h in header]
    has_meas = any(r.measured_step_ms is not None for r in rows)
    head = (f"{'strategy':>16} {'buckets':>7} {'comm ms':>9} {'exposed ms':>10} {'step ms':>9}")
    if has_meas:
        head += (f" {'meas. step':>10} {'interval':>9} {'err %':>6} {'meas. exp.':>10} {'speed':>5} "
                 f"{'adj. step':>9} {'adj. int.':>9} {'err %':>6}  runs")
    lines.append(head + "   (modeled)")
    for r in rows:
        ln = f"{r.label:>16} {r.buckets:>7} {r.comm_ms:9.2f} {r.exposed_ms:10.2f} {r.step_ms:9.2f}"
        if r.measured_step_ms is not None:
            lo, hi = r.measured_ci or (r.measured_step_ms,) * 2
            alo, ahi = r.adjusted_ci or (r.adjusted_step_ms,) * 2
            ln += (f" {r.measured_step_ms:10.2f} {f'{lo:.0f}-{hi:.0f}':>9} "
                   f"{_error_pct(r.step_ms, r.measured_step_ms):6.1f} {r.measured_exposed_ms:10.2f} {r.speed:5.2f} "
                   f"{r.adjusted_step_ms:9.2f} {f'{alo:.0f}-{ahi:.0f}':>9} "
                   f"{_error_pct(r.step_ms, r.adjusted_step_ms):6.1f}  {r.run}")
        if not r.lossless:
            ln += "  (lossy)" if r.communicates else "  (no communication: headroom only)"
        lines.append(ln)
    best = min((r for r in rows if r.lossless and r.communicates and r.run is None),
               key=lambda r: (round(r.step_ms, 2), r.comm_ms), default=None)  # ties: less traffic
    if best:
        lines.append(f"# best lossless choice (modeled): {best.label}, {best.step_ms:.2f} ms per step")
    if has_meas:
        m = [r for r in rows if r.measured_step_ms is not None]
        lines.append("# interval: the range of run medians with repeated runs, else the ~95% order-statistics "
                     "interval of one run's median; speed: the run's forward time over the profiled run's")
        interleaved = all(paired(a, b) is not None for i, a in enumerate(m) for b in m[i + 1:])
        if interleaved:
            lines.append("# every pair ran interleaved (analysis.interleave): pairs are separated by their step-by-"
                         "step differences, and no speed adjustment is needed (the drift hits all alike)")
        lines += _summary(m, adjusted=False) + ([] if interleaved else _summary(m, adjusted=True))
    return "\n".join(lines)


def _parse_list(text: str, kind=str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise UserError(f"bad list '{text}': {e}") from e



def main(argv=None) -> None:
    ap = ArgumentParser(prog=f"python -m {PROG}",
                        description="Predict step time and exposed communication per strategy and bucket size from "
                                    "one profiled step and a cost model (modeled, not measured).")
    ap.add_argument("--run", help="a run directory (config.yaml, run.json, steps.jsonl, buckets.jsonl)")
    ap.add_argument("--topology", help="cost model: a preset (h100x8 ...) or local:<bench.csv|json|fit.json>")
    ap.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES))
    ap.add_argument("--bucket-sizes", default=",".join(f"{c:g}" for c in DEFAULT_CAPS_MB), help="MiB, comma list")
    ap.add_argument("--step", type=int, help="the step to replay (default: the most typical steady step)")
    ap.add_argument("--median", action="store_true", help="replay the medians of the steady steps instead of one")
    ap.add_argument("--warmup", type=int, help="steps dropped as warm-up (default max(3, 10%%))")
    ap.add_argument("--no-calibrate", action="store_true", help="do not scale the model by the profiled step")
    ap.add_argument("--no-host-cost", action="store_true",
                    help="CPU runs: do not charge what collectives take from the backward they overlap (applied by "
                         "default when the benchmark measured it: collectives.bench --overlap)")
    ap.add_argument("--lanes", type=int, help="collectives in flight at once per process group (default: "
                    f"{GLOO_LANES} for a gloo run with a fitted model, as ProcessGroupGloo's threads; 1 otherwise)")
    ap.add_argument("--measured", nargs="*", default=[], help="runs to compare against (their own configs)")
    ap.add_argument("--every-step", action="store_true",
                    help="with --measured: repeat the check with each steady step as the profiled step and summarize")
    ap.add_argument("--paper", action="store_true", help="project the paper's base configuration (8 P100)")
    ap.add_argument("--mfu", type=float, default=0.3, help="--paper: assumed fraction of the GPU's fp32 peak")
    ap.add_argument("--json", action="store_true")
    with exit_on_user_error(PROG):
        _main(ap.parse_args(argv))


def default_lanes(backend: str, model) -> int:
    """gloo runs GLOO_LANES collectives at once per process group, which a fit to its benchmark models; NCCL's
    models (a preset, or the table NCCL logged) are one stream."""
    return GLOO_LANES if backend == "gloo" and isinstance(model, cm.FittedModel) else 1


def _main(args) -> None:
    if args.lanes is not None and args.lanes < 1:
        raise UserError("--lanes must be at least 1")
    if args.every_step and (args.paper or not args.measured):
        raise UserError("--every-step repeats the check against --measured runs: give --run and --measured")
    if args.warmup is not None and args.warmup < 0:
        raise UserError("--warmup must be at least 0")
    if args.median and args.step is not None:
        raise UserError("--median replays the medians of the steady steps, --step one step: give one of them")
    strategies = _parse_list(args.strategies)
    if not strategies:
        raise UserError("--strategies: give at least one strategy")
    caps = _parse_list(args.bucket_sizes, float)
    if not caps or any(not math.isfinite(c) or c <= 0 for c in caps):
        raise UserError("--bucket-sizes must be positive, finite numbers (MiB)")
    if args.paper:
        topo = cm.topology(args.topology or "p100x8")
        model = cm.NcclModel(topo)
        cfg, prof, curve, notes, implied = paper_profile(topo, mfu=args.mfu)
        rows = sweep(cfg, prof, curve, model, Calibration(), strategies, caps)
        header = ["MODELED projection of the paper's base configuration (no measurement)", *notes, *model.header(),
                  f"paper: {PAPER_STEP_S} s per step; at that step time the compute alone implies {implied:.0%} of "
                  f"fp32 peak"]
    else:
        if not args.run or not args.topology:
            raise UserError("give --run and --topology (or --paper)")
        run = load_run(args.run)
        model = cm.load_model(args.topology)
        if model.ranks and run.world > 1 and model.ranks != run.world:
            print(f"# note: the cost model has {model.ranks} ranks, the run {run.world}", file=sys.stderr)
        prof = profiled_step(run, args.step, args.warmup, args.median)
        curve = ready_curve(run, prof)
        on_cpu = str(run.header.get("device", "cpu")).startswith("cpu")
        lanes = args.lanes or default_lanes(str(run.header.get("backend", "gloo")), model)
        class_groups = cm.bucket_plan(run.cfg).class_groups
        host_cost = on_cpu and not args.no_host_cost
        calib = (Calibration(note="off", lanes=lanes) if args.no_calibrate
                 else calibrate(prof, model, host_cost, lanes, class_groups))
        rows = sweep(run.cfg, prof, curve, model, calib, strategies, caps, run.vocab)
        measured_dirs = [load_run(p) for p in args.measured]
        measured = measured_runs(measured_dirs, run, prof, curve, model, calib, args.warmup)
        rows += measured
        which = "medians of its steady steps" if args.median else f"step {prof.step}"
        header = [f"MODELED from run {run.path} (strategy {run.strategy}, world {run.world}), {which}: "
                  f"data {prof.data_ms:.1f} + forward {prof.forward_ms:.1f} + backward {prof.backward_ms:.1f} + "
                  f"optimizer {prof.optimizer_ms:.1f} ms (measured {prof.step_ms:.1f} ms, exposed "
                  f"{prof.exposed_ms:.1f})", f"ready times: {curve.source}", f"calibration: {calib.note}",
                  *model.header(), *prof.notes]
        if measured:
            header.append(speed_probe(prof, measured))
        if args.every_step:
            robust = every_step(run, model, measured_dirs, host_cost, lanes, args.warmup)
    if args.json:
        doc = {"modeled": True, "notes": header,
               "rows": [{k: v for k, v in vars(r).items() if k != "samples"} | {"label": r.label} for r in rows]}
        if any(r.measured_step_ms is not None for r in rows):
            for key, adjusted in (("ranking", False), ("ranking_adjusted", True)):
                rk = ranking(rows, adjusted)
                doc[key] = dataclasses.asdict(rk) | {"agrees": rk.agrees}
        if args.every_step:
            doc["every_step"] = dataclasses.asdict(robust)
        print(json.dumps(doc, indent=1))
    else:
        print(format_rows(rows, header))
        if args.every_step:
            print("\n".join("# " + ln for ln in robust.lines()))


if __name__ == "__main__":
    main()
