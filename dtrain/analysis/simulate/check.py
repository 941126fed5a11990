"""The check against measurement: each measured configuration's median step (with its interval) beside the
prediction for its own configuration, the speed adjustment for a machine whose speed drifted between runs, the
pairwise ranking of predictions against measurement, and the check repeated with every steady step as the
reference step.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from dtrain.analysis.plans import schedule_of
from dtrain.analysis.runs import Run
from dtrain.analysis.simulate.calibration import Calibration, calibrate
from dtrain.analysis.simulate.predict import Prediction, predict
from dtrain.analysis.simulate.reference import ReferenceStep, ready_curve, reference_step
from dtrain.collectives import strategies
from dtrain.collectives.timeline import ReadyCurve
from dtrain.common.errors import UserError
from dtrain.common.stats import median_ci, paired_median

PREDICTED_TIE = 0.005  # relative
MIN_PAIRED = 10  # common steps for a paired comparison


def run_level(values: list[float]) -> tuple[float, tuple[float, float]]:
    """The median of per-run medians and its interval: the lowest to the highest run median. With repeats, runs
    are the independent units: steps of one run share the machine's state of those minutes (a shared machine's
    speed drifts over minutes), so intervals from pooled steps would be far too narrow. For n runs the range
    holds the true median with probability 1 - 2·0.5^n (75 % for 3, 94 % for 5)."""
    return statistics.median(values), (min(values), max(values))


def measured_runs(measured: list[Run], ref_run: Run, ref: ReferenceStep, curve: ReadyCurve, model,
                  calib: Calibration, warmup: int | None) -> list[Prediction]:
    """For each measured configuration: the median steady step and exposed time, next to the prediction for its own
    configuration (same strategy, caps and classes) played on the reference step. Runs of the same resolved profile
    (repeats, e.g. the rounds of a sweep run into several folders) are taken together: the median of their run
    medians, with the range of run medians as its interval (`run_level`); one run: its steps' median and the order-
    statistics interval.

    Each is also given speed-adjusted: every run's step time scaled by the reference run's median forward over its
    own. The forward pass does identical work under every strategy (same seed, same batches, no communication), so
    that ratio is the machine's speed during the run relative to the reference run; the adjusted figure asks whether
    the model is right about communication and overlap when the machine's drift is taken out. It is a correction of
    the measurement, labelled as such, not a fit: nothing in the model changes. It holds only where the forward pass
    is untouched by the strategy: on a CPU machine whose speed drifts, yes; with two ranks time-slicing one GPU, no
    (the other rank's collectives take the GPU's time slices, and the forward time then measures that)."""
    groups: dict[str, list[Run]] = {}
    for run in measured:
        groups.setdefault(run.cfg.config_hash(), []).append(run)
    ref_forward = statistics.median(s["forward_ms"] for s in ref_run.steady_steps(warmup))
    out = []
    for runs in groups.values():
        cfg = _with_layout(runs[0])
        per_run = [run.steady_steps(warmup) for run in runs]
        cap = cfg.sync.bucket_cap_mb
        pred = predict(cfg, ref, curve, model, calib, runs[0].strategy, cap, ref_run.vocab)
        pred.cap_mb = cap if strategies.get(runs[0].strategy).uses_cap else None
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


def _with_layout(run: Run):
    """The run's config, with the ranks per node its hierarchical plan ran on (`Run.ranks_per_node`, from run.json)
    where the config left them to torchrun's layout."""
    cfg = run.cfg
    if cfg.sync.hierarchical and cfg.sync.ranks_per_node is None and run.ranks_per_node:
        cfg = dataclasses.replace(cfg, sync=dataclasses.replace(cfg.sync, ranks_per_node=run.ranks_per_node))
    return cfg


def speed_probe(ref: ReferenceStep, measured: list[Prediction]) -> str:
    """Forward and optimizer do the same local compute under every strategy: when their time differs between the
    reference run and the measured runs, the machine's speed changed between them, and that shows up as error."""
    opt = [r.measured_optimizer_ms for r in measured]
    speeds = [r.speed for r in measured if r.speed is not None]
    return (f"machine-speed probes (compute only, the same work in every run): optimizer step profiled "
            f"{ref.optimizer_ms:.1f} ms, measured configurations {min(opt):.1f}-{max(opt):.1f} ms; forward relative "
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


def paired(a: Prediction, b: Prediction) -> tuple[float, float, float] | None:
    """Configurations measured in the same interleaved job(s) ran each step within seconds of each other: the
    median of their step-by-step differences (a - b, ms) and its ~95% order-statistics interval; the machine's drift
    cancels in each difference. None when they share fewer than `MIN_PAIRED` steps."""
    common = a.samples.keys() & b.samples.keys()
    if len(common) < MIN_PAIRED:
        return None
    keys = sorted(common)
    return paired_median([a.samples[k] for k in keys], [b.samples[k] for k in keys])


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


def order_changes(rows: list[Prediction], other: list[Prediction]) -> list[tuple[str, str]]:
    """The pairs that two sets of predictions of the same configurations (under two cost models) order oppositely,
    each by more than `PREDICTED_TIE`: (the one the first set puts ahead, the other). Predictions are matched by
    label, the sweep's apart from the measured configurations'."""
    def key(r: Prediction) -> tuple[str, bool]:
        return r.label, r.run is not None

    theirs = {key(r): r.step_ms for r in other}
    mine = [(key(r), r.step_ms) for r in rows if key(r) in theirs]

    def ahead(x: float, y: float) -> int:  # 1: x faster, -1: y faster, 0: within the tie
        return 0 if abs(x - y) <= PREDICTED_TIE * min(x, y) else (1 if x < y else -1)

    out = []
    for i, (ka, a) in enumerate(mine):
        for kb, b in mine[i + 1:]:
            here, there = ahead(a, b), ahead(theirs[ka], theirs[kb])
            if here and there and here != there:
                out.append((ka[0], kb[0]) if here > 0 else (kb[0], ka[0]))
    return out


@dataclass
class EveryStep:
    """The check against measurement repeated with each steady step of the reference run as the reference step:
    how much the verdict depends on which step is the reference."""

    steps: int
    max_err: list[float]  # per reference step: the largest |error| over the measured configurations, %
    discordant: list[int]  # per reference step: pairs ordered differently
    separated: list[int]  # per reference step: pairs measurement and model both order
    frequent: list[tuple[str, str, int]]  # the discordant pairs, with how many reference steps they are discordant in
    pool: int = 1  # consecutive steady steps whose predictions are pooled (`pooled`) in each window

    def lines(self) -> list[str]:
        e, d = sorted(self.max_err), self.discordant
        what = ("step of the profiled run as the profiled step" if self.pool == 1 else
                f"window of {self.pool} steps of the profiled run, the median of their steps' predictions")
        return [f"every steady {what} ({self.steps}): max |err| median "
                f"{statistics.median(e):.1f}% (range {e[0]:.1f}-{e[-1]:.1f}%), within 15% for "
                f"{sum(x <= 15 for x in e)}; discordant pairs mean {statistics.mean(d):.2f} (none for "
                f"{sum(x == 0 for x in d)}, at most one for {sum(x <= 1 for x in d)}) of "
                f"{statistics.median(self.separated):g} separated (median)",
                *(f"  discordant with {n} of {self.steps} profiled steps: {a} vs {b}" for a, b, n in self.frequent[:5])]


def recorded_steps(run: Run, warmup: int | None) -> list[dict]:
    """The run's steady steps that have bucket records: the steps a prediction can be played on (none: a run that
    recorded no buckets, whose typical step alone can be replayed, from its phases)."""
    return [s for s in run.steady_steps(warmup) if run.buckets.get(s["step"])]


def each_step(run: Run, model, host_cost: bool, lanes: int, warmup: int | None,
              play: Callable[[ReferenceStep, ReadyCurve, Calibration], list[Prediction]],
              calibrated: bool = True, steps: list[dict] | None = None) -> list[list[Prediction]]:
    """`play`'s predictions with each of `steps` (default: the run's `recorded_steps`) as the reference step (its
    ready curve, and its own calibration unless not `calibrated`), in step order."""
    steps = recorded_steps(run, warmup) if steps is None else steps
    if not steps:
        raise UserError(f"{run.path}: no steady step with bucket records to profile")
    class_groups = schedule_of(run.cfg, world=run.world, ranks_per_node=run.ranks_per_node).class_groups
    out = []
    for s in steps:
        ref = reference_step(run, s["step"], warmup)
        calib = (calibrate(ref, model, host_cost, lanes, class_groups) if calibrated
                 else Calibration(note="off", lanes=lanes))
        calib.streams = not run.on_cpu
        out.append(play(ref, ready_curve(run, ref), calib))
    return out


def pooled(per_step: list[list[Prediction]]) -> list[Prediction]:
    """Each configuration's median prediction over several reference steps (`per_step`: one list of predictions
    per step, the configurations in the same order). A measured median step is the median over steps that each ran
    on their own batch at that minute's machine speed; each reference step's prediction carries the same for that
    step (in an interleaved job, the very batch and minute of the measured configurations' same step), so the median
    of the predictions is what the measured median is to be set against, and no one step decides it."""
    out = []
    for rows in zip(*per_step):
        p = dataclasses.replace(rows[0])
        p.step_ms, p.comm_ms, p.exposed_ms = (statistics.median(getattr(r, k) for r in rows)
                                              for k in ("step_ms", "comm_ms", "exposed_ms"))
        out.append(p)
    return out


def every_step(runs: list[Run], model, measured: list[Run], host_cost: bool, lanes: int,
               warmup: int | None, pool: int = 1, per_run: list[list[list[Prediction]]] | None = None) -> EveryStep:
    """`EveryStep` over the reference runs' steady steps that have bucket records; with `pool` > 1, over each window
    of that many consecutive such steps of one run, each configuration's prediction the median over the window's
    steps (`pooled`). `per_run`: the measured configurations' predictions per run and step where they were already
    played (`each_step` with calibration), else they are played here."""
    errs, disc, sep, count = [], [], [], {}
    for i, run in enumerate(runs):
        steps = recorded_steps(run, warmup)
        if steps and pool > len(steps):
            raise UserError(f"{run.path}: --pool {pool} needs that many steady steps with bucket records, it has "
                            f"{len(steps)}")

        def play(ref, curve, calib, run=run):
            return measured_runs(measured, run, ref, curve, model, calib, warmup)

        per_step = per_run[i] if per_run is not None else each_step(run, model, host_cost, lanes, warmup, play,
                                                                     steps=steps)
        for j in range(len(per_step) - pool + 1):
            rows = pooled(per_step[j: j + pool])
            rk = ranking(rows)
            errs.append(max(abs(error_pct(r.step_ms, r.measured_step_ms)) for r in rows))
            disc.append(len(rk.discordant))
            sep.append(rk.pairs - rk.ties)
            for pair in rk.discordant:
                count[pair] = count.get(pair, 0) + 1
    frequent = sorted(((a, b, n) for (a, b), n in count.items()), key=lambda t: -t[2])
    return EveryStep(len(errs), errs, disc, sep, frequent, pool)


def error_pct(predicted: float, measured: float) -> float:
    return 100 * (predicted - measured) / measured
