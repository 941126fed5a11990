"""The reference step: the one synchronized step of a recorded run that every prediction is replayed on (its
compute phases from steps.jsonl, its buckets' ready, launch and completion times from buckets.jsonl), and the
gradient-ready curve it gives.

By default it is the run's typical steady step (`dtrain.analysis.runs.typical_step`); `--step` names one, `--median` makes
a synthetic step of the steady steps' medians.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from dtrain.analysis.plans import meta_model, ready_params, schedule_of
from dtrain.analysis.runs import Run, slowest_rank_records, typical_step
from dtrain.collectives import strategies
from dtrain.collectives.schedule import IN_BACKWARD, Schedule
from dtrain.collectives.timeline import ReadyCurve, through
from dtrain.common.errors import UserError

SPLIT_PARTS = ("projection", "lookup")  # the `part` of a split tied embedding's records (`dtrain.collectives.tied_split`)


@dataclass
class ReferenceStep:
    """One synchronized step as the simulator uses it (ms)."""

    step: int  # 0 for a synthetic step (medians, or a FLOP estimate)
    data_ms: float
    forward_ms: float
    backward_ms: float  # all micro-batches
    optimizer_ms: float
    exposed_ms: float
    step_ms: float
    accum_steps: int = 1
    records: list[dict] = field(default_factory=list)  # buckets.jsonl rows of this step
    # what the run's strategy sent (its schedule; None where it has none): its host work is in this step's compute
    schedule: Schedule | None = field(default=None, repr=False)
    notes: list[str] = field(default_factory=list)

    @property
    def sync_backward_ms(self) -> float:
        """When the synchronized (last) micro-batch's backward ends, on the clock of the ready times: the
        reducer's clock starts at the first gradient hook, after the loss and generator backward, so it is when
        `wait()` started where the records say, else the trainer's backward time."""
        starts = [r["wait_start_ms"] for r in self.records if r.get("wait_start_ms") is not None]
        return max(starts) if starts else self.backward_ms / self.accum_steps

    @property
    def compute_start_ms(self) -> float:
        """When the last rank's backward starts, on this rank's clock (`slowest_rank_records`; 0 where the run has
        no other rank's records): a gradient ready "at the start of backward" is ready on every rank then."""
        return max([0.0, *(r.get("last_backward_start_ms") or 0.0 for r in self.records)])

    @property
    def compute_end_ms(self) -> float:
        """When the last rank's backward ends, on the same clock (`slowest_rank_records`; this rank's where the
        run has no other rank's records): until then some rank computes, and on a machine whose ranks share cores
        the collectives run slower."""
        last = [r["last_wait_start_ms"] for r in self.records if r.get("last_wait_start_ms") is not None]
        return max([self.sync_backward_ms, *last])

    @property
    def projection_ready_ms(self) -> float | None:
        """When a split tied embedding's projection part was ready in this step (its record, `tied_split`; the latest
        rank's where the run recorded every rank's), None where the step has no such record. It is not the start of
        backward: the clock starts as the model's output gets its gradient, and the generator's backward runs
        before the projection part exists (the log-softmax's over V logits per token, then the (tokens, V) x
        (tokens, d) product that makes the (V, d) weight gradient)."""
        ready = [r["ready_ms"] for r in self.records if r.get("part") == "projection" and r.get("ready_ms") is not None]
        return max(ready) if ready else None

    def split_ready_ms(self, curve: ReadyCurve) -> float:
        """When a split tied embedding's bucket (its projection part) is ready on every rank: this step's record
        where it has one (`projection_ready_ms`), else the start of backward as `curve` has it (a step without the
        split does not show when the generator's backward ended)."""
        recorded = self.projection_ready_ms
        return curve.at(0) if recorded is None else recorded

    @property
    def compute_ms(self) -> float:
        return self.data_ms + self.forward_ms + self.backward_ms + self.optimizer_ms

    @property
    def split_lookups(self) -> int:
        """How many lookups of a split tied embedding this step recorded (`tied_split`: one record each)."""
        return sum(r.get("part") == "lookup" for r in self.records)

    @property
    def lookup_rows(self) -> list[tuple[float, int]]:
        """A split tied embedding's lookups' rows as this step recorded them: (ready ms, bytes) per lookup that sent
        any."""
        return [(r["ready_ms"], r["bytes"]) for r in self.records
                if r.get("part") == "lookup" and r.get("ready_ms") is not None]

    @property
    def split_host_ms(self) -> float:
        """The split's own work on the computing thread in this step (`tied_split`'s records: each lookup's mask in
        forward, its rows in backward, adding them), which the same model without the split does not do; 0 where
        the step has no split, or its records predate the measurement."""
        return sum(r.get("host_ms") or 0.0 for r in self.records if r.get("part") == "lookup")


def reference_step(run: Run, step: int | None = None, warmup: int | None = None, median: bool = False,
                   steps: list[int] | None = None) -> ReferenceStep:
    """The step to replay: `step`, or the most typical of the steady steps with bucket records (`typical_step`);
    with `median`, a synthetic step of the steady steps' medians, phase by phase and bucket time by bucket time
    (a steadier basis on a noisy machine than any single step); with `steps`, the same of those steps only."""
    steady = run.steady_steps(warmup)
    if steps is not None:
        return _median_step(run, [s for s in steady if s["step"] in set(steps)])
    if median:
        return _median_step(run, steady)
    if step is not None:
        chosen = next((s for s in run.steps if s["step"] == step), None)
        if chosen is None:
            raise UserError(f"{run.path}: no step {step} in steps.jsonl")
    else:
        chosen = typical_step(run, [s for s in steady if s["step"] in run.buckets] or steady)
    records, delay = slowest_rank_records(run, chosen["step"])
    ref = ReferenceStep(chosen["step"], chosen.get("data_ms", 0.0), chosen["forward_ms"], chosen["backward_ms"],
                        chosen["optimizer_ms"], chosen.get("comm_exposed_ms", 0.0), chosen["step_ms"],
                        run.cfg.train.accum_steps, records)
    if delay is not None:
        ref.notes.append(f"ready and launch times: the latest of {len(run.rank_buckets) + 1} ranks (the others "
                         f"delayed a launch by up to {max(0.0, delay):.1f} ms)")
    return _own_schedule(run, ref)


def _median_step(run: Run, steady: list[dict]) -> ReferenceStep:
    def med(rows, k):
        return statistics.median(r.get(k) or 0.0 for r in rows)

    ref = ReferenceStep(0, med(steady, "data_ms"), med(steady, "forward_ms"), med(steady, "backward_ms"),
                        med(steady, "optimizer_ms"), med(steady, "comm_exposed_ms"), med(steady, "step_ms"),
                        run.cfg.train.accum_steps)
    layouts = [slowest_rank_records(run, s["step"])[0] for s in steady if s["step"] in run.buckets]
    if layouts:
        shape = statistics.mode(tuple(r["numel"] for r in lay) for lay in layouts)
        layouts = [lay for lay in layouts if tuple(r["numel"] for r in lay) == shape]
        for i, first in enumerate(layouts[0]):
            rec = dict(first)
            for k in ("ready_ms", "launch_ms", "complete_ms", "wait_start_ms", "host_ms"):
                vals = [lay[i][k] for lay in layouts if lay[i].get(k) is not None]
                rec[k] = statistics.median(vals) if vals else None
            ref.records.append(rec)
    ref.notes.append(f"profile: medians of {len(steady)} steady steps ({len(layouts)} with bucket records)")
    return _own_schedule(run, ref)


def _own_schedule(run: Run, ref: ReferenceStep) -> ReferenceStep:
    """`ref` with the run's schedule (None for a strategy without one, as powersgd), and its backward without the
    communication the run's strategy waits for inside it (its collectives waited by `backward()`: DDP's): its
    backward time holds that exposed communication, and the last gradient's ready time is the end of the compute."""
    try:
        ref.schedule = strategies.schedule_for(run.cfg.sync, meta_model(run.cfg, run.vocab), max(2, run.world),
                                               run.cfg.train.accum_steps, run.ranks_per_node)
    except UserError:  # where it waits is not known: its backward is taken as recorded
        ref.schedule = None
    if ref.schedule is not None and any(c.waits == IN_BACKWARD for c in ref.schedule.collectives):
        readies = [r["ready_ms"] for r in ref.records if r.get("ready_ms") is not None]
        if readies:
            ref.backward_ms = max(readies) * ref.accum_steps
            ref.notes.append(f"{run.strategy} profile: backward compute taken as the last bucket's ready time")
        else:
            ref.notes.append(f"{run.strategy} profile without bucket timings: backward includes the communication "
                             "it waits for inside backward()")
    return ref


def ready_curve(run: Run, ref: ReferenceStep) -> ReadyCurve:
    """The reference step's ready curve. Bucket positions come from re-planning the run's own strategy when that
    plan matches the recorded bucket sizes, else the buckets are taken as contiguous in ready order."""
    params = ready_params(run.cfg, run.vocab)
    total = sum(p.numel() for _, p in params)
    # A split tied embedding's parts (`tied_split`) are not where the embedding sits in ready order: its projection
    # part is ready first, its lookups' rows as each lookup's backward ends. The curve is the rest's; the embedding
    # keeps its place at the end of the ready order (its encoder lookup, the last gradient computed).
    recs = [r for r in ref.records if r.get("ready_ms") is not None and r.get("part") not in SPLIT_PARTS]
    if not recs:
        ref.notes.append("no per-bucket ready times: gradients assumed ready uniformly over backward")
        return ReadyCurve.uniform(total, ref.sync_backward_ms)
    xs = None
    try:
        plan = schedule_of(run.cfg, vocab=run.vocab, world=max(2, run.world), ranks_per_node=run.ranks_per_node).buckets
        if [b.numel for b in plan] == [r["numel"] for r in ref.records]:
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
    # Nothing is ready before the last rank's backward starts (its ready times are no earlier than that)
    start = min(ref.compute_start_ms, min(r["ready_ms"] for r in recs))
    pts = [(0, start)] + [(x, r["ready_ms"]) for x, r in zip(xs, recs)]
    pts.append((total, max(ref.sync_backward_ms, max(t for _, t in pts))))
    return ReadyCurve(pts, source)
