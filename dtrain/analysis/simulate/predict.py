"""Predictions: a configuration's step played on the reference step (its buckets ready where the reference step's
ready curve says, its collectives costed by the model and calibrated), and the sweep over strategies and caps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.analysis.plans import bucket_plan, ready_params, sharded_exchanges, sync_for
from dtrain.analysis.simulate.calibration import LOOKUP_GROUP, Calibration
from dtrain.analysis.simulate.costs import host_ms, lockstep, off_link_ms, played_ms
from dtrain.analysis.simulate.reference import ReferenceStep
from dtrain.collectives import nccl, strategies, tensor_classes
from dtrain.collectives.strategies.fsdp2 import Fsdp2Units
from dtrain.collectives.tensor_classes import WIRE_DTYPES
from dtrain.collectives.sharded.exchange import ROWS
from dtrain.collectives.timeline import (ReadyCurve, gather_stall, optimizer_saving, play_timeline, sharded_times,
                                         through)
from dtrain.common.errors import UserError


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
    # (`dtrain.analysis.interleave`) share keys, and a pair of them is compared step by step, paired
    samples: dict = field(default_factory=dict, repr=False)
    speed: float | None = None  # median over its runs of (run's forward / profiled run's forward): machine speed
    adjusted_step_ms: float | None = None  # measured, each run scaled to the profiled run's machine speed
    adjusted_ci: tuple[float, float] | None = None
    run: str | None = None
    split: bool = False  # the tied embedding's gradient split (`tied_split`)
    rows: bool = False  # and that embedding sharded by rows (`sharded` with `shard_tied_split`)
    narrowed: str | None = None  # `sharded` with `gather_dtype`: the Linear members' dtype in the exchanges
    keep: bool = False  # fsdp2 with `reshard_after_forward: false`: the units keep their parameters until backward
    hierarchical: bool = False  # the hierarchical plan (`sync.hierarchical`)
    collectives: str | None = None  # fsdp2's collectives where not its own (`sync.fsdp2_collectives`: async, p2p)

    @property
    def label(self) -> str:
        return (self.strategy + (f"@{self.cap_mb:g}M" if self.cap_mb is not None else "")
                + ("+split" if self.split else "") + ("+rows" if self.rows else "")
                + (f"+{self.narrowed}" if self.narrowed else "") + ("+keep" if self.keep else "")
                + ("+hier" if self.hierarchical else "") + (f"+{self.collectives}" if self.collectives else ""))


def requested_nccl(cfg, class_groups: bool):
    """bucket -> (algo, proto) as the run would request them (None: NCCL decides): a class's own settings where
    each class has its communicator (`dtrain.collectives.nccl.resolve`), else `collectives.default` for every bucket."""
    cache: dict = {}

    def of(bucket):
        name = bucket.tensor_class if class_groups else None
        if name not in cache:
            s = nccl.resolve(cfg, name) if name else cfg.collectives.default
            cache[name] = (s.algo, s.proto)
        return cache[name]

    return of


def predict(cfg, ref: ReferenceStep, curve: ReadyCurve, model, calib: Calibration, strategy: str,
            cap_mb: float | None = None, vocab: int | None = None, classes: dict | None = None,
            cost=None, nccl_of=None) -> Prediction:
    """Predicted step of `cfg`'s model under `strategy` (bucket cap, per-class overrides), played on the reference
    step. `cost(nbytes, algo, proto) -> ms` replaces the model's cost of one all-reduce; `nccl_of(bucket)` gives
    the (algo, proto) a bucket is forced to (default: what the profile requests). A split tied embedding
    (`tied_split`) under the all-reducing strategies is played as the reducer runs it (`_split_first`, and each
    lookup's rows one more all-reduce) where the profiled step recorded its lookups' rows, else as its plain plan.
    `sharded` is played by `_sharded`, fsdp2 by `_fsdp2`."""
    if strategy == "powersgd":
        raise UserError("powersgd is lossy and sends low-rank factors, not buckets: not simulated")
    if strategy == "noop":
        compute = _compute_ms(ref, model, vocab, split=False) - (calib.host_base_ms or 0.0)
        return Prediction("noop", None, 0, 0.0, 0.0, compute, lossless=False, communicates=False)
    if strategies.get(strategy).plans_like is Fsdp2Units:
        return _fsdp2(cfg, ref, curve, model, calib, strategy, vocab, classes, cost, nccl_of)
    if strategies.planner(strategy).shards:
        return _sharded(cfg, ref, curve, model, calib, strategy, cap_mb, vocab, classes, cost, nccl_of)
    plan, overlap, class_groups = bucket_plan(cfg, strategy, bucket_cap_mb=cap_mb, classes=classes, vocab=vocab)
    split = _split_classes(cfg, strategy, classes)
    compute = _compute_ms(ref, model, vocab, bool(split))
    # a split embedding's lookups' rows, where the profiled step recorded them: (ready ms, bytes)
    rows = ref.lookup_rows if split and overlap else []
    if rows:
        plan, ready = _split_first(cfg, strategy, cap_mb, classes, vocab, curve, split, ref.split_ready_ms(curve))
    else:
        ready = [curve.at(x) for x in through(plan, ready_params(cfg, vocab))]
    allreduce, latency, off_link = _costs(model, calib, cost, nccl_of or requested_nccl(cfg, class_groups))
    per_node = _per_node(cfg, strategy, model)
    if per_node:  # the hierarchical plan: each bucket's three collectives one after another on the reducer's thread
        world = model.ranks
        inside = _inside_node(model, calib) if cost is None else None
        dur = [hierarchical_ms(allreduce, latency, b, b.nbytes, per_node, world, inside) for b in plan]
        lat = [hierarchical_ms(lambda _, n: off_link(n), latency, b, b.nbytes, per_node, world, inside)
               for b in plan]
    else:
        dur = [allreduce(b, b.nbytes) for b in plan]
        lat = [off_link(b.nbytes) for b in plan] if cost is None else None
    groups = _groups(plan, class_groups, calib)
    sent = [b.nbytes for b in plan]
    if rows:  # each lookup's rows one more all-reduce on the split's own group, when that lookup's backward ended
        entries = list(zip(ready, dur, lat or [0.0] * len(plan), groups or [None] * len(plan), sent))
        for at, nbytes in sorted(rows):
            i = next((i for i in range(len(entries)) if entries[i][0] > at), len(entries))
            entries.insert(i, (at, allreduce(plan[0], nbytes), off_link(nbytes), LOOKUP_GROUP, nbytes))
        ready, dur, lats, groups, sent = (list(c) for c in zip(*entries))
        lat = lats if lat else None
    tl, exposed, slower = _played(ref, model, calib, ready, dur, overlap, lat, groups, sent, 1 if per_node else None)
    return Prediction(strategy, cap_mb if strategies.get(strategy).uses_cap else None, len(plan), tl.comm_ms,
                      exposed, compute + slower + exposed, _lossless(plan), split=bool(split),
                      hierarchical=per_node is not None)


def _sharded(cfg, ref: ReferenceStep, curve: ReadyCurve, model, calib: Calibration, strategy: str,
             cap_mb: float | None, vocab: int | None, classes: dict | None, cost, nccl_of) -> Prediction:
    """`sharded`'s step, each bucket as its exchange plan says (`dtrain.analysis.plans.sharded_exchanges`, the plan
    training runs): a sharded bucket reduce-scattered in backward and all-gathered in the next forward, a
    replicated one (a split tied embedding) all-reduced, or exchanged whole in bf16, from the start of backward;
    narrowed members in their bytes (the reduce-scatter's only in a step of one micro-batch). A reduce-scatter or
    all-gather costs its latency and half the rest of an all-reduce of its bytes; a whole exchange sends each of
    the world - 1 peers the bucket, as a reduce-scatter of world times its bytes does. A lookup's fetch of its rows
    in the next forward is not played."""
    sync = sync_for(cfg, strategy, cap_mb, classes)
    plan, overlap, class_groups = bucket_plan(cfg, strategy, bucket_cap_mb=cap_mb, classes=classes, vocab=vocab)
    world = getattr(model, "ranks", None) or 2
    load = p2p_load(world, model.ranks_per_node)
    exchanges = sharded_exchanges(cfg, sync, plan, world, vocab)
    accumulated = cfg.train.accum_steps > 1
    allreduce, latency, off_link = _costs(model, calib, cost, nccl_of or requested_nccl(cfg, class_groups))
    alpha = [latency(b.nbytes) for b in plan]
    sent = [ex.nbytes("reduce_scatter", accumulated) for ex in exchanges]
    whole = [ex.whole and not accumulated for ex in exchanges]
    costed = [n * world if w else n for n, w in zip(sent, whole)]  # the all-reduce's bytes each is costed from
    ready, dur = sharded_times(exchanges, [curve.at(x) for x in through(plan, ready_params(cfg, vocab))],
                               [allreduce(b, n) for b, n in zip(plan, costed)],
                               lambda i, d: exchange_ms(d, alpha[i], load), ref.split_ready_ms(curve))
    dur = [exchange_ms(d, alpha[i], load) if w else d for i, (d, w) in enumerate(zip(dur, whole))]
    # a reduce-scatter (or a whole exchange, costed as one) moves half the bytes of the all-reduce it is costed from
    halved = [ex.gathered or w for ex, w in zip(exchanges, whole)]
    lat = ([off_link(n, d, 0.5 if h else 1.0) for n, d, h in zip(costed, dur, halved)] if cost is None else None)
    tl, exposed, slower = _played(ref, model, calib, ready, dur, overlap, lat, _groups(plan, class_groups, calib),
                                  sent)
    gather_bytes = [ex.nbytes("all_gather") for ex in exchanges]
    gather = [exchange_ms(allreduce(b, n), a, load) for b, n, a in zip(plan, gather_bytes, alpha)]
    split = any(ex.split for ex in exchanges)
    compute = (_compute_ms(ref, model, vocab, split) + slower
               + _sharded_extra_ms(ref, model, plan, exchanges, gather, gather_bytes, calib, world))
    return Prediction(strategy, cap_mb, len(plan), tl.comm_ms, exposed, compute + exposed, _lossless(plan),
                      split=split, rows=any(ex.layout == ROWS for ex in exchanges),
                      narrowed=sync.gather_dtype)


def _costs(model, calib: Calibration, cost, nccl_of):
    """(allreduce(bucket, nbytes), latency(nbytes), off_link(nbytes, ms=None, share=1)), calibrated ms: one
    all-reduce of `nbytes` with the (algo, proto) `nccl_of(bucket)` gives, by `cost(nbytes, algo, proto)` where
    given, else by the model; the model's latency term for that size (the fixed cost a reduce-scatter or a
    collective inside a node keeps whole); and the part of a collective that does not share the link, played as
    its latency on the timeline (`off_link_ms`: of that all-reduce, or of one taking `ms` that moves `share` of its
    bytes). Both none for a given `cost`."""
    one = cost or model.allreduce_ms
    scale = calib.comm_scale

    def allreduce(bucket, nbytes: int) -> float:
        ms = one(nbytes, *nccl_of(bucket))
        return scale * (ms if cost is not None else played_ms(model, nbytes, ms))

    def latency(nbytes: int) -> float:
        return scale * model.allreduce_latency_ms(nbytes) if cost is None else 0.0

    def off_link(nbytes: int, ms: float | None = None, share: float = 1.0) -> float:
        if cost is not None:
            return 0.0
        return scale * off_link_ms(model, nbytes, None if ms is None or not scale else ms / scale, share)

    return allreduce, latency, off_link


def _groups(plan, class_groups: bool, calib: Calibration) -> list[str] | None:
    """Each bucket's process group (its class's), where classes have their own and the machine runs several lanes."""
    return [b.tensor_class for b in plan] if class_groups and calib.lanes > 1 else None


def _played(ref: ReferenceStep, model, calib: Calibration, ready, dur, overlap: bool, lat, groups, sent,
            lanes: int | None = None):
    """The backward's collectives (ready and taking `dur` ms, of `sent` bytes) played on the reference step, with
    `lanes` per group (default: the calibration's): (timeline, exposed ms, ms the reference step's compute is slower
    for more collectives during backward)."""
    tl = play_timeline(ready, dur, ref.sync_backward_ms, overlap, calib.slowdown, lanes or calib.lanes, lat, groups,
                       model.link_efficiency, ref.compute_end_ms, lockstep(model))
    slower = host_ms(model, sent, tl, ref.compute_end_ms) - calib.host_base_ms if calib.host_base_ms is not None else 0.0
    return tl, tl.exposed_ms + calib.post_ms, slower


def _per_node(cfg, strategy: str, model) -> int | None:
    """R, the ranks per node of `cfg`'s hierarchical plan (`sync.hierarchical`): `sync.ranks_per_node`, else the
    machine's the cost model was given (`--ranks-per-node`, or the profiled run's record), where `strategy` runs the
    plan and the cost model knows the world it costs; None for a flat all-reduce."""
    sync = sync_for(cfg, strategy)
    if not (sync.hierarchical and "hierarchical" in strategies.get(strategy).sync_keys):
        return None
    world = getattr(model, "ranks", None)
    per_node = sync.ranks_per_node or model.ranks_per_node
    if not world or not per_node:
        raise UserError(f"{strategy} with 'sync.hierarchical': the simulator needs the ranks per node "
                        f"('sync.ranks_per_node' or --ranks-per-node) and a cost model of the job's world (a "
                        f"benchmark fit on the same shape)")
    if world % per_node or not 1 < per_node < world:
        raise UserError(f"{per_node} ranks per node ('sync.ranks_per_node' or --ranks-per-node) do not split the "
                        f"cost model's {world} ranks into nodes of several ranks")
    return per_node


def hierarchical_ms(allreduce, latency, bucket, nbytes: int, per_node: int, world: int, inside=None) -> float:
    """One bucket of the hierarchical plan (`dtrain.collectives.hierarchy`) from the flat all-reduce's costs over
    `world` ranks: the reduce-scatter and the all-gather inside the node, which do not cross the link between nodes
    (`inside(nbytes)`, their time on the path inside a node; without it their latency each), and the shard's
    all-reduce between the N nodes. That one is costed by what it puts on a node's link: its R ranks each send
    2(N-1)/N of their 1/R of the bucket at once, where a flat ring sends 2(NR-1)/NR of all of it, so it costs the
    flat all-reduce of (N-1)/N / ((NR-1)/NR) of the bytes."""
    nodes = world // per_node
    load = ((nodes - 1) / nodes) / ((world - 1) / world)
    within = inside(nbytes) if inside else 2 * latency(nbytes // per_node)
    return within + allreduce(bucket, int(nbytes * load))


def _inside_node(model, calib: Calibration):
    """nbytes -> ms of the hierarchical plan's reduce-scatter and all-gather of a bucket inside a node, from the cost
    model of that path (`inside_node`: a benchmark of one node's ranks, simulate's --intra-topology): each as that
    benchmark measured it where it ran the collective itself (`--collective`; gloo's reduce-scatter moves as many
    bytes as an all-reduce), else as half an all-reduce. None without such a model."""
    intra = model.inside_node
    if intra is None:
        return None
    fitted = getattr(intra, "colls", ())

    def one(nbytes: int, coll: str) -> float:
        if coll in fitted:
            return intra.time_us(nbytes, coll) / 1000.0
        return exchange_ms(played_ms(intra, nbytes), intra.allreduce_latency_ms(nbytes))

    return lambda nbytes: calib.comm_scale * (one(nbytes, "reducescatter") + one(nbytes, "allgather"))


def _lossless(plan) -> bool:
    return all(b.settings.wire_dtype == "fp32" for b in plan)


def exchange_ms(allreduce_ms: float, latency_ms: float, load: float = 1.0) -> float:
    """A reduce-scatter's (or an all-gather's) time from the all-reduce of the same bytes: it moves half of them,
    so it costs the latency and half the rest; `load` times that rest where it puts more on a node's link than the
    ring's half (`p2p_load`)."""
    return latency_ms + load * (allreduce_ms - latency_ms) / 2


def p2p_load(world: int, per_node: int | None) -> float:
    """What a point-to-point exchange (`sharded`'s reduce-scatter and all-gather: each rank sends its 1/W of a
    bucket to every other rank) puts on a node's link, as a multiple of what half a ring all-reduce of the same
    bucket puts there. With R ranks per node, each of the node's R ranks sends W - R shards of 1/W across it,
    R(W - R)/W of the bucket; a ring crosses each node's link once per direction, (W - 1)/W for half an all-reduce.
    So R(W - R)/(W - 1): 1 with one rank per node, 4/3 on 2 nodes of 2. With every rank on one node, or the layout
    unknown, 1: the fit's link is then the path the exchange takes."""
    if not per_node or not 1 < per_node < world:
        return 1.0
    return per_node * (world - per_node) / (world - 1)


def _fsdp2(cfg, ref: ReferenceStep, curve: ReadyCurve, model, calib: Calibration, strategy: str,
           vocab: int | None, classes: dict | None, cost, nccl_of) -> Prediction:
    """FSDP2's step: each unit (`Fsdp2Units`' buckets) reduce-scattered in backward, all-gathered in forward (in
    bf16 with `gather_dtype`, FSDP2's mixed precision) and, with `reshard_after_forward`, gathered again in backward
    (all but the root, the last bucket, which keeps its parameters). A reduce-scatter or all-gather costs what the
    benchmark measured for that collective where the model was fitted on it (FSDP2 calls torch's own, which on gloo
    is not half an all-reduce), else, and for `sharded`'s point-to-point exchanges (`fsdp2_collectives: p2p`), its
    latency and half the rest of an all-reduce of its bytes. Stock FSDP2 on a CPU device (no `calib.streams`)
    waits for every collective on the computing thread, so they add up to the step. With device streams, or
    collectives that do not wait (`fsdp2_collectives`), the reduce-scatters and the backward gathers (each issued as
    the unit before starts its backward, FSDP2's prefetch) are played on the timeline as `sharded`'s, and the
    forward waits for its gathers as `sharded`'s does. A split tied embedding (`tied_split`, outside FSDP2) is
    all-reduced by its own hooks in any case: its projection part as backward completes it, each lookup's rows as
    the profiled step recorded them, on the timeline. Not modeled: FSDP2's copies into and out of its flat buffers
    and the DTensor optimizer's overhead; the optimizer is charged for 1/world of the sharded parameters, as
    `sharded`'s."""
    sync = sync_for(cfg, strategy, classes=classes)
    plan = bucket_plan(cfg, strategy, classes=classes, vocab=vocab).buckets
    allreduce, latency, _ = _costs(model, calib, cost, nccl_of or requested_nccl(cfg, False))
    fitted = getattr(model, "colls", ()) if cost is None and sync.fsdp2_collectives != "p2p" else ()
    world = getattr(model, "ranks", None) or 2
    load = p2p_load(world, model.ranks_per_node) if sync.fsdp2_collectives == "p2p" else 1.0

    def collective(b, nbytes: int, coll: str) -> float:
        if coll in fitted:  # the benchmark measured this collective itself (`--collective`)
            return calib.comm_scale * model.time_us(nbytes, coll) / 1000.0
        return exchange_ms(allreduce(b, nbytes), latency(nbytes), load)

    split = _split_classes(cfg, strategy, classes)
    whole = [b.tensor_class in split for b in plan]  # the split embedding's bucket, outside FSDP2
    units = [b for b, w in zip(plan, whole) if not w]
    low = WIRE_DTYPES[sync.gather_dtype].itemsize if sync.gather_dtype else None
    scatter = [collective(b, b.nbytes, "reducescatter") for b in units]
    gather = [collective(b, b.numel * low if low else b.nbytes, "allgather") for b in units]
    regather = gather[:-1] if sync.reshard_after_forward else []
    compute = (_compute_ms(ref, model, vocab, split=bool(split)) - (calib.host_base_ms or 0.0)
               - optimizer_saving(plan, ref.optimizer_ms, world, [not w for w in whole]))
    # the split's all-reduces, issued by its own hooks without waiting: the projection part, then each lookup's rows
    reduced = [(ref.split_ready_ms(curve), allreduce(b, b.nbytes)) for b, w in zip(plan, whole) if w]
    if reduced:
        reduced += [(at, allreduce(plan[0], nbytes)) for at, nbytes in ref.lookup_rows]
    entries = list(reduced)
    exposed = 0.0
    if not calib.streams and sync.fsdp2_collectives == "stock":
        exposed = sum(scatter) + sum(regather)
        compute += sum(gather)
    else:
        ready = [curve.at(x) for x in through(units, ready_params(cfg, vocab))]
        prefetch = [curve.at(0)] * 2 + ready  # unit i's gather, as unit i - 1 starts its backward
        entries += list(zip(ready + prefetch[:len(regather)], scatter + regather))
        compute += gather_stall(units, gather, ref.forward_ms / ref.accum_steps) + (regather[0] if regather else 0.0)
    if entries:
        entries.sort()
        tl = play_timeline([r for r, _ in entries], [d for _, d in entries], ref.sync_backward_ms, True,
                           calib.slowdown, calib.lanes, None, None, model.link_efficiency, ref.compute_end_ms,
                           lockstep(model))
        exposed += tl.exposed_ms + calib.post_ms
    comm = sum(scatter) + sum(gather) + sum(regather) + sum(d for _, d in reduced)
    return Prediction(strategy, None, len(plan), comm, exposed, compute + exposed, lossless=sync.gather_dtype is None,
                      split=bool(split), narrowed=sync.gather_dtype, keep=not sync.reshard_after_forward,
                      collectives=None if sync.fsdp2_collectives == "stock" else sync.fsdp2_collectives)


def split_cost_ms(ref: ReferenceStep, model, vocab: int | None) -> float:
    """What a split tied embedding cost the reference step's compute, to take out of a prediction without the split
    (ms): the split's own work on the computing thread, as its records measured it (`ReferenceStep.split_host_ms`),
    and the computation its masks' all-reduces took from the forward they ran beside (V bytes each, one per lookup;
    the benchmark's --overlap measurement, `FittedModel.host_us`, where the model has it). 0 for a reference step
    without the split."""
    lookups = ref.split_lookups
    if not lookups:
        return 0.0
    host = getattr(model, "host_us", None)
    masks = lookups * host(vocab) / 1000.0 if vocab and host is not None and host(0) is not None else 0.0
    return ref.split_host_ms + masks


def _compute_ms(ref: ReferenceStep, model, vocab: int | None, split: bool) -> float:
    """The reference step's compute for a configuration with or without the split (without: its work taken out)."""
    return ref.compute_ms - (0.0 if split else split_cost_ms(ref, model, vocab))


def _split_classes(cfg, strategy: str, classes: dict | None) -> set[str]:
    """The classes whose tied embedding `strategy` splits under `cfg`'s classes with the overrides `classes`."""
    if "classes.tied_split" not in strategies.get(strategy).sync_keys:
        return set()
    return {name for name, c in sync_for(cfg, strategy, classes=classes).classes.items() if c.tied_split}


def _split_first(cfg, strategy: str, cap_mb: float | None, classes: dict | None, vocab: int | None,
                 curve: ReadyCurve, split: set[str], split_ready: float) -> tuple[list, list[float]]:
    """The plan of an all-reducing strategy as its reducer re-plans it with a split tied embedding (`tied_split`),
    in the order gradients became ready in its first backward: the embedding first (its gradient is then the
    projection part, the first computed), the others in their expected order. And each bucket's ready time: the
    embedding's at `split_ready` (`ReferenceStep.split_ready_ms`: once the generator's backward made the projection
    part), the others' where the reference step's curve puts them."""
    sync = sync_for(cfg, strategy, cap_mb, classes)
    params = list(ready_params(cfg, vocab))
    class_of = tensor_classes.from_config(sync).assign(params)
    at, x = {}, 0
    for name, p in params:
        x += p.numel()
        at[name] = split_ready if class_of[name] in split else curve.at(x)
    first = [(n, p) for n, p in params if class_of[n] in split]
    plan = strategies.plan_for(sync, first + [(n, p) for n, p in params if class_of[n] not in split]).buckets
    return plan, [max(at[n] for n in b.names) for b in plan]


def _sharded_extra_ms(ref: ReferenceStep, model, plan, exchanges, gather: list[float], gather_bytes: list[int],
                      calib: Calibration, world: int) -> float:
    """What a sharded step adds to (or saves from) the reference step's compute: the next forward waiting for the
    all-gathers (taking `gather` ms, of buckets of `gather_bytes`; `dtrain.collectives.timeline.gather_stall`), their
    host cost on a CPU machine, and the optimizer updating 1/world of the sharded parameters (`optimizer_saving`)."""
    forward = ref.forward_ms / ref.accum_steps  # the gathers delay only the first micro-batch's forward
    gathered = [ex.gathered for ex in exchanges]
    extra = gather_stall(plan, gather, forward, gathered)
    host = getattr(model, "host_us", None)
    if calib.host_base_ms is not None and host is not None and host(0) is not None:
        # half an all-reduce's bytes each
        extra += sum(host(n) / 2 for n, g in zip(gather_bytes, gathered) if g) / 1000.0
    return extra - optimizer_saving(plan, ref.optimizer_ms, world, gathered)


def sweep(cfg, ref, curve, model, calib, names, caps, vocab=None) -> list[Prediction]:
    """A prediction per strategy of `names`, and per cap of `caps` for those whose buckets follow the cap."""
    out = []
    for s in names:
        for cap in (caps if strategies.get(s).uses_cap else (None,)):
            out.append(predict(cfg, ref, curve, model, calib, s, cap, vocab))
    return out
