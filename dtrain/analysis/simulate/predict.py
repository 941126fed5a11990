"""Predictions: a configuration's step played on the reference step: its strategy's schedule (what it sends, when,
and what waits for it: `dtrain.collectives.schedule`) played by the one step-time predictor
(`dtrain.collectives.step_time`) on the reference step's compute and ready curve, its collectives costed by the model
and calibrated; and the sweep over strategies and caps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.analysis.plans import meta_model, sync_for
from dtrain.analysis.simulate.reference import ReferenceStep
from dtrain.collectives import nccl, step_time, strategies
from dtrain.collectives.step_time import Basis, Calibration
from dtrain.collectives.timeline import ReadyCurve
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
    # what sets the configuration apart beyond strategy and cap, as its schedule says (`Schedule.label`): "+split"
    # (the tied embedding's split), "+rows" (sharded by rows), "+bf16" (narrowed exchanges, FSDP2's mixed
    # precision), "+keep" (fsdp2 without resharding), "+hier" (the hierarchical plan), "+p2p" (fsdp2's collectives)
    variant: str = ""
    unpriced: tuple[str, ...] = ()  # kinds of its host work the cost model has no timing of (`step_time.Played`)

    @property
    def label(self) -> str:
        return self.strategy + (f"@{self.cap_mb:g}M" if self.cap_mb is not None else "") + self.variant


def requested_nccl(cfg, class_groups: bool):
    """bucket -> (algo, proto) as the run would request them (None: NCCL decides): a class's own settings where
    each class has its communicator (`dtrain.collectives.nccl.resolve`), else `collectives.default` for every bucket."""
    cache: dict = {}

    def of(bucket):
        name = bucket.tensor_class if class_groups else None
        if name not in cache:
            s = nccl.resolve(cfg.sync, cfg.collectives, name) if name else cfg.collectives.default
            cache[name] = (s.algorithm, s.protocol)
        return cache[name]

    return of


def predict(cfg, ref: ReferenceStep, curve: ReadyCurve, model, calib: Calibration, strategy: str,
            cap_mb: float | None = None, vocab: int | None = None, classes: dict | None = None,
            cost=None, nccl_of=None) -> Prediction:
    """Predicted step of `cfg`'s model under `strategy` (bucket cap, per-class overrides), played on the reference
    step. `cost(nbytes, algo, proto) -> ms` replaces the model's cost of one all-reduce; `nccl_of(bucket)` gives
    the (algo, proto) a bucket is forced to (default: what the profile requests). A configuration without the
    reference step's split tied embedding has the split's own work taken out of the compute (`split_cost_ms`)."""
    sync = sync_for(cfg, strategy, cap_mb, classes)
    world = getattr(model, "ranks", None) or 2
    per_node = sync.ranks_per_node or getattr(model, "ranks_per_node", None)
    try:
        schedule = strategies.schedule_for(sync, meta_model(cfg, vocab), world, cfg.train.accum_steps, per_node)
    except UserError as e:
        raise UserError(f"{strategy}: not simulated: {e}") from None
    own = step_time.host_work_ms(ref.schedule, model)[0] if ref.schedule is not None else 0.0
    basis = Basis(ref.compute_ms, ref.forward_ms / ref.accum_steps, ref.sync_backward_ms, ref.optimizer_ms, curve,
                  ref.split_ready_ms(curve), ref.compute_end_ms, ref.lookup_rows, split_cost_ms(ref, model, vocab),
                  own)
    played = step_time.predict(schedule, basis, model, calib, cost,
                               nccl_of or requested_nccl(cfg, schedule.class_groups), per_node)
    return Prediction(strategy, cap_mb if strategies.get(strategy).uses_cap else None, played.buckets,
                      played.comm_ms, played.exposed_ms, played.step_ms, schedule.exact, schedule.communicates,
                      variant=schedule.label, unpriced=played.unpriced)


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


def sweep(cfg, ref, curve, model, calib, names, caps, vocab=None) -> list[Prediction]:
    """A prediction per strategy of `names`, and per cap of `caps` for those whose buckets follow the cap."""
    out = []
    for s in names:
        for cap in (caps if strategies.get(s).uses_cap else (None,)):
            out.append(predict(cfg, ref, curve, model, calib, s, cap, vocab))
    return out
