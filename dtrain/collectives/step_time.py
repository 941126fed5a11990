"""The one step-time predictor: a strategy's schedule (`dtrain.collectives.schedule`) played on a step's compute.

MODELED throughout. `auto`'s pruning (`dtrain.collectives.auto.predict`, on the job's own probe and in-job network
fit) and the simulator (`dtrain.analysis.simulate`, on a recorded reference step and a benchmark fit or NCCL's model)
both call `predict`; neither knows which strategy a schedule is.

The step is the basis's compute (`Basis`), plus:
- the collectives issued in backward, played on `dtrain.collectives.timeline` from the moment each is ready (a
  gradient, a split embedding's projection part, a lookup's rows, FSDP2's prefetch), in launch order: what is still
  running when backward ends is exposed, and where the model measured it (`FittedModel.host_us`), the computation
  they take from backward on a CPU machine;
- the all-gathers the next forward waits for, each at the first module that reads it (`timeline.gather_stall`),
  with their host cost;
- a collective waited for on the computing thread (`Collective.blocking`: stock FSDP2 without device streams)
  added whole;
- less the optimizer work a rank no longer does on parameters it does not own (`Schedule.updated`);
- the host work the strategy adds on the computing thread (`Schedule.host`: FSDP2's copies and its optimizer over
  DTensors, a comm hook's casts), as the benchmark timed each on the machine (`--host-work`), less the basis's own.

A collective's cost: an all-reduce, the model's (`played_ms`: never faster than its bytes at the link's rate);
point-to-point exchanges and torch's reduce-scatter or all-gather, their latency and half the rest of an all-reduce
of their bytes, times what they put on a node's link (`p2p_load`); torch's own where the benchmark measured that
collective (`--collective`); the hierarchical plan's, its three levels (`hierarchical_ms`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.collectives.costmodel.played import host_ms, lockstep, off_link_ms, played_ms
from dtrain.collectives.schedule import (ALL_GATHER, ALL_REDUCE, BACKWARD, EXCHANGE, HIERARCHICAL, LOOKUP,
                                         FORWARD_START, LOOKUP_GROUP, P2P, PREFETCH, PROJECTION, STEP, TORCH,
                                         Schedule)
from dtrain.collectives.timeline import ReadyCurve, Timeline, gather_stall, play_timeline


@dataclass
class Calibration:
    """How the collectives of the machine the prediction is for run beside its compute: measured on a reference
    step (`dtrain.analysis.simulate.calibration`), or the defaults (none) for `auto`'s probe."""

    comm_scale: float = 1.0  # measured over modeled collective time, when none overlapped backward
    post_ms: float = 0.0  # what `wait()` spends after the last collective completes
    note: str = "none"
    slowdown: float = 1.0  # collectives run this many times slower while backward computes
    # CPU machines: what the reference step's own collectives took from its backward (`host_ms` of its timeline),
    # which its backward time already holds; a schedule running more (or fewer) there costs the difference. None:
    # not applied
    host_base_ms: float | None = None
    lanes: int = 1  # collectives at once per process group (`play_timeline`): 1 for NCCL's single stream, 2 for gloo
    # The device has streams on which a collective runs beside the computing thread (CUDA). On a CPU device a
    # collective waited for on the computing thread (`Collective.blocking`, stock FSDP2's) adds up to the step.
    streams: bool = True
    timeline: Timeline | None = field(default=None, repr=False)  # the reference step's collectives, played again


@dataclass
class Basis:
    """The compute a schedule is played on (ms): a recorded reference step's, or `auto`'s probe."""

    compute_ms: float  # the whole step without exposed communication: data, forward, backward, optimizer
    forward_ms: float  # one micro-batch's forward: the one the all-gathers delay
    backward_ms: float  # when the synchronized backward ends, on the clock of the ready times
    optimizer_ms: float
    curve: ReadyCurve  # gradient elements ready -> ms
    split_ready_ms: float = 0.0  # when a split embedding's projection part is ready
    compute_end_ms: float | None = None  # when the last rank's backward ends, where ranks share cores
    lookup_rows: list[tuple[float, int]] = field(default_factory=list)  # a split's lookups: (ready ms, bytes)
    split_cost_ms: float = 0.0  # what the split's own work cost `compute_ms`, out of a schedule without it
    host_work_ms: float = 0.0  # what the basis's own strategy's host work cost `compute_ms` (`host_work_ms`)


@dataclass
class Played:
    buckets: int
    comm_ms: float  # time with a collective running
    exposed_ms: float  # of the step's, communication nothing hid
    step_ms: float
    unpriced: tuple[str, ...] = ()  # kinds of the schedule's host work the model has no measurement of (not charged)


def host_work_ms(schedule: Schedule, model) -> tuple[float, tuple[str, ...]]:
    """What `schedule`'s host work takes on the computing thread (ms), as the model's benchmark timed each kind
    (`FittedModel.host_work_us`); and the kinds it did not time, which are not charged."""
    priced = getattr(model, "host_work_us", None)
    total, missing = 0.0, []
    for w in schedule.host:
        us = priced(w.what, w.nbytes, w.count) if priced else None
        if us is None:
            missing.append(w.what)
        else:
            total += us / 1000.0
    return total, tuple(dict.fromkeys(missing))


def predict(schedule: Schedule, basis: Basis, model, calib: Calibration, cost=None, nccl_of=None,
            ranks_per_node: int | None = None) -> Played:
    """`schedule`'s step on `basis` with `model`'s collectives (a `dtrain.collectives.costmodel` model; `cost(nbytes,
    algo, proto) -> ms` replaces its all-reduce, and `nccl_of(bucket) -> (algo, proto)` forces NCCL's choices, both
    uncalibrated), calibrated by `calib`. `ranks_per_node`: the job's layout, for point-to-point load."""
    costs = _Costs(model, calib, cost, nccl_of, schedule, ranks_per_node)
    blocking = [c for c in schedule.collectives if c.blocking and not calib.streams]
    gathers = [c for c in schedule.collectives if c.ready in (STEP, FORWARD_START) and c not in blocking]
    backward = [c for c in schedule.collectives if c not in blocking and c not in gathers]
    entries = _launches(schedule, backward, basis, costs)
    lanes = 1 if any(c.path == HIERARCHICAL for c in schedule.collectives) else calib.lanes
    groups = [c.group if lanes > 1 or c.group == LOOKUP_GROUP else None for c, *_ in entries]
    off_link = None if cost is not None else [a for *_, a, _ in entries]
    tl = play_timeline([r for _, r, _, _, _ in entries], [d for _, _, d, _, _ in entries], basis.backward_ms,
                       schedule.overlap, calib.slowdown, lanes, off_link,
                       groups if any(g is not None for g in groups) else None, model.link_efficiency,
                       basis.compute_end_ms, lockstep(model))
    exposed = tl.exposed_ms + calib.post_ms if entries else 0.0
    slower = 0.0
    if calib.host_base_ms is not None:
        slower = (host_ms(model, [n for *_, n in entries], tl, basis.compute_end_ms) or 0.0) - calib.host_base_ms
    compute = basis.compute_ms - (0.0 if schedule.split else basis.split_cost_ms) + slower
    # waited for on the computing thread: in backward exposed, in forward compute
    exposed += sum(costs.ms(c) for c in blocking if c.ready not in (STEP, FORWARD_START))
    compute += sum(costs.ms(c) for c in blocking if c.ready in (STEP, FORWARD_START))
    gather_ms = [costs.ms(c) for c in gathers]
    if gathers:
        compute += gather_stall([schedule.buckets[c.bucket] for c in gathers], gather_ms, basis.forward_ms)
        host = getattr(model, "host_us", None)
        if calib.host_base_ms is not None and host is not None and host(0) is not None:
            compute += sum(host(c.nbytes) / 2 for c in gathers) / 1000.0  # half an all-reduce's bytes each
    # the first unit regathered for its backward: nothing runs ahead of it to hide it
    first = next((costs.ms(c) for c in backward if c.waits == BACKWARD), 0.0)
    compute += first - basis.optimizer_ms * (1.0 - schedule.updated)
    work, unpriced = host_work_ms(schedule, model)
    compute += work - basis.host_work_ms
    comm = tl.comm_ms + sum(costs.ms(c) for c in blocking) + sum(gather_ms)
    return Played(len(schedule.buckets), comm, exposed, compute + exposed, unpriced)


def _launches(schedule: Schedule, collectives, basis: Basis, costs: "_Costs") -> list[tuple]:
    """(collective, ready ms, ms, off-link ms, bytes) of the collectives played on the backward's timeline: the
    buckets' in launch order; each lookup's rows (one per lookup the basis recorded) and each prefetched gather
    where its ready time falls."""
    out, apart = [], []  # apart: issued outside the buckets' launch order
    for c in collectives:
        if c.ready == LOOKUP:
            apart += [(c, at, nbytes) for at, nbytes in basis.lookup_rows]
            continue
        ready = basis.split_ready_ms if c.ready == PROJECTION else basis.curve.at(c.after)
        if c.ready == PREFETCH:
            apart.append((c, ready, c.nbytes))
            continue
        d = costs.ms(c)
        out.append((c, ready, d, costs.off_link(c, d), c.nbytes))
    for c, at, nbytes in sorted(apart, key=lambda x: x[1]):
        i = next((i for i, e in enumerate(out) if e[1] > at), len(out))
        d = costs.ms(c, nbytes)
        out.insert(i, (c, at, d, costs.off_link(c, d, nbytes), nbytes))
    return out


class _Costs:
    """Each collective's calibrated time and the part of it off the link (ms)."""

    def __init__(self, model, calib: Calibration, cost, nccl_of, schedule: Schedule, ranks_per_node):
        self.model, self.calib, self.cost, self.schedule = model, calib, cost, schedule
        self.nccl_of = nccl_of or (lambda bucket: (None, None))
        self.world = schedule.world
        self.load = p2p_load(self.world, ranks_per_node or getattr(model, "ranks_per_node", None))
        self.fitted = getattr(model, "colls", ()) if cost is None else ()

    def allreduce(self, c, nbytes: int) -> float:
        ms = (self.cost or self.model.allreduce_ms)(nbytes, *self.nccl_of(self.schedule.buckets[c.bucket]))
        return self.calib.comm_scale * (ms if self.cost is not None else played_ms(self.model, nbytes, ms))

    def latency(self, nbytes: int) -> float:
        return self.calib.comm_scale * self.model.allreduce_latency_ms(nbytes) if self.cost is None else 0.0

    def ms(self, c, nbytes: int | None = None) -> float:
        n = c.nbytes if nbytes is None else nbytes
        if c.kind == ALL_REDUCE and c.path == HIERARCHICAL:
            return hierarchical_ms(lambda b: self.allreduce(c, b), self.latency, n, c.per_node, self.world,
                                   self._inside_node())
        if c.kind == ALL_REDUCE:
            return self.allreduce(c, n)
        if c.kind == EXCHANGE:  # a whole bucket to each of the world - 1 peers: a reduce-scatter of world times it
            return exchange_ms(self.allreduce(c, n * self.world), self.latency(n), self.load)
        coll = "allgather" if c.kind == ALL_GATHER else "reducescatter"
        if c.path == TORCH and coll in self.fitted:  # the benchmark measured torch's collective itself
            return self.calib.comm_scale * self.model.time_us(n, coll) / 1000.0
        return exchange_ms(self.allreduce(c, n), self.latency(n), self.load if c.path == P2P else 1.0)

    def off_link(self, c, ms: float, nbytes: int | None = None) -> float:
        """The part of its time that does not use the link (`off_link_ms`; a reduce-scatter or an all-gather moves
        half an all-reduce's bytes)."""
        if self.cost is not None:
            return 0.0
        n = c.nbytes if nbytes is None else nbytes
        scale = self.calib.comm_scale
        if c.path == HIERARCHICAL:
            return hierarchical_ms(lambda b: scale * off_link_ms(self.model, b), self.latency, n, c.per_node,
                                   self.world, self._inside_node())
        if c.kind == ALL_REDUCE:
            return scale * off_link_ms(self.model, n, ms / scale if scale else None, 1.0)
        costed = n * self.world if c.kind == EXCHANGE else n
        return scale * off_link_ms(self.model, costed, ms / scale if scale else None, 0.5)

    def _inside_node(self):
        """nbytes -> ms of the hierarchical plan's reduce-scatter and all-gather of a bucket inside a node, from the
        cost model of that path (`model.inside_node`: a benchmark of one node's ranks): each as that benchmark
        measured it where it ran the collective itself (gloo's reduce-scatter moves as many bytes as an
        all-reduce), else as half an all-reduce. None without such a model (then their latency each)."""
        intra = getattr(self.model, "inside_node", None)
        if intra is None or self.cost is not None:
            return None
        fitted = getattr(intra, "colls", ())

        def one(nbytes: int, coll: str) -> float:
            if coll in fitted:
                return intra.time_us(nbytes, coll) / 1000.0
            return exchange_ms(played_ms(intra, nbytes), intra.allreduce_latency_ms(nbytes))

        return lambda nbytes: self.calib.comm_scale * (one(nbytes, "reducescatter") + one(nbytes, "allgather"))


def hierarchical_ms(allreduce, latency, nbytes: int, per_node: int, world: int, inside=None) -> float:
    """One bucket of the hierarchical plan (`dtrain.collectives.hierarchy`) from the flat all-reduce's costs over
    `world` ranks (`allreduce(nbytes)`): the reduce-scatter and the all-gather inside the node, which do not cross
    the link between nodes (`inside(nbytes)`, their time on the path inside a node; without it their latency each),
    and the shard's all-reduce between the N nodes. That one is costed by what it puts on a node's link: its R
    ranks each send 2(N-1)/N of their 1/R of the bucket at once, where a flat ring sends 2(NR-1)/NR of all of it,
    so it costs the flat all-reduce of (N-1)/N / ((NR-1)/NR) of the bytes."""
    nodes = world // per_node
    load = ((nodes - 1) / nodes) / ((world - 1) / world)
    within = inside(nbytes) if inside else 2 * latency(nbytes // per_node)
    return within + allreduce(int(nbytes * load))


def exchange_ms(allreduce_ms: float, latency_ms: float, load: float = 1.0) -> float:
    """A reduce-scatter's (or an all-gather's) time from the all-reduce of the same bytes: it moves half of them,
    so it costs the latency and half the rest; `load` times that rest where it puts more on a node's link than the
    ring's half (`p2p_load`)."""
    return latency_ms + load * (allreduce_ms - latency_ms) / 2


def p2p_load(world: int, per_node: int | None) -> float:
    """What a point-to-point exchange (each rank sends its 1/W of a bucket to every other rank) puts on a node's
    link, as a multiple of what half a ring all-reduce of the same bucket puts there. With R ranks per node, each of
    the node's R ranks sends W - R shards of 1/W across it, R(W - R)/W of the bucket; a ring crosses each node's
    link once per direction, (W - 1)/W for half an all-reduce. So R(W - R)/(W - 1): 1 with one rank per node, 4/3
    on 2 nodes of 2. With every rank on one node, or the layout unknown, 1: the fit's link is then the path the
    exchange takes."""
    if not per_node or not 1 < per_node < world:
        return 1.0
    return per_node * (world - per_node) / (world - 1)


__all__ = ["Basis", "Calibration", "Played", "exchange_ms", "hierarchical_ms", "p2p_load", "predict"]
