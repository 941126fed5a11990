"""Measured comparison of gradient synchronization strategies: one torchrun training run per strategy, same profile,
seed and batches, then one table; and a bucket-size sweep of `bucketed` (CSV + PNG of step time vs bucket size).

Sits after the records: it reads each run (`dtrain.analysis.runs`: its steady steps, warm-up and skipped updates left out)
and prints median and p95 step time, exposed communication, bytes and collectives per step, and the step-time ratio
to `ddp`.

    python -m dtrain.analysis.compare --profile dtrain/profiles/multi30k-cpu.yaml --nproc 2 --steps 40 \\
        --strategies ddp,per_tensor,flat,bucketed,per_class,noop --set data.max_tokens=500
    python -m dtrain.analysis.compare --profile dtrain/profiles/multi30k-cpu.yaml --nproc 2 --steps 40 --strategies ddp,noop \\
        --bucket-mb 0.25,1,4,16,64 --set data.max_tokens=500 --out runs/sweep
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dtrain.analysis.runs import load_run, warmup_steps
from dtrain.collectives.strategies import available
from dtrain.common import rundir
from dtrain.common.errors import UserError, exit_on_user_error
from dtrain.engine import config as config_mod

PROG = "dtrain.analysis.compare"
DEFAULT_STRATEGIES = "ddp,per_tensor,flat,bucketed,per_class,noop"
# Every run trains the same steps and nothing else: no wall-clock stop, no mid-run validation, checkpoint, decode.
RUN_OVERRIDES = ("train.max_minutes=null", "train.val_every=0", "eval.at_end=false", "train.average_last=1")


@dataclass
class Summary:
    """One run's measurements over its steady steps (times in ms)."""

    label: str
    strategy: str
    bucket_mb: float | None
    steps: int  # measured steps
    median_ms: float
    p95_ms: float
    backward_ms: float  # median; DDP waits for its buckets inside backward
    exposed_ms: float  # median time in wait(): communication the optimizer waited for
    bytes_per_step: float
    collectives_per_step: float
    lossless: bool | None
    communicates: bool | None
    ratio_to_ddp: float | None = None


def summarize(run_dirs: list[Path], label: str, warmup: int | None, bucket_mb: float | None = None) -> Summary:
    """The steady steps of one or more runs of the same job (rounds), pooled; `warmup` overrides the warm-up rule."""
    steps, counts, nbytes, sync = [], [], [], {}
    for run in (load_run(d, strict=False) for d in run_dirs):
        kept = run.steady(warmup)
        if not kept:
            raise UserError(f"{run.path}: no steps after the {warmup_steps(len(run.steps), warmup)} warm-up steps "
                            "(raise --steps or lower --warmup)")
        sync = run.sync
        per_step = [run.buckets.get(s["step"], []) for s in kept]
        counts += [len(recs) for recs in per_step]
        nbytes += [sum(r["bytes"] for r in recs) for recs in per_step]
        steps += kept
    step_ms = np.array([s["step_ms"] for s in steps])
    return Summary(label, sync.get("strategy", label), bucket_mb, len(steps), float(np.median(step_ms)),
                   float(np.percentile(step_ms, 95)), float(np.median([s["backward_ms"] for s in steps])),
                   float(np.median([s["comm_exposed_ms"] for s in steps])), float(np.median(nbytes)),
                   float(np.median(counts)), sync.get("lossless"), sync.get("communicates"))


def with_ratios(rows: list[Summary]) -> list[Summary]:
    base = next((r for r in rows if r.label == "ddp"), None)
    for r in rows:
        r.ratio_to_ddp = None if base is None else r.median_ms / base.median_ms
    return rows


def table(rows: list[Summary]) -> list[str]:
    lines = [f"{'strategy':<16} {'steps':>5} {'median ms':>9} {'p95 ms':>8} {'bwd ms':>8} {'exposed ms':>10} "
             f"{'MB/step':>8} {'colls/step':>10} {'vs ddp':>7}  note"]
    for r in rows:
        note = ("no communication: headroom only" if r.communicates is False
                else "lossy" if r.lossless is False else "")
        if r.strategy == "ddp":
            note = "waits inside backward: exposed time is in bwd ms"
        ratio = "-" if r.ratio_to_ddp is None else f"{r.ratio_to_ddp:.3f}"
        lines.append(f"{r.label:<16} {r.steps:>5} {r.median_ms:>9.1f} {r.p95_ms:>8.1f} {r.backward_ms:>8.1f} "
                     f"{r.exposed_ms:>10.2f} {r.bytes_per_step / 1e6:>8.2f} {r.collectives_per_step:>10.0f} "
                     f"{ratio:>7}  {note}")
    return lines


def write_csv(rows: list[Summary], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


def plot_sweep(rows: list[Summary], refs: list[Summary], path: Path, title: str) -> None:
    """Median step time (p95 as the bar's top) versus bucket size, with ddp and noop (when run) as lines."""
    import matplotlib  # heavy, and only the bucket sweep draws a figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r.bucket_mb)
    x = [r.bucket_mb for r in rows]
    med = np.array([r.median_ms for r in rows])
    p95 = np.array([r.p95_ms for r in rows])
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.errorbar(x, med, yerr=[np.zeros_like(med), p95 - med], marker="o", capsize=3, label="bucketed (median, p95)")
    refs = [r for r in refs if r.label in ("ddp", "noop")]  # the baseline and the headroom
    for r, style in zip(refs, ("--", ":")):
        ax.axhline(r.median_ms, linestyle=style, color="gray", linewidth=1)
        ax.annotate(f"{r.label} {r.median_ms:.0f} ms", (x[0], r.median_ms), textcoords="offset points", xytext=(0, 3),
                    fontsize=8, color="dimgray")
    ax.set_xscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{v:g}" for v in x])
    ax.set_xlabel("bucket size (MiB, sync.bucket_cap_mb)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# Running


@dataclass
class Job:
    label: str
    strategy: str
    bucket_mb: float | None = None

    def overrides(self) -> list[str]:
        out = [f"sync.strategy={self.strategy}"]
        if self.bucket_mb is not None:
            out.append(f"sync.bucket_cap_mb={self.bucket_mb:g}")
        return out


def jobs_for(strategies: list[str], bucket_mbs: list[float]) -> list[Job]:
    jobs = [Job(s, s) for s in strategies]
    jobs += [Job(f"bucketed@{mb:g}MB", "bucketed", mb) for mb in bucket_mbs]
    return jobs


def torchrun_command(profile: str, nproc: int, run_dir: Path, overrides: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "dtrain.engine.train", "--profile", profile, "--run-dir", str(run_dir)]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def run_job(job: Job, args, out: Path, common: list[str], round_: int = 1) -> Path:
    run_dir = out / (job.label if round_ == 1 else f"{job.label}.r{round_}")
    steps = rundir.read_steps(run_dir)
    if args.reuse and len(steps) >= args.steps:
        return run_dir
    if run_dir.exists():
        raise UserError(f"{run_dir}: exists already; choose another --out, or pass --reuse to keep finished runs")
    cmd = torchrun_command(args.profile, args.nproc, run_dir, common + job.overrides())
    log = run_dir.with_name(run_dir.name + ".log")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0:
        tail = log.read_text().splitlines()[-5:]
        raise UserError(f"run '{job.label}' failed (exit {r.returncode}); log {log}: " + " | ".join(tail))
    print(f"# {run_dir.name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return run_dir


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=PROG, description="Run each strategy under torchrun on the same batches and "
                                 "compare step times; optionally sweep bucketed's bucket size.")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    ap.add_argument("--warmup", type=int, help="first steps left out of the statistics (default: max(3, 10%%) of "
                                                "--steps, the warm-up rule of dtrain.analysis.runs)")
    ap.add_argument("--strategies", default=DEFAULT_STRATEGIES, help=f"comma-separated (default {DEFAULT_STRATEGIES})")
    ap.add_argument("--bucket-mb", default="", help="bucketed sweep over these sync.bucket_cap_mb, e.g. 0.25,1,4,16,64")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="profile override for every run, e.g. data.max_tokens=500")
    ap.add_argument("--out", help="directory for the runs, logs, CSV and PNG (default runs/compare-<time>)")
    ap.add_argument("--rounds", type=int, default=1, help="run every job this many times, interleaved, and pool "
                                                           "the steps (default 1)")
    ap.add_argument("--reuse", action="store_true", help="keep runs in --out that already have --steps steps")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with exit_on_user_error(PROG):
        strategies = [s for s in args.strategies.split(",") if s]
        for s in strategies:
            if s not in available():
                raise UserError(f"--strategies: unknown strategy '{s}' (available: {', '.join(available())})")
        try:
            bucket_mbs = [float(v) for v in args.bucket_mb.split(",") if v]
        except ValueError:
            raise UserError(f"--bucket-mb '{args.bucket_mb}': expected numbers, e.g. 0.25,1,4") from None
        if any(v <= 0 for v in bucket_mbs):
            raise UserError("--bucket-mb: sizes must be positive")
        if args.rounds < 1 or args.nproc < 1:
            raise UserError("--rounds and --nproc must be positive")
        warmup = warmup_steps(args.steps, args.warmup)
        if args.warmup is not None and args.warmup < 0:
            raise UserError("--warmup must be 0 or positive")
        if args.steps <= warmup:
            raise UserError(f"--steps ({args.steps}) must exceed --warmup ({warmup})")
        if not strategies and not bucket_mbs:
            raise UserError("nothing to run: give --strategies and/or --bucket-mb")
        common = list(args.overrides) + list(RUN_OVERRIDES) + [f"train.max_steps={args.steps}",
                                                               f"train.ckpt_every={args.steps}"]
        config_mod.load(args.profile, common)  # a bad profile or override fails here, once
        out = Path(args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
        out.mkdir(parents=True, exist_ok=True)
        load_before = os.getloadavg()
        jobs = jobs_for(strategies, bucket_mbs)
        dirs: dict[str, list[Path]] = {job.label: [] for job in jobs}
        for round_ in range(1, args.rounds + 1):  # rounds interleave the jobs, so drift in load hits all alike
            for job in jobs:
                dirs[job.label].append(run_job(job, args, out, common, round_))
        summaries = [summarize(dirs[job.label], job.label, args.warmup, job.bucket_mb) for job in jobs]
        load_after = os.getloadavg()
    with_ratios(summaries)
    sets = " ".join(f"--set {o}" for o in args.overrides)
    head = (f"# {args.profile} {sets} | {args.nproc} ranks, {args.steps} steps x {args.rounds} round(s), first "
            f"{warmup} of each left out, same seed and batches | {platform.node()} {os.cpu_count()} CPUs, "
            f"load {load_before[0]:.2f} before, {load_after[0]:.2f} after | runs in {out}")
    main_rows = [s for s in summaries if s.bucket_mb is None]
    sweep_rows = [s for s in summaries if s.bucket_mb is not None]
    print(head)
    for line in table(summaries):
        print(line)
    if main_rows:
        write_csv(main_rows, out / "compare.csv")
    if sweep_rows:
        write_csv(sweep_rows, out / "sweep.csv")
        plot_sweep(sweep_rows, main_rows, out / "sweep.png",
                   ", ".join([Path(args.profile).stem, *args.overrides, f"{args.nproc} ranks"]))
        print(f"# sweep: {out / 'sweep.csv'}, {out / 'sweep.png'}")
    (out / "compare.txt").write_text("\n".join([head] + table(summaries)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
