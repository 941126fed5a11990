"""The search's predictions: each candidate's step time, MODELED from what the job measured of itself, and the
pruning by them (`sync.tune.top_k`).

Two measurements feed it, both taken by `attach`'s search (`dtrain.collectives.auto.search`) on the job itself:
- the probe: the run's first `probe_steps` training steps under one candidate (stock DDP's defaults where the space
  holds them): their forward, backward and optimizer times, the step less the time `wait()` blocked being the
  compute every candidate shares;
- the network: an all-reduce timing of the job's own process group at a few sizes (as `dtrain.collectives.bench`
  does at more), fitted by `dtrain.collectives.costmodel`'s regime fit.

A candidate's schedule (`dtrain.collectives.schedule`: what its strategy sends, when, and what waits for it) is
played on the probe's compute by the one step-time predictor the simulator uses too (`dtrain.collectives.step_time`),
its gradients ready uniformly over the probe's backward. No calibration: the ranking only has to keep the best few of
each family for measurement, which decides.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtrain.collectives import step_time, strategies
from dtrain.collectives.costmodel.fit import FittedModel, fit_regimes
from dtrain.collectives.plan import ready_order
from dtrain.collectives.step_time import Basis, Calibration
from dtrain.collectives.timeline import GLOO_LANES, ReadyCurve
from dtrain.common.errors import UserError

BENCH_BYTES = (16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)  # all-reduce sizes of the network probe
BENCH_REPEATS = 3


@dataclass(frozen=True)
class Probe:
    """Median compute of the probe's steps past its first (ms), the same on every rank (averaged over them)."""

    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    step_ms: float
    accum_steps: int = 1


def probe_of(steps: list[tuple[float, float, float, float]]) -> list[float]:
    """This rank's median forward, backward, optimizer and compute-step times (ms) over `steps`, each (forward,
    backward, optimizer, step less the exposed wait), the first one dropped (it allocates); averaged over the ranks
    into a `Probe`."""
    steady = steps[1:] or steps
    return [statistics.median(s[i] for s in steady) for i in range(4)]


def bench_sizes(gradient_bytes: int) -> list[int]:
    """The all-reduce sizes to time for a model of `gradient_bytes`: BENCH_BYTES up to the first at least that large
    (no bucket is larger; a tiny model's steps would not hold the timing of 16 MiB), two at the least."""
    sizes = [b for b in BENCH_BYTES if b < gradient_bytes]
    return list(BENCH_BYTES[:max(2, len(sizes) + 1)])


def time_allreduce(device, sizes: list[int], group=None) -> list[float]:
    """This rank's median time (µs) of one all-reduce of each of `sizes` (bytes) over `group`."""
    out = []
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(t, group=group)  # warm-up: connections, buffers
        times = []
        for _ in range(BENCH_REPEATS):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dist.all_reduce(t, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e6)
        out.append(statistics.median(times))
    return out


def network_model(sizes: list[int], times_us: list[float], world: int) -> FittedModel:
    """The all-reduce cost of the job's process group, fitted on the (rank-averaged) timings of `time_allreduce`."""
    return FittedModel({"in-job": fit_regimes(list(sizes), times_us, max_regimes=2)}, "allreduce", world,
                       name="in-job", source="the job's own all-reduce timings")


def predict_ms(sync, model: torch.nn.Module, probe: Probe, net: FittedModel, world: int, backend: str
               ) -> float | None:
    """Modeled step time of `sync` (a candidate's SyncConfig) on this job: its strategy's schedule
    (`dtrain.collectives.schedule`) played by the one predictor (`dtrain.collectives.step_time`) on the probe's
    compute, its gradients ready uniformly over the probe's backward, with gloo's lanes on a CPU device (where a
    collective that waits on the computing thread adds up to the step). None where the job cannot predict it: a
    strategy without a schedule (PowerSGD's low-rank factors), or the hierarchical plan (the in-job timing has the
    world's all-reduce, not each level's); such a candidate is measured without a prediction."""
    if sync.hierarchical:
        return None
    params = ready_order(model)
    try:
        schedule = strategies.schedule_for(sync, model, world, probe.accum_steps)
    except UserError:
        return None
    backward = probe.backward_ms / probe.accum_steps  # only the last micro-batch's backward communicates
    basis = Basis(probe.step_ms, probe.forward_ms / probe.accum_steps, backward, probe.optimizer_ms,
                  ReadyCurve.uniform(sum(p.numel() for _, p in params), backward))
    calib = Calibration(lanes=GLOO_LANES if backend == "gloo" else 1, streams=backend != "gloo")
    return step_time.predict(schedule, basis, net, calib).step_ms


# Of the `top_k` measured, each family's best predicted member goes first where its prediction is within this factor
# of the best one: a prediction can be 20-25% off (docs/tuning.md), and a family measurement would pick must not be
# lost to another family's near copies.
FAMILY_SLACK = 1.30


def family(sync) -> str:
    """A candidate's family: its strategy and the project's own ideas it uses (the split, rows, bf16 exchanges, the
    hierarchical plan, per-class NCCL choices; the prediction does not see the last, measurement decides)."""
    split = any(c.tied_split for c in sync.classes.values()) and "classes.tied_split" in strategies.get(
        sync.strategy).sync_keys
    rows = split and sync.shard_tied_split
    nccl = any(c.protocol or c.algorithm or c.min_ctas or c.max_ctas for c in sync.classes.values())
    return sync.strategy + ("+split" if split else "") + ("+rows" if rows else "") + (
        f"+{sync.gather_dtype}" if sync.gather_dtype else "") + ("+hierarchical" if sync.hierarchical else "") + (
        "+nccl" if nccl else "")


def prune(cands: list, syncs: dict, top_k: int, keep: set[str] = frozenset()) -> list:
    """The entrants to measure (`dtrain.collectives.auto.race.Entrant`, their `predicted_ms` set; `syncs`: name ->
    SyncConfig): those named in `keep`; the best predicted member of every family whose prediction is within
    FAMILY_SLACK of the best one, however many that is; then, up to `top_k` in all, the best predicted of the rest;
    and every one without a prediction (PowerSGD: no bucket plan to play). The others are marked dropped. Ranks are
    given in predicted order."""
    predicted = sorted((c for c in cands if c.predicted_ms is not None), key=lambda c: c.predicted_ms)
    for i, c in enumerate(predicted):
        c.predicted_rank = i + 1
    kept: list = [c for c in predicted if c.name in keep]
    families: set[str] = set()
    for c in predicted:
        if c in kept:
            continue
        if family(syncs[c.name]) not in families and c.predicted_ms <= FAMILY_SLACK * predicted[0].predicted_ms:
            kept.append(c)
            families.add(family(syncs[c.name]))
    kept += [c for c in predicted if c not in kept][:max(0, top_k - len(kept))]
    kept.sort(key=lambda c: c.predicted_ms)
    for c in predicted:
        if c not in kept:
            c.status = "dropped: predicted"
            c.reason = (f"predicted {c.predicted_ms:.0f} ms, rank {c.predicted_rank} of {len(predicted)}; measured: "
                        f"each family's best within {FAMILY_SLACK}x of the best, and up to {top_k} in all")
    return kept + [c for c in cands if c.predicted_ms is None]
