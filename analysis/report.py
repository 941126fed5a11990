"""The trade-off report: every run's records (and benchmark rows) → tables, figures, Markdown and HTML.

Last stage of the pipeline. Each figure is built from a table that is written beside it as CSV, and captioned with
its axes, units and the machine it was measured on (run.json). Runs of the no-communication baseline appear in timing
figures as headroom and never in quality figures. A figure whose data is missing is skipped with a note. Runs that
kept their translations (hyps.<split>.txt) also get a table of BLEU with 95% confidence intervals and paired
significance against a baseline run (`analysis.significance`).

    python -m analysis.report runs/sweep-lossless-buckets --out reports/lossless
    python -m analysis.report runs/sweep-bleu-cost --bench runs/bench.json --topology h100x8-ib:2 --out reports/bleu
"""

from __future__ import annotations

import argparse
import html
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import plots, significance
from analysis.runs import PHASES, Run, find_runs, load_run, steady_text, typical_step
from collectives import costmodel as cm
from collectives import strategies
from collectives.costmodel.loading import is_fit_spec
from common.errors import UserError, exit_on_user_error
from common.files import output_dir

PROG = "analysis.report"


@dataclass
class Section:
    """One figure of the report: its table, its caption, or the note saying why it is missing."""

    key: str  # file stem of its PNG, SVG and CSV
    title: str
    caption: str = ""
    table: pd.DataFrame | None = None
    figure: object = None  # matplotlib Figure
    note: str = ""  # why the figure was skipped (no figure then)
    display: pd.DataFrame | None = None  # a table section: `table` formatted as text, shown in place of a figure


def machines(runs: list[Run]) -> str:
    seen = list(dict.fromkeys(r.machine for r in runs if r.header))
    return "; ".join(seen) if seen else "no run"


def _pct(values: pd.Series, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def load_bench(path: str | Path) -> pd.DataFrame:
    """Rows of a `collectives.bench` JSON/CSV (or an nccl-tests log): size (B), time_us, algbw, busbw (GB/s), label
    (the code path, raw or reducer, when both were measured). Rows that failed the correctness pass are left out."""
    ms = cm.read_measurements(path)
    df = pd.DataFrame([vars(m) for m in ms.rows])
    df["source"] = str(path)
    df["ranks"] = ms.ranks
    return df


# ---------------------------------------------------------------------------------------------------------------
# Tables


def summary_table(runs: list[Run], warmup: int | None) -> pd.DataFrame:
    """One row per run: what it was and its median / p95 step, its exposed communication and its quality."""
    rows = []
    for r in runs:
        m = r.steady_frame(warmup)
        bleu = r.bleu
        val = r.val
        rows.append({
            "run": r.label, "series": r.series, "strategy": r.strategy, "bucket_cap_mb": r.bucket_cap_mb,
            "headroom": not r.communicates, "steps": len(r.steps), "measured_steps": len(m),
            "median_ms": float(m["step_ms"].median()) if len(m) else np.nan,
            "p95_ms": _pct(m["step_ms"], 95) if len(m) else np.nan,
            "exposed_ms": float(m["comm_exposed_ms"].median()) if len(m) and "comm_exposed_ms" in m else np.nan,
            "train_s": float(r.step_frame["step_ms"].sum() / 1000) if len(r.steps) else np.nan,
            "val_nll": float(val["val_nll"].iloc[-1]) if len(val) else np.nan,
            "bleu": bleu.get("bleu") if bleu and r.communicates else np.nan,
            "failed": r.launch.get("exit_code") not in (None, 0),
        })
    return pd.DataFrame(rows)


def step_vs_bucket_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary grouped by (series, bucket cap): repeated runs of one configuration pooled by their medians."""
    s = summary.dropna(subset=["median_ms"])
    if s.empty:
        return s
    key = s["bucket_cap_mb"].fillna(-1.0)  # groupby drops NaN keys; -1 stands for "no cap" and is undone below
    g = s.assign(cap_key=key).groupby(["series", "cap_key", "headroom"], as_index=False).agg(
        strategy=("strategy", "first"), median_ms=("median_ms", "median"), p95_ms=("p95_ms", "median"),
        runs=("run", "count"))
    g["bucket_cap_mb"] = g["cap_key"].where(g["cap_key"] >= 0)
    return g.drop(columns="cap_key")[["series", "strategy", "bucket_cap_mb", "headroom", "median_ms", "p95_ms",
                                      "runs"]]


def breakdown_table(runs: list[Run], warmup: int | None) -> pd.DataFrame:
    """Mean of each phase per run: means add up (medians do not: the median step is not the sum of the phases'
    medians), so 'other' is the time a step spends outside the timed phases (loss readback, zero_grad)."""
    rows = []
    for r in runs:
        m = r.steady_frame(warmup)
        if m.empty or not all(p in m for p in PHASES):
            continue
        row = {"label": r.label, "headroom": not r.communicates, **{p: float(m[p].mean()) for p in PHASES}}
        row["step_ms"] = float(m["step_ms"].mean())
        row["other_ms"] = max(0.0, row["step_ms"] - sum(row[p] for p in PHASES))
        rows.append(row)
    return pd.DataFrame(rows)


def pick_timeline_run(runs: list[Run], wanted: str | None) -> Run | None:
    """The named run, else the first with per-bucket timestamps, preferring per_class (the classes show)."""
    if wanted:
        for r in runs:
            if wanted in (r.label, r.path.name, str(r.path)):
                return r
        raise UserError(f"--timeline '{wanted}': no such run among the inputs")
    timed = [r for r in runs if r.steps  # and step records to pick from
             and any(b.get("launch_ms") is not None for recs in r.buckets.values() for b in recs)]
    order = {"per_class": 0, "bucketed": 1}
    return min(timed, key=lambda r: order.get(r.strategy, 2), default=None)


def timeline_table(run: Run, warmup: int | None, step: int | None = None
                   ) -> tuple[pd.DataFrame, int, float | None]:
    """The buckets of one step (by default the most typical steady step with bucket timings, `typical_step`) and
    when its backward ended: wait() marks it, else the backward time of one micro-batch."""
    if not run.steps:
        raise UserError(f"{run.path}: no step records (steps.jsonl) to pick a step from")
    if step is None:
        timed = {s for s, recs in run.buckets.items() if any(r.get("launch_ms") is not None for r in recs)}
        pool = [s for s in run.steady(warmup) if s["step"] in timed] or [s for s in run.steps if s["step"] in timed]
        if not pool:
            raise UserError(f"{run.path}: no step has bucket launch and completion times to draw (noop, or DDP "
                            "without a comm hook, records none)")
        step = int(typical_step(run, pool)["step"])
    b = run.bucket_frame[run.bucket_frame["step"] == step].sort_values("bucket")
    cols = ["bucket", "class", "bytes", "ready_ms", "launch_ms", "complete_ms", "wait_start_ms", "wait_ms", "part"]
    b = b.reindex(columns=cols).reset_index(drop=True)
    if b["part"].isna().all():
        b = b.drop(columns="part")  # whole buckets only: no parts to name
    end = b["wait_start_ms"].dropna()
    if len(end):
        backward_end = float(end.iloc[0])
    else:
        s = run.step_frame[run.step_frame["step"] == step]
        accum = (run.config.get("train") or {}).get("accum_steps", 1) or 1
        backward_end = float(s["backward_ms"].iloc[0]) / accum if len(s) else None
    return b, step, backward_end


def pareto_front(x: pd.Series, y: pd.Series) -> pd.Series:
    """True where no other point is at least as fast (lower x) and at least as good (higher y), one strictly."""
    on = []
    for i in x.index:
        dominated = any((x[j] <= x[i] and y[j] >= y[i]) and (x[j] < x[i] or y[j] > y[i]) for j in x.index if j != i)
        on.append(not dominated)
    return pd.Series(on, index=x.index, dtype=bool)


def time_to_target(run: Run, target: float) -> float:
    """Seconds of training (the sum of step times, validation and checkpoints left out) until the first
    validation at or below `target` nats per token; NaN if never."""
    val = run.val
    hit = val[val["val_nll"] <= target]
    if hit.empty or not run.steps:
        return float("nan")
    step = int(hit["step"].iloc[0])
    steps = run.step_frame
    return float(steps.loc[steps["step"] <= step, "step_ms"].sum() / 1000)


def quality_table(runs: list[Run], warmup: int | None, target: float | None) -> tuple[pd.DataFrame, float | None]:
    """Communicating runs with a BLEU score: speed, quality and time to a target validation loss (by default the
    loosest target every one of them reached: the worst of their best validation losses)."""
    scored = [r for r in runs if r.communicates and r.bleu is not None]
    if not scored:
        return pd.DataFrame(), target
    bests = [r.val["val_nll"].min() for r in scored if len(r.val)]
    if target is None and bests:
        target = float(max(bests))
    rows = []
    for r in scored:
        m = r.steady_frame(warmup)
        rows.append({"label": r.label, "series": r.series, "step_ms": float(m["step_ms"].median()),
                     # per 1,000 target tokens (rank 0's): comparable across accumulation and batch sizes
                     "tokens_per_step": float(m["tokens"].mean()),
                     "ms_per_ktok": float((m["step_ms"] / m["tokens"] * 1000).median()),
                     "bleu": float(r.bleu["bleu"]), "steps": len(r.steps),
                     "train_s": float(r.step_frame["step_ms"].sum() / 1000),
                     "best_val_nll": float(r.val["val_nll"].min()) if len(r.val) else np.nan,
                     "to_target_s": time_to_target(r, target) if target is not None else np.nan,
                     "split": r.bleu.get("split"), "signature": r.bleu.get("signature")})
    t = pd.DataFrame(rows)
    t["on_front_step"] = pareto_front(t["ms_per_ktok"], t["bleu"])
    reached = t.dropna(subset=["to_target_s"])
    t["on_front_wall"] = False
    if len(reached):
        t.loc[reached.index, "on_front_wall"] = pareto_front(reached["to_target_s"], reached["bleu"])
    return t, target


def busbw_table(bench_paths: list[Path], topology: str | None) -> tuple[pd.DataFrame, str]:
    """Measured rows of the benchmark files, and the cost model's bus bandwidth per protocol (its best algorithm for
    that protocol) for `topology` over the same sizes (8 B to 1 GiB when nothing was measured)."""
    parts = []
    for p in bench_paths:
        d = load_bench(p)
        many = len(bench_paths) > 1
        d["curve"] = [f"{Path(p).stem} {lab}" if many else str(lab) for lab in d["label"]]
        d["kind"] = "measured"
        parts.append(d[["kind", "curve", "size", "busbw"]].dropna())
    described = ""
    if topology:
        model = cm.load_model(topology)
        described = getattr(getattr(model, "topo", None), "describe", lambda: topology)()
        sizes = sorted({int(s) for part in parts for s in part["size"]}) or [2 ** k for k in range(3, 31)]
        best: dict[tuple[str, int], float] = {}  # (protocol, size) → the fastest algorithm's bus bandwidth
        for size in sizes:
            for c in sorted(model.choices(size), key=lambda c: -c.time_us):
                best[(c.proto or c.algo, size)] = c.busbw  # a fitted model's curves are its labels
        rows = [{"kind": "modeled", "curve": f"{topology} {proto}", "size": size, "busbw": bw}
                for (proto, size), bw in best.items()]
        parts.append(pd.DataFrame(rows).sort_values(["curve", "size"], kind="stable"))
    if not parts:
        return pd.DataFrame(columns=["kind", "curve", "size", "busbw"]), described
    return pd.concat(parts, ignore_index=True), described


def network_model(bench_paths: list[Path], topology: str | None):
    """The cost model of the network the runs measured, and how it was chosen: `--topology fit:<file>` as given;
    else a fit of the benchmark measured beside the runs (a sweep's bench.json, or --bench: the same launcher, hence
    the same network: the testbed's emulated links too); else the `--topology` preset, which is not that network;
    else none."""
    if topology and is_fit_spec(topology):
        return cm.load_model(topology), f"fitted to {topology.partition(':')[2]} (--topology)"
    if bench_paths:
        spec = f"fit:{bench_paths[0]}"
        return cm.load_model(spec), f"fitted to the benchmark measured beside the runs ({bench_paths[0]})"
    if topology:
        model = cm.load_model(topology)
        described = getattr(getattr(model, "topo", None), "describe", lambda: topology)()
        return model, f"NCCL's model of the preset {described}: not the network these runs measured"
    return None, ""


def allreduce_size_table(runs: list[Run], model) -> pd.DataFrame:
    """Every recorded bucket with launch and completion times (rank 0's, every step): its bytes and its time
    (complete - launch), and the cost model's all-reduce time over the same range of sizes, per strategy.
    Columns: kind (measured | modeled), strategy, run, step, bucket, class, bytes, time_ms."""
    rows = []
    for r in runs:
        b = r.bucket_frame
        if b.empty or "launch_ms" not in b or "complete_ms" not in b:
            continue
        b = b.dropna(subset=["launch_ms", "complete_ms"])
        for _, x in b.iterrows():
            rows.append({"kind": "measured", "strategy": r.strategy, "run": r.label, "step": int(x["step"]),
                         "bucket": int(x["bucket"]), "class": x["class"], "bytes": int(x["bytes"]),
                         "time_ms": float(x["complete_ms"] - x["launch_ms"])})
    t = pd.DataFrame(rows)
    if t.empty or model is None:
        return t
    lo, hi = max(1.0, t["bytes"].min() / 2), t["bytes"].max() * 2
    sizes = sorted({int(v) for v in np.geomspace(lo, hi, 40)})
    modeled = [{"kind": "modeled", "strategy": s, "bytes": n, "time_ms": model.allreduce_ms(n)}
               for s in t["strategy"].unique() for n in sizes]
    return pd.concat([t, pd.DataFrame(modeled)], ignore_index=True)


# ---------------------------------------------------------------------------------------------------------------
# Sections: a table, a figure and a caption each


def _missing(key: str, title: str, why: str, table: pd.DataFrame | None = None) -> Section:
    return Section(key, title, table=table, note=f"skipped: {why}")


def section_step_vs_bucket(runs: list[Run], summary: pd.DataFrame, warmup: int | None) -> Section:
    key, title = "step_vs_bucket", "Step time versus bucket size, per strategy"
    t = step_vs_bucket_table(summary)
    if t.empty:
        return _missing(key, title, "no run has step records")
    uncapped = ", ".join(n for n in strategies.available()
                         if not strategies.get(n).uses_cap and strategies.get(n).communicates)
    caption = (f"x: bucket size cap (MiB, sync.bucket_cap_mb, log scale); y: step time (ms), median with a whisker "
               f"to the p95, over each run's steady steps ({steady_text(warmup)}). One line per strategy; "
               f"strategies without a cap ({uncapped}) are dashed horizontal lines, and the no-communication baseline "
               f"(dotted, black) is headroom, not a result. Measured on: {machines(runs)}.")
    return Section(key, title, caption, t, plots.step_vs_bucket(t))


def section_busbw(bench: list[Path], topology: str | None, runs: list[Run] = ()) -> Section:
    key, title = "busbw", "Bus bandwidth versus message size: measured and modeled"
    if not bench and not topology:
        return _missing(key, title, "no benchmark file (--bench) and no --topology")
    t, described = busbw_table(bench, topology)
    if t.empty:
        return _missing(key, title, "the benchmark files hold no rows")
    # The benchmark's rows do not say where they ran; one a sweep ran sits beside that sweep's runs.
    beside = [r for r in runs if r.path.parent in {b.parent for b in bench}]
    where = f"measured on: {machines(beside)}" if beside else "machine not recorded in the benchmark file"
    measured = (f"collectives.bench ({', '.join(map(str, bench))}), {where}") if bench else \
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
        return _missing(key, title, "no run recorded per-bucket launch and completion times (buckets.jsonl)")
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
        return _missing(key, title, "no run has per-phase step times")
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
        return _missing(key, title, "no run recorded per-bucket launch and completion times (buckets.jsonl)")
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
        return _missing(key, title, "no communicating run has a BLEU score (eval.jsonl kind 'bleu')")
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


def sections_significance(runs: list[Run], baseline: str | None) -> list[Section]:
    """BLEU with 95% intervals and sacreBLEU's paired bootstrap test against a baseline run (`analysis.significance`),
    and the spread across seeds where a configuration has several. Only when some run kept its translations
    (hyps.<split>.txt): the report of runs never decoded has no such section."""
    key, title = "bleu_significance", "BLEU with 95% confidence intervals, paired against a baseline"
    if not any(significance.has_hypotheses(r) for r in runs):
        return []
    try:
        a = significance.analyse(runs, baseline=baseline, strict=False)
    except significance.NotComparable as e:
        return [_missing(key, title, str(e))]
    out = [Section(key, title, a.caption(), a.paired, display=significance.display_paired(a.paired))]
    if len(a.seeds):
        out.append(Section("bleu_seeds", "BLEU across seeds, per configuration",
                           f"Mean BLEU on split {a.split} over each configuration's seeds, its sample standard "
                           "deviation and range; Δ mean: against the baseline configuration "
                           f"({a.baseline.configuration}); significant seeds: of its runs paired with the baseline "
                           f"configuration's run of the same seed, those with p < {significance.ALPHA}.",
                           a.seeds, display=significance.display_seeds(a.seeds)))
    return out


def build(run_paths: list[str | Path], out: str | Path, bench: list[str | Path] = (), topology: str | None = "h100x8",
          warmup: int | None = None, target: float | None = None, timeline: str | None = None,
          baseline: str | None = None) -> list[Section]:
    """Load the runs, build every section, write figures (PNG, SVG), tables (CSV), report.md and report.html."""
    paths = find_runs(run_paths)
    if not paths:
        raise UserError(f"no run directories in {', '.join(map(str, run_paths))} (a run holds steps.jsonl)")
    runs = [load_run(p, strict=False) for p in paths]
    _unique_labels(runs)
    # A sweep that ran the benchmark left bench.json in its folder: used unless --bench names files.
    found = [Path(p) / "bench.json" for p in run_paths if (Path(p) / "bench.json").is_file()]
    bench = [Path(b) for b in bench] or found
    for b in bench:
        if not b.is_file():
            raise UserError(f"--bench {b}: no such file")
    summary = summary_table(runs, warmup)
    sections = [section_step_vs_bucket(runs, summary, warmup), section_busbw(bench, topology, runs),
                section_allreduce_size(runs, bench, topology), section_breakdown(runs, warmup),
                section_timeline(runs, warmup, timeline), section_pareto(runs, warmup, target),
                *sections_significance(runs, baseline)]
    write(Path(out), runs, summary, sections)
    return sections


def _unique_labels(runs: list[Run]) -> None:
    """Short legend labels: the directory names, less the "<profile>-" prefix they all share; runs from different
    sweeps that share a name get their parent's name in front."""
    names = [r.label for r in runs]
    for r in runs:
        if names.count(r.label) > 1:
            r.label = f"{r.path.parent.name}/{r.path.name}"
    profiles = {r.config.get("name") for r in runs}  # a sweep names its runs "<profile name>-<settings>"
    prefix = f"{profiles.pop()}-" if len(profiles) == 1 else None
    if prefix and all(r.label.startswith(prefix) and r.label != prefix for r in runs):
        for r in runs:
            r.label = r.label[len(prefix):]


# ---------------------------------------------------------------------------------------------------------------
# Writing


def _fmt(v) -> str:
    if isinstance(v, (float, np.floating)):
        return "" if np.isnan(v) else f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def markdown_table(df: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(_fmt(v).replace("|", "/") for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


SUMMARY_COLUMNS = ["run", "strategy", "bucket_cap_mb", "headroom", "measured_steps", "median_ms", "p95_ms",
                   "exposed_ms", "train_s", "val_nll", "bleu"]


def write(out: Path, runs: list[Run], summary: pd.DataFrame, sections: list[Section]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary.to_csv(out / "summary.csv", index=False)
    for s in sections:
        if s.table is not None and not s.table.empty:
            s.table.to_csv(out / f"{s.key}.csv", index=False)
        if s.figure is not None:
            s.figure.savefig(out / f"{s.key}.png", dpi=130)
            s.figure.savefig(out / f"{s.key}.svg")
    failed = [f"{r.label} (exit {r.launch.get('exit_code')}: {r.launch.get('error') or '?'})" for r in runs
              if r.launch.get("exit_code") not in (None, 0)]
    intro = (f"{len(runs)} run(s) from {', '.join(sorted({str(r.path.parent) for r in runs}))}. "
             f"Machines: {machines(runs)}." + (f" Failed runs: {'; '.join(failed)}." if failed
                                              else ""))
    table = summary[SUMMARY_COLUMNS]
    md = ["# dtrain trade-off report", "", intro, "", "## Runs", "", markdown_table(table), "",
          "Times in ms (median and p95 over the measured steps), train_s in s (sum of step times), val_nll in nats "
          "per target token, bleu from sacreBLEU; headroom = the no-communication baseline. Table: summary.csv.", ""]
    page = [f"<h1>dtrain trade-off report</h1><p>{html.escape(intro)}</p><h2>Runs</h2>",
            table.to_html(index=False, na_rep="", float_format=lambda v: _fmt(v), border=0, classes="runs")]
    for s in sections:
        md += [f"## {s.title}", ""]
        page.append(f"<h2>{html.escape(s.title)}</h2>")
        if s.display is not None:
            md += [markdown_table(s.display), "", f"{s.caption} Table: [{s.key}.csv]({s.key}.csv).", ""]
            page += [s.display.to_html(index=False, border=0, classes="runs"),
                     f"<p>{html.escape(s.caption)} Table: <a href=\"{s.key}.csv\">{s.key}.csv</a>.</p>"]
            continue
        if s.figure is None:
            md += [f"*{s.note}*", ""]
            page.append(f"<p><em>{html.escape(s.note)}</em></p>")
            continue
        md += [f"![{s.title}]({s.key}.png)", "", f"{s.caption} Figure: [{s.key}.svg]({s.key}.svg); "
               f"table: [{s.key}.csv]({s.key}.csv).", ""]
        page.append(f'<figure><img src="{s.key}.svg" alt="{html.escape(s.title)}"><figcaption>'
                    f"{html.escape(s.caption)} Table: <a href=\"{s.key}.csv\">{s.key}.csv</a>.</figcaption></figure>")
    (out / "report.md").write_text("\n".join(md))
    (out / "report.html").write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>dtrain trade-off report</title><style>"
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto;line-height:1.4}"
        "img{max-width:100%}figcaption{font-size:90%;color:#333}table.runs{border-collapse:collapse;font-size:85%}"
        "table.runs td,table.runs th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}"
        "</style></head><body>" + "\n".join(page) + "</body></html>\n")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=PROG, description="Tables, figures, Markdown and HTML from recorded runs.")
    ap.add_argument("runs", nargs="+", help="run directories, or folders of them (a sweep's output)")
    ap.add_argument("--out", required=True, help="directory for report.md, report.html, PNG/SVG figures and CSVs")
    ap.add_argument("--bench", action="append", default=[], metavar="FILE",
                    help="collectives.bench --json/--csv output (or an nccl-tests log) for the bandwidth figure")
    ap.add_argument("--topology", default="h100x8",
                    help="cost-model topology for the modeled curves (h100x8, a100x8-ib:2, fit:fit.json ...; "
                         "'none' to leave them out; default h100x8). The all-reduce-time figure models the runs' "
                         "own network: a fit:/local: topology, else a fit of the benchmark beside the runs")
    ap.add_argument("--warmup", type=int, help="first steps of each run left out of timings (default: max(3, "
                                                "10%%) of its steps, the warm-up rule of analysis.runs)")
    ap.add_argument("--target-val-nll", type=float,
                    help="validation loss for the time-to-target axis (default: the worst run's best)")
    ap.add_argument("--timeline", help="run (directory name) whose bucket timeline is drawn (default: first "
                                       "per_class, else bucketed run)")
    ap.add_argument("--baseline", help="run (directory name) the BLEU significance table compares with (default: "
                                       "the first ddp run, else the first run with hypotheses)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with exit_on_user_error(PROG):
        if args.warmup is not None and args.warmup < 0:
            raise UserError("--warmup must be 0 or positive")
        topology = None if args.topology in ("none", "") else args.topology
        output_dir(args.out, "--out")  # before the work, not after it
        sections = build(args.runs, args.out, args.bench, topology, args.warmup, args.target_val_nll, args.timeline,
                         args.baseline)
    for s in sections:
        print(f"{s.key:<16} {'written' if s.figure is not None or s.display is not None else s.note}")
    print(f"report: {Path(args.out) / 'report.md'}, {Path(args.out) / 'report.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
