"""The trade-off report: every run's records (and benchmark rows) → tables, figures, Markdown and HTML.

Last stage of the pipeline. Each figure is built from a table that is written beside it as CSV, and captioned with
its axes, units and the machine it was measured on (run.json). Runs of the no-communication baseline appear in timing
figures as headroom and never in quality figures (the training-loss and validation curves against step among them).
A figure whose data is missing is skipped with a note. Runs that kept their translations (hyps.<split>.txt) also get
a table of BLEU with 95% confidence intervals and paired significance against a baseline run
(`dtrain.analysis.significance`); runs that tuned their own communication (`sync.strategy: auto`) get their search,
from tuning.csv (`dtrain.analysis.report.tuning`).

The tables are built in `dtrain.analysis.report.tables`, captioned and drawn in `dtrain.analysis.report.sections`; this module
puts the sections in order and writes them.

    python -m dtrain.analysis.report runs/sweep-lossless-buckets --out reports/lossless
    python -m dtrain.analysis.report runs/sweep-bleu-cost --bench runs/bench.json --topology h100x8-ib:2 --out reports/bleu
"""

from __future__ import annotations

import argparse
import html
from pathlib import Path

import pandas as pd

from dtrain.analysis.report.sections import (Section, fmt, machines, section_allreduce_size, section_breakdown,
                                      section_busbw, section_pareto, section_step_vs_bucket, section_timeline,
                                      sections_curves, sections_significance)
from dtrain.analysis.report.scaling import parse_spec, section_scaling
from dtrain.analysis.report.tables import summary_table
from dtrain.analysis.report.tuning import sections_tuning
from dtrain.analysis.runs import Run, find_runs, load_run
from dtrain.common.errors import UserError, exit_on_user_error
from dtrain.common.files import output_dir

PROG = "dtrain.analysis.report"


def build(run_paths: list[str | Path], out: str | Path, bench: list[str | Path] = (), topology: str | None = "h100x8",
          warmup: int | None = None, target: float | None = None, timeline: str | None = None,
          baseline: str | None = None, scaling: list[str] = ()) -> list[Section]:
    """Load the runs, build every section, write figures (PNG, SVG), tables (CSV), report.md and report.html.
    `scaling`: 'NxR=FILE' per shape, FILE the simulator's JSON for that shape (`dtrain.analysis.report.scaling`)."""
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
                *sections_curves(runs), *sections_significance(runs, baseline), *sections_tuning(runs)]
    if scaling:
        sections.append(section_scaling(list(scaling)))
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


def markdown_table(df: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(fmt(v).replace("|", "/") for v in row) + " |" for row in df.itertuples(index=False)]
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
            table.to_html(index=False, na_rep="", float_format=lambda v: fmt(v), border=0, classes="runs")]
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
                    help="dtrain.collectives.bench --json/--csv output (or an nccl-tests log) for the bandwidth figure")
    ap.add_argument("--topology", default="h100x8",
                    help="cost-model topology for the modeled curves (h100x8, a100x8-ib:2, fit:fit.json ...; "
                         "'none' to leave them out; default h100x8). The all-reduce-time figure models the runs' "
                         "own network: a fit:/local: topology, else a fit of the benchmark beside the runs")
    ap.add_argument("--warmup", type=int, help="first steps of each run left out of timings (default: max(3, "
                                                "10%%) of its steps, the warm-up rule of dtrain.analysis.runs)")
    ap.add_argument("--target-val-nll", type=float,
                    help="validation loss for the time-to-target axis (default: the worst run's best)")
    ap.add_argument("--timeline", help="run (directory name) whose bucket timeline is drawn (default: first "
                                       "per_class, else bucketed run)")
    ap.add_argument("--baseline", help="run (directory name) the BLEU significance table compares with (default: "
                                       "the first ddp run, else the first run with hypotheses)")
    ap.add_argument("--scaling", action="append", default=[], metavar="NxR=FILE",
                    help="a shape's simulator JSON (python -m dtrain.analysis.simulate ... --measured ... --json), "
                         "e.g. 2x2=sim-2x2.json; repeat per shape for the figure of step time against the shape")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with exit_on_user_error(PROG):
        if args.warmup is not None and args.warmup < 0:
            raise UserError("--warmup must be 0 or positive")
        topology = None if args.topology in ("none", "") else args.topology
        for spec in args.scaling:  # before the work, not after it
            _, _, _, path = parse_spec(spec)
            if not path.is_file():
                raise UserError(f"--scaling {spec}: no such file")
        output_dir(args.out, "--out")
        sections = build(args.runs, args.out, args.bench, topology, args.warmup, args.target_val_nll, args.timeline,
                         args.baseline, args.scaling)
    for s in sections:
        print(f"{s.key:<16} {'written' if s.figure is not None or s.display is not None else s.note}")
    print(f"report: {Path(args.out) / 'report.md'}, {Path(args.out) / 'report.html'}")
    return 0
