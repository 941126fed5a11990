"""The report's sections: what one section is (a figure or a formatted table, its caption, or the note saying why
it is missing) and the builder of each, which captions a table of `dtrain.analysis.report.tables` and draws it
(`dtrain.analysis.plots`).

Captions give the axes, their units and the machine the runs were measured on (run.json), and label whatever the
cost model supplied MODELED. `dtrain.analysis.report` puts the sections in order and writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from dtrain.analysis import plots, significance
from dtrain.analysis.report.tables import (allreduce_size_table, bleu_points, breakdown_table, busbw_table,
                                           network_model, pick_timeline_run, quality_table, step_vs_bucket_table,
                                           timeline_table, train_loss_table, validation_table)
from dtrain.analysis.runs import Run, steady_text
from dtrain.collectives import strategies


@dataclass
class Section:
    """One section of the report: its table, its figure or the table formatted as text, its caption, or the note
    saying why it is missing."""

    key: str  # file stem of its PNG, SVG and CSV
    title: str
    caption: str = ""
    table: pd.DataFrame | None = None
    figure: object = None  # matplotlib Figure
    note: str = ""  # why the figure was skipped (no figure then)
    display: pd.DataFrame | None = None  # a table section: `table` formatted as text, shown in place of a figure


def machines(runs: list[Run]) -> str:
    """Where the runs ran, each machine once, for captions."""
    seen = list(dict.fromkeys(r.machine for r in runs if r.header))
    return "; ".join(seen) if seen else "no run"


def fmt(v) -> str:
    """A table cell as text: three significant digits below 100, whole numbers above, NaN as nothing."""
    if isinstance(v, (float, np.floating)):
        return "" if np.isnan(v) else f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def missing(key: str, title: str, why: str, table: pd.DataFrame | None = None) -> Section:
    return Section(key, title, table=table, note=f"skipped: {why}")


def section_step_vs_bucket(runs: list[Run], summary: pd.DataFrame, warmup: int | None) -> Section:
    key, title = "step_vs_bucket", "Step time versus bucket size, per strategy"
    t = step_vs_bucket_table(summary)
    if t.empty:
        return missing(key, title, "no run has step records")
    # Those drawn as horizontal lines. `auto` is left out: it picks one of the others, and its runs record that one.
    uncapped = ", ".join(n for n, cls in ((n, strategies.get(n)) for n in strategies.attachable())
                         if not cls.uses_cap and cls.communicates)
    caption = (f"x: bucket size cap (MiB, sync.bucket_cap_mb, log scale); y: step time (ms), median with a whisker "
               f"to the p95, over each run's steady steps ({steady_text(warmup)}). One line per strategy; "
               f"strategies without a cap ({uncapped}) are dashed horizontal lines, and the no-communication baseline "
               f"(dotted, black) is headroom, not a result. Measured on: {machines(runs)}.")
    return Section(key, title, caption, t, plots.step_vs_bucket(t))


def section_busbw(bench: list[Path], topology: str | None, runs: list[Run] = ()) -> Section:
    key, title = "busbw", "Bus bandwidth versus message size: measured and modeled"
    if not bench and not topology:
        return missing(key, title, "no benchmark file (--bench) and no --topology")
    t, described = busbw_table(bench, topology)
    if t.empty:
        return missing(key, title, "the benchmark files hold no rows")
    # The benchmark's rows do not say where they ran; one a sweep ran sits beside that sweep's runs.
    beside = [r for r in runs if r.path.parent in {b.parent for b in bench}]
    where = f"measured on: {machines(beside)}" if beside else "machine not recorded in the benchmark file"
    measured = (f"dtrain.collectives.bench ({', '.join(map(str, bench))}), {where}") if bench else \
        "nothing measured (no --bench given): modeled curves only"
    model = (f"Dashed curves are MODELED, not measured: the NCCL cost model's fastest algorithm per protocol "
             f"(LL, LL128, Simple) for {described}.") if topology else ""
    caption = (f"x: message size (bytes, log scale); y: all-reduce bus bandwidth (GB/s, nccl-tests' busbw = algbw x "
               f"2(n-1)/n, log scale). Solid: {measured}. {model}")
    return Section(key, title, caption, t, plots.busbw(t))


def section_allreduce_size(runs: list[Run], bench: list[Path], topology: str | None) -> Section:
    key, title = "allreduce_size", "All-reduce time versus bucket size, per strategy: measured and modeled"
    model, how = network_model(bench, topology)
    t = allreduce_size_table(runs, model)
    if t.empty:
        return missing(key, title, "no run recorded per-bucket launch and completion times (buckets.jsonl)")
    measured = t[t["kind"] == "measured"]
    shown = [r for r in runs if r.label in set(measured["run"])]
    left = sorted({r.strategy for r in runs if r.communicates} - set(measured["strategy"]))
    model_text = (f"Dashed black curve: MODELED, not measured: the cost model's time for one all-reduce of that "
                  f"size ({model.ranks or '?'} ranks), {how}." if model is not None else
                  "No modeled curve: no benchmark beside the runs and no --topology.")
    caption = (f"x: bucket size (bytes on the wire, log scale); y: all-reduce time (ms, log scale), from the bucket's "
               f"launch to its completion, which includes waiting behind buckets launched earlier on the same "
               f"communicator. One point per recorded bucket and step (rank 0's records, warm-up steps "
               f"included), coloured by tensor class; one panel per strategy. {model_text}"
               + (f" Strategies without bucket timings: {', '.join(left)}." if left else "")
               + f" Measured on: {machines(shown)}.")
    return Section(key, title, caption, t, plots.allreduce_size(t))


def section_breakdown(runs: list[Run], warmup: int | None) -> Section:
    key, title = "breakdown", "Step-time breakdown per configuration"
    t = breakdown_table(runs, warmup)
    if t.empty:
        return missing(key, title, "no run has per-phase step times")
    caption = ("x: configuration (run); y: mean time per step (ms), stacked: data loading, forward, backward, "
               "exposed communication (time in wait() before the optimizer), optimizer, and the rest of the step "
               f"(other). Means over the steady steps ({steady_text(warmup)}), so the stack adds up to the mean "
               "step. DDP all-reduces inside its backward, so its communication shows in 'backward'. Hatched bars: "
               f"the no-communication baseline, headroom only. Measured on: {machines(runs)}.")
    return Section(key, title, caption, t, plots.breakdown(t))


def section_timeline(runs: list[Run], warmup: int | None, wanted: str | None) -> Section:
    key, title = "timeline", "One step's gradient buckets against the backward pass"
    run = pick_timeline_run(runs, wanted)
    if run is None:
        return missing(key, title, "no run recorded per-bucket launch and completion times (buckets.jsonl)")
    t, step, backward_end = timeline_table(run, warmup)
    caption = (f"Run {run.label} ({run.series}), step {step} (its most typical steady step: nearest the run's "
               "medians of forward, backward, exposed communication and step time). x: time since the "
               "start of the synchronized backward (ms); y: bucket index (in launch order). Tick: the bucket's "
               "gradients are all ready; thin line: waiting for the buckets before it to launch; bar: from launch "
               "to completion of its all-reduce, coloured by tensor class. Grey span: the backward pass; dashed "
               f"line: wait() called by the optimizer. Measured on: {run.machine}.")
    return Section(key, title, caption, t, plots.timeline(t, backward_end, f"{run.label}: step {step}"))


def section_pareto(runs: list[Run], warmup: int | None, target: float | None) -> Section:
    key, title = "pareto", "BLEU versus speed, Pareto front marked"
    t, target = quality_table(runs, warmup, target)
    if t.empty:
        return missing(key, title, "no communicating run has a BLEU score (eval.jsonl kind 'bleu')")
    splits = ", ".join(sorted({str(s) for s in t["split"].dropna()})) or "?"
    shown = [r for r in runs if r.label in set(t["label"])]
    caption = (f"y: BLEU (sacreBLEU, split {splits}). Left, x: median step time per 1,000 target tokens of rank 0 "
               f"(ms, over the steady steps: {steady_text(warmup)}; with equal batches this orders runs as step "
               "time does, and it stays comparable when a run accumulates several micro-batches per step); "
               f"right, x: training time to a validation loss of {target:.3f} nats/token (s, the sum of step times "
               "up to the first validation at or below it; the default target is the worst of the runs' best "
               "validation losses, so every run reaches it). Red: the Pareto front (nothing else is both faster and "
               "better). The no-communication baseline is never scored. "
               f"Measured on: {machines(shown)}.")
    return Section(key, title, caption, t, plots.pareto(t))


# Said of both curve figures: why a run's line may hide another's, and why the baseline is missing.
CURVES_NOTE = ("One line per run, each its own colour and dash pattern: runs that computed the same updates (lossless "
               "strategies from one seed) draw the same curve, one over the other. The no-communication baseline is "
               "left out: its ranks never combine their gradients, so its losses are not a result.")


def sections_curves(runs: list[Run]) -> list[Section]:
    """Training loss against step, and validation loss (with BLEU where a run was scored at several steps) against
    step, for every communicating run, each run drawn alike in both."""
    styles = plots.run_styles([r.label for r in runs if r.communicates])
    return [section_train_loss(runs, styles), section_validation(runs, styles)]


def section_train_loss(runs: list[Run], styles: dict[str, dict]) -> Section:
    key, title = "train_loss", "Training loss against step"
    t = train_loss_table(runs)
    if t.empty:
        return missing(key, title, "no communicating run has step records with a training loss")
    shown = [r for r in runs if r.label in set(t["run"])]
    caption = ("x: optimizer step; y: training loss (nats per target token): rank 0's, the mean over the target "
               "tokens of its own micro-batches of that step, not averaged across ranks. Every step as recorded, "
               f"nothing smoothed; a non-finite loss leaves a gap. {CURVES_NOTE} Measured on: {machines(shown)}.")
    return Section(key, title, caption, t, plots.train_loss(t, styles))


def section_validation(runs: list[Run], styles: dict[str, dict]) -> Section:
    key, title = "validation", "Validation loss against step"
    t = validation_table(runs)
    if t["val_nll"].isna().all():
        return missing(key, title, "no communicating run has validation records (eval.jsonl kind 'val')")
    shown = [r for r in runs if r.label in set(t["run"])]
    with_bleu = bleu_points(t) >= 2
    if with_bleu:
        title = "Validation loss and BLEU against step"
        splits = ", ".join(sorted({str(r.bleu.get("split")) for r in shown if r.bleu}))
        bleu = (f"Right, y: BLEU (sacreBLEU, split {splits}) at each step a run was scored at, from the run's "
                "records (a score taken afterwards, with no step, is left out).")
    else:
        bleu = ("BLEU is not drawn: no run was scored at more than one step (the Runs table gives each run's "
                "final score).")
    caption = (f"x: optimizer step; {'left, ' if with_bleu else ''}y: validation loss (nats per target token: the "
               "negative log-likelihood over the whole validation split, every rank's share summed), a point at "
               f"each validation (every train.val_every steps and after the last), joined by lines. {bleu} "
               f"{CURVES_NOTE} Measured on: {machines(shown)}.")
    return Section(key, title, caption, t, plots.validation(t, styles, with_bleu))


def sections_significance(runs: list[Run], baseline: str | None) -> list[Section]:
    """BLEU with 95% intervals and sacreBLEU's paired bootstrap test against a baseline run (`dtrain.analysis.significance`),
    and the spread across seeds where a configuration has several. Only when some run kept its translations
    (hyps.<split>.txt): the report of runs never decoded has no such section."""
    key, title = "bleu_significance", "BLEU with 95% confidence intervals, paired against a baseline"
    if not any(significance.has_hypotheses(r) for r in runs):
        return []
    try:
        a = significance.analyse(runs, baseline=baseline, strict=False)
    except significance.NotComparable as e:
        return [missing(key, title, str(e))]
    out = [Section(key, title, a.caption(), a.paired, display=significance.display_paired(a.paired))]
    if len(a.seeds):
        out.append(Section("bleu_seeds", "BLEU across seeds, per configuration",
                           f"Mean BLEU on split {a.split} over each configuration's seeds, its sample standard "
                           "deviation and range; Δ mean: against the baseline configuration "
                           f"({a.baseline.configuration}); significant seeds: of its runs paired with the baseline "
                           f"configuration's run of the same seed, those with p < {significance.ALPHA}.",
                           a.seeds, display=significance.display_seeds(a.seeds)))
    return out
